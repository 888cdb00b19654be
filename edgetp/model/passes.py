"""Forward passes one half-layer at a time, so that several can share each all-reduce.

A pass (`Shard.forward_steps`, `Shard.rows_steps`) is a generator: it yields
the partial sum (n, dim) of each half-layer, which its driver sums across the
shards in place, and returns the pass's result. `run` drives one pass with a
reduce; `together` drives several in lockstep, one reduce per half-layer over
their partials stacked in order (a step's decode rows and a prefill chunk: in
a cluster their round trips are paid once). A reduce sums each value across
the shards on its own, so a pass driven together gets the same bits as alone.
"""

from __future__ import annotations

from typing import Callable, Generator, Sequence

import numpy as np

Reduce = Callable[[np.ndarray], None]  # sums a (n, dim) partial in place across the shards
Steps = Generator[np.ndarray, None, np.ndarray]  # yields partials to sum, returns the result


def run(steps: Steps, reduce: Reduce) -> np.ndarray:
    """The result of one pass, each partial reduced in place."""
    return together([steps], reduce)[0]


def together(passes: Sequence[Steps], reduce: Reduce) -> list[np.ndarray]:
    """The results of passes run in lockstep: per half-layer one reduce over their partials, stacked
    in the order given (every pass must take the same number of half-layers)."""
    results: list[np.ndarray | None] = [None] * len(passes)
    live = list(range(len(passes)))
    for _ in range(1_000_000):  # two per layer; bounded all the same
        parts = []
        for k in live:
            try:
                parts.append(passes[k].send(None))
            except StopIteration as done:
                results[k] = done.value
        if not parts:
            return results  # type: ignore[return-value]
        if len(parts) != len(live):
            raise RuntimeError("passes driven together took different numbers of half-layers")
        if len(parts) == 1:
            reduce(parts[0])
            continue
        joined = np.concatenate(parts)
        reduce(joined)
        at = 0
        for p in parts:
            p[...] = joined[at:at + p.shape[0]]
            at += p.shape[0]
    raise RuntimeError("a pass did not end")
