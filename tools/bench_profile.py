#!/usr/bin/env python3
"""Does the speed profile tell how fast a node decodes? Profiled speed beside the speed decode reads at.

    python tools/bench_profile.py                                        # 1B shape Q4_0, Q4_K_M, Q8_0, SmolLM2
    python tools/bench_profile.py --models llama1b-q4_0 --threads 1,2

For each model and thread count, in its own subprocess (numba's thread count is per process):

* ``decode``: the weight bytes one token reads (tools/bench_local.py's count) over the median
  time of a decode step (Shard.forward + Shard.logits, 32 steps after an 8-token prompt): the
  speed the node really streams its weights at, the reference;
* ``profiled``: `parallel.profile.profile` at that thread count on the model's token pass
  (`profile.token_pass`: layer 0's matrices grouped as decode calls them and 1/L of the head),
  what the planner and the cost model are given (copies of the pass cycled through twice the
  last-level cache);
* ``one matrix``: the profile as it was before the token pass, one 8192-row matrix of the
  model's dominant type, cycled the same way.

Printed: GB/s of each and the ratio of each profile to the decode figure (1.00: a plan's
compute predicted exactly), and the token time the cost model predicts for one node from the
profile (`cost.predict` for one node of that speed) against decode's, now and as it was before
(the one matrix, and 90 µs a layer beyond the weights). Models are
tools/bench_local.py's. One run on a machine that may be shared: read it as one sample.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools import bench_local  # noqa: E402

DEFAULT_MODELS = ("llama1b-q4_0", "llama1b-q4_k_m", "llama1b-q8_0", "smollm2")
PROMPT, STEPS = 8, 32


def worker(path: str, threads: int) -> dict:
    from edgetp.model import gguf, isa, llama, quant
    from edgetp.parallel import profile

    quant.set_threads(threads)
    mf = gguf.open_model(path)
    shard = llama.Shard(llama.load_weights(mf), ctx=PROMPT + STEPS + 2)
    vocab = int(mf.config.vocab)
    shard.forward(llama.embed(mf, [(10 + i) % vocab for i in range(PROMPT)]), 0)
    times = []
    for i in range(STEPS):
        t0 = time.perf_counter()
        shard.logits(shard.forward(llama.embed(mf, [11 + i]), PROMPT + i))
        times.append(time.perf_counter() - t0)
    qtype = mf.dominant_type
    p = profile.profile(threads, 0.5, qtype, None, profile.token_pass(mf))
    one = profile.profile(threads, 0.5, qtype)
    return {"token_s": statistics.median(times), "profiled": p.speed, "one": one.speed, "isa": isa.current(),
            "cache": profile.cache_bytes(), "qtype": int(qtype)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS), help="tools/bench_local.py's model keys")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one measurement may take")
    ap.add_argument("--worker", nargs=2, metavar=("PATH", "THREADS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]))))
        return 0
    from gguf import GGMLQuantizationType as QT

    from edgetp.model import gguf
    from edgetp.parallel import cost, pipeline
    from edgetp.parallel.plan import NodeSpec
    from edgetp.parallel.shard import model_shape

    threads = [int(t) for t in args.threads.split(",") if t.strip()]
    keys = [k.strip() for k in args.models.split(",") if k.strip()]
    if unknown := [k for k in keys if k not in bench_local.BUILTIN]:
        ap.error(f"unknown model(s) {', '.join(unknown)}: use {', '.join(bench_local.BUILTIN)}")
    cache = bench_local.bench_dir(None)

    before = cost.Overheads(layer_s=90e-6, value_s=0.0)  # the per-layer constant of the one-matrix profile

    def predict(path: Path, speed: float, oh: cost.Overheads = cost.Overheads()) -> float:
        """The cost model's token time for one node of `speed` holding the whole model."""
        shape = model_shape(gguf.open_model(path), 64, 1, "f16")
        return cost.predict(pipeline.stage_plan(shape, [[NodeSpec("node", speed, 1 << 40)]]), {}, 1, oh).step_s

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    rows, seen = [], {}
    for key in keys:
        spec = bench_local.BUILTIN[key]
        path = bench_local.resolve_model(spec, cache, log)
        nbytes = bench_local.bytes_per_token(path)
        for nt in threads:
            log(f"{spec.label}, {nt} thread(s) ...")
            try:
                out = subprocess.run([sys.executable, __file__, "--worker", str(path), str(nt)], capture_output=True,
                                     text=True, timeout=args.timeout, check=True)
                r = json.loads(out.stdout.strip().splitlines()[-1])
            except (subprocess.SubprocessError, ValueError, IndexError) as exc:
                why = (getattr(exc, "stderr", None) or str(exc)).strip().splitlines() or [type(exc).__name__]
                rows.append(f"| {spec.label} | {nt} | failed: {why[-1]} | | | | | | | | |")
                continue
            seen = r
            decode = nbytes / r["token_s"]
            predicted = [predict(path, r["profiled"]), predict(path, r["one"], before)]
            rows.append(f"| {spec.label} | {nt} | {QT(r['qtype']).name} | {decode / 1e9:.1f} | "
                        f"{r['profiled'] / 1e9:.1f} | {r['profiled'] / decode:.2f} | {r['one'] / 1e9:.1f} | "
                        f"{r['one'] / decode:.2f} | {r['token_s'] * 1e3:.2f} | "
                        f"{predicted[0] * 1e3:.2f} ({predicted[0] / r['token_s'] - 1:+.0%}) | "
                        f"{predicted[1] * 1e3:.2f} ({predicted[1] / r['token_s'] - 1:+.0%}) |")
    llc = seen.get("cache")
    print(f"# edgetp speed profile against decode\n\n- {bench_local.cpu_line()}; ISA {seen.get('isa', '?')}; "
          f"last-level cache {f'{llc / 2**20:.0f} MiB (sysfs)' if llc else 'not listed by sysfs'}; "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    print("\n| model | threads | dominant type | decode GB/s (reference) | token pass GB/s | ÷ decode | "
          "one matrix GB/s (before) | ÷ decode | decode ms | predicted ms | predicted ms before (one matrix, 90 µs a layer) |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
