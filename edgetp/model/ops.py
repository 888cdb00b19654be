"""The element-wise and attention kernels of the forward pass.

Every kernel writes into an `out` (or in-place) buffer; none allocates in
its hot loop beyond a per-thread scratch row. Shapes are in the comments;
`n` is the number of tokens in the batch (1 when decoding).
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from edgetp.model import isa

_JIT = dict(cache=True, nogil=True, fastmath=False)


@intrinsic
def _f32_bits(typingctx, i):
    """The float32 whose bits are the int32 i."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


# ---------------------------------------------------------------- KV cache types
# A KV cache is float32, or f16 (KV_TYPES): numpy holds an f16 cache as float16, the compiled
# kernels as its uint16 view (numba has no float16) and convert each value with the CPU's
# own instruction (LLVM fpext/fptrunc of half: vcvtph2ps/vcvtps2ph with F16C, fcvt on
# aarch64, compiler-rt's routines on a baseline x86-64). fptrunc rounds to nearest even, as
# numpy's float16 assignment does, so a value written by a kernel or by numpy is the same bits.
# On the generic ISA (a baseline x86-64 without F16C) LLVM lowers those to compiler-rt calls
# numba cannot link (__truncsfhf2), so there the same conversions are integer code.

KV_TYPES = {"f16": np.float16, "f32": np.float32}  # setting -> numpy dtype of the cache


def kv_dtype(kv_type: str) -> type:
    """The numpy dtype of a KV cache of type kv_type; ValueError (one line) for others."""
    if kv_type not in KV_TYPES:
        raise ValueError(f"KV cache type {kv_type!r} is not one of {', '.join(KV_TYPES)}")
    return KV_TYPES[kv_type]


def kernel_view(cache: np.ndarray) -> np.ndarray:
    """What the compiled kernels read and write of a KV cache: an f16 cache's uint16 view."""
    return cache.view(np.uint16) if cache.dtype == np.float16 else cache


@intrinsic
def _i32_bits(typingctx, f):
    """The int32 whose bits are the float32 f."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.int32(types.float32), codegen


@njit(inline="always", **_JIT)
def h2f_soft(h):  # pragma: no cover - compiled
    """_h2f in integer code: a finite f16's bits moved into a float32 (as a subnormal when
    the exponent field is 0) scaled by 2**112 (exact), inf and nan rebuilt."""
    h = np.int32(h)
    mag = (h & np.int32(0x7FFF)) << np.int32(13)
    if mag >= np.int32(0x7C00 << 13):
        mag = mag | np.int32(0x7F800000)  # inf, nan (payload kept)
        v = _f32_bits(mag)
    else:
        v = _f32_bits(mag) * np.float32(2.0**112)
    return -v if h & np.int32(0x8000) else v


@njit(inline="always", **_JIT)
def f2h_soft(f):  # pragma: no cover - compiled
    """_f2h in integer code: float32 f to the bits of the nearest f16, ties to even."""
    x = _i32_bits(np.float32(f))
    sign = (x >> np.int32(16)) & np.int32(0x8000)
    x = x & np.int32(0x7FFFFFFF)
    if x > np.int32(0x7F800000):  # nan: quiet, the payload's top bits kept
        h = np.int32(0x7E00) | ((x >> np.int32(13)) & np.int32(0x3FF))
    elif x >= np.int32(0x477FF000):  # 65520 and up (inf too) round to inf
        h = np.int32(0x7C00)
    elif x >= np.int32(0x38800000):  # an f16 normal: rebias the exponent, round 13 bits off
        h = (x - np.int32(0x38000000)) >> np.int32(13)
        rest = x & np.int32(0x1FFF)
        if rest > np.int32(0x1000) or (rest == np.int32(0x1000) and h & np.int32(1)):
            h += np.int32(1)
    elif x > np.int32(0x33000000):  # an f16 subnormal (or the smallest normal after rounding)
        shift = np.int32(126) - (x >> np.int32(23))  # 14 .. 24
        m = (x & np.int32(0x7FFFFF)) | np.int32(0x800000)
        h = m >> shift
        rest = m & ((np.int32(1) << shift) - np.int32(1))
        half = np.int32(1) << (shift - np.int32(1))
        if rest > half or (rest == half and h & np.int32(1)):
            h += np.int32(1)
    else:  # 2**-25 and below round to zero
        h = np.int32(0)
    return np.uint16(sign | h)


def _soft_half() -> bool:
    """Whether compiled code converts f16 in integer code: on the generic ISA (or if the ISA is in error)."""
    try:
        return isa.current() == "generic"
    except isa.IsaError:
        return True


@intrinsic
def _h2f(typingctx, h):
    """The float32 value of the f16 whose bits are the uint16 h (exact)."""

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def _f2h(typingctx, f):
    """The bits of the float32 f rounded to f16, nearest even (overflow to inf)."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


def kv_load(x):  # pragma: no cover - compiled through the overload
    """A KV cache element as float32 (compiled code only)."""
    raise NotImplementedError


def kv_store(v, cache):  # pragma: no cover - compiled through the overload
    """float32 v as an element of `cache` (compiled code only)."""
    raise NotImplementedError


@overload(kv_load, inline="always")
def _kv_load(x):
    if x == types.uint16:
        if _soft_half():
            return lambda x: h2f_soft(x)
        return lambda x: _h2f(x)
    return lambda x: x


@overload(kv_store, inline="always")
def _kv_store(v, cache):
    if cache.dtype == types.uint16:
        if _soft_half():
            return lambda v, cache: f2h_soft(v)
        return lambda v, cache: _f2h(np.float32(v))
    return lambda v, cache: v


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
               scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin of every position and frequency: (n_pos, rope_dims // 2) each, f32; scale: linear
    rope scaling, every angle times it (llama.cpp's freq_scale)."""
    inv = theta ** (-np.arange(0, rope_dims, 2, dtype=np.float64) / rope_dims)
    if freq_factors is not None:
        inv = inv / freq_factors[: rope_dims // 2].astype(np.float64)
    ang = (np.arange(n_pos, dtype=np.float64) * scale)[:, None] * inv[None, :]
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
def attention(q, k_cache, v_cache, pos0, group, out, serial, scale=0.0, window=0, cap=0.0):  # pragma: no cover
    # q: (n, n_heads * hd) roped queries for positions pos0 .. pos0+n-1
    # k_cache, v_cache: (n_kv, ctx, hd) float32, or uint16 bits of f16; rows up to pos0+n-1 are filled
    # out: (n, n_heads * hd); query head h reads KV head h // group (causal)
    # serial: one thread, without the parallel launch (each head's arithmetic is the same)
    # scale: of q.k (0: 1/sqrt(hd)); window > 0: only keys p with pos - p < window (a sliding
    # window); cap > 0: scores soft-capped to cap * tanh(score / cap) (gemma2)
    jobs = q.shape[0] * k_cache.shape[0] * group
    if serial:
        for job in range(jobs):
            attend_head(q, k_cache, v_cache, pos0, group, out, job, scale, window, cap)
    else:
        for job in prange(jobs):
            attend_head(q, k_cache, v_cache, pos0, group, out, job, scale, window, cap)


@njit(**_JIT)
def attend_head(q, k_cache, v_cache, pos0, group, out, job, scale=0.0, window=0, cap=0.0):  # pragma: no cover
    # one (token, query head) of `attention`. Each score is one chain over d in order, each
    # output value one chain over s in order; four scores run side by side (independent
    # chains, the same bits) rather than one long dependency at a time.
    n_kv, ctx, hd = k_cache.shape
    n_heads = n_kv * group
    sc = np.float32(1.0 / math.sqrt(hd)) if scale == 0.0 else np.float32(scale)
    t = job // n_heads
    h = job % n_heads
    kv = h // group
    last = pos0 + t  # attends to first .. last
    first = max(0, last - window + 1) if window > 0 else 0
    scores = np.empty(last + 1, dtype=np.float32)
    qh = q[t, h * hd : h * hd + hd]
    kc = k_cache[kv]
    s0 = first
    while s0 + 4 <= last + 1:  # four scores at a time: four independent chains
        a0 = a1 = a2 = a3 = np.float32(0.0)
        for d in range(hd):
            qd = qh[d]
            a0 += qd * kv_load(kc[s0, d])
            a1 += qd * kv_load(kc[s0 + 1, d])
            a2 += qd * kv_load(kc[s0 + 2, d])
            a3 += qd * kv_load(kc[s0 + 3, d])
        scores[s0] = a0 * sc
        scores[s0 + 1] = a1 * sc
        scores[s0 + 2] = a2 * sc
        scores[s0 + 3] = a3 * sc
        s0 += 4
    for s in range(s0, last + 1):
        acc = np.float32(0.0)
        for d in range(hd):
            acc += qh[d] * kv_load(kc[s, d])
        scores[s] = acc * sc
    if cap > 0.0:
        softcap(scores[first:], cap)
    top = np.float32(-np.inf)
    for s in range(first, last + 1):
        if scores[s] > top:
            top = scores[s]
    total = np.float32(0.0)
    for s in range(first, last + 1):
        e = np.float32(math.exp(scores[s] - top))
        scores[s] = e
        total += e
    inv = np.float32(1.0) / total
    o = np.zeros(hd, dtype=np.float32)
    for s in range(first, last + 1):
        p = scores[s] * inv
        for d in range(hd):
            o[d] += p * kv_load(v_cache[kv, s, d])
    for d in range(hd):
        out[t, h * hd + d] = o[d]


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
    for j in range(gate.shape[1]):
        g = gate[i, j]
        inner = np.float32(0.7978845608028654) * (g + np.float32(0.044715) * g * g * g)
        gate[i, j] = np.float32(0.5) * g * (np.float32(1.0) + np.float32(math.tanh(inner))) * up[i, j]


@njit(parallel=True, **_JIT)
def silu_mul(gate, up):  # pragma: no cover - compiled
    # gate, up: (n, f); gate <- silu(gate) * up; one token runs on the calling thread
    n = gate.shape[0]
    if n == 1:
        silu_mul_row(gate, up, 0)
    else:
        for i in prange(n):
            silu_mul_row(gate, up, i)


@njit(error_model="numpy", **_JIT)  # IEEE division (the divisor is >= 1): no zero check, so it vectorizes (3x)
def silu_mul_row(gate, up, i):  # pragma: no cover - compiled
    for j in range(gate.shape[1]):
        g = gate[i, j]
        gate[i, j] = g / (np.float32(1.0) + exp32(-g)) * up[i, j]


QBLOCK = 64  # query rows per attention block: a block reads keys only up to its own last row


def attention_batch(q, k_cache, v_cache, pos0, group, out, scale=0.0, window=0, cap=0.0):
    """Causal attention for a batch of n > 1 tokens through BLAS, in blocks of one KV head
    and QBLOCK query rows.

    Same contract as `attention` (an f16 cache as numpy float16 here, scale, window and cap
    too); the scalar kernel is right for one token, but a
    prefill batch is two matrix products per KV head. Row blocks skip the keys
    after their last row: for 256 new tokens, 3/8 of the work. The scale goes on
    q, the causal softmax is one vectorized pass (`_softmax_causal`), and the
    normalisation goes on the (rows, hd) result rather than the (rows, keys)
    scores. Every block's shapes depend on n and pos0 only, not on which node
    holds the head, so a cluster stays bit-identical to a single node.
    """
    n = q.shape[0]
    n_kv, _, hd = k_cache.shape
    wide = k_cache.dtype != np.float32  # f16 rows are widened to f32 (exact) for BLAS
    qh = q.reshape(n, n_kv, group, hd)
    oh = out.reshape(n, n_kv, group, hd)
    scale = np.float32(1.0 / math.sqrt(hd) if scale == 0.0 else scale)
    for kv, a in ((kv, a) for kv in range(n_kv) for a in range(0, n, QBLOCK)):
        b = min(n, a + QBLOCK)
        m, last = b - a, pos0 + b  # rows a..b-1 attend to keys 0..last-1 at most
        qs = qh[a:b, kv].transpose(1, 0, 2).reshape(group * m, hd) * scale    # rows: head-major
        keys, values = k_cache[kv, :last], v_cache[kv, :last]
        if wide:
            keys, values = keys.astype(np.float32), values.astype(np.float32)
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
