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
    accumulator m[j] per scale slot j of a block (`Layout.slots`: 1 for Q4_1 and
    Q5_1, 8 for Q4_K and Q5_K (32 values each), 16 for Q2_K (16 each)), zero at
    first; for each block in order, each slot: m[j] = m[j] + (wm * dx) * f32(S),
    S the integer sum of xq over the slot's values;
  - out = ((acc[0] + acc[1]) + acc[2]) + ... + acc[7], then
    + (((m[0] + m[1]) + m[2]) + ... + m[n-1]).
A K-quant's per-slot values (ws * dx, the offset term) are then one vector per
block, not a scalar chain per 32 values.
This is llama.cpp's ggml_vec_dot_q4_0_q8_0 on AVX2 (a per-lane f32 accumulator,
integer dot within a block) without its FMA, and a K-quant's sub-block scale
is a float (d*sc, as the dequantizer rounds it) rather than folded into an
integer sum: x is rounded per 32, so its scale changes every 32 values anyway.
Any ISA may form a lane in any way because it is an exact integer.

How each ISA forms the lanes is `intdot_ir.py` (one small function per ISA).

Several tokens at once (a decode step of several sequences: `TokenProducts`) run the
same arithmetic per (row, token); each chunk's codes and scales are unpacked once and
applied to every token (intdot_ir.emit_rows_tokens), so the weights are read once.

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
from numba import njit, prange, types  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from edgetp.model.intdot_ir import emit_rows, emit_rows_tokens  # noqa: E402
from edgetp.model.intdot_layouts import LAYOUTS, decode  # noqa: E402
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

    @classmethod
    def empty(cls, cols: int) -> "Rounded":
        """Buffers for one token of `cols` columns, to be filled by round_into."""
        return cls(np.empty(cols, np.int8), np.empty(cols // 32, np.float32),
                   np.empty(cols // 4, np.int32), np.empty(cols // 16, np.int32))

    @classmethod
    def rows(cls, n: int, cols: int) -> "Rounded":
        """Buffers for n tokens, (n, ...) each: row b is token b (`row(b)`), as TokenProducts reads them."""
        return cls(np.empty((n, cols), np.int8), np.empty((n, cols // 32), np.float32),
                   np.empty((n, cols // 4), np.int32), np.empty((n, cols // 16), np.int32))

    def row(self, b: int) -> "Rounded":
        """Token b of a Rounded.rows: one token's buffers (views)."""
        return Rounded(*(a[b] for a in self))


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
    r = Rounded.empty(cols)
    round_into(np.ascontiguousarray(x, np.float32), *r)
    return r


@intrinsic
def _rows4(typingctx, kind, which, rows, xq, dx, s4, s16, tab, nb, out):
    """out[0:4] (an address of 4 f32) = rows (4 addresses) . the token, in layout `kind` (a literal
    qtype) with ISA `which` (a literal name)."""
    if not isinstance(kind, types.IntegerLiteral) or not isinstance(which, types.StringLiteral):
        return None
    layout, name = LAYOUTS[kind.literal_value], which.literal_value
    sig = types.void(kind, which, rows, *(types.int64,) * 7)

    def codegen(context, builder, signature, args):
        rows_v = [builder.extract_value(args[2], i) for i in range(rows.count)]
        emit_rows(builder, layout, name, rows_v, args[3:7], args[7], args[8], args[9])
        return context.get_dummy_value()

    return sig, codegen


@functools.cache
def _kernel(kind: int, which: str):
    """The decode kernel of one layout on one ISA (both constants inside it, and so in
    numba's cache key: two ISAs compiled for one NUMBA_CPU_NAME stay apart).

    It multiplies one token by several weights of that layout at once (q, k and v read
    one token; gate and up another), handing all their spans of rows to one parallel
    loop; `serial` runs the same spans in order on the calling thread, without the
    parallel launch (one thread). Each row's arithmetic is the same either way."""

    @njit(parallel=True, **_OPTS)
    def matvec_rows(ws, xq, dx, s4, s16, tab, nb, out, serial):
        # ws: (weights, 4) int64, per weight: address of its (rows, nb * block bytes) uint8 blocks, row bytes,
        # rows, and where its rows start in out; xq/dx/s4/s16: one Rounded token; out: (sum of rows,) f32.
        # Job j is span j of all the weights' spans in weight order. The two loops are one body:
        # a helper function would be a closure variable, which numba's cache cannot key.
        xa, da, s4a, s16a, ta = xq.ctypes.data, dx.ctypes.data, s4.ctypes.data, s16.ctypes.data, tab.ctypes.data
        total = 0
        for i in range(ws.shape[0]):
            total += spans(ws[i, 2])
        if serial:
            res = np.empty(4, np.float32)
            for job in range(total):
                i, first = 0, 0
                while job >= first + spans(ws[i, 2]):
                    first += spans(ws[i, 2])
                    i += 1
                wa, st, rows, o, c = ws[i, 0], ws[i, 1], ws[i, 2], ws[i, 3], job - first
                for r in range(c * 4 * SPREAD, min(rows, c * 4 * SPREAD + SPREAD)):
                    r1, r2, r3 = partners(r, rows)
                    _rows4(kind, which, (wa + r * st, wa + r1 * st, wa + r2 * st, wa + r3 * st), xa, da, s4a, s16a,
                           ta, nb, res.ctypes.data)
                    for j in range(4):
                        if r + j * SPREAD < rows:
                            out[o + r + j * SPREAD] = res[j]
        else:
            for job in prange(total):
                res = np.empty(4, np.float32)
                i, first = 0, 0
                while job >= first + spans(ws[i, 2]):
                    first += spans(ws[i, 2])
                    i += 1
                wa, st, rows, o, c = ws[i, 0], ws[i, 1], ws[i, 2], ws[i, 3], job - first
                for r in range(c * 4 * SPREAD, min(rows, c * 4 * SPREAD + SPREAD)):
                    r1, r2, r3 = partners(r, rows)
                    _rows4(kind, which, (wa + r * st, wa + r1 * st, wa + r2 * st, wa + r3 * st), xa, da, s4a, s16a,
                           ta, nb, res.ctypes.data)
                    for j in range(4):
                        if r + j * SPREAD < rows:
                            out[o + r + j * SPREAD] = res[j]

    return matvec_rows


@intrinsic
def _rows4_tokens(typingctx, kind, which, rows, xq, dx, s4, s16, ntok, tab, nb, acc, out):
    """out[4 t + j] (an address of 4 ntok f32) = rows[j] . token t for t < ntok, the tokens' Rounded
    rows interleaved by block (_by_block) from xq/dx/s4/s16; acc: a scratch of ntok * 4 * 24 f32."""
    if not isinstance(kind, types.IntegerLiteral) or not isinstance(which, types.StringLiteral):
        return None
    layout, name = LAYOUTS[kind.literal_value], which.literal_value
    sig = types.void(kind, which, rows, *(types.int64,) * 9)

    def codegen(context, builder, signature, args):
        rows_v = [builder.extract_value(args[2], i) for i in range(rows.count)]
        emit_rows_tokens(builder, layout, name, rows_v, args[3:7], args[7], args[8], args[9], args[10], args[11])
        return context.get_dummy_value()

    return sig, codegen


@njit(**_OPTS)
def _by_block(a, ntok, nb, out):
    """Tokens 0..ntok-1 of a (>= ntok, nb * m) into out (flat) interleaved by block: block k of
    token t at k * ntok + t (what the token loop of one block reads is adjacent)."""
    m = a.shape[1] // nb
    for k in range(nb):
        for t in range(ntok):
            out[(k * ntok + t) * m : (k * ntok + t + 1) * m] = a[t, k * m : (k + 1) * m]


@functools.cache
def _kernel_tokens(kind: int, which: str):
    """_kernel for several tokens: each weight's rows read once for all of them, each
    (row, token) result the single-token kernel's bits (emit_rows_tokens)."""

    @njit(parallel=True, **_OPTS)
    def matvec_tokens(ws, xq, dx, s4, s16, xi, di, s4i, s16i, ntok, tab, nb, out, serial):
        # as matvec_rows, for tokens 0..ntok-1: xq/dx/s4/s16 (>= ntok, ...) Rounded.rows, C-contiguous,
        # copied by block into xi/di/s4i/s16i (flat, as large); out (>= ntok, sum of rows) f32. A
        # job's results go to out row by row after its call.
        _by_block(xq, ntok, nb, xi)
        _by_block(dx, ntok, nb, di)
        _by_block(s4, ntok, nb, s4i)
        _by_block(s16, ntok, nb, s16i)
        xa, da, s4a, s16a, ta = xi.ctypes.data, di.ctypes.data, s4i.ctypes.data, s16i.ctypes.data, tab.ctypes.data
        total = 0
        for i in range(ws.shape[0]):
            total += spans(ws[i, 2])
        if serial:
            res = np.empty(4 * ntok, np.float32)
            acc = np.empty(4 * 24 * ntok, np.float32)
            for job in range(total):
                i, first = 0, 0
                while job >= first + spans(ws[i, 2]):
                    first += spans(ws[i, 2])
                    i += 1
                wa, st, rows, o, c = ws[i, 0], ws[i, 1], ws[i, 2], ws[i, 3], job - first
                for r in range(c * 4 * SPREAD, min(rows, c * 4 * SPREAD + SPREAD)):
                    r1, r2, r3 = partners(r, rows)
                    _rows4_tokens(kind, which, (wa + r * st, wa + r1 * st, wa + r2 * st, wa + r3 * st), xa, da, s4a,
                                  s16a, ntok, ta, nb, acc.ctypes.data, res.ctypes.data)
                    for t in range(ntok):
                        for j in range(4):
                            if r + j * SPREAD < rows:
                                out[t, o + r + j * SPREAD] = res[4 * t + j]
        else:
            for job in prange(total):
                res = np.empty(4 * ntok, np.float32)
                acc = np.empty(4 * 24 * ntok, np.float32)
                i, first = 0, 0
                while job >= first + spans(ws[i, 2]):
                    first += spans(ws[i, 2])
                    i += 1
                wa, st, rows, o, c = ws[i, 0], ws[i, 1], ws[i, 2], ws[i, 3], job - first
                for r in range(c * 4 * SPREAD, min(rows, c * 4 * SPREAD + SPREAD)):
                    r1, r2, r3 = partners(r, rows)
                    _rows4_tokens(kind, which, (wa + r * st, wa + r1 * st, wa + r2 * st, wa + r3 * st), xa, da, s4a,
                                  s16a, ntok, ta, nb, acc.ctypes.data, res.ctypes.data)
                    for t in range(ntok):
                        for j in range(4):
                            if r + j * SPREAD < rows:
                                out[t, o + r + j * SPREAD] = res[4 * t + j]

    return matvec_tokens


@functools.cache
def _tab() -> np.ndarray:
    return f16_table()


class Products:
    """out[starts[i] : starts[i] + rows_i] = W_i . x for several weights of one layout that
    read one rounded token (q, k and v; gate and up), checked and resolved once; each call
    runs them all in one kernel call. The weights, x and out must outlive it (the kernel
    reads them by address) and keep their shapes."""

    def __init__(self, qtype: int, ws: list[np.ndarray], x: Rounded, out: np.ndarray, starts: list[int]) -> None:
        L = LAYOUTS[qtype]
        nb = x.xq.shape[0] // L.values
        if x.xq.shape[0] != nb * L.values:
            raise ValueError(f"{x.xq.shape[0]} rounded columns is not a whole number of {L.qtype.name} blocks")
        for w, a in zip(ws, starts, strict=True):
            if w.dtype != np.uint8 or w.ndim != 2 or not w.flags.c_contiguous or w.shape[1] != nb * L.nbytes:
                raise ValueError(f"weight {w.dtype} {w.shape} does not match {x.xq.shape[0]} rounded columns")
            if out.dtype != np.float32 or out.ndim != 1 or not out.flags.c_contiguous or not 0 <= a <= a + w.shape[0] <= out.shape[0]:
                raise ValueError(f"out must be C-contiguous float32 holding rows {a}:{a + w.shape[0]}, got {out.dtype} {out.shape}")
        self._keep = (ws, x, out)
        table = np.array([(w.ctypes.data, w.shape[1], w.shape[0], a) for w, a in zip(ws, starts)], np.int64)
        self._args = (table.reshape(len(ws), 4), *x, _tab(), nb, out)
        self._kernel = _kernel(int(qtype), isa.current())

    def __call__(self, serial: bool) -> None:
        """Run them; serial (one thread) skips the parallel launch, with the same bits."""
        self._kernel(*self._args, serial)


class TokenProducts:
    """Products for up to n tokens at once: out[b, starts[i] : starts[i] + rows_i] = W_i . x.row(b)
    for b < the count each call names, x a Rounded.rows(n, cols) and out (n, total) f32. Each
    weight block is read and unpacked once for all the tokens; each (row, token) result is
    Products' bits for that token alone."""

    def __init__(self, qtype: int, ws: list[np.ndarray], x: Rounded, out: np.ndarray, starts: list[int]) -> None:
        L = LAYOUTS[qtype]
        n, cols = x.xq.shape
        nb = cols // L.values
        if cols != nb * L.values or not all(a.flags.c_contiguous and a.shape[0] == n for a in x):
            raise ValueError(f"rounded tokens {x.xq.shape} are not C-contiguous rows of whole {L.qtype.name} blocks")
        if out.dtype != np.float32 or out.ndim != 2 or not out.flags.c_contiguous or out.shape[0] != n:
            raise ValueError(f"out must be C-contiguous float32 ({n}, rows), got {out.dtype} {out.shape}")
        for w, a in zip(ws, starts, strict=True):
            if w.dtype != np.uint8 or w.ndim != 2 or not w.flags.c_contiguous or w.shape[1] != nb * L.nbytes:
                raise ValueError(f"weight {w.dtype} {w.shape} does not match {cols} rounded columns")
            if not 0 <= a <= a + w.shape[0] <= out.shape[1]:
                raise ValueError(f"out {out.shape} does not hold rows {a}:{a + w.shape[0]}")
        self.n = n
        self._keep = (ws, x, out)
        table = np.array([(w.ctypes.data, w.shape[1], w.shape[0], a) for w, a in zip(ws, starts)], np.int64)
        by_block = tuple(np.empty(a.size, a.dtype) for a in x)  # the kernel's copy of x, interleaved by block
        self._table, self._x, self._tail = table.reshape(len(ws), 4), (*x, *by_block), (_tab(), nb, out)
        self._kernel = _kernel_tokens(int(qtype), isa.current())

    def __call__(self, ntok: int, serial: bool) -> None:
        """Tokens 0..ntok-1 (ntok <= n); serial (one thread) skips the parallel launch, with the same bits."""
        if not 0 < ntok <= self.n:
            raise ValueError(f"{ntok} tokens: these products hold 1 to {self.n}")
        self._kernel(self._table, *self._x, ntok, *self._tail, serial)


def matvec_tokens(qtype: int, w: np.ndarray, x: Rounded, out: np.ndarray, serial: bool = False) -> None:
    """out (n, rows) f32 = W . x.row(b) for each b: x = Rounded.rows(n, cols) filled by round_into row by row."""
    if out.shape != (x.xq.shape[0], w.shape[0]):
        raise ValueError(f"out must be float32 ({x.xq.shape[0]}, {w.shape[0]}), got {out.dtype} {out.shape}")
    TokenProducts(qtype, [w], x, out, [0])(x.xq.shape[0], serial)


def rounded_rows(x: np.ndarray) -> Rounded:
    """Round n tokens x (n, cols) f32, each as `rounded` rounds one."""
    n, cols = x.shape
    if cols % 32:
        raise ValueError(f"{cols} columns is not a multiple of 32")
    r = Rounded.rows(n, cols)
    xs = np.ascontiguousarray(x, np.float32)
    for b in range(n):
        round_into(xs[b], *r.row(b))
    return r


def matvec(qtype: int, w: np.ndarray, x: Rounded, out: np.ndarray, serial: bool = False) -> None:
    """out (rows,) f32 = W . x: w (rows, row_bytes) uint8 GGUF blocks of qtype, x = rounded(token)."""
    if out.shape != (w.shape[0],):
        raise ValueError(f"out must be float32 ({w.shape[0]},), got {out.dtype} {out.shape}")
    Products(qtype, [w], x, out, [0])(serial)


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
    n = len(L.slots)  # one offset accumulator per slot of a block (1, 8 or 16)
    per = L.values // n  # values per slot: 32 or 16
    wmg = wm[:, :: per // 16]  # (rows, cols/per)
    p = (wmg * np.repeat(x.dx, 32 // per)[None]) * x.s16.reshape(-1, per // 16).sum(1).astype(np.float32)[None]
    macc = np.zeros((rows, n), np.float32)
    for k in range(cols // L.values):
        macc = macc + p[:, k * n : (k + 1) * n]
    m = macc[:, 0]
    for j in range(1, n):
        m = m + macc[:, j]
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
def _isa() -> str | None:
    """The ISA the kernels compile for, logged once; None when EDGETP_ISA names one this
    CPU lacks (`isa.require()` says why)."""
    try:
        name = isa.current()
    except isa.IsaError as exc:
        log.warning("integer decode kernels unavailable: %s", exc)
        return None
    log.info("integer decode kernels on %s", name)
    return name


@functools.cache
def available(qtype: int) -> bool:
    """True when qtype's integer decode kernel compiled and passed its probe on this ISA.
    Probed on first use, one type at a time: a model compiles only the kernels it uses."""
    from edgetp.model.vnni import checked  # noqa: PLC0415

    name = _isa()
    return (qtype in KINDS and name is not None
            and checked(lambda: _probe(qtype), f"integer {LAYOUTS[qtype].qtype.name} decode ({name})"))
