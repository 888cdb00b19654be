#!/usr/bin/env python3
"""Scoring a prompt (the API's `echo` with `logprobs`) against reading it, and against llama.cpp.

    python tools/bench_score.py                          # SmolLM2 and the 1B shape Q4_0, 1 thread
    python tools/bench_score.py --models llama1b-q4_k_m --tokens 512 --threads 2

For each model, in its own subprocess per engine (numba's thread count and llama.cpp's state never
leak), best of ``--reps``, the same PROMPT ids on both:

* ``edgetp read``   the prompt read by a batch.Scheduler on one LocalRunner, nothing answered
                    (max_tokens 0): prefill only, the logits of no position;
* ``edgetp scored`` the same with Seq.score = 1: every position's logits, log-sum-exp, best one
                    and the logit of the prompt's next token, as `echo` asks;
* ``llama.cpp``     llama-cpp-python with ``logits_all=True`` evaluating the prompt: every position's
                    logits (its own log-softmax not counted: a numpy pass here, not llama.cpp's work).

The two engines' log probabilities of the prompt tokens are compared (max |difference|), so the
table also says that both computed the same thing. Most of that difference is llama.cpp's own
rounding of the activations to 8 bits (tests/test_engine_reference.py holds each engine to the
exact float64 math: on SmolLM2 Q4_1 ours is within 2.8e-4 of the logits' spread, llama.cpp 2.6e-2
on average). Timings are one sample on a machine that may be shared.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.bench_local import BUILTIN, _prompt, bench_dir, cpu_line, resolve_model  # noqa: E402

DEFAULT_MODELS = ("smollm2", "llama1b-q4_0")


def worker_edgetp(path: str, threads: int, n: int, reps: int) -> dict[str, Any]:
    from edgetp.model import gguf, isa, quant, sampling
    from edgetp.model.batch import Scheduler, Seq
    from edgetp.model.generate import LocalRunner
    from edgetp.model.tokenizer import Tokenizer

    quant.set_threads(threads)
    mf = gguf.open_model(path)
    tok = Tokenizer.from_metadata(mf.metadata)
    sched = Scheduler(LocalRunner(mf, ctx=n + 16, slots=1), tok)
    prompt = _prompt(n, int(mf.config.vocab))
    greedy = sampling.SamplingParams(temperature=0)

    def run(score: int | None) -> tuple[float, list[float]]:
        seq = Seq(prompt, greedy, 0, score=score)
        sched.cache.forget()  # read in full every time: no chunk from the prefix cache
        t0 = time.perf_counter()
        sched.admit(seq)
        for _ in range(n + 4):  # one chunk a step
            sched.step()
            if seq.done:
                break
        return time.perf_counter() - t0, [lp.logprob for lp in seq.scores]

    run(None), run(1)  # warm-up: kernels from the cache
    read = min(run(None)[0] for _ in range(reps))
    scored = [run(1) for _ in range(reps)]
    return dict(read_s=read, scored_s=min(s for s, _ in scored), logprobs=scored[0][1], isa=isa.current())


def worker_llama_cpp(path: str, threads: int, n: int, reps: int) -> dict[str, Any]:
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(model_path=path, n_ctx=n + 16, n_batch=512, n_threads=threads, n_threads_batch=threads,
                          logits_all=True, verbose=False)
    prompt = _prompt(n, llm.n_vocab())
    best = float("inf")
    for _ in range(reps + 1):  # the first is the warm-up
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        best = min(best, time.perf_counter() - t0)
    x = np.array(llm.scores[:n], dtype=np.float64)
    top = x.max(axis=1, keepdims=True)
    lsm = x - top - np.log(np.exp(x - top).sum(axis=1, keepdims=True))
    return dict(eval_s=best, logprobs=[float(lsm[i, prompt[i + 1]]) for i in range(n - 1)])


def run_worker(engine: str, path: Path, threads: int, n: int, reps: int) -> dict[str, Any]:
    spec = json.dumps(dict(engine=engine, path=str(path), threads=threads, n=n, reps=reps))
    proc = subprocess.run([sys.executable, __file__, "--_worker", spec], capture_output=True, text=True,
                          timeout=1800, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{engine} on {path.name} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma separated: " + ", ".join(BUILTIN))
    ap.add_argument("--tokens", type=int, default=256, help="prompt tokens")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--_worker", dest="worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        fn = worker_edgetp if spec.pop("engine") == "edgetp" else worker_llama_cpp
        print(json.dumps(fn(**spec)))
        return 0
    cache = bench_dir(args.cache_dir)
    rows = []
    for name in args.models.split(","):
        path = resolve_model(BUILTIN[name], cache, lambda m: print(m, file=sys.stderr)) if name in BUILTIN else Path(name)
        ours = run_worker("edgetp", path, args.threads, args.tokens, args.reps)
        ref = run_worker("llama.cpp", path, args.threads, args.tokens, args.reps)
        diff = max(abs(a - b) for a, b in zip(ours["logprobs"], ref["logprobs"]))
        n = args.tokens
        rows.append(f"| {name} | {ours['isa']} | {n / ref['eval_s']:.1f} | {n / ours['read_s']:.1f} | "
                    f"{n / ours['scored_s']:.1f} | {ours['scored_s'] / ours['read_s'] - 1:+.0%} | "
                    f"{ref['eval_s'] / ours['scored_s']:.2f}x | {diff:.1e} |")
    print(f"\n{cpu_line()}; {args.threads} thread(s); a {args.tokens}-token prompt; best of {args.reps}\n")
    print("| model | ISA | llama.cpp, every position's logits, tok/s | edgetp read tok/s | edgetp scored tok/s "
          "| scoring's cost | scored vs llama.cpp | max abs logprob difference |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
