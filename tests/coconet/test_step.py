"""coconet.compile: the step object's schedule choice, layouts and the checks of its inputs."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import coconet
from coconet.errors import CoconetError, InputError
from coconet.loader import examples_dir, load_file
from coconet.schedules.space import generate
from coconet.schedules.types import Sliced
from coconet.step import input_specs, rows
from tests.coconet.ranks import run

ZERO1 = "split(ar0); reorder(ag0); as_slice(m); as_slice(v); fuse_collective(rs0)"
HYPER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "t": 1}
N = 1001


def _sliced_schedules(name):
    prog = load_file(examples_dir() / f"{name}.py")
    return prog, [s for s in generate(prog) if any(isinstance(x.type.layout, Sliced) for x in s.scheduled.inputs)]


@pytest.mark.parametrize("backend", ["gloo", "shm", "nccl"])
@pytest.mark.parametrize("kernels", ["compiled", "eager"])
@pytest.mark.parametrize("name", ["adam", "lamb", "sgd"])
def test_whole_state_given_to_a_schedule_that_slices_it_is_refused(name, backend, kernels):
    """Every schedule that keeps an input sliced, handed the whole tensor (a whole-state schedule's checkpoint),
    raises naming the input, what it got and the rows it wants, on every rank but the first and the first alike,
    before any collective: under compiled kernels it used to update rank 1's rows of w with rank 0's rows of
    the moments. Handed this rank's rows, the same call passes."""
    prog, schedules = _sliced_schedules(name)
    assert schedules
    for sched in schedules:
        for rank in (0, 1, 2):
            step = coconet.compile(
                prog, {"N": N}, schedule=sched.text, world=3, rank=rank, backend=backend, kernels=kernels
            )
            whole = {n: torch.empty(N, device="meta") for n in step.inputs}
            right = {n: torch.empty(s.shape, device="meta") for n, s in step.inputs.items()}
            scalars = {s: 1.0 for s in step.scalars}
            step.device_type = "meta"  # shapes checked without memory: the check reads shapes, dtypes, devices
            with pytest.raises(InputError) as err:
                step(whole, scalars)
            first = step.sliced[0]
            lo, hi = step.inputs[first].rows
            assert err.value.input == first and f"given float32 [{N}]" in str(err.value)
            assert f"this rank's rows {lo}:{hi} of {N}" in str(err.value) and "sliced" in str(err.value)
            step.check(right, scalars)


def _whole_moments(rank, world, backend, kernels):
    """ZeRO-1 on real ranks, handed whole moments: each rank raises before its first collective."""
    step = coconet.compile("examples/adam.py", {"N": N}, schedule=ZERO1, backend=backend, kernels=kernels)
    tensors = {n: torch.zeros(N) for n in ("g", "w", "m", "v")}
    try:
        step(tensors, HYPER)
    except InputError as e:
        return e.input, step.layouts["m"], step.inputs["m"].rows
    return None


@pytest.mark.parametrize("backend, kernels", [("gloo", "compiled"), ("shm", "compiled"), ("shm", "eager")])
def test_ranks_refuse_whole_moments_under_zero1(backend, kernels):
    got = run(_whole_moments, 2, backend, kernels)
    assert [g[0] for g in got] == ["m", "m"]
    assert got[1][1] == Sliced(0) and got[0][2] == (0, 501) and got[1][2] == (501, 1001)


def _step(**kw):
    return coconet.compile("examples/adam.py", {"N": N}, schedule=ZERO1, world=2, rank=1, kernels="eager", **kw)


def test_layouts_and_describe_say_what_is_whole_and_what_is_this_ranks_rows():
    step = _step()
    assert {n: str(v) for n, v in step.layouts.items()} == {
        "g": "Local",
        "w": "Replicated",
        "m": "Sliced(0)",
        "v": "Sliced(0)",
    }
    assert step.sliced == ("m", "v") and step.inputs["m"].shape == (500,) and step.inputs["w"].shape == (N,)
    text = step.describe()
    assert "m: Sliced(0), float32[500]: this rank's rows 501:1001 of 1001" in text
    assert "w: Replicated, float32[1001]: whole" in text and "given by the caller" in text
    assert "def step(" in step.source


def test_each_input_is_checked_once_per_tensor_and_again_when_it_changes(monkeypatch):
    step = _step()
    calls = []
    real = step._check_tensor
    monkeypatch.setattr(step, "_check_tensor", lambda spec, t: (calls.append(spec.name), real(spec, t)))
    tensors = {"g": torch.zeros(N), "w": torch.zeros(N), "m": torch.zeros(500), "v": torch.zeros(500)}
    for _ in range(5):
        step.check(tensors, HYPER)
    assert sorted(calls) == ["g", "m", "v", "w"]
    tensors["m"].data = torch.zeros(N)  # the same tensor object, now whole: a restored checkpoint's moment
    with pytest.raises(InputError, match="input m: given float32 \\[1001\\]"):
        step.check(tensors, HYPER)
    tensors["m"] = torch.zeros(500, dtype=torch.float64)
    with pytest.raises(InputError, match="input m: given float64 \\[500\\] on cpu, the schedule expects float32"):
        step.check(tensors, HYPER)


def test_names_types_and_devices_are_checked():
    step = _step()
    ok = {"g": torch.zeros(N), "w": torch.zeros(N), "m": torch.zeros(500), "v": torch.zeros(500)}
    with pytest.raises(InputError, match="missing v") as err:
        step.check({k: v for k, v in ok.items() if k != "v"}, HYPER)
    assert err.value.input == "v"
    with pytest.raises(InputError, match="unknown lr_"):
        step.check(ok, {**HYPER, "lr_": 1.0})
    with pytest.raises(InputError, match="missing t"):
        step.check(ok, {k: v for k, v in HYPER.items() if k != "t"})
    with pytest.raises(InputError, match="input g: given a ndarray"):
        step.check({**ok, "g": ok["g"].numpy()}, HYPER)
    with pytest.raises(InputError, match="on meta"):
        step.check({**ok, "w": torch.empty(N, device="meta")}, HYPER)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 5000), world=st.integers(1, 9))
def test_the_ranks_rows_cover_the_dim_once_in_order(n, world):
    prog = load_file(examples_dir() / "adam.py")
    spans = [rows(n, world, r) for r in range(world)]
    assert spans[0][0] == 0 and spans[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])) and all(lo <= hi for lo, hi in spans)
    sched = coconet.step.Schedule.parse("split(ar0); reorder(ag0); as_slice(m)", prog)
    shapes = [input_specs(sched.scheduled, {"N": n}, world, r)["m"].shape[0] for r in range(world)]
    assert sum(shapes) == n


def test_best_reads_the_stores_winner_and_says_where_it_came_from(tmp_path):
    from coconet.server.records import NewMeasurement
    from coconet.server.store import Store

    prog = load_file(examples_dir() / "adam.py")
    zero1 = coconet.step.Schedule.parse(ZERO1, prog)
    db = f"sqlite:///{tmp_path / 'c.db'}"
    with Store.open(db) as store:
        store.add_program(prog)
        mid = store.add_measurement(
            NewMeasurement.of(
                zero1, median_s=2e-3, samples=[2e-3] * 3, sizes={"N": 1024}, topology="local", world=2, backend="shm"
            )
        )
        store.add_winner(mid)
    step = coconet.compile(prog, "N=1024", store=db, world=2, rank=0, kernels="eager")
    assert step.schedule.text == zero1.text and step.backend == "shm" and step.origin.how == "measured"
    assert "measured fastest on topology local (2 ms a step)" in step.describe()
    near = coconet.compile(prog, {"N": 1000}, store=db, world=2, rank=0, kernels="eager")
    assert not near.origin.exact and "nearest tuned sizes N=1024" in near.describe()
    with pytest.raises(CoconetError, match="coconet tune FILE --world 3 --size N=1024") as err:
        coconet.compile(prog, {"N": 1024}, store=db, world=3, rank=0)
    assert err.value.not_tuned


def test_tune_on_miss_tunes_the_key_into_the_store_then_reads_it(ray_local, tmp_path, capsys):
    """No winner at these sizes (only the nearest's): rank 0 tunes the exact key first, says so, and the step
    runs the measured winner; asked again, the store answers without tuning."""
    from coconet.server.records import NewMeasurement
    from coconet.server.store import Store

    db = f"sqlite:///{tmp_path / 'c.db'}"
    prog = load_file(examples_dir() / "sgd.py")
    with Store.open(db) as store:  # a winner at other sizes: the nearest, which tune_on_miss does not settle for
        store.add_program(prog)
        store.add_winner(
            store.add_measurement(
                NewMeasurement.of(
                    coconet.step.Schedule.parse("baseline", prog),
                    median_s=1e-3,
                    samples=[1e-3] * 3,
                    sizes={"N": 4096},
                    topology="local",
                    world=2,
                    backend="gloo",
                )
            )
        )
    step = coconet.compile(
        "examples/sgd.py",
        {"N": 1024},
        store=db,
        world=2,
        rank=0,
        backend="gloo",
        kernels="eager",
        tune_on_miss=True,
        budget=2,
    )
    assert "has no measured winner for N=1024, world 2, topology local: tuning it" in capsys.readouterr().err
    assert step.origin.how == "measured" and step.origin.exact and step.backend == "gloo"
    with Store.open(db) as store:
        best = store.best(prog.hash, {"N": 1024}, "local", 2)
        assert best is not None and best.exact and best.measurement.schedule == step.schedule.text
        tuned = len(store.measurements(prog.hash))
    again = coconet.compile(
        "examples/sgd.py", {"N": 1024}, store=db, world=2, rank=1, kernels="eager", tune_on_miss=True
    )
    assert again.schedule.text == step.schedule.text and "tuning" not in capsys.readouterr().err
    with Store.open(db) as store:
        assert len(store.measurements(prog.hash)) == tuned
    with pytest.raises(CoconetError, match="budget: at least 1 trial"):
        coconet.compile("examples/sgd.py", {"N": 1024}, store=db, world=2, rank=0, tune_on_miss=True, budget=0)


def test_import_coconet_does_not_import_torch():
    import subprocess
    import sys

    code = (
        "import sys, coconet; coconet.compile; assert 'torch' not in sys.modules; coconet.optim; "
        "assert 'torch' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
