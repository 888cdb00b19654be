"""Who is root: ballots ranked by a pure function, and epochs that mean the same on every node.

Ranking (`Ballot` order, "greater" wins):
  1. a node that may lead (`can_lead`, i.e. not --no-root) beats one that may not;
  2. higher priority;
  3. higher measured speed (weight bytes/s);
  4. tie-break: the *smaller* node id wins (plain string order), so the result is
     deterministic and every node computes the same one from the same live set.

`elect` is the max over the ballots of nodes that may lead: a pure function of the
*set* of ballots, so two nodes seeing the same live set agree on the root. Speeds
enter the ballot as advertised (measured at start and on request), so the ranking
does not flap with measurement noise.

Epochs (terms): `Term(leader, epoch)` is frozen, and every node signs its current
term into its advert and heartbeat answers (cluster/discovery.py), so the epochs
other nodes are in are known everywhere. `next_term` is the pure rule:
  - a node elected root takes max(every epoch seen) + 1, and takes a new epoch again
    whenever it sees an epoch above its own, or its own epoch claimed under another
    leader: a rebooted root starting from 0 thus climbs past the cluster at once;
  - a follower names the leader at once, and takes the leader's epoch once the leader claims
    it, if that epoch is new to it; until then it names the leader one past the epoch it
    held under another, so the leader climbs past (never going down, never letting one
    epoch have two leaders on one node).
A root's link HELLO is admitted by `EpochState.require` (worker side): its epoch must
be newer than the node's, or equal with the same leader; anything older raises
`StaleEpoch` and an equal epoch naming another leader raises `EpochConflict`. That is
how a partitioned old root, still stamping its old epoch, is refused: no split brain.

`Elector` is the small loop around it: it takes a snapshot of the live ballots and the
terms peers report, re-elects on a tick or when poked, and reports term changes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import total_ordering

log = logging.getLogger(__name__)


class EpochError(Exception):
    """A leader message was refused; `current` is the epoch this node is in."""

    def __init__(self, message: str, current: int) -> None:
        super().__init__(message)
        self.current = current


class StaleEpoch(EpochError):
    """The message carries an epoch older than the one this node is in."""


class EpochConflict(EpochError):
    """The message claims the current epoch for a different leader."""


@total_ordering
@dataclass(frozen=True, eq=True)
class Ballot:
    priority: int
    speed: float
    node_id: str
    can_lead: bool = True

    def __post_init__(self) -> None:
        if not (self.speed >= 0 and self.speed != float("inf")):
            raise ValueError(f"a ballot's speed must be finite and >= 0, got {self.speed!r}")

    def _rank(self) -> tuple[bool, int, float]:
        return (self.can_lead, self.priority, self.speed)

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Ballot):
            return NotImplemented
        if self._rank() != other._rank():
            return self._rank() < other._rank()
        return self.node_id > other.node_id  # the smaller id ranks higher


def elect(ballots: Iterable[Ballot]) -> str | None:
    """The node id of the best ballot that may lead, or None if none may."""
    eligible = [b for b in ballots if b.can_lead]
    return max(eligible).node_id if eligible else None


@dataclass(frozen=True)
class Term:
    """Who leads in which epoch; epoch 0 with no leader is the start."""

    leader: str | None = None
    epoch: int = 0

    def admit(self, leader: str, epoch: int) -> Term:
        """The term after accepting a message stamped (leader, epoch); raises if it must be refused."""
        if epoch < self.epoch:
            raise StaleEpoch(f"epoch {epoch} from {leader!r} is older than current epoch {self.epoch}", self.epoch)
        if epoch == self.epoch and self.leader is not None and leader != self.leader:
            raise EpochConflict(f"epoch {epoch} already belongs to {self.leader!r}, not {leader!r}", self.epoch)
        return Term(leader, epoch)


def next_term(current: Term, me: str, leader: str | None, claims: Mapping[str, Term]) -> Term:
    """This node's term after an election that chose `leader`, given each peer's signed term.

    `claims`: node id -> the term that node says it is in. Epochs never go down.
    """
    seen = max((t.epoch for t in claims.values()), default=0)
    if leader is None:
        return Term(None, max(current.epoch, seen))
    if leader == me:
        overtaken = any(t.epoch > current.epoch or (t.epoch == current.epoch and t.leader not in (None, me))
                        for t in claims.values())
        if current.leader == me and current.epoch > 0 and not overtaken:
            return current
        return Term(me, max(current.epoch, seen) + 1)
    # A follower names the elected leader at once, but takes the leader's own claim only where that epoch
    # is new to it, or is one it already gives that leader. Otherwise (the leader has not claimed yet, or
    # claimed an epoch this node holds under another leader or has passed) it names the leader one epoch
    # past any it held under another: the leader, seeing a follower above its own epoch, climbs past it
    # (above), and every worker admits the epoch it climbs to. Taking a claimed epoch that another leader
    # held here would leave a worker that admitted that other leader refusing this one for good (a
    # preferred root booting late after a power cut, claiming epoch 1 before it heard the stand-in's).
    claim = claims.get(leader)
    if claim is not None and claim.leader == leader and (
            claim.epoch > current.epoch or (claim.epoch == current.epoch and current.leader in (None, leader))):
        return claim
    return Term(leader, current.epoch + (current.leader not in (None, leader)))


class EpochState:
    """The term of the roots a worker follows, changed only through `require`."""

    def __init__(self, term: Term = Term()) -> None:
        self.term = term

    @property
    def epoch(self) -> int:
        return self.term.epoch

    @property
    def leader(self) -> str | None:
        return self.term.leader

    def require(self, leader_id: str, epoch: int) -> None:
        """Admit a leader message or raise StaleEpoch / EpochConflict."""
        self.term = self.term.admit(leader_id, epoch)


# --------------------------------------------------------------------------- the loop


@dataclass(frozen=True)
class LeaderChanged:
    leader: str | None  # None: nobody here may lead
    epoch: int


class Elector:
    """Re-elects every `interval` s or when poked; yields `LeaderChanged` at every new term.

    `snapshot()`: the live ballots (ours included); `claims()`: node id -> the term
    each live peer reports. The caller owns the task that iterates `changes()`.
    """

    def __init__(self, me: str, snapshot: Callable[[], Iterable[Ballot]],
                 claims: Callable[[], Mapping[str, Term]] = dict, *, interval: float = 0.5) -> None:
        self.me = me
        self.snapshot = snapshot
        self.claims = claims
        self.interval = interval
        self.term = Term()
        self._poke = asyncio.Event()

    def poke(self) -> None:
        """Re-elect now (a peer joined or left) instead of at the next tick."""
        self._poke.set()

    def step(self) -> LeaderChanged | None:
        """One election over the current snapshot; the change, if any."""
        term = next_term(self.term, self.me, elect(self.snapshot()), self.claims())
        if term == self.term:
            return None
        self.term = term
        return LeaderChanged(term.leader, term.epoch)

    async def changes(self) -> AsyncIterator[LeaderChanged]:
        while True:
            change = self.step()
            if change is not None:
                log.info("leader %s in epoch %d", change.leader, change.epoch)
                yield change
            try:  # not asyncio.wait_for: on Python 3.11 it swallows a cancel that lands as the poke
                # completes (gh-86296), and a daemon told to stop by SIGTERM then ran on
                async with asyncio.timeout(self.interval):
                    await self._poke.wait()
            except TimeoutError:
                pass
            self._poke.clear()
