#!/usr/bin/env python3
"""Streams running while a long prompt arrives: what reading it costs the streams.

    python tools/bench_mixed.py                                  # SmolLM2, the 2-node cluster
    python tools/bench_mixed.py --models llama1b-q4_0 --setups one,two --streams 4 --long 1000

Real `edgetp serve` daemons on loopback, as tools/bench_serve.py starts them (``one``: one
daemon; ``two``: the self-formed 2-node cluster, tensor-parallel unless ``--parallel`` says
otherwise). ``--streams`` clients stream completions;
once each has streamed a few tokens, one more client sends a prompt of ``--long`` token ids.
The engine reads it in prefill chunks between (or, mixed, inside) the running streams' decode
steps. Reported, over the window from that request being sent to its first token:

* p50, p95 and max time between tokens of the running streams (gaps that end in the window),
  beside their p50 outside the window;
* engine steps in the window and all-reduce rounds per step (the root's
  ``edgetp_allreduce_rounds`` and ``edgetp_steps_total{kind="decode"}`` from /metrics, before
  and after; every step in the window carries the streams' decode rows);
* the long request's time to first token.

A warm-up round with another long prompt runs first (kernels loaded; no prefix shared with the
timed one). One run on a machine that may be shared: read the figures as one sample.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.bench_local import BUILTIN, ModelSpec  # noqa: E402
from tools.bench_serve import (PROMPT_TOKENS, Daemon, Stream, add_daemon_args,  # noqa: E402
                               get_json, markdown, models_of, ms, one_stream, pct, plan_line, preamble, prompt_ids,
                               serve_flags, serving_setup, setups_of, token_ids)

WARM_TOKENS = 8      # tokens each running stream has streamed before the long prompt is sent
STREAM_TOKENS = 128  # tokens each running stream asks for


@dataclass(frozen=True)
class Result:
    steps: int | None           # engine steps while the long prompt was read
    rounds: int | None          # all-reduce rounds in them
    tbt50: float | None         # s, running streams' gaps ending in the window
    tbt95: float | None
    tbt_max: float | None
    tbt50_outside: float | None
    long_ttft: float | None
    error: str | None = None


def scrape(url: str) -> dict[str, float]:
    """The two counters this bench reads from /metrics (a missing one is absent)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for name, pattern in (("rounds", r"^edgetp_allreduce_rounds (\S+)$"),
                          ("steps", r'^edgetp_steps_total\{kind="decode"\} (\S+)$')):
        if m := re.search(pattern, text, re.M):
            out[name] = float(m.group(1))
    return out


async def scenario(url: str, model: str, streams: int, long: int, limit: float, seed: int) -> Result:
    import openai  # noqa: PLC0415

    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=limit) as client:
        running = [Stream(time.perf_counter()) for _ in range(streams)]
        tasks = [asyncio.create_task(one_stream(client, model, prompt_ids(seed, i), STREAM_TOKENS, s))
                 for i, s in enumerate(running)]
        try:
            deadline = time.monotonic() + limit
            while min(len(s.arrivals) for s in running) < WARM_TOKENS and time.monotonic() < deadline:
                if any(t.done() for t in tasks):
                    break
                await asyncio.sleep(0.01)
            before = await asyncio.to_thread(scrape, url)
            sent = time.perf_counter()
            first = await one_stream(client, model, token_ids(long, seed), 1)
            after = await asyncio.to_thread(scrape, url)
            await asyncio.wait_for(asyncio.gather(*tasks), limit)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    failed = [s.error for s in [*running, first] if s.error]
    if failed or not first.arrivals:
        return Result(None, None, None, None, None, None, None, failed[0] if failed else "no first token")
    end = first.arrivals[0]
    inside, outside = [], []
    for s in running:
        for a, b in zip(s.arrivals, s.arrivals[1:]):
            (inside if sent < b <= end else outside).append(b - a)
    delta = {k: after[k] - before[k] for k in ("rounds", "steps") if k in before and k in after}
    steps = int(delta["steps"]) if "steps" in delta else None
    rounds = int(delta["rounds"]) if "rounds" in delta else None
    return Result(steps, rounds, pct(inside, 50), pct(inside, 95), max(inside, default=None), pct(outside, 50),
                  end - sent)


def run_setup(setup: str, spec: ModelSpec, path: Path, args: argparse.Namespace, flags: set[str]) -> tuple[str, Result]:
    daemons: list[Daemon] = []
    ctx = -(-(max(args.long, PROMPT_TOKENS + STREAM_TOKENS) + 16) // 64) * 64
    ns = argparse.Namespace(clients=[args.streams + 1], slots=args.streams + 1, threads=args.threads,
                            start_timeout=args.start_timeout, logs=args.logs)
    try:
        with serving_setup(setup, path, ns, flags, daemons, ctx,
                           ["--parallel", args.parallel] if setup == "two" else []) as root:
            model = get_json(root.url, "/v1/models")["data"][0]["id"]
            warm = asyncio.run(scenario(root.url, model, args.streams, args.long, args.limit, seed=1))
            if warm.error:
                raise RuntimeError(f"warm-up: {warm.error}")
            result = asyncio.run(scenario(root.url, model, args.streams, args.long, args.limit, seed=2))
            return plan_line(root.url), result
    except Exception as exc:  # noqa: BLE001 - one failed setup is reported, the others still run
        tails = "; ".join(line for d in daemons for line in list(d.tail)[-3:])
        return f"FAILED: {exc} {tails}", Result(None, None, None, None, None, None, None, str(exc))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2", help=f"comma-separated: {', '.join(BUILTIN)} or .gguf paths")
    ap.add_argument("--setups", default="two", help="comma-separated: one, two")
    ap.add_argument("--streams", type=int, default=3, help="running streams (3)")
    ap.add_argument("--long", type=int, default=1000, help="token ids in the long prompt (1000)")
    ap.add_argument("--parallel", default="tp", choices=("tp", "pp", "auto"),
                    help="plan kind of the 2-node cluster (tp: both nodes split every layer, so every step pays "
                         "its all-reduces)")
    ap.add_argument("--limit", type=float, default=600.0, help="seconds a scenario may take (600)")
    add_daemon_args(ap)
    args = ap.parse_args(argv)
    setups = setups_of(ap, args.setups)
    if args.streams < 1 or args.long < 2:
        ap.error("--streams must be at least 1 and --long at least 2")
    flags = serve_flags()
    print(preamble("streams while a long prompt arrives") +
          f"\n- {args.streams} running stream(s) of {STREAM_TOKENS} tokens, then one prompt of {args.long} token ids; "
          f"{args.threads} thread(s) per daemon; the window: that request sent -> its first token\n", flush=True)
    head = ["model", "setup", "steps", "rounds/step", "TBT p50 ms", "TBT p95 ms", "TBT max ms", "p50 outside ms",
            "long TTFT ms", "notes"]
    body = []
    for spec, path in models_of(args.models, args.cache_dir):
        for setup in setups:
            print(f"{spec.label}, {setup} ...", file=sys.stderr, flush=True)
            plan, r = run_setup(setup, spec, path, args, flags)
            per = "-" if not r.steps or r.rounds is None else f"{r.rounds / r.steps:.1f} ({r.rounds}/{r.steps})"
            body.append([spec.label, setup, "-" if r.steps is None else str(r.steps), per, ms(r.tbt50), ms(r.tbt95),
                         ms(r.tbt_max), ms(r.tbt50_outside), ms(r.long_ttft), r.error or plan])
    print(markdown(head, body), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
