"""GB/s of the decode matvec per weight type and thread count, and prefill speedup.

    python tools/bench_kernels.py [--rows 4096 --cols 4096 --threads 1,2 --types Q8_0,Q4_0 --batch 64]

GB/s counts the GGUF bytes of the original type (also for repacked layouts,
so numbers compare what a model file costs to stream). "cold" cycles through
enough copies of the matrix to exceed the L3 cache, so weights come from RAM.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from edgetp.model import quant as Q


def random_weight(qt: QT, rows: int, cols: int, rng: np.random.Generator) -> Q.Weight:
    """Random bytes with sane f16 scale fields, so the values are finite."""
    bs, ts = GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, size=(rows, cols // bs, ts), dtype=np.uint8)
    scale = rng.uniform(0.001, 0.01, size=(rows, cols // bs)).astype(np.float16).view(np.uint8)
    offsets = {QT.Q8_0: [0], QT.Q4_0: [0], QT.Q4_1: [0, 2], QT.Q4_K: [0, 2], QT.Q6_K: [208]}.get(qt, [])
    for off in offsets:
        raw[..., off : off + 2] = scale.reshape(rows, cols // bs, 2)
    if qt in (QT.F16, QT.BF16, QT.F32):
        vals = rng.standard_normal((rows, cols)).astype(np.float32)
        raw = {QT.F32: vals, QT.F16: vals.astype(np.float16), QT.BF16: (vals.view(np.uint32) >> 16).astype(np.uint16)}[qt]
    return Q.Weight(int(qt), rows, cols, np.ascontiguousarray(raw.view(np.uint8).reshape(rows, -1)))


def _time(fn, min_time=0.3) -> float:
    """Best of many calls: the machine is shared, so the minimum is the signal."""
    fn()
    best, t_end = float("inf"), time.perf_counter() + min_time
    while (t0 := time.perf_counter()) < t_end:
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench(qt: QT, rows: int, cols: int, threads: list[int], batch: int, repacked: bool) -> None:
    rng = np.random.default_rng(0)
    base = random_weight(qt, rows, cols, rng)
    gguf_bytes = base.nbytes
    copies = max(1, int(np.ceil(128e6 / base.nbytes)))
    ws = [base] + [Q.Weight(base.qtype, rows, cols, base.data.copy()) for _ in range(copies - 1)]
    if repacked:
        ws = [Q.repack(w) for w in ws]
        if ws[0] is base:
            return
    x = rng.standard_normal(cols).astype(np.float32)
    out = np.empty(rows, np.float32)
    X = rng.standard_normal((batch, cols)).astype(np.float32)
    O = np.empty((batch, rows), np.float32)
    name = f"{qt.name}{'->' + Q._type_name(ws[0].qtype) if repacked else ''}"
    for nt in threads:
        Q.set_threads(nt)
        hot = _time(lambda: Q.matvec(ws[0], x, out))
        it = iter(range(1 << 62))
        cold = _time(lambda: Q.matvec(ws[next(it) % len(ws)], x, out))
        mm = _time(lambda: Q.matmul(ws[0], X, O), min_time=0.5)
        print(
            f"{name:14s} threads={nt} hot {gguf_bytes / hot / 1e9:6.2f} GB/s  cold {gguf_bytes / cold / 1e9:6.2f} GB/s"
            f"  matvec {cold * 1e6:8.1f} us/token  matmul(n={batch}) {mm / batch * 1e6:8.1f} us/token"
            f"  speedup x{cold / (mm / batch):5.1f}",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--types", default="F32,F16,BF16,Q8_0,Q4_0,Q4_1,Q4_K,Q6_K")
    ap.add_argument("--no-repack", action="store_true")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    for name in args.types.split(","):
        qt = QT[name]
        bench(qt, args.rows, args.cols, threads, args.batch, repacked=False)
        if not args.no_repack:
            bench(qt, args.rows, args.cols, threads, args.batch, repacked=True)


if __name__ == "__main__":
    main()
