"""Election: ballots rank by (may lead, priority, speed, smaller id); epochs refuse the past."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edgetp.cluster.election import (
    Ballot, Elector, EpochConflict, EpochState, LeaderChanged, StaleEpoch, Term, elect,
)

ids = st.text(alphabet="abcdefgh0123456789-", min_size=1, max_size=8)
ballot = st.builds(Ballot, priority=st.integers(-3, 3), speed=st.sampled_from([0.0, 1e8, 2e8, 3.5e9]),
                   node_id=ids, can_lead=st.booleans())
# A live set: one ballot per node id.
live_sets = st.lists(ballot, max_size=12, unique_by=lambda b: b.node_id)


def reference_winner(ballots):
    """The rule written out independently: filter, then sort by the documented keys."""
    eligible = [b for b in ballots if b.can_lead]
    if not eligible:
        return None
    eligible.sort(key=lambda b: b.node_id)                             # smaller id first ...
    eligible.sort(key=lambda b: (b.priority, b.speed), reverse=True)   # ... within equal rank (stable)
    return eligible[0].node_id


def test_higher_priority_beats_higher_speed():
    assert elect([Ballot(1, 1e6, "slow"), Ballot(0, 9e9, "fast")]) == "slow"


def test_at_equal_priority_the_faster_node_wins():
    assert elect([Ballot(0, 1e6, "a"), Ballot(0, 2e6, "b")]) == "b"


def test_a_full_tie_goes_to_the_smaller_node_id():
    assert elect([Ballot(0, 1e6, "b"), Ballot(0, 1e6, "a")]) == "a"
    assert Ballot(0, 1e6, "a") > Ballot(0, 1e6, "b")


def test_a_no_root_node_never_wins_even_with_the_best_ballot():
    assert elect([Ballot(9, 9e9, "best", can_lead=False), Ballot(0, 1.0, "meek")]) == "meek"
    assert elect([Ballot(9, 9e9, "best", can_lead=False)]) is None
    assert elect([]) is None


def test_a_ballot_with_a_non_finite_speed_is_refused():
    with pytest.raises(ValueError):
        Ballot(0, float("nan"), "x")
    with pytest.raises(ValueError):
        Ballot(0, float("inf"), "x")


@given(live_sets)
def test_the_winner_is_the_greatest_eligible_ballot_by_the_documented_rule(ballots):
    assert elect(ballots) == reference_winner(ballots)
    eligible = [b for b in ballots if b.can_lead]
    if eligible:
        winner = next(b for b in eligible if b.node_id == elect(ballots))
        assert all(winner >= b for b in eligible)


@given(live_sets)
def test_no_root_nodes_never_win(ballots):
    winner = elect(ballots)
    assert winner is None or all(b.can_lead for b in ballots if b.node_id == winner)
    assert (winner is None) == (not any(b.can_lead for b in ballots))


@given(live_sets, st.randoms(use_true_random=False))
def test_the_result_does_not_depend_on_the_order_of_the_ballots(ballots, rnd):
    shuffled = list(ballots)
    rnd.shuffle(shuffled)
    assert elect(shuffled) == elect(ballots)


@given(live_sets, st.randoms(use_true_random=False), st.integers(0, 5), st.integers(0, 5))
def test_two_nodes_seeing_the_same_live_set_agree_on_the_root(ballots, rnd, epoch_a, epoch_b):
    # Two electors with different histories (epochs) and different snapshot orders.
    other = list(ballots)
    rnd.shuffle(other)
    a = Elector(lambda: ballots, state=EpochState(Term("old", epoch_a)))
    b = Elector(lambda: other, state=EpochState(Term(None, epoch_b)))
    a.step(), b.step()
    assert a.state.leader == b.state.leader == elect(ballots)


@given(st.integers(0, 100), st.integers(1, 100), ids, ids)
def test_a_message_stamped_with_an_older_epoch_is_refused(current, back, leader, old_leader):
    state = EpochState(Term(leader, current + back))
    assert state.observe(old_leader, current) is False
    with pytest.raises(StaleEpoch) as e:
        state.require(old_leader, current)
    assert e.value.current == current + back
    assert state.term == Term(leader, current + back)  # unchanged


def test_a_newer_epoch_is_adopted_and_the_same_term_is_accepted_again():
    state = EpochState()
    assert state.observe("a", 1) and state.term == Term("a", 1)
    assert state.observe("a", 1)
    assert state.observe("b", 3) and state.term == Term("b", 3)


def test_a_second_leader_claiming_the_current_epoch_is_refused():
    state = EpochState(Term("a", 4))
    with pytest.raises(EpochConflict):
        state.require("b", 4)
    assert state.observe("b", 4) is False


def test_after_a_partition_the_old_roots_messages_are_refused_by_nodes_that_moved_on():
    # a leads epoch 1; it is cut off; b and c elect b for epoch 2; a still stamps epoch 1.
    worker = EpochState()
    assert worker.observe("a", 1)
    assert worker.next_epoch("b") == 2
    assert not worker.observe("a", 1)
    assert worker.observe("b", 2)


def test_a_new_root_starts_past_every_epoch_it_has_seen():
    root = EpochState(Term("a", 2))
    try:
        EpochState(Term("z", 7)).require("b", 3)
    except StaleEpoch as exc:
        assert root.next_epoch("b", seen=exc.current) == 8
    assert EpochState(Term("x", 5)).observe("b", 8)


def test_step_reports_a_change_only_when_the_root_changes_and_bumps_the_epoch():
    live = [Ballot(0, 2.0, "a"), Ballot(0, 1.0, "b")]
    el = Elector(lambda: live)
    assert el.step() == LeaderChanged("a", 1)
    assert el.step() is None
    live.pop(0)  # a is gone
    assert el.step() == LeaderChanged("b", 2)
    live.clear()
    assert el.step() == LeaderChanged(None, 2)
    live.append(Ballot(0, 1.0, "c"))
    assert el.step() == LeaderChanged("c", 3)


@pytest.mark.asyncio
async def test_the_elector_loop_reports_a_new_root_at_once_when_poked():
    live = [Ballot(0, 2.0, "a"), Ballot(0, 1.0, "b")]
    el = Elector(lambda: live, interval=60.0)  # the tick would never come in time
    changes = el.changes()
    try:
        assert await asyncio.wait_for(anext(changes), 1.0) == LeaderChanged("a", 1)
        live.pop(0)
        el.poke()
        assert await asyncio.wait_for(anext(changes), 1.0) == LeaderChanged("b", 2)
    finally:
        await changes.aclose()


@pytest.mark.asyncio
async def test_the_elector_loop_notices_a_change_on_its_tick():
    live = [Ballot(0, 1.0, "a")]
    el = Elector(lambda: live, interval=0.01)
    changes = el.changes()
    try:
        assert await asyncio.wait_for(anext(changes), 1.0) == LeaderChanged("a", 1)
        live[0] = Ballot(5, 1.0, "b")
        assert await asyncio.wait_for(anext(changes), 1.0) == LeaderChanged("b", 2)
    finally:
        await changes.aclose()
