"""Prefill products on AVX-512 VNNI: Q4_0, Q4_1 and Q8_0 weights times integer activations.

Decode reads every weight once per token, so it is bound by memory (`intdot.py`,
`kernels.py`). Prefill reuses each weight for every token of the batch, so it
is bound by arithmetic. f32 sgemm peaks near 116 GFLOP/s on one core here, and
VNNI tiles with 16 columns per register reached only 63-80 GOPS: every block
cost an unpack, a conversion and two scale products per row and token.

Here the lanes of a register are 16 rows, not 16 columns. A panel of 16 rows
is packed once per batch:
  q: per block, 4 (Q4_0/Q4_1: nibbles) or 8 (Q8_0: bytes) 64-byte vectors;
     vector g holds the g-th 4 bytes of the block for each of the 16 rows;
  d: per block, the 16 rows' scales (f32); Q4_1 also m, their offsets.
One dot instruction then multiplies 4 (int8) or 2 (int16) columns of 16 rows
by the same activations, broadcast from memory. A block of 32 columns goes
into one integer accumulator per token; only then is it converted and scaled,
once per block for 16 rows: sum += float(acc) * dx[t, b] * d[b].

Activations are rounded per block of 32 columns:
  Q4_0  to int8 exactly as `vnni.q8_block` does (ggml's x86 quantize_row_q8_0),
        so prefill and decode agree with llama.cpp's arithmetic. `vpdpbusd`:
        nibbles q (0..15) times x, the accumulator starts at -8 * sum(x).
  Q4_1, Q8_0  to int16 (scale max|x| / 32767, f32), `vpdpwssd` on 16-bit
        weight pairs unpacked from the panel in registers; Q4_1's offset adds
        m[b] * dx * sum(x). Int8 activations flip SmolLM2's first answer
        token (a 0.08-logit tie: "L'Etoile..." instead of "The capital of
        France is Paris"), as they do in llama.cpp; 16 bits keep the logits
        within 3e-4 of their spread of the exact math, and these types'
        decode is exact f32.

One core, 256 tokens, 2048- and 8192-column shapes: ~270 GOPS (int8) and
~155 GOPS (int16), against ~80 for f32 sgemm on decoded tiles. Packing the
panels is ~1% of that.
"""

from __future__ import annotations

import functools

import numpy as np
from gguf import GGMLQuantizationType as QT
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from edgetp.model import vnni
from edgetp.model.kernels import f16_table
from edgetp.model.vnni import _F32, _I32, _I64, _V16F, _V16I32, _at, _decl, _vec, q8_block

NT = 8  # tokens per tile: 4..8 ran alike (270-280 GOPS), 12 fell off on 8192 columns, 16 spilled
LANES = 16  # rows per panel
_OPTS = dict(cache=True, nogil=True)

# kind: (block bytes, offset of the quants in a block, 4-byte groups packed per block)
Q4_0, Q4_1, Q8_0 = 0, 1, 2
_LAYOUT = {Q4_0: (18, 2, 4), Q4_1: (20, 4, 4), Q8_0: (34, 2, 8)}
KINDS = {int(QT.Q4_0): Q4_0, int(QT.Q4_1): Q4_1, int(QT.Q8_0): Q8_0}
WIDE = {Q4_0: False, Q4_1: True, Q8_0: True}  # 16-bit activations


# ---------------------------------------------------------------- the tile


def _splat(builder, value, vty):
    v = builder.insert_element(ir.Constant(vty, None), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, v, _vec(_I32, [0] * LANES))


def _operands(builder, kind, v, g):
    """The multiplicand vectors in one loaded panel vector (group g of a block), each
    with the byte offset of its activation pair/quad in the block's activation row."""
    i32 = _vec(_I32, [0x0F0F0F0F] * LANES)
    if kind == Q4_0:  # bytes: columns 4g.. (low nibbles) and 16+4g.. (high), x int8
        return [(builder.and_(v, i32), 4 * g), (builder.and_(builder.lshr(v, _vec(_I32, [4] * LANES)), i32), 16 + 4 * g)]
    words = ir.VectorType(ir.IntType(16), 2 * LANES)
    if kind == Q8_0:
        # signed bytes b0..b3 of columns 4g..4g+3 -> 16-bit pairs (b0, b2) and (b1, b3)
        w = builder.bitcast(v, words)
        eight = ir.Constant(words, [ir.Constant(ir.IntType(16), 8)] * 2 * LANES)
        even = builder.bitcast(builder.ashr(builder.shl(w, eight), eight), _V16I32)
        odd = builder.bitcast(builder.ashr(w, eight), _V16I32)
        return [(even, 8 * g), (odd, 8 * g + 4)]
    low = _vec(_I32, [0x00FF00FF] * LANES)
    out = []
    for nib, col in ((builder.and_(v, i32), 4 * g), (builder.and_(builder.lshr(v, _vec(_I32, [4] * LANES)), i32), 16 + 4 * g)):
        out.append((builder.and_(nib, low), 2 * col))
        out.append((builder.and_(builder.lshr(nib, _vec(_I32, [8] * LANES)), low), 2 * col + 4))
    return out


def _tile(kind: int, nt: int):
    """An intrinsic: 16 panel rows times nt tokens over all nb blocks, stored to out."""
    groups = _LAYOUT[kind][2]
    seed = {Q4_0: -8, Q8_0: 0, Q4_1: 0}[kind]
    wide = WIDE[kind]

    def codegen(context, builder, signature, args):
        pq, pd, pm, nb, xa, xs, da, sa, ds, oa, ostride, m, ntv = args
        mod = builder.module
        name = "llvm.x86.avx512.vpdpwssd.512" if wide else "llvm.x86.avx512.vpdpbusd.512"
        dot = _decl(mod, name, _V16I32, [_V16I32] * 3)
        fma = _decl(mod, "llvm.fma.v16f32", _V16F, [_V16F] * 3)

        def c(v):
            return ir.Constant(_I64, v)

        def scalar(base, t, b4, ty):
            return builder.load(_at(builder, builder.add(builder.add(base, builder.mul(ds, c(t))), b4), 0, ty), align=4)

        entry = builder.block
        loop = builder.append_basic_block("intgemm.loop")
        done = builder.append_basic_block("intgemm.done")
        builder.branch(loop)
        builder.position_at_end(loop)
        b = builder.phi(_I64)
        acc = [builder.phi(_V16F) for _ in range(nt)]
        b4 = builder.mul(b, c(4))
        sums = [scalar(sa, t, b4, _I32) for t in range(nt)]
        if seed:
            ints = [_splat(builder, builder.mul(s, ir.Constant(_I32, seed)), _V16I32) for s in sums]
        else:
            ints = [ir.Constant(_V16I32, None)] * nt
        qb = builder.add(pq, builder.mul(b, c(64 * groups)))
        xrows = [builder.add(builder.add(xa, builder.mul(xs, c(t))), builder.mul(b, c(64 if wide else 32)))
                 for t in range(nt)]
        for g in range(groups):
            v = builder.load(_at(builder, qb, 64 * g, _V16I32), align=4)
            for w, off in _operands(builder, kind, v, g):
                for t in range(nt):
                    x = _splat(builder, builder.load(_at(builder, xrows[t], off, _I32), align=4), _V16I32)
                    ints[t] = builder.call(dot, [ints[t], w, x])
        d = builder.load(_at(builder, builder.add(pd, builder.mul(b, c(64))), 0, _V16F), align=4)
        if kind == Q4_1:
            mw = builder.load(_at(builder, builder.add(pm, builder.mul(b, c(64))), 0, _V16F), align=4)
        new = []
        for t in range(nt):
            dx = scalar(da, t, b4, _F32)
            a = builder.call(fma, [builder.fmul(builder.sitofp(ints[t], _V16F), _splat(builder, dx, _V16F)), d, acc[t]])
            if kind == Q4_1:
                sx = builder.fmul(dx, builder.sitofp(sums[t], _F32))
                a = builder.call(fma, [_splat(builder, sx, _V16F), mw, a])
            new.append(a)
        b1 = builder.add(b, c(1))
        b.add_incoming(c(0), entry)
        b.add_incoming(b1, builder.block)
        for phi, n in zip(acc, new):
            phi.add_incoming(ir.Constant(_V16F, None), entry)
            phi.add_incoming(n, builder.block)
        builder.cbranch(builder.icmp_signed("<", b1, nb), loop, done)

        builder.position_at_end(done)
        lanes = _vec(_I32, range(LANES))
        valid = builder.icmp_signed("<", lanes, _splat(builder, builder.trunc(m, _I32), _V16I32))
        i8p = ir.IntType(8).as_pointer()
        store = _decl(mod, "llvm.masked.store.v16f32.p0", ir.VoidType(), [_V16F, i8p, _I32, ir.VectorType(ir.IntType(1), LANES)])
        for t in range(nt):
            with builder.if_then(builder.icmp_signed("<", c(t), ntv)):
                p = builder.inttoptr(builder.add(oa, builder.mul(ostride, c(t))), i8p)
                builder.call(store, [new[t], p, ir.Constant(_I32, 4), valid])
        return context.get_dummy_value()

    @intrinsic
    def tile(typingctx, pq, pd, pm, nb, xa, xs, da, sa, ds, oa, ostride, m, ntv):
        """pq/pd/pm: panel addresses; nb blocks; xa/xs: first token's activation row and the
        row stride; da/sa: its dx and sum rows, ds their stride; oa/ostride: out[t0, r0] and
        the row stride (bytes); m valid rows (lanes), ntv valid tokens (<= nt)."""
        return types.void(*([types.int64] * 13)), codegen

    return tile


_TILES = {kind: _tile(kind, NT) for kind in _LAYOUT}
_tile_q4_0, _tile_q4_1, _tile_q8_0 = _TILES[Q4_0], _TILES[Q4_1], _TILES[Q8_0]


@intrinsic
def _load_u32(typingctx, addr):
    """The 4 bytes at an address, unaligned."""

    def codegen(context, builder, signature, args):
        return builder.load(builder.inttoptr(args[0], _I32.as_pointer()), align=1)

    return types.uint32(types.int64), codegen


# ---------------------------------------------------------------- panels


@njit(**_OPTS)
def _pack(w, r0, kind, bsz, qoff, groups, tab, pq, pd, pm):
    """Rows r0..r0+15 of w (the last row repeated past the end) into a panel."""
    rows = w.shape[0]
    nb = w.shape[1] // bsz
    wa, st = w.ctypes.data, w.shape[1]
    for i in range(LANES):
        r = min(r0 + i, rows - 1)
        for b in range(nb):
            o = b * bsz
            pd[b, i] = tab[np.int64(w[r, o]) | (np.int64(w[r, o + 1]) << 8)]
            if kind == Q4_1:
                pm[b, i] = tab[np.int64(w[r, o + 2]) | (np.int64(w[r, o + 3]) << 8)]
            a = wa + r * st + o + qoff
            for g in range(groups):
                pq[b, g, i] = _load_u32(a + 4 * g)


@njit(parallel=True, **_OPTS)
def gemm(w, kind, bsz, qoff, groups, tab, qx, dx, sums, n, out):
    """out (n, rows) = x @ W.T for W in GGUF blocks of `kind` (its _LAYOUT after it),
    x as quantize8/16 left it."""
    rows = w.shape[0]
    nb = w.shape[1] // bsz
    xs, ds, os_ = qx.shape[1] * qx.itemsize, dx.shape[1] * 4, out.shape[1] * 4
    qa, da, sa, oa = qx.ctypes.data, dx.ctypes.data, sums.ctypes.data, out.ctypes.data
    for p in prange((rows + LANES - 1) // LANES):
        pq = np.empty((nb, groups, LANES), np.uint32)
        pd = np.empty((nb, LANES), np.float32)
        pm = np.empty((nb if kind == Q4_1 else 1, LANES), np.float32)
        r0 = p * LANES
        _pack(w, r0, kind, bsz, qoff, groups, tab, pq, pd, pm)
        m = min(LANES, rows - r0)
        a, b, c = pq.ctypes.data, pd.ctypes.data, pm.ctypes.data
        for t in range(0, n, NT):
            args = (a, b, c, nb, qa + t * xs, xs, da + t * ds, sa + t * ds, ds, oa + t * os_ + r0 * 4, os_, m, min(NT, n - t))
            if kind == Q4_0:
                _tile_q4_0(*args)
            elif kind == Q4_1:
                _tile_q4_1(*args)
            else:
                _tile_q8_0(*args)


# ---------------------------------------------------------------- activations


@njit(parallel=True, **_OPTS)
def quantize8(x, qx, dx, sums):
    """x (n, nb*32) f32 -> qx (n, nb*32) int8, dx (n, nb) f32 scales, sums (n, nb) int32."""
    n, nb = x.shape[0], x.shape[1] // 32
    for t in prange(n):
        f = np.empty(1, np.float32)
        u = f.view(np.uint32)
        for b in range(nb):
            d, s = q8_block(x[t, b * 32 : b * 32 + 32], qx[t, b * 32 : b * 32 + 32], f, u)
            dx[t, b] = d
            sums[t, b] = s


@njit(parallel=True, **_OPTS)
def quantize16(x, qx, dx, sums):
    """x (n, nb*32) f32 -> qx (n, nb*32) int16, dx (n, nb) f32, sums (n, nb) int32.

    Per block of 32: d = max|x| / 32767 (f32), q = round-half-even(x * 32767/max|x|).
    Within each 4 columns the values are stored as (0, 2, 1, 3): the 16-bit pairs
    the Q4_1/Q8_0 panels multiply by.
    """
    n, nb = x.shape[0], x.shape[1] // 32
    for t in prange(n):
        for b in range(nb):
            amax = np.float32(0.0)
            for j in range(32):
                amax = max(amax, abs(x[t, b * 32 + j]))
            inv = np.float32(32767.0) / amax if amax != 0 else np.float32(0.0)
            s = 0
            for j in range(32):
                v = np.int16(np.rint(x[t, b * 32 + j] * inv))
                qx[t, b * 32 + (j & ~3) + ((j & 1) << 1) + ((j >> 1) & 1)] = v
                s += v
            dx[t, b] = amax / np.float32(32767.0)
            sums[t, b] = s


def quantized(x: np.ndarray, wide: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(qx, dx, sums) of x (n, cols) for quantize16 (wide) or quantize8, rows padded with
    zeros to a multiple of NT tokens."""
    n, cols = x.shape
    npad = -(-n // NT) * NT
    qx = np.zeros((npad, cols), np.int16 if wide else np.int8)
    dx = np.zeros((npad, cols // 32), np.float32)
    sums = np.zeros((npad, cols // 32), np.int32)
    (quantize16 if wide else quantize8)(x, qx, dx, sums)
    return qx, dx, sums


def matmul(qtype: int, data: np.ndarray, tab: np.ndarray, xq: tuple[np.ndarray, np.ndarray, np.ndarray],
           out: np.ndarray) -> None:
    """out (n, rows) = x @ W.T; xq = quantized(x, wide(qtype)), W's raw (rows, row_bytes) blocks."""
    qx, dx, sums = xq
    kind = KINDS[qtype]
    gemm(data, kind, *_LAYOUT[kind], tab, qx, dx, sums, out.shape[0], out)


def wide(qtype: int) -> bool:
    """True if qtype's products take 16-bit activations (Q4_1, Q8_0), False for int8 (Q4_0)."""
    return WIDE[KINDS[qtype]]


# ---------------------------------------------------------------- availability


def _probe(tab: np.ndarray) -> bool:
    """Every kind on an odd shape (rows and tokens past a whole tile) against a plain
    integer evaluation of the same arithmetic."""
    rng = np.random.default_rng(11)
    rows, nb, n = 19, 3, NT + 3
    x = rng.standard_normal((n, nb * 32)).astype(np.float32)
    for qtype, kind in KINDS.items():
        xq = quantized(x, WIDE[kind])
        q = xq[0][:n].reshape(n, nb, 8, 4)
        q = (q[..., [0, 2, 1, 3]] if WIDE[kind] else q).reshape(n, nb, 32).astype(np.int64)
        dx = xq[1][:n].astype(np.float64)
        bsz, qoff, _ = _LAYOUT[kind]
        w = rng.integers(0, 256, (rows, nb * bsz), dtype=np.uint8)
        blocks = w.reshape(rows, nb, bsz)
        blocks[:, :, :qoff] = np.full((rows, nb, qoff // 2), 0.25, np.float16).view(np.uint8)
        raw = blocks[:, :, qoff:]
        if kind == Q8_0:
            vals = raw.view(np.int8).astype(np.int64)
        else:
            vals = np.concatenate([raw & 15, raw >> 4], axis=2).astype(np.int64) - (8 if kind == Q4_0 else 0)
        want = np.einsum("rbj,tbj,tb->tr", vals, q, dx) * 0.25
        if kind == Q4_1:
            want += np.einsum("tbj,tb->t", q, dx)[:, None] * 0.25
        got = np.full((n, rows), np.nan, np.float32)
        matmul(qtype, w, tab, xq, got)
        if not np.allclose(got, want, rtol=1e-5, atol=1e-4):
            return False
    return True


@functools.cache
def _probed() -> bool:
    return vnni.checked(lambda: _probe(f16_table()), "integer prefill kernels")


def available() -> bool:
    """True when the VNNI prefill kernels run here: vnni.wanted() and a passing probe."""
    return vnni.wanted() and _probed()
