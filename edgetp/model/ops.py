"""The element-wise and attention kernels of the forward pass.

Every kernel writes into an `out` (or in-place) buffer; none allocates in
its hot loop beyond a per-thread scratch row. Shapes are in the comments;
`n` is the number of tokens in the batch (1 when decoding).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from edgetp.model import lanes
from edgetp.model.kvcache import _f32_bits, kv_rows, kv_values

_JIT = dict(cache=True, nogil=True, fastmath=False)


@njit(inline="always", **_JIT)
def exp32(x):  # pragma: no cover - compiled
    """e**x in float32 that LLVM can vectorize (libm's expf is one call per value).

    Cephes' expf: x = k ln2 + r, |r| <= ln2/2, e**r by a degree-7 polynomial, times
    2**k built from its bits. Measured against float64 exp on 2M points of
    (-87, 88]: at most 1.35 ulp (numpy's float32 exp: 3.4). At -87 and below it returns 0
    (e**-87 is near float32's smallest normal), above 88 it returns e**88.
    """
    y = min(max(x, np.float32(-87.0)), np.float32(88.0))
    k = np.floor(y * np.float32(1.44269504088896341) + np.float32(0.5))
    r = y - k * np.float32(0.693359375) + k * np.float32(2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    e = p * _f32_bits((np.int32(k) + np.int32(127)) << np.int32(23))
    return e if x > np.float32(-87.0) else np.float32(0.0)


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


@njit(**_JIT)
def rmsnorm_heads(x, head_dim, w, eps):  # pragma: no cover - compiled
    # x: (n, heads * head_dim) f32, each head's head_dim values RMS-normed in place, times w (head_dim,)
    # (qwen3's q and k norms); each head's arithmetic is rmsnorm's on a row of head_dim
    n, width = x.shape
    for i in range(n):
        for base in range(0, width, head_dim):
            ss = 0.0
            for j in range(head_dim):
                ss += x[i, base + j] * x[i, base + j]
            scale = np.float32(1.0 / math.sqrt(ss / head_dim + eps))
            for j in range(head_dim):
                x[i, base + j] = x[i, base + j] * scale * w[j]


def rope_table(n_pos: int, rope_dims: int, theta: float, freq_factors: np.ndarray | None,
               scale: float = 1.0, mscale: float = 1.0,
               yarn: tuple[int, float, float] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin of every position and frequency: (n_pos, rope_dims // 2) each, f32; scale: linear
    rope scaling, every angle times it (llama.cpp's freq_scale); mscale: cos and sin times it, so
    the rotated values of q and k are too (llama.cpp's attn_factor).

    yarn (original context, beta_fast, beta_slow): YaRN, as ggml's rope_yarn. The pairs that turn
    more than beta_fast times over the original context keep their angle, those that turn fewer than
    beta_slow times take it times `scale`, and a linear ramp blends the ones between. cos and sin are
    then also times 1 + 0.1 ln(1 / scale) (ModelConfig.rope_mscale gives the mscale that goes with it)."""
    inv = theta ** (-np.arange(0, rope_dims, 2, dtype=np.float64) / rope_dims)
    if freq_factors is not None:
        inv = inv / freq_factors[: rope_dims // 2].astype(np.float64)
    if yarn is not None:
        ctx, fast, slow = yarn

        def corr(rotations: float) -> float:  # the pair that turns `rotations` times over ctx
            return rope_dims * math.log(ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = max(0.0, math.floor(corr(fast))), min(rope_dims - 1.0, math.ceil(corr(slow)))
        pair = np.arange(rope_dims // 2, dtype=np.float64)
        keep = 1.0 - np.clip((pair - low) / max(0.001, high - low), 0.0, 1.0)  # 1: the angle as it is
        inv = inv * (scale * (1.0 - keep) + keep)
        mscale *= 1.0 + 0.1 * math.log(1.0 / scale)
        scale = 1.0
    ang = (np.arange(n_pos, dtype=np.float64) * scale)[:, None] * inv[None, :]
    return (np.cos(ang) * mscale).astype(np.float32), (np.sin(ang) * mscale).astype(np.float32)


@njit(**_JIT)
def temper(x, pos0, temp, floor):  # pragma: no cover - compiled
    # x: (n, width) f32, row t (position pos0 + t) times 1 + temp * ln(floor((pos0 + t) / floor) + 1),
    # in place: llama 4's query temperature (llama.cpp's attn_temp input, for mistral3); temp 0: none
    if temp == 0.0:
        return
    for t in range(x.shape[0]):
        s = np.float32(math.log(math.floor((pos0 + t) / floor) + 1.0) * temp + 1.0)
        for j in range(x.shape[1]):
            x[t, j] = x[t, j] * s


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
def attention(q, k_cache, v_cache, pos0, group, out, threads, scale=0.0, window=0, cap=0.0):  # pragma: no cover
    # q: (n, n_heads * hd) roped queries for positions pos0 .. pos0+n-1
    # k_cache, v_cache: (n_kv, ctx, row) kernel views (kernel_view); rows up to pos0+n-1 are filled
    # out: (n, n_heads * hd); query head h reads KV head h // group (causal)
    # threads: numba's thread count; 1 runs without the parallel launch (each head's arithmetic is
    # the same however the jobs go: by_kv)
    # scale: of q.k (0: 1/sqrt(hd)); window > 0: only keys p with pos - p < window (a sliding
    # window); cap > 0: scores soft-capped to cap * tanh(score / cap) (gemma2)
    per_kv = by_kv(q.shape[0], k_cache.shape[0], threads)
    jobs = q.shape[0] * k_cache.shape[0] * (1 if per_kv else group)
    if threads <= 1:
        for job in range(jobs):
            attend_job(q, k_cache, v_cache, pos0, group, out, job, per_kv, scale, window, cap)
    else:
        for job in prange(jobs):
            attend_job(q, k_cache, v_cache, pos0, group, out, job, per_kv, scale, window, cap)


@njit(inline="always", **_JIT)
def by_kv(n, n_kv, threads):  # pragma: no cover - compiled
    # whether n tokens' attention over n_kv KV heads goes in jobs of one (token, KV head), each key
    # read once for its query heads, not one (token, query head) each: always on one thread, and
    # when there are jobs enough for every thread (the bits are the same either way)
    return threads <= 1 or n * n_kv >= 2 * threads


@njit(**_JIT)
def attend_job(q, k_cache, v_cache, pos0, group, out, job, per_kv, scale=0.0, window=0, cap=0.0):  # pragma: no cover
    # job of `attention`: if per_kv, every query head of one (token, KV head), job = token * n_kv +
    # KV head (each key and value row read and decoded once for the group's heads); else one
    # (token, query head), job = token * n_heads + head
    # (one call site: with two, numba compiled attend_heads twice, once with count a literal 1: 3.3 s
    # more at a process's first start)
    per = k_cache.shape[0] if per_kv else k_cache.shape[0] * group  # jobs a token
    h0 = job % per * group if per_kv else job % per
    attend_heads(q, k_cache, v_cache, pos0, group, out, job // per, h0, group if per_kv else 1, scale, window, cap)


@njit(**_JIT)
def attend_heads(q, k_cache, v_cache, pos0, group, out, t, h0, count, scale, window, cap):  # pragma: no cover
    # query heads h0 .. h0+count-1 of token t, which read one KV head. Each head's arithmetic is
    # its own and the same whatever count is: each score is lanes' dot of q and the key (16 lanes,
    # folded in halves: one order on every ISA), times the scale; e**x is exp32 (float32 steps,
    # the same bits on every ISA and C library: libm's expf, one call per value, was a third of
    # the time); softmax's sum is one chain over positions in order, and so is each output
    # value, four positions a step (the same chain). A cache that is not float32 is decoded
    # (kv_rows) four rows at a time into f32 first: the same values, any type.
    n_kv = k_cache.shape[0]
    n_heads = n_kv * group
    hd = q.shape[1] // n_heads
    sc = np.float32(1.0 / math.sqrt(hd)) if scale == 0.0 else np.float32(scale)
    kv = h0 // group
    last = pos0 + t  # attends to first .. last
    first = max(0, last - window + 1) if window > 0 else 0
    scores = np.empty((count, last + 1), dtype=np.float32)
    qh = np.empty((count, hd), dtype=np.float32)  # contiguous, for lanes.scores*
    for g in range(count):  # (element by element here and below: a slice assignment compiles numba's
        for d in range(hd):   # shape-mismatch message, 1.5-2.8 s at a process's first start)
            qh[g, d] = q[t, (h0 + g) * hd + d]
    qa = qh.ctypes.data
    sa, span = scores.ctypes.data, (last + 1) * 4  # scores[g, s] at sa + g * span + s * 4
    kc, vc = k_cache[kv], v_cache[kv]
    scratch = np.empty((4, hd), dtype=np.float32)
    s0 = first
    while s0 <= last:
        m = min(4, last + 1 - s0)
        keys = kv_rows(kc, s0, m, scratch)
        if keys.strides[1] != 4:  # a float32 cache whose rows are not contiguous
            for r in range(m):
                for d in range(hd):
                    scratch[r, d] = keys[r, d]
            keys = scratch[:m]
        for r in range(m):  # the group's heads 4, 2 and 1 at a time, each score the bits of its own lane dot * sc
            ka = keys.ctypes.data + r * keys.strides[0]
            at = sa + (s0 + r) * 4
            g = 0
            while g + 4 <= count:
                lanes.scores4(qa + g * hd * 4, ka, hd, at + g * span, last + 1, sc)
                g += 4
            if g + 2 <= count:
                lanes.scores2(qa + g * hd * 4, ka, hd, at + g * span, last + 1, sc)
                g += 2
            if g < count:
                lanes.scores1(qa + g * hd * 4, ka, hd, at + g * span, last + 1, sc)
        s0 += m
    inv = np.empty(count, dtype=np.float32)
    for g in range(count):
        row = scores[g]
        if cap > 0.0:
            softcap(row[first:], cap)
        top = np.float32(-np.inf)
        for s in range(first, last + 1):
            if row[s] > top:
                top = row[s]
        for s in range(first, last + 1):  # (vectorizes)
            row[s] = exp32(row[s] - top)
        total = np.float32(0.0)
        for s in range(first, last + 1):  # one chain, in order
            total += row[s]
        inv[g] = np.float32(1.0) / total
    o = np.zeros((count, hd), dtype=np.float32)
    s0 = first
    while s0 + 4 <= last + 1:  # o[d] += p_s v_s[d] for four s in order: one load and store of o
        values = kv_rows(vc, s0, 4, scratch)
        for g in range(count):
            p0, p1 = scores[g, s0] * inv[g], scores[g, s0 + 1] * inv[g]
            p2, p3 = scores[g, s0 + 2] * inv[g], scores[g, s0 + 3] * inv[g]
            og = o[g]
            for d in range(hd):
                x = og[d]
                x += p0 * values[0, d]
                x += p1 * values[1, d]
                x += p2 * values[2, d]
                x += p3 * values[3, d]
                og[d] = x
        s0 += 4
    for s in range(s0, last + 1):
        values = kv_rows(vc, s, 1, scratch)
        for g in range(count):
            p = scores[g, s] * inv[g]
            og = o[g]
            for d in range(hd):
                og[d] += p * values[0, d]
    for g in range(count):
        for d in range(hd):
            out[t, (h0 + g) * hd + d] = o[g, d]


@njit(**_JIT)
def softcap(x, cap):  # pragma: no cover - compiled
    # x (m,) f32 <- cap * tanh(x / cap) in place, in f32 steps as ggml's scale, tanh, scale
    inv = np.float32(1.0 / cap)
    c = np.float32(cap)
    for i in range(x.shape[0]):
        x[i] = np.float32(math.tanh(np.float32(x[i] * inv))) * c


@njit(parallel=True, **_JIT)
def gelu_mul(gate, up):  # pragma: no cover - compiled
    # gate, up: (n, f); gate <- gelu(gate) * up, GELU's tanh form (GeGLU, gemma)
    for i in prange(gate.shape[0]):
        gelu_mul_row(gate, up, i)


@njit(**_JIT)
def gelu_mul_row(gate, up, i):  # pragma: no cover - compiled
    gelu_mul_vec(gate[i], up[i])


@njit(error_model="numpy", **_JIT)  # as silu_mul_vec: IEEE division, so it vectorizes
def gelu_mul_vec(gate, up):  # pragma: no cover - compiled
    # GELU's tanh form, 0.5 g (1 + tanh(u)), written as g / (1 + e**(-2u)) (the same function:
    # 1 + tanh(u) = 2 / (1 + e**(-2u))), with exp32 rather than libm's tanhf, one call per value
    for j in range(gate.shape[0]):
        g = gate[j]
        u = np.float32(0.7978845608028654) * (g + np.float32(0.044715) * g * g * g)
        gate[j] = g / (np.float32(1.0) + exp32(np.float32(-2.0) * u)) * up[j]


@njit(parallel=True, **_JIT)
def silu_mul(gate, up):  # pragma: no cover - compiled
    # gate, up: (n, f); gate <- silu(gate) * up; one token runs on the calling thread
    n = gate.shape[0]
    if n == 1:
        silu_mul_row(gate, up, 0)
    else:
        for i in prange(n):
            silu_mul_row(gate, up, i)


@njit(**_JIT)
def silu_mul_row(gate, up, i):  # pragma: no cover - compiled
    silu_mul_vec(gate[i], up[i])


# IEEE division (the divisor is >= 1): no zero check, so it vectorizes (3x). Only on rows numba
# knows are contiguous: on a strided view (a column range of a wider buffer) it ran 5x slower.
@njit(error_model="numpy", **_JIT)
def silu_mul_vec(gate, up):  # pragma: no cover - compiled
    for j in range(gate.shape[0]):
        g = gate[j]
        gate[j] = g / (np.float32(1.0) + exp32(-g)) * up[j]


QBLOCK = 64  # query rows per attention block: a block reads keys only up to its own last row


def attention_batch(q, k_cache, v_cache, pos0, group, out, scale=0.0, window=0, cap=0.0):
    """Causal attention for a batch of n > 1 tokens through BLAS, in blocks of one KV head
    and QBLOCK query rows.

    Same contract as `attention` (the caches as numpy holds them here, scale, window and cap
    too); the scalar kernel is right for one token, but a
    prefill batch is two matrix products per KV head. Row blocks skip the keys
    after their last row: for 256 new tokens, 3/8 of the work. The scale goes on
    q, the causal softmax is one vectorized pass (`_softmax_causal`), and the
    normalisation goes on the (rows, hd) result rather than the (rows, keys)
    scores. Every block's shapes depend on n and pos0 only, not on which node
    holds the head, so a cluster stays bit-identical to a single node.
    """
    n = q.shape[0]
    n_kv = k_cache.shape[0]
    hd = q.shape[1] // (n_kv * group)
    qh = q.reshape(n, n_kv, group, hd)
    oh = out.reshape(n, n_kv, group, hd)
    scale = np.float32(1.0 / math.sqrt(hd) if scale == 0.0 else scale)
    for kv, a in ((kv, a) for kv in range(n_kv) for a in range(0, n, QBLOCK)):
        b = min(n, a + QBLOCK)
        m, last = b - a, pos0 + b  # rows a..b-1 attend to keys 0..last-1 at most
        qs = qh[a:b, kv].transpose(1, 0, 2).reshape(group * m, hd) * scale    # rows: head-major
        keys, values = kv_values(k_cache[kv, :last]), kv_values(v_cache[kv, :last])  # f32 for BLAS
        scores = qs @ keys.T                                                   # (group * m, last)
        if cap > 0.0:
            scores = np.tanh(scores * np.float32(1.0 / cap)) * np.float32(cap)
        total = np.empty((group * m, 1), np.float32)
        _softmax_causal(scores, m, last - m, total, window)
        att = (scores @ values) / total                                        # normalised after PV
        oh[a:b, kv] = att.reshape(group, m, hd).transpose(1, 0, 2)


@njit(cache=True, nogil=True, fastmath={"reassoc", "nsz"})
def _softmax_causal(scores, m, base, total, window):  # pragma: no cover - compiled
    # scores: (rows, keys), row r is query r % m of a block whose first query sees keys
    # 0..base; in place: exp(s - max) over the keys it sees, 0 elsewhere; total: the sums.
    # window > 0: a row sees only its last `window` keys (itself included).
    # One thread: a block is ~0.1 ms, about what waking numba's workers costs.
    # (Keys before the window are set to -inf, which exp32 takes to exactly 0: the loops stay
    # those of plain causal attention, whose fastmath vector code, and so bits, they keep.)
    rows, keys = scores.shape
    for r in range(rows):
        seen = base + r % m + 1
        if window > 0:
            for j in range(seen - window):
                scores[r, j] = -np.inf
        top = scores[r, 0]
        for j in range(1, seen):
            top = max(top, scores[r, j])
        acc = np.float32(0.0)
        for j in range(seen):
            e = exp32(scores[r, j] - top)
            scores[r, j] = e
            acc += e
        for j in range(seen, keys):
            scores[r, j] = 0.0
        total[r, 0] = acc
