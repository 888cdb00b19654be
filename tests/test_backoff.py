"""serve/backoff.py against its formula: the n-th failure in a row waits min(cap, first * 2**(n-1)) seconds."""

from __future__ import annotations

from hypothesis import given, strategies as st

from edgetp.serve.backoff import CAP_S, FIRST_S, Backoff


def expected_wait(n: int, first: float = FIRST_S, cap: float = CAP_S) -> float:
    return min(cap, first * 2 ** (n - 1))


def test_the_defaults_are_two_seconds_doubling_up_to_a_minute():
    b, waits = Backoff(), []
    for n in range(1, 9):
        waits.append(b.failed("p", f"failure {n}", now=1000.0).until - 1000.0)
    assert waits == [2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0]


@given(first=st.floats(0.01, 100), cap=st.floats(0.01, 1000), fails=st.integers(1, 40),
       start=st.floats(0, 1e6))
def test_each_failure_in_a_row_waits_by_the_formula(first, cap, fails, start):
    b = Backoff(first_s=first, cap_s=cap)
    for n in range(1, fails + 1):
        now = start + n  # failures may come at any later time
        strike = b.failed("peer", f"cause {n}", now)
        assert strike.failures == n and strike.cause == f"cause {n}"
        assert strike.until == now + expected_wait(n, first, cap)


def test_a_peer_is_excluded_until_its_wait_is_over_and_not_after():
    b = Backoff()
    strike = b.failed("10.0.0.2:7710", "connection refused", now=100.0)
    assert set(b.excluded(100.0)) == {"10.0.0.2:7710"}
    assert set(b.excluded(strike.until - 1e-6)) == {"10.0.0.2:7710"}
    assert b.excluded(strike.until) == {}
    assert b.excluded(100.0)["10.0.0.2:7710"].cause == "connection refused"


def test_success_forgives_and_the_next_failure_starts_from_the_first_wait_again():
    b = Backoff()
    for _ in range(4):
        b.failed("p", "x", now=0.0)
    b.succeeded("p")
    assert b.excluded(0.0) == {}
    assert b.failed("p", "x", now=10.0).until == 10.0 + FIRST_S


def test_peers_are_counted_apart_and_leaving_the_cluster_wipes_the_slate():
    b = Backoff()
    for _ in range(3):
        b.failed("a", "x", now=0.0)
    assert b.failed("b", "y", now=0.0).failures == 1
    b.forget(keep={"b"})
    assert set(b.excluded(0.0)) == {"b"}
    assert b.failed("a", "x", now=0.0).failures == 1  # a rejoined: a first failure again
