#!/usr/bin/env python3
"""Time to first token where it hurts: a short request behind a long prompt, a chat's second turn, and
clients that send one long system prompt at the same time.

    python tools/bench_ttft.py                                        # 1B shape Q4_0, one node
    python tools/bench_ttft.py --models smollm2,llama1b-q4_0 --setups one,two --long 2000 --chat 1000

Real `edgetp serve` daemons on loopback, started as tools/bench_serve.py starts them, 2 slots.
Every request goes through ``openai.AsyncOpenAI`` as a streamed, greedy completion of token ids.
Two scenarios, each reported as the time from a request sent to its first streamed text:

* **short behind long.** A prompt of ``--long`` token ids is sent (one answer token). Once the
  root has read its first chunk (``edgetp_steps_total{kind="prefill"}`` moved), short requests
  (64 ids, one answer token) are sent one after another until the long prompt answers or
  ``--shorts`` have run. Reported: their first-token times (p50, max, how many), beside the same
  short request with nothing else running, and the long prompt's own first-token time.
* **a chat's second turn.** Turn 1 is a prompt of ``--chat`` ids (16 tokens answered). Turn 2 is
  that prompt and 48 more ids (standing in for the answer and the next question), sent twice:
  warm, right after turn 1, so the prefix cache holds turn 1; then cold, after one unrelated
  request per slot has taken every slot in turn (least recently used first), so nothing of turn 1
  is left. Reported: both first-token times, the ``cached_tokens`` usage says for each, and the
  cold/warm ratio.
* **one system prompt, two clients at once.** Two requests are sent together, each ``--shared``
  ids and then 48 of its own (one answer token): first with different beginnings (nothing to
  share: the reference), then with the same one (a shared system prompt), each pair on prompts no
  slot holds yet. Reported: the later first-token time of each pair, the ``cached_tokens`` of the
  shared pair together (the whole chunks one copied from the other instead of reading them) and
  the distinct/shared ratio.

A warm-up request runs first (kernels loaded). Every daemon started is stopped, whatever happens.
One run on a machine that may be shared: read the figures as one sample.
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
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.bench_local import BUILTIN  # noqa: E402
from tools.bench_serve import (PROMPT_TOKENS, Daemon, add_daemon_args,  # noqa: E402
                               get_json, markdown, models_of, ms, pct, plan_line, preamble, serve_flags,
                               serving_setup, setups_of, token_ids)

SLOTS = 2            # the long prompt and one short request; the chat's turn and nothing else
TURN_ANSWER = 16     # tokens answered in each chat turn
TURN_MORE = 48       # ids turn 2 adds to turn 1's prompt
POLL = 0.02          # s between looks at /metrics


@dataclass
class Reply:
    ttft: float | None = None      # s, request sent -> first streamed text
    cached: int | None = None      # usage.prompt_tokens_details.cached_tokens
    error: str | None = None


async def ask(client: Any, model: str, ids: list[int], max_tokens: int) -> Reply:
    r, sent = Reply(), time.perf_counter()
    try:
        stream = await client.completions.create(model=model, prompt=ids, max_tokens=max_tokens, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            if r.ttft is None and chunk.choices and chunk.choices[0].text:
                r.ttft = time.perf_counter() - sent
            if chunk.usage is not None:
                details = chunk.usage.prompt_tokens_details
                r.cached = getattr(details, "cached_tokens", None) if details is not None else None
        if r.ttft is None:
            r.error = "no text streamed"
    except Exception as exc:  # noqa: BLE001 - a failed request is a table entry, not the end of the bench
        r.error = f"{type(exc).__name__}: {str(exc)[:120]}"
    return r


def prefill_steps(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    m = re.search(r'^edgetp_steps_total\{kind="prefill"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


@dataclass
class Result:
    alone: float | None = None                # s, a short request with nothing else running
    behind: tuple[float, ...] = ()            # s, short requests while the long prompt was read
    long_ttft: float | None = None
    cold: Reply | None = None
    warm: Reply | None = None
    distinct: tuple[Reply, ...] = ()          # two at once, different beginnings
    shared: tuple[Reply, ...] = ()            # two at once, the same beginning
    error: str | None = None


async def short_behind_long(client: Any, url: str, model: str, long: int, shorts: int, limit: float,
                            out: Result) -> None:
    seed = 100
    alone = await ask(client, model, token_ids(PROMPT_TOKENS, seed), 1)
    if alone.error:
        raise RuntimeError(f"short request alone: {alone.error}")
    out.alone = alone.ttft
    before = await asyncio.to_thread(prefill_steps, url)
    long_task = asyncio.create_task(ask(client, model, token_ids(long, seed + 1), 1))
    try:
        deadline = time.monotonic() + limit
        while await asyncio.to_thread(prefill_steps, url) <= before:  # its first chunk is read
            if long_task.done() or time.monotonic() > deadline:
                break
            await asyncio.sleep(POLL)
        behind = []
        for k in range(shorts):
            if long_task.done():
                break
            r = await ask(client, model, token_ids(PROMPT_TOKENS, seed + 2 + k), 1)
            if r.error:
                raise RuntimeError(f"short request behind the long prompt: {r.error}")
            behind.append(r.ttft)
        out.behind = tuple(behind)
        r = await asyncio.wait_for(long_task, limit)
    finally:
        long_task.cancel()
        await asyncio.gather(long_task, return_exceptions=True)
    if r.error:
        raise RuntimeError(f"long prompt: {r.error}")
    out.long_ttft = r.ttft


async def second_turn(client: Any, model: str, chat: int, out: Result) -> None:
    turn1 = token_ids(chat, 200)
    turn2 = turn1 + token_ids(TURN_MORE, 201)
    first = await ask(client, model, turn1, TURN_ANSWER)
    if first.error:
        raise RuntimeError(f"turn 1: {first.error}")
    out.warm = await ask(client, model, turn2, TURN_ANSWER)
    for k in range(SLOTS):  # each takes the least recently used slot: every slot is taken once
        r = await ask(client, model, token_ids(PROMPT_TOKENS, 300 + k), 1)
        if r.error:
            raise RuntimeError(f"evicting: {r.error}")
    out.cold = await ask(client, model, turn2, TURN_ANSWER)


async def together(client: Any, model: str, shared: int, seeds: tuple[int, int]) -> tuple[Reply, ...]:
    """SLOTS requests sent at once: `shared` ids of beginning seeds[0] + k * seeds[1], then 48 of their own."""
    prompts = [token_ids(shared, seeds[0] + k * seeds[1]) + token_ids(TURN_MORE, 500 + k) for k in range(SLOTS)]
    replies = await asyncio.gather(*(ask(client, model, p, 1) for p in prompts))
    if any(r.error for r in replies):
        raise RuntimeError(f"two at once: {next(r.error for r in replies if r.error)}")
    return tuple(replies)


async def scenarios(url: str, args: argparse.Namespace) -> Result:
    import openai  # noqa: PLC0415

    out = Result()
    model = get_json(url, "/v1/models")["data"][0]["id"]
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=args.limit) as client:
        warm = await ask(client, model, token_ids(PROMPT_TOKENS + 200, 1), 2)  # a whole chunk and decode rows
        if warm.error:
            raise RuntimeError(f"warm-up: {warm.error}")
        if args.long:
            await short_behind_long(client, url, model, args.long, args.shorts, args.limit, out)
        if args.chat:
            await second_turn(client, model, args.chat, out)
        if args.shared:
            out.distinct = await together(client, model, args.shared, (400, 1))
            out.shared = await together(client, model, args.shared, (450, 0))
    return out


def run_setup(setup: str, path: Path, args: argparse.Namespace, flags: set[str]) -> tuple[str, Result]:
    daemons: list[Daemon] = []
    ctx = -(-(max(args.long, args.chat + TURN_MORE + TURN_ANSWER, args.shared + TURN_MORE, PROMPT_TOKENS + 200)
              + 16) // 64) * 64
    ns = argparse.Namespace(clients=[SLOTS], slots=SLOTS, threads=args.threads, start_timeout=args.start_timeout,
                            logs=args.logs)
    try:
        with serving_setup(setup, path, ns, flags, daemons, ctx,
                           ["--parallel", args.parallel] if setup == "two" else []) as root:
            result = asyncio.run(scenarios(root.url, args))
            return plan_line(root.url), result
    except Exception as exc:  # noqa: BLE001 - one failed setup is reported, the others still run
        tails = "; ".join(line for d in daemons for line in list(d.tail)[-3:])
        return "", Result(error=f"FAILED: {exc} {tails}".strip())


def row(label: str, setup: str, r: Result, plan: str) -> list[str]:
    behind = (f"{ms(pct(r.behind, 50))} / {ms(max(r.behind))} ({len(r.behind)})" if r.behind else "-")
    cold, warm = r.cold or Reply(), r.warm or Reply()
    speedup = f"{cold.ttft / warm.ttft:.1f}x" if cold.ttft and warm.ttft else "-"
    cached = "-" if r.cold is None else f"{warm.cached} / {cold.cached}"
    apart, alike = (max(x.ttft for x in replies) if replies else None for replies in (r.distinct, r.shared))
    sharing = f"{apart / alike:.1f}x" if apart and alike else "-"
    copied = str(sum(x.cached or 0 for x in r.shared)) if r.shared else "-"
    return [label, setup, ms(r.alone), behind, ms(r.long_ttft), ms(cold.ttft), ms(warm.ttft), cached, speedup,
            ms(apart), ms(alike), copied, sharing, r.error or plan]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama1b-q4_0", help=f"comma-separated: {', '.join(BUILTIN)} or .gguf paths")
    ap.add_argument("--setups", default="one", help="comma-separated: one, two")
    ap.add_argument("--long", type=int, default=2000, help="token ids in the long prompt (2000; 0: skip)")
    ap.add_argument("--shorts", type=int, default=8, help="short requests sent while it is read, at most (8)")
    ap.add_argument("--chat", type=int, default=1000, help="token ids in the chat's first turn (1000; 0: skip)")
    ap.add_argument("--shared", type=int, default=1000,
                    help="token ids of the system prompt two clients send at once (1000; 0: skip)")
    ap.add_argument("--parallel", default="tp", choices=("tp", "pp", "auto"), help="plan kind of the 2-node cluster")
    ap.add_argument("--limit", type=float, default=600.0, help="seconds one request may take (600)")
    add_daemon_args(ap)
    args = ap.parse_args(argv)
    setups = setups_of(ap, args.setups)
    if min(args.long, args.chat, args.shared) < 0 or args.shorts < 1 or not (args.long or args.chat or args.shared):
        ap.error("--long, --chat and --shared must not be negative (one of them above 0), --shorts at least 1")
    if args.long and args.long <= PROMPT_TOKENS + 200:
        ap.error(f"--long must exceed {PROMPT_TOKENS + 200} token ids (more than two prefill chunks)")
    flags = serve_flags()
    print(preamble("time to first token") +
          f"\n- {args.threads} thread(s) per daemon, {SLOTS} slots; short requests: {PROMPT_TOKENS} ids, one token; "
          f"long prompt: {args.long} ids; chat: {args.chat} ids, then {TURN_MORE} more; system prompt: "
          f"{args.shared} ids, then {TURN_MORE} of each client's\n", flush=True)
    head = ["model", "setup", "short alone ms", "short behind long p50 / max ms (n)", "long TTFT ms",
            "turn 2 cold ms", "turn 2 warm ms", "cached warm / cold", "cold / warm",
            "2 at once, distinct: later ms", "2 at once, one system prompt: later ms", "cached (both)",
            "distinct / shared", "notes"]
    body = []
    for spec, path in models_of(args.models, args.cache_dir):
        for setup in setups:
            print(f"{spec.label}, {setup} ...", file=sys.stderr, flush=True)
            plan, r = run_setup(setup, path, args, flags)
            body.append(row(spec.label, setup, r, plan))
    print(markdown(head, body), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
