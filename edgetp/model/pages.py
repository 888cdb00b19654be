"""Giving back a model file's pages once nothing reads them.

Every tensor is a view of one read-only map of the GGUF file (gguf._map_tensors). A weight whose
products run on panels packed from it (intgemm.KEPT) is not read again after the packing, yet its
pages stay mapped: the process then holds the model twice, the panels and the file, and the file's
pages count in its RSS (and in what the kernel's OOM killer weighs) although nothing uses them.
`release` unmaps them (madvise MADV_DONTNEED): they stay in the page cache, clean, for the kernel
to keep or reclaim as it sees fit, and a later read maps them again with the same bytes (a minor
fault while they are cached, a read from the file if they were reclaimed).
"""

from __future__ import annotations

import mmap

import numpy as np


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
    origin = np.frombuffer(mm, np.uint8).ctypes.data
    start = a.ctypes.data - origin
    lo = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    hi = (start + a.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if hi <= lo:
        return 0
    try:
        mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
    except (OSError, ValueError, AttributeError):
        return 0
    return hi - lo
