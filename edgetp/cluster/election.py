"""Who is root: ballots ranked by a pure function, and epochs that refuse the past.

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

Epochs (terms): `Term(leader, epoch)` is frozen. A message stamped (leader, epoch)
is admitted only if its epoch is newer than ours, or equal with the same leader;
anything older raises `StaleEpoch` (carrying our epoch so the sender can catch up),
and an equal epoch naming another leader raises `EpochConflict`. A node that becomes
root starts `next_epoch(seen)`: one past every epoch it has seen. That is how a
partitioned old root, still stamping its old epoch, is refused by everyone who has
moved on: no split brain.

`Elector` is the small loop around it: it takes a snapshot of the live ballots,
re-elects on a tick or when poked (a peer left), and reports leader changes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterable
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

    def next(self, leader: str | None, seen: int = 0) -> Term:
        """A new term for `leader`, past this epoch and every epoch `seen` elsewhere."""
        return Term(leader, max(self.epoch, seen) + 1)


class EpochState:
    """A node's current term, changed only through `observe` and `next_epoch`."""

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

    def observe(self, leader_id: str, epoch: int) -> bool:
        """Admit a leader message; False (logged) if it is stale or conflicting."""
        try:
            self.require(leader_id, epoch)
        except EpochError as exc:
            log.info("refused leader message: %s", exc)
            return False
        return True

    def next_epoch(self, leader_id: str | None, seen: int = 0) -> int:
        """Start a new epoch (the root is gone, or another was elected); returns it."""
        self.term = self.term.next(leader_id, seen)
        return self.term.epoch


# --------------------------------------------------------------------------- the loop


@dataclass(frozen=True)
class LeaderChanged:
    leader: str | None  # None: nobody here may lead
    epoch: int


class Elector:
    """Re-elects from `snapshot()` every `interval` s or when poked; yields `LeaderChanged`.

    A leader change starts a new epoch (`EpochState.next_epoch`); losing every
    eligible node reports `LeaderChanged(None, epoch)` without a new epoch.
    The caller owns the task that iterates `changes()`.
    """

    def __init__(self, snapshot: Callable[[], Iterable[Ballot]], *, interval: float = 0.5,
                 state: EpochState | None = None) -> None:
        self.snapshot = snapshot
        self.interval = interval
        self.state = state or EpochState()
        self._poke = asyncio.Event()

    def poke(self) -> None:
        """Re-elect now (a peer joined or left) instead of at the next tick."""
        self._poke.set()

    def step(self) -> LeaderChanged | None:
        """One election over the current snapshot; the change, if any."""
        leader = elect(self.snapshot())
        if leader == self.state.leader:
            return None
        if leader is None:
            self.state.term = Term(None, self.state.epoch)
        else:
            self.state.next_epoch(leader)
        return LeaderChanged(leader, self.state.epoch)

    async def changes(self) -> AsyncIterator[LeaderChanged]:
        while True:
            change = self.step()
            if change is not None:
                log.info("leader %s in epoch %d", change.leader, change.epoch)
                yield change
            try:
                await asyncio.wait_for(self._poke.wait(), self.interval)
            except TimeoutError:
                pass
            self._poke.clear()
