"""Dequantize rows of GGUF blocks to f32.

Same float operations, in the same order, as gguf-py's numpy dequantizers
(`gguf.quants.dequantize`), and no FMA contraction (no fastmath here), so the
results are bit-identical to that reference. F16 scales go through the exact
65536-entry table `tab16` (see kernels.f16_table).

Prefill (quant.matmul) decodes tiles of rows with `dequant_rows_serial` and
multiplies them by sgemm; quant.matvec does the same for types without a
dedicated decode kernel. Every njit function these call lives in this module:
numba's on-disk cache only notices edits to the file a function is defined in.

Block layouts, per 32 or 256 values (byte offsets; `nib` = 16 bytes of
nibbles, value j<16 the low nibble of byte j, j>=16 the high nibble of byte j-16):
  Q4_0   18 B: d@0, nib@2                               (q-8)*d
  Q4_1   20 B: d@0, m@2, nib@4                          d*q + m
  Q5_0   22 B: d@0, qh u32@2 (bit j = 5th bit of j), nib@6    d*(q-16)
  Q5_1   24 B: d@0, m@2, qh u32@4, nib@8                d*q + m
  Q8_0   34 B: d@0, int8 q@2                            q*d
  IQ4_NL 18 B: d@0, nib@2                               d*KVALUES[q]
  Q2_K   84 B: scales[16]@0 (lo 4 bits scale, hi 4 min), qs[64]@16, d@80, dmin@82
  Q3_K  110 B: hmask[32]@0, qs[64]@32, 12 B packed 6-bit scales@96, d@108
  Q4_K  144 B: d@0, dmin@2, 12 B packed 6-bit scales/mins@4, qs[128]@16
  Q5_K  176 B: d@0, dmin@2, 12 B scales/mins@4, qh[32]@16, qs[128]@48
  Q6_K  210 B: ql[128]@0, qh[64]@128, int8 scales[16]@192, d@208
  IQ4_XS 136 B: d@0, scales_h u16@2, scales_l[4]@4, qs[128]@8
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
from numba import errors, literally, njit, prange, types
from numba.extending import overload

_OPTS = dict(cache=True, nogil=True)

# IQ4_NL / IQ4_XS non-linear 4-bit code book (ggml's kvalues_iq4nl)
KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)


@njit(inline="always", **_OPTS)
def _h(ru, off, tab):
    """f16 at byte offset `off` of a uint8 row, as f32."""
    return tab[np.int64(ru[off]) | (np.int64(ru[off + 1]) << 8)]


@njit(inline="always", **_OPTS)
def _nib(ru, q, j):
    # value j (0..31) of the 16 nibble bytes at ru[q:q+16]
    return np.int32(ru[q + j] & 15) if j < 16 else np.int32(ru[q + j - 16] >> 4)


@njit(inline="always", **_OPTS)
def _u32(ru, off):
    return (np.uint32(ru[off]) | (np.uint32(ru[off + 1]) << 8)
            | (np.uint32(ru[off + 2]) << 16) | (np.uint32(ru[off + 3]) << 24))  # fmt: skip


@njit(inline="always", **_OPTS)
def scale_min_k4(ru, p, j):
    # 6-bit scale and min of sub-block j (0..7) of Q4_K/Q5_K, packed in the 12 bytes at ru[p:p+12]
    if j < 4:
        sc = ru[p + j] & 63
        mn = ru[p + 4 + j] & 63
    else:
        sc = (ru[p + 4 + j] & 15) | ((ru[p + j - 4] >> 6) << 4)
        mn = (ru[p + 4 + j] >> 4) | ((ru[p + j] >> 6) << 4)
    return np.float32(sc), np.float32(mn)


# ---------------------------------------------------------------- 32-value blocks


@njit(**_OPTS)
def _q4(ru, tab16, dst, with_min):
    # Q4_0 (with_min False) / Q4_1 (True)
    bs = 20 if with_min else 18
    for b in range(dst.shape[0] // 32):
        o = b * bs
        d = _h(ru, o, tab16)
        if with_min:
            m = _h(ru, o + 2, tab16)
            for j in range(32):
                dst[b * 32 + j] = d * np.float32(_nib(ru, o + 4, j)) + m
        else:
            for j in range(32):
                dst[b * 32 + j] = d * np.float32(_nib(ru, o + 2, j) - 8)


@njit(**_OPTS)
def _q5(ru, tab16, dst, with_min):
    # Q5_0 (with_min False): d*(q-16); Q5_1 (True): d*q + m. q = nibble | (bit j of qh) << 4
    bs = 24 if with_min else 22
    hq = 4 if with_min else 2  # offset of qh; nibbles follow it
    for b in range(dst.shape[0] // 32):
        o = b * bs
        d = _h(ru, o, tab16)
        qh = _u32(ru, o + hq)
        m = _h(ru, o + 2, tab16) if with_min else np.float32(0.0)
        for j in range(32):
            q = _nib(ru, o + hq + 4, j) | np.int32(((qh >> np.uint32(j)) & np.uint32(1)) << np.uint32(4))
            if with_min:
                dst[b * 32 + j] = d * np.float32(q) + m
            else:
                dst[b * 32 + j] = d * np.float32(q - 16)


@njit(**_OPTS)
def _iq4_nl(ru, tab16, dst):
    for b in range(dst.shape[0] // 32):
        o = b * 18
        d = _h(ru, o, tab16)
        for j in range(32):
            dst[b * 32 + j] = d * KVALUES[_nib(ru, o + 2, j)]


# ---------------------------------------------------------------- 256-value blocks
# In Q2_K and Q3_K, 2-bit value e of a block (0..255) sits in half h = e//128 at bit
# pair g = (e%128)//32 of byte qs[h*32 + e%32]; Q3_K's high bit is bit e//32 of
# hmask[e%32]. Sub-block scales cover 16 values (Q2_K, Q3_K, Q6_K) or 32 (the rest).


@njit(**_OPTS)
def _q2_k(ru, tab16, dst):
    for b in range(dst.shape[0] // 256):
        o = b * 84
        d = _h(ru, o + 80, tab16)
        dmin = _h(ru, o + 82, tab16)
        for s in range(16):
            dl = d * np.float32(ru[o + s] & 15)
            ml = dmin * np.float32(ru[o + s] >> 4)
            for i in range(16):
                e = s * 16 + i
                q = (ru[o + 16 + (e // 128) * 32 + e % 32] >> (2 * ((e % 128) // 32))) & 3
                dst[b * 256 + e] = dl * np.float32(q) - ml


@njit(**_OPTS)
def _q3_k(ru, tab16, dst):
    # 6-bit scale s (0..15): low 4 bits from byte s%8 (>>4 for s>=8), high 2 bits from
    # byte 8 + s%4 at bit 2*(s//4); value = d*(scale-32) * (q2 - 4*(1 - hbit))
    for b in range(dst.shape[0] // 256):
        o = b * 110
        d = _h(ru, o + 108, tab16)
        p = o + 96
        for s in range(16):
            lo = (ru[p + s % 8] >> (4 * (s // 8))) & 15
            hi = (ru[p + 8 + s % 4] >> (2 * (s // 4))) & 3
            dl = d * np.float32(np.int32(lo | (hi << 4)) - 32)
            for i in range(16):
                e = s * 16 + i
                q2 = np.int32((ru[o + 32 + (e // 128) * 32 + e % 32] >> (2 * ((e % 128) // 32))) & 3)
                hbit = np.int32((ru[o + e % 32] >> (e // 32)) & 1)
                dst[b * 256 + e] = dl * np.float32(q2 - ((hbit ^ 1) << 2))


@njit(**_OPTS)
def _q45_k(ru, tab16, dst, five):
    # Q4_K (five False) / Q5_K (True). Sub-block j (32 values): q = (qs[(j//2)*32 + l] >> 4*(j%2)) & 15,
    # plus (bit j of qh[l]) << 4 for Q5_K; value = (d*sc_j)*q - dmin*m_j
    bs = 176 if five else 144
    qo = 48 if five else 16
    for b in range(dst.shape[0] // 256):
        o = b * bs
        d = _h(ru, o, tab16)
        dmin = _h(ru, o + 2, tab16)
        for j in range(8):
            sc, mn = scale_min_k4(ru, o + 4, j)
            dj = d * sc
            mj = dmin * mn
            for l in range(32):
                q = (ru[o + qo + (j // 2) * 32 + l] >> (4 * (j % 2))) & 15
                if five:
                    q |= ((ru[o + 16 + l] >> j) & 1) << 4
                dst[b * 256 + j * 32 + l] = dj * np.float32(q) - mj


@njit(**_OPTS)
def _q6_k(ru, tab16, dst):
    # value e = h*128 + 32g + l: q = nibble (g//2) of ql[h*64 + (g%2)*32 + l] | bits 2g of qh[h*32 + l] << 4
    for b in range(dst.shape[0] // 256):
        o = b * 210
        d = _h(ru, o + 208, tab16)
        for h in range(2):
            for g in range(4):
                for l in range(32):
                    e = h * 128 + 32 * g + l
                    q = ((ru[o + h * 64 + (g % 2) * 32 + l] >> (4 * (g // 2))) & 15) | (
                        ((ru[o + 128 + h * 32 + l] >> (2 * g)) & 3) << 4
                    )
                    dd = d * np.float32(np.int8(ru[o + 192 + e // 16]))
                    dst[b * 256 + e] = dd * np.float32(np.int32(q) - 32)


@njit(**_OPTS)
def _iq4_xs(ru, tab16, dst):
    # sub-block j (32 values): 6-bit scale = (scales_l[j//2] >> 4*(j%2)) & 15 | ((scales_h >> 2j) & 3) << 4;
    # its values are the 16 nibble bytes at qs[j*16:], value = (d*(scale-32)) * KVALUES[q]
    for b in range(dst.shape[0] // 256):
        o = b * 136
        d = _h(ru, o, tab16)
        sh = np.int32(ru[o + 2]) | (np.int32(ru[o + 3]) << 8)
        for j in range(8):
            lo = np.int32((ru[o + 4 + j // 2] >> (4 * (j % 2))) & 15)
            hi = (sh >> (2 * j)) & 3
            dl = d * np.float32((lo | (hi << 4)) - 32)
            for l in range(32):
                dst[b * 256 + j * 32 + l] = dl * KVALUES[_nib(ru, o + 8 + j * 16, l)]


# ---------------------------------------------------------------- rows


@njit(**_OPTS)
def _f32(ru, dst):
    f = ru.view(np.float32)
    for k in range(dst.shape[0]):  # a loop: `dst[:] = f` compiled numba's shape-mismatch message, ~3 s
        dst[k] = f[k]


@njit(**_OPTS)
def _half(ru, tab, dst):  # F16 or BF16, through its exact table
    h = ru.view(np.uint16)
    for k in range(dst.shape[0]):
        dst[k] = tab[h[k]]


@njit(**_OPTS)
def _q8(ru, tab16, dst):
    qi = ru.view(np.int8)
    for b in range(dst.shape[0] // 32):
        d = _h(ru, b * 34, tab16)
        for l in range(32):
            dst[b * 32 + l] = np.float32(qi[b * 34 + 2 + l]) * d


def _row(kind, ru, tab16, tabbf, dst):
    """One row of GGML type `kind` (a literal): typed by _row_of."""
    raise NotImplementedError


@overload(_row, prefer_literal=True)
def _row_of(kind, ru, tab16, tabbf, dst):
    # one type's code alone: a kernel compiles the types it is called with, not all fifteen (an
    # if-chain over a runtime kind compiled every type's rows, ~8 s at a process's first start)
    if not isinstance(kind, types.IntegerLiteral):
        return None
    k = kind.literal_value
    if k == 0:
        return lambda kind, ru, tab16, tabbf, dst: _f32(ru, dst)
    if k == 1:
        return lambda kind, ru, tab16, tabbf, dst: _half(ru, tab16, dst)
    if k == 30:
        return lambda kind, ru, tab16, tabbf, dst: _half(ru, tabbf, dst)
    if k == 8:
        return lambda kind, ru, tab16, tabbf, dst: _q8(ru, tab16, dst)
    if k in (2, 3):
        m = k == 3
        return lambda kind, ru, tab16, tabbf, dst: _q4(ru, tab16, dst, m)
    if k in (6, 7):
        m = k == 7
        return lambda kind, ru, tab16, tabbf, dst: _q5(ru, tab16, dst, m)
    if k in (12, 13):
        five = k == 13
        return lambda kind, ru, tab16, tabbf, dst: _q45_k(ru, tab16, dst, five)
    one = {20: _iq4_nl, 10: _q2_k, 11: _q3_k, 14: _q6_k, 23: _iq4_xs}.get(k)
    if one is None:
        raise errors.TypingError(f"no dequantizer for GGML type {k}")
    return lambda kind, ru, tab16, tabbf, dst: one(ru, tab16, dst)


@njit(**_OPTS)
def deq_row(kind, ru, tab16, tabbf, dst):
    # ru: (row_bytes,) uint8 -> dst: (cols,) f32; kind is the GGML qtype code, compiled as a
    # literal (its callers, called with a plain int, are compiled once for each type they see)
    literally(kind)
    _row(kind, ru, tab16, tabbf, dst)


@njit(parallel=True, **_OPTS)
def _dequant_rows(kind, w, tab16, tabbf, out):
    # w: (n, row_bytes) uint8 -> out: (n, cols) f32
    for r in prange(w.shape[0]):
        deq_row(kind, w[r], tab16, tabbf, out[r])


@njit(**_OPTS)
def _dequant_rows_serial(kind, w, tab16, tabbf, out):
    # as _dequant_rows, on the calling thread (prefill workers run one each)
    for r in range(w.shape[0]):
        deq_row(kind, w[r], tab16, tabbf, out[r])


@njit(**_OPTS)
def _exact_tokens(kind, w, x, tab16, tabbf, out):
    # out[b, i] = _exact_dots' value of row i of W against token x[b]: each row dequantized once for
    # all n tokens, each sum taken as _exact_dots takes it (the same bits). Four sums run side by
    # side, each still one float64 chain in column order, so that the chains do not wait on each
    # other's adds: four tokens of a row (a mixture's router over a 256-token prefill: 28 -> 21
    # ms), or, for fewer than four tokens (decode), four rows of each token.
    # w: (rows, row_bytes) uint8 of type kind; x: (n, cols) f32; out: (n, rows) f32
    n, cols = x.shape
    if n < 4:
        rows = np.arange(w.shape[0])
        for b in range(n):
            _exact_dots(kind, w, rows, x[b], tab16, tabbf, out[b])
        return
    scratch = np.empty(cols, np.float32)
    for i in range(w.shape[0]):
        deq_row(kind, w[i], tab16, tabbf, scratch)
        b = 0
        while b + 4 <= n:
            t0, t1, t2, t3 = _four_sums(scratch, scratch, scratch, scratch, x[b], x[b + 1], x[b + 2], x[b + 3])
            out[b, i], out[b + 1, i] = np.float32(t0), np.float32(t1)
            out[b + 2, i], out[b + 3, i] = np.float32(t2), np.float32(t3)
            b += 4
        for b in range(b, n):
            out[b, i] = np.float32(_one_sum(scratch, x[b]))


@njit(**_OPTS)
def _exact_dots(kind, w, rows, x, tab16, tabbf, out):
    # out[i] = f32(sum_j f64(W[rows[i], j]) * f64(x[j])), the sum taken in column order in
    # float64 with nothing fused or reordered (no fastmath): the same bits on every CPU. Four
    # rows' chains run side by side (each its own chain: the same bits), where one chain waited
    # on each add (64 rows of 2048 columns, the head's exact rows of a decoded token: ~175 us).
    # w: (n, row_bytes) uint8 of type kind; rows: (k,) int64; x: (cols,) f32; out: (k,) f32
    sc = np.empty((4, x.shape[0]), np.float32)
    k = rows.shape[0]
    i = 0
    while i + 4 <= k:
        for q in range(4):
            deq_row(kind, w[rows[i + q]], tab16, tabbf, sc[q])
        t0, t1, t2, t3 = _four_sums(sc[0], sc[1], sc[2], sc[3], x, x, x, x)
        out[i], out[i + 1], out[i + 2], out[i + 3] = np.float32(t0), np.float32(t1), np.float32(t2), np.float32(t3)
        i += 4
    for i in range(i, k):
        deq_row(kind, w[rows[i]], tab16, tabbf, sc[0])
        out[i] = np.float32(_one_sum(sc[0], x))


# ---------------------------------------------------------------- entry points, one type each


class _Kernels(NamedTuple):
    rows: object
    rows_serial: object
    tokens: object
    dots: object


@functools.cache
def _kernels(kind: int) -> _Kernels:
    """The row kernels of GGUF type `kind`, each calling its kernel above with kind a literal.
    Called from Python with a plain int, a kernel that asks for a literal is dispatched afresh at
    every call (~29 ms); these take no kind, so they dispatch as any kernel does (~1-3 us), and
    numba caches each, keyed by KIND (a closure capturing only an int pickles the same in every
    process)."""
    KIND = kind

    @njit(**_OPTS)
    def rows(w, tab16, tabbf, out):
        _dequant_rows(KIND, w, tab16, tabbf, out)

    @njit(**_OPTS)
    def rows_serial(w, tab16, tabbf, out):
        _dequant_rows_serial(KIND, w, tab16, tabbf, out)

    @njit(**_OPTS)
    def tokens(w, x, tab16, tabbf, out):
        _exact_tokens(KIND, w, x, tab16, tabbf, out)

    @njit(**_OPTS)
    def dots(w, rows, x, tab16, tabbf, out):
        _exact_dots(KIND, w, rows, x, tab16, tabbf, out)

    return _Kernels(rows, rows_serial, tokens, dots)


def dequant_rows(kind: int, w: np.ndarray, tab16: np.ndarray, tabbf: np.ndarray, out: np.ndarray) -> None:
    """w: (n, row_bytes) uint8 of GGUF type kind -> out: (n, cols) f32, rows in parallel."""
    _kernels(kind).rows(w, tab16, tabbf, out)


def dequant_rows_serial(kind: int, w: np.ndarray, tab16: np.ndarray, tabbf: np.ndarray, out: np.ndarray) -> None:
    """As dequant_rows, on the calling thread (prefill workers run one each)."""
    _kernels(kind).rows_serial(w, tab16, tabbf, out)


def exact_tokens(kind: int, w: np.ndarray, x: np.ndarray, tab16: np.ndarray, tabbf: np.ndarray,
                 out: np.ndarray) -> None:
    """out[b, i] = exact_dots' value of row i of W against token x[b] (n, cols) -> out (n, rows)."""
    _kernels(kind).tokens(w, x, tab16, tabbf, out)


def exact_dots(kind: int, w: np.ndarray, rows: np.ndarray, x: np.ndarray, tab16: np.ndarray, tabbf: np.ndarray,
               out: np.ndarray) -> None:
    """out[i] = f32(sum_j f64(W[rows[i], j]) * f64(x[j])) in column order: the same bits on every CPU."""
    _kernels(kind).dots(w, rows, x, tab16, tabbf, out)


@njit(inline="always", **_OPTS)
def _four_sums(a0, a1, a2, a3, x0, x1, x2, x3):
    # sum_j f64(a_q[j]) * f64(x_q[j]) for q = 0..3: four float64 chains, each in column order
    t0 = t1 = t2 = t3 = 0.0
    for j in range(a0.shape[0]):
        t0 += np.float64(a0[j]) * np.float64(x0[j])
        t1 += np.float64(a1[j]) * np.float64(x1[j])
        t2 += np.float64(a2[j]) * np.float64(x2[j])
        t3 += np.float64(a3[j]) * np.float64(x3[j])
    return t0, t1, t2, t3


@njit(inline="always", **_OPTS)
def _one_sum(a, x):
    t = 0.0
    for j in range(a.shape[0]):
        t += np.float64(a[j]) * np.float64(x[j])
    return t
