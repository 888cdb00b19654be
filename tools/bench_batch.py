#!/usr/bin/env python3
"""One batched decode step on one process: B sequences' tokens at once vs B single-token steps.

    python tools/bench_batch.py                                   # every model, 1 and 2 threads
    python tools/bench_batch.py --models smollm2 --threads 1 --batches 1,4,8
    python tools/bench_batch.py --models smollm2 --kv-types f16,q8_0 --prompt 1000   # attention's share

For each model and thread count, in its own subprocess (numba's thread count is per
process), a Shard with max(batches) KV slots is prefilled with a short prompt in each
slot (``--prompt`` tokens, a KV cache of ``--kv-types``); then it times

* ``single``: one token of one sequence, Shard.forward + Shard.logits (today's decode step);
* ``B rows``: one token of each of B sequences, Shard.forward_rows + Shard.logits_rows
  (each row the bits of the single step: tests/test_batch_rows.py).

Each figure is the median of ``--reps`` steps (positions advance). Printed: step time,
aggregate tok/s (B / step time) and the speed-up over B single steps. Models are
tools/bench_local.py's (its files in <edgetp cache>/bench, written once).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools import bench_local  # noqa: E402

DEFAULT_MODELS = ("smollm2", "llama1b-q4_0", "llama1b-q8_0")
PROMPT = 8  # tokens prefilled into each slot before timing (default)


def worker(path: str, batches: list[int], reps: int, kv_type: str = "f16", prompt: int = PROMPT) -> dict:
    import numpy as np

    from edgetp.model import gguf, isa, llama, quant

    mf = gguf.open_model(path)
    slots = max(batches)
    shard = llama.Shard(llama.load_weights(mf), ctx=prompt + 2 * reps + 4, slots=slots, kv_type=kv_type)
    vocab = int(mf.config.vocab)
    for s in range(slots):
        shard.forward(llama.embed(mf, [(10 + 7 * s + i) % vocab for i in range(prompt)]), 0, slot=s)
    pos = [prompt] * slots
    x1 = llama.embed(mf, [11])

    def single() -> float:
        t0 = time.perf_counter()
        shard.logits(shard.forward(x1.copy(), pos[0], slot=0))
        dt = time.perf_counter() - t0
        pos[0] += 1
        return dt

    def rows(b: int) -> float:
        x = llama.embed(mf, [(20 + s) % vocab for s in range(b)])
        sl = np.arange(b)
        t0 = time.perf_counter()
        shard.logits_rows(shard.forward_rows(x, sl, [pos[s] for s in range(b)]))
        dt = time.perf_counter() - t0
        for s in range(b):
            pos[s] += 1
        return dt

    quant.use_threads()
    single()  # warm-up: kernels load from numba's cache
    rows(max(2, min(batches)) if slots > 1 else 1)
    for s in range(slots):
        pos[s] = prompt  # rewrite the same positions: only the timing matters here
    out = {"isa": isa.current(), "threads": quant.threads(), "single": statistics.median(single() for _ in range(reps))}
    pos[0] = prompt
    for b in batches:
        out[str(b)] = statistics.median(rows(b) for _ in range(reps))
        for s in range(slots):
            pos[s] = prompt
    return out


def run(path: Path, threads: int, batches: list[int], reps: int, timeout: float, kv_type: str = "f16",
        prompt: int = PROMPT) -> tuple[dict | None, str | None]:
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS=str(threads), NUMBA_NUM_THREADS=str(threads))
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    spec = json.dumps(dict(path=str(path), batches=batches, reps=reps, kv_type=kv_type, prompt=prompt))
    try:
        p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", spec], env=env, cwd=str(ROOT),
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timeout after {timeout:.0f} s"
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:]), None
    return None, f"exit {p.returncode}: " + " | ".join((p.stderr or p.stdout).strip().splitlines()[-3:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"of {', '.join(bench_local.BUILTIN)}")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--reps", type=int, default=5, help="steps per figure (median)")
    ap.add_argument("--kv-types", default="f16", help="KV cache types, comma-separated (f16, f32, q8_0)")
    ap.add_argument("--prompt", type=int, default=PROMPT, help="tokens in each slot's cache before timing")
    ap.add_argument("--cache-dir", default=None, help="where the benchmark models live (bench_local's default)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per subprocess")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        print("RESULT " + json.dumps(worker(spec["path"], spec["batches"], spec["reps"], spec["kv_type"], spec["prompt"])),
              flush=True)
        return 0
    try:
        threads = [int(t) for t in args.threads.split(",")]
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        ap.error("--threads and --batches are comma-separated integers")
    if min(threads + batches) < 1 or args.reps < 1 or args.prompt < 1:
        ap.error("--threads, --batches, --reps and --prompt must be at least 1")
    kv_types = [k for k in args.kv_types.split(",") if k]
    from edgetp.model.kvcache import KV_TYPES

    if not kv_types or set(kv_types) - set(KV_TYPES):
        ap.error(f"--kv-types: each of {', '.join(KV_TYPES)}")
    keys = [k for k in args.models.split(",") if k]
    unknown = [k for k in keys if k not in bench_local.BUILTIN]
    if unknown:
        ap.error(f"unknown model {', '.join(unknown)} (choose from {', '.join(bench_local.BUILTIN)})")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    cache = bench_local.bench_dir(args.cache_dir)
    from edgetp.model import isa

    print(f"Batched decode steps on {bench_local.cpu_line()}, {os.cpu_count()} CPUs, ISA {isa.current()}; "
          f"load avg {os.getloadavg()[0]:.2f} at start; median of {args.reps} steps after a {args.prompt}-token "
          f"prompt in each slot; {time.strftime('%Y-%m-%d %H:%M')}\n")
    print("| model | KV cache | threads | B | step ms | tok/s | single step ms | speed-up vs B single steps |")
    print("|---|---|---|---|---|---|---|---|")
    for key in keys:
        spec = bench_local.BUILTIN[key]
        path = bench_local.resolve_model(spec, cache, log)
        for kv, t in ((kv, t) for t in threads for kv in kv_types):
            res, err = run(path, t, batches, args.reps, args.timeout, kv, args.prompt)
            if err:
                print(f"| {spec.label} | {kv} | {t} | | FAILED: {err} | | | |", flush=True)
                continue
            one = res["single"]
            for b in batches:
                step = res[str(b)]
                print(f"| {spec.label} | {kv} | {t} | {b} | {step * 1e3:.1f} | {b / step:.1f} | {one * 1e3:.1f} | "
                      f"{b * one / step:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
