"""Noticing, at run time, that a plan no longer fits its nodes: steps steadily slower than they began.

A plan is sized by the speeds and links measured when it was made. When a
node gets slower afterwards (other load, a Pi throttling when hot, a CPU
quota cut) or a link degrades, every step waits for it. StepWatch keeps,
per batch size and span of POS_SPAN positions (attention grows with the
position, the weights do not), the median time of the first WINDOW decode
steps under the plan, and of the last WINDOW; once the recent median is FACTOR times the first,
it says why, and the runner asks for a re-plan (batch.Rebalance): fresh
measurements of every node and link, a new plan, the running sequences
replayed. At most once per MIN_GAP_S, so a cluster that is simply slower
everywhere is not re-planned in a loop.
"""

from __future__ import annotations

import collections
import statistics
import time

WINDOW = 8        # decode steps in each median
FACTOR = 1.3      # recent median over the first one that counts as steadily slower
MIN_GAP_S = 30.0  # seconds between two re-plans asked for by the watch
POS_SPAN = 256    # positions whose steps are compared with each other


class StepWatch:
    def __init__(self, window: int = WINDOW, factor: float = FACTOR, min_gap_s: float = MIN_GAP_S,
                 clock=time.monotonic) -> None:
        self.window, self.factor, self.min_gap_s, self.clock = window, factor, min_gap_s, clock
        self.first: dict[tuple[int, int], list[float]] = {}
        self.recent: dict[tuple[int, int], collections.deque[float]] = {}
        self.since = clock()

    def record(self, rows: int, seconds: float, pos: int = 0) -> str | None:
        """One decode step of `rows` rows, the furthest at position `pos`, took `seconds`; the reason
        to re-plan, once it is due."""
        key = (rows, pos // POS_SPAN)
        first = self.first.setdefault(key, [])
        if len(first) < self.window:
            first.append(seconds)
            return None
        recent = self.recent.setdefault(key, collections.deque(maxlen=self.window))
        recent.append(seconds)
        if len(recent) < self.window or self.clock() - self.since < self.min_gap_s:
            return None
        was, now = statistics.median(first), statistics.median(recent)
        if now <= self.factor * was:
            return None
        return (f"decode steps of {rows} row(s) take {now * 1e3:.1f} ms (median of the last {self.window}), "
                f"{was * 1e3:.1f} ms when this plan began")
