import os
import platform
import subprocess
import sys

import pytest

from coconet.tuner.rank import ALLOCATOR, allocator_policy

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the policy is glibc's mallopt")

FAULTS = """
import resource, sys, torch
from coconet.tuner.rank import keep_freed_memory
if sys.argv[1] == "keep":
    keep_freed_memory()
torch.set_num_threads(1)
w, m, v, g = (torch.rand(2 ** 24) for _ in range(4))  # 64 MiB each
counts = []
for _ in range(8):  # an eager Adam step: every temporary a fresh 64 MiB tensor
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    m1 = 0.9 * m + 0.1 * g
    v1 = 0.999 * v + 0.001 * g * g
    w1 = w - 0.001 * m1 / (torch.sqrt(v1) + 1e-8)
    m.copy_(m1); v.copy_(v1); w.copy_(w1)
    del m1, v1, w1
    counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
# once the heap holds enough freed blocks (it may take a few steps to grow) a step faults nothing in; now and
# then a later one still extends the heap by a temporary where the address space around it is laid out so
print(min(counts[-3:]))
"""


def _faults(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    proc = subprocess.run([sys.executable, "-c", FAULTS, mode], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout)


@glibc
def test_ranks_keep_freed_memory_so_steady_steps_fault_no_temporaries_in():
    pages = 2**26 // 4096  # of one temporary
    assert _faults("default") >= 5 * pages  # glibc unmaps each at its free: every page faults again, every step
    # (the fewest faults of the last three steps: by default not one of them goes without)
    assert _faults("keep") < pages // 10


@glibc
def test_the_users_malloc_settings_win(monkeypatch):
    for k in [k for k in os.environ if k.startswith("MALLOC_")]:
        monkeypatch.delenv(k)
    assert allocator_policy() == ALLOCATOR
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    assert allocator_policy() != ALLOCATOR and "MALLOC_" in allocator_policy()
