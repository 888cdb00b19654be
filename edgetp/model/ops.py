"""The element-wise and attention kernels of the forward pass.

Every kernel writes into an `out` (or in-place) buffer; none allocates in
its hot loop beyond a per-thread scratch row. Shapes are in the comments;
`n` is the number of tokens in the batch (1 when decoding).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

_JIT = dict(cache=True, nogil=True, fastmath=False)


@njit(**_JIT)
def rmsnorm(x, w, eps, out):  # pragma: no cover - compiled
    # x: (n, dim) f32, w: (dim,) f32, out: (n, dim) f32
    n, dim = x.shape
    for i in range(n):
        ss = 0.0
        for j in range(dim):
            ss += x[i, j] * x[i, j]
        scale = np.float32(1.0 / math.sqrt(ss / dim + eps))
        for j in range(dim):
            out[i, j] = x[i, j] * scale * w[j]


def rope_table(n_pos: int, rope_dims: int, theta: float, freq_factors: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin of every position and frequency: (n_pos, rope_dims // 2) each, f32."""
    inv = theta ** (-np.arange(0, rope_dims, 2, dtype=np.float64) / rope_dims)
    if freq_factors is not None:
        inv = inv / freq_factors[: rope_dims // 2].astype(np.float64)
    ang = np.arange(n_pos, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


@njit(**_JIT)
def rope(x, n_heads, head_dim, rope_dims, pos0, cos, sin, neox):  # pragma: no cover - compiled
    # x: (n, n_heads * head_dim) f32, rotated in place for positions pos0 .. pos0+n-1
    # cos, sin: (n_pos, rope_dims // 2); neox pairs (i, i + rope_dims/2), else (2i, 2i+1)
    n = x.shape[0]
    half = rope_dims // 2
    for t in range(n):
        p = pos0 + t
        for h in range(n_heads):
            base = h * head_dim
            for i in range(half):
                c = cos[p, i]
                s = sin[p, i]
                if neox:
                    a = base + i
                    b = base + i + half
                else:
                    a = base + 2 * i
                    b = a + 1
                x0 = x[t, a]
                x1 = x[t, b]
                x[t, a] = x0 * c - x1 * s
                x[t, b] = x0 * s + x1 * c


@njit(parallel=True, **_JIT)
def attention(q, k_cache, v_cache, pos0, group, out):  # pragma: no cover - compiled
    # q: (n, n_heads * hd) roped queries for positions pos0 .. pos0+n-1
    # k_cache, v_cache: (n_kv, ctx, hd); rows up to pos0+n-1 are filled
    # out: (n, n_heads * hd); query head h reads KV head h // group (causal)
    n = q.shape[0]
    n_kv, ctx, hd = k_cache.shape
    n_heads = n_kv * group
    scale = np.float32(1.0 / math.sqrt(hd))
    for job in prange(n * n_heads):
        t = job // n_heads
        h = job % n_heads
        kv = h // group
        last = pos0 + t  # attends to 0 .. last
        scores = np.empty(last + 1, dtype=np.float32)
        top = np.float32(-np.inf)
        for s in range(last + 1):
            acc = np.float32(0.0)
            for d in range(hd):
                acc += q[t, h * hd + d] * k_cache[kv, s, d]
            acc *= scale
            scores[s] = acc
            if acc > top:
                top = acc
        total = np.float32(0.0)
        for s in range(last + 1):
            e = np.float32(math.exp(scores[s] - top))
            scores[s] = e
            total += e
        inv = np.float32(1.0) / total
        for d in range(hd):
            out[t, h * hd + d] = 0.0
        for s in range(last + 1):
            p = scores[s] * inv
            for d in range(hd):
                out[t, h * hd + d] += p * v_cache[kv, s, d]


def silu_mul(gate: np.ndarray, up: np.ndarray) -> None:
    """gate <- silu(gate) * up, (n, f) f32 each, a row at a time through numpy's SIMD
    exp (the scalar numba loop called libm's exp per value: 2.5x slower)."""
    tmp = np.empty(gate.shape[1], np.float32)
    for g, u in zip(gate, up):
        np.negative(g, out=tmp)
        np.exp(tmp, out=tmp)
        tmp += np.float32(1.0)
        g /= tmp
        g *= u


QBLOCK = 64  # query rows per attention block: a block reads keys only up to its own last row


def attention_batch(q, k_cache, v_cache, pos0, group, out):
    """Causal attention for a batch of n > 1 tokens through BLAS, in blocks of one KV head
    and QBLOCK query rows.

    Same contract as `attention`; the scalar kernel is right for one token, but a
    prefill batch is two matrix products per KV head. Row blocks skip the keys
    after their last row: for 256 new tokens, 3/8 of the work. (Python threads
    running the blocks side by side were slower: numba's OpenMP workers still spin
    on the same cores after each kernel.) Every block's shapes depend on n and pos0
    only, not on which node holds the head, so a cluster stays bit-identical to a
    single node.
    """
    n = q.shape[0]
    n_kv, _, hd = k_cache.shape
    qh = q.reshape(n, n_kv, group, hd)
    oh = out.reshape(n, n_kv, group, hd)
    scale = np.float32(1.0 / math.sqrt(hd))
    for kv, a in ((kv, a) for kv in range(n_kv) for a in range(0, n, QBLOCK)):
        b = min(n, a + QBLOCK)
        m, last = b - a, pos0 + b  # rows a..b-1 attend to keys 0..last-1 at most
        future = np.arange(last)[None, :] > (pos0 + np.arange(a, b))[:, None]  # (m, last): s > t
        causal = np.where(future, np.float32(-np.inf), np.float32(0.0))         # added: x + 0 is x
        qs = qh[a:b, kv].transpose(1, 0, 2).reshape(group * m, hd)            # rows: head-major
        scores = qs @ k_cache[kv, :last].T                                     # (group * m, last)
        s3 = scores.reshape(group, m, last)
        s3 *= scale
        s3 += causal
        scores -= scores.max(axis=1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=1, keepdims=True)
        oh[a:b, kv] = (scores @ v_cache[kv, :last]).reshape(group, m, hd).transpose(1, 0, 2)
