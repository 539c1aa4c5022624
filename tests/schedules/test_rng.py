import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coconet.schedules import rng
from coconet.schedules.interp import slice_bounds

# Random123's kat_vectors, the three philox4x32 10 lines: counter, key -> output.
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize("counter,key,want", KAT)
def test_known_answers(counter, key, want):
    assert rng.philox4x32_10(np.array(counter, dtype=np.uint32), key).tolist() == list(want)


def test_words_follow_the_counter_layout():
    seed = 0x0123456789ABCDEF
    g = np.array([0, 1, 2, 3, 4, 7, 2**34 + 5])
    words = rng.random_bits(seed, g)
    for gi, w in zip(g.tolist(), words.tolist()):
        b = gi // 4
        block = rng.philox4x32_10(
            np.array([b & 0xFFFFFFFF, b >> 32, 0, 0], dtype=np.uint32), (seed & 0xFFFFFFFF, seed >> 32)
        )
        assert w == int(block[gi % 4])


@st.composite
def boxes(draw):
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=0, max_size=3)))
    region = []
    for n in shape:
        a = draw(st.integers(0, n))
        b = draw(st.integers(a, n))
        region.append(slice(a, b))
    return shape, tuple(region)


@settings(max_examples=200, deadline=None)
@given(boxes(), st.integers(0, 2**64 - 1), st.sampled_from([0.0, 0.1, 0.5, 0.9]))
def test_mask_of_a_region_is_the_region_of_the_mask(box, seed, p):
    shape, region = box
    full = rng.dropout_mask(seed, p, shape)
    assert np.array_equal(rng.dropout_mask(seed, p, shape, region), full[region])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=3), st.integers(1, 4), st.data())
def test_mask_of_rank_slices_reassembles(shape, world, data):
    dim = data.draw(st.integers(0, len(shape) - 1))
    seed = data.draw(st.integers(0, 2**63))
    full = rng.dropout_mask(seed, 0.3, tuple(shape))
    parts = []
    for r in range(world):
        region = [slice(0, n) for n in shape]
        region[dim] = slice(*slice_bounds(shape[dim], world, r))
        parts.append(rng.dropout_mask(seed, 0.3, tuple(shape), tuple(region)))
    assert np.array_equal(np.concatenate(parts, axis=dim), full)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_keep_rate(p):
    n = 2**20
    kept = rng.dropout_mask(42, p, (n,)).mean()
    sigma = np.sqrt(p * (1 - p) / n)
    assert abs(kept - (1 - p)) < 6 * sigma


def test_seeds_and_indices_decorrelate():
    a = rng.dropout_mask(1, 0.5, (4096,))
    b = rng.dropout_mask(2, 0.5, (4096,))
    assert 0.4 < (a == b).mean() < 0.6
    high = rng.keep_mask(1, 0.5, np.arange(2**40, 2**40 + 4096))
    assert 0.4 < (a == high).mean() < 0.6


def test_thresholds():
    assert rng.threshold(0.0) == 0 and rng.threshold(0.5) == 2**23
    assert rng.dropout_mask(3, 0.0, (1000,)).all()
    for bad in (-0.1, 1.0, 2, float("nan")):
        with pytest.raises(ValueError):
            rng.threshold(bad)
    for bad in (-1, 2**64, 1.5, True):
        with pytest.raises(ValueError):
            rng.random_bits(bad, [0])


def test_empty_and_scalar_regions():
    assert rng.dropout_mask(1, 0.5, (3, 4), (slice(1, 1), slice(0, 4))).shape == (0, 4)
    assert rng.dropout_mask(1, 0.5, ()).shape == ()
    assert rng.global_index((2, 3), (slice(1, 2), slice(1, 3))).tolist() == [[4, 5]]
