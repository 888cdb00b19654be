"""Continuous batching: several sequences on one runner, one token of each per decode step.

A `Scheduler` holds up to `runner.slots` sequences, each in a slot of the KV
cache. Every `step()` runs, in one pass through the runner,
  1. the decode rows: the pending token of every sequence that is decoding
     (in a cluster its all-reduces carry the whole batch, so the round trips
     are paid once for all of them);
  2. one prefill chunk of the sequence with the least of its prompt left to
     read, so a long prompt is read between the tokens of the streams already
     running, and a short prompt arriving meanwhile is read at the next step
     instead of after the whole long one (its first token comes a step or two
     later, not a whole long prompt later). A sequence passed over PATIENCE
     steps in a row is read next whatever its length, so a stream of short
     prompts never starves a long one.
A step with both is one `runner.mixed` call: each all-reduce carries the
decode rows and the chunk's rows together (`Shard.forward_mixed`), so the
chunk adds no round trip of its own. A step with one kind only calls
`runner.decode` or `runner.prefill`.
Sequences join (`admit`) and leave (`drop`, or on finishing) between steps,
each with its own sampling parameters, stop strings and `max_tokens`.

The same text under any load: nothing a sequence computes depends on the
others. Prefill chunks are cut at absolute multiples of PREFILL_CHUNK
positions and never mix sequences; a decode row comes out bit for bit as it
would alone (`Shard.forward_rows`); each sequence samples with its own
seeded sampler and history.

The prefix cache: a slot keeps its KV cache after its sequence ends, until
another sequence needs the slot (least recently used first). A new prompt
that starts with what a free slot holds skips that part, in whole chunks
only, and only in chunks that were themselves computed as whole prefill
chunks at the same positions: those are exactly the bits a cold prefill of
the new prompt would compute. Answer tokens (computed one at a time) and a
prompt's last partial chunk are computed again. Running sequences share too:
before a prompt's chunk is read, the whole chunks of its beginning that any
other slot holds (a system prompt several clients send, a request's `n`
choices) are copied into its slot on every node (`Chunk.copy`,
`Shard.copy_kv`) instead of being read again; whoever reads a shared chunk
first, the others copy it.

Scoring a prompt (`Seq.score`, the API's `echo` with `logprobs`): each chunk
of the prompt also asks, at every position, the log probability of the
prompt's next token (`Chunk.targets`), so the prompt is read in full, never
from the prefix cache. The scores are kept by position as chunks are read;
a replay after a lost node re-reads chunks without scoring them, so nothing
is counted twice. They reach the caller with the answer's first event, or
with a token-less finishing event when `max_tokens` is 0 (which, unscored,
only reads the prompt: into the prefix cache).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Sequence

from edgetp.model import sampling
from edgetp.model.llama import STEP_ROWS
from edgetp.model.sampling import Candidates, SamplingParams

# raised here; its home has no numba, for the client
from edgetp.params import ContextError

# Prompt tokens per prefill step; chunk boundaries sit at multiples of it. A step is never cut short,
# so one chunk's time is what a request arriving meanwhile waits before its own prompt is read, and
# what every running stream waits for its next token: 64 tokens of the 1B shape take ~0.6 s on one
# core (128 took ~1.2 s) for a prefill rate within a few percent of 128's (each chunk reads every
# weight once more). It is also the prefix cache's unit of reuse.
PREFILL_CHUNK = 64
PATIENCE = 4         # steps a prompt may be passed over for shorter ones before it is read next
MAX_RECOVERIES = 3


class RunnerLost(Exception):
    """Part of a runner (a cluster node) is gone; a new runner may take over."""


class Rebalance(RunnerLost):
    """The runner's plan no longer fits its nodes (parallel/rebalance.py), or nodes joined: a new plan
    should take over, replaying what this one had seen, as after a lost node."""

    def __init__(self, reason: str, addresses: Sequence[str] | None = None) -> None:
        super().__init__(reason)
        self.addresses = None if addresses is None else tuple(addresses)  # the workers to plan over; None: the same


@dataclass(frozen=True)
class TokenEvent:
    index: int                 # 0-based position in the answer
    token_id: int
    text: str                  # the new complete text this token adds ("" while a character is incomplete)
    ms: float                  # wall time since this sequence's previous token (prefill and waiting included for index 0)
    finish_reason: str | None  # None, "stop" (end token or stop string), "length" (max_tokens) or "context" (KV cache full)
    note: str | None = None    # what happened on the way, e.g. a node lost and a recovery
    logprobs: sampling.Logprobs | None = None  # when params.logprobs asked for them
    # with Seq.score, on the first event: the log probability of each prompt token after the first
    prompt_logprobs: tuple[sampling.Logprobs, ...] | None = None

    @property
    def answered(self) -> bool:
        """False for the one event of a sequence that answers nothing (max_tokens 0: its prompt only)."""
        return self.token_id >= 0


@dataclass(frozen=True)
class Row:
    """One decode row: the token fed at `pos` of `slot`, and how to pick the next one."""

    slot: int
    pos: int
    token: int
    history: Sequence[int]     # every token of the sequence so far, this one included (penalties)
    params: SamplingParams


@dataclass(frozen=True)
class Chunk:
    """One prefill chunk: ids fed at pos.. of slot; with params (the prompt's last chunk), how to
    pick the token after them."""

    slot: int
    pos: int
    ids: Sequence[int]
    history: Sequence[int] | None = None  # every token of the sequence so far (penalties); None: no candidates
    params: SamplingParams | None = None
    score: int | None = None              # with targets: the log probability of each, and the `score` likeliest
    targets: Sequence[int] = ()           # per row of ids: the token after it (-1: none, the prompt's last)
    copy: tuple[int, int] | None = None   # (src slot, a): first copy positions a..pos-1 of src's KV into slot


def chunks(start: int, end: int, size: int = PREFILL_CHUNK) -> Iterator[tuple[int, int]]:
    """[start, end) cut at absolute multiples of size."""
    a = start
    while a < end:
        b = min((a // size + 1) * size, end)
        yield a, b
        a = b


@dataclass(eq=False)
class Seq:
    """One request's sequence: its prompt, its settings and how far it got."""

    prompt: Sequence[int]
    params: SamplingParams
    max_tokens: int                 # 0: the prompt is read (and scored, with score), nothing is answered
    stop: Sequence[str] = ()
    tag: Any = None                 # the caller's handle (the engine's Job)
    score: int | None = None        # score the prompt: each token's log probability and the `score` likeliest
    slot: int = -1
    fed: int = 0                    # positions of the slot that hold this sequence's tokens
    cached: int = 0                 # prompt tokens taken from the prefix cache
    passed: int = 0                 # prefill steps in a row that read another prompt while this one waited
    index: int = 0                  # tokens answered so far
    pending: int | None = None      # the answered token to feed next
    finish_reason: str | None = None
    history: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    scores: list[sampling.Logprobs] = field(default_factory=list)  # prompt tokens 1.. scored so far

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class PrefixCache:
    """What each slot's KV cache holds, which slots are free, and which prefix of a slot may be reused."""

    def __init__(self, n: int, chunk: int = PREFILL_CHUNK) -> None:
        self.chunk = chunk
        self.tokens: list[list[int]] = [[] for _ in range(n)]  # token at each position of the slot
        self.exact = [0] * n       # leading positions computed by whole prefill chunks (reusable)
        self.busy = [False] * n
        self.last_used = [0] * n
        self._clock = 0

    @property
    def free(self) -> int:
        return self.busy.count(False)

    def take(self, prompt: Sequence[int], reuse: bool = True) -> tuple[int, int]:
        """A free slot for prompt and how many of its leading positions are reused: the slot with
        the longest reusable prefix, else the least recently used (reuse False: none is reused)."""
        limit = (len(prompt) - 1) // self.chunk * self.chunk if reuse else 0  # the last token is always computed
        best: tuple[int, int, int] | None = None                # (reuse, -last_used, slot)
        for s in range(len(self.busy)):
            if self.busy[s]:
                continue
            held, n = self.tokens[s], min(self.exact[s], limit)
            same = 0
            while same < n and held[same] == prompt[same]:
                same += 1
            key = (same // self.chunk * self.chunk, -self.last_used[s], s)
            if best is None or key > best:
                best = key
        if best is None:
            raise RuntimeError("no free slot")
        reuse, _, slot = best
        self.busy[slot] = True
        del self.tokens[slot][reuse:]
        self.exact[slot] = reuse
        return slot, reuse

    def fed(self, slot: int, pos: int, ids: Sequence[int], whole_chunk: bool) -> None:
        """ids now sit at pos.. of slot; whole_chunk: a prefill chunk of exactly `chunk` tokens."""
        del self.tokens[slot][pos:]
        self.tokens[slot].extend(int(t) for t in ids)
        if whole_chunk and self.exact[slot] == pos:
            self.exact[slot] = pos + len(ids)
        elif self.exact[slot] > pos:
            self.exact[slot] = pos

    def holder(self, slot: int, prompt: Sequence[int], fed: int) -> tuple[int, int]:
        """Another slot, running or free, that holds more of prompt's leading whole chunks than the fed
        positions of `slot`: (that slot, how many positions it holds), else (-1, fed). The prompt's last
        token is always computed, as by `take`."""
        limit = (len(prompt) - 1) // self.chunk * self.chunk
        best = (fed, -1)
        for s in range(len(self.busy)):
            held, n = self.tokens[s], min(self.exact[s], limit)
            if s == slot or n <= best[0]:
                continue
            same = 0
            while same < n and held[same:same + self.chunk] == list(prompt[same:same + self.chunk]):
                same += self.chunk
            if min(same, n) > best[0]:
                best = (min(same, n), s)
        return best[1], best[0]

    def release(self, slot: int) -> None:
        self._clock += 1
        self.busy[slot] = False
        self.last_used[slot] = self._clock

    def forget(self) -> None:
        """Every slot's contents are gone (a new runner): nothing is reusable."""
        for s in range(len(self.busy)):
            self.tokens[s] = []
            self.exact[s] = 0


Recover = Callable[[RunnerLost], Any]  # builds a runner over what is left (a re-plan)


class Scheduler:
    """Sequences on a runner's slots; `step()` advances every one of them (see the module docstring)."""

    def __init__(self, runner: Any, tok: Any, recover: Recover | None = None, chunk: int = PREFILL_CHUNK) -> None:
        self.runner = runner
        self.tok = tok
        self.recover = recover
        self.chunk = chunk
        self.cache = PrefixCache(runner.slots, chunk)
        self.seqs: list[Seq] = []      # admission order
        self.batch = 0                 # rows of the last decode step
        self.last: list[tuple[str, int, float, bool]] = []  # what the last step() ran: (kind, tokens, ms, mixed)
        self.prefix_hits = 0
        self.cached_tokens = 0
        self._stream: dict[int, Any] = {}   # id(seq) -> its _StopFilter
        self._samplers: dict[int, sampling.Sampler] = {}
        self._t: dict[int, float] = {}

    @property
    def ctx(self) -> int:
        return self.runner.ctx

    @property
    def free(self) -> int:
        return self.cache.free

    def check(self, prompt: Sequence[int]) -> None:
        """ContextError when prompt can never run here."""
        if not prompt:
            raise ContextError("the prompt is empty")
        if len(prompt) >= self.ctx:
            raise ContextError(f"the prompt has {len(prompt)} tokens but the context holds {self.ctx}")

    def admit(self, seq: Seq) -> None:
        """seq takes a free slot (ContextError for a prompt that cannot run; RuntimeError when none is free)."""
        self.check(seq.prompt)
        seq.slot, seq.fed = self.cache.take(seq.prompt, reuse=seq.score is None)
        seq.cached = seq.fed
        if seq.cached:
            self.prefix_hits += 1
            self.cached_tokens += seq.cached
        seq.history = list(seq.prompt)
        self._stream[id(seq)] = _StopFilter(self.tok.stream(), [s for s in seq.stop if s])
        self._samplers[id(seq)] = sampling.Sampler(seq.params)
        self._t[id(seq)] = time.perf_counter()
        self.seqs.append(seq)

    def drop(self, seq: Seq) -> None:
        """seq leaves (finished or cancelled); its slot keeps what it computed for the prefix cache."""
        if seq in self.seqs:
            self.seqs.remove(seq)
            self.cache.release(seq.slot)
            for d in (self._stream, self._samplers, self._t):
                d.pop(id(seq), None)

    def drop_all(self) -> list[Seq]:
        """Every sequence leaves, and the cache forgets (after a failed step nothing in it is sure)."""
        gone = list(self.seqs)
        for s in gone:
            self.drop(s)
        self.cache.forget()
        return gone

    def begin(self) -> None:
        """runner.begin() (a cluster's workers enter their generation loop), re-planned around a node
        lost since the last pass as a step would be: a worker that died while the cluster was idle
        fails the first frame sent to it, and that is this one. Raises as step() does."""
        fresh = self.runner
        self._run(lambda r: r.begin() if r is fresh else None)  # a recovered runner has begun already

    # ---------------------------------------------------------------- one step

    def step(self) -> list[tuple[Seq, TokenEvent]]:
        """One pass: a decode row of every decoding sequence and one prefill chunk; the tokens they answered.

        Finished sequences leave. Raises what the runner raises (RunnerLost only when no recovery is left).
        `last` says what ran: a mixed pass is one ("decode", rows, ms, True) and one ("prefill",
        tokens, ms, True) with the same ms, the wall time of the whole pass (count it once).
        """
        self.last = []
        decoding = [s for s in self.seqs if s.pending is not None]
        rows = [Row(s.slot, s.fed, s.pending, s.history, s.params) for s in decoding]
        filling = self._next_to_fill()
        chunk = None
        if filling is not None:
            chunk = self._chunk(filling)
        if not rows and chunk is None:
            return []
        t0 = time.perf_counter()
        scores: list[Candidates] = []
        if chunk is not None and chunk.copy is not None:  # (a new runner after a lost node copies nothing)
            first = self.runner
            cands, cand, _ = self._run(lambda r: r.mixed(rows, chunk if r is first else replace(chunk, copy=None)))
        elif chunk is not None and chunk.score is not None:
            cands, cand, scores = self._run(lambda r: r.mixed(rows, chunk))
        elif not rows:
            cands, cand = [], self._run(lambda r: r.prefill(chunk.slot, chunk.ids, chunk.pos, chunk.history,
                                                            chunk.params))
        elif chunk is None:
            cands, cand = self._run(lambda r: r.decode(rows)), None
        else:
            cands, cand, _ = self._run(lambda r: r.mixed(rows, chunk))
        ms = (time.perf_counter() - t0) * 1000
        out: list[tuple[Seq, TokenEvent]] = []
        if rows:
            self.batch = len(rows)
            self.last.append(("decode", len(rows), ms, chunk is not None))
            for s, c in zip(decoding, cands):
                self.cache.fed(s.slot, s.fed, [s.pending], False)
                s.fed += 1
                out.append((s, self._answer(s, c)))
        if chunk is not None:
            s = filling
            self.last.append(("prefill", len(chunk.ids), ms, bool(rows)))
            self.cache.fed(s.slot, chunk.pos, chunk.ids, len(chunk.ids) == self.chunk)
            s.fed = chunk.pos + len(chunk.ids)
            s.scores += [sampling.logprobs(c, t, chunk.score) for c, t in zip(scores, [t for t in chunk.targets
                                                                                       if t >= 0])]
            if chunk.params is not None:
                ev = self._answer(s, cand)
                out.append((s, ev if s.score is None else replace(ev, prompt_logprobs=tuple(s.scores))))
            elif s.fed == len(s.prompt) and s.max_tokens == 0:
                note = "; ".join(s.notes) or None
                ms_s = (time.perf_counter() - self._t[id(s)]) * 1000
                scored = None if s.score is None else tuple(s.scores)
                out.append((s, self._finish(s, TokenEvent(0, -1, "", ms_s, "length", note, prompt_logprobs=scored))))
        for s, ev in out:
            if ev.finish_reason is not None:
                self.drop(s)
        return out

    def _chunk(self, s: Seq) -> Chunk:
        """The next chunk of s's prompt; the prompt's last asks the first answer's candidates (none
        when max_tokens is 0), and each chunk of a scored prompt the scores of its next tokens.

        Whole chunks of the prompt that another slot holds (a sequence running with the same
        beginning: a shared system prompt, a request's other choices) are copied, not read: the chunk
        is the one after them, and copies them first (Chunk.copy). s counts them as fed and cached
        from here, so a replay after a lost node reads them (the slot they came from may be gone)."""
        copy = None
        if s.score is None:
            src, held = self.cache.holder(s.slot, s.prompt, s.fed)
            if src >= 0:
                copy = (src, s.fed)
                self.cache.fed(s.slot, s.fed, s.prompt[s.fed:held], True)
                self.prefix_hits += not s.cached  # a hit per sequence, as /metrics counts them
                self.cached_tokens += held - s.fed
                s.cached += held - s.fed
                s.fed = held
        a, b = next(chunks(s.fed, len(s.prompt), self.chunk))
        ask = b == len(s.prompt) and s.max_tokens > 0
        history, params = (s.history, s.params) if ask else (None, None)
        if s.score is None:
            return Chunk(s.slot, a, list(s.prompt[a:b]), history, params, copy=copy)
        targets = [int(t) for t in s.prompt[a + 1:b + 1]] + ([-1] if b == len(s.prompt) else [])
        return Chunk(s.slot, a, list(s.prompt[a:b]), history, params, s.score, targets)

    def _next_to_fill(self) -> Seq | None:
        """The sequence whose prompt the next chunk reads: the least left to read (the oldest among equals),
        unless one has been passed over PATIENCE times (the oldest such)."""
        waiting = [s for s in self.seqs if s.pending is None and not s.done]
        if not waiting:
            return None
        pick = next((s for s in waiting if s.passed >= PATIENCE), None) or min(
            waiting, key=lambda s: len(s.prompt) - s.fed)
        for s in waiting:
            s.passed = 0 if s is pick else s.passed + 1
        return pick

    def _answer(self, s: Seq, cand: Candidates) -> TokenEvent:
        tid = self._samplers[id(s)].pick(cand)
        lp = None if s.params.logprobs is None else sampling.logprobs(cand, tid, s.params.logprobs)
        now = time.perf_counter()
        ms, self._t[id(s)] = (now - self._t[id(s)]) * 1000, now
        note = "; ".join(s.notes) or None
        s.notes.clear()
        s.history.append(tid)
        index, s.index = s.index, s.index + 1
        out = self._stream[id(s)]
        s.pending = None
        if tid in self.tok.stop_ids:
            # (an end token is no part of the answer: OpenAI's logprobs leave it out)
            return self._finish(s, TokenEvent(index, tid, out.finish(), ms, "stop", note))
        text, stopped = out.feed(tid)
        if stopped:
            return self._finish(s, TokenEvent(index, tid, text, ms, "stop", note, lp))
        if s.fed >= self.ctx:  # no room to feed this token back: stop, never wrap around
            return self._finish(s, TokenEvent(index, tid, text + out.finish(), ms, "context", note, lp))
        if index == s.max_tokens - 1:
            return self._finish(s, TokenEvent(index, tid, text + out.finish(), ms, "length", note, lp))
        s.pending = tid
        return TokenEvent(index, tid, text, ms, None, note, lp)

    @staticmethod
    def _finish(s: Seq, ev: TokenEvent) -> TokenEvent:
        s.finish_reason = ev.finish_reason
        return ev

    # ---------------------------------------------------------------- losing a node

    def _run(self, call: Callable[[Any], Any]) -> Any:
        """call(runner); a lost runner is replaced (recover), fed again what it had seen (_replay),
        and call retried. A loss while the new runner begins or replays is one more loss, not the
        end: a second node that dies while the first one's answers are replayed is planned around
        too, up to MAX_RECOVERIES in all."""
        lost: RunnerLost | None = None
        for attempt in range(MAX_RECOVERIES + 1):
            try:
                if lost is not None:
                    self._take_over(lost)
                return call(self.runner)
            except RunnerLost as exc:
                if self.recover is None or attempt == MAX_RECOVERIES:
                    raise
                lost = exc
        raise AssertionError("unreachable")

    def _take_over(self, exc: RunnerLost) -> None:
        self.runner = self.recover(exc)
        self.runner.begin()
        self.cache.forget()
        replayed = self._replay()
        for s in self.seqs:
            s.notes.append(f"{exc}; recovered with a new plan, replayed {replayed} tokens")

    def _replay(self) -> int:
        """Feed the new runner what the lost one had seen, computed as it was computed then:
        prompts in the same aligned chunks, answer tokens as decode rows, STEP_ROWS of them a step
        (each row gets the bits of its own step: Shard.forward_rows), so a long answer costs a
        handful of steps and round trips, not one per token."""
        total = 0
        for s in self.seqs:
            n_prompt = min(s.fed, len(s.prompt))
            for a, b in chunks(0, n_prompt, self.chunk):
                ids = list(s.prompt[a:b])
                self.runner.prefill(s.slot, ids, a, None, None)
                self.cache.fed(s.slot, a, ids, b - a == self.chunk)
            for a in range(n_prompt, s.fed, STEP_ROWS):
                run = range(a, min(a + STEP_ROWS, s.fed))
                self.runner.decode([Row(s.slot, pos, s.history[pos], s.history[:pos + 1], s.params) for pos in run])
                for pos in run:
                    self.cache.fed(s.slot, pos, [s.history[pos]], False)
            total += s.fed
        return total


class _StopFilter:
    """Streams decoded text, holding back what could still become a stop string.

    Text that ends with the first characters of a stop string is kept until
    the next token shows whether the stop string follows. The first token
    that completes a stop string ends the text, where that stop string starts
    (of several it completes, the one that starts first, whatever their order
    in the request); the stop string and everything after it are never sent.
    Each stop string is followed by a `_Match` as the text grows, so a token
    costs its own characters, however long the stop strings.
    """

    def __init__(self, decoder, stop: list[str]) -> None:
        self.decoder = decoder
        self.matches = [_Match(s) for s in stop if s]
        self.text = ""   # everything decoded so far
        self.sent = 0    # how much of it went out

    def feed(self, tid: int) -> tuple[str, bool]:
        piece = self.decoder.feed(tid)
        self.text += piece
        ends = [(m.feed(piece), len(m.s)) for m in self.matches]
        starts = [len(self.text) - len(piece) + end - n for end, n in ends if end is not None]
        if starts:
            return self._send(min(starts)), True
        hold = max((m.held for m in self.matches), default=0)
        return self._send(len(self.text) - hold), False

    def finish(self) -> str:
        self.text += self.decoder.flush()
        return self._send(len(self.text))

    def _send(self, upto: int) -> str:
        upto = max(upto, self.sent)
        piece, self.sent = self.text[self.sent:upto], upto
        return piece


class _Match:
    """Knuth-Morris-Pratt over one stop string: `held` is the length of the longest beginning of it the
    text fed so far ends with; `feed` says where in a piece the whole string first ends."""

    def __init__(self, s: str) -> None:
        self.s, self.held = s, 0
        self.back = back = [0] * len(s)  # back[i]: the longest beginning of s that s[:i + 1] ends with, s itself not
        k = 0
        for i in range(1, len(s)):
            while k and s[i] != s[k]:
                k = back[k - 1]
            if s[i] == s[k]:
                k += 1
            back[i] = k

    def feed(self, piece: str) -> int | None:
        """The index in piece just past where s first ends in the text (None: it does not, yet)."""
        s, back, k = self.s, self.back, self.held
        for i, c in enumerate(piece):
            while k and s[k] != c:
                k = back[k - 1]
            if s[k] == c:
                k += 1
                if k == len(s):
                    self.held = 0
                    return i + 1
        self.held = k
        return None
