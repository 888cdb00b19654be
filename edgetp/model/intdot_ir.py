"""LLVM IR of the integer decode kernels: a layout row (intdot_layouts) emitted for one ISA.

How an ISA forms the 8 int32 lanes of a chunk (its `_dot_*`), from unsigned codes u (code = u - bias,
the bias removed afterwards as bias * s4) or signed codes (Q8_0, IQ4):
  avx2        vpmaddubsw (u8 x s8 -> pairs in i16) then vpmaddwd by 1 (-> fours in i32);
              signed codes as |code| x sign(xq, code) (vpabsb, vpsignb), as llama.cpp does
  avxvnni,
  avx512vnni  vpdpbusd (u8 x s8, four products per i32 lane), 256 bits wide
  neon        sdot (s8 x s8, four products per i32 lane), two 128-bit halves
  generic     sign-extend to i32, multiply, add even and odd products (LLVM forms
              pmaddwd from that on any x86), then adjacent pairs: plain LLVM vectors
IQ4's table lookup is the ISA's byte shuffle (vpshufb, tbl; generic: selects).
"""

from __future__ import annotations

from llvmlite import ir

from edgetp.model.intdot_layouts import Field, Layout, Scale
from edgetp.model.vnni import _decl, _vec  # the IR helpers the VNNI prefill panels use too

# ---------------------------------------------------------------- IR helpers

_I1, _I8, _I16, _I32, _I64 = (ir.IntType(n) for n in (1, 8, 16, 32, 64))
_F32 = ir.FloatType()
_V32I8, _V16I8, _V8I32, _V4I32, _V8F = (ir.VectorType(t, n) for t, n in
                                        ((_I8, 32), (_I8, 16), (_I32, 8), (_I32, 4), (_F32, 8)))  # fmt: skip


def _splat8(v):
    return _vec(_I8, [v] * 32)


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
    # products of even and odd values added in i32: the shape LLVM matches to pmaddwd on
    # any x86 (SSE2) and to smull/smlal on aarch64; then adjacent pairs added
    v16i32 = ir.VectorType(_I32, 16)
    even, odd = _vec(_I32, range(0, 32, 2)), _vec(_I32, range(1, 32, 2))

    def prod(sel):  # unsigned codes are < 128: sext is zext
        return b.mul(b.sext(b.shuffle_vector(u, u, sel), v16i32), b.sext(b.shuffle_vector(x, x, sel), v16i32))

    s = b.add(prod(even), prod(odd))
    return b.add(b.shuffle_vector(s, s, _vec(_I32, range(0, 16, 2))), b.shuffle_vector(s, s, _vec(_I32, range(1, 16, 2))))


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

    def splat(self, v):
        b = self.b
        return b.shuffle_vector(b.insert_element(ir.Constant(_V8F, None), v, ir.Constant(_I32, 0)), ir.Constant(_V8F, None),
                                _vec(_I32, [0] * 8))

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
            elif len(set(f.shift)) > 1 and all(len(set(f.shift[i : i + 4])) == 1 for i in range(0, 32, 4)) \
                    and f.mask < 1 << (8 - max(f.shift)):  # a shift per 4 bytes (nibble halves): one i32 shift,
                sh = _vec(_I32, f.shift[::4])  # the bits it pulls from a neighbour byte are masked off
                v = b.and_(b.bitcast(b.lshr(b.bitcast(g, _V8I32), sh), _V32I8), _splat8(f.mask))
                v = b.shl(v, _splat8(f.pos)) if f.pos else v
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

    def slot_ints(self, base, fieldsets, int8):
        """<N x i16>: lane i = the integer of fieldsets[i] (OR'd fields, or one int8 byte), all
        N at once from one 16-byte load of the block's scale bytes."""
        b, N = self.b, len(fieldsets)
        offs = [f.off + f.idx for fs in fieldsets for f in fs]
        lo = min(min(offs), self.layout.nbytes - 16)  # never past the block
        assert max(offs) - lo < 16, "scale bytes must lie within 16"
        raw = _load(b, base, lo, _V16I8)
        vi16, v = ir.VectorType(_I16, N), None
        for k in range(max(len(fs) for fs in fieldsets)):
            fk = [fs[k] if k < len(fs) else None for fs in fieldsets]  # None: contributes 0
            g = b.shuffle_vector(raw, raw, _vec(_I32, [f.off + f.idx - lo if f else 0 for f in fk]))
            if int8:
                x = b.sext(g, vi16)
            else:
                x = b.zext(g, vi16)
                if any(f and f.shift for f in fk):
                    x = b.lshr(x, _vec(_I16, [f.shift if f else 0 for f in fk]))
                x = b.and_(x, _vec(_I16, [f.mask if f else 0 for f in fk]))
                if any(f and f.pos for f in fk):
                    x = b.shl(x, _vec(_I16, [f.pos if f else 0 for f in fk]))
            v = x if v is None else b.or_(v, x)
        return v

    def slot_scales(self, base, dxs, S):
        """Per block, all slots at once: (ws * dx, (wm * dx) * f32(S) or None) as <n x f32>;
        dxs and S are the dx and xq sums of each slot."""
        ws, wm = self.slot_weights(base)
        b = self.b
        if wm is None:
            return b.fmul(ws, dxs), None
        return b.fmul(ws, dxs), b.fmul(b.fmul(wm, dxs), S)

    def slot_weights(self, base):
        """Per block, all slots at once: (ws, wm or None) as <n x f32>, the weights' part of slot_scales."""
        b, slots = self.b, self.layout.slots
        n, s0 = len(slots), slots[0]
        assert all(s.d == s0.d and s.m == s0.m and bool(s.mn) == bool(s0.mn) for s in slots)
        vf = ir.VectorType(_F32, n)

        def splat(v):
            return b.shuffle_vector(b.insert_element(ir.Constant(vf, None), v, ir.Constant(_I32, 0)), ir.Constant(vf, None),
                                    ir.Constant(ir.VectorType(_I32, n), [0] * n))

        def ints_f32(v, lanes, bias):
            sel = b.shuffle_vector(v, v, _vec(_I32, lanes))
            sel = b.sub(sel, _vec(_I16, [bias] * n)) if bias else sel
            return b.sitofp(sel, vf)

        fieldsets = [s.sc for s in slots] + ([s.mn for s in slots] if s0.mn else [])
        ints = self.slot_ints(base, fieldsets, s0.sc_int8)
        ws = b.fmul(splat(self.f16(base, s0.d)), ints_f32(ints, range(n), s0.sc_bias))
        if s0.m is None:
            return ws, None
        return ws, b.fneg(b.fmul(splat(self.f16(base, s0.m)), ints_f32(ints, range(n, 2 * n), 0)))

    def slot_x(self, k, dx, s16):
        """Per block of one token, all slots at once: (dx, f32 xq sum or None) of each slot as <n x f32>."""
        b, L = self.b, self.layout
        nch, n = len(L.chunks), len(L.slots)
        dxv = _load(b, dx, b.mul(k, ir.Constant(_I64, 4 * nch)), ir.VectorType(_F32, nch), 4)
        dxs = b.shuffle_vector(dxv, dxv, _vec(_I32, [i * nch // n for i in range(n)]))
        if not L.offset:
            return dxs, None
        v16 = _load(b, s16, b.mul(k, ir.Constant(_I64, 4 * 2 * nch)), ir.VectorType(_I32, 2 * nch), 4)
        if n < 2 * nch:
            v16 = b.add(b.shuffle_vector(v16, v16, _vec(_I32, range(0, 2 * nch, 2))),
                        b.shuffle_vector(v16, v16, _vec(_I32, range(1, 2 * nch, 2))))
        return dxs, b.sitofp(v16, ir.VectorType(_F32, n))

    def block(self, k, rows, x, accs, maccs):
        """One block of R rows: returns the updated (accs, maccs)."""
        b, L = self.b, self.layout
        xq, dx, s4, s16 = x
        accs, maccs = list(accs), list(maccs)
        nch, n = len(L.chunks), len(L.slots)
        bases = [b.add(r, b.mul(k, ir.Constant(_I64, L.nbytes))) for r in rows]
        if n > 1:  # K-quants: every slot's ws*dx (and offset term) once per block, as vectors
            dxs, S = self.slot_x(k, dx, s16)  # xq sums per slot: s16 per 16 values, or adjacent pairs of them
            tv = []
            for r, base in enumerate(bases):
                t, p = self.slot_scales(base, dxs, S)
                tv.append(t)
                if p is not None:
                    maccs[r] = b.fadd(maccs[r], p)
        for c, ch in enumerate(L.chunks):
            ci = b.add(b.mul(k, ir.Constant(_I64, nch)), ir.Constant(_I64, c))
            xv = _load(b, xq, b.mul(ci, ir.Constant(_I64, 32)), _V32I8)
            if L.bias:
                corr = b.shl(_load(b, s4, b.mul(ci, ir.Constant(_I64, 32)), _V8I32, 4),
                             ir.Constant(_V8I32, [ir.Constant(_I32, L.bias.bit_length() - 1)] * 8))
            if n == 1:
                dxs = _load(b, dx, b.mul(ci, ir.Constant(_I64, 4)), _F32, 4)
                if L.offset:
                    sa = _load(b, s16, b.mul(ci, ir.Constant(_I64, 8)), _I32, 4)
                    sb = _load(b, s16, b.add(b.mul(ci, ir.Constant(_I64, 8)), ir.Constant(_I64, 4)), _I32, 4)
            for r, base in enumerate(bases):
                u = self.codes(base, ch.code)
                if L.table is not None:
                    u = self.lookup(b, L.table, u)
                lanes = self.dot(b, u, xv, L.signed or L.table is not None)
                lanes = b.sub(lanes, corr) if L.bias else lanes
                if n == 1:  # one scale per block
                    ws, wm = self.scale(base, ch.lo)
                    sv = self.splat(b.fmul(ws, dxs))
                    if L.offset:
                        maccs[r] = b.fadd(maccs[r], b.fmul(b.fmul(wm, dxs), b.sitofp(b.add(sa, sb), _F32)))
                else:
                    lo, hi = (2 * c, 2 * c + 1) if L.split else (c, c)
                    sv = b.shuffle_vector(tv[r], tv[r], _vec(_I32, [lo] * 4 + [hi] * 4))
                accs[r] = b.fadd(accs[r], b.fmul(sv, b.sitofp(lanes, _V8F)))
        return accs, maccs


def emit_rows(b: ir.IRBuilder, layout: Layout, name: str, rows, x, tab, nb, out) -> None:
    """out[0:R] = R rows (addresses) . the token x = (xq, dx, s4, s16 addresses), nb blocks, on ISA `name`."""
    em = _Emit(b, layout, name, tab)
    R = len(rows)
    nslot = len(layout.slots)
    mty = _F32 if nslot == 1 else ir.VectorType(_F32, nslot)  # offset accumulators, one per slot
    zero_v, zero = ir.Constant(_V8F, None), ir.Constant(mty, None if nslot > 1 else 0.0)
    entry = b.block
    loop, done = b.append_basic_block("intdot.loop"), b.append_basic_block("intdot.done")
    b.cbranch(b.icmp_signed(">", nb, ir.Constant(_I64, 0)), loop, done)
    b.position_at_end(loop)
    k = b.phi(_I64)
    accs = [b.phi(_V8F) for _ in range(R)]
    maccs = [b.phi(mty) for _ in range(R)]
    new_a, new_m = em.block(k, rows, x, accs, maccs)
    k1 = b.add(k, ir.Constant(_I64, 1))
    for phi, init, new in [(k, ir.Constant(_I64, 0), k1), *((a, zero_v, n) for a, n in zip(accs, new_a)),
                           *((m, zero, n) for m, n in zip(maccs, new_m))]:
        phi.add_incoming(init, entry)
        phi.add_incoming(new, b.block)
    last = b.block
    b.cbranch(b.icmp_signed("<", k1, nb), loop, done)
    b.position_at_end(done)
    fin = [(b.phi(_V8F), b.phi(mty)) for _ in range(R)]  # phis first in the block
    for r, (acc, macc) in enumerate(fin):
        acc.add_incoming(zero_v, entry)
        acc.add_incoming(new_a[r], last)
        macc.add_incoming(zero, entry)
        macc.add_incoming(new_m[r], last)
    for r, (acc, macc) in enumerate(fin):
        h = b.extract_element(acc, ir.Constant(_I32, 0))
        for l in range(1, 8):
            h = b.fadd(h, b.extract_element(acc, ir.Constant(_I32, l)))
        if layout.offset and nslot > 1:
            m = b.extract_element(macc, ir.Constant(_I32, 0))
            for l in range(1, nslot):
                m = b.fadd(m, b.extract_element(macc, ir.Constant(_I32, l)))
            macc = m
        h = b.fadd(h, macc) if layout.offset else h
        b.store(h, _ptr(b, out, 4 * r, _F32), align=4)




# ---------------------------------------------------------------- several tokens per weight read


def _count(b: ir.IRBuilder, n, body, name: str) -> None:
    """for t in range(n): body(t), n an i64 value; body may add blocks of its own."""
    entry = b.block
    loop, done = b.append_basic_block(name + ".loop"), b.append_basic_block(name + ".done")
    b.cbranch(b.icmp_signed(">", n, ir.Constant(_I64, 0)), loop, done)
    b.position_at_end(loop)
    t = b.phi(_I64)
    t.add_incoming(ir.Constant(_I64, 0), entry)
    body(t)
    t1 = b.add(t, ir.Constant(_I64, 1))
    t.add_incoming(t1, b.block)
    b.cbranch(b.icmp_signed("<", t1, n), loop, done)
    b.position_at_end(done)


def emit_rows_tokens(b: ir.IRBuilder, layout: Layout, name: str, rows, x, ntok, tab, nb, acc, out) -> None:
    """out[t * R + r] = row r . token t for every t < ntok: R rows (addresses), x = (xq, dx, s4, s16)
    addresses of ntok rounded tokens interleaved by block (block k of every token, in token order,
    then block k + 1: what the token loop of a block reads is adjacent), acc a scratch of
    ntok * R * (8 + slots) f32.

    For each (row, token) this is emit_rows's arithmetic op for op (the same integer lanes, the
    same f32 products and sums in the same order), so each result has the single-token bits;
    but a chunk's codes and scales are unpacked once and applied to every token in turn, the
    accumulators living in acc rather than registers (their count is not known here)."""
    em, L = _Emit(b, layout, name, tab), layout
    R, nch, n = len(rows), len(layout.chunks), len(layout.slots)
    mty = _F32 if n == 1 else ir.VectorType(_F32, n)
    sizes = [ir.Constant(_I64, v) for v in (L.values, L.values // 8, L.values, L.values // 4)]  # bytes per block
    others = b.sub(ntok, ir.Constant(_I64, 1))

    def token(t, k):  # (xq, dx, s4, s16) of token t, where block k + j of it sits at + j blocks
        return tuple(b.add(a, b.mul(b.add(t, b.mul(k, others)), s)) for a, s in zip(x, sizes))

    def acc_at(t, r):
        return _ptr(b, acc, b.mul(b.add(b.mul(t, ir.Constant(_I64, R)), ir.Constant(_I64, r)), ir.Constant(_I64, 32)), _V8F)

    macc0 = b.add(acc, b.mul(ntok, ir.Constant(_I64, R * 32)))

    def macc_at(t, r):
        off = b.mul(b.add(b.mul(t, ir.Constant(_I64, R)), ir.Constant(_I64, r)), ir.Constant(_I64, 4 * n))
        return _ptr(b, macc0, off, mty)

    def zero(t):
        for r in range(R):
            b.store(ir.Constant(_V8F, None), acc_at(t, r), align=4)
            b.store(ir.Constant(mty, None if n > 1 else 0.0), macc_at(t, r), align=4)

    _count(b, ntok, zero, "tok.zero")

    def block(k):
        bases = [b.add(r, b.mul(k, ir.Constant(_I64, L.nbytes))) for r in rows]
        if n > 1:
            sw = [em.slot_weights(base) for base in bases]  # (ws, wm) per row, for every token
            if L.offset:
                def offsets(t):
                    _, tdx, _, ts16 = token(t, k)
                    dxs, S = em.slot_x(k, tdx, ts16)
                    for r, (_, wm) in enumerate(sw):
                        p = macc_at(t, r)
                        b.store(b.fadd(b.load(p, align=4), b.fmul(b.fmul(wm, dxs), S)), p, align=4)
                _count(b, ntok, offsets, "tok.offsets")
        for c, ch in enumerate(L.chunks):
            ci = b.add(b.mul(k, ir.Constant(_I64, nch)), ir.Constant(_I64, c))
            us, scales = [], []
            for base in bases:
                u = em.codes(base, ch.code)
                us.append(em.lookup(b, L.table, u) if L.table is not None else u)
                if n == 1:
                    scales.append(em.scale(base, ch.lo))

            def apply(t, ci=ci, c=c, us=us, scales=scales):
                txq, tdx, ts4, ts16 = token(t, k)
                xv = _load(b, txq, b.mul(ci, ir.Constant(_I64, 32)), _V32I8)
                if L.bias:
                    corr = b.shl(_load(b, ts4, b.mul(ci, ir.Constant(_I64, 32)), _V8I32, 4),
                                 ir.Constant(_V8I32, [ir.Constant(_I32, L.bias.bit_length() - 1)] * 8))
                if n == 1:
                    dxs = _load(b, tdx, b.mul(ci, ir.Constant(_I64, 4)), _F32, 4)
                    if L.offset:
                        sa = _load(b, ts16, b.mul(ci, ir.Constant(_I64, 8)), _I32, 4)
                        sb = _load(b, ts16, b.add(b.mul(ci, ir.Constant(_I64, 8)), ir.Constant(_I64, 4)), _I32, 4)
                else:
                    dxs, _ = em.slot_x(k, tdx, ts16)
                for r, u in enumerate(us):
                    lanes = em.dot(b, u, xv, L.signed or L.table is not None)
                    lanes = b.sub(lanes, corr) if L.bias else lanes
                    if n == 1:
                        ws, wm = scales[r]
                        sv = em.splat(b.fmul(ws, dxs))
                        if L.offset:
                            p = macc_at(t, r)
                            b.store(b.fadd(b.load(p, align=4), b.fmul(b.fmul(wm, dxs), b.sitofp(b.add(sa, sb), _F32))), p, align=4)
                    else:
                        tv = b.fmul(sw[r][0], dxs)
                        lo, hi = (2 * c, 2 * c + 1) if L.split else (c, c)
                        sv = b.shuffle_vector(tv, tv, _vec(_I32, [lo] * 4 + [hi] * 4))
                    p = acc_at(t, r)
                    b.store(b.fadd(b.load(p, align=4), b.fmul(sv, b.sitofp(lanes, _V8F))), p, align=4)

            _count(b, ntok, apply, f"tok.chunk{c}")

    _count(b, nb, block, "tok.blocks")

    def finish(t):
        for r in range(R):
            acc_v = b.load(acc_at(t, r), align=4)
            h = b.extract_element(acc_v, ir.Constant(_I32, 0))
            for lane in range(1, 8):
                h = b.fadd(h, b.extract_element(acc_v, ir.Constant(_I32, lane)))
            if L.offset:
                m = b.load(macc_at(t, r), align=4)
                if n > 1:
                    s = b.extract_element(m, ir.Constant(_I32, 0))
                    for lane in range(1, n):
                        s = b.fadd(s, b.extract_element(m, ir.Constant(_I32, lane)))
                    m = s
                h = b.fadd(h, m)
            off = b.mul(b.add(b.mul(t, ir.Constant(_I64, R)), ir.Constant(_I64, r)), ir.Constant(_I64, 4))
            b.store(h, _ptr(b, out, off, _F32), align=4)

    _count(b, ntok, finish, "tok.finish")
