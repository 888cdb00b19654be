"""LLVM IR of the integer decode kernels: a layout row (intdot_layouts) emitted for one ISA.

How an ISA forms the 8 int32 lanes of a chunk (its `_dot_*`, added into acc if one is given), from unsigned codes u (code = u - bias,
the bias removed afterwards as bias * s4) or signed codes (Q8_0, IQ4):
  avx2        vpmaddubsw (u8 x s8 -> pairs in i16) then vpmaddwd by 1 (-> fours in i32);
              signed codes as |code| x sign(xq, code) (vpabsb, vpsignb), as llama.cpp does
  avxvnni,
  avx512vnni  vpdpbusd (u8 x s8, four products per i32 lane), 256 bits wide; the several-token
              kernel takes two rows in one 512-bit vpdpbusd (Emit.quad_by_unit_rows2)
  neon        sdot (s8 x s8, four products per i32 lane), two 128-bit halves
  generic     sign-extend to i32, multiply, add even and odd products (LLVM forms
              pmaddwd from that on any x86), then adjacent pairs: plain LLVM vectors
IQ4's table lookup is the ISA's byte shuffle (vpshufb, tbl; generic: selects).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from llvmlite import ir

from edgetp.model.intdot_layouts import Field, Layout
from edgetp.model.vnni import _decl, _vec  # the IR helpers the VNNI prefill panels use too

# ---------------------------------------------------------------- IR helpers

_I1, _I8, _I16, _I32, _I64 = (ir.IntType(n) for n in (1, 8, 16, 32, 64))
_F32 = ir.FloatType()
_V32I8, _V16I8, _V16I16, _V8I32, _V4I32, _V8F = (ir.VectorType(t, n) for t, n in
                                                 ((_I8, 32), (_I8, 16), (_I16, 16), (_I32, 8), (_I32, 4), (_F32, 8)))  # fmt: skip
_V64I8, _V16I32, _V16F = ir.VectorType(_I8, 64), ir.VectorType(_I32, 16), ir.VectorType(_F32, 16)


def _splat8(v):
    return _vec(_I8, [v] * 32)


def _ptr(b, addr, off, ty):
    if not (isinstance(off, int) and off == 0):
        addr = b.add(addr, off if not isinstance(off, int) else ir.Constant(_I64, off))
    return b.inttoptr(addr, ty.as_pointer())


def _load(b, addr, off, ty, align=1):
    return b.load(_ptr(b, addr, off, ty), align=align)


# ---------------------------------------------------------------- ISAs: how int8 lanes multiply


def _pairs_avx2(b, u, x, signed):
    """<16 x i16>: vpmaddubsw's sums of adjacent products, each at most 2 * umax * 127 (xq is
    within +-127), so never saturated."""
    if signed:  # pmaddubsw wants one unsigned operand: |code| x (xq with the code's sign)
        u, x = b.call(_decl(b.module, "llvm.abs.v32i8", _V32I8, [_V32I8, _I1]), [u, ir.Constant(_I1, 0)]), \
            b.call(_decl(b.module, "llvm.x86.avx2.psign.b", _V32I8, [_V32I8] * 2), [x, u])
    return b.call(_decl(b.module, "llvm.x86.avx2.pmadd.ub.sw", _V16I16, [_V32I8] * 2), [u, x])


def _widen_avx2(b, pairs, acc=None):
    """acc + <8 x i32> of adjacent i16 pairs added (vpmaddwd by 1)."""
    fn = _decl(b.module, "llvm.x86.avx2.pmadd.wd", _V8I32, [_V16I16] * 2)
    return _plus(b, acc, b.call(fn, [pairs, _vec(_I16, [1] * 16)]))


def _dot_avx2(b, u, x, signed, acc=None):
    return _widen_avx2(b, _pairs_avx2(b, u, x, signed), acc)


def _dot_vnni(b, u, x, signed, acc=None):
    if signed:
        u, x = b.call(_decl(b.module, "llvm.abs.v32i8", _V32I8, [_V32I8, _I1]), [u, ir.Constant(_I1, 0)]), \
            b.call(_decl(b.module, "llvm.x86.avx2.psign.b", _V32I8, [_V32I8] * 2), [x, u])
    fn = _decl(b.module, "llvm.x86.avx512.vpdpbusd.256", _V8I32, [_V8I32] * 3)
    return b.call(fn, [acc or ir.Constant(_V8I32, None), b.bitcast(u, _V8I32), b.bitcast(x, _V8I32)])


def _dot_vnni512(b, u, x, signed, acc=None):
    """_dot_vnni on <64 x i8> (two rows' chunks): AVX-512 has no vpsignb, so the sign of a signed
    code moves to xq by a select (where the code is 0 the product is 0 either way)."""
    if signed:
        x = b.select(b.icmp_signed("<", u, ir.Constant(_V64I8, None)), b.sub(ir.Constant(_V64I8, None), x), x)
        u = b.call(_decl(b.module, "llvm.abs.v64i8", _V64I8, [_V64I8, _I1]), [u, ir.Constant(_I1, 0)])
    fn = _decl(b.module, "llvm.x86.avx512.vpdpbusd.512", _V16I32, [_V16I32] * 3)
    return b.call(fn, [acc or ir.Constant(_V16I32, None), b.bitcast(u, _V16I32), b.bitcast(x, _V16I32)])


def _dot_neon(b, u, x, signed, acc=None):
    fn = _decl(b.module, "llvm.aarch64.neon.sdot.v4i32.v16i8", _V4I32, [_V4I32, _V16I8, _V16I8])
    halves = []
    for h in range(2):
        sel = _vec(_I32, range(16 * h, 16 * h + 16))
        into = ir.Constant(_V4I32, None) if acc is None else b.shuffle_vector(acc, acc, _vec(_I32, range(4 * h, 4 * h + 4)))
        halves.append(b.call(fn, [into, b.shuffle_vector(u, u, sel), b.shuffle_vector(x, x, sel)]))
    return b.shuffle_vector(halves[0], halves[1], _vec(_I32, range(8)))


def _dot_generic(b, u, x, signed, acc=None):
    # products of even and odd values added in i32: the shape LLVM matches to pmaddwd on
    # any x86 (SSE2) and to smull/smlal on aarch64; then adjacent pairs added
    v16i32 = ir.VectorType(_I32, 16)
    even, odd = _vec(_I32, range(0, 32, 2)), _vec(_I32, range(1, 32, 2))

    def prod(sel):  # unsigned codes are < 128: sext is zext
        return b.mul(b.sext(b.shuffle_vector(u, u, sel), v16i32), b.sext(b.shuffle_vector(x, x, sel), v16i32))

    s = b.add(prod(even), prod(odd))
    return _plus(b, acc, b.add(b.shuffle_vector(s, s, _vec(_I32, range(0, 16, 2))),
                               b.shuffle_vector(s, s, _vec(_I32, range(1, 16, 2)))))


def _plus(b, acc, v):
    return v if acc is None else b.add(acc, v)


def _lookup_x86(b, table, idx):
    fn = _decl(b.module, "llvm.x86.avx2.pshuf.b", _V32I8, [_V32I8] * 2)
    return b.call(fn, [_vec(_I8, list(table) * 2), idx])


def lookup512(b, table, idx):
    """<64 x i8> of a 16-entry table's values at <64 x i8> indices (0..15): one 512-bit vpshufb,
    which looks up within each 128 bits (AVX-512 only)."""
    fn = _decl(b.module, "llvm.x86.avx512.pshuf.b.512", _V64I8, [_V64I8] * 2)
    return b.call(fn, [_vec(_I8, list(table) * 4), idx])


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


class Ops(NamedTuple):
    dot: Callable  # the _dot_* of the ISA
    lookup: Callable  # the _lookup_* of the ISA
    fpext: bool  # f16 by fpext (vcvtph2ps, fcvtl), else a table
    wide_u8: bool  # dot takes unsigned bytes to 255 (see in_place)
    word_permute: bool  # a 64-byte vector of 32 words permutes in one instruction (vpermw, vpermt2w)
    pairs: tuple[Callable, Callable] | None = None  # dot = widen(pairs): several dots' i16 pairs may add first
    rows512: bool = False  # the several-token kernel takes two rows a 512-bit vector (quad_by_unit_rows2)


ISA_OPS = {
    "avx2": Ops(_dot_avx2, _lookup_x86, True, False, False, (_pairs_avx2, _widen_avx2)),  # i16 pairs: no u8 to 255
    "avxvnni": Ops(_dot_vnni, _lookup_x86, True, True, False),
    "avx512vnni": Ops(_dot_vnni, _lookup_x86, True, True, True, None, True),
    "neon": Ops(_dot_neon, _lookup_neon, True, False, False),  # sdot's bytes are signed
    "generic": Ops(_dot_generic, _lookup_generic, False, False, False),
}


def in_place(layout: Layout) -> tuple[int, ...] | None:
    """Each quad lane's shift k when a layout's codes can be multiplied where they lie in their
    byte, u * 2^k (byte & (mask << k)), the unit's integer then shifted right by k, exactly (it
    is a multiple of 2^k): a nibble or 2-bit plane without its shift. Layouts whose every chunk
    is one such field (Q4_0, Q4_1, Q4_K, Q2_K), the shift the same over each 16 values and the
    same for every quad; else None. Only for a dot product that takes u8 to 255 (VNNI)."""
    if layout.signed or layout.table is not None:
        return None
    quads = [layout.chunks[i : i + 4] for i in range(0, len(layout.chunks), 4)]
    lanes = set()
    for chunks in quads:
        ks = []
        for ch in chunks:
            if len(ch.code) != 1 or ch.code[0].pos or ch.code[0].mask == 1:
                return None
            f = ch.code[0]
            halves = (set(f.shift[:16]), set(f.shift[16:]))
            if any(len(h) != 1 for h in halves) or f.mask << max(f.shift) > 255:
                return None
            ks.append(tuple(h.pop() for h in halves))
        ks = ks * (4 // len(ks))  # a 32-value layout: one chunk, four times a quad
        lanes.add(tuple(ks[l % 4][l // 4] for l in range(8)))
    return lanes.pop() if len(lanes) == 1 and any(next(iter(lanes))) else None


# ---------------------------------------------------------------- layout rows -> IR


class Emit:
    """Emits one layout's block arithmetic for one ISA into a builder."""

    def __init__(self, b: ir.IRBuilder, layout: Layout, name: str, tab, shifted: bool = True):
        self.b, self.layout, self.tab = b, layout, tab
        self.dot, self.lookup, self.fpext, wide, self.permute, self.pairs, self.rows512 = ISA_OPS[name]
        # see in_place: quad32/quads256 codes only; shifted=False unpacks every code (a kernel that
        # reuses a quad's codes for several tokens saves the shift back of each product instead)
        self.shifts = in_place(layout) if wide and shifted else None
        # the several-token kernels (shifted=False) on a dot product of u8 to 255 take signed codes
        # (Q8_0, IQ4) as u = code + 128, the token's seed -128 * S taking the 128 off (seed_bias):
        # no sign moved onto each token's xq
        self.unsign = not shifted and _unsigned(layout, name)
        self.signed = (layout.signed or layout.table is not None) and not self.unsign

    def f16(self, base, off):
        b = self.b
        h = _load(b, base, off, _I16)
        if self.fpext:
            return b.fpext(b.bitcast(h, ir.HalfType()), _F32)
        return _load(b, self.tab, b.mul(b.zext(h, _I64), ir.Constant(_I64, 4)), _F32, align=4)

    def codes(self, base, fields: tuple[Field, ...], shifted=False, other=None):
        """<32 x i8> unsigned codes u of a chunk; shifted: u * 2^k where they lie (see in_place).
        other: the same chunk of a second row, whose codes follow in one <64 x i8> (each step
        on both rows' bytes at once; the same bytes as two calls)."""
        b, u, k = self.b, None, 1 if other is None else 2
        w = 32 * k

        def splat(v):
            return _vec(_I8, [v] * w)

        for f in fields:
            n = next(n for n in (4, 16, 32) if max(f.idx) < n)
            raw = _load(b, base, f.off, ir.VectorType(_I8, n))
            idx, shift = f.idx, f.shift * k
            if other is not None:
                raw = b.shuffle_vector(raw, _load(b, other, f.off, ir.VectorType(_I8, n)), _vec(_I32, range(2 * n)))
                idx = f.idx + tuple(i + n for i in f.idx)
            g = raw if n == 32 and f.idx == tuple(range(32)) else b.shuffle_vector(raw, raw, _vec(_I32, idx))
            if shifted:
                v = b.and_(g, _vec(_I8, [f.mask << s for s in shift]))
            elif f.mask == 1:  # one bit: test it in place
                bit = b.and_(g, _vec(_I8, [1 << s for s in shift]))
                v = b.select(b.icmp_unsigned("!=", bit, splat(0)), splat(1 << f.pos), splat(0))
            elif len(set(f.shift)) > 1 and all(len(set(f.shift[i : i + 4])) == 1 for i in range(0, 32, 4)) \
                    and f.mask < 1 << (8 - max(f.shift)):  # a shift per 4 bytes (nibble halves): one i32 shift,
                sh = _vec(_I32, shift[::4])  # the bits it pulls from a neighbour byte are masked off
                v32 = ir.VectorType(_I32, 8 * k)
                v = b.and_(b.bitcast(b.lshr(b.bitcast(g, v32), sh), ir.VectorType(_I8, w)), splat(f.mask))
                v = b.shl(v, splat(f.pos)) if f.pos else v
            else:
                part = {s: (b.lshr(g, splat(s)) if s else g) for s in sorted(set(f.shift))}
                part = {s: (b.and_(p, splat(f.mask)) if f.mask != 255 else p) for s, p in part.items()}
                v = part[f.shift[0]]
                if len(part) == 2:  # two shifts (nibble pairs): take each value from its own
                    lo = f.shift[0]
                    v = b.shuffle_vector(part[lo], part[max(part)], _vec(_I32, [j if shift[j] == lo else w + j for j in range(w)]))
                v = b.shl(v, splat(f.pos)) if f.pos else v
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

    def chunk(self, base, ch, shifted=False, other=None):
        """<32 x i8> integer codes of a chunk as `dot` takes them: u (a bias removed later), int8 or
        a table's values; shifted: u * 2^k where they lie (in_place's layouts); other: a second
        row's chunk too, in one <64 x i8> (codes)."""
        b, table = self.b, self.layout.table
        u = self.codes(base, ch.code, shifted, other)
        if table is not None and self.unsign:
            table = [(t + 128) - 256 * (t >= 0) for t in table]  # code + 128, as a byte (i8 constants)
        elif self.unsign:  # int8 codes: code + 128 is the byte with its top bit flipped
            return b.xor(u, _vec(_I8, [-128] * u.type.count))
        if table is None:
            return u
        if other is None:
            return self.lookup(b, table, u)
        assert self.rows512, "two rows' codes at once: AVX-512 only"
        return lookup512(b, table, u)

    def quad32(self, row, q, valid=None, other=None):
        """A 32-value layout's quad q (blocks 4q..4q+3) of one row: (4 chunks' codes, ws and wm
        <8 x f32> in lane order, wm None without offsets). valid: None, or 4 i1 saying which blocks
        exist (the row's last quad): the others read block 4q and give codes and scales of 0.
        other: a second row, unpacked alongside: (4 <64 x i8>, <16 x f32>, <16 x f32> or None),
        each the first row's then the second's, as `pair` would join them."""
        b, L = self.b, self.layout
        ch = L.chunks[0]
        assert not ch.lo.sc and not ch.lo.mn, "a 32-value layout's scales are plain f16 fields"
        step = b.mul(b.mul(q, ir.Constant(_I64, 4)), ir.Constant(_I64, L.nbytes))
        firsts = [b.add(r, step) for r in (row, other) if r is not None]

        def block(first, i):
            base = b.add(first, ir.Constant(_I64, i * L.nbytes)) if i else first
            return b.select(valid[i], base, first) if valid is not None and i else base

        us = []
        for i in range(4):
            bases = [block(f, i) for f in firsts]
            u = self.chunk(bases[0], ch, self.shifts is not None, bases[1] if other is not None else None)
            if valid is not None and i:
                u = b.select(valid[i], u, ir.Constant(u.type, None))
            us.append(u)
        scales = [self._scales32(f, valid) for f in firsts]
        if other is None:
            return (us, *scales[0])
        (wsa, wma), (wsb, wmb) = scales
        return us, _cat(b, wsa, wsb), (_cat(b, wma, wmb) if wma is not None else None)

    def _scales32(self, first, valid):
        """quad32's (ws, wm) of the row whose quad starts at `first`."""
        b, L = self.b, self.layout
        ch = L.chunks[0]
        if valid is None and self.permute:  # a whole quad: each scale field's four f16 at once (words)
            return self.words(first, ch.lo.d), (self.words(first, ch.lo.m) if L.offset else None)
        d, m = [], []
        for i in range(4):
            base = b.add(first, ir.Constant(_I64, i * L.nbytes)) if i else first
            if valid is not None and i:
                base = b.select(valid[i], base, first)
            for off, into in ((ch.lo.d, d), *(((ch.lo.m, m),) if L.offset else ())):
                h = _load(b, base, off, _I16)
                into.append(b.select(valid[i], h, ir.Constant(_I16, 0)) if valid is not None and i else h)  # f16 +0 is 0
        return self.halves(d), (self.halves(m) if L.offset else None)

    def pair(self, wa, wb):
        """Two rows' quads (codes, ws, wm) as one: each chunk's codes <64 x i8>, the scales <16 x f32>."""
        b = self.b
        (ua, wsa, wma), (ub, wsb, wmb) = wa, wb
        return [_cat(b, x, y) for x, y in zip(ua, ub)], _cat(b, wsa, wsb), (_cat(b, wma, wmb) if wma is not None else None)

    def words(self, first, off):
        """The f16 at `off` of a quad's 4 blocks from `first` (its whole 4 * nbytes are there) as
        halves gives them: picked from one or two 64-byte loads by one word permutation, where
        halves inserts them one by one. Field offsets are even (every 32-value layout's)."""
        b, n = self.b, self.layout.nbytes
        at = [i * n + off for i in range(4)]
        hi = min([4 * n - 64] + [a for a in at if a + 2 > 64])  # the second load: no further than the quad's end
        assert 4 * n >= 64 and all(a % 2 == 0 and (a + 2 <= 64 or hi <= a <= hi + 62) for a in at) and hi % 2 == 0
        v32 = ir.VectorType(_I16, 32)
        lo_v, hi_v = _load(b, first, 0, v32), (_load(b, first, hi, v32) if at[-1] + 2 > 64 else None)
        idx = [a // 2 if a + 2 <= 64 else 32 + (a - hi) // 2 for a in at]
        h = b.shuffle_vector(lo_v, hi_v if hi_v is not None else ir.Constant(v32, None), _vec(_I32, idx * 2))
        return b.fpext(b.bitcast(h, ir.VectorType(ir.HalfType(), 8)), _V8F)

    def halves(self, f16s):
        """4 f16 bit patterns (i16) -> <8 x f32>: each chunk's value for both of its halves, in lane
        order; one vector conversion (vcvtph2ps, fcvtl) where the ISA has it, else the table."""
        b, v = self.b, ir.Constant(ir.VectorType(_I16, 4), None)
        for i, h in enumerate(f16s):
            v = b.insert_element(v, h, ir.Constant(_I32, i))
        if self.fpext:
            f = b.fpext(b.bitcast(v, ir.VectorType(ir.HalfType(), 4)), ir.VectorType(_F32, 4))
        else:
            f = ir.Constant(ir.VectorType(_F32, 4), None)
            for i, h in enumerate(f16s):
                val = _load(b, self.tab, b.mul(b.zext(h, _I64), ir.Constant(_I64, 4)), _F32, align=4)
                f = b.insert_element(f, val, ir.Constant(_I32, i))
        return b.shuffle_vector(f, f, _vec(_I32, [0, 1, 2, 3] * 2))

    def quads256(self, row, k):
        """A 256-value layout's block k of one row: its two quads, each as quad32 gives one."""
        blk = self.block256(row, k)
        return [self.half256(blk, h) for h in range(2)]

    def block256(self, row, k):
        """Block k of one row of a 256-value layout: (its address, ws, wm), for half256."""
        base = self.b.add(row, self.b.mul(k, ir.Constant(_I64, self.layout.nbytes)))
        return (base, *self.slot_weights(base))

    def half256(self, blk, h):
        """Quad h (0, 1) of a block256: as quad32 gives one."""
        b, L = self.b, self.layout
        base, ws, wm = blk
        chunks = L.chunks[4 * h : 4 * h + 4]
        sel = _vec(_I32, [(2 * (4 * h + l % 4) + l // 4) if L.split else 4 * h + l % 4 for l in range(8)])
        return ([self.chunk(base, ch, self.shifts is not None) for ch in chunks], b.shuffle_vector(ws, ws, sel),
                b.shuffle_vector(wm, wm, sel) if wm is not None else None)

    def token(self, x, at, seeded=False):
        """One token's quad at quad index `at` of its (xq, dq, sq, xs) addresses: (4 chunks of xq,
        dq, the bias correction bias * sq or None, xs or None). seeded: sq holds -bias * S already
        (intdot._by_quad_seed), returned in the correction's place."""
        b, L = self.b, self.layout
        xq, dq, sq, xs = x
        xvs = [_load(b, xq, b.add(b.mul(at, ir.Constant(_I64, 128)), ir.Constant(_I64, 32 * i)), _V32I8) for i in range(4)]
        off = b.mul(at, ir.Constant(_I64, 32))
        corr = None
        if seeded and (self.unsign or L.bias):
            corr = _load(b, sq, off, _V8I32, 4)
        elif L.bias and not seeded:
            corr = b.shl(_load(b, sq, off, _V8I32, 4), _vec(_I32, [L.bias.bit_length() - 1] * 8))
        return xvs, _load(b, dq, off, _V8F, 4), corr, (_load(b, xs, off, _V8F, 4) if L.offset else None)

    def quad(self, acc, w, tok):
        """acc + one quad of one row w = (codes, ws, wm) times one token tok (self.token)."""
        b, L = self.b, self.layout
        (us, ws, wm), (xvs, dq, corr, xs) = w, tok
        units = self._unshift(_units(b, [self.dot(b, u, xv, L.signed or L.table is not None) for u, xv in zip(us, xvs)]))
        units = b.sub(units, corr) if corr is not None else units
        return self._scaled(acc, units, ws, wm, dq, xs)

    def quad_by_unit(self, acc, w, tok):
        """quad with the codes and the token's xq both `by_unit`: the four dot products add into one
        vector whose lane l is unit l's integer at once (no lanes to gather), starting from the
        token's seed -bias * S (token(seeded=True)). Codes unshifted (Emit(shifted=False))."""
        b, L = self.b, self.layout
        (us, ws, wm), (xvs, dq, units, xs) = w, tok
        assert not self.shifts, "the several-token kernels unpack every code (Emit(shifted=False))"
        signed = self.signed
        if self.pairs:  # widened once per `group` dots (AVX2's vpmaddwd), their pairs summed in i16
            pair, widen = self.pairs
            group = 32767 // (2 * L.umax * 127)  # 8 for 4-bit codes, 4 for 5-bit, 2 for 6, 1 signed
            for k in range(0, 4, group):
                pairs = [pair(b, u, xv, signed) for u, xv in zip(us[k : k + group], xvs[k : k + group])]
                s16 = pairs[0]
                for p in pairs[1:]:
                    s16 = b.add(s16, p)
                units = widen(b, s16, units)
        else:
            for u, xv in zip(us, xvs):
                units = self.dot(b, u, xv, signed, units)
        return self._scaled(acc, units, ws, wm, dq, xs)

    def quad_by_unit_rows2(self, acc, w2, tok):
        """quad_by_unit of two rows at once, in 512-bit vectors: w2 = two rows' quads joined (`pair`,
        quad32(other=)), codes `by_unit`; lanes 0-7 the first row's, 8-15 the second's (acc
        <16 x f32>). Every operation is lane by lane and the same as quad_by_unit's on each half
        (vpdpbusd's integers, then the f32 products and sums in the same order), so each half has
        quad_by_unit's bits; the dot products and f32 steps are half as many instructions."""
        b = self.b
        us, ws, wm = w2
        xvs, dq, seed, xs = tok

        def twice(v):
            return b.shuffle_vector(v, v, _vec(_I32, list(range(v.type.count)) * 2))

        assert not self.shifts, "the several-token kernels unpack every code (Emit(shifted=False))"
        units = twice(seed) if seed is not None else None
        for u, xv in zip(us, map(twice, xvs)):
            units = _dot_vnni512(b, u, xv, self.signed, units)
        acc = b.fadd(acc, b.fmul(b.fmul(ws, twice(dq)), b.sitofp(units, _V16F)))
        return b.fadd(acc, b.fmul(wm, twice(xs))) if wm is not None else acc

    def _unshift(self, units):
        """A quad's unit integers from codes multiplied in place (in_place): each shifted right by
        its lane's k, exactly."""
        return self.b.ashr(units, _vec(_I32, self.shifts)) if self.shifts else units

    def _scaled(self, acc, units, ws, wm, dq, xs):
        """acc + (ws * dq) * f32(units) (+ wm * xs): each rounded to f32 in that order."""
        b = self.b
        acc = b.fadd(acc, b.fmul(b.fmul(ws, dq), b.sitofp(units, _V8F)))
        return b.fadd(acc, b.fmul(wm, xs)) if wm is not None else acc


def _unsigned(layout: Layout, name: str) -> bool:
    """Signed codes (Q8_0, IQ4) on an ISA whose dot product takes u8 to 255: the several-token
    kernels take them as code + 128 (Emit.unsign)."""
    return ISA_OPS[name].wide_u8 and (layout.signed or layout.table is not None)


def seed_bias(layout: Layout, name: str) -> int:
    """The bias the several-token kernels' seed takes off each unit on ISA `name` (-bias * S;
    intdot._by_quad_seed): 128 where they take signed codes as code + 128, else the layout's own
    (u = code + bias, or 0)."""
    return 128 if _unsigned(layout, name) else layout.bias


def by_unit(b, us):
    """A quad's 4 chunks (<32 x i8>, chunk c's values in order: its first 16 in lanes 0-3 of 4
    bytes, its last 16 in lanes 4-7) -> 4 vectors v_j whose lane l holds bytes 4j..4j+3 of unit l
    (chunk l % 4, half l // 4: the quad's lane order). A 4 x 4 transpose of i32 lanes within each
    128-bit half (vpunpck*dq, vpunpck*qdq; zip on NEON). intdot._by_quad_units orders a token's xq alike.
    Two rows' chunks joined (<64 x i8>, `Emit.pair`) transpose alike, each row in its own 256 bits."""
    n = us[0].type.count // 4  # i32 lanes: 8, or 16 for two rows
    vi = ir.VectorType(_I32, n)
    v = [b.bitcast(u, vi) for u in us]

    def pattern(*offs):  # within each 128-bit group g of i32 lanes 4g..4g+3
        return _vec(_I32, [o + 4 * g for g in range(n // 4) for o in offs])

    lo32, hi32 = pattern(0, n, 1, n + 1), pattern(2, n + 2, 3, n + 3)
    lo64, hi64 = pattern(0, 1, n, n + 1), pattern(2, 3, n + 2, n + 3)
    t0, t1 = b.shuffle_vector(v[0], v[1], lo32), b.shuffle_vector(v[2], v[3], lo32)
    t2, t3 = b.shuffle_vector(v[0], v[1], hi32), b.shuffle_vector(v[2], v[3], hi32)
    out = [b.shuffle_vector(t0, t1, lo64), b.shuffle_vector(t0, t1, hi64),
           b.shuffle_vector(t2, t3, lo64), b.shuffle_vector(t2, t3, hi64)]
    return [b.bitcast(o, us[0].type) for o in out]


def _cat(b, p, q):
    """p then q, one vector twice as long."""
    return b.shuffle_vector(p, q, _vec(_I32, range(2 * p.type.count)))


def _units(b, lanes):
    """4 chunks' <8 x i32> lanes (each the sums of 4 products; 0-3 the first 16 values) -> the 8
    units' integers in quad lane order: chunk i's first half in lane i, its last in 4 + i.
    In-lane shuffles (vpunpck*dq, zip) and adds."""
    v0, v1, v2, v3 = lanes
    lo32, hi32 = _vec(_I32, [0, 8, 1, 9, 4, 12, 5, 13]), _vec(_I32, [2, 10, 3, 11, 6, 14, 7, 15])
    p01 = b.add(b.shuffle_vector(v0, v1, lo32), b.shuffle_vector(v0, v1, hi32))
    p23 = b.add(b.shuffle_vector(v2, v3, lo32), b.shuffle_vector(v2, v3, hi32))
    lo64, hi64 = _vec(_I32, [0, 1, 8, 9, 4, 5, 12, 13]), _vec(_I32, [2, 3, 10, 11, 6, 7, 14, 15])
    return b.add(b.shuffle_vector(p01, p23, lo64), b.shuffle_vector(p01, p23, hi64))


# ---------------------------------------------------------------- loops


def _loop(b: ir.IRBuilder, n, inits, body, name: str):
    """for i in range(n): values = body(i, values), n an i64 value, values IR values starting at
    inits (body may add blocks of its own); returns the values after the loop."""
    entry = b.block
    loop, done = b.append_basic_block(name + ".loop"), b.append_basic_block(name + ".done")
    b.cbranch(b.icmp_signed(">", n, ir.Constant(_I64, 0)), loop, done)
    b.position_at_end(loop)
    i, vals = b.phi(_I64), [b.phi(v.type) for v in inits]
    new = body(i, vals)
    i1, last = b.add(i, ir.Constant(_I64, 1)), b.block
    for phi, init, v in [(i, ir.Constant(_I64, 0), i1), *zip(vals, inits, new)]:
        phi.add_incoming(init, entry)
        phi.add_incoming(v, last)
    b.cbranch(b.icmp_signed("<", i1, n), loop, done)
    return _joined(b, done, inits, entry, new, last)


def _joined(b: ir.IRBuilder, done, inits, entry, new, last):
    """At the start of block `done`: each value is inits' (coming from entry) or new's (from last)."""
    b.position_at_end(done)
    outs = [b.phi(v.type) for v in inits]
    for phi, init, v in zip(outs, inits, new):
        phi.add_incoming(init, entry)
        phi.add_incoming(v, last)
    return outs


def _when(b: ir.IRBuilder, cond, inits, body, name: str):
    """values = body(values) if cond (an i1) else values; returns them."""
    entry = b.block
    then, done = b.append_basic_block(name + ".then"), b.append_basic_block(name + ".done")
    b.cbranch(cond, then, done)
    b.position_at_end(then)
    new = body(inits)
    last = b.block
    b.branch(done)
    return _joined(b, done, inits, entry, new, last)


def _quads(b: ir.IRBuilder, em: Emit, rows, nb, accs, apply, name: str, pairs: bool = False):
    """Walk a row's quads: apply(q, w, accs) -> accs for each quad q (an i64) with w the weights
    of every row there (em.quad32 or em.quads256 per row); the last, partial quad of a 32-value
    layout with its missing blocks zeroed. accs: loop-carried values (possibly none). pairs: w
    holds rows 0 and 1 joined, 2 and 3, ... (Emit.pair; a 32-value layout's unpacked together)."""
    L = em.layout
    assert not pairs or len(rows) % 2 == 0

    def joined(ws):
        return [em.pair(ws[i], ws[i + 1]) for i in range(0, len(ws), 2)] if pairs else ws

    if L.values == 256:
        def block(k, vals):
            _prefetch(b, rows, b.mul(k, ir.Constant(_I64, L.nbytes)), L.nbytes)
            per_row = [em.quads256(r, k) for r in rows]
            for h in range(2):
                vals = apply(b.add(b.mul(k, ir.Constant(_I64, 2)), ir.Constant(_I64, h)), joined([w[h] for w in per_row]), vals)
            return vals
        return _loop(b, nb, accs, block, name)
    full = b.lshr(nb, ir.Constant(_I64, 2))

    def unpack(q, valid=None):
        if pairs:
            return [em.quad32(rows[i], q, valid, other=rows[i + 1]) for i in range(0, len(rows), 2)]
        return [em.quad32(r, q, valid) for r in rows]

    def quad(q, vals):
        ws = unpack(q)
        _prefetch(b, rows, b.mul(q, ir.Constant(_I64, 4 * L.nbytes)), 4 * L.nbytes)
        return apply(q, ws, vals)

    accs = _loop(b, full, accs, quad, name)
    left = b.and_(nb, ir.Constant(_I64, 3))

    def tail(vals):
        valid = [b.icmp_signed("<", ir.Constant(_I64, i), left) for i in range(4)]
        return apply(full, unpack(full, valid), vals)

    return _when(b, b.icmp_signed("!=", left, ir.Constant(_I64, 0)), accs, tail, name + ".tail")


PREFETCH = 2048  # bytes ahead of each row's reads, into L2 (prefetcht1; PRFM PLDL2KEEP on aarch64)


def _prefetch(b: ir.IRBuilder, rows, off, step, locality: int = 2):
    """Ask for the bytes PREFETCH ahead of [row + off, row + off + step) of every row: one request
    per 64-byte line. The rows are streams the hardware prefetchers follow, but not far enough
    ahead of a kernel that keeps the core busy, and they stop at 4 KiB pages. On a Zen 4 these
    raised the 1-thread decode kernels' speed from RAM by 18-30% (Q4_0 15.4 -> 19.9 GB/s, Q4_K
    14.0 -> 16.6, Q8_0 22.3 -> 26.4, tools/bench_kernels.py --intdot's shapes; 1B Q4_0 decode
    19.8 -> 22.3 tok/s, Q4_K_M 17.3 -> 19.3, tools/bench_local.py); 1 KiB ahead or into L1 gained
    less. A prefetch never faults, so asking past a weight's end is harmless. `locality` 3 asks into
    L1 (prefetcht0, PLDL1KEEP), as the kept panels do (intgemm.KEPT_LOCALITY)."""
    fn = _decl(b.module, "llvm.prefetch.p0i8", ir.VoidType(), [ir.IntType(8).as_pointer(), _I32, _I32, _I32])
    read, locality, data = (ir.Constant(_I32, v) for v in (0, locality, 1))
    for r in rows:
        at = b.add(r, off)
        for j in range(-(-step // 64)):
            b.call(fn, [b.inttoptr(b.add(at, ir.Constant(_I64, PREFETCH + 64 * j)), ir.IntType(8).as_pointer()),
                        read, locality, data])


def _barrier(b: ir.IRBuilder):
    """A compiler barrier: no load or store moves across it (an empty asm that clobbers memory),
    and no load after it is merged with one before. A 256-value block of four rows is 64
    vectors of codes and scales; emitted all at once LLVM hoisted them ahead of their dot
    products and kept ~45 on the stack. Behind a barrier per row, only one row's codes are
    live, and the token's values are loaded again for each row (in L1; folded into the dot's
    memory operand) instead of held in registers."""
    b.asm(ir.FunctionType(ir.VoidType(), []), "", "~{memory}", [], True)


def _hsum(b, acc):
    """((acc[0] + acc[1]) + acc[2]) + ... + acc[7]."""
    h = b.extract_element(acc, ir.Constant(_I32, 0))
    for lane in range(1, 8):
        h = b.fadd(h, b.extract_element(acc, ir.Constant(_I32, lane)))
    return h


def emit_rows(b: ir.IRBuilder, layout: Layout, name: str, rows, x, tab, nb, out) -> None:
    """out[0:R] = R rows (addresses) . the token x = (xq, dq, sq, xs addresses of a Rounded), nb blocks
    a row, on ISA `name`; the accumulators live in registers."""
    em = Emit(b, layout, name, tab)
    zero = [ir.Constant(_V8F, None)] * len(rows)
    if layout.values == 256:
        def block(k, accs):  # a row at a time, both quads, behind a barrier (_barrier: why)
            _prefetch(b, rows, b.mul(k, ir.Constant(_I64, layout.nbytes)), layout.nbytes)
            out = []
            for r, acc in zip(rows, accs):
                _barrier(b)
                blk = em.block256(r, k)
                for h in range(2):
                    acc = em.quad(acc, em.half256(blk, h), em.token(x, b.add(b.mul(k, ir.Constant(_I64, 2)),
                                                                              ir.Constant(_I64, h))))
                out.append(acc)
            return out

        accs = _loop(b, nb, zero, block, "intdot")
    else:
        def apply(q, ws, accs):
            tok = em.token(x, q)
            return [em.quad(a, w, tok) for a, w in zip(accs, ws)]

        accs = _quads(b, em, rows, nb, zero, apply, "intdot")
    for r, acc in enumerate(accs):
        b.store(_hsum(b, acc), _ptr(b, out, 4 * r, _F32), align=4)


def emit_rows_tokens(b: ir.IRBuilder, layout: Layout, name: str, rows, x, ntok, tab, nb, acc, out) -> None:
    """out[t * R + r] = row r . token t for every t < ntok: R rows (addresses), x = (xq, dq, sq, xs)
    addresses of ntok Rounded tokens interleaved by quad (quad q of every token, in token order,
    then quad q + 1: what the token loop of a quad reads is adjacent), each quad's xq `by_unit`;
    acc a scratch of ntok * R * 8 f32.

    For each (row, token) this is emit_rows's arithmetic (the same integers, the same f32
    products and sums in the same order), so each result has the single-token bits; but a
    quad's codes and scales are unpacked once per row and applied to every token in turn, the
    accumulators living in acc rather than registers (their count is not known here). The
    codes are transposed `by_unit` once per row, so that each token's unit integers come from
    four chained dot products alone, without emit_rows's gathering of lanes (_units).

    What a token costs is what the token loop does per row, so everything else is done once
    elsewhere: each unit's integer starts from the token's seed -bias * S, made once per token
    (intdot._by_quad_seed); codes are unpacked whole (no in-place shifts to undo per product);
    on a u8-to-255 dot product (VNNI) signed codes come as code + 128 (Emit.unsign), so no sign
    moves onto the token's xq; on AVX-512 two rows share each 512-bit step and are unpacked
    together (quad32(other=)). Per token and pair of rows that leaves four vpdpbusd and the
    four f32 steps of the canonical arithmetic."""
    em = Emit(b, layout, name, tab, shifted=False)
    R = len(rows)

    def acc_at(t, r, ty=_V8F):  # row r's 8 f32 of token t; ty _V16F: rows r and r + 1's
        return _ptr(b, acc, b.mul(b.add(b.mul(t, ir.Constant(_I64, R)), ir.Constant(_I64, r)), ir.Constant(_I64, 32)), ty)

    def zero(t, _):
        for r in range(R):
            b.store(ir.Constant(_V8F, None), acc_at(t, r), align=4)
        return []

    _loop(b, ntok, [], zero, "tok.zero")

    pairs = em.rows512 and R % 2 == 0  # two rows a 512-bit vector (quad_by_unit_rows2)

    def apply(q, ws, _):
        ws = [(by_unit(b, us), s, m) for us, s, m in ws]  # once per row (or pair), for every token

        def each(t, _):  # the token's quad loaded once for all R rows
            tok = em.token(x, b.add(b.mul(q, ntok), t), seeded=True)
            for i, w in enumerate(ws):
                if pairs:
                    p = acc_at(t, 2 * i, _V16F)
                    b.store(em.quad_by_unit_rows2(b.load(p, align=4), w, tok), p, align=4)
                else:
                    p = acc_at(t, i)
                    b.store(em.quad_by_unit(b.load(p, align=4), w, tok), p, align=4)
            return []
        _loop(b, ntok, [], each, "tok.rows")
        return []

    _quads(b, em, rows, nb, [], apply, "tok", pairs)

    def finish(t, _):
        for r in range(R):
            off = b.mul(b.add(b.mul(t, ir.Constant(_I64, R)), ir.Constant(_I64, r)), ir.Constant(_I64, 4))
            b.store(_hsum(b, b.load(acc_at(t, r), align=4)), _ptr(b, out, off, _F32), align=4)
        return []

    _loop(b, ntok, [], finish, "tok.finish")
