"""Election: ballots rank by (may lead, priority, speed, smaller id); epochs mean the same everywhere
and refuse the past."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edgetp.cluster.election import (
    Ballot, Elector, EpochConflict, EpochState, LeaderChanged, StaleEpoch, Term, elect, next_term,
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
    a, b = Elector("x", lambda: ballots), Elector("y", lambda: other)
    a.term, b.term = Term("old", epoch_a), Term(None, epoch_b)
    a.step(), b.step()
    assert a.term.leader == b.term.leader == elect(ballots)


@given(st.integers(0, 100), st.integers(1, 100), ids, ids)
def test_a_message_stamped_with_an_older_epoch_is_refused(current, back, leader, old_leader):
    state = EpochState(Term(leader, current + back))
    with pytest.raises(StaleEpoch) as e:
        state.require(old_leader, current)
    assert e.value.current == current + back
    assert state.term == Term(leader, current + back)  # unchanged


def test_a_newer_epoch_is_adopted_and_the_same_term_is_accepted_again():
    state = EpochState()
    state.require("a", 1)
    assert state.term == Term("a", 1)
    state.require("a", 1)
    state.require("b", 3)
    assert state.term == Term("b", 3)


def test_a_second_leader_claiming_the_current_epoch_is_refused():
    state = EpochState(Term("a", 4))
    with pytest.raises(EpochConflict):
        state.require("b", 4)
    assert state.term == Term("a", 4)


# --------------------------------------------------------------------------- next_term


def test_a_new_root_takes_one_past_every_epoch_it_has_seen():
    claims = {"b": Term("b", 7), "c": Term("b", 7), "d": Term(None, 2)}
    assert next_term(Term(None, 0), "a", "a", claims) == Term("a", 8)


def test_a_rebooted_root_climbs_past_the_cluster_and_then_holds_its_term():
    # it elected itself alone at epoch 1, then sees the cluster that moved on to b's epoch 5
    mine = next_term(Term("a", 1), "a", "a", {"b": Term("b", 5), "c": Term("b", 5)})
    assert mine == Term("a", 6)
    followers = {"b": Term("a", 6), "c": Term("a", 6)}
    assert next_term(mine, "a", "a", followers) == mine


def test_a_root_that_sees_its_epoch_claimed_by_another_leader_moves_past_it():
    assert next_term(Term("a", 4), "a", "a", {"b": Term("b", 4)}) == Term("a", 5)
    assert next_term(Term("a", 4), "a", "a", {"b": Term(None, 4)}) == Term("a", 4)


def test_a_follower_takes_its_leaders_epoch_once_claimed_and_never_goes_down():
    assert next_term(Term("b", 5), "c", "a", {"a": Term("a", 6)}) == Term("a", 6)
    assert next_term(Term(None, 5), "c", "a", {"a": Term("a", 5)}) == Term("a", 5)
    assert next_term(Term("a", 5), "c", "a", {"a": Term("a", 5)}) == Term("a", 5)
    # not claimed yet: named at once, past the epoch held under b
    assert next_term(Term("b", 5), "c", "a", {"a": Term("b", 5)}) == Term("a", 6)
    assert next_term(Term(None, 5), "c", "a", {}) == Term("a", 5)
    # an epoch held here under another leader, or one below it, is not taken from a's claim ...
    assert next_term(Term("b", 5), "c", "a", {"a": Term("a", 5)}) == Term("a", 6)
    assert next_term(Term("b", 9), "c", "a", {"a": Term("a", 6)}) == Term("a", 10)
    assert next_term(Term("a", 9), "c", "a", {"a": Term("a", 6)}) == Term("a", 9)
    # ... and a, seeing a follower of its own above its epoch, climbs past it; then the follower takes it
    assert next_term(Term("a", 6), "a", "a", {"c": Term("a", 10)}) == Term("a", 11)
    assert next_term(Term("a", 10), "c", "a", {"a": Term("a", 11)}) == Term("a", 11)


def test_a_preferred_root_booting_late_is_admitted_by_the_worker_that_followed_the_stand_in():
    """After a power cut pw-2 and pw-3 come back first: pw-2 leads epoch 1 and pw-3's worker admits its
    HELLO. pw-1, preferred, boots later and elects itself before it hears any term: epoch 1 as well.
    pw-2 and pw-3 hear its claim before it hears theirs. The cluster must settle in an epoch pw-3's
    worker admits, not leave it refusing pw-1 for good (seen in a restart probe, 4 of 4)."""
    held = {"pw-1": next_term(Term(), "pw-1", "pw-1", {}), "pw-2": Term("pw-2", 1), "pw-3": Term("pw-2", 1)}
    assert held["pw-1"] == Term("pw-1", 1)
    worker = EpochState()
    worker.require("pw-2", 1)  # pw-3's worker, planned in by pw-2
    for me in ("pw-2", "pw-3"):  # they step first, on pw-1's claim
        held[me] = next_term(held[me], me, "pw-1", {"pw-1": held["pw-1"]})
    for _ in range(4):  # then every node steps on the others' last terms, in turn
        for me in ("pw-1", "pw-2", "pw-3"):
            held[me] = next_term(held[me], me, "pw-1", {n: u for n, u in held.items() if n != me})
    (term,) = set(held.values())
    assert term.leader == "pw-1" and term.epoch > 1
    worker.require(term.leader, term.epoch)


def test_losing_every_eligible_node_keeps_the_epoch():
    assert next_term(Term("a", 4), "c", None, {"b": Term(None, 3)}) == Term(None, 4)


terms = st.builds(Term, st.sampled_from([None, "n0", "n1", "n2", "n3"]), st.integers(0, 20))


@given(st.lists(st.tuples(ballot, terms), min_size=1, max_size=6, unique_by=lambda bt: bt[0].node_id))
def test_nodes_exchanging_signed_terms_converge_on_one_leader_in_an_epoch_past_every_epoch_held(nodes):
    """Every node sees every other's ballot and term (one round = each node steps on the others' last terms)."""
    ballots = [b for b, _ in nodes]
    held = {b.node_id: t for b, t in nodes}
    start = max(t.epoch for t in held.values())
    leader = elect(ballots)
    for _ in range(8):
        held = {me: next_term(t, me, leader, {n: u for n, u in held.items() if n != me}) for me, t in held.items()}
    assert len(set(held.values())) == 1, held
    (term,) = set(held.values())
    assert term.leader == leader
    assert leader is None or term.epoch > start
    # a worker that followed any earlier term admits the converged leader's HELLO
    if leader is not None:
        for _, t in nodes:
            EpochState(t).require(leader, term.epoch)


# --------------------------------------------------------------------------- the loop


def test_step_reports_a_change_at_every_new_term():
    live = [Ballot(0, 2.0, "a"), Ballot(0, 1.0, "b")]
    claims: dict[str, Term] = {}
    el = Elector("a", lambda: live, lambda: claims)
    assert el.step() == LeaderChanged("a", 1)
    assert el.step() is None
    live.append(Ballot(3, 1.0, "c"))  # c outranks a: a follows c past a's epoch until c claims one
    assert el.step() == LeaderChanged("c", 2)
    claims["c"] = Term("c", 3)
    assert el.step() == LeaderChanged("c", 3)
    live[:] = [Ballot(0, 2.0, "a")]  # c is gone
    claims.clear()
    assert el.step() == LeaderChanged("a", 4)


@pytest.mark.asyncio
async def test_the_elector_loop_reports_a_new_root_at_once_when_poked():
    live = [Ballot(0, 2.0, "a"), Ballot(0, 1.0, "b")]
    el = Elector("b", lambda: live, interval=60.0)  # the tick would never come in time
    changes = el.changes()
    try:
        assert await asyncio.wait_for(anext(changes), 1.0) == LeaderChanged("a", 0)
        live.pop(0)
        el.poke()
        assert await asyncio.wait_for(anext(changes), 1.0) == LeaderChanged("b", 1)
    finally:
        await changes.aclose()


@pytest.mark.asyncio
async def test_the_elector_loop_notices_a_change_on_its_tick():
    live = [Ballot(0, 1.0, "a")]
    el = Elector("a", lambda: live, interval=0.01)
    changes = el.changes()
    try:
        assert await asyncio.wait_for(anext(changes), 1.0) == LeaderChanged("a", 1)
        live.append(Ballot(5, 1.0, "b"))  # named at once, past a's epoch 1 (b has not claimed one)
        assert await asyncio.wait_for(anext(changes), 1.0) == LeaderChanged("b", 2)
    finally:
        await changes.aclose()


@pytest.mark.asyncio
async def test_a_loop_cancelled_as_it_is_poked_stops():
    """SIGTERM cancels the daemon's main task, which waits in this loop. On Python 3.11 asyncio.wait_for
    returned normally when the cancel landed after the awaited poke had completed but before the loop
    resumed (gh-86296): the cancel was lost and the daemon ran on. Here exactly that interleaving."""
    el = Elector("a", lambda: [Ballot(0, 1.0, "a")], interval=60.0)

    async def follow() -> None:
        async for _ in el.changes():
            pass

    task = asyncio.create_task(follow())
    for _ in range(5):
        await asyncio.sleep(0)  # it elected itself and now waits for a poke or its tick
    el.poke()
    await asyncio.sleep(0)  # the poke's wait completes; the loop has not resumed yet
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=2)
    assert task in done and task.cancelled(), "the cancel was swallowed: the loop runs on"
