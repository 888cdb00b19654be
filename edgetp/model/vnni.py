"""What the integer kernels share: ggml's activation rounding and LLVM-IR helpers.

`q8_halves` rounds a block of 32 activations to int8 exactly as ggml's x86
quantize_row_q8_0 does (scale d = max|x|/127 stored as f16, q =
round-half-even(x * 127/max|x|)): the integer decode kernels of every ISA
(`intdot.py`) and the Q4_0 prefill panels (`intgemm.py`) round with it, so
they agree with llama.cpp's arithmetic. `wanted()` says whether the integer
prefill kernels may run (EDGETP_INT8 is not 0 and the ISA is one this CPU
runs), `checked()` runs a probe of compiled kernels and turns any failure into
a logged False.

numba cannot express `vpdpbusd`, `vpmaddubsw` or `sdot`, so those kernels are
LLVM IR in numba intrinsics, built with the helpers below, for the ISA in use
only (isa.py, EDGETP_ISA): LLVM aborts on instructions the CPU it compiles for
lacks.
"""

from __future__ import annotations

import logging

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from edgetp.model import isa

log = logging.getLogger(__name__)

_OPTS = dict(cache=True, nogil=True)

_I32, _I64, _F32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
_V16I32, _V16F = ir.VectorType(_I32, 16), ir.VectorType(_F32, 16)


def _vec(ty, vals):
    """A constant integer vector of type ty (numpy integers welcome)."""
    return ir.Constant(ir.VectorType(ty, len(vals)), [ir.Constant(ty, int(v)) for v in vals])


def _splat(builder, value, vty):
    """value (a scalar) in every lane of vector type vty."""
    v = builder.insert_element(ir.Constant(vty, None), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, v, _vec(_I32, [0] * vty.count))


def _decl(module, name, ret, args):
    fn = module.globals.get(name)
    return fn if fn is not None else ir.Function(module, ir.FunctionType(ret, args), name)


def _at(builder, addr, offset, ty):
    """Pointer of type ty* at integer address addr + offset."""
    if offset:
        addr = builder.add(addr, ir.Constant(_I64, offset))
    return builder.inttoptr(addr, ty.as_pointer())


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


_V32I32, _V32F, _V16I = ir.VectorType(_I32, 32), ir.VectorType(_F32, 32), ir.VectorType(_I32, 16)
# y + 1.5 * 2**23 - 1.5 * 2**23, each step rounded to f32, is y rounded half to even for |y| < 2**22
# (|y| <= 127 here): np.rint's value, in two plain vector adds on every ISA (no SSE4.1 or libm call)
_MAGIC = 12582912.0


@intrinsic
def _absmax32(typingctx, src):
    """max |x| over the 32 f32 at address src: the largest of their bits with the sign cleared
    (non-negative floats order as their bits do), one vector reduction."""
    def codegen(context, builder, signature, args):
        v = builder.load(_at(builder, args[0], 0, _V32I32), align=4)
        m = builder.and_(v, _vec(_I32, [0x7FFFFFFF] * 32))
        top = builder.call(_decl(builder.module, "llvm.vector.reduce.umax.v32i32", _I32, [_V32I32]), [m])
        return builder.bitcast(top, _F32)

    return types.float32(types.int64), codegen


@intrinsic
def _round32(typingctx, src, dst, inv):
    """The 32 f32 at src times inv, rounded half to even, stored as int8 at dst; returns the sums
    of the first and the last 16, packed (first in the low 32 bits)."""
    def codegen(context, builder, signature, args):
        s, d, k = args
        y = builder.fmul(builder.load(_at(builder, s, 0, _V32F), align=4), _splat(builder, k, _V32F))
        magic = ir.Constant(_V32F, [ir.Constant(_F32, _MAGIC)] * 32)
        q = builder.fptosi(builder.fsub(builder.fadd(y, magic), magic), _V32I32)
        builder.store(builder.trunc(q, ir.VectorType(ir.IntType(8), 32)), _at(builder, d, 0, ir.VectorType(ir.IntType(8), 32)),
                      align=1)
        add = _decl(builder.module, "llvm.vector.reduce.add.v16i32", _I32, [_V16I])
        halves = [builder.call(add, [builder.shuffle_vector(q, q, _vec(_I32, range(h, h + 16)))]) for h in (0, 16)]
        lo, hi = (builder.zext(v, _I64) for v in halves)
        return builder.or_(lo, builder.shl(hi, ir.Constant(_I64, 32)))

    return types.int64(types.int64, types.int64, types.float32), codegen


@njit(inline="always", **_OPTS)
def q8_halves(src, dst, f, u):
    """One block of 32 activations rounded like ggml's x86 quantize_row_q8_0: the 32 f32 at
    address src to int8 at address dst, returns (d, sum of the first 16, sum of the last 16).
    f/u as for _f16_round. In vector steps: max |x| from the bits, then x * 127/max rounded.
    Addresses, not array slices: a slice's reference counting cost more than the block's work."""
    amax = _absmax32(src)
    d = _f16_round(amax / np.float32(127.0), f, u)
    inv = np.float32(127.0) / amax if amax != 0 else np.float32(0.0)
    both = _round32(src, dst, inv)
    return d, np.int32(both & 0xFFFFFFFF), np.int32(both >> 32)


def wanted() -> bool:
    """True when the integer prefill kernels (intgemm.py, a tile for every ISA) should run
    here: EDGETP_INT8 is not 0 and the ISA in use (isa.py, EDGETP_ISA) is one this CPU
    runs, other than generic. `intgemm.available()` also probes them.

    The generic tile stays out of prefill: without FMA in the target its fused steps are
    library calls, 9.7-15 GOPS against 59-81 for sgemm on decoded tiles (AMD EPYC, one
    core), and a CPU on the generic path (an AVX laptop) has no FMA either. Its prefill
    bits then differ from the integer ISAs' within the float bound (tests/test_isa_float.py).
    """
    try:
        return isa.int8() and isa.current() in isa.ISAS and isa.current() != "generic"
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
