import json
import runpy
from pathlib import Path

from coconet.schedules.schedule import Schedule
from coconet.tuner.launch import Options, run_schedules
from coconet.tuner.trace import MATMUL, overlap

ROOT = Path(__file__).parents[2]


def _event(name, tid, ts, dur):
    return {"ph": "X", "cat": "cpu_op", "name": name, "tid": tid, "ts": ts, "dur": dur}


def test_overlap_is_the_intersection_of_matmuls_and_communication(tmp_path):
    trace = tmp_path / "t.json"
    events = [
        _event("aten::matmul", 1, 0, 100),
        _event("aten::mm", 1, 10, 80),  # nested: counted once
        _event("aten::add", 1, 100, 50),
        _event("gloo:reduce_scatter", 7, 60, 60),  # 40 us under the matmul
        _event("gloo:reduce_scatter", 8, 130, 40),
    ]  # under nothing but an add
    trace.write_text(json.dumps({"traceEvents": events + [{"ph": "M", "name": "thread_name", "tid": 7}]}))
    o = overlap(trace)
    us = 1e-6
    assert abs(o.step_s - 170 * us) < 1e-12 and abs(o.compute_s - 100 * us) < 1e-12
    assert abs(o.comm_s - 100 * us) < 1e-12 and abs(o.overlapped_s - 40 * us) < 1e-12
    assert abs(o.hidden - 0.4) < 1e-9


def test_run_traces_every_rank_and_overlap_shows_in_flight_collectives(tmp_path):
    prog = runpy.run_path(str(ROOT / "examples/megatron_mlp.py"))["program"].ir
    seq, ovl = Schedule.parse("split(ar0)", prog), Schedule.parse("split(ar0); overlap(mm0, rs0)", prog)
    opts = Options(
        world=2, sizes={"B": 4, "S": 64, "H": 128}, kernels="eager", warmup=0, repeats=1, trace=str(tmp_path)
    )
    results = run_schedules([seq, ovl], opts)
    assert all(r.status == "ok" and r.correct for r in results)
    for sched in (seq, ovl):
        files = sorted(tmp_path.glob(f"*{sched.hash}*_rank*.json"))
        assert [f.name.rsplit("_", 1)[1] for f in files] == ["rank0.json", "rank1.json"]
    o = overlap(next(tmp_path.glob(f"*{ovl.hash}*_rank0.json")))
    assert o.compute_s > 0 and o.comm_s > 0  # the collectives ran on gloo's threads, the matmuls on the main one


def test_shm_collectives_show_on_their_thread_in_the_trace(tmp_path):
    """The shm backend's async collectives run on its communication thread, which exists before the
    profiler starts: the trace still has them, as named spans beside the matmuls."""
    prog = runpy.run_path(str(ROOT / "examples/megatron_mlp.py"))["program"].ir
    ovl = Schedule.parse("split(ar0); overlap(mm0, rs0); chunks=4", prog)
    opts = Options(
        world=2,
        sizes={"B": 4, "S": 64, "H": 128},
        backend="shm",
        kernels="eager",
        warmup=0,
        repeats=1,
        trace=str(tmp_path),
    )
    (res,) = run_schedules([ovl], opts)
    assert res.status == "ok" and res.correct, res.error
    trace = next(tmp_path.glob(f"*{ovl.hash}*_rank0.json"))
    events = json.loads(trace.read_text())["traceEvents"]
    main = next(e["tid"] for e in events if e.get("name") in MATMUL)
    spans = [e for e in events if e.get("name", "").startswith("shm ") and e.get("ph") == "X"]
    assert spans and all(e["tid"] != main for e in spans)
    assert {e["name"] for e in spans} == {"shm _shm_reduce_scatter"}
    o = overlap(trace)
    assert o.compute_s > 0 and o.comm_s > 0
