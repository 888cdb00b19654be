"""Weights in GGUF block formats: the `Weight` value, slicing, dispatch.

A `Weight` is a (rows, row_bytes) uint8 view of the bytes exactly as the
GGUF file stores them (usually a read-only memmap), tagged with its qtype.
Kernels in `kernels.py` and `intdot.py` compute on those bytes directly; `deq.py`
dequantizes rows of any type (prefill, and products of types without a decode
kernel). Weights of every quantized type but Q8_0 are also packed once into panels (`panels`, intgemm.KEPT),
which their decode and prefill both read, about the size of the blocks; the file's pages under them
are then unmapped (`pages.release`) and left to the page cache, clean and reclaimable.

Block formats (ggml), per row of `cols` values:
  F32 / F16 / BF16   1 value per "block", 4 / 2 / 2 bytes
  Q8_0   32 values, 34 B: f16 d, int8 q[32]                value q*d
  Q4_0   32 values, 18 B: f16 d, 16 B nibbles              value (q-8)*d
  Q4_1   32 values, 20 B: f16 d, f16 m, 16 B nibbles       value q*d + m
         (nibbles: value j<16 is the low nibble of byte j, j>=16 the high nibble of byte j-16)
  Q5_0   32 values, 22 B: f16 d, u32 qh, 16 B nibbles    value (q-16)*d, q = nibble | qh bit << 4
  Q5_1   32 values, 24 B: f16 d, f16 m, u32 qh, nibbles   value q*d + m
  IQ4_NL 32 values, 18 B: f16 d, 16 B nibbles             value d*kvalues[q] (a 16-entry code book)
  Q2_K  256 values,  84 B: 4-bit scales/mins[16], 2-bit q 64 B, f16 d, f16 dmin
  Q3_K  256 values, 110 B: hmask 32 B, 2-bit q 64 B, 12 B 6-bit scales, f16 d
  Q4_K  256 values, 144 B: f16 d, f16 dmin, 12 B 6-bit scales/mins, 128 B nibbles
  Q5_K  256 values, 176 B: as Q4_K plus qh 32 B (the 5th bits)
  Q6_K  256 values, 210 B: ql 128 B, qh 64 B, int8 scales[16], f16 d
  IQ4_XS 256 values, 136 B: f16 d, 6-bit scales (u16 high bits, 4 B low), 128 B code-book nibbles
  (exact layouts in deq.py; K-quants and IQ4_XS need widths that are multiples of 256,
  which is why llama.cpp writes 576-wide SmolLM2 tensors of a Q4_K_M file as Q5_0/Q8_0/IQ4_NL)
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# numba's OpenMP threads spin after every parallel region, forever with OMP_WAIT_POLICY=ACTIVE:
# a node waiting on the network, or sharing cores with another process, then loses
# nearly everything (3 processes on 2 cores: 1.2 tok/s). Sleeping at once (PASSIVE)
# costs a wake-up per kernel instead (quiet machine, SmolLM2, 2 threads: 33 tok/s).
# A bounded spin, well under a millisecond, keeps both: 70 tok/s quiet, 18.7 shared.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

import numba  # noqa: E402
import numpy as np  # noqa: E402
from gguf import GGMLQuantizationType as QT  # noqa: E402

from edgetp.model import deq as D  # noqa: E402
from edgetp.model import intdot, intgemm, isa, pages  # noqa: E402
from edgetp.model import kernels as K  # noqa: E402
from edgetp.model.sampling import top_k  # noqa: E402

# qtype -> (values per block, bytes per block)
_BLOCK = {
    QT.F32: (1, 4),
    QT.F16: (1, 2),
    QT.BF16: (1, 2),
    QT.Q8_0: (32, 34),
    QT.Q4_0: (32, 18),
    QT.Q4_1: (32, 20),
    QT.Q5_0: (32, 22),
    QT.Q5_1: (32, 24),
    QT.IQ4_NL: (32, 18),
    QT.Q2_K: (256, 84),
    QT.Q3_K: (256, 110),
    QT.Q4_K: (256, 144),
    QT.Q5_K: (256, 176),
    QT.Q6_K: (256, 210),
    QT.IQ4_XS: (256, 136),
}
SUPPORTED = frozenset(QT(t) for t in _BLOCK)

_TAB16 = K.f16_table()  # (65536,) f32
_TABBF = K.bf16_table()  # (65536,) f32


class ThreadCountError(ValueError):
    """A thread count this machine cannot run."""


class UnsupportedTensorType(ValueError):
    """A tensor's GGML type has no kernel here."""


def _type_name(qtype: int) -> str:
    try:
        return QT(qtype).name
    except ValueError:
        return f"unknown type {qtype}"


def _check(qtype: int) -> None:
    if qtype not in _BLOCK:
        supported = ", ".join(sorted(_type_name(t) for t in SUPPORTED))
        raise UnsupportedTensorType(f"tensor type {_type_name(qtype)} is not supported (supported: {supported})")


def block_size(qtype: int) -> int:
    """Values per block: 1 for float types, 32, 256 for K-quants and IQ4_XS."""
    _check(qtype)
    return _BLOCK[qtype][0]


def row_bytes(qtype: int, cols: int) -> int:
    bs, nbytes = _BLOCK[qtype]
    return cols // bs * nbytes


@dataclass(frozen=True, eq=False)
class Weight:
    qtype: int  # GGMLQuantizationType value
    rows: int  # output features
    cols: int  # input features
    data: np.ndarray  # (rows, row_bytes) uint8, C-contiguous

    def __post_init__(self) -> None:
        _check(self.qtype)
        if self.cols % _BLOCK[self.qtype][0]:
            raise ValueError(f"{self.cols} columns is not a multiple of the {_type_name(self.qtype)} block size")
        if self.data.dtype != np.uint8 or self.data.shape != (self.rows, row_bytes(self.qtype, self.cols)):
            raise ValueError(f"data must be uint8 {(self.rows, row_bytes(self.qtype, self.cols))}, got {self.data.dtype} {self.data.shape}")
        if not self.data.flags.c_contiguous:
            raise ValueError("weight data must be C-contiguous")

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


def weight_from_gguf(tensor) -> Weight:
    """Wrap a 2-D gguf.ReaderTensor as a Weight, viewing its bytes without a copy."""
    qtype = int(tensor.tensor_type)
    try:
        _check(qtype)
    except UnsupportedTensorType as exc:
        raise UnsupportedTensorType(f"{tensor.name}: {exc}") from None
    shape = [int(s) for s in tensor.shape]  # ggml order: [cols, rows, 1...]
    if len(shape) < 2 or any(s != 1 for s in shape[2:]):
        raise ValueError(f"{tensor.name}: a Weight needs a 2-D tensor, got shape {shape}")
    cols, rows = shape[0], shape[1]
    data = np.asarray(tensor.data).view(np.uint8).reshape(rows, row_bytes(qtype, cols))
    return Weight(qtype, rows, cols, data)


_threads: int | None = None  # compute threads for every kernel call (set_threads); None: all cores
_local = threading.local()  # the count numba was last told on each calling thread


def set_threads(n: int | None) -> None:
    """Compute threads for every kernel call from now on, whichever thread makes it.

    numba's own count is per calling thread: set on the event-loop thread, it did
    not reach the pool threads that run the kernels (`--threads 1` still used every
    core). So the count is kept here and applied by each kernel entry (`use_threads`).
    """
    global _threads
    if n is not None and not 1 <= n <= numba.config.NUMBA_NUM_THREADS:
        raise ThreadCountError(f"threads {n} (--threads, EDGETP_THREADS or the config file's threads): this machine "
                               f"runs 1 to {numba.config.NUMBA_NUM_THREADS} compute threads (one per core; NUMBA_NUM_THREADS)")
    _threads = n
    use_threads()


def threads() -> int:
    """The compute threads kernel calls use."""
    return _threads or numba.config.NUMBA_NUM_THREADS


def use_threads() -> None:
    """Apply the thread count to this thread's numba kernels (once per thread and change)."""
    n = threads()
    if getattr(_local, "n", None) != n:
        numba.set_num_threads(n)
        _local.n = n


# ---------------------------------------------------------------- kernels


def check_io(w: Weight, x: np.ndarray, out: np.ndarray, n: int | None) -> None:
    """ValueError unless x is (cols,) and out (rows,) f32 C-contiguous ((n, ...) for a batch):
    numba does no bounds checks, so a wrong shape would read or write past the buffers."""
    want_x, want_out = ((w.cols,), (w.rows,)) if n is None else ((n, w.cols), (n, w.rows))
    for name, a, shape in (("x", x, want_x), ("out", out, want_out)):
        if a.dtype != np.float32 or a.shape != shape or not a.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous float32 {shape}, got {a.dtype} {a.shape}")


class Batch:
    """Activations (n, cols) f32 that several products read: q, k and v read one,
    gate and up another. The integer kernels round them once per Batch and layout,
    not once per product. x must not change while the Batch is in use."""

    def __init__(self, x: np.ndarray) -> None:
        self.x = x
        self.shape = x.shape
        self._rounded: dict[str, tuple] = {}

    def token(self) -> intdot.Rounded:
        """intdot.rounded(x[0]): one token as the integer decode kernels read it."""
        if "token" not in self._rounded:
            self._rounded["token"] = intdot.rounded(self.x[0])
        return self._rounded["token"]

    def ints(self, wide: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """intgemm.quantized(x, wide): the prefill kernels' layouts (int16 if wide, else int8)."""
        key = "int16" if wide else "int8"
        if key not in self._rounded:
            self._rounded[key] = intgemm.quantized(self.x, wide)
        return self._rounded[key]


def int8_decode() -> bool:
    """Quantized weights decode on the integer kernels (intdot: x rounded to int8 blocks,
    the same bits on every ISA) unless EDGETP_INT8=0 keeps them on the float kernels
    (f32 activations: exact against the dequantized weights, slower)."""
    return isa.int8()


_PANELS: weakref.WeakKeyDictionary[Weight, intgemm.Panels] = weakref.WeakKeyDictionary()
_panels_lock = threading.Lock()


def kept(w: Weight) -> bool:
    """True when w's products, decode's and prefill's alike, run on panels packed once and kept
    (intgemm.KEPT: every quantized type but Q8_0, whose panels are about as large as their blocks)."""
    return int8_decode() and intgemm.kept(w.qtype)


def panels(w: Weight) -> intgemm.Panels:
    """w's kept panels, packed on first use and held as long as w is."""
    with _panels_lock:
        p = _PANELS.get(w)
        if p is None:
            # decode and prefill read the panels alone from now on (generic: its prefill's sgemm reads w)
            p = _PANELS[w] = intgemm.pack(w.qtype, w.data, _TAB16, done=pages.release if intgemm.available(w.qtype) else None)
        return p


def row_piece(w: Weight, start: int, stop: int) -> Weight:
    """slice_rows(w, start, stop) for a piece of a weight that runs whole as well (decode's
    pieces of o and down): where w is kept and start begins a panel, the piece's panels are
    views of w's, not a second copy."""
    piece = slice_rows(w, start, stop)
    if kept(w) and start % intgemm.panel_rows() == 0:
        whole = panels(w)
        with _panels_lock:
            _PANELS[piece] = whole.sliced(start, stop, intgemm.panel_rows())
    return piece


def _kept_one(w: Weight, x: intdot.Rounded, out: np.ndarray) -> None:
    intgemm.Kept(w.qtype, [panels(w)], intdot.Rounded(*(a[None] for a in x)), out[None], [0])(1, threads() == 1)


def matvec(w: Weight, x: np.ndarray | Batch, out: np.ndarray) -> None:
    """out (rows,) = W @ x, all f32; x (cols,), or a Batch of one token."""
    batch = x if isinstance(x, Batch) else None
    x = x.x[0] if batch is not None else x
    check_io(w, x, out, None)
    use_threads()
    if kept(w) and intgemm.wide(w.qtype):  # 16-bit activations (Q4_1): prefill's rounding of the one token
        intgemm.Kept(w.qtype, [panels(w)], (batch or Batch(x[None])).ints(True), out[None], [0])(1, threads() == 1)
    elif kept(w):
        _kept_one(w, (batch or Batch(x[None])).token(), out)
    elif int8_kernel(w, int8_decode()):
        intdot.matvec(w.qtype, w.data, (batch or Batch(x[None])).token(), out, threads() == 1)
    else:
        float_matvec(w, x, out)


def int8_kernel(w: Weight, int8: bool) -> bool:
    """True when matvec(w) runs on the integer kernels, int8 being int8_decode()."""
    return int8 and w.qtype in intdot.KINDS and intdot.available(w.qtype)


def float_matvec(w: Weight, x: np.ndarray, out: np.ndarray) -> None:
    """out (rows,) = W @ x on the float kernels, f32 x; shapes as matvec checks them (unchecked here)."""
    d, t = w.data, w.qtype
    if t == QT.Q8_0:
        K.matvec_q8_0(d, d.view(np.int8), _TAB16, x, out)
    elif t == QT.Q4_0:
        K.matvec_q4_0(d, _TAB16, x, out)
    elif t == QT.Q4_1:
        K.matvec_q4_1(d, _TAB16, x, out)
    elif t == QT.Q4_K:
        K.matvec_q4_k(d, _TAB16, x, out)
    elif t == QT.Q6_K:
        K.matvec_q6_k(d, _TAB16, x, out)
    elif t == QT.F32:
        K.matvec_f32(d.view(np.float32), x, out)
    elif t == QT.F16:
        K.matvec_half(d.view(np.uint16), _TAB16, x, out, False)
    elif t == QT.BF16:
        K.matvec_half(d.view(np.uint16), _TABBF, x, out, True)
    else:  # no decode kernel for this type: the prefill path's decoded tiles (correct, not fast)
        _openblas_single_thread()
        tile = int(np.clip(_SCRATCH_BYTES // (4 * w.cols), 1, w.rows))
        _matmul_tiles(w, x[None], out[None], range(0, w.rows, tile), tile)


def refine_top(w: Weight, x: np.ndarray, out: np.ndarray, k: int) -> None:
    """Recompute the k largest of out = W @ x exactly: f64 dots of the dequantized rows
    with the f32 x, in column order, the same bits on every CPU (deq.exact_dots).

    For a vocabulary projection: the int8 rounding of x moves logits by up to a few
    hundredths, enough to flip a near-tie between the tokens that can be chosen, and
    the float kernels' FMA makes the last bits depend on the CPU. The candidates that
    sampling looks at are then exact, and the rest cost what decode costs.
    """
    k = min(k, w.rows)
    if k <= 0:
        return
    rows, vals = np.empty(k, np.int64), np.empty(k, np.float32)
    top_k(out, rows, vals)
    exact = np.empty(k, np.float32)
    D.exact_dots(int(w.qtype), pages.read_rows(w.data, rows), np.arange(k, dtype=np.int64), np.ascontiguousarray(x, np.float32),
                 _TAB16, _TABBF, exact)  # rows from the file: through the map, they stayed mapped (pages)
    out[rows] = exact


def exact_matvec(w: Weight, x: np.ndarray, out: np.ndarray) -> None:
    """out (rows,) = W @ x, every row by refine_top's exact dots: the same bits on every CPU
    (for small products that several nodes must agree on, such as a mixture's router)."""
    check_io(w, x, out, None)
    D.exact_dots(int(w.qtype), w.data, np.arange(w.rows, dtype=np.int64), x, _TAB16, _TABBF, out)


def exact_matmul(w: Weight, x: np.ndarray, out: np.ndarray) -> None:
    """out (n, rows) = x @ W.T for x (n, cols), each row exact_matvec's bits for its token (W read once)."""
    check_io(w, x, out, x.shape[0])
    D.exact_tokens(int(w.qtype), w.data, x, _TAB16, _TABBF, out)


def apply(w: Weight, x: np.ndarray | Batch, out: np.ndarray) -> None:
    """out = x @ w.T for (n, cols) x: matvec when decoding, matmul for batches."""
    batch = x if isinstance(x, Batch) else Batch(x)
    if batch.shape[0] == 1:
        matvec(w, batch, out[0])
    else:
        matmul(w, batch, out)


_SCRATCH_BYTES = 2 << 20  # f32 tile of W decoded per step (sgemm is fastest from ~128 rows)
_pool: ThreadPoolExecutor | None = None  # prefill workers, created on first threaded matmul
_pool_size = 0


def matmul(w: Weight, x: np.ndarray | Batch, out: np.ndarray) -> None:
    """out (n, rows) = x (n, cols) @ W.T, x an array or a Batch.

    The types of intgemm.KINDS go to its integer kernels where the CPU has them.
    Otherwise each tile of W is decoded once for all n tokens: workers (numba's
    thread count of them) take interleaved tiles of rows, a numba kernel decodes
    the tile into an f32 scratch (tile, cols), and single-threaded OpenBLAS sgemm
    multiplies it by all tokens. A numba axpy micro-kernel reached 25-37 GFLOP/s
    per core here, sgemm 60-68.
    """
    batch = x if isinstance(x, Batch) else None
    x = x.x if batch is not None else x
    check_io(w, x, out, x.shape[0] if x.ndim == 2 else -1)
    use_threads()
    # attention's BLAS products follow, on either path: OpenBLAS's own threads would fight ours
    _openblas_single_thread()
    if kept(w) and intgemm.available(w.qtype):  # decode's bits for each token (generic: sgemm, as for every type)
        intgemm.Kept(w.qtype, [panels(w)], (batch or Batch(x)).ints(intgemm.wide(w.qtype)), out, [0])(
            x.shape[0], threads() == 1)
        return
    if intgemm.available(w.qtype):  # every ISA: the same bits on each
        xq = (batch or Batch(x)).ints(intgemm.wide(w.qtype))
        intgemm.matmul(w.qtype, w.data, _TAB16, xq, out)
        return
    # rows per tile: scratch <= 2 MiB, >= 32 rows for sgemm. Never from the thread count:
    # sgemm's result for a row depends on the tile shape it sits in (1.3e-5 apart on AVX2),
    # and the same text must come out at any --threads.
    tile = int(np.clip(min(_SCRATCH_BYTES // (4 * w.cols), -(-w.rows // 4)), 32, 1024))
    starts = range(0, w.rows, tile)
    nt = min(threads(), len(starts))
    if nt == 1:
        _matmul_tiles(w, x, out, starts, tile)
        return
    global _pool, _pool_size
    if _pool is None or _pool_size < nt:
        _pool, _pool_size = ThreadPoolExecutor(max_workers=nt, thread_name_prefix="edgetp-matmul"), nt
    jobs = [_pool.submit(_matmul_tiles, w, x, out, starts[i::nt], tile) for i in range(nt)]
    for job in jobs:
        job.result()


def _matmul_tiles(w: Weight, x: np.ndarray, out: np.ndarray, starts, tile: int) -> None:
    scratch = np.empty((tile, w.cols), np.float32)  # (tile, cols) decoded rows of W
    for r0 in starts:
        r1 = min(w.rows, r0 + tile)
        D.dequant_rows_serial(int(w.qtype), w.data[r0:r1], _TAB16, _TABBF, scratch[: r1 - r0])
        np.matmul(x, scratch[: r1 - r0].T, out=out[:, r0:r1])


@functools.cache
def _openblas_single_thread() -> None:
    """Pin numpy's OpenBLAS to one thread (our workers parallelise), even if numpy
    was imported before OPENBLAS_NUM_THREADS=1 was set. Best effort."""
    libs = Path(np.__file__).resolve().parent.parent / "numpy.libs"
    for lib in libs.glob("libscipy_openblas*.so*"):
        try:
            dll = ctypes.CDLL(str(lib))
        except OSError:
            continue
        for sym in ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads", "openblas_set_num_threads"):
            if hasattr(dll, sym):
                getattr(dll, sym)(1)
                return


def dequantize_rows(w: Weight, start: int, stop: int) -> np.ndarray:
    """Rows start..stop of W as f32 (stop-start, cols), bit-identical to gguf-py."""
    out = np.empty((stop - start, w.cols), np.float32)
    D.dequant_rows(int(w.qtype), w.data[start:stop], _TAB16, _TABBF, out)
    return out


# ---------------------------------------------------------------- slicing


def slice_rows(w: Weight, start: int, stop: int) -> Weight:
    """Rows start..stop, a zero-copy view."""
    start, stop, _ = slice(start, stop).indices(w.rows)
    return Weight(w.qtype, stop - start, w.cols, w.data[start:stop])


def slice_cols(w: Weight, start: int, stop: int) -> Weight:
    """Columns start..stop (block-aligned) as a contiguous copy of just those blocks."""
    bs, nbytes = _BLOCK[w.qtype]
    if start % bs or stop % bs or not 0 <= start < stop <= w.cols:
        raise ValueError(f"columns {start}:{stop} are not whole {_type_name(w.qtype)} blocks of {bs} within 0:{w.cols}")
    data = np.ascontiguousarray(w.data[:, start // bs * nbytes : stop // bs * nbytes])
    return Weight(w.qtype, w.rows, stop - start, data)


# ---------------------------------------------------------------- Q8_0 codec for activations


def quantize_q8_0(x: np.ndarray, back: bool = False) -> np.ndarray:
    """f32 (n,) with n % 32 == 0 -> (n//32*34,) uint8, byte-identical to ggml's quantize_row_q8_0.

    Per block: d = max|x|/127 (stored as f16), q = roundf(x/d) (half away from zero).
    Blocks whose max |x| is below ~1e-36 make 1/d overflow, as in ggml. back: x (C-contiguous)
    is then replaced by what dequantize_q8_0 gives for the blocks (an all-reduce's root applies
    the rounded total it sends), in the same pass.
    """
    given = x
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 1 or x.shape[0] % 32:
        raise ValueError(f"quantize_q8_0 needs a 1-D array whose length is a multiple of 32, got {x.shape}")
    if back and x is not given:
        raise ValueError("quantize_q8_0(back=True) writes into x: it must be C-contiguous float32 itself")
    out = np.empty(x.shape[0] // 32 * 34, np.uint8)
    K.quantize_q8_0_blocks(x, _TAB16, out, back)
    return out


def dequantize_q8_0(buf: Any, n: int, out: np.ndarray | None = None, add: bool = False) -> np.ndarray:
    """(n//32*34,) uint8 Q8_0 blocks (an array or any bytes-like buffer) -> f32 (n,): into `out` (C-contiguous f32, n values) when given, added
    to what it holds when `add` (f32 sums, as numpy's +=)."""
    buf = np.frombuffer(buf, np.uint8)
    if n % 32 or buf.shape[0] != n // 32 * 34:
        raise ValueError(f"{buf.shape[0]} bytes are not the Q8_0 blocks of {n} values")
    if out is None:
        out = np.zeros(n, np.float32)
    elif out.dtype != np.float32 or out.size != n or not out.flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous float32 of {n} values, got {out.dtype} {out.shape}")
    K.q8_0_values(buf, _TAB16, out.reshape(-1), add)
    return out.reshape(-1)
