"""The bench harness's settings: what it refuses, by name, before any rank starts (the harness's runs are
checked through `coconet bench` in tests/coconet/test_cli.py)."""

import pytest

from coconet.errors import CoconetError
from coconet.tuner.bench import BenchSettings


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"backends": ("gloo", "tcp")}, "unknown backend 'tcp' (use gloo, nccl, shm)"),
        ({"backends": ()}, "no backend to bench on"),
        ({"knobs": "some"}, "--knobs 'some': use default or all"),
        ({"backends": ("nccl", "shm", "gloo")}, "--backend nccl runs on CUDA tensors and shm, gloo on CPU tensors"),
    ],
)
def test_settings_refuse_what_cannot_be_benched(kwargs, words):
    with pytest.raises(CoconetError) as caught:
        BenchSettings(**kwargs)
    assert words in str(caught.value)


def test_settings_take_each_backend_once_and_the_device_their_tensors_live_on():
    s = BenchSettings(backends=("shm", "gloo", "shm"))
    assert s.backends == ("shm", "gloo") and s.device == "cpu"
    assert BenchSettings(backends=("nccl", "nccl")).device == "cuda"
