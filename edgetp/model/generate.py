"""The generation loop: prefill, then one token at a time, streamed as events.

It drives a `Runner`, which turns token ids into sampling candidates. A
single process uses `LocalRunner`; the tensor-parallel root has its own
runner that spreads the same work over links. Both feed this one loop, so
stopping, streaming and context limits behave the same everywhere.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol, Sequence

import numpy as np

from edgetp.model import llama, sampling
from edgetp.model.gguf import ModelFile
from edgetp.model.sampling import Candidates, SamplingParams
from edgetp.model.tokenizer import Tokenizer

# Tokens per prefill batch: bounds the activations' memory. Measured here, sgemm on a
# decoded 2048x2048 tile ran ~83 GFLOP/s for 256 tokens against ~71 for 128; a decoded
# tile (or a packed integer panel, intgemm.py) is shared by twice the tokens.
PREFILL_CHUNK = 256


class Runner(Protocol):
    ctx: int

    def begin(self, params: SamplingParams) -> None:
        """A generation starts (a cluster readies its links)."""

    def end(self) -> None:
        """The generation is over, finished or not."""

    def run(self, ids: Sequence[int], pos: int, history: Sequence[int], params: SamplingParams) -> Candidates:
        """Feed ids at positions pos.., return candidates for the token after the last one."""

    def logits(self, ids: Sequence[int], pos: int) -> np.ndarray:
        """Feed ids at positions pos.., return the full logits of every position: (n, vocab)."""


class LocalRunner:
    """Every slice of every layer in this process."""

    def __init__(self, mf: ModelFile, ctx: int) -> None:
        self.mf = mf
        self.ctx = ctx
        self.weights = llama.load_weights(mf)  # zero-copy views of the file
        self.shard = llama.Shard(self.weights, ctx)

    def _chunks(self, ids: Sequence[int], pos: int) -> Iterator[np.ndarray]:
        """Final-norm hidden states, PREFILL_CHUNK tokens at a time (the cluster chunks alike)."""
        for start in range(0, len(ids), PREFILL_CHUNK):
            chunk = list(ids[start:start + PREFILL_CHUNK])
            yield self.shard.forward(llama.embed(self.mf, chunk), pos + start)

    def begin(self, params):
        return None

    def end(self):
        return None

    def run(self, ids, pos, history, params):
        *_, h = self._chunks(ids, pos)
        return sampling.candidates(self.shard.logits(h[-1:])[0], 0, history, params)

    def logits(self, ids, pos):
        return np.concatenate([self.shard.logits(h) for h in self._chunks(ids, pos)])


@dataclass(frozen=True)
class TokenEvent:
    index: int                 # 0-based position in the answer
    token_id: int
    text: str                  # the new complete text this token adds ("" while a character is incomplete)
    ms: float                  # wall time of this step (prefill included for index 0)
    finish_reason: str | None  # None, "stop" (end token or stop string), "length" (max_tokens) or "context" (KV cache full)
    note: str | None = None    # what happened on the way, e.g. a node lost and a recovery


class ContextError(ValueError):
    """The prompt and answer do not fit the context."""


class RunnerLost(Exception):
    """Part of a runner (a cluster node) is gone; a new runner may take over."""


Recover = Callable[[RunnerLost], Runner]  # builds a runner over what is left (a re-plan)
MAX_RECOVERIES = 3


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

    When the runner loses a part mid-answer and `recover` is given, a new
    runner replays every token fed so far (same chunks, so the same KV
    cache) and the answer goes on as if nothing happened.
    """
    if not prompt_ids:
        raise ContextError("the prompt is empty")
    if len(prompt_ids) >= runner.ctx:
        raise ContextError(f"the prompt has {len(prompt_ids)} tokens but the context holds {runner.ctx}")
    steps = _Steps(runner, recover, params, len(prompt_ids))
    runner.begin(params)
    try:
        yield from _loop(steps, tok, prompt_ids, params, max_tokens, stop)
    finally:
        steps.runner.end()


class _Steps:
    """Runs steps on the current runner, replacing it (and replaying) when it loses a part."""

    def __init__(self, runner: Runner, recover: Recover | None, params: SamplingParams, n_prompt: int) -> None:
        self.runner, self.recover, self.params, self.n_prompt = runner, recover, params, n_prompt
        self.notes: list[str] = []

    @property
    def ctx(self) -> int:
        return self.runner.ctx

    def run(self, pending: Sequence[int], pos: int, history: Sequence[int]) -> Candidates:
        for attempt in range(MAX_RECOVERIES + 1):
            try:
                return self.runner.run(pending, pos, history, self.params)
            except RunnerLost as exc:
                if self.recover is None or attempt == MAX_RECOVERIES:
                    raise
                self.runner = self.recover(exc)
                self.runner.begin(self.params)
                self._replay(history[:pos])
                self.notes.append(f"{exc}; recovered with a new plan, replayed {pos} tokens")
        raise AssertionError("unreachable")

    def _replay(self, fed: Sequence[int]) -> None:
        """Feed what the lost runner had seen, in the same chunks it was fed."""
        if not fed:
            return
        self.runner.run(fed[: self.n_prompt], 0, fed[: self.n_prompt], self.params)
        for i in range(self.n_prompt, len(fed)):
            self.runner.run(fed[i:i + 1], i, fed[: i + 1], self.params)


def _loop(runner: _Steps, tok: Tokenizer, prompt_ids: Sequence[int], params: SamplingParams, max_tokens: int,
          stop: Sequence[str]) -> Iterator[TokenEvent]:
    sampler = sampling.Sampler(params)
    history = list(prompt_ids)
    out = _StopFilter(tok.stream(), [s for s in stop if s])
    pending = list(prompt_ids)
    pos = 0
    for index in range(max_tokens):
        t0 = time.perf_counter()
        cand = runner.run(pending, pos, history)
        tid = sampler.pick(cand)
        ms = (time.perf_counter() - t0) * 1000
        note = "; ".join(runner.notes) or None
        runner.notes.clear()
        pos += len(pending)
        history.append(tid)
        if tid in tok.stop_ids:
            yield TokenEvent(index, tid, out.finish(), ms, "stop", note)
            return
        text, stopped = out.feed(tid)
        if stopped:
            yield TokenEvent(index, tid, text, ms, "stop", note)
            return
        if pos >= runner.ctx:  # no room to feed this token back: stop, never wrap around
            yield TokenEvent(index, tid, text + out.finish(), ms, "context", note)
            return
        if index == max_tokens - 1:
            yield TokenEvent(index, tid, text + out.finish(), ms, "length", note)
            return
        yield TokenEvent(index, tid, text, ms, None, note)
        pending = [tid]


class _StopFilter:
    """Streams decoded text, holding back what could still become a stop string.

    Text that ends with the first characters of a stop string is kept until
    the next token shows whether the stop string follows; the stop string and
    everything after it are never sent.
    """

    def __init__(self, decoder, stop: list[str]) -> None:
        self.decoder = decoder
        self.stop = stop
        self.text = ""   # everything decoded so far
        self.sent = 0    # how much of it went out

    def feed(self, tid: int) -> tuple[str, bool]:
        self.text += self.decoder.feed(tid)
        for s in self.stop:
            at = self.text.find(s, max(0, self.sent - len(s)))
            if at >= 0:
                return self._send(at), True
        hold = max((k for s in self.stop for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        return self._send(len(self.text) - hold), False

    def finish(self) -> str:
        self.text += self.decoder.flush()
        return self._send(len(self.text))

    def _send(self, upto: int) -> str:
        upto = max(upto, self.sent)
        piece, self.sent = self.text[self.sent:upto], upto
        return piece
