import runpy
from pathlib import Path

from coconet.tuner.roofline import bytes_moved_once, memory_bandwidth

ROOT = Path(__file__).parents[2]


def example(name):
    return runpy.run_path(str(ROOT / "examples" / f"{name}.py"))["program"].ir


def test_bytes_moved_once():
    # every rank's gradient read once; w, m, v read and written once
    assert bytes_moved_once(example("adam"), {"N": 1000}, 4) == 4 * 1000 * 4 + 6 * 1000 * 4
    # x (B, S, 4H), w (4H, H), b, r read; out written (all float32)
    B, S, H = 2, 3, 5
    want = 4 * (B * S * 4 * H + 4 * H * H + H + B * S * H + B * S * H)
    assert bytes_moved_once(example("megatron_mlp"), {"B": B, "S": S, "H": H}, 2) == want


def test_memory_bandwidth_is_a_rate():
    assert memory_bandwidth(nbytes=2**22, repeats=2) > 1e8
