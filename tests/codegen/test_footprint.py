"""The least memory a local launch holds, and the refusal of one this machine cannot hold."""

import runpy
from pathlib import Path

import pytest

from coconet.codegen.footprint import least_bytes, machine_bytes, require_fits
from coconet.errors import SizeError

ROOT = Path(__file__).parents[2]


def example(name):
    return runpy.run_path(str(ROOT / "examples" / f"{name}.py"))["program"].ir


def test_each_rank_holds_its_pieces_and_the_check_its_float64_reference():
    adam = example("adam")  # g Local; w, m, v Replicated; all float32
    n, world = 1000, 3
    ranks = 4 * n * 4 * world  # every rank holds all four whole
    reference = 8 * n * (world + 3)  # g once per simulated rank, the rest once
    assert least_bytes(adam, {"N": n}, world, check=False) == ranks
    assert least_bytes(adam, {"N": n}, world, check=True) == ranks + reference
    mlp = example("megatron_mlp")
    sizes, world = {"B": 2, "S": 3, "H": 4}, 2
    b, s, h = 2, 3, 4
    sliced = b * s * 4 * h + 4 * h * h  # x Sliced(last), w Sliced(0): the ranks' pieces add up to one whole
    whole = h + b * s * h  # bias and residual: on every rank
    assert least_bytes(mlp, sizes, world, check=False) == 4 * (sliced + whole * world)


def test_a_launch_that_cannot_fit_is_refused_naming_sizes_and_memory():
    adam = example("adam")
    require_fits(adam, {"N": 1000}, 2, check=True, available=10**6)
    with pytest.raises(
        SizeError,
        match=r"at N=1000 the inputs of adam on 2 rank\(s\) take at least 70.3 KiB with "
        r"the reference check's float64 copies; this machine has 48.8 KiB of memory",
    ):
        require_fits(adam, {"N": 1000}, 2, check=True, available=50_000)
    assert machine_bytes() > 2**20
