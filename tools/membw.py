"""Single-core memory read bandwidth: the ceiling of a decode that streams every weight once.

    python tools/membw.py [--mb 512] [--threads 1]

Reads a buffer far larger than the caches with a numba loop of 8 independent
uint64 sums (no stores), best of several passes.
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np
from numba import njit, prange


@njit(parallel=True, cache=True, nogil=True)
def _read(buf):  # buf: (n, 8) uint64; sum of every word, lanes independent
    total = np.uint64(0)
    for c in prange(buf.shape[0] // 4096):
        acc = np.zeros(8, np.uint64)
        for i in range(c * 4096, (c + 1) * 4096):
            for j in range(8):
                acc[j] += buf[i, j]
        total += acc.sum()
    return total


def read_bandwidth(threads: int = 1, mb: int = 512, passes: int = 5) -> float:
    """Bytes per second a plain read of `mb` MB reaches on `threads` threads (best of `passes`)."""
    buf = np.ones((mb * (1 << 20) // 64 // 4096 * 4096, 8), np.uint64)
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
