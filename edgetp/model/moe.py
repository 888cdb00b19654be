"""A mixture-of-experts FFN (mixtral, qwen3moe) as llama.cpp's build_moe_ffn computes it.

Per token, with h the normed hidden state (dim,):
    r = W_router @ h                      router logits, (n_experts,)
    p = softmax(r)
    e_1..e_k = the k experts of largest p, largest first
    w_j = p[e_j]; if normalised: w_j /= max(sum_j w_j, 2^-14); if scaled: w_j *= scale
    out = sum_j w_j * down_e_j(act(gate_e_j @ h) * (up_e_j @ h)), added in the order j = 1..k

qwen2moe adds a shared expert that every token goes through (llama_model_qwen2moe's graph), its
weights not normalised (norm_w false):
    out += g * down_s(silu(gate_s @ h) * (up_s @ h)),  g = silu(z) / z (a sigmoid), z = w_gate_s . h

Each expert is an ordinary quantized matrix (quant.Weight), so its products run on the
kernels every other weight runs on (the integer decode and prefill kernels of each ISA).

A shard holds, like a dense FFN, a range of every expert's columns (ShardSpec.ffn_cols):
its out is its columns' part of the sum, and the shards' parts add up in the layer's
reduce. The router is replicated and computed by the exact kernel (quant.exact_matmul:
float64 sums in column order, the same bits on every CPU), so that every shard, whatever
its CPU, picks the same experts for a token. The shared expert is split like a dense FFN
(ModelConfig.shared_cols: every shard its columns, in the same reduce) and its gate z is
computed whole on every shard by the same exact kernel, so every shard scales by the same g.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from edgetp.model import ops, quant

NORM_FLOOR = np.float32(6.103515625e-5)  # llama.cpp clamps the sum of the chosen weights at f16's smallest normal


@dataclass(frozen=True)
class Shared:
    """A shared expert (qwen2moe) as a shard holds it: its gate whole, its columns of the FFN."""

    gate_inp: quant.Weight             # (1, dim) f32: z = gate_inp . h, whole on every shard
    gate: quant.Weight | None          # (shared_l, dim); None: no columns here
    up: quant.Weight | None            # (shared_l, dim)
    down: quant.Weight | None          # (dim, shared_l)

    @property
    def nbytes(self) -> int:
        return self.gate_inp.nbytes + sum(w.nbytes for w in (self.gate, self.up, self.down) if w is not None)


@dataclass(frozen=True)
class Experts:
    """One layer's experts as a shard holds them."""

    router: quant.Weight                   # (n_experts, dim), whole on every shard
    gate: tuple[quant.Weight | None, ...]  # per expert (ffn_l, dim); None: no columns here
    up: tuple[quant.Weight | None, ...]    # per expert (ffn_l, dim)
    down: tuple[quant.Weight | None, ...]  # per expert (dim, ffn_l)
    used: int                              # k: experts per token
    norm: bool                             # chosen weights divided by their sum
    scale: float = 0.0                     # then times this; 0: not scaled
    shared: Shared | None = None           # a shared expert beside them (qwen2moe)

    @property
    def nbytes(self) -> int:
        own = self.router.nbytes + sum(w.nbytes for w in self.gate + self.up + self.down if w is not None)
        return own + (self.shared.nbytes if self.shared is not None else 0)


def shared_gate(s: Shared, h: np.ndarray, out: np.ndarray) -> None:
    """out (n,) = the shared expert's gate of each row of h (n, dim), C-contiguous: sigmoid(z) as
    llama.cpp computes it, silu(z) / z in f32, z by the exact kernel (the same bits on every shard and CPU)."""
    quant.exact_matmul(s.gate_inp, h, out.reshape(-1, 1))
    _sigmoid(out)


@njit(cache=True, nogil=True)
def _sigmoid(z):  # pragma: no cover - compiled
    # z (n,) f32 in place -> silu(z) / z: ggml's silu (z / (1 + e^-z), f32) divided by z, as qwen2moe's
    # graph; at z = 0 its limit 1/2 (llama.cpp's 0 / 0 gives NaN there)
    for b in range(z.shape[0]):
        x = z[b]
        z[b] = np.float32(0.5) if x == 0 else (x / (np.float32(1.0) + np.exp(-x))) / x


def shared_ffn(s: Shared, h: np.ndarray, out: np.ndarray, geglu: bool) -> None:
    """out (n, dim) += this shard's part of the gated shared expert for each row of h (n, dim)
    (nothing if it holds none of its columns), after the routed experts' sum, as llama.cpp adds it."""
    if s.gate is None:
        return
    n, h = h.shape[0], np.ascontiguousarray(h)
    g = np.empty(n, np.float32)
    shared_gate(s, h, g)
    hx = quant.Batch(h)
    a = np.empty((n, s.gate.rows), np.float32)
    u = np.empty_like(a)
    quant.apply(s.gate, hx, a)
    quant.apply(s.up, hx, u)
    (ops.gelu_mul if geglu else ops.silu_mul)(a, u)
    y = np.empty((n, out.shape[1]), np.float32)
    quant.apply(s.down, a, y)
    y *= g[:, None]
    out += y


def route(e: Experts, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The experts of each row of h (n, dim) and their weights: ((n, k) int64, largest first; (n, k) f32).

    Chosen by the exact router logits (ties to the lower index), so every shard agrees; the
    weights are the softmax probabilities of those experts (f32 exps, their sum in f64 as
    ggml's soft_max), then normalised and scaled."""
    n = h.shape[0]
    ids, w = np.empty((n, e.used), np.int64), np.empty((n, e.used), np.float32)
    route_into(e, np.ascontiguousarray(h), np.empty((n, e.router.rows), np.float32), ids, w)
    return ids, w


def route_into(e: Experts, h: np.ndarray, logits: np.ndarray, ids: np.ndarray, w: np.ndarray) -> None:
    """route into buffers: h (n, dim) C-contiguous; logits (n, n_experts), ids (n, k), w (n, k)."""
    quant.exact_matmul(e.router, h, logits)
    _pick(logits, e.norm, np.float32(e.scale), ids, w)


@njit(cache=True, nogil=True)
def group(ids, hits, starts, fill, rows, slots):  # pragma: no cover - compiled
    # ids (n, k) -> the (row, slot) pairs routed to each expert x at [starts[x], starts[x + 1]) of
    # rows and slots (n * k each), in row order; hits[x] += their count. starts (E + 1,), fill (E,) scratch
    n, k = ids.shape
    starts[:] = 0
    for b in range(n):
        for j in range(k):
            starts[ids[b, j] + 1] += 1
    for x in range(fill.shape[0]):
        hits[x] += starts[x + 1]
        starts[x + 1] += starts[x]
        fill[x] = starts[x]
    for b in range(n):
        for j in range(k):
            x = ids[b, j]
            rows[fill[x]] = b
            slots[fill[x]] = j
            fill[x] += 1


@njit(cache=True, nogil=True)
def _pick(logits, norm, scale, ids, w):  # pragma: no cover - compiled
    # logits (n, E) f32 -> ids (n, k) the k largest of each row, largest first (ties: lower index),
    # w (n, k) their softmax probabilities, divided by their sum (at least NORM_FLOOR) if norm,
    # times scale unless it is 0
    n, n_exp = logits.shape
    k = ids.shape[1]
    taken = np.zeros(n_exp, np.bool_)
    for b in range(n):
        row = logits[b]
        top = row.max()
        total = 0.0
        for x in range(n_exp):
            total += np.float64(np.exp(np.float32(row[x] - top)))
        inv = np.float32(1.0 / total)
        taken[:] = False
        for j in range(k):
            best = -1
            for x in range(n_exp):
                if not taken[x] and (best < 0 or row[x] > row[best]):
                    best = x
            taken[best] = True
            ids[b, j] = best
            w[b, j] = np.exp(np.float32(row[best] - top)) * inv
        if norm:
            s = np.float32(0.0)
            for j in range(k):
                s += w[b, j]
            s = max(s, NORM_FLOOR)
            for j in range(k):
                w[b, j] = w[b, j] / s
        if scale != 0:
            for j in range(k):
                w[b, j] *= scale


def ffn(e: Experts, h: np.ndarray, out: np.ndarray, geglu: bool, hits: np.ndarray | None = None) -> None:
    """out (n, dim) = this shard's part of the experts' output for each row of h (n, dim).

    Each expert runs once on the rows routed to it (a matvec for one row, a matmul for
    more); a row's k weighted outputs are then added in routing order, as llama.cpp adds
    them. hits (n_experts,), if given, counts each expert once per row routed to it."""
    ids, w = route(e, h)
    if hits is not None:
        np.add.at(hits, ids.reshape(-1), 1)
    n, dim = h.shape
    parts = np.zeros((e.used, n, dim), np.float32)  # parts[j, b]: row b's j-th expert, weighted
    for x in np.unique(ids).tolist():
        gate, up, down = e.gate[x], e.up[x], e.down[x]
        if gate is None:
            continue
        rows, slots = np.nonzero(ids == x)
        hx = quant.Batch(np.ascontiguousarray(h[rows]))
        g = np.empty((rows.shape[0], gate.rows), np.float32)
        u = np.empty_like(g)
        quant.apply(gate, hx, g)
        quant.apply(up, hx, u)
        (ops.gelu_mul if geglu else ops.silu_mul)(g, u)
        y = np.empty((rows.shape[0], dim), np.float32)
        quant.apply(down, g, y)
        parts[slots, rows] = y * w[rows, slots][:, None]
    out[:] = parts[0]
    for j in range(1, e.used):
        out += parts[j]
    if e.shared is not None:
        shared_ffn(e.shared, h, out, geglu)
