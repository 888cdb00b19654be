"""GB/s of the decode matvec per weight type and thread count, and prefill speedup.

    python tools/bench_kernels.py [--rows 4096 --cols 4096 --threads 1,2 --types Q8_0,Q4_0 --batch 64]
    python tools/bench_kernels.py --intdot [--threads 1 --types Q4_0,Q8_0,Q4_K]   (EDGETP_ISA=generic for the plain code)
    python tools/bench_kernels.py --intdot --types Q4_1 --shapes 3072x576,576x1536,960x576   (SmolLM2's)

--intdot also runs the kept panels of every type but Q8_0 (intgemm.KEPT): one token, and 8 tokens beside
the several-token kernel, both from RAM.

GB/s counts the GGUF bytes of the type (what a model file costs to stream).
"cold" cycles through enough copies of the matrix to exceed the L3 cache, so
weights come from RAM.
"""

from __future__ import annotations

import argparse
import os
import time

import numba
import numpy as np
from gguf import GGMLQuantizationType as QT

from edgetp.parallel.profile import random_weight
from edgetp.model import intdot, intgemm, isa
from edgetp.model import quant as Q
from edgetp.model.kernels import SPREAD, f16_table, partners, spans
from membw import sum4  # tools/ is on the path of a script run from it


def _time(fn, min_time=0.3) -> float:
    """Best of many calls: the machine is shared, so the minimum is the signal."""
    fn()
    best, t_end = float("inf"), time.perf_counter() + min_time
    while (t0 := time.perf_counter()) < t_end:
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench(qt: QT, rows: int, cols: int, threads: list[int], batch: int) -> None:
    rng = np.random.default_rng(0)
    base = random_weight(int(qt), rows, cols, seed=0)
    gguf_bytes = base.nbytes
    copies = max(1, int(np.ceil(128e6 / base.nbytes)))
    ws = [base] + [Q.Weight(base.qtype, rows, cols, base.data.copy()) for _ in range(copies - 1)]
    x = rng.standard_normal(cols).astype(np.float32)
    out = np.empty(rows, np.float32)
    X = rng.standard_normal((batch, cols)).astype(np.float32)
    O = np.empty((batch, rows), np.float32)
    name = qt.name
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


@numba.njit(parallel=True, cache=True)
def _read_rows(w, out):
    # a plain read of a (rows, words) uint64 matrix in the decode kernels' order: four rows
    # SPREAD apart at a time
    rows = w.shape[0]
    for c in numba.prange(spans(rows)):
        for r in range(c * 4 * SPREAD, min(rows, c * 4 * SPREAD + SPREAD)):
            r1, r2, r3 = partners(r, rows)
            out[r] = sum4(w[r], w[r1], w[r2], w[r3])


def bench_intdot(types: list[str], threads: list[int], shapes: list[tuple[int, int]]) -> None:
    """GB/s (stored bytes) of the integer decode kernels beside the float ones and a plain read of the same bytes.

    Shapes (rows x cols) default to a 1B model's decode: 8192x2048 (gate/up) and 2048x8192 (down). "cold" cycles
    through copies of the matrix totalling > 256 MB, so weights come from RAM. Best of many
    calls: the machine is shared.
    """
    arch, feats = isa.host_features()
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith(("model name", "Model"))), arch)
    print(f"CPU {cpu}; {arch} {' '.join(sorted(f for f in feats if f.startswith(('avx', 'fma', 'f16c', 'dotprod', 'neon'))))}")
    print(f"ISA {isa.current()} (NUMBA_CPU_NAME={numba.config.CPU_NAME or 'host'})", flush=True)
    rng = np.random.default_rng(0)
    for name in types:
        qt = QT[name]
        lay = intdot.LAYOUTS[qt]
        for rows, cols in shapes:
            base = intdot.random_blocks(qt, rows, cols // lay.values, rng)
            ws = [base] + [base.copy() for _ in range(max(1, int(np.ceil(256e6 / base.nbytes))) - 1)]
            x = rng.standard_normal(cols).astype(np.float32)
            xr = intdot.rounded(x)
            out = np.empty(rows, np.float32)
            for nt in threads:
                Q.set_threads(nt)
                it = iter(range(1 << 62))
                row = f"{name:7s} {rows}x{cols} threads={nt}"
                if base.shape[1] % 64 == 0:  # the same bytes read plainly (whole 8-word groups)
                    w64 = [w.view(np.uint64) for w in ws]
                    hot = _time(lambda: _read_rows(w64[0], out))
                    cold = _time(lambda: _read_rows(w64[next(it) % len(w64)], out))
                    row += f"  read hot {base.nbytes / hot / 1e9:6.2f} cold {base.nbytes / cold / 1e9:6.2f}"
                if intdot.available(qt):
                    hot = _time(lambda: intdot.matvec(qt, base, xr, out))
                    cold = _time(lambda: intdot.matvec(qt, ws[next(it) % len(ws)], xr, out))
                    row += f"  int hot {base.nbytes / hot / 1e9:6.2f} cold {base.nbytes / cold / 1e9:6.2f} GB/s"
                if intgemm.kept(int(qt)):  # kept panels (intgemm.KEPT): one token, then 8 beside intdot's several
                    row += _kept_columns(int(qt), ws, x, out, nt == 1, rng)
                if int(qt) in Q.SUPPORTED:  # quant.matvec on its float kernels (EDGETP_INT8=0)
                    wq = [Q.Weight(int(qt), rows, cols, w) for w in ws]
                    was = os.environ.get("EDGETP_INT8")
                    os.environ["EDGETP_INT8"] = "0"
                    hot = _time(lambda: Q.matvec(wq[0], x, out))
                    cold = _time(lambda: Q.matvec(wq[next(it) % len(wq)], x, out))
                    os.environ.pop("EDGETP_INT8") if was is None else os.environ.update(EDGETP_INT8=was)
                    row += f"  float hot {base.nbytes / hot / 1e9:6.2f} cold {base.nbytes / cold / 1e9:6.2f} GB/s"
                print(row, flush=True)


def _kept_columns(qt: int, ws: list[np.ndarray], x: np.ndarray, out: np.ndarray, serial: bool,
                  rng: np.random.Generator) -> str:
    """Hot and cold GB/s of one token on kept panels (intgemm.Kept), and the ms of 8 tokens there and
    on intdot's several-token kernel, every weight copy packed once beforehand."""
    ps = [intgemm.pack(qt, w, f16_table()) for w in ws]
    one = intgemm.decode_x(qt, x[None])  # (Q4_1: 16 bits, as its prefill rounds; else decode's int8)
    k1 = [intgemm.Kept(qt, [p], one, out[None], [0]) for p in ps]
    it = iter(range(1 << 62))
    hot = _time(lambda: k1[0](1, serial))
    cold = _time(lambda: k1[next(it) % len(k1)](1, serial))
    x8 = rng.standard_normal((8, x.shape[0])).astype(np.float32)
    o8 = np.empty((8, out.shape[0]), np.float32)
    k8 = [intgemm.Kept(qt, [p], intgemm.decode_x(qt, x8), o8, [0]) for p in ps]
    t8 = [intdot.TokenProducts(qt, [w], intdot.rounded_rows(x8), o8, [0]) for w in ws]
    kept8 = _time(lambda: k8[next(it) % len(k8)](8, serial))
    int8 = _time(lambda: t8[next(it) % len(t8)](8, serial))
    return (f"  kept hot {ws[0].nbytes / hot / 1e9:6.2f} cold {ws[0].nbytes / cold / 1e9:6.2f} GB/s; 8 tokens cold: int {int8 * 1e3:6.2f} ms,"
            f" kept {kept8 * 1e3:6.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--types", default="F32,F16,BF16,Q8_0,Q4_0,Q4_1,Q4_K,Q6_K")
    ap.add_argument("--intdot", action="store_true", help="integer decode kernels vs float kernels vs a plain read")
    ap.add_argument("--shapes", default="8192x2048,2048x8192", help="--intdot's weights, rows x cols, comma separated")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    if args.intdot:
        default = "F32,F16,BF16,Q8_0,Q4_0,Q4_1,Q4_K,Q6_K"
        bench_intdot(("Q8_0,Q4_0,Q4_1,Q4_K,Q6_K,Q5_0,Q5_1,Q5_K,Q2_K,Q3_K,IQ4_NL,IQ4_XS" if args.types == default
                      else args.types).split(","), threads,
                     [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")])
        return
    for name in args.types.split(","):
        qt = QT[name]
        bench(qt, args.rows, args.cols, threads, args.batch)


if __name__ == "__main__":
    main()
