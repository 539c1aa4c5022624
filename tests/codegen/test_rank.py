import os
import platform
import subprocess
import sys

import pytest

from coconet.codegen.rank import ALLOCATOR, allocator_policy

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the policy is glibc's mallopt")

FAULTS = """
import resource, sys, torch
from coconet.codegen.rank import keep_freed_memory
if sys.argv[1] == "keep":
    keep_freed_memory()
counts = []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.empty(2 ** 24)  # 64 MiB, as an eager step's temporary
    x.fill_(1.0)
    del x
    counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(max(counts[1:]))
"""


def _faults(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    proc = subprocess.run([sys.executable, "-c", FAULTS, mode], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout)


@glibc
def test_ranks_keep_freed_memory_so_a_steps_temporaries_fault_in_once():
    pages = 2 ** 26 // 4096
    assert _faults("default") >= pages // 2  # glibc unmaps the block at every free: every page faults again
    assert _faults("keep") < pages // 20


@glibc
def test_the_users_malloc_settings_win(monkeypatch):
    for k in [k for k in os.environ if k.startswith("MALLOC_")]:
        monkeypatch.delenv(k)
    assert allocator_policy() == ALLOCATOR
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    assert allocator_policy() != ALLOCATOR and "MALLOC_" in allocator_policy()
