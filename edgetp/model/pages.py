"""Giving back a model file's pages once nothing reads them.

Every tensor is a view of one read-only map of the GGUF file (gguf._map_tensors). A weight whose
products run on panels packed from it (intgemm.KEPT) is not read again after the packing, yet its
pages stay mapped: the process then holds the model twice, the panels and the file, and the file's
pages count in its RSS (and in what the kernel's OOM killer weighs) although nothing uses them.
`release` unmaps them (madvise MADV_DONTNEED): they stay in the page cache, clean, for the kernel
to keep or reclaim as it sees fit, and a later read maps them again with the same bytes (a minor
fault while they are cached, a read from the file if they were reclaimed).

A few rows read now and then (a token's embedding, the head's rows that decode recomputes exactly)
would map their pages again and keep them, with the neighbours the kernel maps around each fault:
64 KB per row, so a table of which nothing is kept grows back toward its whole size. `read_rows`
reads such rows from the file instead, through the descriptor `map_file` keeps beside its map (the
same file as the map even if the path is replaced since).
"""

from __future__ import annotations

import mmap
import os
import weakref

import numpy as np
from numba import njit, types
from numba.core.types import ExternalFunction

_FILES: weakref.WeakKeyDictionary[mmap.mmap, object] = weakref.WeakKeyDictionary()  # map -> its open file


def map_file(path: os.PathLike[str] | str) -> np.memmap:
    """The whole file, mapped read-only from its first byte, its file kept open as long as the map."""
    f = open(path, "rb", buffering=0)  # closed with the map, or here on failure
    try:
        mm = np.memmap(f, dtype=np.uint8, mode="r")
    except BaseException:
        f.close()
        raise
    _FILES[mm.base] = f
    weakref.finalize(mm.base, f.close)
    return mm


def read_rows(a: np.ndarray, rows) -> np.ndarray:
    """a[rows] for a 2-D C-contiguous byte array, as an array of its own. Where `a` is a view of a
    map_file map the rows are read from its file (pread), so that none of the map's pages is
    mapped by them; otherwise they are copied as numpy would."""
    rows = np.asarray(rows, np.int64).reshape(-1)
    mm = file_map(a)
    f = _FILES.get(mm) if mm is not None and a.ndim == 2 and a.flags.c_contiguous else None
    if f is None:
        return a[rows]
    if rows.size and not (0 <= rows.min() and rows.max() < a.shape[0]):
        raise IndexError(f"row {int(rows[(rows < 0) | (rows >= a.shape[0])][0])} is outside 0..{a.shape[0] - 1}")
    size = a.shape[1]
    at = rows * size + _offset(a, mm)  # map_file's map begins at the file's byte 0
    out = np.empty((rows.size, size), np.uint8)
    done = _pread_rows(f.fileno(), out, at)
    if done != rows.size:
        raise OSError(f"{f.name}: {size} bytes at byte {int(at[done])} could not be read")
    return out


_pread = ExternalFunction("pread", types.intp(types.intc, types.uintp, types.uintp, types.int64))


@njit(cache=True, nogil=True)
def _pread_rows(fd, out, at):  # pragma: no cover - compiled
    # out[i] = the out.shape[1] bytes of file fd at byte at[i]; returns the rows read whole (all, or
    # the first that failed or came short). A loop of os.preadv cost 3 us a row, this 0.8 (syscalls)
    size = out.shape[1]
    for i in range(at.shape[0]):
        if _pread(fd, out[i].ctypes.data, size, at[i]) != size:
            return i
    return at.shape[0]


def _offset(a: np.ndarray, mm: mmap.mmap) -> int:
    """Where `a`, a view of map mm, begins in it (bytes)."""
    return a.ctypes.data - np.frombuffer(mm, np.uint8).ctypes.data


def file_map(a: np.ndarray) -> mmap.mmap | None:
    """The read-only file map `a` is a view of, or None (memory of its own, or any other buffer)."""
    base = a
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, mmap.mmap) and not base.closed and not np.frombuffer(base, np.uint8, count=0).flags.writeable:
        return base  # a writable map may hold changes of its own, which DONTNEED would drop
    return None


def release(a: np.ndarray) -> int:
    """Unmap the whole pages that lie under `a` (contiguous, a view of a read-only file map); returns
    the bytes released, 0 where `a` is not such a view (DONTNEED on anonymous memory would zero it)
    or the kernel refused."""
    mm = file_map(a)
    if mm is None or a.size == 0 or not a.flags.c_contiguous or not hasattr(mm, "madvise"):
        return 0
    start = _offset(a, mm)
    lo = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    hi = (start + a.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if hi <= lo:
        return 0
    try:
        mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
    except (OSError, ValueError, AttributeError):
        return 0
    return hi - lo
