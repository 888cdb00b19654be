"""Runners and the one-sequence generation loop.

A `Runner` turns token ids into sampling candidates, for prefill chunks and
for decode steps of several sequences at once (each in its own KV slot). A
single process uses `LocalRunner`; the tensor-parallel root has its own
runner that spreads the same work over links. `generate()` streams one
answer through the same `batch.Scheduler` the serving engine batches with,
so stopping, streaming and context limits behave the same everywhere.
"""

from __future__ import annotations

import time
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

    def mixed(self, rows: Sequence[Row], chunk: Chunk) -> tuple[list[Candidates], Candidates | None,
                                                                 list[Candidates]]:
        """decode(rows) (none or several) and prefill of chunk in one pass (each all-reduce carries both),
        each computed as alone: decode's candidates, prefill's (None without chunk.params), and with
        chunk.score the merged scores of its targets (one per target >= 0, `sampling.scored`). With
        chunk.copy, positions copy[1]..chunk.pos-1 of slot copy[0] are first copied into chunk.slot
        on every node (`Shard.copy_kv`)."""

    def logits(self, ids: Sequence[int], pos: int) -> np.ndarray:
        """Feed ids at positions pos.. of slot 0, return the full logits of every position: (n, vocab)."""


class LocalRunner:
    """Every slice of every layer in this process."""

    def __init__(self, mf: ModelFile, ctx: int, slots: int = 1, kv_type: str = "f16",
                 spec: llama.ShardSpec | None = None) -> None:
        self.mf = mf
        self.ctx = ctx
        self.slots = slots
        self.weights = llama.load_weights(mf, spec)  # zero-copy views of the file
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
        if chunk.copy is not None:
            self.shard.copy_kv(chunk.copy[0], chunk.slot, chunk.copy[1], chunk.pos)
        x = llama.embed(self.mf, [r.token for r in rows] + list(chunk.ids))
        if rows:
            h = self.shard.forward_mixed(x, [r.slot for r in rows], [r.pos for r in rows], chunk.pos, chunk.slot)
        else:
            h = self.shard.forward(x, chunk.pos, slot=chunk.slot)
        last = None if chunk.params is None else \
            sampling.candidates(self.shard.logits(h[-1:])[0], 0, chunk.history, chunk.params)
        return self._rows(h[:len(rows)], rows), last, scores(self.shard, h[len(rows):], 0, chunk)

    def _rows(self, h, rows):
        logits = self.shard.logits_rows(h)
        return [sampling.candidates(logits[i], 0, r.history, r.params) for i, r in enumerate(rows)]

    def run(self, ids, pos, history, params):
        """Feed ids at pos.. of slot 0 in aligned chunks; the candidates for the next token."""
        return feed(self, ids, pos, history, params)

    def logits(self, ids, pos):
        return np.concatenate([self.shard.logits(self.shard.forward(llama.embed(self.mf, list(ids[a - pos:b - pos])), a))
                               for a, b in chunks(pos, pos + len(ids))])


def scores(shard: llama.Shard, h: np.ndarray, offset: int, chunk: Chunk) -> list[Candidates]:
    """This shard's part of the scores chunk asks for (none without chunk.score): h holds the chunk's
    final hidden states, and each row with a target gets `sampling.scored` of its logits."""
    if chunk.score is None:
        return []
    logits = shard.logits(h)
    return [sampling.scored(logits[i], offset, int(t), chunk.score) for i, t in enumerate(chunk.targets) if t >= 0]


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


WARM_TEXT = "Warming up: every kind of step once."
WARM_VOCAB = 256  # rows of the output head a warm-up computes


def warm(mf: ModelFile, tok: Tokenizer, kv_type: str = "f16") -> float:
    """Run every kind of step a request runs, once, on throw-away slices of mf; the seconds it took.

    numba compiles a kernel the first time it runs (or loads it from its on-disk cache); with a
    cold cache (a new install, or new kernels after an upgrade) that took the first request 60 s
    on the 2-core AMD EPYC here, and a Pi is slower. A daemon warms up before it says it serves, as
    llama.cpp runs an empty batch first. Kernels are compiled per type, not per size, so one
    layer of each mix of tensor types (`warm_specs`) compiles all of them, and the memory it
    takes is a layer's, not the model's (a node may hold a file it could not run whole)."""
    t0 = time.perf_counter()
    ids = tok.encode(WARM_TEXT)[: PREFILL_CHUNK // 4] or [0]
    for spec in warm_specs(mf):
        _steps(LocalRunner(mf, min(PREFILL_CHUNK, mf.config.ctx_train), 2, kv_type, spec), tok, ids)
    return time.perf_counter() - t0


def warm_specs(mf: ModelFile) -> list[llama.ShardSpec | None]:
    """One single-layer slice for each mix of tensor types (and of sliding-window or global
    attention) the model's layers have, the last layer's first (it holds the final norm), each
    with WARM_VOCAB rows of the head. A mixture's experts are packed as the router picks them, so
    a layer's experts take its used ones' memory. [None] (the whole) for a shard file, which is
    a slice already."""
    cfg = mf.config
    if llama.stored_spec(mf) is not None:
        return [None]
    specs: dict[tuple, llama.ShardSpec] = {}
    for i in [cfg.n_layers - 1, *range(cfg.n_layers - 1)]:
        p = f"blk.{i}."
        mix = (cfg.is_local(i), *sorted((n[len(p):], int(t.tensor_type)) for n, t in mf.tensors.items()
                                      if n.startswith(p)))
        specs.setdefault(mix, llama.ShardSpec((0, cfg.n_kv_heads), (0, cfg.ffn), (0, min(cfg.vocab, WARM_VOCAB)),
                                              (i, i + 1)))
    return list(specs.values())


def _steps(runner: LocalRunner, tok: Tokenizer, ids: list[int]) -> None:
    """Two sequences through a Scheduler: a prompt alone (prefill), a decode row beside the other's
    prompt (mixed), then two decode rows; one greedy, one sampled."""
    sched = Scheduler(runner, tok)
    seqs = [Seq(ids, SamplingParams(temperature=0), 3), Seq(ids[::-1], SamplingParams(seed=0), 3)]
    sched.admit(seqs[0])
    sched.step()
    sched.admit(seqs[1])
    for _ in range(8):  # 3 tokens each: 4 more steps
        if all(s.done for s in seqs):
            break
        sched.step()
