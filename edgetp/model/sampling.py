"""Sampling: greedy, temperature, top-k, top-p, min-p, logit bias, repetition, frequency and presence
penalties (llama.cpp's, over the last `repeat_last_n` tokens, prompt included), seed.

Sampling is split in two so that it stays exact when the vocabulary is
spread over several nodes:

1. `candidates()` runs where the logits are (each node, on its own rows):
   it applies the logit bias and the penalties, keeps the local top-k, and reports the
   log-sum-exp of all its (penalised, temperature-scaled) logits.
2. `merge()` + `Sampler.pick()` run on the root over the union of the
   candidates. The global top-k is always inside the union of local top-ks,
   and the log-sum-exp pieces give the exact softmax denominator, so top-p
   and min-p see the same probabilities as on a single node.

A single node runs the same two steps, so it samples identically to a
cluster with the same seed.

Log probabilities (`SamplingParams.logprobs`, the API's `logprobs`) are the model's own: the
log-softmax of its logits before the bias, the penalties and the temperature, as vLLM reports
them by default. Each shard sends the log-sum-exp of its own logits, their values at
its candidates and its `logprobs` best; `merge` joins them as it joins the candidates.

Scoring a prompt (the API's `echo`) asks the same of every prompt position, at the prompt's next
token instead of at candidates: `scored()` is one position's part from one shard, and `merge` +
`logprobs` join the parts as they join a sampled token's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
from numba import njit

# the settings and their checks live apart, without numba: a client validates them before it sends
from edgetp.params import MAX_CANDIDATES, MAX_LOGPROBS, SamplingError, SamplingParams  # noqa: F401


@dataclass(frozen=True)
class Own:
    """A shard's own logits (no bias, penalty or temperature), for log probabilities."""

    at: np.ndarray         # (k,) f32, at the candidates' ids
    lse: float             # log-sum-exp of all of them (f64 sum)
    top_ids: np.ndarray    # (n,) int64, the n highest, best first (ties: lower id first)
    top: np.ndarray        # (n,) f32


@dataclass(frozen=True)
class Candidates:
    ids: np.ndarray      # (k,) int64, global token ids, best first (ties: lower id first)
    logits: np.ndarray   # (k,) f32, penalised and divided by the temperature
    lse: float           # log-sum-exp of every logit of the shard (after penalty and temperature)
    own: Own | None = None  # with params.logprobs


@dataclass(frozen=True)
class Logprobs:
    """One answered (or scored prompt) token's log probability under the model, and the n likeliest
    tokens beside it. A prompt's first token has neither (None): nothing before it predicts it."""

    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] | None  # (token id, log probability), likeliest first


def logprobs(c: Candidates, token: int, n: int) -> Logprobs:
    """`token`'s (one of c.ids) log probability and the n likeliest, from merged candidates with `own`."""
    own = c.own
    if own is None:
        raise ValueError("these candidates carry no logits of the model's own (params.logprobs was not set)")
    at = int(np.flatnonzero(c.ids == token)[0])
    top = tuple((int(t), float(np.float64(v) - own.lse)) for t, v in zip(own.top_ids[:n], own.top[:n]))
    return Logprobs(int(token), float(np.float64(own.at[at]) - own.lse), top)


def penalise(logits: np.ndarray, offset: int, history: Sequence[int], params: SamplingParams) -> np.ndarray:
    """This shard's rows (offset ..) of the logits as llama.cpp's sampler chain leaves them before
    temperature: the logit bias added, then its penalties on each token that occurs c > 0 times in
    the last `repeat_last_n` of history: divided by repeat_penalty (multiplied when <= 0), then
    c * frequency_penalty + presence_penalty subtracted (llama_sampler_penalties)."""
    p = params
    penalties = p.repeat_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
    if not p.logit_bias and not (penalties and history):
        return logits
    out = logits.copy()
    for token, bias in p.logit_bias:
        if 0 <= token - offset < out.shape[0]:
            out[token - offset] += np.float32(bias)
    if not penalties or not history:
        return out
    recent, count = np.unique(np.asarray(history[-p.repeat_last_n:], dtype=np.int64), return_counts=True)
    mine = (recent >= offset) & (recent < offset + out.shape[0])
    rows, count = recent[mine] - offset, count[mine].astype(np.float32)
    vals = out[rows]
    if p.repeat_penalty != 1.0:
        vals = np.where(vals > 0, vals / np.float32(p.repeat_penalty), vals * np.float32(p.repeat_penalty))
    out[rows] = vals - (count * np.float32(p.frequency_penalty) + np.float32(p.presence_penalty))
    return out


def candidates(logits: np.ndarray, offset: int, history: Sequence[int], params: SamplingParams) -> Candidates:
    """A shard's best tokens; `logits` are rows offset .. offset+len of the vocabulary."""
    raw = np.asarray(logits, np.float32)
    x = penalise(raw, offset, history, params)
    if x.size == 0:  # a shard with no vocabulary rows
        return Candidates(np.zeros(0, np.int64), np.zeros(0, np.float32), float("-inf"))
    if params.greedy:
        best = int(np.argmax(x))
        return _with_own(Candidates(np.array([best + offset]), x[best:best + 1].copy(), 0.0), raw, offset, params)
    x = x / np.float32(params.temperature)
    k = min(params.k, x.shape[0])
    idx, vals = np.empty(k, np.int64), np.empty(k, np.float32)
    lse = _top_lse(x, idx, vals)
    return _with_own(Candidates(idx + offset, vals, lse), raw, offset, params)


def scored(logits: np.ndarray, offset: int, target: int, n: int) -> Candidates:
    """A shard's part of one prompt position's score: the model's own logit at `target` (the prompt's
    next token; none when another shard holds it), its log-sum-exp and its n best, as `Own`. The ids
    hold target when this shard has it, so `merge` and `logprobs` take it as a sampled token."""
    raw = np.asarray(logits, np.float32)
    if raw.size == 0:
        return Candidates(np.zeros(0, np.int64), np.zeros(0, np.float32), float("-inf"))
    mine = 0 <= target - offset < raw.shape[0]
    ids = np.array([target] if mine else [], np.int64)
    k = min(n, raw.shape[0])
    idx, vals = np.empty(max(k, 1), np.int64), np.empty(max(k, 1), np.float32)
    lse = float(_top_lse(raw, idx, vals))
    at = raw[ids - offset]  # (an index array: a copy of its own)
    return Candidates(ids, at, lse, Own(at, lse, idx[:k] + offset, vals[:k]))


def _with_own(c: Candidates, raw: np.ndarray, offset: int, params: SamplingParams) -> Candidates:
    if params.logprobs is None:
        return c
    n = min(params.logprobs, raw.shape[0])
    idx, vals = np.empty(max(n, 1), np.int64), np.empty(max(n, 1), np.float32)
    lse = _top_lse(raw, idx, vals)
    return Candidates(c.ids, c.logits, c.lse, Own(raw[c.ids - offset].copy(), float(lse), idx[:n] + offset, vals[:n]))


@njit(cache=True, nogil=True)
def top_k(x, idx, vals):  # pragma: no cover - compiled
    # idx, vals (k,) = the k largest of x (f32), largest first, ties lower index first, in one
    # pass: an entry goes in only if strictly above the k-th so far, after its equals (so ties
    # keep index order). Over a 128k vocabulary with k = 64: ~0.1 ms, where argpartition takes
    # ~1.6. k <= x.shape[0].
    k, m = idx.shape[0], 0
    for i in range(x.shape[0]):
        v = x[i]
        if m == k and not v > vals[k - 1]:
            continue
        j = m if m < k else k - 1  # the slot it may take: past the end, or the last
        while j > 0 and v > vals[j - 1]:
            if j < k:
                vals[j], idx[j] = vals[j - 1], idx[j - 1]
            j -= 1
        vals[j], idx[j] = v, i
        m = min(m + 1, k)


@njit(cache=True, nogil=True)
def _top_lse(x, idx, vals):  # pragma: no cover - compiled
    # top_k, then top + log(sum of exp(f64(x - top))), top = max(x): over a 128k vocabulary
    # ~5x faster than argpartition, lexsort and numpy's exp.
    top_k(x, idx, vals)
    top = vals[0]
    s = 0.0
    for i in range(x.shape[0]):
        s += np.exp(np.float64(x[i] - top))
    return np.float64(top) + np.log(s)


def merge(parts: Iterable[Candidates]) -> Candidates:
    """The union of shard candidates, best first, with the total log-sum-exp. A part with no ids
    counts only when it carries its own logits (a prompt position's score from a shard that does not
    hold the scored token); else it is a shard with no vocabulary rows."""
    parts = [p for p in parts if p.ids.size or p.own is not None]
    ids = np.concatenate([p.ids for p in parts])
    vals = np.concatenate([p.logits for p in parts])
    order = np.lexsort((ids, -vals))
    own = _merge_own(parts, order) if all(p.own is not None for p in parts) else None
    return Candidates(ids[order], vals[order], _lse([p.lse for p in parts]), own)


def _lse(parts: list[float]) -> float:
    lses = np.array(parts)
    top = lses.max()
    return float(top + np.log(np.exp(lses - top).sum()))


def _merge_own(parts: list[Candidates], order: np.ndarray) -> Own:
    n = max(p.own.top.size for p in parts)
    ids = np.concatenate([p.own.top_ids for p in parts])
    vals = np.concatenate([p.own.top for p in parts])
    best = np.lexsort((ids, -vals))[:n]
    return Own(np.concatenate([p.own.at for p in parts])[order], _lse([p.own.lse for p in parts]), ids[best],
               vals[best])


class Sampler:
    """Picks the next token from merged candidates; seeded for reproducibility."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def pick(self, c: Candidates) -> int:
        # A NaN logit reaches here from any shard: np.argmax takes the first NaN as the best token, and
        # top_k's first k keep one; a NaN anywhere makes the shard's log-sum-exp NaN.
        nan = np.flatnonzero(np.isnan(c.logits))
        if nan.size or np.isnan(c.lse):
            where = f" (token {int(c.ids[nan[0]])})" if nan.size else ""
            raise ValueError(f"the model's logits hold NaN{where}: its weights are corrupt or do not hold what "
                             "their type says")
        p = self.params
        if p.greedy:
            return int(c.ids[0])
        k = min(p.top_k or c.ids.size, c.ids.size)
        ids, vals = c.ids[:k], c.logits[:k].astype(np.float64)
        probs = np.exp(vals - c.lse)  # exact full-vocabulary softmax
        keep = k
        if p.top_p < 1.0:
            cum = np.cumsum(probs)
            keep = min(keep, int(np.searchsorted(cum, p.top_p)) + 1)
        if p.min_p > 0:
            keep = min(keep, max(1, int(np.count_nonzero(probs >= p.min_p * probs[0]))))
        probs = probs[:keep] / probs[:keep].sum()
        return int(ids[self.rng.choice(keep, p=probs)])
