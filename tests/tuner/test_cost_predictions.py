"""The cost model's predictions hold still: every schedule of the adam and megatron_mlp examples, on each backend,
is predicted what ``tests/data/cost_predictions.json`` records (written by ``tests/tuner/cost_predictions.py``
before the lowering's decisions moved into one plan). A change meant to move them rewrites the file."""

import json

from tests.tuner.cost_predictions import FIXTURE, predictions


def test_every_prediction_is_the_recorded_one():
    recorded = json.loads(FIXTURE.read_text())
    now = predictions()
    assert now.keys() == recorded.keys()
    moved = {k: (recorded[k], v) for k, v in now.items() if v != recorded[k]}
    assert not moved, f"{len(moved)} predictions moved, e.g. {next(iter(moved.items()))}"
    assert len({round(v, 12) for v in now.values()}) > len(now) // 4  # they tell schedules apart
