"""Prefill products on every ISA: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K and Q6_K weights times integer
activations (the types of llama.cpp's Q4_0, Q4_1, Q8_0 and Q4_K_M files; the others prefill
on sgemm, quant.py).

Decode reads every weight once per token, so it is bound by memory (`intdot.py`,
`kernels.py`). Prefill reuses each weight for every token of the batch, so it
is bound by arithmetic. On AVX-512 VNNI, f32 sgemm peaks near 116 GFLOP/s on one
core, and VNNI tiles with 16 columns per register reached only 63-80 GOPS: every
block cost an unpack, a conversion and two scale products per row and token.

Here the lanes of a register are rows, not columns. A panel of rows (16 on
avx512vnni, 8 elsewhere: `Shape`) is packed once per batch:
  q: per block of 32 values, 4 (Q4_0/Q4_1/Q4_K: nibbles) or 8 (Q8_0: bytes; Q5_0, Q6_K:
     unsigned 5- and 6-bit codes in bytes) vectors; vector g holds the g-th 4 bytes of the
     block for each row of the panel;
  d: per block, the rows' scales (f32); Q4_1 and Q4_K also m, their offsets.
     Q6_K has a scale per 16 values: two per block, each half of the block a unit of its own.
     A K-quant's 32 values are a Q4_1 (Q4_K) or 2 x 16 biased (Q6_K) block whose scale is
     d * sc, exact in f32 as the dequantizer forms it (`_pack`).
One dot product then multiplies 4 (int8) or 2 (int16) columns of every row by
the same activations, broadcast from memory. A block of 32 columns goes into one
integer accumulator per token; only then is it converted and scaled, once per
block for all rows: sum = fma(float(acc) * dx[t, b], d[b], sum).

The tile is written once (`_emit_tile`); an ISA only says how its lanes multiply
(`_Mac` and its subclasses, `ISA_TILES`):
  avx512vnni  vpdpbusd / vpdpwssd, 512 bits
  avxvnni     the same, VEX-encoded, 256 bits
  avx2        int8: vpmaddubsw, a block's outputs summed in i16 (bound in _Avx2),
              then one vpmaddwd by 1; int16: vpmaddwd, vpaddd
  neon        int8: sdot on 128-bit halves; int16: as generic
  generic     plain LLVM vectors (sign-extend, multiply, add pairs)
The integer sums are exact and the float steps are the same per lane in the same
order, so every ISA returns the same bits (tests/test_intgemm_isa.py holds each
to a numpy evaluation of the definition).

Activations are rounded per block of 32 columns:
  Q4_0, Q5_0, Q4_K, Q6_K  to int8 exactly as `vnni.q8_block` does (ggml's x86
        quantize_row_q8_0), as decode rounds them. Unsigned codes u = q + bias (0..15,
        0..31, 0..63) times x; the accumulator of a unit starts at -bias * sum(x) over it.
        On AVX2 the products go through 16 bits: OPERANDS bounds how many are summed
        there before vpmaddwd widens them (fewer for wider codes).
  Q4_1, Q8_0  to int16 (scale max|x| / 32767, f32), products of 16-bit weight
        pairs unpacked from the panel in registers; Q4_1's offset adds
        m[b] * dx * sum(x). Int8 activations flip SmolLM2's first answer
        token (a 0.08-logit tie: "L'Etoile..." instead of "The capital of
        France is Paris"), as they do in llama.cpp; 16 bits keep the logits
        within 3e-4 of their spread of the exact math, and these types'
        decode is exact f32.

AVX-512 VNNI, one core, 256 tokens, 2048- and 8192-column shapes: ~270 GOPS
(int8) and ~155 GOPS (int16), against ~80 for f32 sgemm on decoded tiles.
Packing the panels is ~1% of that.

AVX2 (AMD EPYC Zen 3 VM, avx2/fma/f16c, one core of a busy 2-core machine,
tools/bench_intgemm.py, 2048x2048 and 8192x2048, 256 tokens): tiles of one
8-row vector by 4 tokens keep everything in the 16 ymm registers (only the
0x0F mask constant is read from the stack) and ran Q4_0 ~125-138 GOPS, Q8_0
~85-98, Q4_1 ~75-88, against 65-78 for f32 sgemm. 6 and 8 tokens, and two
vectors (16 rows) by 2 or 3 tokens (tried with a vector count in Shape, since
dropped), ran the same or slower; 2 x 3 spills.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import gguf.quants
import numpy as np
from gguf import GGMLQuantizationType as QT
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from edgetp.model import isa, vnni
from edgetp.model.kernels import _q4k_scale_min, f16_table
from edgetp.model.vnni import _F32, _I32, _I64, _at, _decl, _vec, q8_block

PAD = 8  # x is padded to a multiple of PAD tokens: whole tiles on every ISA
_OPTS = dict(cache=True, nogil=True)

# kind: (GGUF block bytes, offset of the quants in it, 4-byte groups packed per 32 values,
# 32-value blocks per GGUF block)
Q4_0, Q4_1, Q8_0, Q4_K, Q5_0, Q6_K = range(6)
_LAYOUT = {Q4_0: (18, 2, 4, 1), Q4_1: (20, 4, 4, 1), Q8_0: (34, 2, 8, 1), Q4_K: (144, 16, 4, 8),
           Q5_0: (22, 6, 8, 1), Q6_K: (210, 0, 8, 8)}
KINDS = {int(QT.Q4_0): Q4_0, int(QT.Q4_1): Q4_1, int(QT.Q8_0): Q8_0, int(QT.Q4_K): Q4_K,
         int(QT.Q5_0): Q5_0, int(QT.Q6_K): Q6_K}
WIDE = {Q4_0: False, Q4_1: True, Q8_0: True, Q4_K: False, Q5_0: False, Q6_K: False}  # 16-bit activations
OFFSET = (Q4_1, Q4_K)  # kinds whose values are d * q + m: the panel carries m
# int8 kinds: the unsigned code u of a value is q + BIAS (the accumulator starts at -BIAS * sum(x));
# OPERANDS packed vectors (4 values per row each) are summed in 16 bits before vpmaddwd widens
# them: a vpmaddubsw pair is at most 2 * umax * 128, so OPERANDS * 2 * umax * 128 < 32768 for
# umax 15 (8 operands: 30720), 31 (4: 31744) and 63 (2: 32256)
BIAS = {Q4_0: 8, Q4_K: 0, Q5_0: 16, Q6_K: 32}
OPERANDS = {Q4_0: 8, Q4_K: 8, Q5_0: 4, Q6_K: 2}
UNITS = {Q6_K: 2}  # scales per 32 values (Q6_K: one per 16), else 1
# where a block keeps its f16 scales (and offsets or dmin)
HALVES = {Q4_0: (0,), Q4_1: (0, 2), Q8_0: (0,), Q4_K: (0, 2), Q5_0: (0,), Q6_K: (208,)}

_I8, _I16 = ir.IntType(8), ir.IntType(16)


# ---------------------------------------------------------------- how each ISA multiplies lanes


@dataclass(frozen=True)
class Shape:
    """How one ISA tiles a panel: `rows` per panel (the i32 lanes of one vector), `nt`
    tokens per tile."""

    rows: int
    nt: int


def _vty(lanes, ty=_I32, per=1):
    return ir.VectorType(ty, lanes * per)


class _Mac:
    """An ISA's integer products of one block: begin(seed) -> acc; mac(acc, w, x) per
    operand; end(acc, seed) -> <lanes x i32>, each lane the exact sum over the block of
    one row's products plus seed. w and x are <lanes x i32>: 4 bytes (int8: unsigned
    nibbles times signed activations) or 2 words (wide: signed times signed) per lane."""

    def __init__(self, b, lanes: int, wide: bool):
        self.b, self.lanes, self.wide = b, lanes, wide

    def begin(self, seed):
        return seed

    def end(self, acc, seed):
        return acc


class _Vnni(_Mac):
    """vpdpbusd / vpdpwssd: four u8 x s8 (two s16 x s16) products added into each i32 lane;
    512 bits wide on avx512vnni, 256 (VEX) on avxvnni."""

    def mac(self, acc, w, x):
        v = _vty(self.lanes)
        name = f"llvm.x86.avx512.vpdp{'wssd' if self.wide else 'busd'}.{32 * self.lanes}"
        return self.b.call(_decl(self.b.module, name, v, [v] * 3), [acc, w, x])


class _Avx2(_Mac):
    """int8: vpmaddubsw (u8 x s8, adjacent pairs added in i16), the block's pairs summed in
    i16 (vpaddw), then one vpmaddwd by 1 per block. Exact: a pair is at most 2 * 15 * 128 =
    3840 (nibbles 0..15, int8 activations, so vpmaddubsw never saturates), and a block adds
    8 operands (Q4_0: 4 groups x low/high nibbles), 16 products per i16 lane: at most
    16 * 15 * 128 = 30720 < 32767, so the wrapping vpaddw never wraps.
    wide: vpmaddwd (s16 x s16, pairs added in i32) then vpaddd, as vpdpwssd does in one."""

    def _madd(self, a, b16):
        b = self.b
        v16 = _vty(self.lanes, _I16, 2)
        fn = _decl(b.module, "llvm.x86.avx2.pmadd.wd", _vty(self.lanes), [v16] * 2)
        return b.call(fn, [b.bitcast(a, v16), b.bitcast(b16, v16)])

    def begin(self, seed):
        return seed if self.wide else ir.Constant(_vty(self.lanes, _I16, 2), None)

    def mac(self, acc, w, x):
        b = self.b
        if self.wide:
            return b.add(acc, self._madd(w, x))
        v8, v16 = _vty(self.lanes, _I8, 4), _vty(self.lanes, _I16, 2)
        fn = _decl(b.module, "llvm.x86.avx2.pmadd.ub.sw", v16, [v8] * 2)
        return b.add(acc, b.call(fn, [b.bitcast(w, v8), b.bitcast(x, v8)]))

    def end(self, acc, seed):
        if self.wide:
            return acc
        return self.b.add(self._madd(acc, _vec(_I16, [1] * 2 * self.lanes)), seed)


class _Generic(_Mac):
    """Plain LLVM vectors, for any CPU: int8 as _Avx2 does it (products and pairs in i16,
    summed over the block in i16 under the same bound, then pairs in i32); wide products
    in i32, even plus odd (the shape LLVM turns into pmaddwd on x86)."""

    def _pairs(self, v):
        b, n = self.b, v.type.count
        even, odd = _vec(_I32, range(0, n, 2)), _vec(_I32, range(1, n, 2))
        return b.add(b.shuffle_vector(v, v, even), b.shuffle_vector(v, v, odd))

    def begin(self, seed):
        return seed if self.wide else ir.Constant(_vty(self.lanes, _I16, 2), None)

    def mac(self, acc, w, x):
        b = self.b
        if self.wide:
            v16, v32 = _vty(self.lanes, _I16, 2), _vty(self.lanes, _I32, 2)
            p = b.mul(b.sext(b.bitcast(w, v16), v32), b.sext(b.bitcast(x, v16), v32))
            return b.add(acc, self._pairs(p))
        v8, v16 = _vty(self.lanes, _I8, 4), _vty(self.lanes, _I16, 4)
        p = b.mul(b.zext(b.bitcast(w, v8), v16), b.sext(b.bitcast(x, v8), v16))
        return b.add(acc, self._pairs(p))

    def end(self, acc, seed):
        if self.wide:
            return acc
        return self.b.add(self._pairs(self.b.sext(acc, _vty(self.lanes, _I32, 2))), seed)


class _Neon(_Generic):
    """int8: sdot (four s8 x s8 products into each i32 lane; nibbles 0..15 are valid s8),
    on 128-bit halves; wide as _Generic."""

    def begin(self, seed):
        return seed

    def mac(self, acc, w, x):
        if self.wide:
            return _Generic.mac(self, acc, w, x)
        b = self.b
        v4, v16 = _vty(4), _vty(4, _I8, 4)
        fn = _decl(b.module, "llvm.aarch64.neon.sdot.v4i32.v16i8", v4, [v4, v16, v16])
        parts = []
        for h in range(self.lanes // 4):
            sel = _vec(_I32, range(4 * h, 4 * h + 4))
            parts.append(b.call(fn, [b.shuffle_vector(acc, acc, sel), b.bitcast(b.shuffle_vector(w, w, sel), v16),
                                     b.bitcast(b.shuffle_vector(x, x, sel), v16)]))
        while len(parts) > 1:
            parts = [b.shuffle_vector(parts[i], parts[i + 1], _vec(_I32, range(2 * parts[i].type.count)))
                     for i in range(0, len(parts), 2)]
        return parts[0]

    def end(self, acc, seed):
        return acc


# isa -> (its products, its tile shape)
ISA_TILES = {
    "avx512vnni": (_Vnni, Shape(16, 8)),  # 4..8 tokens ran alike (270-280 GOPS), 12 fell off, 16 spilled
    "avxvnni": (_Vnni, Shape(8, 4)),  # as avx2 (not measured: no such CPU here)
    "avx2": (_Avx2, Shape(8, 4)),  # see the module docstring
    "neon": (_Neon, Shape(8, 4)),
    "generic": (_Generic, Shape(8, 4)),
}
assert all(PAD % s.nt == 0 for _, s in ISA_TILES.values())


# ---------------------------------------------------------------- the tile


def _splat(builder, value, vty):
    v = builder.insert_element(ir.Constant(vty, None), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, v, _vec(_I32, [0] * vty.count))


def _operands(builder, kind, v, g, lanes):
    """The multiplicand vectors in one loaded panel vector (group g of a block), each
    with the byte offset of its activation pair/quad in the block's activation row."""
    if kind in (Q5_0, Q6_K):  # bytes: columns 4g.., codes 0..31 or 0..63, x int8
        return [(v, 4 * g)]
    i32 = _vec(_I32, [0x0F0F0F0F] * lanes)
    if kind in (Q4_0, Q4_K):  # bytes: columns 4g.. (low nibbles) and 16+4g.. (high), x int8
        return [(builder.and_(v, i32), 4 * g), (builder.and_(builder.lshr(v, _vec(_I32, [4] * lanes)), i32), 16 + 4 * g)]
    words = ir.VectorType(_I16, 2 * lanes)
    if kind == Q8_0:
        # signed bytes b0..b3 of columns 4g..4g+3 -> 16-bit pairs (b0, b2) and (b1, b3)
        w = builder.bitcast(v, words)
        eight = ir.Constant(words, [ir.Constant(_I16, 8)] * 2 * lanes)
        even = builder.bitcast(builder.ashr(builder.shl(w, eight), eight), v.type)
        odd = builder.bitcast(builder.ashr(w, eight), v.type)
        return [(even, 8 * g), (odd, 8 * g + 4)]
    low = _vec(_I32, [0x00FF00FF] * lanes)
    out = []
    for nib, col in ((builder.and_(v, i32), 4 * g), (builder.and_(builder.lshr(v, _vec(_I32, [4] * lanes)), i32), 16 + 4 * g)):
        out.append((builder.and_(nib, low), 2 * col))
        out.append((builder.and_(builder.lshr(nib, _vec(_I32, [8] * lanes)), low), 2 * col + 4))
    return out


def _emit_tile(builder, kind: int, which: str, args) -> None:
    """One panel (shape.rows rows, one vector) times shape.nt tokens over all nb blocks,
    stored to out, with ISA `which`'s products. The float steps, per block, row and token,
    are the same on every ISA: sum = fma(float(acc) * dx[t, b], d[b], sum) per unit (Q6_K: two
    a block, each with its own acc and d), Q4_1 and Q4_K then
    sum = fma(dx[t, b] * float(sums[t, b]), m[b], sum); so every ISA gives the same bits."""
    groups = _LAYOUT[kind][2]
    wide = WIDE[kind]
    bias, units = BIAS.get(kind, 0), UNITS.get(kind, 1)
    per = groups // units  # packed vectors per unit
    ops, shape = ISA_TILES[which]
    L, nt = shape.rows, shape.nt
    vi, vf = _vty(L), _vty(L, _F32)
    mac = ops(builder, L, wide)
    pq, pd, pm, nb, xa, xs, da, sa, s16, ds, oa, ostride, m, ntv = args
    mod = builder.module
    fma = _decl(mod, f"llvm.fma.v{L}f32", vf, [vf] * 3)

    def c(v):
        return ir.Constant(_I64, v)

    def scalar(base, t, b4, ty, stride=ds):
        return builder.load(_at(builder, builder.add(builder.add(base, builder.mul(stride, c(t))), b4), 0, ty), align=4)

    entry = builder.block
    loop = builder.append_basic_block("intgemm.loop")
    done = builder.append_basic_block("intgemm.done")
    builder.branch(loop)
    builder.position_at_end(loop)
    b = builder.phi(_I64)
    acc = [builder.phi(vf) for _ in range(nt)]
    b4 = builder.mul(b, c(4))
    sums = [scalar(sa, t, b4, _I32) for t in range(nt)]
    qb = builder.add(pq, builder.mul(b, c(4 * L * groups)))
    xrows = [builder.add(builder.add(xa, builder.mul(xs, c(t))), builder.mul(b, c(64 if wide else 32)))
             for t in range(nt)]
    dxs = [scalar(da, t, b4, _F32) for t in range(nt)]
    new = acc
    for u in range(units):
        if units > 1:  # the unit's own sums of x (sums16[t, 2b + u])
            su = [scalar(s16, t, builder.add(builder.mul(b, c(8)), c(4 * u)), _I32, builder.mul(ds, c(2)))
                  for t in range(nt)]
        else:
            su = sums
        if bias:
            totals = [_splat(builder, builder.mul(x, ir.Constant(_I32, -bias)), vi) for x in su]
        else:
            totals = [ir.Constant(vi, None)] * nt
        operands = []
        for g in range(u * per, (u + 1) * per):
            v = builder.load(_at(builder, qb, 4 * L * g, vi), align=4)
            operands += _operands(builder, kind, v, g, L)
        step = len(operands) if wide else OPERANDS[kind]
        for k in range(0, len(operands), step):  # partial sums chained through each ISA's begin/end
            ints = [mac.begin(tot) for tot in totals]
            for w, off in operands[k : k + step]:
                for t in range(nt):
                    x = _splat(builder, builder.load(_at(builder, xrows[t], off, _I32), align=4), vi)
                    ints[t] = mac.mac(ints[t], w, x)
            totals = [mac.end(i, tot) for i, tot in zip(ints, totals)]
        d = builder.load(_at(builder, builder.add(pd, builder.mul(b, c(4 * L * units))), 4 * L * u, vf), align=4)
        new = [builder.call(fma, [builder.fmul(builder.sitofp(totals[t], vf), _splat(builder, dxs[t], vf)), d, new[t]])
               for t in range(nt)]
    if kind in OFFSET:
        mw = builder.load(_at(builder, builder.add(pm, builder.mul(b, c(4 * L))), 0, vf), align=4)
        for t in range(nt):
            sx = builder.fmul(dxs[t], builder.sitofp(sums[t], _F32))
            new[t] = builder.call(fma, [_splat(builder, sx, vf), mw, new[t]])
    b1 = builder.add(b, c(1))
    b.add_incoming(c(0), entry)
    b.add_incoming(b1, builder.block)
    for phi, n in zip(acc, new):
        phi.add_incoming(ir.Constant(vf, None), entry)
        phi.add_incoming(n, builder.block)
    builder.cbranch(builder.icmp_signed("<", b1, nb), loop, done)

    builder.position_at_end(done)
    valid = builder.icmp_signed("<", _vec(_I32, range(L)), _splat(builder, builder.trunc(m, _I32), vi))
    i8p = _I8.as_pointer()
    store = _decl(mod, f"llvm.masked.store.v{L}f32.p0", ir.VoidType(), [vf, i8p, _I32, ir.VectorType(ir.IntType(1), L)])
    for t in range(nt):
        with builder.if_then(builder.icmp_signed("<", c(t), ntv)):
            p = builder.inttoptr(builder.add(oa, builder.mul(ostride, c(t))), i8p)
            builder.call(store, [new[t], p, ir.Constant(_I32, 4), valid])


@intrinsic
def _tile(typingctx, kind, which, pq, pd, pm, nb, xa, xs, da, sa, s16, ds, oa, ostride, m, ntv):
    """kind: a literal kind; which: a literal ISA name. pq/pd/pm: panel addresses; nb blocks;
    xa/xs: first token's activation row and the row stride; da/sa/s16: its dx, sum and
    sum-per-16 rows, ds the stride of the first two (s16's is twice it); oa/ostride:
    out[t0, r0] and the row stride (bytes); m valid rows, ntv valid tokens (<= the shape's nt)."""
    if not isinstance(kind, types.IntegerLiteral) or not isinstance(which, types.StringLiteral):
        return None
    k, name = kind.literal_value, which.literal_value

    def codegen(context, builder, signature, args):
        _emit_tile(builder, k, name, args[2:])
        return context.get_dummy_value()

    return types.void(kind, which, *([types.int64] * 14)), codegen


@intrinsic
def _load_u32(typingctx, addr):
    """The 4 bytes at an address, unaligned."""

    def codegen(context, builder, signature, args):
        return builder.load(builder.inttoptr(args[0], _I32.as_pointer()), align=1)

    return types.uint32(types.int64), codegen


# ---------------------------------------------------------------- panels


@njit(inline="always", **_OPTS)
def _f16(w, r, o, tab):
    return tab[np.int64(w[r, o]) | (np.int64(w[r, o + 1]) << 8)]


@njit(**_OPTS)
def _pack(w, r0, kind, bsz, qoff, groups, tab, pq, pd, pm):
    """Rows r0..r0+P-1 of w (P = pq.shape[2]; the last row repeated past the end) into a panel.

    Q4_K: sub-block j (32 values) of a 256-value block is the Q4_1 block with
    d = d * sc_j and m = -(dmin * mn_j), as the dequantizer computes them (both exact in f32);
    its nibbles, the low or high halves of 32 bytes, are repacked as Q4_0/Q4_1 hold them
    (byte k: value k in the low nibble, value 16 + k in the high one).
    Q5_0: byte k of a block is value k's nibble with its fifth bit (bit k of qh) as bit 4.
    Q6_K: byte k of sub-block j is value k's 6-bit code (its ql nibble | its 2 qh bits << 4),
    the two halves' scales d * sc (sc int8) side by side in pd."""
    rows = w.shape[0]
    nblk = w.shape[1] // bsz
    wa, st = w.ctypes.data, w.shape[1]
    for i in range(pq.shape[2]):
        r = min(r0 + i, rows - 1)
        for k in range(nblk):
            o = k * bsz
            if kind == Q4_K:
                d, dmin = _f16(w, r, o, tab), _f16(w, r, o + 2, tab)
                for j in range(8):
                    sc, mn = _q4k_scale_min(w, r, o, j)
                    b = 8 * k + j
                    pd[b, i] = d * sc
                    pm[b, i] = -(dmin * mn)
                    a, s = wa + r * st + o + qoff + 32 * (j // 2), 4 * (j % 2)
                    for g in range(4):
                        lo = (_load_u32(a + 4 * g) >> s) & 0x0F0F0F0F
                        hi = (_load_u32(a + 16 + 4 * g) >> s) & 0x0F0F0F0F
                        pq[b, g, i] = lo | (hi << 4)
                continue
            if kind == Q6_K:
                d = _f16(w, r, o + 208, tab)
                for j in range(8):
                    b = 8 * k + j
                    for u in range(2):
                        pd[2 * b + u, i] = d * np.float32(np.int8(w[r, o + 192 + 2 * j + u]))
                    ql, s1 = wa + r * st + o + 64 * (j // 4) + 32 * (j % 2), 4 * (j % 4 // 2)
                    qh, s2 = wa + r * st + o + 128 + 32 * (j // 4), 2 * (j % 4)
                    for g in range(8):
                        lo = (_load_u32(ql + 4 * g) >> s1) & 0x0F0F0F0F
                        hi = (_load_u32(qh + 4 * g) >> s2) & 0x03030303
                        pq[b, g, i] = lo | (hi << 4)
                continue
            pd[k, i] = _f16(w, r, o, tab)
            if kind == Q5_0:
                qh, a = _load_u32(wa + r * st + o + 2), wa + r * st + o + qoff
                for g in range(8):
                    nib = (_load_u32(a + 4 * (g % 4)) >> (4 * (g // 4))) & 0x0F0F0F0F
                    h = (qh >> (4 * g)) & 15
                    pq[k, g, i] = nib | ((h & 1) << 4) | ((h & 2) << 11) | ((h & 4) << 18) | ((h & 8) << 25)
                continue
            if kind == Q4_1:
                pm[k, i] = _f16(w, r, o + 2, tab)
            a = wa + r * st + o + qoff
            for g in range(groups):
                pq[k, g, i] = _load_u32(a + 4 * g)


@functools.cache
def _gemm(kind: int, which: str):
    """The prefill kernel of one kind on one ISA (both constants inside it, and so in
    numba's cache key: two ISAs compiled for one NUMBA_CPU_NAME stay apart)."""
    shape = ISA_TILES[which][1]
    P, NTI = shape.rows, shape.nt
    UNITS_ = UNITS.get(kind, 1)

    @njit(parallel=True, **_OPTS)
    def gemm(w, bsz, qoff, groups, sub, tab, qx, dx, sums, sums16, n, out):
        # out (n, rows) = x @ W.T for W in GGUF blocks of `kind` (its _LAYOUT after w),
        # x as quantize8/16 left it
        rows = w.shape[0]
        nb = w.shape[1] // bsz * sub
        xs, ds, os_ = qx.shape[1] * qx.itemsize, dx.shape[1] * 4, out.shape[1] * 4
        qa, da, sa, oa = qx.ctypes.data, dx.ctypes.data, sums.ctypes.data, out.ctypes.data
        s16 = sums16.ctypes.data
        for p in prange((rows + P - 1) // P):
            pq = np.empty((nb, groups, P), np.uint32)
            pd = np.empty((nb * UNITS_, P), np.float32)
            pm = np.empty((nb if kind == Q4_1 or kind == Q4_K else 1, P), np.float32)
            r0 = p * P
            _pack(w, r0, kind, bsz, qoff, groups, tab, pq, pd, pm)
            m = min(P, rows - r0)
            a, b, c = pq.ctypes.data, pd.ctypes.data, pm.ctypes.data
            for t in range(0, n, NTI):
                _tile(kind, which, a, b, c, nb, qa + t * xs, xs, da + t * ds, sa + t * ds, s16 + 2 * t * ds, ds,
                      oa + t * os_ + r0 * 4, os_, m, min(NTI, n - t))

    return gemm


# ---------------------------------------------------------------- activations


@njit(parallel=True, **_OPTS)
def quantize8(x, qx, dx, sums, sums16):
    """x (n, nb*32) f32 -> qx (n, nb*32) int8, dx (n, nb) f32 scales, sums (n, nb) and
    sums16 (n, 2 nb) int32: the sums of qx per 32 and per 16."""
    n, nb = x.shape[0], x.shape[1] // 32
    for t in prange(n):
        f = np.empty(1, np.float32)
        u = f.view(np.uint32)
        for b in range(nb):
            d, s = q8_block(x[t, b * 32 : b * 32 + 32], qx[t, b * 32 : b * 32 + 32], f, u)
            dx[t, b] = d
            sums[t, b] = s
            s0 = 0
            for j in range(16):
                s0 += qx[t, b * 32 + j]
            sums16[t, 2 * b] = s0
            sums16[t, 2 * b + 1] = s - s0


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


def quantized(x: np.ndarray, wide: bool) -> tuple[np.ndarray, ...]:
    """(qx, dx, sums, sums16) of x (n, cols) for quantize16 (wide; sums16 left 0, unused) or
    quantize8, rows padded with zeros to a multiple of PAD tokens (whole tiles on every ISA)."""
    n, cols = x.shape
    npad = -(-n // PAD) * PAD
    qx = np.zeros((npad, cols), np.int16 if wide else np.int8)
    dx = np.zeros((npad, cols // 32), np.float32)
    sums = np.zeros((npad, cols // 32), np.int32)
    sums16 = np.zeros((npad, cols // 16), np.int32)
    if wide:
        quantize16(x, qx, dx, sums)
    else:
        quantize8(x, qx, dx, sums, sums16)
    return qx, dx, sums, sums16


def matmul(qtype: int, data: np.ndarray, tab: np.ndarray, xq: tuple[np.ndarray, ...], out: np.ndarray) -> None:
    """out (n, rows) = x @ W.T; xq = quantized(x, wide(qtype)), W's raw (rows, row_bytes) blocks."""
    kind = KINDS[qtype]
    _gemm(kind, isa.current())(data, *_LAYOUT[kind], tab, *xq, out.shape[0], out)


def wide(qtype: int) -> bool:
    """True if qtype's products take 16-bit activations (Q4_1, Q8_0), False for int8 (the others)."""
    return WIDE[KINDS[qtype]]


# ---------------------------------------------------------------- availability


def _probe(tab: np.ndarray) -> bool:
    """Every kind on an odd shape (rows and tokens past a whole tile) against gguf-py's
    dequantized weights times the rounded activations, in float64."""
    rng = np.random.default_rng(11)
    rows, cols, n = 19, 512, PAD + 3
    x = rng.standard_normal((n, cols)).astype(np.float32)
    for qtype, kind in KINDS.items():
        xq = quantized(x, WIDE[kind])
        q = xq[0][:n].reshape(n, cols // 32, 8, 4)
        q = (q[..., [0, 2, 1, 3]] if WIDE[kind] else q).reshape(n, cols // 32, 32)
        xr = (q * xq[1][:n, :, None].astype(np.float64)).reshape(n, cols)
        bsz, qoff, _, sub = _LAYOUT[kind]
        w = rng.integers(0, 256, (rows, cols // (32 * sub), bsz), dtype=np.uint8)
        for at in HALVES[kind]:  # finite scales
            w[:, :, at : at + 2] = np.full((rows, w.shape[1], 1), 0.25, np.float16).view(np.uint8)
        w = w.reshape(rows, -1)
        wr = gguf.quants.dequantize(w, QT(qtype)).reshape(rows, cols).astype(np.float64)
        got = np.full((n, rows), np.nan, np.float32)
        matmul(qtype, w, tab, xq, got)
        if not np.all(np.abs(got - xr @ wr.T) <= 1e-5 * (np.abs(xr) @ np.abs(wr).T)):
            return False
    return True


@functools.cache
def _probed(which: str) -> bool:
    return vnni.checked(lambda: _probe(f16_table()), f"integer prefill kernels ({which})")


def available() -> bool:
    """True when the prefill kernels run here: vnni.wanted() (EDGETP_INT8 is not 0, the
    ISA in use is known) and a passing probe of this ISA's tiles."""
    return vnni.wanted() and _probed(isa.current())
