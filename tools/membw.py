"""Single-core memory read bandwidth: the ceiling of a decode that streams every weight once.

    python tools/membw.py [--mb 512] [--threads 1]

Reads a buffer far larger than the caches, each thread summing contiguous pieces of it
with a plain compiled loop of uint64 adds (no stores; LLVM vectorizes it), best of several passes.
The loop is a function of its own: written inside the prange body (as it was until 2026-11-25),
numba left it scalar, and on a Zen 4 it read 4.9 GB/s where this reads 34 (numpy's sum: 31), so
every decode there looked faster than memory.
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np
from numba import njit, prange


PIECE = 1 << 15  # uint64 words a thread sums at a time (256 KiB)


@njit(cache=True, nogil=True)
def _sum(words):  # a contiguous piece: the sum of its words
    s = np.uint64(0)
    for i in range(words.shape[0]):
        s += words[i]
    return s


@njit(parallel=True, cache=True, nogil=True)
def _read(buf):  # buf: (n * PIECE,) uint64; the sum of every word
    total = np.uint64(0)
    for c in prange(buf.shape[0] // PIECE):
        total += _sum(buf[c * PIECE : (c + 1) * PIECE])
    return total


def read_bandwidth(threads: int = 1, mb: int = 512, passes: int = 5) -> float:
    """Bytes per second a plain read of `mb` MB reaches on `threads` threads (best of `passes`)."""
    buf = np.ones(mb * (1 << 20) // 8 // PIECE * PIECE, np.uint64)
    prev = numba.get_num_threads()
    numba.set_num_threads(threads)
    try:
        _read(buf)
        best = float("inf")
        for _ in range(passes):
            t0 = time.perf_counter()
            _read(buf)
            best = min(best, time.perf_counter() - t0)
    finally:
        numba.set_num_threads(prev)
    return buf.nbytes / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    print(f"read bandwidth, {args.threads} thread(s): {read_bandwidth(args.threads, args.mb) / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
