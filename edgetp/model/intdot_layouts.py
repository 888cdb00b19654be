"""Where each GGUF block type keeps its quants, scales and mins: one row per type.

A block is cut into chunks of 32 consecutive values. For each chunk a row says
  - how the unsigned integer code u of each value is formed: the OR of bit
    fields ((byte[off + idx] >> shift) & mask) << pos, read from the block's bytes;
  - how u becomes the integer weight code: u - bias, int8(u) (Q8_0), or table[u]
    (IQ4's non-linear values);
  - the f32 scale ws (and offset wm) of the chunk's first and last 16 values,
    computed exactly as gguf-py's dequantizer computes them:
      ws = d                 or d * f32(sc)           (sc an integer made of fields)
      wm = m (Q4_1, Q5_1)    or -(dmin * f32(mn))     (K-quants with mins)
So a value is ws * code + wm, bit for bit what `gguf.quants.dequantize` returns
(tests/test_intdot.py checks every row against it).

This module is data plus its numpy meaning (`decode`); `intdot.py` turns the
same rows into LLVM IR for every ISA. A new type is a new row here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as QT

LANES = tuple(range(32))


@dataclass(frozen=True)
class Field:
    """((byte[off + idx] >> shift) & mask) << pos; idx/shift per value (32-tuples) or scalar ints."""

    off: int
    idx: tuple[int, ...] | int
    shift: tuple[int, ...] | int
    mask: int
    pos: int = 0


@dataclass(frozen=True)
class Scale:
    """ws = f16(d) [* f32(sc - sc_bias)]; wm = f16(m) if mn is empty, else -(f16(m) * f32(mn))."""

    d: int
    sc: tuple[Field, ...] = ()
    sc_bias: int = 0
    sc_int8: bool = False  # sc is the one field's byte read as int8 (Q6_K)
    m: int | None = None
    mn: tuple[Field, ...] = ()


@dataclass(frozen=True)
class Chunk:
    code: tuple[Field, ...]  # OR'd into u, per value of the chunk
    lo: Scale  # values 0..15 of the chunk
    hi: Scale  # values 16..31 (the same Scale for types with one scale per 32)


@dataclass(frozen=True)
class Layout:
    qtype: int
    values: int  # per block
    nbytes: int  # per block
    chunks: tuple[Chunk, ...]
    bias: int = 0  # code = u - bias (a power of two or 0)
    signed: bool = False  # code = int8(u)
    table: tuple[int, ...] | None = None  # code = table[u]

    @property
    def offset(self) -> bool:
        return self.chunks[0].lo.m is not None

    @property
    def split(self) -> bool:
        """True when a chunk's two 16-value halves have scales of their own."""
        return any(ch.lo != ch.hi for ch in self.chunks)

    @property
    def umax(self) -> int:
        """The largest unsigned multiplicand a dot product takes: the largest code u, or 128 for
        signed codes and a code book's values (|code| <= 128, multiplied as |code| x sign)."""
        if self.signed or self.table is not None:
            return 128
        return max(sum(f.mask << f.pos for f in ch.code) for ch in self.chunks)

    @property
    def slots(self) -> tuple[Scale, ...]:
        """The scales of a block in value order: one per chunk, or one per 16 values if split
        (1 for the 32-value types, 8 or 16 for the K-quants)."""
        return tuple(s for ch in self.chunks for s in ((ch.lo, ch.hi) if self.split else (ch.lo,)))


def nibbles(off: int) -> tuple[Field]:
    """16 bytes: value j < 16 is the low nibble of byte j, j >= 16 the high nibble of byte j-16."""
    return (Field(off, tuple(j % 16 for j in LANES), tuple(0 if j < 16 else 4 for j in LANES), 15),)


def plane(off: int, shift: int, mask: int, pos: int = 0) -> Field:
    """32 bytes, value j from byte j."""
    return Field(off, LANES, (shift,) * 32, mask, pos)


def bits32(off: int, pos: int) -> Field:
    """A little-endian u32: bit j of it for value j."""
    return Field(off, tuple(j // 8 for j in LANES), tuple(j % 8 for j in LANES), 1, pos)


def _q4k_scale(g: int) -> Scale:
    # 12 bytes at 4: 6-bit sc and mn of sub-block g, as get_scale_min packs them
    b = 4
    if g < 4:
        sc, mn = (Field(b + g, 0, 0, 63),), (Field(b + 4 + g, 0, 0, 63),)
    else:
        sc = (Field(b + 4 + g, 0, 0, 15), Field(b + g - 4, 0, 6, 3, 4))
        mn = (Field(b + 4 + g, 0, 4, 15), Field(b + g, 0, 6, 3, 4))
    return Scale(0, sc, m=2, mn=mn)


def _q3k_scale(i: int) -> Scale:
    # 12 bytes at 96: low 4 bits of scale i in a nibble of bytes 0..7, high 2 bits in bytes 8..11
    lo = Field(96 + i % 8, 0, 0 if i < 8 else 4, 15)
    return Scale(108, (lo, Field(104 + i % 4, 0, 2 * (i // 4), 3, 4)), sc_bias=32)


def _iq4xs_scale(g: int) -> Scale:
    return Scale(0, (Field(4 + g // 2, 0, 4 * (g % 2), 15), Field(2 + g // 4, 0, 2 * (g % 4), 3, 4)), sc_bias=32)


def _one(code, s: Scale) -> Chunk:
    return Chunk(tuple(code), s, s)


def _two(code, lo: Scale, hi: Scale) -> Chunk:
    return Chunk(tuple(code), lo, hi)


KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # IQ4_NL's values

LAYOUTS: dict[int, Layout] = {
    QT.Q8_0: Layout(QT.Q8_0, 32, 34, (_one([plane(2, 0, 255)], Scale(0)),), signed=True),
    QT.Q4_0: Layout(QT.Q4_0, 32, 18, (_one(nibbles(2), Scale(0)),), bias=8),
    QT.Q4_1: Layout(QT.Q4_1, 32, 20, (_one(nibbles(4), Scale(0, m=2)),)),
    QT.Q5_0: Layout(QT.Q5_0, 32, 22, (_one([*nibbles(6), bits32(2, 4)], Scale(0)),), bias=16),
    QT.Q5_1: Layout(QT.Q5_1, 32, 24, (_one([*nibbles(8), bits32(4, 4)], Scale(0, m=2)),)),
    QT.IQ4_NL: Layout(QT.IQ4_NL, 32, 18, (_one(nibbles(2), Scale(0)),), table=KVALUES),
    # d, dmin, 12 B scales/mins, 128 B: chunk g in nibble g%2 of bytes 16 + 32*(g//2)
    QT.Q4_K: Layout(QT.Q4_K, 256, 144, tuple(
        _one([plane(16 + 32 * (g // 2), 4 * (g % 2), 15)], _q4k_scale(g)) for g in range(8))),
    # as Q4_K with 32 B of high bits at 16 (bit g of byte j for value j of chunk g), nibbles at 48
    QT.Q5_K: Layout(QT.Q5_K, 256, 176, tuple(
        _one([plane(48 + 32 * (g // 2), 4 * (g % 2), 15), plane(16, g, 1, 4)], _q4k_scale(g)) for g in range(8))),
    # ql 128 B, qh 64 B, int8 scales[16] at 192, d at 208; code = (ql nibble | 2 qh bits << 4) - 32
    QT.Q6_K: Layout(QT.Q6_K, 256, 210, tuple(
        _two([plane(64 * (g // 4) + 32 * (g % 2), 4 * (g % 4 // 2), 15), plane(128 + 32 * (g // 4), 2 * (g % 4), 3, 4)],
             Scale(208, (Field(192 + 2 * g, 0, 0, 255),), sc_int8=True),
             Scale(208, (Field(193 + 2 * g, 0, 0, 255),), sc_int8=True)) for g in range(8)), bias=32),
    # hmask 32 B, qs 64 B, 12 B 6-bit scales, d at 108; code = (2 bits | hmask bit << 2) - 4
    QT.Q3_K: Layout(QT.Q3_K, 256, 110, tuple(
        _two([plane(32 + 32 * (g // 4), 2 * (g % 4), 3), plane(0, g, 1, 2)], _q3k_scale(2 * g), _q3k_scale(2 * g + 1))
        for g in range(8)), bias=4),
    # scales[16] (low nibble sc, high nibble mn) at 0, qs 64 B at 16, d at 80, dmin at 82
    QT.Q2_K: Layout(QT.Q2_K, 256, 84, tuple(
        _two([plane(16 + 32 * (g // 4), 2 * (g % 4), 3)],
             Scale(80, (Field(2 * g, 0, 0, 15),), m=82, mn=(Field(2 * g, 0, 4, 15),)),
             Scale(80, (Field(2 * g + 1, 0, 0, 15),), m=82, mn=(Field(2 * g + 1, 0, 4, 15),))) for g in range(8))),
    # d, u16 high scale bits at 2, 4 B low scale nibbles at 4, 128 B nibbles at 8 (16 per chunk)
    QT.IQ4_XS: Layout(QT.IQ4_XS, 256, 136, tuple(_one(nibbles(8 + 16 * g), _iq4xs_scale(g)) for g in range(8)),
                      table=KVALUES),
}  # fmt: skip


# ---------------------------------------------------------------- numpy meaning


def _field(blocks: np.ndarray, f: Field) -> np.ndarray:
    """(n, 32) or (n,) int64 values of a field over blocks (n, nbytes) uint8."""
    idx = np.asarray(f.idx) + f.off
    return ((blocks[:, idx].astype(np.int64) >> np.asarray(f.shift)) & f.mask) << f.pos


def _int(blocks, fields) -> np.ndarray:
    v = np.zeros(blocks.shape[0], np.int64)
    for f in fields:
        v |= _field(blocks, f)
    return v


def _f16(blocks, off) -> np.ndarray:
    return blocks[:, off : off + 2].copy().view(np.float16)[:, 0].astype(np.float32)


def _scale(blocks, s: Scale) -> tuple[np.ndarray, np.ndarray | None]:
    ws = _f16(blocks, s.d)
    if s.sc:
        sc = _int(blocks, s.sc)
        sc = sc.astype(np.uint8).view(np.int8).astype(np.int64) if s.sc_int8 else sc - s.sc_bias
        ws = ws * sc.astype(np.float32)
    if s.m is None:
        return ws, None
    wm = _f16(blocks, s.m)
    return ws, (wm if not s.mn else -(wm * _int(blocks, s.mn).astype(np.float32)))


def decode(layout: Layout, data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Integer codes (rows, cols) int64, ws (rows, cols//16) f32 and wm (same, or None)
    of a (rows, row_bytes) uint8 weight in this layout."""
    rows = data.shape[0]
    blocks = data.reshape(-1, layout.nbytes)
    codes, ws, wm = [], [], []
    for ch in layout.chunks:
        u = np.zeros((blocks.shape[0], 32), np.int64)
        for f in ch.code:
            u |= _field(blocks, f)
        if layout.table is not None:
            u = np.asarray(layout.table)[u]
        elif layout.signed:
            u = u.astype(np.uint8).view(np.int8).astype(np.int64)
        codes.append(u - layout.bias)
        for s in (ch.lo, ch.hi):
            a, m = _scale(blocks, s)
            ws.append(a)
            wm.append(m)
    codes = np.stack(codes, 1).reshape(rows, -1)
    ws = np.stack(ws, 1).reshape(rows, -1)
    return codes, ws, (np.stack(wm, 1).reshape(rows, -1) if layout.offset else None)
