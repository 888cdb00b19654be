#!/usr/bin/env python3
"""Rebalancing at run time: a worker's CPU quota cut mid-answer, and how the root's plan follows it.

Root here (core 0), one `edgetp worker` (core 1) in a cgroup with a CPU quota, 1 thread each, on
loopback, planned with measured speeds (`--parallel`, default auto, the product's default). A
first answer sets the decode-step baseline (parallel/rebalance.StepWatch); once the plan is
older than the watch's minimum gap, a second answer runs and, at token `--cut-at`, the worker's
quota drops to `--quota` of a core. The watch sees the steps slow down, the runner re-plans with
speeds measured again, every token fed so far is replayed (batch.Scheduler), and the answer goes
on. Printed: tok/s before the cut, while slowed, after the re-plan; the tokens from the cut to the
re-plan and the re-plan's own time; and the ideal for the new speeds: a fresh plan made with the
worker already at the cut quota, decoding the same positions.

    python tools/bench_rebalance.py                       # the 1B shape Q8_0
    python tools/bench_rebalance.py --model smollm2 --quota 0.3

Every process and the cgroup are removed in a finally; every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository's root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# first: bench_parallel sets one thread per process before numba loads
from tools.bench_parallel import GREEDY, SMOLLM2, CpuQuota, Procs, ensure_1b, prompt_for, table  # noqa: E402
from edgetp.model import gguf, isa, quant  # noqa: E402
from edgetp.model.generate import generate  # noqa: E402
from edgetp.model.tokenizer import Tokenizer  # noqa: E402
from edgetp.net.loopthread import LoopThread  # noqa: E402
from edgetp.parallel import pipeline, rebalance  # noqa: E402
from edgetp.parallel.runner import ClusterRunner  # noqa: E402
from tools.bench_local import cpu_line  # noqa: E402

CTX = 512


def connect(lt: LoopThread, path: Path, addr: str, parallel: str) -> ClusterRunner:
    return lt.run(ClusterRunner.connect(gguf.open_model(path), [addr], ctx=CTX, threads=1, parallel=parallel),
                  timeout=600)


def plan_line(runner: ClusterRunner) -> str:
    speeds = " / ".join(f"{n.node_id} {n.speed / 1e9:.2f} GB/s" for n in runner.nodes)
    return f"{pipeline.describe(runner.plan)} (measured {speeds})"


def tok_s(ms: list[float]) -> float:
    return 1000 * len(ms) / sum(ms) if ms else float("nan")


def run(args) -> str:
    path = SMOLLM2 if args.model == "smollm2" else ensure_1b()
    mf = gguf.open_model(path)
    tok = Tokenizer.from_metadata(mf.metadata)
    prompt = prompt_for(path)
    os.sched_setaffinity(0, {0})
    quant.set_threads(1)
    out = []
    with contextlib.ExitStack() as stack:
        cg = stack.enter_context(CpuQuota(1.0, args.period_us))
        procs = stack.enter_context(Procs())  # exits first: members gone before the cgroup is removed
        _, addr = procs.worker(cpus={1}, cgroup_procs=cg.procs, node_id="worker")
        lt = stack.enter_context(LoopThread())
        runner = connect(lt, path, addr, args.parallel)
        began = time.monotonic()
        current, replans = [runner], []

        def recover(exc):
            t0 = time.perf_counter()
            current[0] = lt.run(current[0].recovered(exc), timeout=600)
            replans.append((str(exc), time.perf_counter() - t0, plan_line(current[0])))
            return current[0]

        try:
            before_plan = plan_line(runner)
            for _ in generate(runner, tok, prompt, GREEDY, args.tokens):  # the watch's baseline
                pass
            wait = rebalance.MIN_GAP_S - (time.monotonic() - began)
            if wait > 0:
                time.sleep(min(wait, 120))
            ms, cut_index, replan_index = [], None, None
            for ev in generate(runner, tok, prompt, GREEDY, args.tokens, recover=recover):
                ms.append(ev.ms)
                if replans and replan_index is None:
                    replan_index = len(ms) - 1  # this token's time holds the re-plan and the replay
                if len(ms) == args.cut_at:
                    cg.set(args.quota)
                    cut_index = len(ms)
            after_runner = current[0]
        finally:
            current[0].close()
        # the ideal for the new speeds: a plan made with the worker already slowed, same positions
        fresh = connect(lt, path, addr, args.parallel)
        try:
            fresh_plan = plan_line(fresh)
            ideal_ms = [ev.ms for ev in generate(fresh, tok, prompt, GREEDY, args.tokens)]
        finally:
            fresh.close()
    n_after = args.after
    steady = ms[max(1, args.cut_at - 16):args.cut_at]
    slowed = ms[cut_index:replan_index] if replan_index is not None else ms[cut_index:]
    after = ms[replan_index + 1:][-n_after:] if replan_index is not None else []
    ideal = ideal_ms[len(ms) - len(after):] if after else ideal_ms[-n_after:]
    rows = [["before the cut (full core)", before_plan, f"{tok_s(steady):.2f}"],
            [f"after the cut, before the re-plan ({len(slowed)} tokens)", "same", f"{tok_s(slowed):.2f}"],
            ["after the re-plan (last tokens)", replans[0][2] if replans else "no re-plan",
             f"{tok_s(after):.2f}"],
            ["ideal: a fresh plan at the new speeds, same positions", fresh_plan, f"{tok_s(ideal):.2f}"]]
    out.append(table(["phase", "plan", "decode tok/s"], rows))
    if replans:
        why, took, _ = replans[0]
        out.append(f"\nRe-planned {replan_index - cut_index + 1} token(s) after the cut (target: within 20): "
                   f"\"{why}\". The re-plan and the replay of {replan_index + len(prompt)} fed tokens took "
                   f"{took:.2f} s (the connect, the profiles and the replay; the token that waited for it took "
                   f"{ms[replan_index] / 1000:.2f} s).")
        out.append(f"**After / ideal = {tok_s(after) / tok_s(ideal):.0%}** (target ≥ 85%); median token "
                   f"{statistics.median(after):.1f} ms after, {statistics.median(ideal):.1f} ms ideal.")
    else:
        out.append(f"\n**No re-plan** within the {len(ms) - args.cut_at} tokens after the cut.")
    out.append(f"\n{len(replans)} re-plan(s) in all; the answer's plan at its end: {plan_line(after_runner)}.")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["1b", "smollm2"], default="1b")
    ap.add_argument("--parallel", choices=pipeline.PARALLEL, default="auto")
    ap.add_argument("--tokens", type=int, default=120, help="tokens of each answer")
    ap.add_argument("--cut-at", type=int, default=40, help="the answer's token at which the quota is cut")
    ap.add_argument("--quota", type=float, default=0.5, help="the worker's CPU quota after the cut, of one core")
    ap.add_argument("--after", type=int, default=20, help="tokens after the re-plan that are measured")
    ap.add_argument("--period-us", type=int, default=20000)
    args = ap.parse_args(argv)
    if CpuQuota.available() is None:
        print("bench_rebalance: needs a writable cgroup cpu controller (run as root)", file=sys.stderr)
        return 1
    if os.cpu_count() < 2:
        print("bench_rebalance: needs 2 CPUs (root on core 0, worker on core 1)", file=sys.stderr)
        return 1
    label = "SmolLM2-135M Q4_1" if args.model == "smollm2" else "Llama-3.2-1B shape Q8_0"
    print(f"# Rebalancing at run time ({label}, --parallel {args.parallel})\n")
    print(f"CPU: {cpu_line()}; kernels {isa.current()}; root core 0, worker core 1 in a cgroup "
          f"(CPU quota cut from 100% to {args.quota:.0%} of a core at token {args.cut_at}); 1 thread each; "
          f"watch: window {rebalance.WINDOW}, factor {rebalance.FACTOR}, minimum gap {rebalance.MIN_GAP_S} s.\n")
    print(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
