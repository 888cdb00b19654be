"""Integer decode kernels (out = W @ x for one token) for every quantized type, on every ISA.

The activations are rounded once per token to int8 in blocks of 32, exactly as
ggml's x86 quantize_row_q8_0 does (`vnni.q8_block`): xq (cols,) int8, dx
(cols/32,) f32, and integer sums of xq per 4 values (s4) and per 16 (s16).
Each weight type is a row of `intdot_layouts.LAYOUTS`: how the integer code of a
value is formed and what f32 scale ws (and offset wm) each 16 values have.

Canonical arithmetic (the same bits on every ISA; `reference()` is it in numpy):
  - a chunk of 32 values has 8 integer lanes; lane l = sum over its 4 values
    4l..4l+3 of code * xq, exact int32 (lanes 0-3 are the chunk's first 16
    values, 4-7 the last 16);
  - per row, 8 f32 accumulators, all zero at first; for each chunk in order:
        acc[l] = acc[l] + (ws * dx) * f32(lane l)      (ws of the lane's 16 values)
    each operation rounded to f32 separately: no FMA, no reassociation;
  - for types with an offset (Q4_1, Q5_1, Q4_K, Q5_K, Q2_K) one more f32
    accumulator m, zero at first; for each sub-block in order (32 values, or 16
    for Q2_K): m = m + (wm * dx) * f32(S), S the integer sum of xq over it;
  - out = ((acc[0] + acc[1]) + acc[2]) + ... + acc[7], then + m.
This is llama.cpp's ggml_vec_dot_q4_0_q8_0 on AVX2 (a per-lane f32 accumulator,
integer dot within a block) without its FMA, and a K-quant's sub-block scale
is a float (d*sc, as the dequantizer rounds it) rather than folded into an
integer sum: x is rounded per 32, so its scale changes every 32 values anyway.
Any ISA may form a lane in any way because it is an exact integer.

How an ISA forms the lanes (`_dot`), from unsigned codes u (code = u - bias,
the bias removed afterwards as bias * s4) or signed codes (Q8_0, IQ4):
  avx2        vpmaddubsw (u8 x s8 -> pairs in i16) then vpmaddwd by 1 (-> fours in i32);
              signed codes as |code| x sign(xq, code) (vpabsb, vpsignb), as llama.cpp does
  avxvnni,
  avx512vnni  vpdpbusd (u8 x s8, four products per i32 lane), 256 bits wide
  neon        sdot (s8 x s8, four products per i32 lane), two 128-bit halves
  generic     sign-extend to i32, multiply, add each four (plain LLVM vectors)
IQ4's table lookup is the ISA's byte shuffle (vpshufb, tbl; generic: selects).

The kernel per row walks four rows SPREAD apart (as kernels.py does) in one
LLVM-IR intrinsic generated from the layout row; the numba function around it
hands spans of rows to threads.
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

from edgetp.model import isa

isa.configure()  # before anything compiles: numba reads its target once

import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import njit, prange, types  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from edgetp.model.intdot_layouts import LAYOUTS, Field, Layout, Scale, decode  # noqa: E402
from edgetp.model.kernels import SPREAD, f16_table, partners, spans  # noqa: E402
from edgetp.model.vnni import q8_block  # noqa: E402

log = logging.getLogger(__name__)

_OPTS = dict(cache=True, nogil=True)
KINDS = frozenset(int(t) for t in LAYOUTS)

# ---------------------------------------------------------------- activations


class Rounded(NamedTuple):
    """One token rounded for the integer kernels (cols a multiple of 32)."""

    xq: np.ndarray  # (cols,) int8
    dx: np.ndarray  # (cols//32,) f32, f16-valued
    s4: np.ndarray  # (cols//4,) int32, sum of each 4 xq
    s16: np.ndarray  # (cols//16,) int32, sum of each 16 xq


@njit(**_OPTS)
def round_into(x, xq, dx, s4, s16):
    """x (cols,) f32 -> xq, dx, s4, s16 (see Rounded)."""
    f = np.empty(1, np.float32)
    u = f.view(np.uint32)
    for b in range(x.shape[0] // 32):
        d, _ = q8_block(x[b * 32 : b * 32 + 32], xq[b * 32 : b * 32 + 32], f, u)
        dx[b] = d
        for k in range(8):
            s = 0
            for j in range(4):
                s += np.int32(xq[b * 32 + 4 * k + j])
            s4[b * 8 + k] = s
        for h in range(2):
            s16[2 * b + h] = s4[b * 8 + 4 * h] + s4[b * 8 + 4 * h + 1] + s4[b * 8 + 4 * h + 2] + s4[b * 8 + 4 * h + 3]


def rounded(x: np.ndarray) -> Rounded:
    """Round one token x (cols,) f32; cols must be a multiple of 32."""
    cols = x.shape[0]
    if cols % 32:
        raise ValueError(f"{cols} columns is not a multiple of 32")
    r = Rounded(np.empty(cols, np.int8), np.empty(cols // 32, np.float32),
                np.empty(cols // 4, np.int32), np.empty(cols // 16, np.int32))  # fmt: skip
    round_into(np.ascontiguousarray(x, np.float32), *r)
    return r


# ---------------------------------------------------------------- IR helpers

_I1, _I8, _I16, _I32, _I64 = (ir.IntType(n) for n in (1, 8, 16, 32, 64))
_F32 = ir.FloatType()
_V32I8, _V16I8, _V8I32, _V4I32, _V8F = (ir.VectorType(t, n) for t, n in
                                        ((_I8, 32), (_I8, 16), (_I32, 8), (_I32, 4), (_F32, 8)))  # fmt: skip


def _vec(ty, vals):
    return ir.Constant(ir.VectorType(ty, len(vals)), [ir.Constant(ty, int(v)) for v in vals])


def _splat8(v):
    return _vec(_I8, [v] * 32)


def _decl(module, name, ret, args):
    fn = module.globals.get(name)
    return fn if fn is not None else ir.Function(module, ir.FunctionType(ret, args), name)


def _ptr(b, addr, off, ty):
    if not (isinstance(off, int) and off == 0):
        addr = b.add(addr, off if not isinstance(off, int) else ir.Constant(_I64, off))
    return b.inttoptr(addr, ty.as_pointer())


def _load(b, addr, off, ty, align=1):
    return b.load(_ptr(b, addr, off, ty), align=align)


# ---------------------------------------------------------------- ISAs: how int8 lanes multiply


def _dot_avx2(b, u, x, signed):
    if signed:  # pmaddubsw wants one unsigned operand: |code| x (xq with the code's sign)
        u, x = b.call(_decl(b.module, "llvm.abs.v32i8", _V32I8, [_V32I8, _I1]), [u, ir.Constant(_I1, 0)]), \
            b.call(_decl(b.module, "llvm.x86.avx2.psign.b", _V32I8, [_V32I8] * 2), [x, u])
    v16 = ir.VectorType(_I16, 16)
    pairs = b.call(_decl(b.module, "llvm.x86.avx2.pmadd.ub.sw", v16, [_V32I8] * 2), [u, x])
    return b.call(_decl(b.module, "llvm.x86.avx2.pmadd.wd", _V8I32, [v16] * 2), [pairs, _vec(_I16, [1] * 16)])


def _dot_vnni(b, u, x, signed):
    if signed:
        u, x = b.call(_decl(b.module, "llvm.abs.v32i8", _V32I8, [_V32I8, _I1]), [u, ir.Constant(_I1, 0)]), \
            b.call(_decl(b.module, "llvm.x86.avx2.psign.b", _V32I8, [_V32I8] * 2), [x, u])
    fn = _decl(b.module, "llvm.x86.avx512.vpdpbusd.256", _V8I32, [_V8I32] * 3)
    return b.call(fn, [ir.Constant(_V8I32, None), b.bitcast(u, _V8I32), b.bitcast(x, _V8I32)])


def _dot_neon(b, u, x, signed):
    fn = _decl(b.module, "llvm.aarch64.neon.sdot.v4i32.v16i8", _V4I32, [_V4I32, _V16I8, _V16I8])
    halves = []
    for h in range(2):
        sel = _vec(_I32, range(16 * h, 16 * h + 16))
        halves.append(b.call(fn, [ir.Constant(_V4I32, None), b.shuffle_vector(u, u, sel), b.shuffle_vector(x, x, sel)]))
    return b.shuffle_vector(halves[0], halves[1], _vec(_I32, range(8)))


def _dot_generic(b, u, x, signed):
    v32 = ir.VectorType(_I32, 32)
    p = b.mul(b.sext(u, v32), b.sext(x, v32))  # unsigned codes are < 128: sext is zext
    parts = [b.shuffle_vector(p, p, _vec(_I32, range(k, 32, 4))) for k in range(4)]
    return b.add(b.add(parts[0], parts[1]), b.add(parts[2], parts[3]))


def _lookup_x86(b, table, idx):
    fn = _decl(b.module, "llvm.x86.avx2.pshuf.b", _V32I8, [_V32I8] * 2)
    return b.call(fn, [_vec(_I8, list(table) * 2), idx])


def _lookup_neon(b, table, idx):
    fn = _decl(b.module, "llvm.aarch64.neon.tbl1.v16i8", _V16I8, [_V16I8] * 2)
    halves = [b.call(fn, [_vec(_I8, table), b.shuffle_vector(idx, idx, _vec(_I32, range(16 * h, 16 * h + 16)))])
              for h in range(2)]  # fmt: skip
    return b.shuffle_vector(halves[0], halves[1], _vec(_I32, range(32)))


def _lookup_generic(b, table, idx):
    v = ir.Constant(_V32I8, None)
    for k, t in enumerate(table):
        v = b.select(b.icmp_unsigned("==", idx, _splat8(k)), _splat8(t), v)
    return v


# isa -> (dot, lookup, f16 by fpext (else a table))
ISA_OPS = {
    "avx2": (_dot_avx2, _lookup_x86, True),
    "avxvnni": (_dot_vnni, _lookup_x86, True),
    "avx512vnni": (_dot_vnni, _lookup_x86, True),
    "neon": (_dot_neon, _lookup_neon, True),
    "generic": (_dot_generic, _lookup_generic, False),
}


# ---------------------------------------------------------------- layout rows -> IR


class _Emit:
    """Emits one layout's block arithmetic for one ISA into a builder."""

    def __init__(self, b: ir.IRBuilder, layout: Layout, name: str, tab):
        self.b, self.layout, self.tab = b, layout, tab
        self.dot, self.lookup, self.fpext = ISA_OPS[name]

    def f16(self, base, off):
        b = self.b
        h = _load(b, base, off, _I16)
        if self.fpext:
            return b.fpext(b.bitcast(h, ir.HalfType()), _F32)
        return _load(b, self.tab, b.mul(b.zext(h, _I64), ir.Constant(_I64, 4)), _F32, align=4)

    def integer(self, base, fields, int8=False):
        b, v = self.b, None
        for f in fields:
            byte = _load(b, base, f.off + f.idx, _I8)
            x = b.sext(byte, _I32) if int8 else b.zext(byte, _I32)
            if not int8:
                x = b.and_(b.lshr(x, ir.Constant(_I32, f.shift)), ir.Constant(_I32, f.mask))
                x = b.shl(x, ir.Constant(_I32, f.pos)) if f.pos else x
            v = x if v is None else b.or_(v, x)
        return v

    def scale(self, base, s: Scale):
        """(ws, wm or None) of a sub-block, rounded as the dequantizer rounds them."""
        b = self.b
        ws = self.f16(base, s.d)
        if s.sc:
            sc = self.integer(base, s.sc, s.sc_int8)
            sc = b.sub(sc, ir.Constant(_I32, s.sc_bias)) if s.sc_bias else sc
            ws = b.fmul(ws, b.sitofp(sc, _F32))
        if s.m is None:
            return ws, None
        wm = self.f16(base, s.m)
        return ws, (wm if not s.mn else b.fneg(b.fmul(wm, b.sitofp(self.integer(base, s.mn), _F32))))

    def codes(self, base, fields: tuple[Field, ...]):
        """<32 x i8> unsigned codes u of a chunk."""
        b, u = self.b, None
        for f in fields:
            n = next(n for n in (4, 16, 32) if max(f.idx) < n)
            raw = _load(b, base, f.off, ir.VectorType(_I8, n))
            g = raw if n == 32 and f.idx == tuple(range(32)) else b.shuffle_vector(raw, raw, _vec(_I32, f.idx))
            if f.mask == 1:  # one bit: test it in place
                bit = b.and_(g, _vec(_I8, [1 << s for s in f.shift]))
                v = b.select(b.icmp_unsigned("!=", bit, _splat8(0)), _splat8(1 << f.pos), _splat8(0))
            else:
                part = {s: (b.lshr(g, _splat8(s)) if s else g) for s in sorted(set(f.shift))}
                part = {s: (b.and_(p, _splat8(f.mask)) if f.mask != 255 else p) for s, p in part.items()}
                v = part[f.shift[0]]
                if len(part) == 2:  # two shifts (nibble pairs): take each value from its own
                    lo = f.shift[0]
                    v = b.shuffle_vector(part[lo], part[max(part)], _vec(_I32, [j if f.shift[j] == lo else 32 + j for j in range(32)]))
                v = b.shl(v, _splat8(f.pos)) if f.pos else v
            u = v if u is None else b.or_(u, v)
        return u

    def block(self, k, rows, x, accs, maccs):
        """One block of R rows: returns the updated (accs, maccs)."""
        b, L = self.b, self.layout
        xq, dx, s4, s16 = x
        accs, maccs = list(accs), list(maccs)
        nch = len(L.chunks)
        bases = [b.add(r, b.mul(k, ir.Constant(_I64, L.nbytes))) for r in rows]
        for c, ch in enumerate(L.chunks):
            ci = b.add(b.mul(k, ir.Constant(_I64, nch)), ir.Constant(_I64, c))
            xv = _load(b, xq, b.mul(ci, ir.Constant(_I64, 32)), _V32I8)
            dxs = _load(b, dx, b.mul(ci, ir.Constant(_I64, 4)), _F32, 4)
            if L.bias:
                corr = b.shl(_load(b, s4, b.mul(ci, ir.Constant(_I64, 32)), _V8I32, 4),
                             ir.Constant(_V8I32, [ir.Constant(_I32, L.bias.bit_length() - 1)] * 8))
            if L.offset:
                sa = _load(b, s16, b.mul(ci, ir.Constant(_I64, 8)), _I32, 4)
                sb = _load(b, s16, b.add(b.mul(ci, ir.Constant(_I64, 8)), ir.Constant(_I64, 4)), _I32, 4)
            for r, base in enumerate(bases):
                u = self.codes(base, ch.code)
                if L.table is not None:
                    u = self.lookup(b, L.table, u)
                lanes = self.dot(b, u, xv, L.signed or L.table is not None)
                lanes = b.sub(lanes, corr) if L.bias else lanes
                ws_lo, wm_lo = self.scale(base, ch.lo)
                ws_hi, wm_hi = (ws_lo, wm_lo) if ch.hi == ch.lo else self.scale(base, ch.hi)
                two = b.insert_element(ir.Constant(ir.VectorType(_F32, 2), None), b.fmul(ws_lo, dxs), ir.Constant(_I32, 0))
                two = b.insert_element(two, b.fmul(ws_hi, dxs), ir.Constant(_I32, 1))
                sv = b.shuffle_vector(two, two, _vec(_I32, [0] * 4 + [1] * 4))
                accs[r] = b.fadd(accs[r], b.fmul(sv, b.sitofp(lanes, _V8F)))
                if L.offset:
                    parts = [(wm_lo, b.add(sa, sb))] if ch.hi == ch.lo else [(wm_lo, sa), (wm_hi, sb)]
                    for wm, s in parts:
                        maccs[r] = b.fadd(maccs[r], b.fmul(b.fmul(wm, dxs), b.sitofp(s, _F32)))
        return accs, maccs


def _emit_rows(b: ir.IRBuilder, layout: Layout, rows, x, tab, nb, out) -> None:
    """out[0:R] = R rows (addresses) . the token x = (xq, dx, s4, s16 addresses), nb blocks."""
    em = _Emit(b, layout, isa.current(), tab)
    R = len(rows)
    zero_v, zero = ir.Constant(_V8F, None), ir.Constant(_F32, 0.0)
    entry = b.block
    loop, done = b.append_basic_block("intdot.loop"), b.append_basic_block("intdot.done")
    b.cbranch(b.icmp_signed(">", nb, ir.Constant(_I64, 0)), loop, done)
    b.position_at_end(loop)
    k = b.phi(_I64)
    accs = [b.phi(_V8F) for _ in range(R)]
    maccs = [b.phi(_F32) for _ in range(R)]
    new_a, new_m = em.block(k, rows, x, accs, maccs)
    k1 = b.add(k, ir.Constant(_I64, 1))
    for phi, init, new in [(k, ir.Constant(_I64, 0), k1), *((a, zero_v, n) for a, n in zip(accs, new_a)),
                           *((m, zero, n) for m, n in zip(maccs, new_m))]:
        phi.add_incoming(init, entry)
        phi.add_incoming(new, b.block)
    last = b.block
    b.cbranch(b.icmp_signed("<", k1, nb), loop, done)
    b.position_at_end(done)
    fin = [(b.phi(_V8F), b.phi(_F32)) for _ in range(R)]  # phis first in the block
    for r, (acc, macc) in enumerate(fin):
        acc.add_incoming(zero_v, entry)
        acc.add_incoming(new_a[r], last)
        macc.add_incoming(zero, entry)
        macc.add_incoming(new_m[r], last)
    for r, (acc, macc) in enumerate(fin):
        h = b.extract_element(acc, ir.Constant(_I32, 0))
        for l in range(1, 8):
            h = b.fadd(h, b.extract_element(acc, ir.Constant(_I32, l)))
        h = b.fadd(h, macc) if layout.offset else h
        b.store(h, _ptr(b, out, 4 * r, _F32), align=4)


@intrinsic
def _rows4(typingctx, kind, rows, xq, dx, s4, s16, tab, nb, out):
    """out[0:4] (an address of 4 f32) = rows (4 addresses) . the token, in layout `kind` (a literal qtype)."""
    if not isinstance(kind, types.IntegerLiteral):
        return None
    layout = LAYOUTS[kind.literal_value]
    sig = types.void(kind, rows, *(types.int64,) * 7)

    def codegen(context, builder, signature, args):
        rows_v = [builder.extract_value(args[1], i) for i in range(rows.count)]
        _emit_rows(builder, layout, rows_v, args[2:6], args[6], args[7], args[8])
        return context.get_dummy_value()

    return sig, codegen


@functools.cache
def _kernel(kind: int):
    """The compiled decode kernel of one layout (`kind` is a constant inside it)."""

    @njit(parallel=True, **_OPTS)
    def matvec_rows(w, xq, dx, s4, s16, tab, nb, out):
        # w: (rows, nb * block bytes) uint8; xq/dx/s4/s16: one Rounded token; out: (rows,) f32
        rows = w.shape[0]
        wa, st = w.ctypes.data, w.shape[1]
        xa, da, s4a, s16a, ta = xq.ctypes.data, dx.ctypes.data, s4.ctypes.data, s16.ctypes.data, tab.ctypes.data
        for c in prange(spans(rows)):
            res = np.empty(4, np.float32)
            for r in range(c * 4 * SPREAD, min(rows, c * 4 * SPREAD + SPREAD)):
                r1, r2, r3 = partners(r, rows)
                _rows4(kind, (wa + r * st, wa + r1 * st, wa + r2 * st, wa + r3 * st), xa, da, s4a, s16a, ta, nb,
                       res.ctypes.data)
                for i in range(4):
                    if r + i * SPREAD < rows:
                        out[r + i * SPREAD] = res[i]

    return matvec_rows


@functools.cache
def _tab() -> np.ndarray:
    return f16_table()


def matvec(qtype: int, w: np.ndarray, x: Rounded, out: np.ndarray) -> None:
    """out (rows,) f32 = W . x: w (rows, row_bytes) uint8 GGUF blocks of qtype, x = rounded(token)."""
    L = LAYOUTS[qtype]
    nb = w.shape[1] // L.nbytes
    if w.dtype != np.uint8 or not w.flags.c_contiguous or w.shape[1] != nb * L.nbytes or x.xq.shape[0] != nb * L.values:
        raise ValueError(f"weight {w.dtype} {w.shape} does not match {x.xq.shape[0]} rounded columns")
    if out.dtype != np.float32 or out.shape != (w.shape[0],):
        raise ValueError(f"out must be float32 ({w.shape[0]},), got {out.dtype} {out.shape}")
    _kernel(int(qtype))(w, x.xq, x.dx, x.s4, x.s16, _tab(), nb, out)


# ---------------------------------------------------------------- reference and availability


def reference(qtype: int, w: np.ndarray, x: Rounded) -> np.ndarray:
    """The canonical arithmetic (module docstring) in numpy: the bits every ISA must return."""
    L = LAYOUTS[qtype]
    codes, ws, wm = decode(L, w)  # (rows, cols) int64, (rows, cols//16) f32
    rows, cols = codes.shape
    nch = cols // 32
    lanes = (codes * x.xq.astype(np.int64)).reshape(rows, nch, 8, 4).sum(-1).astype(np.float32)
    t = np.repeat((ws.reshape(rows, nch, 2) * x.dx[None, :, None]).astype(np.float32), 4, axis=2)
    acc = np.zeros((rows, 8), np.float32)
    for c in range(nch):
        acc = acc + t[:, c] * lanes[:, c]
    h = acc[:, 0]
    for lane in range(1, 8):
        h = h + acc[:, lane]
    if wm is None:
        return h
    m = np.zeros(rows, np.float32)
    for c in range(nch):
        ch = L.chunks[c % len(L.chunks)]
        sa, sb = x.s16[2 * c], x.s16[2 * c + 1]
        parts = [(wm[:, 2 * c], sa + sb)] if ch.hi == ch.lo else [(wm[:, 2 * c], sa), (wm[:, 2 * c + 1], sb)]
        for wmc, s in parts:
            m = m + (wmc * x.dx[c]) * np.float32(s)
    return h + m


def f16_fields(qtype: int) -> tuple[int, ...]:
    """Byte offsets of the f16 fields (scales, mins) in a block of qtype."""
    L = LAYOUTS[qtype]
    return tuple(sorted({o for ch in L.chunks for s in (ch.lo, ch.hi) for o in (s.d, s.m) if o is not None}))


def random_blocks(qtype: int, rows: int, nb: int, rng: np.random.Generator) -> np.ndarray:
    """(rows, nb * block bytes) uint8: random bytes, with f16 fields in +-0.02 (finite, both signs)."""
    L = LAYOUTS[qtype]
    raw = rng.integers(0, 256, (rows, nb, L.nbytes), dtype=np.uint8)
    for off in f16_fields(qtype):
        raw[:, :, off : off + 2] = rng.uniform(-0.02, 0.02, (rows, nb, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def _probe(qtype: int) -> bool:
    """Compile and run the kernel on an odd shape (rows past a span, 3 blocks); True if
    its bits equal the canonical arithmetic's."""
    rng = np.random.default_rng(11)
    rows, nb = 4 * SPREAD + 7, 3
    w = random_blocks(qtype, rows, nb, rng)
    x = rounded(rng.standard_normal(nb * LAYOUTS[qtype].values).astype(np.float32))
    out = np.empty(rows, np.float32)
    matvec(qtype, w, x, out)
    return bool(np.array_equal(out.view(np.uint32), reference(qtype, w, x).view(np.uint32)))


@functools.cache
def working() -> frozenset[int]:
    """The qtypes whose integer kernel compiled and passed its probe on this ISA (empty when
    EDGETP_ISA names one this CPU lacks: `isa.require()` says why)."""
    from edgetp.model.vnni import checked  # noqa: PLC0415

    try:
        name = isa.current()
    except isa.IsaError as exc:
        log.warning("integer decode kernels unavailable: %s", exc)
        return frozenset()
    ok = frozenset(t for t in sorted(KINDS) if checked(lambda t=t: _probe(t), f"integer {LAYOUTS[t].qtype.name} decode ({name})"))
    log.info("integer decode kernels on %s: %s", name, ", ".join(LAYOUTS[t].qtype.name for t in sorted(ok)) or "none")
    return ok


def available(qtype: int) -> bool:
    """True when qtype's integer decode kernel runs correctly here (probed once per process)."""
    return qtype in KINDS and qtype in working()
