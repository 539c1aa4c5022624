"""The benchmark scripts' own claims that can be checked without timing anything."""

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # a function it hands to a spawned process is pickled by its module's name
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("program", ["rmsprop", "amsgrad", "adagrad", "adamw_clip"])
def test_the_unseen_optimizers_are_the_updates_torch_optim_makes(program):
    # the baseline they are timed against is torch.optim's: the same update, or the comparison means nothing
    assert _script("unseen_optimizers").check_semantics(program, world=3, n=257) < 1e-5


def test_the_single_copy_reduces_the_rows_the_publish_does(tmp_path):
    # its times mean something only if reading the peer's private memory gives the peer's rows
    report = _script("single_copy").main(
        [
            "--size",
            "N=4096",
            "--chunk",
            "300",
            "--repeats",
            "1",
            "--rounds",
            "1",
            "--out",
            str(tmp_path / "single_copy.json"),
        ]
    )
    if report["process_vm_readv"] != "allowed":
        pytest.skip(f"this system refuses process_vm_readv: {report['process_vm_readv']}")
    copied = report["variants"]["single copy, chunks of 300"]
    assert copied["same_result_as_publish"] and copied["checksum"] != report["variants"]["local"]["checksum"]


def test_the_kernel_without_dynamo_writes_what_the_compiled_one_writes():
    # the call-cost comparison holds only between kernels that compute the same update in place
    report = _script("kernel_call").main(["--size", "N=300", "--calls", "1"])
    (point,) = report["points"]
    assert point["same_results"] and point["wrote_in_place"]


def test_the_kernel_wrapper_writes_what_eager_torch_writes():
    # a wrapper's cost per step compares revisions only if each one's kernel computes the same update
    report = _script("kernel_wrapper").main(["--rev", ".", "--size", "N=300", "--steps", "1"])
    (point,) = report["points"]
    assert point["same_results"] == {".": True}


def test_interleaved_modules_that_compute_the_same_step_agree_and_a_broken_one_does_not(tmp_path):
    # a ratio of step times means something only between modules that compute the same step
    from coconet.codegen.lower import lower
    from coconet.loader import examples_dir, load_file
    from coconet.schedules.schedule import Schedule

    program = examples_dir() / "adam.py"
    adam = load_file(program)
    paths = []
    for name, text in [
        ("as_written", ""),
        ("zero1", "split(ar0); reorder(ag0); as_slice(m); as_slice(v); fuse_collective(rs0); fc_chunks=3"),
    ]:
        paths.append(tmp_path / f"{name}.py")
        paths[-1].write_text(lower(Schedule.parse(text, adam), "shm", "eager").source)
    broken = paths[1].read_text() + (
        "\n_step = step\n\n\ndef step(tensors, scalars, **kw):\n"
        "    out = _step(tensors, scalars, **kw)\n"
        "    tensors['w'].mul_(1.01)\n    return out\n"
    )
    paths.append(tmp_path / "broken.py")
    paths[-1].write_text(broken)
    report = _script("interleaved").main(
        [str(program), *map(str, paths), "--world", "2", "--size", "N=301", "--steps", "2"]
    )
    diffs = [m["state_rel_diff_to_first"] for m in report["modules"]]
    assert diffs[0] == 0 and diffs[1] < 1e-5 and diffs[2] > 1e-3
    assert all(m["median_s"] > 0 for m in report["modules"])


def test_interleaved_stopped_from_outside_stops_its_ranks_and_leaves_no_segment(tmp_path):
    # a long comparison is often cut short: its ranks must not live on holding shared memory
    import signal
    import subprocess
    import time

    from coconet.codegen.lower import lower
    from coconet.loader import examples_dir, load_file
    from coconet.schedules.schedule import Schedule

    program = examples_dir() / "adam.py"
    module = tmp_path / "zero1.py"
    module.write_text(
        lower(
            Schedule.parse(
                "split(ar0); reorder(ag0); as_slice(m); as_slice(v); fuse_collective(rs0)", load_file(program)
            ),
            "shm",
            "eager",
        ).source
    )
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "interleaved.py"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(script),
            str(program),
            str(module),
            "--world",
            "2",
            "--size",
            "N=4096",
            "--steps",
            "100000",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )

    def ranks():
        out = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True, check=False).stdout
        return [int(x) for x in out.split()]

    deadline = time.monotonic() + 120
    while not any(Path("/dev/shm").glob(f"coconet-{r}-*") for r in ranks()):  # stepping, its state in segments
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "no step"
        time.sleep(0.2)
    children = ranks()
    ranks_ = [r for r in children if "resource_tracker" not in Path(f"/proc/{r}/cmdline").read_text()]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM

    def running(pid):  # an exited child nobody has reaped yet (a zombie) holds nothing
        try:
            return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            return False

    assert len(ranks_) == 2 and not [r for r in ranks_ if running(r)]  # the ranks are gone when it exits
    # and multiprocessing's resource tracker once it sees its pipe close
    deadline = time.monotonic() + 10
    while [r for r in children if running(r)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [r for r in children if running(r)]
    assert not [p for r in children for p in Path("/dev/shm").glob(f"coconet-{r}-*")]


def test_the_c_chunk_kernel_writes_inductors_bits(tmp_path, monkeypatch):
    monkeypatch.setenv("COCONET_CACHE_DIR", str(tmp_path))
    report = _script("native_chunk").main(["--world", "3", "--size", "N=3003", "--calls", "1"])
    assert set(report["kinds"]) == {"inductor", "c_streamed", "c_plain"}
    assert all(k["same_bits_as_inductor"] for k in report["kinds"].values())
    assert len(list((tmp_path / "kernels").glob("chunk_*.so"))) == 2  # streamed and plain


def test_the_chunk_concurrency_runs_the_c_kernel_in_every_process_count(tmp_path, monkeypatch):
    monkeypatch.setenv("COCONET_CACHE_DIR", str(tmp_path))
    report = _script("chunk_concurrency").main(
        ["--world", "3", "--size", "N=3003", "--processes", "1,2", "--calls", "1", "--rounds", "1"]
    )
    assert report["chunk_kernel"] == "C" and list((tmp_path / "kernels").glob("chunk_*.so"))
    assert report["bytes_per_call_per_process"]["chunk"] == (2 * 3 + 5) * 4 * 1001  # the words one rank's chunk moves
    assert set(report["processes"]) == {"1", "2"}
    assert all(r["chunk_GBps"] > 0 and r["add_GBps"] > 0 and r["states_GBps"] > 0 for r in report["processes"].values())


def test_the_launch_startup_times_correct_launches_each_way():
    # a launch's time means something only if its ranks computed the step right: a wrong one stops the script
    report = _script("launch_startup").main(["--world", "2", "--size", "N=64", "--rounds", "1"])
    (point,) = report["worlds"]
    assert {way: len(s) for way, s in point["samples_s"].items()} == {"fork server": 1, "fresh interpreters": 1}


def test_the_space_scaling_compares_ways_that_give_the_same_schedules(tmp_path):
    from coconet.schedules.transforms import Reorder

    batched = Reorder.apply_all
    out = tmp_path / "space.json"
    report = _script("space_scaling").main(["--tensors", "3", "--tensors", "5", "--rounds", "2", "--out", str(out)])
    assert Reorder.apply_all == batched  # the one-by-one way's refusal ends with it
    assert [p["tensors"] for p in report["points"]] == [3, 5]
    for point in report["points"]:
        assert point["schedules"] > 1 and point["longest_schedule_transforms"] >= 3 * point["tensors"]
        for way in ("together", "one by one"):
            assert len(point[way]["rounds"]["generate_s"]) == 2 and point[way]["read_back_s"] > 0
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_schedule_keeps_each_programs_rows_and_names_what_failed_or_ran_out_of_time(tmp_path):
    import json
    import subprocess

    from coconet.loader import load_file
    from coconet.schedules.space import generate

    script = ROOT / "benchmarks" / "every_schedule.py"
    sgd = tmp_path / "sgd.py"  # plain SGD: ten schedules, a few seconds at world 1
    sgd.write_text(
        "from coconet import Local, Program, Replicated, allreduce\n"
        "p = Program('sgd', dims=('N',))\n"
        "g = p.tensor('g', ('N',), layout=Local)\n"
        "w = p.tensor('w', ('N',), layout=Replicated)\n"
        "p.update(w, w - p.scalar('lr') * allreduce(g))\n"
        "program = p\n"
    )
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('this program does not load')\n")
    slow = tmp_path / "slow.py"
    slow.write_text("import time\ntime.sleep(600)\n")

    def every(*programs, deadline):
        out = tmp_path / "rows.jsonl"
        done = subprocess.run(
            [
                sys.executable,
                str(script),
                *map(str, programs),
                "--backend",
                "gloo",
                "--kernels",
                "eager",
                "--jobs",
                "2",
                "--deadline-s",
                str(deadline),
                "--out",
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        return [json.loads(line) for line in out.read_text().splitlines()]

    rows = every(sgd, broken, deadline=240)
    found = [r for r in rows if "schedule" in r]
    assert sorted(r["schedule"] for r in found) == sorted(s.text for s in generate(load_file(sgd)))
    assert all(r["status"] == "ok" and r["correct"] and r["program"] == "sgd" for r in found)
    [failed] = [r for r in rows if "schedule" not in r]
    assert failed["program"] == "broken" and failed["returncode"] != 0 and not failed["stopped_at_deadline"]
    assert "this program does not load" in failed["tail"]

    *stopped, queued = every(slow, slow, sgd, deadline=2)  # two at a time: the third never starts
    assert [(r["program"], r["stopped_at_deadline"], r["rows"]) for r in stopped] == [("slow", True, 0)] * 2
    assert queued == {"program": "sgd", "not_started": True}


def test_the_gpu_summary_names_failures_stopped_programs_and_missing_files(tmp_path, capsys):
    import json

    rows = [
        {"schedule": "split(ar0)", "status": "ok", "correct": True, "error": None, "program": "adam"},
        {
            "schedule": "fuse(mul0)",
            "status": "runtime_error",
            "correct": None,
            "error": "CUDA error: boom",
            "program": "adam",
        },
        {"program": "lamb", "stopped_at_deadline": True, "returncode": -9, "rows": 0, "tail": ""},
        {"program": "sgd", "not_started": True},
    ]
    (tmp_path / "every_schedule_nccl_eager.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    point = {
        "sizes": {"N": 8},
        "torch": {"status": "runtime_error", "median_s": None, "error": "no NCCL"},
        "results": [{"status": "ok", "correct": True}],
        "best_speedup": None,
        "best_over_floor": 1.5,
        "best": {"median_s": 2e-6, "schedule": "fuse(mul0)"},
    }
    (tmp_path / "bench_adam_nccl_w1.json").write_text(
        json.dumps({"workload": "adam", "world": 1, "backends": ["nccl"], "complete": False, "points": [point]})
    )
    (tmp_path / "gpu_kernels.json").write_text('{"device": "H200"')  # cut off mid-write
    _script("gpu_summary").main(tmp_path)
    out = capsys.readouterr().out
    assert "1/2 schedules ok in 1 programs; stopped or not started: lamb, sgd" in out
    assert "adam: fuse(mul0)  runtime_error: CUDA error: boom" in out
    assert "torch runtime_error: no NCCL, best 2 us (0.00x; 1.50x the floor) fuse(mul0); 1/1 ok" in out
    assert "--- gpu_kernels.json\nunreadable: JSONDecodeError" in out
    assert out.count("missing") == 3  # kernel_call, megatron's bench, the compiled run


@pytest.mark.parametrize("world", [2, 3])
def test_a_model_trained_with_the_generated_step_follows_ddp_and_adam(tmp_path, world):
    # the loop's parameters and gradients are views of the flat buffers the step reads and writes on shm: its
    # times mean something only if training that way is training, step for step what DDP and Adam do (2845
    # parameters: uneven rows at world 3)
    report = _script("training_loop").main(
        [
            "--world",
            str(world),
            "--dims",
            "24,40,40,5",
            "--batch",
            "8",
            "--steps",
            "6",
            "--rounds",
            "1",
            "--kernels",
            "eager",
            "--out",
            str(tmp_path / "loop.json"),
        ]
    )
    assert report["loss_rel_gap"]["coconet"] < 1e-5 and report["weights_rel_gap"]["coconet"] < 1e-5, report
    assert report["weights_rel_gap"]["allreduce"] < 1e-5, report  # the second baseline trains the same model too
    assert report["losses"]["coconet"][-1] < report["losses"]["coconet"][0]


def test_same_code_finds_the_schedules_whose_generated_modules_changed(tmp_path, capsys):
    # a GPU figure is carried over to a checkout on this report's word: it must see a change in one shared
    # helper, and nothing where there is none
    same_code = _script("same_code")
    sgd = str(ROOT / "examples" / "sgd.py")
    assert same_code.main(["--rev", ".", sgd, "--out", str(tmp_path / "same.json")]) == 0
    import json

    report = json.loads((tmp_path / "same.json").read_text())
    assert report["every_module_same"] and report["programs"]["sgd"]["same"] == report["programs"]["sgd"]["schedules"]

    tree = tmp_path / "tree"
    tree.mkdir()
    parts = ("pyproject.toml", "coconet", "schedules", "codegen", "kernels", "tuner", "server", "configs", "examples")
    for part in parts:
        copy = shutil.copytree if (ROOT / part).is_dir() else shutil.copy2
        copy(ROOT / part, tree / part)
    wrapper = tree / "kernels" / "compiled.py"  # the runtime: no module's text changes, what it runs does
    text = wrapper.read_text()
    assert text.count("A fused pointwise kernel, compiled") == 1
    wrapper.write_text(text.replace("A fused pointwise kernel, compiled", "A fused pointwise kernel, built"))
    capsys.readouterr()
    assert same_code.main(["--rev", ".", "--rev", str(tree), sgd, "--out", str(tmp_path / "changed.json")]) == 1
    sgd_report = json.loads((tmp_path / "changed.json").read_text())["programs"]["sgd"]
    # only the modules with a compiled fused kernel import the wrapper whose doc changed
    assert 0 < len(sgd_report["differ"]) < sgd_report["schedules"]
    assert all("fuse" in t for t in sgd_report["differ"])
    assert "NOT every module" in capsys.readouterr().out
    # the schedules' own code is the same: only the runtime they import changed
    assert same_code.main(["--rev", ".", "--rev", str(tree), sgd, "--step-only"]) == 0


def test_bench_between_pairs_each_round_and_divides_by_each_runs_torch(tmp_path):
    bench_between = _script("bench_between")

    def run(side, k, torch_s, times):
        results = [{"schedule": s, "backend": "shm", "status": "ok", "median_s": t} for s, t in times.items()]
        results.append({"schedule": "broken", "backend": "shm", "status": "runtime_error", "median_s": None})
        report = {"points": [{"torch": {"median_s": torch_s}, "results": results}]}
        (tmp_path / f"adam_{side}_r{k}.json").write_text(json.dumps(report))

    run("before", 1, 1.0, {"baseline": 2.0, "fc": 1.0})
    run("after", 1, 2.0, {"baseline": 4.0, "fc": 1.0})  # a loaded round: torch too took twice as long
    run("before", 2, 1.0, {"baseline": 2.0, "fc": 1.0})
    run("after", 2, 1.0, {"baseline": 2.0, "fc": 0.5})
    report = bench_between.main(["--before", "a", "--runs", str(tmp_path), "--summarize", "--", "adam"])
    rows = report["schedules"]
    assert report["rounds"] == 2 and set(rows) == {"baseline [shm]", "fc [shm]"}
    assert rows["baseline [shm]"]["after_over_before"] == [2.0, 1.0]
    assert rows["baseline [shm]"]["after_over_before_vs_torch"] == [1.0, 1.0]
    assert rows["fc [shm]"]["after_over_before_vs_torch"] == [0.5, 0.5] and rows["fc [shm]"]["median_ratio"] == 0.75


def test_the_docs_result_tables_are_their_json():
    # a figure on a page is the figure a run wrote: the tables are rendered from benchmarks/results, not copied
    tables = _script("tables")
    pages = sorted((ROOT / "docs").glob("*.md"))
    assert sum(p.read_text().count("<!-- table: ") for p in pages) >= 3
    assert tables.stale(pages) == []


def test_a_table_block_is_rewritten_from_its_json(tmp_path):
    tables = _script("tables")
    page = "before\n<!-- table: training training_loop_w2.json -->\n| stale | row |\n<!-- /table -->\nafter\n"
    new = tables.rewrite(page)
    data = json.loads((ROOT / "benchmarks" / "results" / "training_loop_w2.json").read_text())
    speedups = sorted(r["speedup"] for r in data["rounds"])
    assert "stale" not in new and new.startswith("before\n") and new.endswith("<!-- /table -->\nafter\n")
    assert f"{speedups[0]:.2f}–{speedups[-1]:.2f}x" in new
    with pytest.raises(ValueError, match="KIND one of"):
        tables.render("nonsense training_loop_w2.json")


def test_where_the_time_goes_takes_each_transformations_fastest_and_the_floor():
    tables = _script("tables")
    data = json.loads((ROOT / "benchmarks" / "results" / "bench_gpt_layer_sp_w2.json").read_text())
    (row,) = tables.time_rows("bench_gpt_layer_sp_w2.json", data)
    point = data["points"][0]
    ok = [r for r in point["results"] if r["status"] == "ok"]
    head = tables.TIME_HEAD
    fc = min(r["median_s"] for r in ok if "fuse_collective(" in r["schedule"])
    best = min(r["median_s"] for r in ok)
    assert row[head.index("fuse_collective")] == f"{fc * 1e3:.3g} ms"
    assert row[head.index("best")] == f"{best * 1e3:.3g} ms"
    assert row[head.index("floor share")] == f"{100 * point['compute_floor_s'] / best:.0f}%"
    # a transformation no schedule used is said, not left blank
    data["points"][0]["results"] = [r for r in ok if "overlap(" not in r["schedule"]]
    (row,) = tables.time_rows("x.json", data)
    assert row[head.index("overlap")] == "—"
