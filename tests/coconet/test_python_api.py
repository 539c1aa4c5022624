"""The Python API: each function returns what its CLI command's --json prints, for the same arguments."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import coconet
from coconet.errors import CoconetError
from coconet.server.records import NewMeasurement
from coconet.server.store import Store

ROOT = Path(__file__).resolve().parents[2]
ADAM = ROOT / "examples" / "adam.py"


def cli_json(*args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "coconet", *args, "--json"], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_load_takes_files_text_mappings_and_programs(tmp_path):
    prog = coconet.load(ADAM)
    assert coconet.load(str(ADAM)).hash == prog.hash
    (tmp_path / "adam.json").write_text(coconet.export(prog))
    for source in (
        tmp_path / "adam.json",
        str(tmp_path / "adam.json"),
        coconet.export(prog),
        json.loads(coconet.export(prog)),
        prog,
    ):
        assert coconet.load(source).hash == prog.hash
    with pytest.raises(CoconetError, match="no such file"):
        coconet.load("nowhere.py")


def test_schedules_are_the_cli_s():
    assert (
        coconet.schedules(coconet.load(ADAM), depth=3) == cli_json("schedules", str(ADAM), "--depth", "3")["schedules"]
    )
    import coconet.schedules.space as space  # the package stays a package under the function

    assert space.generate is not None


def test_best_says_measured_or_predicted_and_refuses_a_miss(tmp_path):
    prog = coconet.load(ADAM)
    url = f"sqlite:///{tmp_path / 'c.db'}"
    from coconet.schedules.space import generate

    base, other = list(generate(prog, depth=1))[:2]
    common = dict(sizes={"N": 1024}, topology="local", world=2, backend="gloo")
    with Store.open(url) as store:
        store.add_program(prog)
        ids = store.add_measurements(
            [
                NewMeasurement.of(base, median_s=2e-3, samples=[2e-3] * 3, **common),
                NewMeasurement.of(other, median_s=1e-3, samples=[1e-3] * 3, **common),
                NewMeasurement.of(
                    other, median_s=1e-4, source="model", versions={"model": "alpha-beta roofline"}, **common
                ),
            ]
        )
        measured = store.add_winner(ids[1], baseline_id=ids[0], shardable="m,v")
        predicted = store.add_winner(ids[2], shardable="m,v")
    got = coconet.best(ADAM, "N=2^10", world=2, store=url)
    assert (got["winner_id"], got["source"], got["prediction"]) == (measured, "measured", None)
    assert got["speedup"] == pytest.approx(2.0) and got["schedule"] == other.text and got["exact"]
    got = coconet.best(prog, {"N": 1024}, store=url, source="predicted")
    assert (got["winner_id"], got["source"]) == (predicted, "predicted")
    assert got["prediction"]["model"] == "alpha-beta roofline"
    with pytest.raises(CoconetError, match="nothing tuned for adam on dgx"):
        coconet.best(prog, {"N": 1024}, topology="dgx", store=url)


MEASURED = ("median_s", "ci95_s", "speedup")  # what differs from one launch to the next


def test_run_gives_the_cli_s_record(tmp_path):
    """`coconet run --json` is `coconet.run` printed: for one request, the same record, the store's answer behind
    `best` included, but for the times each launch measures anew."""
    prog = coconet.load(ADAM)
    url = f"sqlite:///{tmp_path / 'c.db'}"
    from coconet.schedules.space import generate

    base, other = list(generate(prog, depth=1))[:2]
    common = dict(sizes={"N": 64}, topology="local", world=2, backend="gloo")
    with Store.open(url) as store:
        store.add_program(prog)
        ids = store.add_measurements(
            [
                NewMeasurement.of(base, median_s=2e-3, samples=[2e-3] * 3, **common),
                NewMeasurement.of(other, median_s=1e-3, samples=[1e-3] * 3, **common),
            ]
        )
        winner = store.add_winner(ids[1], baseline_id=ids[0], shardable="m,v")
    args = dict(world=2, schedules=["best", "3"], kernels="eager", repeats=2, warmup=0, store=url)
    got = coconet.run(ADAM, "N=64", **args)
    want = cli_json(
        "run", str(ADAM), "--size", "N=64", "--world", "2", "--schedule", "best", "--schedule", "3",
        "--kernels", "eager", "--repeats", "2", "--warmup", "0", "--db", url,
    )  # fmt: skip
    assert [r["schedule"] for r in got["results"]] == ["baseline", other.text, list(generate(prog))[3].text]
    assert all(r["status"] == "ok" and r["correct"] for r in got["results"])
    assert [r["id"] for r in got["results"]] == [0, 1, 3]
    assert got["best"] == {
        "schedule": other.text,
        "hash": other.hash,
        "source": "measured",
        "exact": True,
        "tuned_sizes": {"N": 64},
        "winner_id": winner,
        "median_s": 1e-3,
        "speedup": pytest.approx(2.0),
    }

    def unmeasured(doc: dict) -> dict:
        return {**doc, "results": [{k: v for k, v in r.items() if k not in MEASURED} for r in doc["results"]]}

    assert unmeasured(got) == unmeasured(want)
    assert [list(r) for r in got["results"]] == [list(r) for r in want["results"]]  # the same keys, in order


def test_sweep_is_the_cli_s(tmp_path):
    config = tmp_path / "sweep.yaml"
    config.write_text('programs:\n  - example: adam\n    sizes: ["N=2^10", "N=2^12"]\ntopologies: [dgx-h100-8]\n')
    got = coconet.sweep(config, simulate=True, store=f"sqlite:///{tmp_path / 'a.db'}")
    want = cli_json("sweep", str(config), "--simulate", "--db", f"sqlite:///{tmp_path / 'b.db'}")
    assert (got["keys"], got["predicted"]) == (want["keys"], want["predicted"]) == (2, 2)
    again = coconet.sweep(config, simulate=True, store=f"sqlite:///{tmp_path / 'a.db'}")
    assert again["skipped"] == 2


def test_tune_records_and_best_answers(ray_local, tmp_path):
    url = f"sqlite:///{tmp_path / 'c.db'}"
    doc = coconet.tune(ADAM, "N=2^10", world=2, budget=2, backends=["gloo"], kernels="eager", store=url)
    assert doc["best"] is not None and doc["trials"] == 2 and doc["record_id"] is not None
    got = coconet.best(ADAM, {"N": 1024}, world=2, store=url)
    assert got["winner_id"] == doc["record_id"] and got["source"] == "measured"


def test_an_examples_name_is_the_example_wherever_coconet_is_installed(tmp_path, monkeypatch):
    """ "adam" names examples/adam.py (coconet/examples in a wheel) for load, compile and optim alike; a file of
    that name in the working directory comes first; an unknown name lists the examples."""
    monkeypatch.chdir(tmp_path)
    assert coconet.load("adam").hash == coconet.load(ADAM).hash
    step = coconet.compile("sgd", {"N": 64}, schedule="baseline", world=2, rank=1)
    assert step.schedule.program.name == coconet.load(ROOT / "examples" / "sgd.py").name
    assert coconet.optim._program_file("adamw")[0].hash == coconet.load(ROOT / "examples/optim/adamw.py").hash
    (tmp_path / "adam").write_text("not a program")  # a file named so: it is what the caller means
    with pytest.raises(CoconetError):
        coconet.load("adam")
    with pytest.raises(CoconetError, match=r"adan: no such file, nor an example of that name \(adam, adam_multi"):
        coconet.compile("adan", {"N": 64}, schedule="baseline", world=2, rank=1)
