import io
import json
import os
import runpy
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def quiet_env():
    """The environment without COCONET_DEBUG, which would print an internal error's traceback, not its one line."""
    return {k: v for k, v in os.environ.items() if k != "COCONET_DEBUG"}


def coconet(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "coconet", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd or ROOT,
        env=quiet_env(),
        timeout=120,
    )


def assert_one_error(proc, *fragments):
    assert proc.returncode == 2, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    for f in fragments:
        assert f in lines[0], lines[0]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_check_examples(path):
    proc = coconet("check", path.relative_to(ROOT), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["program"] == path.stem and len(out["hash"]) == 16
    for s in out["statements"]:
        assert set(s) >= {"name", "op", "args"}
        if s["op"] not in ("update", "output", "send"):
            assert {"shape", "dtype", "layout"} <= set(s)


def test_check_human_listing_and_sizes():
    proc = coconet("check", "examples/megatron_mlp.py", "--size", "B=2,S=3,H=4")
    assert proc.returncode == 0, proc.stderr
    assert "Sliced(2)" in proc.stdout and "(2, 3, 16)" in proc.stdout and "allreduce" in proc.stdout
    proc = coconet("check", "examples/megatron_mlp.py", "--size", "B=2,S=3")
    assert_one_error(proc, "no size given for H")


def test_export_round_trips_through_check(tmp_path):
    out = tmp_path / "adam.json"
    proc = coconet("export", "examples/adam.py", "-o", out)
    assert proc.returncode == 0, proc.stderr
    py = json.loads(coconet("check", "examples/adam.py", "--json").stdout)
    js = json.loads(coconet("check", out, "--json").stdout)
    assert py == js
    stdout = coconet("export", "examples/adam.py").stdout
    assert json.loads(stdout) == json.loads(out.read_text())


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


HEADER = "from coconet import *\np = Program('bad', dims=('N',))\n"
BAD_PROGRAMS = {
    "local_plus_sliced": (
        HEADER + "g = p.tensor('g', ('N',), layout=Local)\n"
        "x = p.tensor('x', ('N',), layout=Sliced(0))\n"
        "p.output('y', g + x)\nprogram = p\n",
        ["bad.py:5", "Local and Sliced"],
    ),
    "mismatched_shapes": (
        "from coconet import *\np = Program('bad', dims=('N', 'M'))\n"
        "a = p.tensor('a', ('N',), layout=Replicated)\nb = p.tensor('b', ('M',), layout=Replicated)\n"
        "p.output('y', a * b)\nprogram = p\n",
        ["bad.py:5", "do not broadcast"],
    ),
    "replicated_from_local": (
        HEADER + "w = p.tensor('w', ('N',), layout=Replicated)\n"
        "g = p.tensor('g', ('N',), layout=Local)\n"
        "p.update(w, w - g)\nprogram = p\n",
        ["bad.py:5", "w is Replicated", "Local"],
    ),
    "no_program": (HEADER + "x = p.tensor('x', ('N',), layout=Local)\n", ["defines no `program`"]),
    "not_a_program": ("program = 3\n", ["not a coconet Program"]),
    "syntax": ("program = (\n", ["syntax error"]),
    "raises": ("import math\nprogram = math.sqrt(-1)\n", ["bad.py:2", "ValueError"]),
    "exits": ("import sys\nsys.exit(3)\n", ["bad.py:2", "the file called sys.exit(3) while being loaded"]),
    "raises_base_exception": ("x = 1\nraise BaseException('base')\n", ["bad.py:2", "BaseException: base"]),
    "raises_generator_exit": ("raise GeneratorExit\n", ["bad.py:1", "GeneratorExit"]),
    "unreadable_message": (
        "class E(Exception):\n    def __str__(self):\n        raise RuntimeError('x')\nraise E()\n",
        ["bad.py:4", "E (its message could not be read: RuntimeError)"],
    ),
    "nul_byte": ("x = 1\0\n", ["bad.py: syntax error", "null bytes"]),
    # a thread the file leaves running would hold the command at exit for ever: refused, and the command ends
    "starts_a_thread": (
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(3600,), name='poller').start()\n"
        + HEADER
        + "x = p.tensor('x', ('N',), layout=Local)\np.output('y', x)\nprogram = p\n",
        ["bad.py: started thread 'poller'", "a program file defines, it does not run"],
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_PROGRAMS))
def test_bad_programs_give_one_error_line(tmp_path, case):
    text, fragments = BAD_PROGRAMS[case]
    path = write(tmp_path, "bad.py", text)
    assert_one_error(coconet("check", path), *fragments)
    assert_one_error(coconet("export", path), *fragments)


def test_json_with_unknown_op(tmp_path):
    d = json.loads(coconet("export", "examples/sgd.py").stdout)
    d["statements"][5]["op"] = "teleport"
    path = tmp_path / "p.json"
    path.write_text(json.dumps(d))
    assert_one_error(coconet("check", path), "unknown op 'teleport'", d["statements"][5]["name"])


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["check", "nowhere.py"], "no such file"),
        (["check", "README.md"], ".py"),
        (["tune", "examples/adam.py"], "--size is required"),
        (["tune", "examples/adam.py", "--size", "N=8", "--backend", "nccl"], "cannot run on local"),
        (["tune", "examples/adam.py", "--size", "N=8", "--topology", "dgx-h100-8"], "needs its cluster"),
        (
            ["tune", "examples/adam.py", "--size", "N=8", "--shardable", "m,g"],
            "shardable g: not replicated state adam updates (it can shard m, v, w; `all` for every one)",
        ),
        (["sweep", "no/such/sweep.yaml"], "cannot read sweep config"),
        (["run", "examples/adam.py"], "--size is required"),
        (["run", "examples/adam.py", "--size", "N=0"], "N"),
        (["run", "examples/adam.py", "--size", "M=4"], "does not have"),
        (
            ["run", "examples/adam.py", "--size", "N=8", "--schedule", "best", "--db", "sqlite:///:memory:"],
            "no tuned schedule of adam",
        ),
        (["run", "examples/adam.py", "--size", "N=8", "--schedule", "999"], "there is no schedule 999"),
        (["run", "examples/adam.py", "--size", "N=8", "--schedule", "split(nope)"], "nope"),
        (["run", "examples/adam.py", "--size", "N=8", "--backend", "mpi"], "unknown backend 'mpi'"),
        (["bench", "adam", "--size", "N=8", "--backend", "mpi"], "unknown backend 'mpi'"),
        (["bench", "adam", "--size", "N=8", "--backend", "nccl", "--backend", "shm"], "bench them in separate runs"),
        (["run", "examples/adam.py", "--size", "N=8", "--kernels", "numba"], "unknown --kernels 'numba'"),
        (["run", "examples/adam.py", "--size", "N=٣"], "value must be an integer or 2^k"),  # int() reads it as 3
        (["run", "examples/adam.py", "--size", "N=+8"], "value must be an integer or 2^k"),
        (
            [
                "run",
                "examples/megatron_mlp.py",
                "--size",
                "B=1,S=2,H=4",
                "--schedule",
                "overlap(mm0, ar0); chunks=" + "9" * 30,
            ],
            "larger than 2^40",
        ),
        (
            [
                "run",
                "examples/adam.py",
                "--size",
                "N=8",
                "--schedule",
                "split(ar0); reorder(ag0); fuse_collective(rs0); fc_chunks=4; fc_chunks=8",
            ],
            "knob fc_chunks given twice",
        ),
        (["tune", "examples/adam.py", "--size", "N=8", "--world", "10000"], "at most 64 ranks"),
        (["tune", "examples/adam.py", "--size", "N=8", "--ray-address", "127.0.0.1:1"], "no Ray cluster answers there"),
        (["submit", "examples/adam.py", "--size", "N=8", "--server", "http://[::1"], "is not a valid URL"),
        # one value kept silently: the last backend alone ran
        (
            ["run", "examples/adam.py", "--size", "N=8", "--backend", "shm", "--backend", "gloo"],
            "Invalid value for '--backend': given more than once: run takes one value",
        ),
        (["tune", "examples/adam.py", "--size", "N=8", "--world", "2", "--world=3"], "'--world': given more than once"),
    ],
)
def test_other_errors(args, fragment):
    assert_one_error(coconet(*args), fragment)


@pytest.mark.parametrize(
    "args",
    [
        ["run", "examples/adam.py", "--size", "N=8", "--backend", "mpi"],
        ["run", "examples/adam.py", "--size", "N=8", "--schedule", "split(nope)"],
        ["bench", "adam", "--size", "N=8", "--backend", "nccl", "--backend", "shm"],
        ["bench", "adam", "--size", "N=2^40"],
        ["tune", "examples/adam.py", "--size", "N=8", "--world", "10000"],
        ["tune", "examples/adam.py", "--size", "N=8", "--shardable", "g"],
    ],
    ids=lambda a: " ".join(a[:1] + a[3:]),
)
def test_a_refused_option_is_answered_before_torch_is_imported(args):
    """Importing torch takes seconds: an option that cannot run is refused without it."""
    probe = (
        "import runpy, sys\n"
        f"sys.argv = ['coconet', *{args!r}]\n"
        "try:\n    runpy.run_module('coconet', run_name='__main__')\n"
        "except SystemExit as e:\n    print(e.code, 'torch' in sys.modules)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, env=quiet_env(), timeout=120
    )
    assert proc.stderr.startswith("error: ") and proc.stdout == "2 False\n", (proc.stdout, proc.stderr)


def test_a_lookup_in_a_store_that_does_not_exist_makes_none(tmp_path):
    db = tmp_path / "typo" / "x.db"
    assert_one_error(
        coconet("run", "examples/adam.py", "--size", "N=8", "--schedule", "best", "--db", f"sqlite:///{db}"),
        "no store at",
        "does not exist",
    )
    assert not (tmp_path / "typo").exists()


def test_an_output_path_that_cannot_be_written_is_refused_before_the_work(tmp_path):
    """A bench measures for minutes: a path it could not write at the end must stop it at the start."""
    (tmp_path / "afile").write_text("")
    (tmp_path / "adir").mkdir()
    cases = [
        (["export", "examples/adam.py", "-o", tmp_path / "adir"], "is a folder"),
        (["export", "examples/adam.py", "-o", tmp_path / "afile" / "x.json"], "afile is a file, not a folder"),
        (["run", "examples/adam.py", "--size", "N=8", "--emit", tmp_path / "afile"], "is a file: name a folder"),
        (["bench", "adam", "--size", "N=8", "--plot", tmp_path / "afile" / "x.png"], "afile is a file, not a folder"),
        (["bench", "adam", "--size", "N=8", "-o", tmp_path / "adir"], "is a folder"),
        (["bench", "adam", "--size", "N=8", "--plot", tmp_path / "x.txt"], "a plot is written as .html or as an image"),
        (["calibrate", "-o", tmp_path / "afile" / "t.yaml"], "afile is a file, not a folder"),
        (["calibrate", "--ray-address", "127.0.0.1:1"], "--ray-address measures a cluster: name its topology"),
        (["calibrate", "--name", "mine"], "this machine is `local`; another name is a cluster's (--ray-address)"),
        (["calibrate", "--name", "../up", "--ray-address", "127.0.0.1:1"], "--name '../up': letters, digits"),
    ]
    for args, fragment in cases:
        start = time.monotonic()
        assert_one_error(coconet(*args), fragment)
        assert time.monotonic() - start < 60  # refused up front, not after a bench or a calibration
    out = tmp_path / "new" / "adam.json"  # a folder that is missing is made
    assert coconet("export", "examples/adam.py", "-o", out).returncode == 0 and json.loads(out.read_text())


def test_what_a_program_file_prints_does_not_mix_with_the_json_answer(tmp_path):
    path = write(tmp_path, "loud.py", "print('hello from the program')\n" + open(ROOT / "examples/sgd.py").read())
    proc = coconet("check", path, "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["program"] == "sgd" and "hello from the program" in proc.stderr


def test_serve_on_a_port_in_use_is_one_error(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = coconet("serve", "--port", port, "--db", f"sqlite:///{tmp_path / 's.db'}")
    assert_one_error(proc, f"cannot serve on 127.0.0.1:{port}")


def test_help_lists_every_command():
    proc = coconet("--help")
    assert proc.returncode == 0
    for cmd in ("check", "export", "schedules", "run", "tune", "sweep", "calibrate", "bench", "serve", "submit"):
        assert cmd in proc.stdout
    assert "Not available yet" not in proc.stdout


def test_schedules_listing_and_json():
    proc = coconet("schedules", "examples/megatron_mlp.py")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (ROOT / "tests/schedules/golden/megatron_mlp.txt").read_text()
    out = json.loads(coconet("schedules", "examples/adam.py", "--json").stdout)
    assert out["program"] == "adam" and out["count"] == len(out["schedules"]) > 10
    first = out["schedules"][0]
    assert first["id"] == 0 and first["text"] == "baseline" and first["transforms"] == [] and len(first["hash"]) == 16
    assert any(s["transforms"] == ["split", "reorder", "fuse_collective"] for s in out["schedules"])
    shallow = json.loads(coconet("schedules", "examples/adam.py", "--json", "--depth", "1").stdout)
    assert [s["text"] for s in shallow["schedules"]] == [s["text"] for s in out["schedules"][: shallow["count"]]]
    assert_one_error(coconet("schedules", "examples/adam.py", "--depth", "99"), "--depth")


def test_schedules_show_and_verify():
    proc = coconet("schedules", "examples/megatron_mlp.py", "--show", "split(ar0); reorder(ag0); fuse_collective(rs0)")
    assert proc.returncode == 0, proc.stderr
    assert "[fused_collective rs0" in proc.stdout and "dropout(add0, seed, p=0.1)" in proc.stdout
    assert coconet("schedules", "examples/megatron_mlp.py", "--show", "9").stdout == proc.stdout
    assert_one_error(coconet("schedules", "examples/megatron_mlp.py", "--show", "99"), "no schedule 99")
    assert_one_error(coconet("schedules", "examples/megatron_mlp.py", "--show", "split(mm0)"), "mm0 is a matmul")
    out = json.loads(coconet("schedules", "examples/sgd.py", "--verify", "--json").stdout)
    assert out["verified"]["worlds"] == [1, 2, 3, 4]


ROOTED = """
from coconet import Local, Program, Replicated, allreduce, broadcast
p = Program("rooted", dims=("N",))
x = p.tensor("x", ("N",), layout=Local)
w = p.tensor("w", ("N",), layout=Replicated)
p.update(w, w + broadcast(x, 2) + allreduce(x))
program = p
"""


def test_a_program_broadcasting_from_rank_2_needs_3_ranks(tmp_path):
    path = tmp_path / "rooted.py"
    path.write_text(ROOTED)
    proc = coconet("schedules", path, "--verify")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1].startswith("all 9 schedules equal the program on 3-4 ranks")
    why = "statement bc0 (broadcast): broadcasts from rank 2: it needs 3 ranks at least, not 2"
    # refused before a rank starts, with or without the reference (which would say so too)
    assert_one_error(coconet("run", path, "--world", "2", "--size", "N=8", "--no-check"), why)
    assert_one_error(coconet("tune", path, "--world", "2", "--size", "N=8", "--db", "sqlite://"), why)


def test_run_json_answers_as_documented(tmp_path):
    proc = coconet(
        "run",
        "examples/sgd.py",
        "--world",
        "3",
        "--size",
        "N=100",
        "--schedule",
        "all",
        "--repeats",
        "2",
        "--warmup",
        "0",
        "--json",
        "--emit",
        tmp_path,
        "--kernels",
        "eager",
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert (out["world"], out["backend"], out["sizes"], out["program"]) == (3, "gloo", {"N": 100}, "sgd")
    space = json.loads(coconet("schedules", "examples/sgd.py", "--json").stdout)
    assert [r["schedule"] for r in out["results"]] == [s["text"] for s in space["schedules"]]
    for r in out["results"]:
        assert r["status"] == "ok" and r["correct"] is True and r["max_rel_err"] < 1e-5
        lo, hi = r["ci95_s"]
        assert 0 < lo <= r["median_s"] <= hi and r["samples"] == 2 and r["speedup"] > 0
    assert out["results"][0]["speedup"] == 1.0
    emitted = sorted(p.name for p in tmp_path.glob("sgd_*_gloo.py"))
    assert len(emitted) == space["count"]


def test_run_table_and_failure_exit_code(tmp_path):
    proc = coconet("run", "examples/adam.py", "--size", "N=2^10", "--schedule", "split(ar0)", "--repeats", "2")
    assert proc.returncode == 0, proc.stderr
    assert "baseline" in proc.stdout and "split(ar0)" in proc.stdout and "vs baseline" in proc.stdout
    program = tmp_path / "faulty_prog.py"
    program.write_text("from tests.codegen import faulty\nprogram = faulty.program(faulty.boom)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "coconet", "run", str(program), "--size", "N=6", "--no-check"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "runtime_error" in proc.stdout
    assert "rank 1 in statement boom0 (boom): RuntimeError: boom on purpose" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bench_compares_with_torch_and_the_floor(tmp_path):
    out, page = tmp_path / "adam.json", tmp_path / "adam.html"
    proc = coconet(
        "bench",
        "adam",
        "--world",
        "2",
        "--size",
        "N=2^10",
        "--size",
        "N=3000",
        "--kernels",
        "eager",
        "--repeats",
        "2",
        "--warmup",
        "1",
        "-o",
        out,
        "--plot",
        page,
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report == json.loads(out.read_text()) and report["complete"] is True
    assert report["torch_baseline"].startswith("dist.all_reduce + torch.optim.Adam(fused=True)")
    assert report["memory_bandwidth_GBps"] > 0 and len(report["points"]) == 2
    # measured before each point and after the last, and by the ranks of every launch after its timed steps;
    # the floor uses the best of them
    launches = [r["bandwidth_GBps"] for pt in report["points"] for r in [pt["torch"]] + pt["results"]]
    assert all(b > 0 for b in launches) and report["memory_bandwidth_launches_GBps"] == launches
    assert report["memory_bandwidth_GBps"] == max(report["memory_bandwidth_samples_GBps"] + launches)
    assert len(report["memory_bandwidth_samples_GBps"]) == 3
    # each sample the faster of the probe's kernels, each kernel's rates kept
    kernels = report["memory_bandwidth_kernels_GBps"]
    assert set(kernels) == {"a += b", "x += g, y += g*g, z -= g"}
    assert report["memory_bandwidth_samples_GBps"] == [max(r) for r in zip(*kernels.values())]
    assert report["backends"] == ["gloo", "shm"]
    # torch.optim leaves w whole: the schedules that shard it are not compared with it
    assert report["shardable"] == ["m", "v"]
    assert report["left_out"] and all("w" in x["sharded"] for x in report["left_out"])
    for point, n in zip(report["points"], (1024, 3000)):
        # one round: its floor at the bandwidth the best schedule's ranks measured after timing it
        bw = point["best"]["bandwidth_GBps"] * 1e9
        assert point["floor_rounds_s"] == pytest.approx([point["bytes_moved_once"] / bw])
        assert point["best_over_floor_rounds"] == pytest.approx(
            [point["best"]["median_s"] * bw / point["bytes_moved_once"]]
        )
        assert all(set(r["sharded"]) <= {"m", "v"} for r in point["results"])
        assert any(r["sharded"] == ["m", "v"] for r in point["results"])
        assert point["sizes"] == {"N": n}
        assert {r["backend"] for r in point["results"]} == {"gloo", "shm"}
        for b in ("gloo", "shm"):
            assert point[f"best_{b}"] == min(
                (r for r in point["results"] if r["backend"] == b), key=lambda r: r["median_s"]
            )
        # g on 2 ranks, w, m, v read; w written on both (it stays whole), the shardable m, v once
        assert point["bytes_moved_once"] == (2 * 4 + 3 * 4 + 2 * 4 + 2 * 4) * n
        assert (
            point["floor_s"]
            == point["memory_floor_s"]
            == pytest.approx(point["bytes_moved_once"] / (report["memory_bandwidth_GBps"] * 1e9))
        )
        assert point["compute_floor_s"] == 0.0 and point["matmul_flops_per_rank"] == 0  # Adam has no matmul
        assert point["torch"]["status"] == "ok" and point["torch"]["correct"] is True
        assert all(r["status"] == "ok" for r in point["results"])
        best = min(point["results"], key=lambda r: r["median_s"])
        assert point["best"] == best
        assert point["best_speedup"] == point["torch"]["median_s"] / best["median_s"]
    assert "Plotly.newPlot" in page.read_text() and "best schedule, shm" in page.read_text()


def bench_killed_once_written(out, written, *args) -> dict:
    """``coconet bench sgd`` killed (as the OOM killer would) as soon as ``out`` holds a report that
    ``written`` accepts."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "coconet",
            "bench",
            "sgd",
            "--world",
            "2",
            *args,
            "--kernels",
            "eager",
            "--backend",
            "shm",
            "--schedule",
            "split(ar0)",
            "--repeats",
            "2",
            "--warmup",
            "1",
            "-o",
            str(out),
        ],
        cwd=ROOT,
        env=quiet_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        # replaced whole: never half a file
        while (
            (not out.exists() or not written(json.loads(out.read_text())))
            and proc.poll() is None
            and time.monotonic() < deadline
        ):
            time.sleep(0.02)
        proc.kill()
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    report = json.loads(out.read_text())
    assert report["complete"] is False, err
    assert not list(out.parent.glob("*.partial"))
    return report


def test_bench_killed_between_points_keeps_the_points_it_made(tmp_path):
    report = bench_killed_once_written(
        tmp_path / "sgd.json", lambda r: r["points"], "--size", "N=3000", "--size", "N=5000"
    )
    (point,) = report["points"]
    assert point["sizes"] == {"N": 3000} and point["best"]["status"] == "ok" and point["rounds_done"] == 1
    assert point["floor_s"] == pytest.approx(point["bytes_moved_once"] / (report["memory_bandwidth_GBps"] * 1e9))


def test_bench_killed_within_a_round_keeps_the_results_it_had(tmp_path):
    """Killed once the baseline and the program as written are timed, before split(ar0) is: those two are in
    the report, as the round in progress, which no point's statistics take."""
    report = bench_killed_once_written(
        tmp_path / "sgd.json", lambda r: (r["round_in_progress"] or {}).get("results"), "--size", "N=3000"
    )
    assert report["points"] == []
    progress = report["round_in_progress"]
    assert progress["sizes"] == {"N": 3000} and progress["round"] == 1
    assert progress["torch"]["status"] == "ok" and progress["torch"]["schedule"].startswith("torch: ")
    as_written = progress["results"][0]
    assert as_written["schedule"] == "baseline" and as_written["status"] == "ok" and as_written["median_s"] > 0
    assert as_written["backend"] == "shm" and as_written["sharded"] == []


def test_bench_killed_between_rounds_keeps_the_rounds_it_made(tmp_path):
    """The one point of a run of three rounds, killed in its second: its first round, as a point of one."""
    report = bench_killed_once_written(
        tmp_path / "sgd.json", lambda r: r["points"], "--size", "N=3000", "--rounds", "3"
    )
    (point,) = report["points"]
    assert report["rounds"] == 3 and point["rounds_done"] == 1
    assert point["best"]["status"] == "ok" and point["torch"]["status"] == "ok"
    assert point["best_speedup"] == point["torch"]["median_s"] / point["best"]["median_s"]
    assert point["best_over_floor_rounds"] == pytest.approx([point["best"]["median_s"] / point["floor_rounds_s"][0]])


def test_bench_of_a_program_without_a_hand_written_baseline_compares_with_it_as_eager_pytorch():
    FC = "split(ar0); reorder(ag0); fuse_collective(rs0)"
    proc = coconet(
        "bench",
        "sgd",
        "--world",
        "2",
        "--size",
        "N=3000",
        "--kernels",
        "eager",
        "--backend",
        "shm",
        "--schedule",
        "split(ar0)",
        "--schedule",
        f"{FC}; fc_chunks=2",
        "--knobs",
        "all",
        "--repeats",
        "2",
        "--warmup",
        "1",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["torch_baseline"] == "eager PyTorch: a torch op per statement, torch.distributed collectives"
    assert report["rank_allocator"]
    (point,) = report["points"]
    assert point["torch"]["schedule"] == "torch: " + report["torch_baseline"]
    assert point["torch"]["status"] == "ok" and point["torch"]["correct"] is True
    # --knobs all: the schedule at every value of its knob, whatever its text gave
    assert [r["schedule"] for r in point["results"]] == ["baseline", "split(ar0)"] + [
        f"{FC}; fc_chunks={c}" for c in (1, 2, 4, 8)
    ]
    assert all(r["status"] == "ok" and r["correct"] for r in point["results"])
    assert point["best_speedup"] == point["torch"]["median_s"] / point["best"]["median_s"]


def test_bench_rounds_take_the_median_of_each_schedules_rounds():
    proc = coconet(
        "bench",
        "sgd",
        "--world",
        "2",
        "--size",
        "N=3000",
        "--kernels",
        "eager",
        "--backend",
        "shm",
        "--schedule",
        "split(ar0)",
        "--repeats",
        "2",
        "--warmup",
        "1",
        "--rounds",
        "3",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["rounds"] == 3 and len(report["memory_bandwidth_samples_GBps"]) == 4  # before each round, after
    (point,) = report["points"]
    for row in [point["torch"]] + point["results"]:
        assert len(row["round_medians_s"]) == 3 and row["samples"] == 3 * 2
        assert row["median_s"] == statistics.median(row["round_medians_s"])
    best, torch_row = point["best"], point["torch"]
    assert point["best_speedup"] == torch_row["median_s"] / best["median_s"]
    assert point["best_speedup_rounds"] == [
        t / b for t, b in zip(torch_row["round_medians_s"], best["round_medians_s"])
    ]
    # each round against the floor at the bandwidth its ranks measured right after timing the best schedule
    assert len(best["round_bandwidth_GBps"]) == 3 and best["bandwidth_GBps"] == max(best["round_bandwidth_GBps"])
    floors = [point["bytes_moved_once"] / (bw * 1e9) for bw in best["round_bandwidth_GBps"]]
    assert point["floor_rounds_s"] == pytest.approx(floors)
    assert point["best_over_floor_rounds"] == pytest.approx([m / f for m, f in zip(best["round_medians_s"], floors)])
    assert point["floor_s"] <= min(point["floor_rounds_s"]) * (1 + 1e-12)  # the run's best rate: the lowest floor

    # the table on an 80-column terminal: every figure whole, the best schedule after it in full
    from rich.console import Console

    from coconet.cli.bench import _fmt_over_floor, _fmt_speedup, _print_bench
    from coconet.cli.output import fmt_s

    big = dict(point, sizes={"B": 4, "S": 512, "H": 1024})  # the longest sizes the README's runs give
    text = io.StringIO()
    _print_bench(dict(report, points=[point, big]), Console(width=80, file=text, highlight=False))
    out = text.getvalue()
    assert all(len(line) <= 80 for line in out.splitlines()) and "…" not in out
    figures = [
        fmt_s(torch_row["median_s"]),
        fmt_s(best["median_s"]),
        fmt_s(point["floor_s"]),
        *_fmt_speedup(point).split("\n"),
        *_fmt_over_floor(point).split("\n"),
    ]
    assert len(figures) == 7
    assert all(out.count(f) >= 2 for f in figures), (figures, out)
    assert f"best at N=3000: shm  {best['schedule']}" in out


def test_a_schedule_that_failed_in_any_round_is_reported_failed():
    from coconet.tuner.bench import over_rounds

    ok = {"schedule": "s", "status": "ok", "median_s": 1.0, "ci95_s": [0.9, 1.1], "samples": 5}
    bad = dict(ok, status="timeout", median_s=None, error="rank 1 timed out")
    assert over_rounds([ok, bad, ok]) == bad
    assert over_rounds([ok]) == ok
    both = over_rounds([ok, dict(ok, median_s=3.0)])
    assert both["median_s"] == 2.0 and both["round_medians_s"] == [1.0, 3.0] and both["samples"] == 10
    assert "round_bandwidth_GBps" not in both
    probed = over_rounds([dict(ok, bandwidth_GBps=50.0), dict(ok, bandwidth_GBps=80.0)])
    assert probed["round_bandwidth_GBps"] == [50.0, 80.0] and probed["bandwidth_GBps"] == 80.0


def test_bench_errors():
    assert_one_error(coconet("bench", "nosuch", "--size", "N=4"), "no workload 'nosuch'", "adam")
    assert_one_error(
        coconet("bench", "adam", "--size", "N=4", "--shardable", "q"), "shardable q: not replicated state adam updates"
    )
    assert_one_error(coconet("bench", "adam", "--size", "M=4"), "does not have")
    assert_one_error(coconet("bench", "adam", "--size", "N=4", "--knobs", "some"), "--knobs 'some'", "default or all")
    # refused before its first point runs
    assert_one_error(coconet("bench", "adam", "--size", "N=4", "--size", "N=2^40"), "N=1099511627776", "of memory")


def test_tune_says_why_its_trials_failed(capsys):
    from coconet.cli.tune import _print_tune_table
    from coconet.loader import load_file
    from coconet.schedules.schedule import Schedule
    from coconet.tuner.launch import RunResult
    from coconet.tuner.search import Candidate, Outcome, Trial
    from coconet.tuner.tune import Tuned

    prog = load_file(ROOT / "examples" / "adam.py")

    def failed(text, error):
        s = Schedule.parse(text, prog) if text else Schedule(prog)
        return Trial(Candidate(s, "shm"), RunResult(s.text, s.hash, "runtime_error", error=error))

    trials = [
        failed(None, "rank 0: MemoryError: Unable to allocate\n 8.00 TiB"),
        failed("split(ar0)", "rank 0: MemoryError: Unable to allocate\n 8.00 TiB"),
        failed("split(ar0); reorder(ag0)", "rank 1: RuntimeError: boom"),
    ]
    tuned = Tuned({"N": 8}, Outcome("s", {"N": 8}, trials, None, None, None), 1, None)
    _print_tune_table(prog, tuned.to_json(prog, "local", 2), tuned)
    out, err = capsys.readouterr()
    assert "no schedule ran correctly: nothing recorded as the winner" in out
    assert err.splitlines() == [
        "3 trial(s) failed:",
        "  runtime_error: rank 0: MemoryError: Unable to allocate 8.00 TiB (x2, e.g. shm: baseline)",
        "  runtime_error: rank 1: RuntimeError: boom (shm: split(ar0); reorder(ag0))",
    ]


def test_a_size_too_large_for_this_machine_is_one_error():
    assert_one_error(
        coconet("run", "examples/adam.py", "--size", "N=2^40", "--world", "2"),
        "at N=1099511627776 the inputs of adam on 2 rank(s) take at least",
        "of memory",
    )
    assert_one_error(
        coconet("tune", "examples/adam.py", "--size", "N=2^40", "--world", "2", "--db", "sqlite://"),
        "take at least 32.0 TiB; this machine has",
    )


def test_a_reader_that_leaves_the_pipe_early_ends_the_command_quietly():
    env = quiet_env()
    proc = subprocess.Popen(
        [sys.executable, "-m", "coconet", "schedules", "examples/lamb.py", "--json"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    proc.stdout.close()  # as `| head -c 0` would, before anything is written
    assert proc.wait(60) == 128 + signal.SIGPIPE
    assert proc.stderr.read() == b""
    proc.stderr.close()


def test_an_answer_stdout_cannot_take_is_one_error_and_a_closed_stdout_none():
    env = quiet_env()
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [sys.executable, "-m", "coconet", "check", "examples/adam.py"],
            cwd=ROOT,
            env=env,
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 2 and proc.stderr.strip() == "error: cannot write the answer: No space left on device"
    proc = subprocess.run(
        [sys.executable, "-m", "coconet", "check", "examples/adam.py"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=60,
        preexec_fn=lambda: os.close(1),
    )
    assert proc.returncode == 0 and proc.stderr == ""


def test_tune_json_then_run_the_best(tmp_path):
    db = f"sqlite:///{tmp_path / 'coconet.db'}"
    proc = coconet(
        "tune",
        "examples/adam.py",
        "--world",
        "2",
        "--size",
        "N=2^10",
        "--budget",
        "2",
        "--kernels",
        "eager",
        "--backend",
        "gloo",
        "--db",
        db,
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["program"] == "adam" and doc["sizes"] == {"N": 1024} and doc["topology"] == "local"
    assert doc["trials"] == 2 and doc["failed"] == 0 and doc["record_id"] >= 1
    for part in ("best", "baseline"):
        assert doc[part]["median_s"] > 0 and doc[part]["ci95_s"][0] <= doc[part]["median_s"] <= doc[part]["ci95_s"][1]
    assert doc["speedup"] == pytest.approx(doc["baseline"]["median_s"] / doc["best"]["median_s"])
    # by default Adam's weights stay whole: only m and v (which torch.optim keeps to itself) may be sharded
    assert doc["shardable"] == ["m", "v"] and set(doc["best"]["sharded"]) <= {"m", "v"}
    # what tune recorded is what `run --schedule best` runs (the baseline always runs beside it)
    proc = coconet(
        "run",
        "examples/adam.py",
        "--world",
        "2",
        "--size",
        "N=2^10",
        "--schedule",
        "best",
        "--kernels",
        "eager",
        "--repeats",
        "3",
        "--db",
        db,
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    ran = [r["schedule"] for r in json.loads(proc.stdout)["results"]]
    assert ran[0] == "baseline" and ran[-1] == doc["best"]["schedule"]
    # a tuning that never tried sharding w does not answer a question allowing it
    assert_one_error(
        coconet(
            "run",
            "examples/adam.py",
            "--world",
            "2",
            "--size",
            "N=2^10",
            "--schedule",
            "best",
            "--shardable",
            "all",
            "--db",
            db,
        ),
        "leaves at most any state sharded",
        "--shardable all` first",
    )


def test_tune_killed_mid_study_resumes_without_measuring_twice(tmp_path, ray_local):
    """SIGKILL of `coconet tune` in the middle of its study, with no chance to clean up: the run again
    reuses every result the first one recorded and measures only the rest. Both join the tests' Ray cluster
    (`tune --json then run the best` starts a local one, as the README's first command does)."""
    from coconet.server.store import Store

    prog = runpy.run_path(str(ROOT / "examples" / "adam.py"))["program"].ir
    db = f"sqlite:///{tmp_path / 'coconet.db'}"
    args = [
        "tune",
        "examples/adam.py",
        "--world",
        "2",
        "--size",
        "N=2^10",
        "--budget",
        "6",
        "--kernels",
        "eager",
        "--backend",
        "gloo",
        "--db",
        db,
        "--json",
        "--ray-address",
        ray_local.get_runtime_context().gcs_address,
    ]
    env = quiet_env()
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(
            [sys.executable, "-m", "coconet", *args], cwd=ROOT, env=env, stdout=log, stderr=log, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 150
        while True:
            assert first.poll() is None, (tmp_path / "first.log").read_text()
            assert time.monotonic() < deadline, "no trial recorded in time"
            if (tmp_path / "coconet.db").exists():
                with Store.open(db) as store:
                    if len([m for m in store.measurements(prog.hash) if m.job_id is not None]) >= 2:
                        break
            time.sleep(0.2)
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
    finally:
        try:
            os.killpg(first.pid, signal.SIGKILL)  # anything it started
        except ProcessLookupError:
            pass
    with Store.open(db) as store:
        (killed,) = store.jobs()
        before = [(m.schedule_hash, m.backend) for m in store.measurements(prog.hash, job_id=killed.id)]
    assert 2 <= len(before) < 6 and len(set(before)) == len(before)

    proc = coconet(*args)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["trials"] == 6 and doc["job_id"] != killed.id
    with Store.open(db) as store:
        after = [(m.schedule_hash, m.backend) for m in store.measurements(prog.hash, job_id=doc["job_id"])]
    trials, retimed = after[: 6 - len(before)], after[6 - len(before) :]  # then the re-timing of the leaders
    assert 2 <= len(retimed) <= 3
    assert len(trials) == 6 - len(before) and not set(trials) & set(before)
    assert doc["best"]["hash"] in {h for h, _ in retimed}


def test_bench_on_nccl_without_cuda_names_the_cause():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    assert_one_error(coconet("bench", "adam", "--size", "N=8", "--backend", "nccl"), "no CUDA device")


def test_a_sweep_says_which_keys_it_left_out(tmp_path):
    config = tmp_path / "sweep.yaml"
    config.write_text(
        'programs:\n  - example: adam\n    sizes: ["N=2^10", "N=2^12"]\n'
        "topologies: [dgx-a100-8]\nworlds: {dgx-a100-8: [2, 16]}\n"
    )
    db = f"sqlite:///{tmp_path / 'c.db'}"
    proc = coconet("sweep", config, "--simulate", "--db", db)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("2 keys: 2 predicted")
    assert proc.stderr.strip().splitlines()[-1] == (
        "note: 2 keys left out: their world needs more ranks than the topology has"
    )
    doc = json.loads(coconet("sweep", config, "--simulate", "--db", db, "--json").stdout)
    assert (doc["keys"], doc["skipped"], doc["unfit"]) == (2, 2, 2)


def test_a_ratio_keeps_three_digits_or_more_and_never_an_exponent():
    from coconet.cli.output import ratio

    assert [ratio(x) for x in (1.2345, 14.93, 151.33, 1234.5, 99.96)] == ["1.23", "14.9", "151", "1234", "100.0"]


def test_a_confidence_interval_says_its_unit_once_where_its_ends_share_it():
    from coconet.cli.output import fmt_ci

    assert fmt_ci([2.02e-4, 2.73e-4]) == "202–273 us"
    assert fmt_ci([5.7e-4, 1.04e-3]) == "570 us–1.04 ms"
    assert fmt_ci(None) == "" and fmt_ci([]) == ""


def test_run_schedule_best_says_whether_it_was_measured_or_predicted(tmp_path, capsys):
    """`coconet run --schedule best` takes the store's answer: the measured winner where the key has one, and
    it says which it took; a key only predicted runs the prediction, saying so and how to measure it."""
    from coconet.api import stored_schedule
    from coconet.cli.run import _say_best
    from coconet.loader import load_file
    from coconet.schedules.space import generate
    from coconet.server.records import NewMeasurement
    from coconet.server.store import Store

    prog = load_file(ROOT / "examples" / "adam.py")
    db = f"sqlite:///{tmp_path / 'c.db'}"
    base, other, third = list(generate(prog, depth=1))[:3]
    common = dict(sizes={"N": 8}, topology="local", world=2, backend="gloo")
    with Store.open(db) as store:
        store.add_program(prog)
        ids = store.add_measurements(
            [
                NewMeasurement.of(base, median_s=3e-3, source="model", **common),
                NewMeasurement.of(
                    third,
                    median_s=1e-3,
                    source="model",
                    versions={"model": "alpha-beta roofline", "topology": "d1g"},
                    **common,
                ),
            ]
        )
        store.add_winner(ids[1], baseline_id=ids[0], shardable="m,v")

    def tuned_best() -> tuple:  # what `coconet run --schedule best` runs, and what it says of it
        sched, found = stored_schedule(prog, {"N": 8}, world=2, backend="gloo", store=db)
        _say_best(found, {"N": 8}, "gloo")
        return sched, found

    sched, found = tuned_best()
    err = capsys.readouterr().err
    assert sched.hash == third.hash and found.source == "model"
    assert (
        "--schedule best is predicted, not measured: 1 ms a step, 3.00x over the baseline by the cost model "
        "(alpha-beta roofline, topology local calibration d1g; winner record 1)"
    ) in err
    assert "coconet tune FILE --world 2 --size N=8 --backend gloo` measures it" in err
    with Store.open(db) as store:
        mid = store.add_measurement(NewMeasurement.of(other, median_s=2e-3, samples=[2e-3] * 3, **common))
        measured = store.add_winner(mid, shardable="m,v")
    sched, found = tuned_best()
    err = capsys.readouterr().err
    assert sched.hash == other.hash and found.winner.id == measured
    assert f"--schedule best is measured: 2 ms a step (winner record {measured})" in err and "predicted" not in err


def test_version_and_help_once():
    proc = coconet("--version")
    assert proc.returncode == 0 and proc.stdout.strip().startswith("coconet ")
    proc = coconet()
    assert proc.returncode == 0 and proc.stdout.count(" Usage: ") == 1 and "Commands" in proc.stdout


def test_best_and_results_read_the_store(tmp_path):
    from coconet.loader import load_file
    from coconet.schedules.space import generate
    from coconet.server.records import NewMeasurement
    from coconet.server.store import Store

    prog = load_file(ROOT / "examples" / "adam.py")
    db = f"sqlite:///{tmp_path / 'c.db'}"
    base, other = list(generate(prog, depth=1))[:2]
    ran = {
        "fingerprint": "5e1f00d5e1f0",
        "machines": "1 node: AMD EPYC, 2 CPUs, 24 GiB, x86_64, no GPU",
        "placement": "2 ranks on 1 node",
    }
    common = dict(sizes={"N": 4096}, topology="local", world=2, backend="gloo", versions=ran)
    with Store.open(db) as store:
        store.add_program(prog)
        ids = store.add_measurements(
            [
                NewMeasurement.of(base, median_s=3e-3, samples=[3e-3] * 3, **common),
                NewMeasurement.of(other, median_s=1e-3, samples=[1e-3] * 3, **common),
            ]
        )
        winner = store.add_winner(ids[1], baseline_id=ids[0], shardable="m,v")
    doc = json.loads(coconet("best", "examples/adam.py", "--size", "N=2^12", "--db", db, "--json").stdout)
    assert (doc["winner_id"], doc["source"], doc["schedule"]) == (winner, "measured", other.text)
    assert doc["machines"] == ran
    proc = coconet("best", "examples/adam.py", "--size", "N=2^13", "--db", db)
    assert proc.returncode == 0, proc.stderr
    assert f"gloo: {other.text}  1 ms  3.00x over the baseline  winner record {winner}" in proc.stdout
    assert f"ran on 2 ranks on 1 node of {ran['machines']} (fingerprint 5e1f00d5e1f0)" in proc.stdout
    assert "note: not tuned at these sizes; the winner of N=4096" in proc.stdout
    assert_one_error(
        coconet("best", "examples/adam.py", "--size", "N=2^12", "--db", db, "--source", "predicted"),
        "nothing tuned for adam on local",
    )
    doc = json.loads(coconet("results", "examples/adam.py", "--db", db, "--json").stdout)
    assert [(r["winner_id"], r["source"], r["machines"]) for r in doc["results"]] == [(winner, "measured", ran)]
    shown = coconet("results", "examples/adam.py", "--db", db).stdout
    assert "machines: fingerprint 5e1f00d5e1f0" in shown and other.text in shown and "N=4096" in shown
    assert_one_error(coconet("results", "examples/adam.py", "--db", f"sqlite:///{tmp_path / 'none.db'}"), "no store at")


def test_run_emit_standalone_writes_the_runtime_beside_the_modules(tmp_path):
    proc = coconet(
        "run",
        "examples/sgd.py",
        "--world",
        "1",
        "--size",
        "N=8",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--kernels",
        "eager",
        "--emit",
        tmp_path,
        "--standalone",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    (module,) = tmp_path.glob("sgd_*_gloo.py")
    assert "from coconet_kernels.context import Ctx as _Ctx" in module.read_text()
    assert "from coconet.kernels" not in module.read_text()
    copied = tmp_path / "coconet_kernels"
    assert (copied / "collectives.py").read_text() == (ROOT / "kernels" / "collectives.py").read_text()
    assert not (copied / "shm.py").exists()  # a gloo module imports none of the shm backend's runtime
    assert_one_error(coconet("run", "examples/sgd.py", "--size", "N=8", "--standalone"), "give --emit DIR too")


def test_results_on_a_narrow_terminal_cut_nothing():
    """Where the table would not fit, each key is a line and its schedule folds under it: sizes, the answer's
    source, time and speed-up, and the schedule are all there, whole, on a 40-column terminal."""
    import io

    from rich.console import Console

    from coconet.cli.queries import print_results

    schedule = "split(ar0); reorder(ag0); as_slice(m); as_slice(v); fuse_collective(rs0); fc_chunks=4"
    doc = {"sizes": {"N": 4194304}, "topology": "local", "world": 2, "backend": "shm", "schedule": schedule}
    doc |= {"median_s": 1.09e-3, "speedup": 1.94, "source": "measured", "machines": {"fingerprint": "5e1f00d5e1f0"}}
    for width, table in ((40, False), (200, True)):
        out = io.StringIO()
        print_results("adam", [doc], Console(file=out, width=width, highlight=False))
        text = out.getvalue()
        assert ("┃" in text) == table
        assert max(map(len, text.splitlines())) <= width
        assert "N=4194304" in text and "measured" in text and "1.09 ms" in text and "1.94x" in text
        assert schedule.replace(" ", "") in "".join(text.split())
        assert "fingerprint 5e1f00d5e1f0" in text
