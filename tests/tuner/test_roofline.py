import runpy
from pathlib import Path

import pytest

from coconet.tuner.bandwidth import memory_bandwidth
from coconet.tuner.roofline import bytes_moved_once, compute_floor, matmul_flops_per_rank, matmul_rate

ROOT = Path(__file__).parents[2]


def example(name):
    return runpy.run_path(str(ROOT / "examples" / f"{name}.py"))["program"].ir


def test_bytes_moved_once():
    n, f32 = 1000, 4
    adam = example("adam")
    # every rank's gradient read, w, m, v read once; each rank keeps its own whole w, m, v: written on all 4
    assert bytes_moved_once(adam, {"N": n}, 4) == (4 + 3 + 3 * 4) * n * f32
    # the state a schedule may leave sharded is written once, each rank its rows
    assert bytes_moved_once(adam, {"N": n}, 4, {"m", "v"}) == (4 + 3 + 4 + 2) * n * f32
    assert bytes_moved_once(adam, {"N": n}, 4, {"w", "m", "v"}) == (4 + 3 + 3) * n * f32
    assert bytes_moved_once(adam, {"N": n}, 1) == (1 + 3 + 3) * n * f32
    # x (B, S, 4H), w (4H, H), b, r read once; the replicated out written on both ranks (all float32)
    B, S, H = 2, 3, 5
    want = 4 * (B * S * 4 * H + 4 * H * H + H + B * S * H + 2 * B * S * H)
    assert bytes_moved_once(example("megatron_mlp"), {"B": B, "S": S, "H": H}, 2) == want


def test_matmul_flops_per_rank():
    # Megatron's row-parallel matmul: (B*S, 4H/R) x (4H/R, H) on each rank, the first rank's share the larger
    B, S, H = 2, 3, 5
    sizes = {"B": B, "S": S, "H": H}
    assert matmul_flops_per_rank(example("megatron_mlp"), sizes, 2) == 2 * B * S * H * 10
    assert matmul_flops_per_rank(example("megatron_mlp"), sizes, 3) == 2 * B * S * H * 7
    assert matmul_flops_per_rank(example("adam"), {"N": 1000}, 2) == 0


def test_matmul_flops_of_a_column_parallel_product_are_the_ranks_columns():
    # x (B, S, H) @ w1 (H, F) with w1 Sliced(1): rank 0 computes ceil(F/R) of the F columns over all of H,
    # then its (B, S, F/R) @ (F/R, H) row-parallel partial sum
    from coconet import Program, Replicated, Sliced, allreduce, matmul

    p = Program("column_then_row", dims=("B", "S", "H", "F"))
    x = p.tensor("x", ("B", "S", "H"), layout=Replicated)
    w1 = p.tensor("w1", ("H", "F"), layout=Sliced(1))
    w2 = p.tensor("w2", ("F", "H"), layout=Sliced(0))
    p.output("y", allreduce(matmul(matmul(x, w1), w2)))
    B, S, H, F = 2, 3, 5, 7
    for world, cols in ((1, 7), (2, 4), (3, 3), (4, 2)):
        assert matmul_flops_per_rank(p.ir, {"B": B, "S": S, "H": H, "F": F}, world) == 2 * B * S * cols * H * 2


def test_compute_floor_shares_the_cores():
    prog, sizes = example("megatron_mlp"), {"B": 4, "S": 8, "H": 16}
    flops = matmul_flops_per_rank(prog, sizes, 2)
    # two ranks of one thread on two cores: in parallel, each its own flops
    assert compute_floor(prog, sizes, 2, rate_per_thread=1e9, cpus=2, threads=1) == flops / 1e9
    # four ranks on two cores: every rank's flops through two cores
    flops4 = matmul_flops_per_rank(prog, sizes, 4)
    assert compute_floor(prog, sizes, 4, rate_per_thread=1e9, cpus=2, threads=1) == flops4 * 4 / 2e9
    assert compute_floor(example("adam"), {"N": 1000}, 2, rate_per_thread=1e9, cpus=2, threads=1) == 0.0


def test_matmul_rate_is_a_rate():
    assert matmul_rate(1, m=64, k=64, n=64, repeats=2) > 1e7


@pytest.mark.gpu
def test_cuda_rates_are_the_devices():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    # far above what host memory or host cores give: the floor of a CUDA run is the GPU's
    assert memory_bandwidth(nbytes=2**29, repeats=3, device="cuda") > 2e11
    assert matmul_rate(m=2048, k=2048, n=2048, repeats=3, device="cuda") > 1e12
