"""Integer decode kernels (out = W @ x for one token) for every quantized type, on every ISA.

The activations are rounded once per token to int8 in blocks of 32, exactly as
ggml's x86 quantize_row_q8_0 does (`vnni.q8_halves`): xq (cols,) int8 and an f16-valued
f32 scale dx per 32 (`Rounded` keeps them with each 16 values' integer sum, by quad).
Each weight type is a row of `intdot_layouts.LAYOUTS`: how the integer code of a
value is formed and what f32 scale ws (and offset wm) each 16 values have.

Canonical arithmetic (the same bits on every ISA; `reference()` is it in numpy):
  - a unit is 16 consecutive values, with one f32 weight scale ws (and offset wm) and the
    dx of its 32; its integer I = sum of code * xq over its 16 values, exact (int32);
  - a quad is 4 chunks of 32 (128 values, 8 units), its units in lane order
        lane l = chunk 4q + l % 4, half l // 4   (first halves in lanes 0-3, last in 4-7);
    a row's last quad is padded with units whose I, ws, wm and dx are 0;
  - per row, 8 f32 accumulators, all zero at first; for each quad in order, lane-wise
        acc = acc + (ws * dx) * f32(I)
        acc = acc + wm * X        (types with an offset: Q4_1, Q5_1, Q4_K, Q5_K, Q2_K)
    with X = dx * f32(S), S the integer sum of xq over the unit (the same for every row),
    each operation rounded to f32 separately: no FMA, no reassociation;
  - out = ((acc[0] + acc[1]) + acc[2]) + ... + acc[7].
A padded unit adds +0 to an accumulator that is never -0, so it changes nothing.
This is llama.cpp's ggml_vec_dot_q4_0_q8_0 on AVX2 with each 16 values' products summed
as integers before their scale is applied (ggml scales each lane of 4), and without FMA.
Summing a unit in integers first is both exact and cheap: four chunks' lanes reduce to
one vector of 8 units with a few in-lane shuffles, and the f32 work is one vector step
per 128 values rather than one per 32. A K-quant's sub-block scale is a float (d*sc, as
the dequantizer rounds it): x is rounded per 32, so its scale changes every 32 anyway.
Any ISA may form a unit's integer in any way because it is exact.

How each ISA forms the lanes is `intdot_ir.py` (one small function per ISA).

Several tokens at once (a decode step of several sequences: `TokenProducts`) run the
same arithmetic per (row, token); each quad's codes and scales are unpacked once and
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
from gguf import GGMLQuantizationType as QT  # noqa: E402
from numba import get_num_threads, njit, prange, types  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from edgetp.model.intdot_ir import emit_rows, emit_rows_tokens, seed_bias  # noqa: E402
from edgetp.model.intdot_layouts import LAYOUTS, decode  # noqa: E402
from edgetp.model.kernels import SPREAD, claim, f16_table, partners, spans  # noqa: E402
from edgetp.model.vnni import q8_halves  # noqa: E402

log = logging.getLogger(__name__)

_OPTS = dict(cache=True, nogil=True)
KINDS = frozenset(int(t) for t in LAYOUTS)

# ---------------------------------------------------------------- activations


QUAD = 128  # values per quad (see the canonical arithmetic above)


def quads(cols: int) -> int:
    """Quads of a row of `cols` values, the last one padded."""
    return -(-cols // QUAD)


class Rounded(NamedTuple):
    """One token rounded for the integer kernels (cols a multiple of 32), padded to whole quads."""

    xq: np.ndarray  # (quads * 128,) int8, 0 past cols
    dq: np.ndarray  # (quads * 8,) f32: dx of each unit, in quad lane order (0 past cols)
    sq: np.ndarray  # (quads * 8,) int32: S, the sum of xq over each unit, in quad lane order
    xs: np.ndarray  # (quads * 8,) f32: X = dq * f32(sq)

    @classmethod
    def empty(cls, cols: int) -> "Rounded":
        """Buffers for one token of `cols` columns, to be filled by round_into."""
        n = quads(cols)
        return cls(np.empty(n * QUAD, np.int8), np.empty(n * 8, np.float32), np.empty(n * 8, np.int32),
                   np.empty(n * 8, np.float32))

    @classmethod
    def rows(cls, n: int, cols: int) -> "Rounded":
        """Buffers for n tokens, (n, ...) each: row b is token b (`row(b)`), as TokenProducts reads them."""
        m = quads(cols)
        return cls(np.empty((n, m * QUAD), np.int8), np.empty((n, m * 8), np.float32), np.empty((n, m * 8), np.int32),
                   np.empty((n, m * 8), np.float32))

    def row(self, b: int) -> "Rounded":
        """Token b of a Rounded.rows: one token's buffers (views)."""
        return Rounded(*(a[b] for a in self))


@njit(**_OPTS)
def round_into(x, xq, dq, sq, xs):
    """x (cols,) f32 -> xq, dq, sq, xs (see Rounded); xq's buffer may be longer than cols (padding)."""
    f = np.empty(1, np.float32)
    u = f.view(np.uint32)
    nch = x.shape[0] // 32
    if x.strides[0] != 4 or xq.strides[0] != 1:
        raise ValueError("round_into reads contiguous f32 and writes contiguous int8")
    xa, qa = x.ctypes.data, xq.ctypes.data
    for c in range(nch):
        d, s0, s1 = q8_halves(xa + c * 128, qa + c * 32, f, u)
        for h in range(2):
            s = s0 if h == 0 else s1
            i = c // 4 * 8 + 4 * h + c % 4
            dq[i] = d
            sq[i] = s
            xs[i] = d * np.float32(s)
    xq[nch * 32 :] = 0
    for c in range(nch, dq.shape[0] // 2):
        for h in range(2):
            i = c // 4 * 8 + 4 * h + c % 4
            dq[i] = 0.0
            sq[i] = 0
            xs[i] = 0.0


def rounded(x: np.ndarray) -> Rounded:
    """Round one token x (cols,) f32; cols must be a multiple of 32."""
    cols = x.shape[0]
    if cols % 32:
        raise ValueError(f"{cols} columns is not a multiple of 32")
    r = Rounded.empty(cols)
    round_into(np.ascontiguousarray(x, np.float32), *r)
    return r


@intrinsic
def _rows4(typingctx, kind, which, rows, xq, dq, sq, xs, tab, nb, out):
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


@njit(inline="always", **_OPTS)
def _jobs(ws):
    """The work items of the weights of a kernels' table (each weight's spans, in weight order)."""
    total = 0
    for i in range(ws.shape[0]):
        total += spans(ws[i, 2])
    return total


@njit(inline="always", **_OPTS)
def _job(ws, job):
    """Work item `job` of the table ws: (address, row bytes, rows, start in out) of its weight
    and the span's index within that weight."""
    i, first = 0, 0
    while job >= first + spans(ws[i, 2]):
        first += spans(ws[i, 2])
        i += 1
    return ws[i, 0], ws[i, 1], ws[i, 2], ws[i, 3], job - first


@functools.cache
def _kernel(kind: int, which: str):
    """The decode kernel of one layout on one ISA (both constants inside it, and so in
    numba's cache key: two ISAs compiled for one NUMBA_CPU_NAME stay apart).

    It multiplies one token by several weights of that layout at once (q, k and v read
    one token; gate and up another), handing all their spans of rows to `workers` threads,
    each claiming the next span until none is left (kernels.claim: a fast core takes more
    than a slow one); `serial` runs the same spans in order on the calling thread, without
    the parallel launch (one thread). Each row's arithmetic is the same either way."""

    @njit(parallel=True, **_OPTS)
    def matvec_rows(ws, xq, dq, sq, xs, tab, nb, out, serial, workers):
        # ws: (weights, 4) int64, per weight: address of its (rows, nb * block bytes) uint8 blocks, row bytes,
        # rows, and where its rows start in out; xq/dq/sq/xs: one Rounded token; out: (sum of rows,) f32.
        # Job j is span j of all the weights' spans in weight order. The two loops are one body:
        # a helper function would be a closure variable, which numba's cache cannot key.
        xa, da, sa, za, ta = xq.ctypes.data, dq.ctypes.data, sq.ctypes.data, xs.ctypes.data, tab.ctypes.data
        total = _jobs(ws)
        if serial:
            res = np.empty(4, np.float32)
            for job in range(total):
                wa, st, rows, o, c = _job(ws, job)
                for r in range(c * 4 * SPREAD, min(rows, c * 4 * SPREAD + SPREAD)):
                    r1, r2, r3 = partners(r, rows)
                    _rows4(kind, which, (wa + r * st, wa + r1 * st, wa + r2 * st, wa + r3 * st), xa, da, sa, za,
                           ta, nb, res.ctypes.data)
                    for j in range(4):
                        if r + j * SPREAD < rows:
                            out[o + r + j * SPREAD] = res[j]
        else:
            nxt = np.zeros(1, np.int64)  # each thread claims jobs until none are left
            for _ in prange(workers):
                res = np.empty(4, np.float32)
                job = claim(nxt.ctypes.data)
                while job < total:
                    wa, st, rows, o, c = _job(ws, job)
                    for r in range(c * 4 * SPREAD, min(rows, c * 4 * SPREAD + SPREAD)):
                        r1, r2, r3 = partners(r, rows)
                        _rows4(kind, which, (wa + r * st, wa + r1 * st, wa + r2 * st, wa + r3 * st), xa, da, sa,
                               za, ta, nb, res.ctypes.data)
                        for j in range(4):
                            if r + j * SPREAD < rows:
                                out[o + r + j * SPREAD] = res[j]
                    job = claim(nxt.ctypes.data)

    return matvec_rows


@intrinsic
def _rows4_tokens(typingctx, kind, which, rows, xq, dq, sq, xs, ntok, tab, nb, acc, out):
    """out[4 t + j] (an address of 4 ntok f32) = rows[j] . token t for t < ntok, the tokens' Rounded
    rows interleaved by quad (_by_quad; xq by _by_quad_units) from xq/dq/sq/xs; acc: a scratch of
    ntok * 4 * 8 f32."""
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
def _by_quad_units(xq, ntok, nq, out):
    """_by_quad for xq, each quad's 128 values ordered as intdot_ir.by_unit orders the codes: value
    32c + 16h + 4j + i (chunk c, half h, dword j, byte i) at 32j + 4(4h + c) + i."""
    for q in range(nq):
        for t in range(ntok):
            at = (q * ntok + t) * 128
            for c in range(4):
                for h in range(2):
                    for j in range(4):
                        src, dst = q * 128 + 32 * c + 16 * h + 4 * j, at + 32 * j + 4 * (4 * h + c)
                        out[dst : dst + 4] = xq[t, src : src + 4]


@njit(**_OPTS)
def _by_quad(a, ntok, nq, out):
    """Tokens 0..ntok-1 of a (>= ntok, nq * m) into out (flat) interleaved by quad: quad q of
    token t at q * ntok + t (what the token loop of one quad reads is adjacent)."""
    m = a.shape[1] // nq
    for q in range(nq):
        for t in range(ntok):
            out[(q * ntok + t) * m : (q * ntok + t + 1) * m] = a[t, q * m : (q + 1) * m]


@njit(**_OPTS)
def _by_quad_seed(sq, ntok, nq, shift, out):
    """_by_quad for sq, each S written as -(S << shift): a unit's integer before its products
    (-bias * S, bias = 2^shift), once per token rather than once per token and row pair."""
    m = sq.shape[1] // nq
    for q in range(nq):
        for t in range(ntok):
            for i in range(m):
                out[(q * ntok + t) * m + i] = -(sq[t, q * m + i] << shift)


@functools.cache
def _kernel_tokens(kind: int, which: str):
    """_kernel for several tokens: each weight's rows read once for all of them, each
    (row, token) result the single-token kernel's bits (emit_rows_tokens)."""
    bias = seed_bias(LAYOUTS[kind], which)
    shift = bias.bit_length() - 1  # a power of two (emit_rows_tokens: seeded)

    @njit(parallel=True, **_OPTS)
    def matvec_tokens(ws, xq, dq, sq, xs, xi, di, si, zi, ntok, tab, nb, out, serial, workers):
        # as matvec_rows, for tokens 0..ntok-1: xq/dq/sq/xs (>= ntok, ...) Rounded.rows, C-contiguous,
        # copied by quad into xi/di/si/zi (flat, as large; si as each unit's seed); out (>= ntok, sum
        # of rows) f32. A job's results go to out row by row after its call.
        nq = xq.shape[1] // 128
        _by_quad_units(xq, ntok, nq, xi)
        _by_quad(dq, ntok, nq, di)
        if bias:
            _by_quad_seed(sq, ntok, nq, shift, si)
        _by_quad(xs, ntok, nq, zi)
        xa, da, sa, za, ta = xi.ctypes.data, di.ctypes.data, si.ctypes.data, zi.ctypes.data, tab.ctypes.data
        total = _jobs(ws)
        if serial:
            res = np.empty(4 * ntok, np.float32)
            acc = np.empty(4 * 8 * ntok, np.float32)
            for job in range(total):
                wa, st, rows, o, c = _job(ws, job)
                for r in range(c * 4 * SPREAD, min(rows, c * 4 * SPREAD + SPREAD)):
                    r1, r2, r3 = partners(r, rows)
                    _rows4_tokens(kind, which, (wa + r * st, wa + r1 * st, wa + r2 * st, wa + r3 * st), xa, da, sa,
                                  za, ntok, ta, nb, acc.ctypes.data, res.ctypes.data)
                    for t in range(ntok):
                        for j in range(4):
                            if r + j * SPREAD < rows:
                                out[t, o + r + j * SPREAD] = res[4 * t + j]
        else:
            nxt = np.zeros(1, np.int64)  # as matvec_rows: jobs claimed until none are left
            for _ in prange(workers):
                res = np.empty(4 * ntok, np.float32)
                acc = np.empty(4 * 8 * ntok, np.float32)
                job = claim(nxt.ctypes.data)
                while job < total:
                    wa, st, rows, o, c = _job(ws, job)
                    for r in range(c * 4 * SPREAD, min(rows, c * 4 * SPREAD + SPREAD)):
                        r1, r2, r3 = partners(r, rows)
                        _rows4_tokens(kind, which, (wa + r * st, wa + r1 * st, wa + r2 * st, wa + r3 * st), xa, da,
                                      sa, za, ntok, ta, nb, acc.ctypes.data, res.ctypes.data)
                        for t in range(ntok):
                            for j in range(4):
                                if r + j * SPREAD < rows:
                                    out[t, o + r + j * SPREAD] = res[4 * t + j]
                    job = claim(nxt.ctypes.data)

    return matvec_tokens


@functools.cache
def _tab() -> np.ndarray:
    return f16_table()


def _blocks(L, ws: list[np.ndarray], padded: int) -> int:
    """Blocks per row of weights ws (all alike) of layout L, read by a Rounded of `padded` xq values."""
    nb = ws[0].shape[1] // L.nbytes if ws and ws[0].ndim == 2 else -1
    for w in ws:
        if w.dtype != np.uint8 or w.ndim != 2 or not w.flags.c_contiguous or w.shape[1] != nb * L.nbytes or nb < 1:
            raise ValueError(f"weight {w.dtype} {w.shape} is not C-contiguous rows of whole {L.qtype.name} blocks "
                             f"like the first")
    if padded != quads(nb * L.values) * QUAD:
        raise ValueError(f"a token rounded to {padded} values does not match {nb * L.values} columns of {L.qtype.name}")
    return nb


# Layouts whose one-token products run faster through the several-token kernel, by ISA: on AVX-512
# it unpacks two rows per 512-bit step and gathers no lanes (emit_rows_tokens), which pays where
# unpacking dominates (codes of 2 to 5 bits, code books). One core of an Emerald Rapids VM,
# 65536 x 2048 from RAM, several-token kernel for 1 token over the one-token kernel: Q4_0
# 1.24-1.56x, Q4_1 1.15-1.42, Q5_0 1.26, Q5_1 1.48, IQ4_NL 1.81, Q2_K 1.42, Q3_K 1.27; Q4_K, Q6_K and
# IQ4_XS 1.0-1.06, Q5_K 0.76-0.91 and Q8_0 0.87 stay. The bits are the same either way. (Every
# type but Q8_0 decodes on kept panels, intgemm.KEPT, unless their probe fails here.)
ONE_BY_TOKENS = {"avx512vnni": frozenset(int(t) for t in (QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.IQ4_NL,
                                                          QT.Q2_K, QT.Q3_K))}


class Products:
    """out[starts[i] : starts[i] + rows_i] = W_i . x for several weights of one layout that
    read one rounded token (q, k and v; gate and up), checked and resolved once; each call
    runs them all in one kernel call. The weights, x and out must outlive it (the kernel
    reads them by address) and keep their shapes. Where ONE_BY_TOKENS says so, the call is
    TokenProducts' for the one token (the same bits)."""

    def __init__(self, qtype: int, ws: list[np.ndarray], x: Rounded, out: np.ndarray, starts: list[int]) -> None:
        L = LAYOUTS[qtype]
        nb = _blocks(L, ws, x.xq.shape[0])
        for w, a in zip(ws, starts, strict=True):
            if out.dtype != np.float32 or out.ndim != 1 or not out.flags.c_contiguous or not 0 <= a <= a + w.shape[0] <= out.shape[0]:
                raise ValueError(f"out must be C-contiguous float32 holding rows {a}:{a + w.shape[0]}, got {out.dtype} {out.shape}")
        self._keep = (ws, x, out)
        self._tokens = None
        if int(qtype) in ONE_BY_TOKENS.get(isa.current(), ()):
            self._tokens = TokenProducts(qtype, ws, Rounded(*(a[None] for a in x)), out[None], starts)
            return
        table = np.array([(w.ctypes.data, w.shape[1], w.shape[0], a) for w, a in zip(ws, starts)], np.int64)
        self._args = (table.reshape(len(ws), 4), *x, _tab(), nb, out)
        self._kernel = _kernel(int(qtype), isa.current())

    def __call__(self, serial: bool) -> None:
        """Run them; serial (one thread) skips the parallel launch, with the same bits."""
        if self._tokens is not None:
            self._tokens(1, serial)
            return
        # the calling thread's count, as prange's; not asked when serial (numba takes two locks to say)
        self._kernel(*self._args, serial, 1 if serial else get_num_threads())


class TokenProducts:
    """Products for up to n tokens at once: out[b, starts[i] : starts[i] + rows_i] = W_i . x.row(b)
    for b < the count each call names, x a Rounded.rows(n, cols) and out (n, total) f32. Each
    weight block is read and unpacked once for all the tokens; each (row, token) result is
    Products' bits for that token alone."""

    def __init__(self, qtype: int, ws: list[np.ndarray], x: Rounded, out: np.ndarray, starts: list[int]) -> None:
        L = LAYOUTS[qtype]
        n = x.xq.shape[0]
        nb = _blocks(L, ws, x.xq.shape[1])
        if not all(a.flags.c_contiguous and a.shape[0] == n for a in x):
            raise ValueError(f"rounded tokens {x.xq.shape} are not C-contiguous rows")
        if out.dtype != np.float32 or out.ndim != 2 or not out.flags.c_contiguous or out.shape[0] != n:
            raise ValueError(f"out must be C-contiguous float32 ({n}, rows), got {out.dtype} {out.shape}")
        for w, a in zip(ws, starts, strict=True):
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
        self._kernel(self._table, *self._x, ntok, *self._tail, serial, 1 if serial else get_num_threads())


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
    nq = quads(cols)
    units = (codes * x.xq[:cols].astype(np.int64)).reshape(rows, cols // 16, 16).sum(-1)
    # quad q's lane l is unit 2 * (4q + l % 4) + l // 4; units past the row are zeros
    order = np.array([2 * (4 * q + l % 4) + l // 4 for q in range(nq) for l in range(8)])
    inside = order < cols // 16

    def lanes(a, dtype):
        out = np.zeros((rows, nq * 8), dtype)
        out[:, inside] = a[:, order[inside]]
        return out

    big, t = lanes(units, np.int64).astype(np.float32), lanes(ws, np.float32) * x.dq[None, : nq * 8]
    m = lanes(wm, np.float32) if wm is not None else None
    acc = np.zeros((rows, 8), np.float32)
    for q in range(nq):
        acc = acc + t[:, 8 * q : 8 * q + 8] * big[:, 8 * q : 8 * q + 8]
        if m is not None:
            acc = acc + m[:, 8 * q : 8 * q + 8] * x.xs[None, 8 * q : 8 * q + 8]
    h = acc[:, 0]
    for lane in range(1, 8):
        h = h + acc[:, lane]
    return h


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
