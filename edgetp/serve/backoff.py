"""Which peers the root plans without for now: each failure doubles a peer's wait, success forgives it.

A pure, clock-injected value: `failed(peer, cause, now)` starts (or doubles)
the peer's wait, capped; `excluded(now)` names the peers still waiting;
`succeeded(peer)` forgets a peer's past. The root asks it before each plan,
so a peer that refused is tried again once its wait is over, never on every
request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FIRST_S = 2.0   # the wait after a first failure
CAP_S = 60.0    # no wait is longer


@dataclass(frozen=True)
class Strike:
    failures: int     # in a row
    until: float      # monotonic seconds: excluded before this
    cause: str        # the last failure, for logs and the 503 text


@dataclass
class Backoff:
    first_s: float = FIRST_S
    cap_s: float = CAP_S
    _strikes: dict[str, Strike] = field(default_factory=dict)

    def failed(self, peer: str, cause: str, now: float) -> Strike:
        before = self._strikes.get(peer)
        n = before.failures + 1 if before else 1
        strike = Strike(n, now + min(self.cap_s, self.first_s * 2 ** (n - 1)), cause)
        self._strikes[peer] = strike
        return strike

    def succeeded(self, peer: str) -> None:
        self._strikes.pop(peer, None)

    def excluded(self, now: float) -> dict[str, Strike]:
        """Peers still waiting out a failure, with why."""
        return {p: s for p, s in self._strikes.items() if s.until > now}

    def forget(self, keep: set[str]) -> None:
        """Drop peers that left the cluster (a rejoin starts with a clean slate)."""
        for p in [p for p in self._strikes if p not in keep]:
            del self._strikes[p]
