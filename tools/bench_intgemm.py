"""GOPS of the integer prefill tiles (intgemm.py) against the float path (decoded tiles, f32 sgemm).

    python tools/bench_intgemm.py [--shapes 2048x2048,8192x2048 --tokens 256 --types Q8_0,Q4_0,...,IQ4_XS --threads 1]
    EDGETP_ISA=avx2 python tools/bench_intgemm.py          (NUMBA_CPU_NAME=haswell on a wider CPU: isa.py sets it)

GOPS counts 2 * rows * cols * tokens (a multiply and an add per weight and token).
"int" is quant.matmul on the integer tiles of the ISA in use (activation rounding
included, panel packing included); "f32" the same call under EDGETP_INT8=0.
Best of several runs: the machine may be shared, so the minimum time is the signal.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np
from gguf import GGMLQuantizationType as QT

from edgetp.model import quant as Q  # configures the ISA before numba compiles
from edgetp.model import intgemm, isa
from edgetp.parallel.profile import random_weight


def _best(fn, reps: int = 5, min_time: float = 1.0) -> float:
    fn()
    best, t_end, n = float("inf"), time.perf_counter() + min_time, 0
    while n < reps or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        n += 1
        if n >= 50:
            break
    return best


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="2048x2048,8192x2048", help="rows x cols of each weight")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--types", default="Q8_0,Q4_0,Q4_1,Q5_0,Q5_1,Q2_K,Q3_K,Q4_K,Q5_K,Q6_K,IQ4_NL,IQ4_XS")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    Q.set_threads(args.threads)
    _, feats = isa.host_features()
    flags = ",".join(f for f in ("avx512vnni", "avxvnni", "avx2", "fma", "f16c", "dotprod") if f in feats)
    shape = intgemm.ISA_TILES[isa.current()][1]
    print(f"CPU {_cpu()} ({flags}); ISA {isa.current()}: {shape.rows}-row panels, {shape.nt} tokens per tile; "
          f"threads {args.threads}; {args.tokens} tokens", flush=True)
    rng = np.random.default_rng(0)
    for spec in args.shapes.split(","):
        rows, cols = (int(v) for v in spec.lower().split("x"))
        x = rng.standard_normal((args.tokens, cols)).astype(np.float32)
        out = np.empty((args.tokens, rows), np.float32)
        ops = 2.0 * rows * cols * args.tokens
        for name in args.types.split(","):
            w = random_weight(int(QT[name]), rows, cols, seed=1)
            os.environ.pop("EDGETP_INT8", None)
            if not intgemm.available(w.qtype):
                print(f"{name:5s} {rows}x{cols}: the integer tiles are unavailable here", flush=True)
                continue
            t_int = _best(lambda: Q.matmul(w, x, out))
            os.environ["EDGETP_INT8"] = "0"
            t_f32 = _best(lambda: Q.matmul(w, x, out))
            os.environ.pop("EDGETP_INT8", None)
            print(f"{name:5s} {rows}x{cols}: int {ops / t_int / 1e9:6.1f} GOPS ({t_int * 1e3:7.1f} ms)   "
                  f"f32 sgemm {ops / t_f32 / 1e9:6.1f} GOPS ({t_f32 * 1e3:7.1f} ms)   x{t_f32 / t_int:4.2f}", flush=True)


if __name__ == "__main__":
    main()
