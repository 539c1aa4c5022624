"""What a tuning question lets stay sharded, and which winners answer which questions."""

import runpy
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coconet.errors import CoconetError
from coconet.schedules import shardable as shard
from coconet.schedules.space import generate

ROOT = Path(__file__).parents[2]


def example(name):
    return runpy.run_path(str(ROOT / "examples" / f"{name}.py"))["program"].ir


ADAM = example("adam")
SPACE = generate(ADAM).schedules


def test_names_round_trip_through_their_text():
    assert shard.candidates(ADAM) == ("m", "v", "w")
    assert shard.candidates(example("megatron_mlp")) == ()  # updates nothing it holds Replicated
    assert shard.resolve(ADAM, ["v,m"]) == shard.resolve(ADAM, ["m", "v"]) == {"m", "v"}
    assert shard.resolve(ADAM, ["all"]) == {"m", "v", "w"}
    assert shard.to_text(ADAM, {"v", "m"}) == "m,v" and shard.to_text(ADAM, ()) == ""
    assert shard.to_text(ADAM, {"m", "v", "w"}) == shard.EVERY  # every state is what old records searched
    assert shard.to_text(example("megatron_mlp"), ()) == shard.EVERY
    assert shard.names("m,v") == {"m", "v"} and shard.names("") == frozenset() and shard.names("*") is None
    # as a user writes it, and back
    assert shard.spelled("m,v") == ("m", "v") and shard.spelled("") == () and shard.spelled("*") == ("all",)
    for text in ("m,v", "", "*", "w"):
        assert shard.to_text(ADAM, shard.resolve(ADAM, shard.spelled(text))) == text


@pytest.mark.parametrize(
    "names, why",
    [
        (["g"], "shardable g: not replicated state adam updates (it can shard m, v, w"),
        (["m", "beta1"], "shardable beta1: not replicated"),
    ],
)
def test_names_outside_the_program_state_are_refused(names, why):
    with pytest.raises(CoconetError, match=why.replace("(", r"\(")):
        shard.resolve(ADAM, names)


@pytest.mark.parametrize("text", ["m,", ",m", "m v", "**", "m;v", None])
def test_malformed_texts_are_refused(text):
    with pytest.raises(CoconetError, match="is not `\\*` or state names"):
        shard.names(text)


questions = st.one_of(
    st.just(shard.EVERY), st.sets(st.sampled_from(["m", "v", "w"])).map(lambda s: shard.to_text(ADAM, s))
)


def space_of(text):
    allowed = shard.names(text)
    return {s.hash for s in SPACE if allowed is None or set(s.sharded) <= allowed}


@settings(max_examples=200, deadline=None)
@given(tuned=questions, asked=questions, winner=st.sampled_from(SPACE))
def test_a_winner_answers_only_questions_whose_space_it_is_in_and_its_search_covered(tuned, asked, winner):
    # the oracle is the schedule space itself: the winner is a schedule the question allows, and the search that
    # found it tried every schedule the question allows
    if winner.hash not in space_of(tuned):
        return  # a search never finds a schedule outside its own space
    if shard.answers(tuned, asked, winner.sharded):
        assert winner.hash in space_of(asked) and space_of(asked) <= space_of(tuned)


def test_a_winner_answers_every_question_its_search_covered_by_name():
    zero1 = next(s for s in SPACE if set(s.sharded) == {"m", "v"})
    assert shard.answers("*", "m,v", zero1.sharded) and shard.answers("m,v", "m,v", zero1.sharded)
    assert shard.answers("m,v,w", "m,v", zero1.sharded) and shard.answers("*", "*", zero1.sharded)
    assert shard.answers("m,v", "", ()) and shard.answers("*", "", ())
    assert not shard.answers("m,v", "*", zero1.sharded)  # never tried sharding w
    assert not shard.answers("*", "m", zero1.sharded) and not shard.answers("", "m,v", ())
