"""Single-core memory read bandwidth: the ceiling of a decode that streams every weight once.

    python tools/membw.py [--mb 512] [--threads 1]

Reads a buffer far larger than the caches, each thread summing pieces of it with a plain
compiled loop of uint64 adds (no stores; LLVM vectorizes it), best of several passes, in two
ways: one stream (contiguous pieces in order) and four streams (four pieces a quarter of the
buffer apart, side by side, as the decode kernels walk four rows). The bandwidth is the better
of the two. One stream alone is not the ceiling everywhere: on an Emerald Rapids VM it read
8.9 GB/s at one hour, while bench_kernels' four-row read reached 20-28 and the decode kernels
themselves streamed 11-12, so a decode measured against the one stream looked faster than
memory (122-138%); four streams here read 14.8-15.8 beside other work.
The loops are functions of their own: written inside the prange body (as it was until
2026-11-25), numba left them scalar, and on a Zen 4 the one stream read 4.9 GB/s where this
reads 34 (numpy's sum: 31).
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


@njit(cache=True, nogil=True)
def sum4(a, b, c, d):  # four pieces side by side (bench_kernels reads four rows with it too)
    s0 = s1 = s2 = s3 = np.uint64(0)
    for i in range(a.shape[0]):
        s0 += a[i]
        s1 += b[i]
        s2 += c[i]
        s3 += d[i]
    return s0 + s1 + s2 + s3


@njit(parallel=True, cache=True, nogil=True)
def _read4(buf):  # buf: (4 * n * PIECE,) uint64; the sum of every word, four streams at a time
    q = buf.shape[0] // 4
    total = np.uint64(0)
    for c in prange(q // PIECE):
        a = c * PIECE
        total += sum4(buf[a : a + PIECE], buf[q + a : q + a + PIECE], buf[2 * q + a : 2 * q + a + PIECE],
                       buf[3 * q + a : 3 * q + a + PIECE])
    return total


def read_bandwidths(threads: int = 1, mb: int = 512, passes: int = 5) -> dict[str, float]:
    """Bytes per second a plain read of `mb` MB reaches on `threads` threads (best of `passes`),
    as one stream and as four."""
    buf = np.ones(mb * (1 << 20) // 8 // (4 * PIECE) * 4 * PIECE, np.uint64)
    prev = numba.get_num_threads()
    numba.set_num_threads(threads)
    out = {}
    try:
        for name, fn in (("one stream", _read), ("four streams", _read4)):
            fn(buf)
            best = float("inf")
            for _ in range(passes):
                t0 = time.perf_counter()
                fn(buf)
                best = min(best, time.perf_counter() - t0)
            out[name] = buf.nbytes / best
    finally:
        numba.set_num_threads(prev)
    return out


def read_bandwidth(threads: int = 1, mb: int = 512, passes: int = 5) -> float:
    """The better of read_bandwidths' two ways: what a decode's reads can reach."""
    return max(read_bandwidths(threads, mb, passes).values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    ways = read_bandwidths(args.threads, args.mb)
    print(f"read bandwidth, {args.threads} thread(s): {max(ways.values()) / 1e9:.1f} GB/s ("
          + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in ways.items()) + ")")


if __name__ == "__main__":
    main()
