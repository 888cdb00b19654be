"""Numba kernels over GGUF block formats.

Every kernel reads the raw uint8 rows of a weight (never a dequantized copy
of the whole matrix) and writes into a caller-owned `out`. Decode kernels
keep one accumulator per lane of a block (32 or 16 lanes) so LLVM can
vectorize without reassociating a float reduction; rows are handed out to
threads in chunks so lane scratch is allocated once per chunk, not per row.

Prefill decodes a tile of rows into f32 scratch with `deq.dequant_rows_serial`
(every block type, bit-identical to gguf-py; in `deq.py`) and multiplies it by
all tokens at once (quant.matmul, via BLAS sgemm), except for Q4_0, Q4_1 and
Q8_0 on CPUs with AVX-512 VNNI (`intgemm.py`).

F16 block scales are decoded by a 65536-entry float32 table passed in as
`tab` (exact: every f16 value is representable in f32). F16/BF16 weight
matrices are widened with integer bit operations inside the vector loop.

Measured on this machine (one hot core, 512x4096, GB/s of stored bytes):
Q8_0 ~19, Q4_0 ~10.8, Q4_1 ~13, Q4_K ~5, Q6_K ~4.6, F16 ~20
(see tools/bench_kernels.py).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

CHUNK = 16  # rows per thread work item in decode kernels
SPREAD = 16  # distance between the four rows the Q8_0/Q4_0/Q4_1 decode kernels walk together

_OPTS = dict(cache=True, nogil=True)
# 'contract' lets LLVM fuse mul+add into FMA; nothing else is relaxed
# (no reassociation: lane accumulators make vectorization explicit).
_FM = {"contract"}


def f16_table() -> np.ndarray:
    """f32 value of every f16 bit pattern, shape (65536,)."""
    with np.errstate(invalid="ignore"):  # the NaN patterns: numpy on aarch64 warns as it widens them
        return np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


def bf16_table() -> np.ndarray:
    """f32 value of every bf16 bit pattern, shape (65536,)."""
    return (np.arange(65536, dtype=np.uint32) << np.uint32(16)).view(np.float32)


# ---------------------------------------------------------------- decode
# Each kernel walks two rows at once (r and s = r+1, or r again at an odd
# tail): the two lane-accumulator chains are independent, which hides the
# store-to-load latency of the numba-allocated acc array (measured 7 -> 13
# GB/s for Q8_0 on one hot core). x is read once per row pair. Q8_0, Q4_0
# and Q4_1, the types models are mostly made of, walk four rows at once, SPREAD
# rows apart: four adjacent short rows share 4 KiB pages and the prefetchers
# fall behind (Q8_0, 65536x2048 from RAM, one core: ~7.7 GB/s adjacent, 11-14 spread).


@njit(inline="always", **_OPTS)
def _hw(w, r, off, tab):
    """f16 at byte `off` of row r of a uint8 matrix, as f32."""
    return tab[np.int64(w[r, off]) | (np.int64(w[r, off + 1]) << 8)]


@njit(inline="always", **_OPTS)
def _store2(acc, t0, t1, out, r, rows):
    # out[r], out[r+1] = t + sum of the lanes of acc[0], acc[1]
    for l in range(acc.shape[1]):
        t0 += acc[0, l]
        t1 += acc[1, l]
    out[r] = t0
    if r + 1 < rows:
        out[r + 1] = t1


@njit(inline="always", **_OPTS)
def _store4(acc, t0, t1, t2, t3, out, r, rows):
    # out[r + i*SPREAD] = t_i + sum of the lanes of acc[i], for the rows that exist
    for l in range(acc.shape[1]):
        t0 += acc[0, l]
        t1 += acc[1, l]
        t2 += acc[2, l]
        t3 += acc[3, l]
    out[r] = t0
    if r + SPREAD < rows:
        out[r + SPREAD] = t1
    if r + 2 * SPREAD < rows:
        out[r + 2 * SPREAD] = t2
    if r + 3 * SPREAD < rows:
        out[r + 3 * SPREAD] = t3


@intrinsic
def claim(typingctx, addr):
    """The next work item: an atomic fetch-and-add of 1 on the int64 at addr, returning its old
    value. Threads that take items this way each run as many as they have time for: numba's
    prange hands each thread an equal share, so the slowest core sets the pace (this VM's second
    vCPU runs compute-bound loops ~0.7x as fast as its first)."""

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        return builder.atomic_rmw("add", builder.inttoptr(args[0], i64.as_pointer()), ir.Constant(i64, 1),
                                  "monotonic")

    return types.int64(types.int64), codegen


@njit(inline="always", **_OPTS)
def spans(rows):
    # work items of the four-row kernels (here and in vnni): 4*SPREAD rows each, walked as
    # rows r, r+SPREAD, r+2*SPREAD, r+3*SPREAD for the first SPREAD r of the span
    return (rows + 4 * SPREAD - 1) // (4 * SPREAD)


@njit(inline="always", **_OPTS)
def partners(r, rows):
    # the three rows walked with r; past the end they repeat the last row (results not stored)
    return min(r + SPREAD, rows - 1), min(r + 2 * SPREAD, rows - 1), min(r + 3 * SPREAD, rows - 1)


@njit(inline="always", **_OPTS)
def _nchunks(rows):
    return (rows + CHUNK - 1) // CHUNK


@njit(parallel=True, fastmath=_FM, **_OPTS)
def matvec_f32(w, x, out):
    # w: (rows, cols) f32, x: (cols,), out: (rows,); columns past a multiple of 32 take a scalar tail
    rows, cols = w.shape
    for c in prange(_nchunks(rows)):
        acc = np.empty((2, 32), np.float32)
        for r in range(c * CHUNK, min(rows, (c + 1) * CHUNK), 2):
            s = min(r + 1, rows - 1)
            acc[:] = 0.0
            for b in range(cols // 32):
                for l in range(32):
                    acc[0, l] += w[r, b * 32 + l] * x[b * 32 + l]
                    acc[1, l] += w[s, b * 32 + l] * x[b * 32 + l]
            t0 = np.float32(0.0)
            t1 = np.float32(0.0)
            for k in range(cols - cols % 32, cols):
                t0 += w[r, k] * x[k]
                t1 += w[s, k] * x[k]
            _store2(acc, t0, t1, out, r, rows)


@njit(parallel=True, fastmath=_FM, **_OPTS)
def matvec_half(w, tab, x, out, bf16):
    # w: (rows, cols) uint16 bit patterns of f16 (bf16=False) or bf16 (bf16=True).
    # Bits are widened with integer ops into a u32 scratch and read back through an f32 view:
    # bf16 -> bits << 16; f16 -> (bits & 0x7fff) << 13 | sign, times 2^112 (exact for
    # normal and subnormal f16; inf/nan weights would read as large finite values).
    rows, cols = w.shape
    mul = np.float32(1.0) if bf16 else np.float32(2.0**112)
    for c in prange(_nchunks(rows)):
        acc = np.empty((2, 32), np.float32)
        u = np.empty((2, 32), np.uint32)
        f = u.view(np.float32)
        for r in range(c * CHUNK, min(rows, (c + 1) * CHUNK), 2):
            s = min(r + 1, rows - 1)
            acc[:] = 0.0
            for b in range(cols // 32):
                if bf16:
                    for l in range(32):
                        u[0, l] = np.uint32(w[r, b * 32 + l]) << np.uint32(16)
                        u[1, l] = np.uint32(w[s, b * 32 + l]) << np.uint32(16)
                else:
                    for l in range(32):
                        h0 = np.uint32(w[r, b * 32 + l])
                        h1 = np.uint32(w[s, b * 32 + l])
                        u[0, l] = ((h0 & np.uint32(0x7FFF)) << np.uint32(13)) | ((h0 & np.uint32(0x8000)) << np.uint32(16))
                        u[1, l] = ((h1 & np.uint32(0x7FFF)) << np.uint32(13)) | ((h1 & np.uint32(0x8000)) << np.uint32(16))
                for l in range(32):
                    xv = x[b * 32 + l]
                    acc[0, l] += (f[0, l] * mul) * xv
                    acc[1, l] += (f[1, l] * mul) * xv
            t0 = np.float32(0.0)
            t1 = np.float32(0.0)
            for k in range(cols - cols % 32, cols):  # tail past a multiple of 32: table decode
                t0 += tab[w[r, k]] * x[k]
                t1 += tab[w[s, k]] * x[k]
            _store2(acc, t0, t1, out, r, rows)


@njit(parallel=True, fastmath=_FM, **_OPTS)
def matvec_q8_0(w, wi, tab, x, out):
    # w/wi: (rows, nb*34) uint8/int8 views of the same bytes; block = f16 d, int8 q[32].
    # Four rows at once: four streams in flight lift the from-RAM rate on one core
    # (2048x2048: 7.2 -> 9.0 GB/s; 8192x2048: 5.8 -> 7.7) where two rows left it latency-bound.
    # The four are SPREAD rows apart, in separate 4 KiB pages: adjacent short rows share
    # pages, which the prefetchers serve badly (see vnni.matvec_q4_0).
    rows = w.shape[0]
    nb = x.shape[0] // 32
    for c in prange(spans(rows)):
        acc = np.empty((4, 32), np.float32)
        for r in range(c * 4 * SPREAD, min(rows, c * 4 * SPREAD + SPREAD)):
            r1, r2, r3 = partners(r, rows)
            acc[:] = 0.0
            for b in range(nb):
                o = b * 34
                d0 = _hw(w, r, o, tab)
                d1 = _hw(w, r1, o, tab)
                d2 = _hw(w, r2, o, tab)
                d3 = _hw(w, r3, o, tab)
                for l in range(32):
                    xv = x[b * 32 + l]
                    acc[0, l] += (d0 * xv) * wi[r, o + 2 + l]
                    acc[1, l] += (d1 * xv) * wi[r1, o + 2 + l]
                    acc[2, l] += (d2 * xv) * wi[r2, o + 2 + l]
                    acc[3, l] += (d3 * xv) * wi[r3, o + 2 + l]
            z = np.float32(0.0)
            _store4(acc, z, z, z, z, out, r, rows)


@njit(**_OPTS)
def _block_sums(x, g):
    # x: (cols,) -> (cols//g,) sum of each group of g
    nb = x.shape[0] // g
    sx = np.zeros(nb, np.float32)
    for b in range(nb):
        t = np.float32(0.0)
        for l in range(g):
            t += x[b * g + l]
        sx[b] = t
    return sx


# Q4_0 / Q4_1 walk four rows at once and sum each block before scaling it:
#   acc[i, l] += d_i * (x[l] * lo(q_il) + x[16+l] * hi(q_il))
# i.e. one mul + two FMAs per 32 values and row (the d*x form needs two muls + two FMAs),
# with the 16 nibble bytes zero-extended once. Four independent accumulator chains per
# block hide the FMA latency. Measured on this machine (one core, 2048x2048, GB/s of
# GGUF bytes) against the two-row d*x form: Q4_0 hot ~8.3 -> ~10.5, cold ~4.3 -> ~6.


@njit(inline="always", **_OPTS)
def _nib4(w, r0, r1, r2, r3, q, d0, d1, d2, d3, x, xo, acc):
    # acc[i, :] += d_i * block dot, for the 16 nibble bytes at w[r_i, q:q+16] and x[xo:xo+32];
    # value j<16 is lo(byte j), j>=16 is hi(byte j-16). Nibbles go through int32 (not
    # int64) so LLVM converts them with 16-lane vcvtdq2ps.
    for l in range(16):
        xa = x[xo + l]
        xb = x[xo + 16 + l]
        a0 = w[r0, q + l]
        a1 = w[r1, q + l]
        a2 = w[r2, q + l]
        a3 = w[r3, q + l]
        acc[0, l] += d0 * (xa * np.float32(np.int32(a0 & 15)) + xb * np.float32(np.int32(a0 >> 4)))
        acc[1, l] += d1 * (xa * np.float32(np.int32(a1 & 15)) + xb * np.float32(np.int32(a1 >> 4)))
        acc[2, l] += d2 * (xa * np.float32(np.int32(a2 & 15)) + xb * np.float32(np.int32(a2 >> 4)))
        acc[3, l] += d3 * (xa * np.float32(np.int32(a3 & 15)) + xb * np.float32(np.int32(a3 >> 4)))


@njit(inline="always", **_OPTS)
def _matvec_nibbles(w, tab, x, out, bs, with_min):
    # Q4_0 (bs 18: f16 d, nibbles; value (q-8)*d) and Q4_1 (bs 20: f16 d, f16 m, nibbles;
    # value q*d + m): sum_j v_j x_j = d * sum_j q_j x_j + c * sum_j x_j, with c = m or -8d.
    # Inlined with constant bs and with_min, so each caller compiles to its own loop.
    rows = w.shape[0]
    nb = x.shape[0] // 32
    sx = _block_sums(x, 32)
    q = 4 if with_min else 2  # where the nibbles start in a block
    for c in prange(spans(rows)):
        acc = np.empty((4, 16), np.float32)
        for r in range(c * 4 * SPREAD, min(rows, c * 4 * SPREAD + SPREAD)):
            r1, r2, r3 = partners(r, rows)
            acc[:] = 0.0
            t0 = t1 = t2 = t3 = np.float32(0.0)
            for b in range(nb):
                o = b * bs
                d0 = _hw(w, r, o, tab)
                d1 = _hw(w, r1, o, tab)
                d2 = _hw(w, r2, o, tab)
                d3 = _hw(w, r3, o, tab)
                if with_min:
                    t0 += _hw(w, r, o + 2, tab) * sx[b]
                    t1 += _hw(w, r1, o + 2, tab) * sx[b]
                    t2 += _hw(w, r2, o + 2, tab) * sx[b]
                    t3 += _hw(w, r3, o + 2, tab) * sx[b]
                else:  # 8 * sx is exact in f32
                    t0 -= d0 * (np.float32(8.0) * sx[b])
                    t1 -= d1 * (np.float32(8.0) * sx[b])
                    t2 -= d2 * (np.float32(8.0) * sx[b])
                    t3 -= d3 * (np.float32(8.0) * sx[b])
                _nib4(w, r, r1, r2, r3, o + q, d0, d1, d2, d3, x, b * 32, acc)
            _store4(acc, t0, t1, t2, t3, out, r, rows)


@njit(parallel=True, fastmath=_FM, **_OPTS)
def matvec_q4_0(w, tab, x, out):
    _matvec_nibbles(w, tab, x, out, 18, False)


@njit(parallel=True, fastmath=_FM, **_OPTS)
def matvec_q4_1(w, tab, x, out):
    _matvec_nibbles(w, tab, x, out, 20, True)


@njit(inline="always", **_OPTS)
def _q4k_scale_min(w, r, o, j):
    # 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes at o+4 of row r
    p = o + 4
    if j < 4:
        sc = w[r, p + j] & 63
        mn = w[r, p + 4 + j] & 63
    else:
        sc = (w[r, p + 4 + j] & 15) | ((w[r, p + j - 4] >> 6) << 4)
        mn = (w[r, p + 4 + j] >> 4) | ((w[r, p + j] >> 6) << 4)
    return np.float32(sc), np.float32(mn)


@njit(parallel=True, fastmath=_FM, **_OPTS)
def matvec_q4_k(w, tab, x, out):
    # block (256 values, 144 B) = f16 d, f16 dmin, 12 B scales/mins, 128 B qs.
    # qs chunk cc (32 B) holds sub-block 2cc in low nibbles, 2cc+1 in high nibbles;
    # value = (d*sc_j)*q - (dmin*m_j)
    rows = w.shape[0]
    nb = x.shape[0] // 256
    sx = _block_sums(x, 32)
    for c in prange(_nchunks(rows)):
        acc = np.empty((2, 32), np.float32)
        tt = np.empty(2, np.float32)
        for r in range(c * CHUNK, min(rows, (c + 1) * CHUNK), 2):
            s = min(r + 1, rows - 1)
            acc[:] = 0.0
            tt[:] = 0.0
            for b in range(nb):
                o = b * 144
                dr = _hw(w, r, o, tab)
                ds = _hw(w, s, o, tab)
                mr = _hw(w, r, o + 2, tab)
                ms = _hw(w, s, o + 2, tab)
                for cc in range(4):
                    xo = b * 256 + cc * 64
                    qo = o + 16 + cc * 32
                    # sub-blocks 2cc (low nibbles) and 2cc+1 (high nibbles) of rows r and s
                    scr0, mnr0 = _q4k_scale_min(w, r, o, 2 * cc)
                    scr1, mnr1 = _q4k_scale_min(w, r, o, 2 * cc + 1)
                    scs0, mns0 = _q4k_scale_min(w, s, o, 2 * cc)
                    scs1, mns1 = _q4k_scale_min(w, s, o, 2 * cc + 1)
                    a0, a1, b0, b1 = dr * scr0, dr * scr1, ds * scs0, ds * scs1
                    sx0 = sx[b * 8 + 2 * cc]
                    sx1 = sx[b * 8 + 2 * cc + 1]
                    tt[0] -= (mr * mnr0) * sx0 + (mr * mnr1) * sx1
                    tt[1] -= (ms * mns0) * sx0 + (ms * mns1) * sx1
                    for l in range(32):
                        xa = x[xo + l]
                        xb = x[xo + 32 + l]
                        q0 = w[r, qo + l]
                        q1 = w[s, qo + l]
                        acc[0, l] += (a0 * xa) * np.float32(np.int32(q0 & 15)) + (a1 * xb) * np.float32(np.int32(q0 >> 4))
                        acc[1, l] += (b0 * xa) * np.float32(np.int32(q1 & 15)) + (b1 * xb) * np.float32(np.int32(q1 >> 4))
            _store2(acc, tt[0], tt[1], out, r, rows)


@njit(parallel=True, fastmath=_FM, **_OPTS)
def matvec_q6_k(w, tab, x, out):
    # block (256 values, 210 B) = ql 128 B, qh 64 B, int8 scales[16], f16 d.
    # In half h (128 values), for l in 0..31, bytes A = ql[h*64 + l], B = ql[h*64 + 32 + l],
    # C = qh[h*32 + l] give values h*128 + 32g + l (g = 0..3):
    #   q0 = lo(A) | (C&3)<<4, q1 = lo(B) | (C>>2&3)<<4, q2 = hi(A) | (C>>4&3)<<4, q3 = hi(B) | (C>>6)<<4
    # value = d*scales[(h*128 + 32g + l)//16] * (q - 32)
    rows = w.shape[0]
    nb = x.shape[0] // 256
    for c in prange(_nchunks(rows)):
        acc = np.empty((2, 32), np.float32)
        for r in range(c * CHUNK, min(rows, (c + 1) * CHUNK), 2):
            s = min(r + 1, rows - 1)
            acc[:] = 0.0
            for b in range(nb):
                o = b * 210
                for j in range(2):
                    rj = r if j == 0 else s
                    d = _hw(w, rj, o + 208, tab)
                    for h in range(2):
                        ql = o + h * 64
                        qh = o + 128 + h * 32
                        xo = b * 256 + h * 128
                        so = o + 192 + h * 8
                        for half in range(2):
                            s0 = d * np.float32(np.int8(w[rj, so + half]))
                            s1 = d * np.float32(np.int8(w[rj, so + 2 + half]))
                            s2 = d * np.float32(np.int8(w[rj, so + 4 + half]))
                            s3 = d * np.float32(np.int8(w[rj, so + 6 + half]))
                            for l in range(half * 16, half * 16 + 16):
                                qa = np.int32(w[rj, ql + l])
                                qb = np.int32(w[rj, ql + 32 + l])
                                qc = np.int32(w[rj, qh + l])
                                q0 = np.float32(np.int32(((qa & 15) | ((qc & 3) << 4)) - 32))
                                q1 = np.float32(np.int32(((qb & 15) | (((qc >> 2) & 3) << 4)) - 32))
                                q2 = np.float32(np.int32(((qa >> 4) | (((qc >> 4) & 3) << 4)) - 32))
                                q3 = np.float32(np.int32(((qb >> 4) | ((qc >> 6) << 4)) - 32))
                                acc[j, l] += (
                                    (s0 * x[xo + l]) * q0
                                    + (s1 * x[xo + 32 + l]) * q1
                                    + (s2 * x[xo + 64 + l]) * q2
                                    + (s3 * x[xo + 96 + l]) * q3
                                )
            _store2(acc, np.float32(0.0), np.float32(0.0), out, r, rows)


@njit(**_OPTS)
def half_bits(u):  # pragma: no cover - compiled
    # the bits of the IEEE half nearest the f32 whose bits are u (an int64), ties to even, as numpy's
    # astype(float16) and F16C's vcvtps2ph round; too large for a half: infinity; NaN: a quiet NaN
    sign = (u >> 16) & 0x8000
    a = u & 0x7FFFFFFF
    if a > 0x7F800000:
        return sign | 0x7E00
    if a >= 0x477FF000:  # from halfway between 65504 and 2^16 up (a tie goes to the even 2^16): inf
        return sign | 0x7C00
    if a < 0x38800000:  # below 2^-14: a subnormal half, in units of 2^-24
        if a <= 0x33000000:  # up to 2^-25, half a unit (a tie goes to the even 0)
            return sign
        e = a >> 23
        m = (a & 0x7FFFFF) | 0x800000
        shift = 126 - e  # m * 2^(e - 150) in units of 2^-24: 14 to 24 bits dropped
        q, rest, half = m >> shift, m & ((1 << shift) - 1), 1 << (shift - 1)
    else:
        q, rest, half = (((a >> 23) - 112) << 10) | ((a & 0x7FFFFF) >> 13), a & 0x1FFF, 0x1000
    if rest > half or (rest == half and q & 1):
        q += 1  # a carry into the exponent is the right result, up to infinity
    return sign | q


@njit(**_OPTS)
def quantize_q8_0_blocks(x, tab16, out, back):  # pragma: no cover - compiled
    # x: (nb*32,) f32 -> out: (nb*34,) uint8, ggml's Q8_0 blocks as quantize_row_q8_0 makes them:
    # d = max|x|/127 stored as f16, q = roundf(x/d) (half away from zero). back: then x[i] = f32(d16) * q[i],
    # what dequantizing the block gives (deq.deq_row's Q8_0 arithmetic)
    nb = x.shape[0] // 32
    q = out.view(np.int8)
    d = np.empty(1, np.float32)
    bits = d.view(np.uint32)
    for b in range(nb):
        amax = np.float32(0.0)
        for j in range(32):
            v = abs(x[b * 32 + j])
            if v > amax:
                amax = v
        db = amax / np.float32(127.0)
        d[0] = db
        h = half_bits(np.int64(bits[0]))
        out[b * 34] = h & 0xFF
        out[b * 34 + 1] = h >> 8
        inv = np.float32(1.0) / db if db != 0 else np.float32(0.0)
        d16 = tab16[h]
        for j in range(32):  # one pass, x written from the code in a register (no reread of q: it vectorizes)
            v = x[b * 32 + j] * inv
            a = abs(v)
            whole = np.floor(a)
            r = whole + np.floor(np.float32(2.0) * (a - whole))
            c = np.int8(-r if v < 0 else r)
            q[b * 34 + 2 + j] = c
            if back:
                x[b * 32 + j] = np.float32(c) * d16


@njit(**_OPTS)
def q8_0_values(buf, tab16, out, add):  # pragma: no cover - compiled
    # out: (nb*32,) f32 = (add: +=) the values of the Q8_0 blocks buf (nb*34,) uint8, f32(d16) * q each
    # (deq.deq_row's Q8_0 arithmetic), added in f32 as numpy's += adds
    qi = buf.view(np.int8)
    for b in range(out.shape[0] // 32):
        d16 = tab16[np.int64(buf[b * 34]) | (np.int64(buf[b * 34 + 1]) << 8)]
        for j in range(32):
            v = np.float32(qi[b * 34 + 2 + j]) * d16
            out[b * 32 + j] = out[b * 32 + j] + v if add else v
