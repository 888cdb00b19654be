"""What a KV cache holds and how the compiled kernels read and write it.

A cache holds one row of head_dim values per (slot, KV head, position), as float32, f16 or
q8_0 (KV_TYPES); numpy holds it in a dtype of its own (kv_cache), the kernels see its
kernel_view and go through kv_rows (read rows as float32) and kv_write (store one row), so
one attention kernel serves every type.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

from edgetp.model import isa

_JIT = dict(cache=True, nogil=True, fastmath=False)


@intrinsic
def _f32_bits(typingctx, i):
    """The float32 whose bits are the int32 i."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


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
# (llama.cpp's own AVX2 writer scales by 127 / amax and rounds ties to even: in rare last-bit
# cases its bytes differ from the reference's, which gguf-py and this module follow.)

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
