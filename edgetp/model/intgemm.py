"""Prefill products on every ISA: the GGUF types whose weights are integer codes times
scales (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, and IQ4_NL and IQ4_XS,
whose codes index a code book; the float types prefill on sgemm, quant.py).

Decode reads every weight once per token, so it is bound by memory (`intdot.py`,
`kernels.py`). Prefill reuses each weight for every token of the batch, so it
is bound by arithmetic. On AVX-512 VNNI, f32 sgemm peaks near 116 GFLOP/s on one
core, and VNNI tiles with 16 columns per register reached only 63-80 GOPS: every
block cost an unpack, a conversion and two scale products per row and token.

Here the lanes of a register are rows, not columns. A panel of rows (16 on
avx512vnni, 8 elsewhere: `Shape`) is packed once per batch (`_emit_pack`, from the
type's intdot_layouts row through the decode kernels' emitter, so decode and prefill
read one description of each block):
  q: per block of 32 values, 4 (codes of at most 4 bits, or a code book's indices: nibbles) or 8 (bytes) vectors, or a vector per
     bit of each plane the type's block holds its codes in (`PLANES`): the 5- and 6-bit types 4 of their
     low nibbles and 1 (Q5_0, Q5_1, Q5_K) or 2 (Q6_K) of their top bits, Q3_K 2 of its low 2 bits and 1
     of its top bit, Q2_K 2 of its 2-bit codes;
     vector g holds the g-th 4 bytes of the block for each row of the panel;
  d: per unit, the rows' scales (f32), and for the offset types m, their offsets. A unit
     is a block of 32 values, or each 16 of it where the type scales each 16 (Q2_K, Q3_K,
     Q6_K). A K-quant's unit is a plain block with d = d * sc and m = -(dmin * mn),
     exact in f32 as the dequantizer forms them.
One dot product then multiplies 4 (int8) or 2 (int16) columns of every row by
the same activations, broadcast from memory. A block of 32 columns goes into one
integer accumulator per token; only then is it converted and scaled, once per
block for all rows: sum = fma(float(acc) * dx[t, b], d[b], sum).

Kept panels (KEPT: every type here but Q8_0). A type whose panel is about as large as its GGUF blocks
is packed once per weight (`pack`, `Panels`; where the ISA converts f16 in registers, Q4_0's scales
and Q4_1's scales and offsets stay f16, and the K-quants' stay as their blocks have them, d (and
dmin) in f16 and a byte per scale (and min): `compact`; Q5_0's f16 scale as Q4_0's) and decode reads the panels too (`Kept`):
one token or several, in tiles of exactly that many tokens (`_tile_n`), each token's row the float
steps above whatever tile holds it. So a token's products are the same bits in decode, in a batched decode step and
in prefill, and a batch of decode tokens costs one float step per 32 values (per 16 where a type
scales each 16) for a whole panel of rows. Q4_1 is WIDE: its decode rounds each token to 16 bits
as its prefill does (`decode_x`; `round16_row`, which decode.py's steps call as they call
intdot.round_into), not to int8 as intdot's decode kernels do.

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
  int8 (every type but WIDE's) exactly as `vnni.q8_halves` does (ggml's x86 quantize_row_q8_0),
        as decode rounds them. Unsigned codes u = q + bias times x; the accumulator of a unit
        starts at -bias * sum(x) over it. On AVX2 the products go through 16 bits:
        `Kind.operands` bounds how many are summed there before vpmaddwd widens them (fewer
        for wider codes). Offset types add m[u] * dx * sum(x) per unit.
        Signed codes (Q8_0's, int8 in the panel, and IQ4_NL's and IQ4_XS's code book values,
        -127..113, looked up in registers from the panel's nibble indices since 4 Dec) are
        multiplied as each ISA's instructions allow
        (`_Mac.signed`): vpdpbusd takes code + 128 (its top bit flipped) with a seed of
        -128 * sum(x); AVX2 takes |code| times x with the code's sign (vpabsb, vpsignb;
        each operand widened on its own); sdot and the generic ISA take them as they are.
        The integer sums are the same, so the bits are too. They were 16-bit (WIDE)
        until 28 Nov; on a Zen 4 (one core, 256 tokens, tools/bench_intgemm.py) Q8_0
        and IQ4 went from 170-180 to 290-310 GOPS on avx512vnni and stayed at
        115-120 on avx2, where an operand costs vpsignb, vpmaddubsw, vpmaddwd and an
        add either way. Their logits are then as close to the exact math as llama.cpp's,
        which rounds their activations to int8 too (tests/test_engine_reference.py,
        tests/test_llamacpp_types.py).
  WIDE (Q4_1, Q5_1) to int16 (scale max|x| / 32767, f32), products of 16-bit
        weight pairs unpacked from the panel in registers. Int8 activations flip SmolLM2's
        first answer token (a 0.08-logit tie: "L'Etoile..." instead of "The capital of
        France is Paris"), as they do in llama.cpp; 16 bits keep the logits
        within 3e-4 of their spread of the exact math. Q5_1 follows Q4_1: the
        32-value type with an offset and the most bits per value.

AVX-512 VNNI, one core, 256 tokens, 2048- and 8192-column shapes: ~270 GOPS
(int8) and ~155 GOPS (int16), against ~80 for f32 sgemm on decoded tiles.
A prefill chunk is 64 tokens (batch.PREFILL_CHUNK), and a type whose panels are
not kept packs them for each chunk: packed a row at a time, 4-byte words 4 * P
bytes apart, that was half of a 64-token Q8_0 or Q5_0 product (Zen 4, one core,
8192 x 2048: 10.2 and 10.0 ms). `_emit_pack` now packs a block of all P rows at
once, their words transposed in registers and each panel vector stored whole:
7.5 and 7.7 ms (Q5_K 11.3 -> 10.4; Q4_1, whose int16 products bind it, 13.4 either
way; Q4_0's kept pack at load 1.2 -> 1.0 ms). Read across its rows, the weight lost
the hardware prefetchers from one panel to the next (SmolLM2's 576-wide Q5_0 weights,
from RAM, packed 8% slower than row by row), so each row's block of the next panel is
asked for: Q5_0 6.9 ms.

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import gguf.quants
import numpy as np
from gguf import GGMLQuantizationType as QT
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from edgetp.model import intdot, intdot_ir, isa, vnni
from edgetp.model import intdot_layouts as IL
from edgetp.model.kernels import f16_table
from edgetp.model.vnni import _F32, _I32, _I64, _at, _decl, _splat, _vec, q8_halves

PAD = 8  # x is padded to a multiple of PAD tokens: whole tiles on every ISA
_OPTS = dict(cache=True, nogil=True)


@dataclass(frozen=True)
class Kind:
    """How the tile multiplies one GGUF type, all derived from its intdot_layouts row (`_kind`)."""

    qtype: int
    nbytes: int  # per GGUF block
    sub: int  # blocks of 32 values per GGUF block
    wide: bool  # 16-bit activations (WIDE), else int8
    nibbles: bool  # codes packed two per byte (value k low, 16 + k high: 4 vectors per 32), else one per byte (8)
    signed: bool  # the weights are int8 (Q8_0's, as the panel holds them; IQ4's code book values, looked up from
    #               the panel's indices), else unsigned u, the weight u - bias (int8 activations: each ISA
    #               multiplies signed weights as `_Mac.signed` says)
    bias: int
    units: int  # scales (and offsets) per 32 values: 2 where each 16 has its own (Q2_K, Q3_K, Q6_K)
    offset: bool  # values are d * q + m: the panel carries m
    umax: int  # the largest unsigned code
    halves: tuple[int, ...]  # where a GGUF block keeps its f16 scales and offsets
    planes: tuple[int, ...] = ()  # codes as planes of these many bits each, the lowest bits first, a plane
    #                               of b bits b vectors (PLANES: Q5_0, Q5_1, Q5_K, Q6_K, Q3_K, Q2_K); (): one plane
    table: tuple[int, ...] | None = None  # a code book (IQ4_NL, IQ4_XS): the panel holds each value's index as a
    #                                        nibble, and the tile looks the int8 weights up (`_looked_up`)

    @property
    def groups(self) -> int:
        return sum(self.planes) if self.planes else 4 if self.nibbles else 8

    @property
    def operands(self) -> int:
        """int8 kinds: packed vectors (4 values per row each) summed in 16 bits before vpmaddwd widens
        them. A vpmaddubsw pair is at most 2 * umax * 128, so operands * 256 * umax <= 32767: umax 15
        (Q4: 8 operands, 30720), 31 (Q5: 4, 31744), 63 (Q6_K: 2, 32256), 7 (Q3_K), 3 (Q2_K), and 127
        for signed codes (1: |code| <= 128 times |x| <= 127, 32512 a pair)."""
        return 32767 // (256 * self.umax)


# 16-bit activations (see the module docstring). Q8_0's codes and IQ4_NL's and IQ4_XS's code book
# values (-127..113) are packed as signed bytes and multiplied as each ISA takes them (`_Mac.signed`)
WIDE = (QT.Q4_1, QT.Q5_1)
# every type whose weight is an integer code (or a code book's value) times a scale, plus an offset
TYPES = (QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K,
         QT.IQ4_NL, QT.IQ4_XS)


# Types whose panels hold their codes in planes, as their blocks do (qtype: each plane's bits, the lowest
# first; _chunk_bytes packs them, _plane_operands joins them): the 5- and 6-bit types a nibble plane and a
# plane of each code's top 1 or 2 bits, 20 (Q5_0, Q5_1, Q5_K) or 24 (Q6_K) bytes per 32 values and row;
# Q3_K a plane of 2 bits and one of 1, 12 bytes; Q2_K one plane of 2 bits, 8 bytes; one code a byte takes 32
PLANES = {QT.Q5_0: (4, 1), QT.Q5_1: (4, 1), QT.Q5_K: (4, 1), QT.Q6_K: (4, 2), QT.Q3_K: (2, 1), QT.Q2_K: (2,)}


def _kind(qtype: int) -> Kind:
    L = IL.LAYOUTS[qtype]
    assert L.values % 32 == 0, qtype
    signed = L.signed or L.table is not None  # the panel holds int8 weights
    umax = L.umax  # the largest unsigned code (128 for signed ones, which the panel holds as int8: 127 below)
    units = 2 if L.split else 1
    halves = sorted({s.d for s in L.slots} | {s.m for s in L.slots if s.m is not None})
    assert not (signed and qtype in WIDE), qtype  # signed codes take int8 activations (_Mac.signed)
    nibbles = units == 1 and (L.table is not None or (umax < 16 and not signed))  # a code book's indices are nibbles
    return Kind(int(qtype), L.nbytes, L.values // 32, qtype in WIDE, nibbles, signed, L.bias, units, L.offset,
                127 if signed else umax, tuple(halves), PLANES.get(qtype, ()), L.table)


KINDS: dict[int, Kind] = {int(qt): _kind(qt) for qt in TYPES}

# Types whose panel is about the size of their GGUF blocks: Q4_0's nibbles and one f16 scale per 32
# values, 18 bytes either way; Q4_K's nibbles and its block's scales unpacked to bytes (`compact`),
# 148 bytes per 256 values where the block has 144; Q6_K's two planes and its d and int8 scales,
# 210 bytes as its block; Q5_0's nibble and top-bit planes and f16 scale, 22 bytes per 32 values as its
# block (Q5_1's, with its f16 offset, 24 as its block); Q5_K's two planes and scales as Q4_K's, 180
# bytes per 256 values where its block has 176 (the types of llama.cpp's Q4_K_M and Q5_K_M files, Q5_0
# and Q5_1 where a width is no multiple of 256, as SmolLM2's 576). Their panels are packed once per
# weight (`Panels`) and kept, and decode reads them too (`Kept`): one token or several, each token's row
# the bits prefill gives it. Rows in lanes take one float step per 32 values for a whole panel of
# rows, where the decode kernels (intdot) take four per pair of rows, so several tokens cost less
# (Emerald Rapids, one core, 65536 x 2048 Q4_0 from RAM: 8 tokens 8.8 ms against 12.6, one token
# 6.4 against 6.0 with f32 scales), and on a Zen 4 one token does too (one core, 8192 x 2048 and
# 2048 x 8192 from RAM, tools/bench_kernels.py --intdot: Q4_K 28.8 and 25.8 GB/s against intdot's
# 15.9 and 17.4; 8 tokens 0.91 ms against 1.77; Q6_K 27.9 and 21.7 against 20.8 and 24.8, 8 tokens
# 1.00 ms against 1.70 and 1.58: the wide shape, as ffn_down, reads slower from panels, the tall
# one, as the output layer, faster). Q4_1's nibbles and f16 d and m are 20 bytes per 32 values either
# way; its products take 16-bit activations (WIDE), in decode too, and still cost less than intdot's
# int8 ones, which reduce each row's 8 unit sums and pad a row's last quad (SmolLM2's 576 columns are
# 4.5 quads). Zen 5 VM, one core, from RAM (tools/bench_kernels.py --intdot --types Q4_1), one token,
# kept over intdot's GB/s: SmolLM2's 3072x576 (gate+up), 576x1536 (down), 960x576 (qkv) and 49152x576
# 3.6, 2.3, 3.4, 2.4x on avx512vnni, 2.3, 1.6, 2.5, 2.4x on avxvnni, 2.6, 1.8, 2.7, 2.5x on avx2; a
# 1B's 8192x2048 and 2048x8192 1.14-1.42x. 8 tokens: 1.2-2.7x faster, but 0.84-0.97x at the 1B shapes
# on avxvnni and avx2 (256-bit int16 products bind them there). Q3_K's panels hold its planes of 2 and
# 1 bits, d and a byte per 16 values' scale less its bias, 114 bytes per 256 values where its block has
# 110; Q2_K's its 2-bit plane, d, dmin and a byte per scale and per min, 100 where it has 84 (one code a
# byte and f32 scales took 320 and 384). Zen 4, one core, from RAM, one token, kept over intdot's GB/s
# at 8192x2048 and 2048x8192: Q2_K 2.4 and 2.1x, Q3_K 2.4 and 2.0x on avx512vnni; 1.7 and 1.6x, 1.6 and
# 1.4x on forced avx2; 8 tokens 1.45-1.76x and 1.09-1.11x. IQ4_NL's and IQ4_XS's panels hold each value's
# index into the code book as a nibble, and the tile looks the values up with the ISA's byte shuffle
# (`_looked_up`, once per operand for every token of the tile): IQ4_NL's f16 d as Q4_0's, 18 bytes per 32
# values as its block; IQ4_XS's d and a byte per 32 values' scale less its bias (`Compact`), 138 per 256
# where its block has 136. Zen 4 (qemu on the other core), one core, from RAM, one token, kept over
# intdot's GB/s at 8192x2048, 2048x8192, 3072x576 and 49152x576: IQ4_NL 1.8, 1.6, 3.1, 2.7x on avx512vnni
# and 3.0, 2.7, 3.5, 3.4x on forced avx2; IQ4_XS (the 1B shapes) 2.4, 1.9x and 1.6, 1.5x; 8 tokens
# 2.0-2.9x and 1.3-1.6x. Q8_0's, with an f16
# scale, would be its block's size, but decode from them was no faster at a 1B's widths and held an
# 8-bit file twice (Zen 4, 3 Dec: 12.98 tok/s at 3.5 GB peak RSS against intdot's 13.86 at 1.9 GB),
# so it stays on intdot too. Q5_1's products take 16-bit activations as Q4_1's do (each 4 codes'
# bytes split into two 16-bit pairs in registers). (The generic ISA, which converts f16 through a
# table, keeps f32 scales: Q4_1's panels take 24 bytes per 32 values, Q4_K's 192 per 256, Q6_K's 256,
# Q3_K's 160, Q2_K's 192, IQ4_NL's 20 per 32, IQ4_XS's 160 per 256, for decode bits the same as every other
# ISA's; its code book lookup is 16 compares and selects.)
KEPT = frozenset({int(QT.Q4_0), int(QT.Q4_1), int(QT.Q5_0), int(QT.Q5_1), int(QT.Q4_K), int(QT.Q5_K), int(QT.Q6_K),
                  int(QT.Q3_K), int(QT.Q2_K), int(QT.IQ4_NL), int(QT.IQ4_XS)})


# bytes ahead of a kept panel's codes to prefetch (its scales: intdot_ir.PREFETCH). Emerald Rapids, one
# core, 65536 x 2048 Q4_0 from RAM, min of 40, one token / 8 tokens (ms): 1 KiB 7.8 / 10.9,
# 2 KiB 5.7 / 8.2, 4 KiB 5.4 / 7.7, 8 KiB 5.3 / 8.0; the scales not prefetched, 5-10% slower.
KEPT_PREFETCH = 4096
# ... into L1 (prefetcht0), not L2 as intdot's rows: on the Zen 4, one core, 8192 x 2048 and 2048 x 8192
# from RAM (tools/bench_kernels.py --intdot), kept panels read Q4_K 19.0-22.8 GB/s into L2 against
# 23.8-29.0 into L1 (three rounds each), Q4_0 20.1-20.7 against 25.6-27.8, Q6_K 21.1-21.6 against
# 25.4-26.3; forced avx2 Q4_0 20.7-24.2 against 21.1-30.6, Q4_K level within the noise. intdot's own
# rows gained nothing from it (Q4_K 15.3-16.9 either way) and keep L2.
KEPT_LOCALITY = 3


def half(qtype: int, which: str) -> bool:
    """Whether qtype's panels hold its f16 scale (and offset) per 32 values as it is on ISA `which`
    (Q4_0 and Q4_1, KEPT, and the ISA converts f16 in registers); f32 otherwise (the generic ISA
    converts through a table)."""
    return qtype in KEPT and KINDS[qtype].sub == 1 and intdot_ir.ISA_OPS[which].fpext


def compact(qtype: int, which: str) -> bool:
    """Whether qtype's panels keep a K-quant block's scales as the block has them, unpacked, on
    ISA `which` (`Compact`): per 256 values and row, Q4_K's f16 d and dmin and a byte per 6-bit
    scale and min (20 bytes, where f32 d * sc and -(dmin * mn) per 32 take 64), Q6_K's f16 d and
    16 int8 scales (18, where f32 d * sc per 16 take 64), Q3_K's f16 d and 16 6-bit scales less
    their bias 32 as int8 (18), Q2_K's f16 d and dmin and a byte per 4-bit scale and min (36, where
    f32 per 16 take 128). The tile forms d * sc and -(dmin * mn) in registers, the same f32
    products the packer forms otherwise. IQ4_XS's f16 d and 8 6-bit scales less their bias as int8
    (10). The types of COMPACT (KEPT), on an ISA that converts f16 in registers."""
    return qtype in KEPT and qtype in COMPACT and intdot_ir.ISA_OPS[which].fpext


class Compact(NamedTuple):
    """Where a compact panel keeps one K block's scales, per row, in units of the panel's rows P:
    d (f16) at 0, dmin (f16) at 2P if `mins`, then a byte per slot's scale (int8 if `int8`),
    then a byte per slot's min; `nbytes` * P bytes in all."""

    slots: int  # scales per 256 values: 8 (one per 32) or 16 (one per 16)
    mins: bool
    int8: bool  # the scale bytes are int8: Q6_K's as its block has them, Q3_K's less their bias
    bias: int = 0  # taken from each scale as it is packed (Q3_K's 32): its byte is then the integer d is multiplied by

    @property
    def nbytes(self) -> int:
        return 2 + 2 * self.mins + self.slots * (1 + self.mins)

    @property
    def sc(self) -> int:
        return 2 + 2 * self.mins


def _compact(qtype) -> Compact:
    s0 = IL.LAYOUTS[qtype].slots[0]
    assert (s0.m is None) == (not s0.mn)
    top = functools.reduce(lambda a, f: a | f.mask << f.pos, s0.sc, 0)  # the largest scale
    assert not s0.sc_bias or (not s0.sc_int8 and s0.sc_bias <= 128 and top - s0.sc_bias <= 127), qtype  # an int8 byte
    return Compact(len(IL.LAYOUTS[qtype].slots), s0.m is not None, s0.sc_int8 or bool(s0.sc_bias), s0.sc_bias)


# per 256 values and row: Q4_K and Q5_K 20 bytes, Q6_K and Q3_K 18, Q2_K 36, IQ4_XS 10
COMPACT = {int(qt): _compact(qt) for qt in (QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q3_K, QT.Q2_K, QT.IQ4_XS)}

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
    """An ISA's integer products of one block: weights(v) once per operand (a code book's values
    are looked up as book(table) has them, and weights() is left out where it adds signed_bias);
    begin(seed) -> acc; mac(acc, w, x) per operand and token; end(acc, seed) -> <lanes x i32>, each lane the exact
    sum over the block of one row's products plus seed. v and x are <lanes x i32>: 4 bytes (int8:
    unsigned codes, or signed ones (`signed`: Q8_0, IQ4's code book values), times signed
    activations) or 2 words (wide: signed times signed) per lane. Signed codes are taken as
    the ISA's instructions take them; `signed_bias` is what that adds to each code (the seed
    then takes it away, as a type's own bias)."""

    chains = 1  # independent i32 sums a block's products are spread over (added at its end: exact)
    signed_bias = 0

    def __init__(self, b, lanes: int, wide: bool, signed: bool = False):
        self.b, self.lanes, self.wide, self.signed = b, lanes, wide, signed and not wide

    def weights(self, v):
        return v

    def book(self, table):
        """A code book's int8 values as weights() would make each (plus signed_bias, as a byte)."""
        return [(t + self.signed_bias + 128) % 256 - 128 for t in table]

    def begin(self, seed):
        return seed

    def end(self, acc, seed):
        return acc


class _Vnni(_Mac):
    """vpdpbusd / vpdpwssd: four u8 x s8 (two s16 x s16) products added into each i32 lane;
    512 bits wide on avx512vnni, 256 (VEX) on avxvnni. An int8 block of 8 or more operands per
    token goes into two chains, even and odd operands, so that each vpdpbusd waits on the one
    before it but one (Emerald Rapids, 2048 x 2048, 256 tokens, best of 11, three A/B runs: Q4_0
    277-300 -> 287-313 GOPS on avx512vnni, 181-188 -> 203-209 on avxvnni; Q4_K and Q5_0 +1-6%;
    Q6_K's 4 operands a unit keep one chain, as do the wide types, which gained nothing)."""

    chains = 2
    signed_bias = 128  # vpdpbusd's weights are unsigned: a signed code as code + 128, its top bit flipped

    def weights(self, v):
        return self.b.xor(v, _vec(_I32, [0x80808080] * self.lanes)) if self.signed else v

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
    wide: vpmaddwd (s16 x s16, pairs added in i32) then vpaddd, as vpdpwssd does in one.
    signed int8 codes: |code| x (x with the code's sign) (vpabsb once per operand, vpsignb per
    token, as intdot_ir does): a pair is at most 2 * 128 * 127 = 32512, so each operand is
    widened on its own (Kind.operands is 1)."""

    def weights(self, v):
        if not self.signed:
            return v
        b, v8 = self.b, _vty(self.lanes, _I8, 4)
        w = b.bitcast(v, v8)
        return b.call(_decl(b.module, f"llvm.abs.v{4 * self.lanes}i8", v8, [v8, ir.IntType(1)]),
                      [w, ir.Constant(ir.IntType(1), 0)]), w

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
        x = b.bitcast(x, v8)
        if self.signed:
            w, sign = w
            x = b.call(_decl(b.module, "llvm.x86.avx2.psign.b", v8, [v8] * 2), [x, sign])
        fn = _decl(b.module, "llvm.x86.avx2.pmadd.ub.sw", v16, [v8] * 2)
        return b.add(acc, b.call(fn, [b.bitcast(w, v8), x]))

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
        p = b.mul((b.sext if self.signed else b.zext)(b.bitcast(w, v8), v16), b.sext(b.bitcast(x, v8), v16))
        return b.add(acc, self._pairs(p))

    def end(self, acc, seed):
        if self.wide:
            return acc
        return self.b.add(self._pairs(self.b.sext(acc, _vty(self.lanes, _I32, 2))), seed)


class _Neon(_Generic):
    """int8: sdot (four s8 x s8 products into each i32 lane; nibbles 0..15 and signed codes are s8),
    on 128-bit halves; wide: smull (four s16 x s16 products widened to i32) on each half of a
    128-bit vector's 8 words, then addp, the pairs' sums: _Generic's integers, asked for by name
    (left to LLVM, Q5_1's plane-joined codes became sign extensions and 32-bit multiplies)."""

    def begin(self, seed):
        return seed

    def _wide(self, acc, w, x):
        b = self.b
        v4, v8h, v4h = _vty(4), _vty(4, _I16, 2), _vty(4, _I16)
        smull = _decl(b.module, "llvm.aarch64.neon.smull.v4i32", v4, [v4h, v4h])
        addp = _decl(b.module, "llvm.aarch64.neon.addp.v4i32", v4, [v4, v4])
        lo, hi = _vec(_I32, range(4)), _vec(_I32, range(4, 8))
        parts = []
        for h in range(self.lanes // 4):
            sel = _vec(_I32, range(4 * h, 4 * h + 4))
            w16, x16 = (b.bitcast(b.shuffle_vector(v, v, sel), v8h) for v in (w, x))
            products = [b.call(smull, [b.shuffle_vector(w16, w16, side), b.shuffle_vector(x16, x16, side)])
                        for side in (lo, hi)]
            parts.append(b.add(b.shuffle_vector(acc, acc, sel), b.call(addp, products)))
        return parts

    def mac(self, acc, w, x):
        if self.wide:
            return _joined(self.b, self._wide(acc, w, x))
        b = self.b
        v4, v16 = _vty(4), _vty(4, _I8, 4)
        fn = _decl(b.module, "llvm.aarch64.neon.sdot.v4i32.v16i8", v4, [v4, v16, v16])
        parts = []
        for h in range(self.lanes // 4):
            sel = _vec(_I32, range(4 * h, 4 * h + 4))
            parts.append(b.call(fn, [b.shuffle_vector(acc, acc, sel), b.bitcast(b.shuffle_vector(w, w, sel), v16),
                                     b.bitcast(b.shuffle_vector(x, x, sel), v16)]))
        return _joined(b, parts)

    def end(self, acc, seed):
        return acc


def _joined(b, parts):
    """<4 x i32> vectors, in order, as one vector of all their lanes."""
    while len(parts) > 1:
        parts = [b.shuffle_vector(parts[i], parts[i + 1], _vec(_I32, range(2 * parts[i].type.count)))
                 for i in range(0, len(parts), 2)]
    return parts[0]


# isa -> (its products, its tile shape)
ISA_TILES = {
    "avx512vnni": (_Vnni, Shape(16, 8)),  # 4..8 tokens ran alike (270-280 GOPS), 12 fell off, 16 spilled
    "avxvnni": (_Vnni, Shape(8, 4)),  # as avx2; Emerald Rapids, 1 run: 8 tokens Q4_0/Q8_0/Q4_K +3-15%, Q6_K -11%
    "avx2": (_Avx2, Shape(8, 4)),  # see the module docstring
    "neon": (_Neon, Shape(8, 4)),
    "generic": (_Generic, Shape(8, 4)),
}
assert all(PAD % s.nt == 0 for _, s in ISA_TILES.values())


# ---------------------------------------------------------------- the tile


def _operands(builder, k: Kind, v, g, lanes):
    """The multiplicand vectors in one loaded panel vector (group g of a block), each
    with the byte offset of its activation pair/quad in the block's activation row."""
    i32 = _vec(_I32, [0x0F0F0F0F] * lanes)
    if not k.wide:
        if not k.nibbles:  # bytes: columns 4g.., unsigned or signed codes, x int8
            return [(v, 4 * g)]
        # columns 4g.. (low nibbles) and 16+4g.. (high), x int8
        return [(builder.and_(v, i32), 4 * g), (builder.and_(builder.lshr(v, _vec(_I32, [4] * lanes)), i32), 16 + 4 * g)]
    if not k.nibbles:  # unsigned bytes: the same pairs, zero-extended
        return _pairs16(builder, v, 4 * g, lanes)
    out = []
    for nib, col in ((builder.and_(v, i32), 4 * g), (builder.and_(builder.lshr(v, _vec(_I32, [4] * lanes)), i32), 16 + 4 * g)):
        out += _pairs16(builder, nib, col, lanes)
    return out


def _pairs16(builder, v, col: int, lanes: int):
    """v's 4 bytes per lane (codes of values col..col+3, unsigned) as two wide multiplicands, 16-bit
    pairs (col, col + 2) and (col + 1, col + 3), each with the byte offset of its activation pair in
    the block's 16-bit row (quantize16 stores each 4 values as 0, 2, 1, 3)."""
    low = _vec(_I32, [0x00FF00FF] * lanes)
    return [(builder.and_(v, low), 2 * col), (builder.and_(builder.lshr(v, _vec(_I32, [8] * lanes)), low), 2 * col + 4)]


def _looked_up(builder, which: str, table, idx, L: int):
    """<L x i32> of code book indices (a byte each, 0..15) as the book's int8 values: the ISA's byte
    shuffle (vpshufb, 512 bits on avx512vnni; tbl; generic: selects), as intdot's decode looks them up."""
    v = builder.bitcast(idx, _vty(L, _I8, 4))
    if 4 * L == 64:
        looked = intdot_ir.lookup512(builder, table, v)
    else:
        assert 4 * L == 32, L
        looked = intdot_ir.ISA_OPS[which].lookup(builder, table, v)
    return builder.bitcast(looked, _vty(L))


def _plane_operands(builder, k: Kind, qb, u: int, L: int):
    """A planes kind's multiplicands of unit u of the block at qb (values 32u/units on): each 4 values'
    codes, each plane's field of them (k.planes: its bits, the lowest first) moved to its place in the
    code and OR'd, with its activations' offset. _chunk_bytes lays a plane of b bits out as b words:
    values 4g..4g+3 have their field in word g % b of it, at bit b * (g // b) of each byte."""
    vi, per = _vty(L), 8 // k.units

    def load(i):
        return builder.load(_at(builder, qb, 4 * L * i, vi), align=4)

    def mask(m):
        return _vec(_I32, [m] * L)

    out = []
    for g in range(per * u, per * (u + 1)):  # values 4g..4g+3
        code, word, pos = None, 0, 0
        for bits in k.planes:
            s = bits * (g // bits)  # the field's place in the plane's bytes; to bit pos on
            field = mask(0x01010101 * (((1 << bits) - 1) << pos))
            v = load(word + g % bits)
            if code is None:  # the lowest plane
                code = builder.and_(builder.lshr(v, _vec(_I32, [s] * L)), field)
            else:
                if s < pos:
                    v = builder.shl(v, _vec(_I32, [pos - s] * L))
                elif s > pos:
                    v = builder.lshr(v, _vec(_I32, [s - pos] * L))
                code = builder.or_(code, builder.and_(v, field))
            word, pos = word + bits, pos + bits
        out.append((code, 4 * g))
    return out


def _emit_tile(builder, qtype: int, which: str, args, tokens: int | None = None) -> None:
    """One panel (shape.rows rows, one vector) times shape.nt tokens over all nb blocks,
    stored to out, with ISA `which`'s products. The float steps, per unit (a block of 32, or
    each 16 of it where the type scales each 16: its own acc, d and m), row and token, are
    the same on every ISA: sum = fma(float(acc) * dx[t, b], d[u], sum), then for the offset
    types sum = fma(dx[t, b] * float(sums[t, u]), m[u], sum); so every ISA gives the same bits."""
    k = KINDS[qtype]
    groups, wide, units = k.groups, k.wide, k.units
    per = groups // units  # packed vectors per unit
    ops, shape = ISA_TILES[which]
    L, nt = shape.rows, tokens or shape.nt
    vi, vf = _vty(L), _vty(L, _F32)
    mac = ops(builder, L, wide, k.signed)
    bias = mac.signed_bias if mac.signed else k.bias
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
    qb = builder.add(pq, builder.mul(b, c(4 * L * groups)))
    if qtype in KEPT:  # packed at load, so read from RAM: ask ahead, as the decode kernels do
        intdot_ir._prefetch(builder, [qb], c(KEPT_PREFETCH - intdot_ir.PREFETCH), 4 * L * groups, KEPT_LOCALITY)
        dstep = 2 * L if half(qtype, which) else COMPACT[qtype].nbytes * L // 8 if compact(qtype, which) else 4 * L
        intdot_ir._prefetch(builder, [builder.add(pd, builder.mul(b, c(dstep)))], c(0), dstep, KEPT_LOCALITY)
        if k.offset and not compact(qtype, which):  # Q4_1's offsets, beside its scales
            mstep = 2 * L if half(qtype, which) else 4 * L
            intdot_ir._prefetch(builder, [builder.add(pm, builder.mul(b, c(mstep)))], c(0), mstep, KEPT_LOCALITY)
    xrows = [builder.add(builder.add(xa, builder.mul(xs, c(t))), builder.mul(b, c(64 if wide else 32)))
             for t in range(nt)]
    dxs = [scalar(da, t, b4, _F32) for t in range(nt)]
    new = acc
    for u in range(units):
        if units > 1:  # the unit's own sums of x (sums16[t, 2b + u])
            su = [scalar(s16, t, builder.add(builder.mul(b, c(8)), c(4 * u)), _I32, builder.mul(ds, c(2)))
                  for t in range(nt)]
        else:
            su = [scalar(sa, t, b4, _I32) for t in range(nt)]
        if bias:
            totals = [_splat(builder, builder.mul(x, ir.Constant(_I32, -bias)), vi) for x in su]
        else:
            totals = [ir.Constant(vi, None)] * nt
        operands = []
        for g in range(u * per, (u + 1) * per) if not k.planes else ():
            v = builder.load(_at(builder, qb, 4 * L * g, vi), align=4)
            operands += _operands(builder, k, v, g, L)
        if k.planes:
            operands = _plane_operands(builder, k, qb, u, L)
            if wide:  # each 4 codes' bytes as two 16-bit pairs, as _operands takes a byte kind's (Q5_1)
                operands = [pair for w, off in operands for pair in _pairs16(builder, w, off, L)]
        if k.table:  # the book's values as weights() makes them: vpdpbusd's code + 128 looked up ready
            book = mac.book(k.table)
            operands = [(_looked_up(builder, which, book, w, L), off) for w, off in operands]
        if not (k.table and mac.signed_bias):
            operands = [(mac.weights(w), off) for w, off in operands]
        chains = mac.chains if len(operands) >= 8 and not wide else 1
        step = len(operands) if wide or chains > 1 else k.operands  # i32 chains need no 16-bit bound
        for o in range(0, len(operands), step):  # partial sums chained through each ISA's begin/end
            ints = [[mac.begin(tot)] + [ir.Constant(vi, None)] * (chains - 1) for tot in totals]
            for j, (w, off) in enumerate(operands[o : o + step]):
                for t in range(nt):
                    x = _splat(builder, builder.load(_at(builder, xrows[t], off, _I32), align=4), vi)
                    ints[t][j % chains] = mac.mac(ints[t][j % chains], w, x)
            totals = [mac.end(functools.reduce(builder.add, i), tot) for i, tot in zip(ints, totals)]
        at = builder.mul(b, c(4 * L * units))
        mw = None
        if half(qtype, which):  # f16 scales (and offsets: Q4_1), exact in f32
            d = _halves(builder, pd, b, L)
            mw = _halves(builder, pm, b, L) if k.offset else None
        elif compact(qtype, which):  # d * sc and -(dmin * mn) of this unit of its K block, as the packer forms them
            d, mw = _compact_scales(builder, COMPACT[qtype], pd, b, u, units, L)
        else:
            d = builder.load(_at(builder, builder.add(pd, at), 4 * L * u, vf), align=4)
        new = [builder.call(fma, [builder.fmul(builder.sitofp(totals[t], vf), _splat(builder, dxs[t], vf)), d, new[t]])
               for t in range(nt)]
        if k.offset:
            if mw is None:
                mw = builder.load(_at(builder, builder.add(pm, at), 4 * L * u, vf), align=4)
            for t in range(nt):
                sx = builder.fmul(dxs[t], builder.sitofp(su[t], _F32))
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


def _halves(builder, base, b, L: int):
    """Block b's L f16 values (a `half` panel's scales or offsets, one per row) as f32, exactly."""
    h = builder.load(_at(builder, builder.add(base, builder.mul(b, ir.Constant(_I64, 2 * L))), 0, _vty(L, _I16)),
                     align=2)
    return builder.fpext(builder.bitcast(h, ir.VectorType(ir.HalfType(), L)), _vty(L, _F32))


def _compact_scales(builder, cp: Compact, pd, b, u: int, units: int, L: int):
    """Unit u of block b of 32 (of a compact panel, `compact`, `Compact`): (d * sc, -(dmin * mn) or
    None) of its L rows, <L x f32> each, from the scales of its K block."""
    vf, c = _vty(L, _F32), (lambda v: ir.Constant(_I64, v))
    base = builder.add(pd, builder.mul(builder.lshr(b, c(3)), c(cp.nbytes * L)))
    j = builder.mul(builder.add(builder.mul(builder.and_(b, c(7)), c(units)), c(u)), c(L))  # the slot's row of bytes

    def f16(off):
        h = builder.load(_at(builder, base, off, _vty(L, _I16)), align=2)
        return builder.fpext(builder.bitcast(h, ir.VectorType(ir.HalfType(), L)), vf)

    def byte(off, signed):
        v = builder.load(_at(builder, builder.add(base, j), off, _vty(L, _I8)), align=1)
        return builder.sitofp(v, vf) if signed else builder.uitofp(v, vf)

    d = builder.fmul(f16(0), byte(cp.sc * L, cp.int8))
    if not cp.mins:
        return d, None
    return d, builder.fneg(builder.fmul(f16(2 * L), byte((cp.sc + cp.slots) * L, False)))


def _emitted(kind, which, emit, nargs: int):
    """The typing and codegen of an intrinsic (literal kind, literal ISA name, nargs int64s)
    whose body emit(builder, qtype, isa, args) writes; None (numba then asks for literals)
    until kind and which are literals."""
    if not isinstance(kind, types.IntegerLiteral) or not isinstance(which, types.StringLiteral):
        return None
    k, name = kind.literal_value, which.literal_value

    def codegen(context, builder, signature, args):
        emit(builder, k, name, args[2:])
        return context.get_dummy_value()

    return types.void(kind, which, *([types.int64] * nargs)), codegen


@intrinsic
def _tile(typingctx, kind, which, pq, pd, pm, nb, xa, xs, da, sa, s16, ds, oa, ostride, m, ntv):
    """kind: a literal qtype (of KINDS); which: a literal ISA name. pq/pd/pm: panel addresses; nb blocks;
    xa/xs: first token's activation row and the row stride; da/sa/s16: its dx, sum and
    sum-per-16 rows, ds the stride of the first two (s16's is twice it); oa/ostride:
    out[t0, r0] and the row stride (bytes); m valid rows, ntv valid tokens (<= the shape's nt)."""
    return _emitted(kind, which, _emit_tile, 14)


# ---------------------------------------------------------------- panels


def _emit_pack(builder, qtype: int, which: str, args) -> None:
    """One GGUF block of each row of a panel into the panel: each 32 values' codes as `Kind` packs
    them (one per byte, or nibbles: byte k holds value k low, 16 + k high), each unit's scale
    and offset. The codes and scales come from the type's intdot_layouts row through the
    decode kernels' emitter (intdot_ir.Emit), so they are gguf-py's values: a K-quant's
    d * sc and -(dmin * mn) in f32. Row i's block is at src + min(i, m - 1) * rstride (rows
    past the weight's end repeat its last); the rows' codes are transposed in registers and each
    panel vector is stored whole (a row's codes stored word by word, 4 bytes 4 * P apart, took
    half of a 64-token Q8_0 prefill on a Zen 4)."""
    src, rstride, m, pq, pd, pm, tab = args
    P = ISA_TILES[which][1].rows
    L, k = IL.LAYOUTS[qtype], KINDS[qtype]
    em = intdot_ir.Emit(builder, L, which, tab)
    c = lambda v: ir.Constant(_I64, v)  # noqa: E731
    stride = c(4 * P)  # bytes from one panel vector to the next
    db = 2 if half(qtype, which) else 4  # bytes of a scale entry

    def store(base, j, v, step=stride):
        builder.store(v, _at(builder, builder.add(base, builder.mul(c(j), step)), 0, v.type),
                      align=v.type.width // 8 if isinstance(v.type, ir.IntType) else 4)

    last = builder.sub(m, c(1))
    words = []  # words[i][chunk]: row i's <groups x i32> codes of that chunk
    for i in range(P):
        row = builder.select(builder.icmp_signed("<", c(i), m), c(i), last) if i else c(0)
        s = builder.add(src, builder.mul(row, rstride))
        # the next panel's block (its rows follow these): the rows are read across, a block of each at
        # a time, which the hardware prefetchers do not follow from one panel into the next
        intdot_ir._prefetch(builder, [s], builder.sub(builder.mul(rstride, c(P)), c(intdot_ir.PREFETCH)), 1)
        di, mi = builder.add(pd, c(i * db)), builder.add(pm, c(i * db))
        if half(qtype, which):  # the block's f16 scale (and offset) as it is (KEPT: one unit)
            store(di, 0, intdot_ir._load(builder, s, L.chunks[0].lo.d, _I16), c(2 * P))
            if k.offset:
                store(mi, 0, intdot_ir._load(builder, s, L.chunks[0].lo.m, _I16), c(2 * P))
            ws, wm = [], None
        elif compact(qtype, which):  # pd: this block's scale bytes in the panel (`compact`)
            _pack_compact(builder, em, COMPACT[qtype], s, pd, c(i), c(P))
            ws, wm = [], None
        elif L.values == 32:
            ch = L.chunks[0]
            ws, wm = [em.f16(s, ch.lo.d)], [em.f16(s, ch.lo.m)] if k.offset else None
        else:
            wsv, wmv = em.slot_weights(s)
            n = wsv.type.count
            ws = [builder.extract_element(wsv, ir.Constant(_I32, j)) for j in range(n)]
            wm = [builder.extract_element(wmv, ir.Constant(_I32, j)) for j in range(n)] if k.offset else None
        for j, v in enumerate(ws):
            store(di, j, v)
        for j, v in enumerate(wm or ()):
            store(mi, j, v)
        words.append([builder.bitcast(_chunk_bytes(builder, em, k, s, ch), ir.VectorType(_I32, k.groups))
                      for ch in L.chunks])
    for ci in range(len(L.chunks)):
        rows = [w[ci] for w in words]
        while len(rows) > 1:  # one vector of every row's words, row after row
            rows = [intdot_ir._cat(builder, a, b) for a, b in zip(rows[::2], rows[1::2])]
        for g in range(k.groups):  # panel vector g: word g of each row
            lanes = _vec(_I32, [i * k.groups + g for i in range(P)])
            store(pq, ci * k.groups + g, builder.shuffle_vector(rows[0], rows[0], lanes))


def _chunk_bytes(builder, em, k: Kind, src, ch):
    """A chunk's codes as its panel holds them, 4 * k.groups bytes: em.chunk's <32 x i8> (unsigned
    codes, int8 for Q8_0) or, for a code book (IQ4), em.codes' indices into it, nibbles or planes packed."""
    u = em.codes(src, ch.code) if k.table else em.chunk(src, ch)  # a code book's indices, not its values
    if k.planes:  # each plane of b bits in turn, 4 * b bytes: with n = 4 * b, byte j holds the fields of
        #           values j, n + j, 2n + j, ... (Q6_K's top plane: j, 8+j, 16+j, 24+j; Q5_0's: j, 4+j, .., 28+j)
        out, pos = None, 0
        for i, bits in enumerate(k.planes):
            n = 4 * bits
            f = builder.lshr(u, _vec(_I8, [pos] * 32)) if pos else u
            if i + 1 < len(k.planes):  # a higher plane's bits lie above this one's
                f = builder.and_(f, _vec(_I8, [(1 << bits) - 1] * 32))
            plane = builder.shuffle_vector(f, f, _vec(_I32, range(n)))
            for j in range(1, 8 // bits):
                plane = builder.or_(plane, builder.shl(builder.shuffle_vector(f, f, _vec(_I32, range(n * j, n * j + n))),
                                                       _vec(_I8, [bits * j] * n)))
            out = plane if out is None else _joined_bytes(builder, out, plane)
            pos += bits
        return out
    if k.nibbles:
        lo = builder.shuffle_vector(u, u, _vec(_I32, range(16)))
        hi = builder.shuffle_vector(u, u, _vec(_I32, range(16, 32)))
        return builder.or_(lo, builder.shl(hi, _vec(_I8, [4] * 16)))
    return u


def _joined_bytes(builder, p, q):
    """Vector p's lanes, then q's (of any lengths), as one vector."""
    n, m = p.type.count, q.type.count
    if m < n:  # q widened to p's length (its extra lanes unused), as shuffle_vector asks
        q = builder.shuffle_vector(q, q, _vec(_I32, list(range(m)) + [0] * (n - m)))
    elif n < m:
        p = builder.shuffle_vector(p, p, _vec(_I32, list(range(n)) + [0] * (m - n)))
    w = max(n, m)
    return builder.shuffle_vector(p, q, _vec(_I32, list(range(n)) + list(range(w, w + m))))


def _pack_compact(builder, em, cp: Compact, src, pd, row, P) -> None:
    """A K block's (or IQ4_XS block's) scales into its compact panel entry (`Compact`, `_compact_scales`)
    for one row."""
    L, c = em.layout, (lambda v: ir.Constant(_I64, v))
    s0 = L.slots[0]
    for k, f in enumerate((s0.d, s0.m) if cp.mins else (s0.d,)):  # f16 at pd + 2 k P + 2 row
        at = builder.add(builder.add(pd, builder.mul(P, c(2 * k))), builder.mul(row, c(2)))
        builder.store(intdot_ir._load(builder, src, f, _I16), _at(builder, at, 0, _I16), align=2)
    ints = em.slot_ints(src, [s.sc for s in L.slots] + ([s.mn for s in L.slots] if cp.mins else []), s0.sc_int8)
    if cp.bias:  # the scales (not the mins) less their bias, as the dequantizer's f32(sc - bias)
        n = ints.type.count
        ints = builder.sub(ints, _vec(_I16, [cp.bias] * cp.slots + [0] * (n - cp.slots)))
    for j in range(ints.type.count):  # slot j's scale, then each slot's min, a row of P bytes each
        at = builder.add(builder.add(pd, builder.mul(P, c(cp.sc + j))), row)
        v = builder.trunc(builder.extract_element(ints, ir.Constant(_I32, j)), _I8)
        builder.store(v, _at(builder, at, 0, _I8), align=1)


@intrinsic
def _pack_block(typingctx, kind, which, src, rstride, m, pq, pd, pm, tab):
    """kind: a literal qtype; which: a literal ISA name (its f16 conversion). src: the first row's
    block, rstride the bytes from a row's block to the next row's, m the rows that exist (1..P);
    pq/pd/pm: the addresses of the block's first vector, scale and offset entry in the panel
    (row 0's); tab: the f16 table (generic ISA)."""
    return _emitted(kind, which, _emit_pack, 7)


@functools.cache
def _gemm(qtype: int, which: str):
    """The prefill kernel of one type on one ISA (both constants inside it, and so in
    numba's cache key: two ISAs compiled for one NUMBA_CPU_NAME stay apart)."""
    shape = ISA_TILES[which][1]
    P, NTI = shape.rows, shape.nt
    k = KINDS[qtype]
    KIND, BSZ, SUB, GROUPS, UNITS, OFF = qtype, k.nbytes, k.sub, k.groups, k.units, k.offset

    @njit(parallel=True, **_OPTS)
    def gemm(w, tab, qx, dx, sums, sums16, n, out):
        # out (n, rows) = x @ W.T for W in GGUF blocks of the type, x as quantize8/16 left it
        rows = w.shape[0]
        nblk = w.shape[1] // BSZ
        nb = nblk * SUB
        xs, ds, os_ = qx.shape[1] * qx.itemsize, dx.shape[1] * 4, out.shape[1] * 4
        qa, da, sa, oa = qx.ctypes.data, dx.ctypes.data, sums.ctypes.data, out.ctypes.data
        s16, wa, ta = sums16.ctypes.data, w.ctypes.data, tab.ctypes.data
        for p in prange((rows + P - 1) // P):
            pq = np.empty((nb, GROUPS, P), np.uint32)
            pd = np.empty((nb * UNITS, P), np.float32)
            pm = np.empty((nb * UNITS if OFF else 1, P), np.float32)
            a, b, c = pq.ctypes.data, pd.ctypes.data, pm.ctypes.data
            r0 = p * P
            m = min(P, rows - r0)
            for kb in range(nblk):  # the panel, a block of its rows at a time (rows past the end repeat the last)
                at = kb * SUB * UNITS * P
                _pack_block(KIND, which, wa + r0 * w.shape[1] + kb * BSZ, w.shape[1], m,
                            a + kb * SUB * GROUPS * P * 4, b + at * 4, c + at * 4, ta)
            for t in range(0, n, NTI):
                _tile(KIND, which, a, b, c, nb, qa + t * xs, xs, da + t * ds, sa + t * ds, s16 + 2 * t * ds, ds,
                      oa + t * os_ + r0 * 4, os_, m, min(NTI, n - t))

    return gemm


# ---------------------------------------------------------------- kept panels (KEPT): decode and prefill


@intrinsic
def _tile_n(typingctx, kind, which, nt, pq, pd, pm, nb, xa, xs, da, sa, s16, ds, oa, ostride, m):
    """_tile for exactly nt (a literal) tokens: a step of n tokens runs tiles of the shape's nt and of
    the powers of two below it, each token's lanes the same float steps whatever tile holds it."""
    if not all(isinstance(a, lit) for a, lit in ((kind, types.IntegerLiteral), (which, types.StringLiteral),
                                                  (nt, types.IntegerLiteral))):
        return None
    k, name, n = kind.literal_value, which.literal_value, nt.literal_value

    def codegen(context, builder, signature, args):
        _emit_tile(builder, k, name, [*args[3:], ir.Constant(_I64, n)], n)
        return context.get_dummy_value()

    return types.void(kind, which, nt, *([types.int64] * 13)), codegen


def panel_rows(which: str | None = None) -> int:
    """Rows per panel on ISA `which` (default: the one in use)."""
    return ISA_TILES[which or isa.current()][1].rows


class Panels(NamedTuple):
    """A weight of a KEPT type packed once into panels of `rows` rows (`pack`)."""

    q: np.ndarray  # (panels, blocks * groups * P) uint32
    d: np.ndarray  # (panels, blocks * units * P): f16 bits as uint16 (`half`), else f32; `compact`: uint8
    m: np.ndarray  # (panels, blocks * units * P) offsets: f16 bits (`half`: Q4_1), else f32; or (panels, 1) unused
    rows: int  # of the weight; the last panel repeats its last row
    nb: int  # blocks of 32 per row

    def sliced(self, start: int, stop: int, per: int) -> "Panels":
        """Rows start..stop (start a multiple of `per`, the panel's rows): views, no copy."""
        a, b = start // per, -(-stop // per)
        return Panels(self.q[a:b], self.d[a:b], self.m[a:b], stop - start, self.nb)


@functools.cache
def _packer(qtype: int, which: str):
    shape = ISA_TILES[which][1]
    P, k = shape.rows, KINDS[qtype]
    KIND, BSZ, SUB, GROUPS, UNITS = qtype, k.nbytes, k.sub, k.groups, k.units
    DB = 2 if half(qtype, which) else 4
    PACKED = compact(qtype, which)
    CBYTES = COMPACT[qtype].nbytes if PACKED else 0

    @njit(parallel=True, **_OPTS)
    def pack(w, tab, pq, pd, pm):
        rows = w.shape[0]
        nblk = w.shape[1] // BSZ
        for p in prange(pq.shape[0]):
            a, b, c = pq[p].ctypes.data, pd[p].ctypes.data, pm[p].ctypes.data
            m = min(P, rows - p * P)
            for kb in range(nblk):
                at = kb * SUB * UNITS * P
                sd = b + kb * CBYTES * P if PACKED else b + at * DB  # (compact: the block's scale bytes)
                _pack_block(KIND, which, w.ctypes.data + p * P * w.shape[1] + kb * BSZ, w.shape[1], m,
                            a + kb * SUB * GROUPS * P * 4, sd, c + at * DB, tab.ctypes.data)

    return pack


def read_only(a: np.ndarray) -> np.ndarray:
    """`a`, or a view of it that cannot be written: numba types the two apart, so a kernel given a
    file's (read-only) weights and one given weights fused in memory would be compiled twice."""
    if not a.flags.writeable:
        return a
    v = a.view()
    v.flags.writeable = False
    return v


PACK_ROWS = 1024  # rows of blocks packed per call of the packer (a multiple of every ISA's panel rows)
assert all(PACK_ROWS % s.rows == 0 for _, s in ISA_TILES.values())


def pack(qtype: int, data: np.ndarray, tab: np.ndarray, which: str | None = None,
         done: Callable[[np.ndarray], object] | None = None) -> Panels:
    """The panels of W's raw (rows, row_bytes) GGUF blocks of a KEPT type, for ISA `which`, packed
    PACK_ROWS rows at a time; done(rows of data), if given, as soon as those rows' panels are written
    (quant.panels gives their file pages back there: a 128k-row vocabulary then never has all its
    pages mapped beside its panels)."""
    which = which or isa.current()
    k, P = KINDS[qtype], ISA_TILES[which][1].rows
    rows, nb = data.shape[0], data.shape[1] // k.nbytes * k.sub
    n = -(-rows // P)
    q = np.empty((n, nb * k.groups * P), np.uint32)
    if compact(qtype, which):
        d, m = np.empty((n, nb // k.sub * COMPACT[qtype].nbytes * P), np.uint8), np.empty((n, 1), np.float32)
    else:
        d = np.empty((n, nb * k.units * P), np.uint16 if half(qtype, which) else np.float32)
        m = np.empty((n, nb * k.units * P if k.offset else 1), np.uint16 if half(qtype, which) and k.offset
                     else np.float32)
    src, packer = read_only(data), _packer(qtype, which)
    for a in range(0, rows, PACK_ROWS):  # the same panels as one call: each is packed from its own rows
        b = min(rows, a + PACK_ROWS)
        at = slice(a // P, -(-b // P))
        packer(src[a:b], tab, q[at], d[at], m[at])
        if done is not None:
            done(data[a:b])
    return Panels(q, d, m, rows, nb)


@functools.cache
def _kept(qtype: int, which: str):
    """The products of kept panels and n tokens, one kernel call for several weights."""
    NT = ISA_TILES[which][1].nt
    P = ISA_TILES[which][1].rows
    KIND = qtype

    @njit(parallel=True, **_OPTS)
    def run(table, qx, dq, sq, dx, sums, sums16, n, nb, out, serial, rounded):
        # out[t, table[i, 9] + r] = W_i[r] . x[t] for t < n; x as quantize8 left it (qx, dx, sums, sums16),
        # or, if rounded, qx/dq/sq as intdot.Rounded.rows holds it: dx, sums and sums16 (n or more
        # rows) are then filled from dq and sq (quad lane order) first.
        # panel is defined here, and numba inlines it: a dispatcher captured from _kept's scope would
        # pickle into the cache key with its process's id, and run would compile afresh at every start
        def panel(table, j, qa, xs, da, sa, s16, ds, oa, os_, n, nb):
            i = 0
            while j >= table[i, 5] + table[i, 4]:
                i += 1
            p = j - table[i, 5]
            pq, pd, pm, rows = table[i, 0] + p * table[i, 6], table[i, 1] + p * table[i, 7], table[i, 2] + p * table[i, 8], table[i, 3]
            m = min(P, rows - p * P)
            o = oa + (table[i, 9] + p * P) * 4
            t = 0
            while n - t >= NT:
                _tile_n(KIND, which, NT, pq, pd, pm, nb, qa + t * xs, xs, da + t * ds, sa + t * ds, s16 + 2 * t * ds, ds,
                        o + t * os_, os_, m)
                t += NT
            if NT > 4 and n - t >= 4:
                _tile_n(KIND, which, 4, pq, pd, pm, nb, qa + t * xs, xs, da + t * ds, sa + t * ds, s16 + 2 * t * ds, ds,
                        o + t * os_, os_, m)
                t += 4
            if n - t >= 2:
                _tile_n(KIND, which, 2, pq, pd, pm, nb, qa + t * xs, xs, da + t * ds, sa + t * ds, s16 + 2 * t * ds, ds,
                        o + t * os_, os_, m)
                t += 2
            if n - t >= 1:
                _tile_n(KIND, which, 1, pq, pd, pm, nb, qa + t * xs, xs, da + t * ds, sa + t * ds, s16 + 2 * t * ds, ds,
                        o + t * os_, os_, m)

        if rounded:
            for t in range(n):
                for c in range(nb):
                    i = c // 4 * 8 + c % 4
                    dx[t, c] = dq[t, i]
                    sums16[t, 2 * c] = sq[t, i]
                    sums16[t, 2 * c + 1] = sq[t, i + 4]
                    sums[t, c] = sq[t, i] + sq[t, i + 4]
        xs, ds, os_ = qx.shape[1] * qx.itemsize, dx.shape[1] * 4, out.shape[1] * 4
        qa, da, sa, s16, oa = qx.ctypes.data, dx.ctypes.data, sums.ctypes.data, sums16.ctypes.data, out.ctypes.data
        total = table[-1, 5] + table[-1, 4]
        if serial:
            for j in range(total):
                panel(table, j, qa, xs, da, sa, s16, ds, oa, os_, n, nb)
        else:
            for j in prange(total):
                panel(table, j, qa, xs, da, sa, s16, ds, oa, os_, n, nb)

    return run


def decode_x(qtype: int, x: np.ndarray) -> tuple[np.ndarray, ...]:
    """Decode tokens x (n, cols) f32 as kept panels of qtype read them: intdot.rounded_rows(x), the
    int8 rounding decode's steps fill, or, for a WIDE type (Q4_1), quantized(x, True), its 16 bits."""
    return quantized(x, True) if KINDS[qtype].wide else intdot.rounded_rows(x)


class Kept:
    """out[t, starts[i] : starts[i] + rows_i] = W_i . x[t] for t < n, for weights of one KEPT type
    that read the same tokens (q, k and v; gate and up), from their panels, in one kernel call.
    x is an intdot.Rounded.rows (decode of an int8 type: the rounding steps fill it) or
    quantized()'s tuple (prefill, and decode of a WIDE type: `decode_x`). The panels, x and out
    must outlive it; each token's row is the same bits whichever n, and the bits prefill (matmul)
    gives it."""

    def __init__(self, qtype: int, panels: list[Panels], x: tuple[np.ndarray, ...], out: np.ndarray,
                 starts: list[int], which: str | None = None) -> None:
        which = which or isa.current()
        nb = panels[0].nb
        self.rounded = isinstance(x, intdot.Rounded)  # else quantized()'s (qx, dx, sums, sums16)
        if self.rounded and KINDS[qtype].wide:
            raise ValueError(f"kept {QT(qtype).name} panels read 16-bit activations (decode_x), not int8 rounding")
        self.n = min(x[0].shape[0], out.shape[0])
        if any(p.nb != nb for p in panels) or x[0].shape[1] < nb * 32 or out.dtype != np.float32 or out.ndim != 2 \
                or not out.flags.c_contiguous:
            raise ValueError(f"kept panels of {[p.nb * 32 for p in panels]} columns do not match x {x[0].shape} "
                             f"and out {out.dtype} {out.shape}")
        for p, a in zip(panels, starts, strict=True):
            if not 0 <= a <= a + p.rows <= out.shape[1]:
                raise ValueError(f"out {out.shape} does not hold rows {a}:{a + p.rows}")
        table = np.zeros((len(panels), 10), np.int64)
        first = 0
        for i, (p, a) in enumerate(zip(panels, starts)):
            table[i] = (p.q.ctypes.data, p.d.ctypes.data, p.m.ctypes.data, p.rows, p.q.shape[0], first,
                        p.q.strides[0], p.d.strides[0], p.m.strides[0], a)
            first += p.q.shape[0]
        if self.rounded:  # dx, sums and sums16 filled from x by each call
            xq, dq, sq = x[0], x[1], x[2]
            dx, sums, sums16 = (np.empty((self.n, nb), np.float32), np.empty((self.n, nb), np.int32),
                                np.empty((self.n, 2 * nb), np.int32))
        else:
            xq, (dx, sums, sums16) = x[0], x[1:4]
            dq, sq = dx, sums
        self._keep = (panels, x, out)
        self._args = (table, xq, dq, sq, dx, sums, sums16)
        self._out, self._nb = out, nb
        self._kernel = _kept(qtype, which)

    def __call__(self, n: int, serial: bool) -> None:
        """Tokens 0..n-1; serial (one thread) skips the parallel launch, with the same bits."""
        if not 0 < n <= self.n:
            raise ValueError(f"{n} tokens: these products hold 1 to {self.n}")
        self._kernel(*self._args, n, self._nb, self._out, serial, self.rounded)


# ---------------------------------------------------------------- activations


@njit(parallel=True, **_OPTS)
def quantize8(x, qx, dx, sums, sums16):
    """x (n, nb*32) f32 -> qx (n, nb*32) int8, dx (n, nb) f32 scales, sums (n, nb) and
    sums16 (n, 2 nb) int32: the sums of qx per 32 and per 16."""
    n, nb = x.shape[0], x.shape[1] // 32
    if x.strides[1] != 4 or qx.strides[1] != 1:
        raise ValueError("quantize8 reads rows of contiguous f32 and writes rows of contiguous int8")
    for t in prange(n):
        f = np.empty(1, np.float32)
        u = f.view(np.uint32)
        xa, qa = x[t].ctypes.data, qx[t].ctypes.data
        for b in range(nb):
            d, s0, s1 = q8_halves(xa + b * 128, qa + b * 32, f, u)
            dx[t, b] = d
            sums[t, b] = s0 + s1
            sums16[t, 2 * b] = s0
            sums16[t, 2 * b + 1] = s1


@njit(parallel=True, **_OPTS)
def quantize16(x, qx, dx, sums):
    """x (n, nb*32) f32 -> qx (n, nb*32) int16, dx (n, nb) f32, sums (n, nb) int32: round16_row per row."""
    for t in prange(x.shape[0]):
        round16_row(x, qx, dx, sums, t)


@njit(inline="always", **_OPTS)
def round16_row(x, qx, dx, sums, t):
    """Row t of x (n, nb*32) f32 -> row t of qx (int16), dx (f32, nb) and sums (int32, nb); decode's
    steps call it on the rows they just computed, as they call intdot.round_into for the int8 types.

    Per block of 32: d = max|x| / 32767 (f32), q = round-half-even(x * 32767/max|x|).
    Within each 4 columns the values are stored as (0, 2, 1, 3): the 16-bit pairs
    the Q4_1/Q8_0 panels multiply by. (Inlined, with 2-D indexing: so numba vectorizes it inside
    quantize16's prange; a call on 1-D row views ran 2.4x slower there, 0.39 against 0.17 ms for
    256 x 576.)
    """
    for b in range(x.shape[1] // 32):
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


def matmul(qtype: int, data: np.ndarray, tab: np.ndarray, xq: tuple[np.ndarray, ...], out: np.ndarray,
           which: str | None = None) -> None:
    """out (n, rows) = x @ W.T; xq = quantized(x, wide(qtype)), W's raw (rows, row_bytes) blocks.
    which: the ISA whose tiles to run (default: the one in use); compiled for this process's target,
    so it must be one this CPU can execute (avxvnni's 256-bit VNNI tiles run on AVX-512 VNNI, EVEX-encoded)."""
    if qtype in KEPT:
        Kept(qtype, [pack(qtype, data, tab, which)], xq, out, [0], which)(out.shape[0], False)
        return
    _gemm(qtype, which or isa.current())(read_only(data), tab, *xq, out.shape[0], out)


def wide(qtype: int) -> bool:
    """True if qtype's products take 16-bit activations (Q4_1, Q5_1, Q8_0), False for int8 (the others)."""
    return KINDS[qtype].wide


# ---------------------------------------------------------------- availability


def _unpermuted(qx: np.ndarray, wide: bool) -> np.ndarray:
    """quantized()'s codes (n, cols) in column order: quantize16 stores each 4 as (0, 2, 1, 3)."""
    n, cols = qx.shape
    return qx.reshape(n, cols // 4, 4)[..., [0, 2, 1, 3]].reshape(n, cols) if wide else qx


def _probe(qtype: int, tab: np.ndarray) -> bool:
    """One kind on an odd shape (rows and tokens past a whole tile) against gguf-py's
    dequantized weights times the rounded activations, in float64."""
    rng = np.random.default_rng(11)
    rows, cols, n = 19, 512, PAD + 3
    x = rng.standard_normal((n, cols)).astype(np.float32)
    k = KINDS[qtype]
    xq = quantized(x, k.wide)
    q = _unpermuted(xq[0][:n], k.wide).reshape(n, cols // 32, 32)
    xr = (q * xq[1][:n, :, None].astype(np.float64)).reshape(n, cols)
    w = rng.integers(0, 256, (rows, cols // (32 * k.sub), k.nbytes), dtype=np.uint8)
    for at in k.halves:  # finite scales
        w[:, :, at : at + 2] = np.full((rows, w.shape[1], 1), 0.25, np.float16).view(np.uint8)
    w = w.reshape(rows, -1)
    wr = gguf.quants.dequantize(w, QT(qtype)).reshape(rows, cols).astype(np.float64)
    got = np.full((n, rows), np.nan, np.float32)
    matmul(qtype, w, tab, xq, got)
    return bool(np.all(np.abs(got - xr @ wr.T) <= 1e-5 * (np.abs(xr) @ np.abs(wr).T)))


@functools.cache
def _probed(which: str, qtype: int) -> bool:
    # one type at a time: a process compiles the kernels of the types its model holds, not of all
    # twelve (SmolLM2 Q4_1 from an empty cache: 118 s of compiling, 55 s of it other types' tiles)
    return vnni.checked(lambda: _probe(qtype, f16_table()), f"integer {QT(qtype).name} prefill ({which})")


def _probe_kept(qtype: int, tab: np.ndarray) -> bool:
    """Kept panels of qtype on an odd shape: one token (decode's rounding) and several
    (prefill's), each the bits of the other, and near gguf-py's dequantized weights."""
    rng = np.random.default_rng(12)
    k = KINDS[qtype]
    rows, cols, n = 37, 512, PAD + 3
    w = rng.integers(0, 256, (rows, cols // (32 * k.sub), k.nbytes), dtype=np.uint8)
    for at in k.halves:
        w[:, :, at : at + 2] = np.full((rows, w.shape[1], 1), 0.25, np.float16).view(np.uint8)
    w = w.reshape(rows, -1)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    xq = quantized(x, k.wide)
    many = np.full((n, rows), np.nan, np.float32)
    p = pack(qtype, w, tab)
    Kept(qtype, [p], xq, many, [0])(n, False)
    one = np.full((1, rows), np.nan, np.float32)
    Kept(qtype, [p], decode_x(qtype, x[n - 1 :]), one, [0])(1, True)
    xr = _unpermuted(xq[0][:n], k.wide).astype(np.float64) * np.repeat(xq[1][:n], 32, axis=1)
    wr = gguf.quants.dequantize(w, QT(qtype)).reshape(rows, cols).astype(np.float64)
    return (np.array_equal(one.view(np.uint32), many[n - 1 :].view(np.uint32))
            and bool(np.all(np.abs(many - xr @ wr.T) <= 1e-5 * (np.abs(xr) @ np.abs(wr).T))))


def kept(qtype: int) -> bool:
    """True when qtype is KEPT and its panels run here, for decode and prefill alike: the ISA in
    use is one this CPU runs (generic too: decode's bits are then the same on every ISA) and a
    probe passes. EDGETP_INT8=0 is quant.kept's to honour (quant.int8_decode)."""
    if qtype not in KEPT:
        return False
    try:
        return _kept_probed(isa.current(), qtype)
    except isa.IsaError:
        return False


@functools.cache
def _kept_probed(which: str, qtype: int) -> bool:
    return vnni.checked(lambda: _probe_kept(qtype, f16_table()), f"kept {QT(qtype).name} panels ({which})")


def available(qtype: int | None = None) -> bool:
    """True when the prefill kernels of qtype (None: of every kind) run here: vnni.wanted()
    (EDGETP_INT8 is not 0, the ISA in use is known) and a passing probe of this ISA's tiles."""
    if not vnni.wanted():
        return False
    which = isa.current()
    return all(q in KINDS and _probed(which, q) for q in (KINDS if qtype is None else (qtype,)))
