"""Runners and the one-sequence generation loop.

A `Runner` turns token ids into sampling candidates, for prefill chunks and
for decode steps of several sequences at once (each in its own KV slot). A
single process uses `LocalRunner`; the tensor-parallel root has its own
runner that spreads the same work over links. `generate()` streams one
answer through the same `batch.Scheduler` the serving engine batches with,
so stopping, streaming and context limits behave the same everywhere.
"""

from __future__ import annotations

from typing import Callable, Iterator, Protocol, Sequence

import numpy as np

from edgetp.model import llama, sampling
from edgetp.model.batch import (PREFILL_CHUNK, Chunk, ContextError, Row, RunnerLost, Scheduler, Seq,  # noqa: F401
                                TokenEvent, chunks)
from edgetp.model.gguf import ModelFile
from edgetp.model.sampling import Candidates, SamplingParams
from edgetp.model.tokenizer import Tokenizer


class Runner(Protocol):
    ctx: int
    slots: int  # sequences whose KV caches it holds at once

    def begin(self, params: SamplingParams | None = None) -> None:
        """Generations start (a cluster readies its links)."""

    def end(self) -> None:
        """No generation runs any more, finished or not."""

    def prefill(self, slot: int, ids: Sequence[int], pos: int, history: Sequence[int] | None,
                params: SamplingParams | None) -> Candidates | None:
        """Feed ids at positions pos.. of slot (one chunk); with params, the candidates for the token after them."""

    def decode(self, rows: Sequence[Row]) -> list[Candidates]:
        """Feed one token of each row's slot at its position; the candidates for each row's next token."""

    def mixed(self, rows: Sequence[Row], chunk: Chunk) -> tuple[list[Candidates], Candidates | None]:
        """decode(rows) and prefill of chunk in one pass (each all-reduce carries both), each computed
        as alone: decode's candidates, and prefill's (None without chunk.params)."""

    def logits(self, ids: Sequence[int], pos: int) -> np.ndarray:
        """Feed ids at positions pos.. of slot 0, return the full logits of every position: (n, vocab)."""


class LocalRunner:
    """Every slice of every layer in this process."""

    def __init__(self, mf: ModelFile, ctx: int, slots: int = 1, kv_type: str = "f16") -> None:
        self.mf = mf
        self.ctx = ctx
        self.slots = slots
        self.weights = llama.load_weights(mf)  # zero-copy views of the file
        self.shard = llama.Shard(self.weights, ctx, slots=slots, kv_type=kv_type)

    def begin(self, params=None):
        return None

    def end(self):
        return None

    def prefill(self, slot, ids, pos, history, params):
        h = self.shard.forward(llama.embed(self.mf, list(ids)), pos, slot=slot)
        if params is None:
            return None
        return sampling.candidates(self.shard.logits(h[-1:])[0], 0, history, params)

    def decode(self, rows):
        h = self.shard.forward_rows(llama.embed(self.mf, [r.token for r in rows]), [r.slot for r in rows],
                                    [r.pos for r in rows])
        return self._rows(h, rows)

    def mixed(self, rows, chunk):
        x = llama.embed(self.mf, [r.token for r in rows] + list(chunk.ids))
        h = self.shard.forward_mixed(x, [r.slot for r in rows], [r.pos for r in rows], chunk.pos, chunk.slot)
        last = None if chunk.params is None else \
            sampling.candidates(self.shard.logits(h[-1:])[0], 0, chunk.history, chunk.params)
        return self._rows(h[:len(rows)], rows), last

    def _rows(self, h, rows):
        logits = self.shard.logits_rows(h)
        return [sampling.candidates(logits[i], 0, r.history, r.params) for i, r in enumerate(rows)]

    def run(self, ids, pos, history, params):
        """Feed ids at pos.. of slot 0 in aligned chunks; the candidates for the next token."""
        return feed(self, ids, pos, history, params)

    def logits(self, ids, pos):
        return np.concatenate([self.shard.logits(self.shard.forward(llama.embed(self.mf, list(ids[a - pos:b - pos])), a))
                               for a, b in chunks(pos, pos + len(ids))])


def feed(runner: Runner, ids: Sequence[int], pos: int, history: Sequence[int], params: SamplingParams) -> Candidates:
    """ids at pos.. of slot 0, in the chunks a Scheduler cuts; the candidates after the last one."""
    cand = None
    for a, b in chunks(pos, pos + len(ids)):
        last = b == pos + len(ids)
        cand = runner.prefill(0, ids[a - pos:b - pos], a, history if last else None, params if last else None)
    return cand


Recover = Callable[[RunnerLost], Runner]  # builds a runner over what is left (a re-plan)


def generate(
    runner: Runner,
    tok: Tokenizer,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    max_tokens: int,
    stop: Sequence[str] = (),
    recover: Recover | None = None,
) -> Iterator[TokenEvent]:
    """Stream the answer to prompt_ids. Stops at an end token, a stop string or max_tokens.

    One sequence through the same Scheduler the serving engine batches with,
    so it computes what the engine computes. When the runner loses a part
    mid-answer and `recover` is given, a new runner replays every token fed
    so far (same chunks, so the same KV cache) and the answer goes on as if
    nothing happened.
    """
    sched = Scheduler(runner, tok, recover)
    seq = Seq(list(prompt_ids), params, max_tokens, tuple(stop))
    sched.admit(seq)
    sched.runner.begin(params)
    try:
        while not seq.done:
            for _, ev in sched.step():
                yield ev
    finally:
        sched.runner.end()
