"""Float32 dot products in one fixed order that vectorize: attention's q.k.

The dot of a and b (addresses of n float32 each) sums in 16 lanes: lane l starts at +0.0 and adds
the products a[d] * b[d] of d = l, l + 16, l + 32, ... in turn (a product rounded to f32, then
the sum rounded: no fused multiply-add); then the lanes fold in halves, lane l += lane l + 8,
then l + 4, then l + 2, then l + 1, and lane 0 is the result. Every step is one IEEE operation
in that order, so every ISA returns the same bits: 16 lanes are one AVX-512 register, two AVX2
ones, four NEON ones or sixteen scalars, and LLVM may not reorder float arithmetic without
fast-math. numba cannot keep 16 sums in registers across a loop (it stores an accumulator
array back on every step), so the loop is LLVM IR in an intrinsic.

`scores1`, `scores2`, `scores4` give the dots of 1, 2 or 4 query rows with one key, times a
scale, each with the bits of that order alone: the key is read once for them all, and their
folds share shuffles. Attention's query heads that read one KV head go through them together.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from edgetp.model.vnni import _decl, _splat, _vec

LANES = 16
_I1, _I32, _I64, _F32 = ir.IntType(1), ir.IntType(32), ir.IntType(64), ir.FloatType()
_VF = ir.VectorType(_F32, LANES)


def _fold_heads(builder, vs):
    """One vector of len(vs) lanes, lane h the fold of vs[h]: lane l += lane l + w for w = 8, 4, 2, 1,
    then lane 0. Each head's additions are those alone, in that order; the heads are packed side by
    side so that one shuffle pair and one add serve two or four of them. len(vs) is 1, 2 or 4."""
    items = [(v, 1) for v in vs]  # (vector, heads in it), each head's lanes w wide, head after head
    width = LANES
    while width > 1:
        half = width // 2
        pairs = list(zip(items[::2], items[1::2])) if len(items) > 1 else [(items[0], None)]
        nxt = []
        for (vx, hx), other in pairs:
            vy, hy = other if other is not None else (vx, 0)
            heads = hx + hy
            lo = builder.shuffle_vector(vx, vy, _vec(_I32, [h * width + j for h in range(heads) for j in range(half)]))
            hi = builder.shuffle_vector(vx, vy, _vec(_I32, [h * width + half + j for h in range(heads)
                                                           for j in range(half)]))
            nxt.append((builder.fadd(lo, hi), heads))
        items, width = nxt, half
    return items[0][0]


def _emit_dots(builder, a, b, n, heads):
    """The IR of the dots of a + h n 4 and b (n values each) for h < heads, as one vector of `heads`
    lanes: a loop over whole groups of 16 (each of b's read once for every head), then the last
    n % 16 under a mask, then _fold_heads."""
    c64 = lambda v: ir.Constant(_I64, v)  # noqa: E731
    pf = _VF.as_pointer()
    zero = ir.Constant(_VF, [0.0] * LANES)
    rows = [builder.add(a, builder.mul(n, c64(4 * h))) for h in range(heads)]
    whole = builder.and_(n, c64(-LANES))
    entry = builder.block
    loop = builder.append_basic_block("lanes.loop")
    after = builder.append_basic_block("lanes.after")
    builder.cbranch(builder.icmp_signed(">", whole, c64(0)), loop, after)

    builder.position_at_end(loop)
    i = builder.phi(_I64)
    accs = [builder.phi(_VF) for _ in range(heads)]
    off = builder.mul(i, c64(4))
    vb = builder.load(builder.inttoptr(builder.add(b, off), pf), align=4)
    summed = [builder.fadd(acc, builder.fmul(builder.load(builder.inttoptr(builder.add(row, off), pf), align=4), vb))
              for acc, row in zip(accs, rows)]
    nxt = builder.add(i, c64(LANES))
    i.add_incoming(c64(0), entry)
    i.add_incoming(nxt, loop)
    for acc, s in zip(accs, summed):
        acc.add_incoming(zero, entry)
        acc.add_incoming(s, loop)
    builder.cbranch(builder.icmp_signed("<", nxt, whole), loop, after)

    builder.position_at_end(after)
    totals = []
    for s in summed:
        total = builder.phi(_VF)
        total.add_incoming(zero, entry)
        total.add_incoming(s, loop)
        totals.append(total)
    rest = builder.trunc(builder.sub(n, whole), _I32)
    tail = builder.append_basic_block("lanes.tail")
    done = builder.append_basic_block("lanes.done")
    builder.cbranch(builder.icmp_signed(">", rest, ir.Constant(_I32, 0)), tail, done)
    whole_only = builder.block

    builder.position_at_end(tail)  # the last n % 16 under a mask (none when n is a multiple of 16)
    mask = builder.icmp_signed("<", _vec(_I32, range(LANES)), _splat(builder, rest, ir.VectorType(_I32, LANES)))
    i8p = ir.IntType(8).as_pointer()
    mload = _decl(builder.module, f"llvm.masked.load.v{LANES}f32.p0", _VF,
                  [i8p, _I32, ir.VectorType(_I1, LANES), _VF])
    off = builder.mul(whole, c64(4))

    def masked(addr):
        return builder.call(mload, [builder.inttoptr(builder.add(addr, off), i8p), ir.Constant(_I32, 4), mask, zero])

    tb = masked(b)
    tails = [builder.select(mask, builder.fadd(total, builder.fmul(masked(row), tb)), total)
             for total, row in zip(totals, rows)]
    builder.branch(done)

    builder.position_at_end(done)
    lasts = []
    for total, t in zip(totals, tails):
        last = builder.phi(_VF)
        last.add_incoming(total, whole_only)
        last.add_incoming(t, tail)
        lasts.append(last)
    return _fold_heads(builder, lasts)


def _scores(heads: int):
    @intrinsic
    def scores(typingctx, a, b, n, out, stride, scale):
        """out[h * stride] = (the dot of a + h n 4 and b, n values each) * scale for h < heads (float32 at
        address out, stride in values): the dots of `heads` query rows, n float32 apart, with one key b."""
        sig = types.void(types.int64, types.int64, types.int64, types.int64, types.int64, types.float32)

        def codegen(context, builder, signature, args):
            a, b, n, out, stride, scale = args
            v = builder.fmul(_emit_dots(builder, a, b, n, heads), _splat(builder, scale, ir.VectorType(_F32, heads)))
            step = builder.mul(stride, ir.Constant(_I64, 4))
            for h in range(heads):
                at = builder.add(out, builder.mul(step, ir.Constant(_I64, h)))
                builder.store(builder.extract_element(v, ir.Constant(_I32, h)),
                              builder.inttoptr(at, _F32.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return scores


scores1, scores2, scores4 = _scores(1), _scores(2), _scores(4)
