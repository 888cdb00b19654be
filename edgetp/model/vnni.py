"""Q4_0 decode times int8 activations with AVX-512 VNNI, as llama.cpp computes it.

Prefill (many tokens) has its own kernels in `intgemm.py`; they share this
module's activation rounding (`q8_block`), IR helpers and `available()`.

The float kernels in `kernels.py` widen every nibble to f32; on one core that
is compute-bound near 10 GB/s of weights, far from what memory gives. Here the
activations are rounded to int8 in blocks of 32 first, exactly as ggml's
x86 `quantize_row_q8_0` does (scale d = max|x|/127 stored as f16, q =
round-half-even(x * 127/max|x|)), and each Q4_0 block is one integer dot
product, `vpdpbusd` (unsigned nibble x signed int8, four products per 32-bit
lane), scaled by d_w * d_x in f32 - the arithmetic of ggml_vec_dot_q4_0_q8_0.
So results agree with llama.cpp to its own rounding, not to a float64
reference: the activation rounding moves a dot by up to about half a percent
of its magnitude (random 2048-column rows).

numba cannot express `vpdpbusd`, so the inner loop is written as LLVM IR in a
numba intrinsic. It only compiles where numba targets a CPU with AVX-512 VNNI;
`available()` tries it once (compile, run, compare with a plain integer
formula) and the float kernels stay in use everywhere else (any other ISA that
isa.py chooses or EDGETP_ISA forces) or when EDGETP_INT8=0.

Layout. Two Q4_0 blocks (2 x 18 B: f16 d, 16 B nibbles) fill one 64-byte
register as [lo nibbles b0 | lo b1 | hi b0 | hi b1], i.e. values
[b0 0:16 | b1 0:16 | b0 16:32 | b1 16:32]. `quantize` stores the int8
activations in that same order per block pair, with two 16-lane vectors
beside them: dx (the block's f32 scale in each of its 8 lanes) and cor (minus
the block's int8 sum in each of its 8 lanes). cor seeds the integer dot, so a
block's 8 lanes sum to sum(q*x) - 8*sum(x) = sum((q-8)*x) without a separate
correction. An odd block count is padded with a zero block on the x side.
"""

from __future__ import annotations

import functools
import logging
import os

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from edgetp.model import isa
from edgetp.model.kernels import SPREAD, partners, spans

log = logging.getLogger(__name__)

_OPTS = dict(cache=True, nogil=True)

_I8, _I16, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
_V16I32, _V16F = ir.VectorType(_I32, 16), ir.VectorType(_F32, 16)


def _vec(ty, vals):
    return ir.Constant(ir.VectorType(ty, len(vals)), [ir.Constant(ty, v) for v in vals])


def _decl(module, name, ret, args):
    fn = module.globals.get(name)
    return fn if fn is not None else ir.Function(module, ir.FunctionType(ret, args), name)


def _at(builder, addr, offset, ty):
    """Pointer of type ty* at integer address addr + offset."""
    if offset:
        addr = builder.add(addr, ir.Constant(_I64, offset))
    return builder.inttoptr(addr, ty.as_pointer())


def _emit_pair(builder, rows, x, off36, off64, accs, full):
    """One block pair of R rows against the token: returns the R updated accumulators.

    rows: R row addresses; x: the token's (qx, dx, cor) addresses; off36/off64: byte
    offsets of this pair in a weight row / in the activation arrays. With full False
    only the first block is read (the second is taken as zero).
    """
    module = builder.module
    dpbusd = _decl(module, "llvm.x86.avx512.vpdpbusd.512", _V16I32, [_V16I32] * 3)
    fma = _decl(module, "llvm.fma.v16f32", _V16F, [_V16F] * 3)
    qx, dx, cor = x
    xq = builder.load(_at(builder, builder.add(qx, off64), 0, _V16I32), align=1)
    xd = builder.load(_at(builder, builder.add(dx, off64), 0, _V16F), align=4)
    xc = builder.load(_at(builder, builder.add(cor, off64), 0, _V16I32), align=4)
    pair = _vec(_I32, [0] * 4 + [1] * 4 + [0] * 4 + [1] * 4)
    v16i8 = ir.VectorType(_I8, 16)
    new = []
    for r, row in enumerate(rows):
        p = builder.add(row, off36)
        d0 = builder.fpext(builder.bitcast(builder.load(_at(builder, p, 0, _I16), align=1), ir.HalfType()), _F32)
        q0 = builder.load(_at(builder, p, 2, v16i8), align=1)
        if full:
            d1 = builder.fpext(builder.bitcast(builder.load(_at(builder, p, 18, _I16), align=1), ir.HalfType()), _F32)
            q1 = builder.load(_at(builder, p, 20, v16i8), align=1)
        else:
            d1, q1 = ir.Constant(_F32, 0.0), ir.Constant(v16i8, None)
        d2 = builder.insert_element(ir.Constant(ir.VectorType(_F32, 2), None), d0, ir.Constant(_I32, 0))
        d2 = builder.insert_element(d2, d1, ir.Constant(_I32, 1))
        dw = builder.shuffle_vector(d2, d2, pair)
        both = builder.shuffle_vector(q0, q1, _vec(_I32, range(32)))
        lo = builder.and_(both, _vec(_I8, [15] * 32))
        hi = builder.lshr(both, _vec(_I8, [4] * 32))
        u = builder.bitcast(builder.shuffle_vector(lo, hi, _vec(_I32, range(64))), _V16I32)
        dot = builder.sitofp(builder.call(dpbusd, [xc, u, xq]), _V16F)
        new.append(builder.call(fma, [dot, builder.fmul(dw, xd), accs[r]]))
    return new


@intrinsic
def _dot_q4_0(typingctx, rows, qx, dx, cor, nb, out):
    """out[r] = row r . the token, for R Q4_0 rows (a tuple of addresses).

    qx/dx/cor: addresses of the token's permuted int8 values, dx and cor vectors;
    nb: blocks per row; out: address of R f32.
    """
    R = rows.count
    sig = types.void(rows, types.int64, types.int64, types.int64, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        rows_v, qx_v, dx_v, cor_v, nb_v, out_v = args
        rows_a = [builder.extract_value(rows_v, i) for i in range(R)]
        xs = (qx_v, dx_v, cor_v)
        zero = ir.Constant(_V16F, None)
        npairs = builder.ashr(nb_v, ir.Constant(_I64, 1))
        entry = builder.block
        loop = builder.append_basic_block("q4.loop")
        after = builder.append_basic_block("q4.after")
        tail = builder.append_basic_block("q4.tail")
        done = builder.append_basic_block("q4.done")
        builder.cbranch(builder.icmp_signed(">", npairs, ir.Constant(_I64, 0)), loop, after)

        builder.position_at_end(loop)
        k = builder.phi(_I64)
        accs = [builder.phi(_V16F) for _ in range(R)]
        new = _emit_pair(builder, rows_a, xs, builder.mul(k, ir.Constant(_I64, 36)),
                         builder.mul(k, ir.Constant(_I64, 64)), accs, True)
        k1 = builder.add(k, ir.Constant(_I64, 1))
        k.add_incoming(ir.Constant(_I64, 0), entry)
        k.add_incoming(k1, builder.block)
        for a, n in zip(accs, new):
            a.add_incoming(zero, entry)
            a.add_incoming(n, builder.block)
        builder.cbranch(builder.icmp_signed("<", k1, npairs), loop, after)

        builder.position_at_end(after)
        mid = [builder.phi(_V16F) for _ in range(R)]
        for m, n in zip(mid, new):
            m.add_incoming(zero, entry)
            m.add_incoming(n, loop)
        odd = builder.icmp_signed("!=", builder.and_(nb_v, ir.Constant(_I64, 1)), ir.Constant(_I64, 0))
        builder.cbranch(odd, tail, done)

        builder.position_at_end(tail)
        last = _emit_pair(builder, rows_a, xs, builder.mul(npairs, ir.Constant(_I64, 36)),
                          builder.mul(npairs, ir.Constant(_I64, 64)), mid, False)
        builder.branch(done)

        builder.position_at_end(done)
        fin = [builder.phi(_V16F) for _ in range(R)]
        for f, m, n in zip(fin, mid, last):
            f.add_incoming(m, after)
            f.add_incoming(n, tail)
        reduce = _decl(builder.module, "llvm.vector.reduce.fadd.v16f32", _F32, [_F32, _V16F])
        for i, f in enumerate(fin):
            builder.store(builder.call(reduce, [ir.Constant(_F32, 0.0), f]), _at(builder, out_v, 4 * i, _F32))
        return context.get_dummy_value()

    return sig, codegen


# ---------------------------------------------------------------- activations


@njit(inline="always", **_OPTS)
def _f16_round(v, f, u):
    """v (f32, >= 0) rounded to the nearest f16 value (ties to even), as f32.

    f/u: a one-element f32 scratch and its uint32 view (numba has no scalar bitcast)."""
    if v >= np.float32(65520.0):
        return np.float32(np.inf)
    if v < np.float32(6.103515625e-05):  # f16 subnormal: a multiple of 2**-24
        return np.float32(np.rint(v * np.float32(16777216.0)) / np.float32(16777216.0))
    f[0] = v
    b = u[0]
    u[0] = (b + np.uint32(0x0FFF) + ((b >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
    return f[0]


@njit(inline="always", **_OPTS)
def q8_block(src, dst, f, u):
    """One block of 32 activations rounded like ggml's x86 quantize_row_q8_0: the int8
    values into dst (32,), returns (d, sum of the values). f/u as for _f16_round."""
    amax = np.float32(0.0)
    for j in range(32):
        amax = max(amax, abs(src[j]))
    d = _f16_round(amax / np.float32(127.0), f, u)
    inv = np.float32(127.0) / amax if amax != 0 else np.float32(0.0)
    s = 0
    for j in range(32):
        v = np.int8(np.rint(src[j] * inv))
        dst[j] = v
        s += v
    return d, s


@njit(**_OPTS)
def quantize(x, qx, dx, cor):
    """x (n, nb*32) f32 -> qx (n, npad*32) int8 in pair order, dx (n, npad*8) f32, cor (n, npad*8) int32.

    npad = nb rounded up to even; a padding block is all zero.
    """
    n = x.shape[0]
    nb = x.shape[1] // 32
    q = np.empty(32, np.int8)
    f = np.empty(1, np.float32)
    u = f.view(np.uint32)
    for t in range(n):
        if nb % 2:
            pb = nb // 2
            for j in range(16):
                qx[t, pb * 64 + 16 + j] = 0
                qx[t, pb * 64 + 48 + j] = 0
            for j in range(4):
                dx[t, pb * 16 + 4 + j] = 0.0
                dx[t, pb * 16 + 12 + j] = 0.0
                cor[t, pb * 16 + 4 + j] = 0
                cor[t, pb * 16 + 12 + j] = 0
        for b in range(nb):
            d, s = q8_block(x[t, b * 32 : b * 32 + 32], q, f, u)
            base = (b // 2) * 64 + (b % 2) * 16
            for j in range(16):
                qx[t, base + j] = q[j]
                qx[t, base + 32 + j] = q[16 + j]
            lane = (b // 2) * 16 + (b % 2) * 4
            for j in range(4):
                dx[t, lane + j] = d
                dx[t, lane + 8 + j] = d
                cor[t, lane + j] = -s
                cor[t, lane + 8 + j] = -s


def quantized(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(qx, dx, cor) for x (n, cols), the arguments of the kernels below."""
    n, cols = x.shape
    npad = -(-cols // 64) * 2
    qx = np.empty((n, npad * 32), np.int8)
    dx = np.empty((n, npad * 8), np.float32)
    cor = np.empty((n, npad * 8), np.int32)
    quantize(x, qx, dx, cor)
    return qx, dx, cor


# ---------------------------------------------------------------- kernels


@njit(parallel=True, **_OPTS)
def matvec_q4_0(w, qx, dx, cor, out):
    """out (rows,) = W . x for one quantized token (row 0 of qx, dx, cor).

    Four rows at once, SPREAD rows apart: four adjacent short rows (2048 columns
    = 1152 B) are four streams inside one 4 KiB page, which the prefetchers serve
    badly; rows 16 apart are four separate pages. One core, 65536x2048 from RAM:
    ~6 GB/s adjacent, ~14 spread (a plain read of the same bytes: ~15).
    """
    rows = w.shape[0]
    nb = w.shape[1] // 18
    wa, st = w.ctypes.data, w.shape[1]
    xa, da, ca = qx.ctypes.data, dx.ctypes.data, cor.ctypes.data
    for c in prange(spans(rows)):
        res = np.empty(4, np.float32)
        for r in range(c * 4 * SPREAD, min(rows, c * 4 * SPREAD + SPREAD)):
            r1, r2, r3 = partners(r, rows)
            _dot_q4_0((wa + r * st, wa + r1 * st, wa + r2 * st, wa + r3 * st), xa, da, ca, nb, res.ctypes.data)
            for i in range(4):
                if r + i * SPREAD < rows:
                    out[r + i * SPREAD] = res[i]


# ---------------------------------------------------------------- availability


def _probe() -> bool:
    """Compile and run the kernels once on a small odd-shaped case; True if they
    agree with a plain integer evaluation of the same arithmetic."""
    rng = np.random.default_rng(7)
    rows, nb = 7, 5
    w = rng.integers(0, 256, (rows, nb * 18), dtype=np.uint8)
    w.reshape(rows, nb, 18)[:, :, :2] = np.full((rows, nb), 0.5, np.float16)[..., None].view(np.uint8)
    x = rng.standard_normal((5, nb * 32)).astype(np.float32)
    qx, dx, cor = quantized(x)
    # reference: unpermute the int8 values, integer dot per block, then scale
    q = (qx.reshape(5, -1, 2, 2, 16).transpose(0, 1, 3, 2, 4).reshape(5, -1, 32))[:, :nb].astype(np.int64)
    d = dx.reshape(5, -1, 2, 2, 4)[:, :, 0, :, 0].reshape(5, -1)[:, :nb].astype(np.float64)
    nib = w.reshape(rows, nb, 18)[:, :, 2:]
    vals = np.concatenate([nib & 15, nib >> 4], axis=2).astype(np.int64) - 8
    want = np.einsum("rbj,tbj,tb->tr", vals, q, d) * 0.5
    got = np.empty((5, rows), np.float32)
    for t in range(5):
        matvec_q4_0(w, qx[t : t + 1], dx[t : t + 1], cor[t : t + 1], got[t])
    return bool(np.allclose(got, want, rtol=1e-5, atol=1e-4))


def wanted() -> bool:
    """True when these AVX-512 VNNI kernels should run here: the ISA in use (isa.py,
    EDGETP_ISA) is avx512vnni and EDGETP_INT8 is not 0. `available()` also probes them."""
    if os.environ.get("EDGETP_INT8", "1") == "0":
        return False
    try:
        return isa.current() == "avx512vnni"
    except isa.IsaError:  # the CLI refuses to start; anything else gets the float kernels
        return False


def checked(probe, what: str) -> bool:
    """probe() -> bool, with any failure to compile or run logged once and taken as False."""
    try:
        ok = probe()
    except Exception as exc:  # noqa: BLE001 - whatever broke, the float kernels still work
        log.warning("%s unavailable, using the float kernels: %s", what, exc)
        return False
    if not ok:
        log.warning("%s gave wrong results on this CPU; using the float kernels", what)
    return ok


@functools.cache
def available() -> bool:
    """True when the VNNI decode kernel runs here (see wanted())."""
    return wanted() and checked(_probe, "int8 Q4_0 decode kernels")
