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
# A KV cache is float32, f16 or q8_0 (KV_TYPES), one row of head_dim values per (slot, KV head,
# position). numpy holds an f16 cache as float16, the compiled kernels as its uint16 view (numba
# has no float16) and convert each value with the CPU's own instruction (LLVM fpext/fptrunc of
# half: vcvtph2ps/vcvtps2ph with F16C, fcvt on aarch64, compiler-rt's routines on a baseline
# x86-64). fptrunc rounds to nearest even, as numpy's float16 assignment does, so a value written
# by a kernel or by numpy is the same bits. On the generic ISA (a baseline x86-64 without F16C)
# LLVM lowers those to compiler-rt calls numba cannot link (__truncsfhf2), so there the same
# conversions are integer code.
#
# q8_0 is llama.cpp's block_q8_0 along head_dim: per 32 values an f16 scale d = amax / 127 and 32
# int8 q = roundf(x / d) (ggml's quantize_row_q8_0_ref: the scale in f32, rounding half away from
# zero), a value read back as d * q in f32. 34 bytes per 32 values; numpy holds it as Q8_0 records
# (d, qs), the kernels as their bytes (uint8, hd / 32 * 34 per row), which are ggml's bytes. As in
# llama.cpp, a head_dim that is not a multiple of 32 cannot hold q8_0 (kv_cache refuses it).

QK8_0 = 32  # values per q8_0 block
Q8_0 = np.dtype([("d", "<f2"), ("qs", "i1", (QK8_0,))])  # one block, 34 bytes (ggml's block_q8_0)
KV_TYPES = {"f16": np.float16, "f32": np.float32, "q8_0": Q8_0}  # setting -> numpy dtype of the cache


class KVTypeError(ValueError):
    """A KV cache type that does not exist, or that the model's head size cannot hold (one line)."""


def kv_dtype(kv_type: str) -> np.dtype:
    """The numpy dtype of a KV cache of type kv_type; KVTypeError (one line) for others."""
    if kv_type not in KV_TYPES:
        raise KVTypeError(f"KV cache type {kv_type!r} is not one of {', '.join(KV_TYPES)}")
    return np.dtype(KV_TYPES[kv_type])


def kv_row_bytes(kv_type: str, head_dim: int) -> int:
    """Bytes of one cached row of head_dim values; KVTypeError (one line) for a type that cannot hold it."""
    dtype = kv_dtype(kv_type)
    if dtype != Q8_0:
        return head_dim * dtype.itemsize
    if head_dim % QK8_0:
        raise KVTypeError(f"KV cache type 'q8_0' needs a head size that is a multiple of {QK8_0}, "
                         f"this model's is {head_dim} (use f16 or f32)")
    return head_dim // QK8_0 * Q8_0.itemsize


def kv_cache(kv_type: str, shape: tuple[int, ...]) -> np.ndarray:
    """A zeroed KV cache of kv_type holding rows of shape[-1] values: shape, or for q8_0 shape[:-1] + (blocks,)."""
    kv_row_bytes(kv_type, shape[-1])
    if kv_type == "q8_0":
        shape = shape[:-1] + (shape[-1] // QK8_0,)
    return np.zeros(shape, kv_dtype(kv_type))


def kernel_view(cache: np.ndarray) -> np.ndarray:
    """What the compiled kernels read and write of a KV cache: an f16 cache's uint16 view, a q8_0 cache's bytes."""
    if cache.dtype == Q8_0:
        return cache.view(np.uint8)
    return cache.view(np.uint16) if cache.dtype == np.float16 else cache


def kv_values(cache: np.ndarray) -> np.ndarray:
    """The float32 values a KV cache (or a slice of its rows) holds, rows of head_dim."""
    if cache.dtype == Q8_0:  # ggml's dequantize_row_q8_0: d * q in f32
        values = cache["qs"].astype(np.float32) * cache["d"].astype(np.float32)[..., None]
        return values.reshape(cache.shape[:-1] + (-1,))
    return cache.astype(np.float32, copy=False)


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


def half_to_f32(h):  # pragma: no cover - compiled through the overload
    """The float32 value of the f16 whose bits are the uint16 h (compiled code only)."""
    raise NotImplementedError


def f32_to_half(v):  # pragma: no cover - compiled through the overload
    """The bits of float32 v rounded to f16, nearest even (compiled code only)."""
    raise NotImplementedError


@overload(half_to_f32, inline="always")
def _half_to_f32(h):
    if _soft_half():
        return lambda h: h2f_soft(h)
    return lambda h: _h2f(np.uint16(h))


@overload(f32_to_half, inline="always")
def _f32_to_half(v):
    if _soft_half():
        return lambda v: f2h_soft(v)
    return lambda v: _f2h(np.float32(v))


def kv_rows(cache, s0, count, scratch):  # pragma: no cover - compiled through the overload
    """Rows s0 .. s0+count-1 of a KV cache's kernel view (ctx, row) as float32 (count, hd): a
    float32 cache's own rows, else decoded into scratch (>= count rows of hd). Compiled code only."""
    raise NotImplementedError


def kv_write(row, values):  # pragma: no cover - compiled through the overload
    """Store the float32 values (hd,) in one row of a KV cache's kernel view. Compiled code only."""
    raise NotImplementedError


@overload(kv_rows, inline="always")
def _kv_rows(cache, s0, count, scratch):
    if cache.dtype == types.float32:
        return lambda cache, s0, count, scratch: cache[s0 : s0 + count]
    if cache.dtype == types.uint16:
        def f16_rows(cache, s0, count, scratch):
            for r in range(count):
                for d in range(scratch.shape[1]):
                    scratch[r, d] = half_to_f32(cache[s0 + r, d])
            return scratch[:count]
        return f16_rows

    def q8_0_rows(cache, s0, count, scratch):  # uint8: block_q8_0 after block_q8_0
        for r in range(count):
            row = cache[s0 + r]
            for blk in range(scratch.shape[1] // 32):
                at = blk * 34
                d = half_to_f32(np.uint16(np.int32(row[at]) | (np.int32(row[at + 1]) << np.int32(8))))
                for j in range(32):
                    scratch[r, blk * 32 + j] = d * np.float32(np.int8(row[at + 2 + j]))
        return scratch[:count]
    return q8_0_rows


@overload(kv_write, inline="always")
def _kv_write(row, values):
    if row.dtype == types.float32:
        def f32_write(row, values):
            for d in range(values.shape[0]):
                row[d] = values[d]
        return f32_write
    if row.dtype == types.uint16:
        def f16_write(row, values):
            for d in range(values.shape[0]):
                row[d] = f32_to_half(values[d])
        return f16_write

    return lambda row, values: q8_0_write(row, values)


@njit(**_JIT)
def q8_0_write(row, values):  # pragma: no cover - compiled
    # values (hd,) f32 as block_q8_0s into the bytes row: ggml's quantize_row_q8_0_ref, bit for bit
    for blk in range(values.shape[0] // 32):
        x = values[blk * 32 : blk * 32 + 32]
        amax = np.float32(0.0)
        for j in range(32):
            amax = max(amax, abs(x[j]))
        d = amax / np.float32(127.0)
        inv = np.float32(0.0)
        if d != np.float32(0.0):
            inv = np.float32(1.0) / d
        h = f32_to_half(d)
        at = blk * 34
        row[at] = np.uint8(h & np.uint16(0xFF))
        row[at + 1] = np.uint8(h >> np.uint16(8))
        for j in range(32):
            v = x[j] * inv
            a = abs(v)
            fl = np.floor(a)
            q = np.int32(fl + np.floor(np.float32(2.0) * (a - fl)))  # roundf: half away from zero
            if v < np.float32(0.0):
                q = -q
            row[at + 2 + j] = np.uint8(q & np.int32(0xFF))


@njit(**_JIT)
def kv_write_rows(cache, pos, values):  # pragma: no cover - compiled
    # cache: one slot's kernel view (n_kv, ctx, row); values (n, n_kv, hd) float32 of positions pos .. pos+n-1
    for t in range(values.shape[0]):
        for g in range(values.shape[1]):
            kv_write(cache[g, pos + t], values[t, g])


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
def attention(q, k_cache, v_cache, pos0, group, out, serial):  # pragma: no cover - compiled
    # q: (n, n_heads * hd) roped queries for positions pos0 .. pos0+n-1
    # k_cache, v_cache: (n_kv, ctx, row) kernel views (kernel_view); rows up to pos0+n-1 are filled
    # out: (n, n_heads * hd); query head h reads KV head h // group (causal)
    # serial: one thread, without the parallel launch (each head's arithmetic is the same)
    jobs = q.shape[0] * k_cache.shape[0] * group
    if serial:
        for job in range(jobs):
            attend_head(q, k_cache, v_cache, pos0, group, out, job)
    else:
        for job in prange(jobs):
            attend_head(q, k_cache, v_cache, pos0, group, out, job)


@njit(**_JIT)
def attend_head(q, k_cache, v_cache, pos0, group, out, job):  # pragma: no cover - compiled
    # one (token, query head) of `attention`. Each score is one chain over d in order, each
    # output value one chain over s in order; four scores run side by side (independent
    # chains, the same bits) rather than one long dependency at a time. A cache that is not
    # float32 is decoded (kv_rows) a few rows at a time into f32 first: the same values, any type.
    n_kv = k_cache.shape[0]
    n_heads = n_kv * group
    hd = q.shape[1] // n_heads
    scale = np.float32(1.0 / math.sqrt(hd))
    t = job // n_heads
    h = job % n_heads
    kv = h // group
    last = pos0 + t  # attends to 0 .. last
    scores = np.empty(last + 1, dtype=np.float32)
    qh = q[t, h * hd : h * hd + hd]
    kc, vc = k_cache[kv], v_cache[kv]
    scratch = np.empty((4, hd), dtype=np.float32)
    s0 = 0
    while s0 + 4 <= last + 1:  # four scores at a time: four independent chains
        keys = kv_rows(kc, s0, 4, scratch)
        a0 = a1 = a2 = a3 = np.float32(0.0)
        for d in range(hd):
            qd = qh[d]
            a0 += qd * keys[0, d]
            a1 += qd * keys[1, d]
            a2 += qd * keys[2, d]
            a3 += qd * keys[3, d]
        scores[s0] = a0 * scale
        scores[s0 + 1] = a1 * scale
        scores[s0 + 2] = a2 * scale
        scores[s0 + 3] = a3 * scale
        s0 += 4
    for s in range(s0, last + 1):
        keys = kv_rows(kc, s, 1, scratch)
        acc = np.float32(0.0)
        for d in range(hd):
            acc += qh[d] * keys[0, d]
        scores[s] = acc * scale
    top = np.float32(-np.inf)
    for s in range(last + 1):
        if scores[s] > top:
            top = scores[s]
    total = np.float32(0.0)
    for s in range(last + 1):
        e = np.float32(math.exp(scores[s] - top))
        scores[s] = e
        total += e
    inv = np.float32(1.0) / total
    o = np.zeros(hd, dtype=np.float32)
    for s in range(last + 1):
        p = scores[s] * inv
        values = kv_rows(vc, s, 1, scratch)
        for d in range(hd):
            o[d] += p * values[0, d]
    for d in range(hd):
        out[t, h * hd + d] = o[d]


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


def attention_batch(q, k_cache, v_cache, pos0, group, out):
    """Causal attention for a batch of n > 1 tokens through BLAS, in blocks of one KV head
    and QBLOCK query rows.

    Same contract as `attention` (the caches as numpy holds them here); the scalar kernel is right for one token, but a
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
    scale = np.float32(1.0 / math.sqrt(hd))
    for kv, a in ((kv, a) for kv in range(n_kv) for a in range(0, n, QBLOCK)):
        b = min(n, a + QBLOCK)
        m, last = b - a, pos0 + b  # rows a..b-1 attend to keys 0..last-1 at most
        qs = qh[a:b, kv].transpose(1, 0, 2).reshape(group * m, hd) * scale    # rows: head-major
        keys, values = kv_values(k_cache[kv, :last]), kv_values(v_cache[kv, :last])  # f32 for BLAS
        scores = qs @ keys.T                                                   # (group * m, last)
        total = np.empty((group * m, 1), np.float32)
        _softmax_causal(scores, m, last - m, total)
        att = (scores @ values) / total                                        # normalised after PV
        oh[a:b, kv] = att.reshape(group, m, hd).transpose(1, 0, 2)


@njit(cache=True, nogil=True, fastmath={"reassoc", "nsz"})
def _softmax_causal(scores, m, base, total):  # pragma: no cover - compiled
    # scores: (rows, keys), row r is query r % m of a block whose first query sees keys
    # 0..base; in place: exp(s - max) over the keys it sees, 0 after them; total: the sums.
    # One thread: a block is ~0.1 ms, about what waking numba's workers costs.
    rows, keys = scores.shape
    for r in range(rows):
        seen = base + r % m + 1
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
