"""Forward passes one half-layer at a time, so that several can share each all-reduce.

A pass (`Shard.forward_steps`, `Shard.rows_steps`) is a generator: it yields
the partial sum (n, dim) of each half-layer, which its driver sums across the
shards in place, and returns the pass's result. `run` drives one pass with a
reduce; `together` drives several in lockstep, one reduce per half-layer over
their partials stacked in order (a step's decode rows and a prefill chunk: in
a cluster their round trips are paid once). A reduce sums each value across
the shards on its own, so a pass driven together gets the same bits as alone.

A pass may yield its partial still to compute, as `Pieces` (columns cut at
multiples of 32, so Q8_0 blocks are unchanged): a reduce with a `pieces`
method computes each piece and sends it while the next computes (communication
overlapped with compute); any other reduce gets the whole partial computed.
Every value still gets the same additions in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generator, Sequence

import numpy as np

PIECED_BYTES = 64 << 10  # the largest f32 partial sent in pieces: a whole partial's pieces sit in socket
# buffers before the totals come back, and 64 KiB fit loopback's and a LAN's default windows


@dataclass(frozen=True)
class Pieces:
    """A half-layer's partial (n, dim) to compute piece by piece: fill(k) writes its columns
    cuts[k]:cuts[k+1] of out."""

    out: np.ndarray
    cuts: tuple[int, ...]
    fill: Callable[[int], None]

    def whole(self) -> np.ndarray:
        for k in range(len(self.cuts) - 1):
            self.fill(k)
        return self.out


Partial = np.ndarray | Pieces
Reduce = Callable[[np.ndarray], None]  # sums a (n, dim) partial in place across the shards
Steps = Generator[Partial, None, np.ndarray]  # yields partials to sum, returns the result


def cuts(dim: int, pieces: int) -> tuple[int, ...]:
    """Column bounds of a (n, dim) partial in `pieces` near-even pieces of whole 32-value blocks (fewer
    when dim has fewer blocks; one when dim is not a multiple of 32)."""
    blocks = dim // 32
    k = max(1, min(pieces, blocks)) if dim % 32 == 0 else 1
    return tuple(32 * (blocks * i // k) for i in range(k)) + (dim,)


def pieced(n: int, dim: int, pieces: int) -> bool:
    """Whether a step of n rows sends its partials in pieces (the same answer on every node)."""
    return pieces > 1 and n * dim * 4 <= PIECED_BYTES


def _reduce(part: Partial, reduce: Reduce) -> None:
    if isinstance(part, Pieces):
        piecewise = getattr(reduce, "pieces", None)
        if piecewise is not None:
            piecewise(part)
            return
        part = part.whole()
    reduce(part)


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
            _reduce(parts[0], reduce)
            continue
        parts = [p.whole() if isinstance(p, Pieces) else p for p in parts]  # one reduce over all: no pieces
        joined = np.concatenate(parts)
        reduce(joined)
        at = 0
        for p in parts:
            p[...] = joined[at:at + p.shape[0]]
            at += p.shape[0]
    raise RuntimeError("a pass did not end")
