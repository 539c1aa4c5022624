import pytest
from hypothesis import given
from hypothesis import strategies as st

from coconet.errors import SizeError
from coconet.schedules.dims import Dim, parse_dim, parse_sizes


@pytest.mark.parametrize("a,b", [("4*H", "H*4"), ("N+1", "1 + N"), ("2*N - N", "N"), ("N*M", "M*N"), (8, "2*4")])
def test_normal_form(a, b):
    assert parse_dim(a) == parse_dim(b)
    assert str(parse_dim(a)) == str(parse_dim(b))


def test_text_and_value():
    assert str(parse_dim("H*4 + 1")) == "4*H + 1"
    assert parse_dim("N").value is None
    assert parse_dim(7).value == 7
    assert parse_dim("3*N - 1").evaluate({"N": 5}) == 14
    assert parse_dim("N").to_json() == "N" and parse_dim(3).to_json() == 3


@pytest.mark.parametrize("bad", ["N/2", "N**2", "f(N)", "", "N +", True, 1.5, 0, -3, "x" * 100])
def test_bad_dims(bad):
    with pytest.raises(ValueError):
        parse_dim(bad)


def test_known_names():
    with pytest.raises(ValueError, match="not among"):
        parse_dim("N+K", ("N",))


@given(st.integers(1, 50), st.integers(1, 50), st.integers(-5, 5), st.integers(-5, 5))
def test_arithmetic_matches_integers(n, m, a, b):
    d = parse_dim(f"{a}*N*M + {b}*N + M") if a or b else parse_dim("M")
    assert d.evaluate({"N": n, "M": m}) == a * n * m + b * n + m
    assert parse_dim(str(d)) == d


def test_parse_sizes():
    assert parse_sizes(["N=2^20"]) == {"N": 2**20}
    assert parse_sizes(["B=8,S=1024", "H=3072"], ("B", "S", "H")) == {"B": 8, "S": 1024, "H": 3072}


@pytest.mark.parametrize(
    "spec,dims,fragment",
    [
        ("N", None, "NAME=VALUE"),
        ("N=abc", None, r"integer or 2\^k"),
        ("N=0", None, "positive"),
        ("N=2^70", None, "too large"),
        ("N=2^41", None, r"larger than 2\^40"),
        ("N=1,N=2", None, "given twice"),
        ("N=4", ("N", "M"), "no size given for M"),
        ("N=4,K=2", ("N",), "does not have"),
    ],
)
def test_bad_sizes(spec, dims, fragment):
    with pytest.raises(SizeError, match=fragment):
        parse_sizes([spec], dims)


def test_dim_ordering_is_total():
    assert sorted([parse_dim("N"), parse_dim(3), parse_dim("2*N")])
    assert isinstance(parse_dim("N"), Dim)
