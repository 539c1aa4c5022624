"""coconet sweep: keys expanded from a config, predicted by the cost model into the store, resumed."""

import pytest

from coconet.errors import CoconetError
from coconet.schedules.schedule import sharded_by
from coconet.server.store import Store
from coconet.tuner.sweep import SweepConfig, expand_sizes, sweep


def test_expand_sizes():
    assert expand_sizes("N=2^10..2^12", ("N",)) == [{"N": 1024}, {"N": 2048}, {"N": 4096}]
    assert [s["N"] for s in expand_sizes("N=1024..2048:2", ("N",))] == [1024, 1448, 2048]
    got = expand_sizes("B=2,S=4..8,H=16..32", ("B", "S", "H"))
    assert got == [
        {"B": 2, "S": 4, "H": 16},
        {"B": 2, "S": 4, "H": 32},
        {"B": 2, "S": 8, "H": 16},
        {"B": 2, "S": 8, "H": 32},
    ]
    with pytest.raises(CoconetError, match="must go up"):
        expand_sizes("N=2^12..2^10", ("N",))


def write(tmp_path, text):
    path = tmp_path / "sweep.yaml"
    path.write_text(text)
    return path


def test_a_simulated_sweep_lands_in_the_store_and_resumes(tmp_path):
    cfg = SweepConfig.load(
        write(
            tmp_path,
            """
programs:
  - example: adam
    sizes: ["N=2^10..2^14"]
  - example: megatron_mlp
    sizes: ["B=2,S=64,H=64..128"]
topologies: [dgx-h100-8, cpu-25gbe, local]
worlds: {dgx-h100-8: [2, 8], local: [2]}
""",
        )
    )
    with Store.open(f"sqlite:///{tmp_path / 'c.db'}") as store:
        report = sweep(cfg, store, simulate=True)
        # adam: 5 sizes, megatron: 2; dgx-h100-8 at 2 worlds, cpu-25gbe at its full world, local at 2
        assert report.keys == report.predicted == (5 + 2) * (2 + 1 + 1)
        prog = cfg.entries[0].program
        winners = store.winners(prog.hash)
        assert len(winners) == 5 * 4 and {w.source for w in winners} == {"model"}
        best = store.best(prog.hash, {"N": 4096}, "dgx-h100-8", 8)
        assert best.exact and best.source == "model" and best.winner.backend == "nccl"
        assert best.baseline.schedule == "baseline" and best.speedup >= 1.0
        assert best.runner_up.median_s >= best.median_s
        # Adam's default: the weights stay whole, only m and v may be sharded
        assert {w.shardable for w in winners} == {"m,v"}
        assert all(set(sharded_by(store.measurement(w.measurement_id).schedule)) <= {"m", "v"} for w in winners)
        again = sweep(cfg, store, simulate=True)
        assert again.skipped == report.keys and again.predicted == 0
        assert len(store.winners(prog.hash)) == 5 * 4


def test_a_sweep_entry_says_what_may_stay_sharded(tmp_path):
    cfg = SweepConfig.load(
        write(
            tmp_path,
            """
programs:
  - example: adam
    sizes: ["N=2^12"]
    shardable: all
  - example: adam
    sizes: ["N=2^12"]
    shardable: []
topologies: [dgx-h100-8]
worlds: {dgx-h100-8: [8]}
""",
        )
    )
    assert [e.shardable for e in cfg.entries] == ["*", ""]
    with Store.open(f"sqlite:///{tmp_path / 'c.db'}") as store:
        report = sweep(cfg, store, simulate=True)
        assert report.predicted == 2  # the same key twice, one per question: not taken for done
        h = cfg.entries[0].program.hash
        whole = store.best(h, {"N": 4096}, "dgx-h100-8", 8, shardable="")
        assert whole.winner.shardable == "" and sharded_by(whole.schedule) == []
        assert store.best(h, {"N": 4096}, "dgx-h100-8", 8, shardable="*").winner.shardable == "*"


@pytest.mark.parametrize(
    "text, message",
    [
        ("programs: []\ntopologies: [local]\n", "programs: List should have at least 1 item"),
        ("programs:\n  - example: nope\n    sizes: [N=4]\ntopologies: [local]\n", "no example 'nope'"),
        ("programs:\n  - example: adam\n    sizes: [N=4]\ntopologies: [local]\nbudget: 0\n", "budget"),
        ("programs:\n  - example: adam\n    sizes: [N=4]\ntopologies: [local]\ncolour: red\n", "unknown key 'colour'"),
        ("programs:\n  - example: adam\n    sizes: [Q=4]\ntopologies: [local]\n", "Q"),
        (
            "programs:\n  - example: adam\n    sizes: [N=4]\n    shardable: [g]\ntopologies: [local]\n",
            r"programs\[0\]: shardable g: not replicated state adam updates",
        ),
        (
            "programs:\n  - example: adam\n    sizes: [N=4]\n    shardable: [1]\ntopologies: [local]\n",
            r"programs\[0\].shardable\[0\]: Input should be a valid string",
        ),
        ("programs:\n  - sizes: [N=4]\ntopologies: [local]\n", r"programs\[0\]: Value error, give `example: NAME`"),
        ("programs:\n  - example: adam\n    sizes: []\ntopologies: [local]\n", r"programs\[0\].sizes: List should"),
        (
            "programs:\n  - example: adam\n    sizes: [N=4]\ntopologies: [local]\nworlds: {local: [0]}\n",
            r"worlds.local\[0\]: Input should be greater than 0",
        ),
        ("- 1\n", "Input should be a valid dictionary"),
    ],
)
def test_bad_configs_name_the_cause(tmp_path, text, message):
    with pytest.raises(CoconetError, match=message):
        SweepConfig.load(write(tmp_path, text))


def test_a_measured_sweep_leaves_out_the_local_keys_this_machine_cannot_hold(tmp_path):
    from coconet.tuner.tune import Request, check

    cfg = SweepConfig.load(
        write(
            tmp_path,
            """
programs:
  - example: sgd
    sizes: ["N=2^10", "N=2^38", "N=2^12", "N=2^40"]
topologies: [local]
worlds: {local: [2]}
""",
        )
    )
    tuned = []

    def tune_key(entry, sizes, world):
        check(Request(entry.program, (sizes,), world, backends=("gloo",)))  # what tune asks before it starts
        tuned.append(sizes["N"])

    with Store.open(f"sqlite:///{tmp_path / 'c.db'}") as store:
        report = sweep(cfg, store, tune_key=tune_key)
    assert tuned == [2**10, 2**12] and report.measured == 2 and report.too_large == 2
    assert "at N=274877906944 the inputs of sgd on 2 rank(s) take at least" in report.too_large_why
    assert report.to_json()["too_large"] == 2


def test_a_simulated_sweep_leaves_measured_keys_alone(tmp_path):
    """The README's sequence: a key tuned (measured) on `local`, then a simulated sweep over the same store.
    The measured key gets no prediction, the sweep says how many it left alone, and the store's answer for
    the key is still the measurement."""
    from coconet.server.records import NewMeasurement

    cfg = SweepConfig.load(
        write(
            tmp_path,
            """
programs:
  - example: adam
    sizes: ["N=2^16", "N=2^18"]
topologies: [local]
worlds: {local: [2]}
""",
        )
    )
    prog = cfg.entries[0].program
    with Store.open(f"sqlite:///{tmp_path / 'c.db'}") as store:
        store.add_program(prog)
        mid = store.add_measurement(
            NewMeasurement(
                program_hash=prog.hash,
                sizes={"N": 2**16},
                topology="local",
                world=2,
                backend="gloo",
                schedule="baseline",
                schedule_hash="b",
                median_s=1.89e-3,
                samples=[1.89e-3] * 3,
            )
        )
        measured = store.add_winner(mid, shardable=cfg.entries[0].shardable)
        report = sweep(cfg, store, simulate=True)
        assert (report.keys, report.kept_measured, report.predicted) == (2, 1, 1)
        assert report.to_json()["kept_measured"] == 1
        assert [w.source for w in store.winners(prog.hash, {"N": 2**16})] == ["measured"]
        best = store.best(prog.hash, {"N": 2**16}, "local", 2)
        assert best.winner.id == measured and best.source == "measured"
        assert store.best(prog.hash, {"N": 2**18}, "local", 2).source == "model"


def test_the_published_schema_is_the_configs():
    """docs/sweep-config.schema.json is what the loader validates against: regenerated when the model changes
    (python -c "import json; from coconet.tuner.sweep import SweepFile; print(json.dumps(
    SweepFile.model_json_schema(), indent=2))" > docs/sweep-config.schema.json)."""
    import json
    from pathlib import Path

    from coconet.tuner.sweep import SweepFile

    published = Path(__file__).resolve().parents[2] / "docs" / "sweep-config.schema.json"
    assert json.loads(published.read_text()) == SweepFile.model_json_schema()
