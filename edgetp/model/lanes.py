"""A float32 dot product in one fixed order that vectorizes: attention's q.k.

`dot(a, b, n)` (addresses of n float32 each) sums in 16 lanes: lane l starts at +0.0 and adds
the products a[d] * b[d] of d = l, l + 16, l + 32, ... in turn (a product rounded to f32, then
the sum rounded: no fused multiply-add); then the lanes fold in halves, lane l += lane l + 8,
then l + 4, then l + 2, then l + 1, and lane 0 is the result. Every step is one IEEE operation
in that order, so every ISA returns the same bits: 16 lanes are one AVX-512 register, two AVX2
ones, four NEON ones or sixteen scalars, and LLVM may not reorder float arithmetic without
fast-math. numba cannot keep 16 sums in registers across a loop (it stores an accumulator
array back on every step), so the loop is LLVM IR in an intrinsic.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from edgetp.model.vnni import _decl, _splat, _vec

LANES = 16
_I1, _I32, _I64, _F32 = ir.IntType(1), ir.IntType(32), ir.IntType(64), ir.FloatType()
_VF = ir.VectorType(_F32, LANES)


def _fold(builder, v):
    """Lane 0 of v after lane l += lane l + w for w = 8, 4, 2, 1 (the halves of v added in turn)."""
    width = LANES
    while width > 1:
        width //= 2
        lo = builder.shuffle_vector(v, v, _vec(_I32, range(width)))
        hi = builder.shuffle_vector(v, v, _vec(_I32, range(width, 2 * width)))
        v = builder.fadd(lo, hi)
    return builder.extract_element(v, ir.Constant(_I32, 0))


def _emit_dot(builder, a, b, n):
    """The IR of dot(a, b, n): a loop over whole groups of 16, then the last n % 16 under a mask."""
    c64 = lambda v: ir.Constant(_I64, v)  # noqa: E731
    pf = _VF.as_pointer()
    zero = ir.Constant(_VF, [0.0] * LANES)
    whole = builder.and_(n, c64(-LANES))
    entry = builder.block
    loop = builder.append_basic_block("lanes.loop")
    after = builder.append_basic_block("lanes.after")
    builder.cbranch(builder.icmp_signed(">", whole, c64(0)), loop, after)

    builder.position_at_end(loop)
    i = builder.phi(_I64)
    acc = builder.phi(_VF)
    off = builder.mul(i, c64(4))
    va = builder.load(builder.inttoptr(builder.add(a, off), pf), align=4)
    vb = builder.load(builder.inttoptr(builder.add(b, off), pf), align=4)
    summed = builder.fadd(acc, builder.fmul(va, vb))
    nxt = builder.add(i, c64(LANES))
    i.add_incoming(c64(0), entry)
    i.add_incoming(nxt, loop)
    acc.add_incoming(zero, entry)
    acc.add_incoming(summed, loop)
    builder.cbranch(builder.icmp_signed("<", nxt, whole), loop, after)

    builder.position_at_end(after)
    total = builder.phi(_VF)
    total.add_incoming(zero, entry)
    total.add_incoming(summed, loop)
    rest = builder.trunc(builder.sub(n, whole), _I32)
    mask = builder.icmp_signed("<", _vec(_I32, range(LANES)), _splat(builder, rest, ir.VectorType(_I32, LANES)))
    i8p = ir.IntType(8).as_pointer()
    mload = _decl(builder.module, f"llvm.masked.load.v{LANES}f32.p0", _VF,
                  [i8p, _I32, ir.VectorType(_I1, LANES), _VF])
    off = builder.mul(whole, c64(4))
    ta = builder.call(mload, [builder.inttoptr(builder.add(a, off), i8p), ir.Constant(_I32, 4), mask, zero])
    tb = builder.call(mload, [builder.inttoptr(builder.add(b, off), i8p), ir.Constant(_I32, 4), mask, zero])
    total = builder.select(mask, builder.fadd(total, builder.fmul(ta, tb)), total)
    return _fold(builder, total)


@intrinsic
def dot(typingctx, a, b, n):
    """The float32 sum of a[d] * b[d] for d < n in the lane order above; a, b: int64 addresses of
    n float32 each (compiled code only)."""
    sig = types.float32(types.int64, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        return _emit_dot(builder, *args)

    return sig, codegen
