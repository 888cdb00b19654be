#!/usr/bin/env python3
"""Serving under load: real `edgetp serve` daemons on loopback, N concurrent streaming clients.

    python tools/bench_serve.py                                   # every model, both setups, 1,2,4,8,16 clients
    python tools/bench_serve.py --models smollm2 --setups one --clients 1,2,4     # a quick run

Setups (``--setups``): ``one`` is one daemon; ``two`` is the self-formed 2-node cluster
(two daemons sharing a fresh cluster key, finding each other by mDNS on 127.0.0.1 and
planning a tensor-parallel split). Models (``--models``): ``llama1b-q4_0``, ``llama1b-q8_0``
(the synthetic Llama-3.2-1B shape) and ``smollm2``, found or built as tools/bench_local.py does
(``<edgetp cache>/bench``), or paths to .gguf files.

For each setup and number of clients, every client streams one completion at once through
``openai.AsyncOpenAI``: a distinct prompt of 64 token ids, ``max_tokens`` 128, greedy. Reported:

* aggregate decode tok/s: every token after each stream's first, over the time from the
  earliest first token to the last token of all streams (queueing and prefills included:
  what the cluster delivers while that many people wait on it);
* aggregate tok/s while all decode: the tokens that arrive between the moment every stream has
  its first token and the moment the first stream ends, over that window (no prefill runs in
  it: what a decode step of that many sequences delivers; the single-client row's is its whole
  stream, as above);
* p50, p95 and max of the time between tokens, pooled over every stream (gaps between
  consecutive streamed chunks of one stream; the max is the longest stall);
* p50 and max of the time to first token (request sent to first text);
* the same figures beside the single-client row (x1 columns).

A level whose requests exceed its time limit or fail says so in the table. Every daemon
started is stopped (SIGTERM, then SIGKILL) whatever happens. Timings come from one run on a
machine that may be shared: read them as one sample, not a promise.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from edgetp.serve.spawn import start_daemon, stop  # noqa: E402
from tools.bench_local import BUILTIN, ModelSpec, bench_dir, cpu_line, resolve_model  # noqa: E402

DEFAULT_MODELS = ("llama1b-q4_0", "llama1b-q8_0", "smollm2")
SETUPS = ("one", "two")
PROMPT_TOKENS = 64
MAX_TOKENS = 128
FIRST_ID = 100   # prompt ids lie in FIRST_ID .. FIRST_ID + ID_SPAN: ordinary tokens in every vocabulary here
ID_SPAN = 900
CTX = 256        # prompt + answer fit, with room


# --------------------------------------------------------------------------- daemons


class Daemon:
    """One `edgetp serve` process, its API URL, and the last lines of its output (read by threads, so
    a chatty daemon never blocks on a full pipe); every line also goes to `log`, a file, if given."""

    def __init__(self, proc: subprocess.Popen, url: str, node_id: str, log: Path | None = None) -> None:
        self.proc, self.url, self.node_id = proc, url, node_id
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        if log:
            log.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log, "a", encoding="utf-8") if log else None  # noqa: SIM115 - closed by stop()
        self._readers = [threading.Thread(target=self._drain, args=(s,), daemon=True)
                         for s in (proc.stdout, proc.stderr) if s is not None]
        for t in self._readers:
            t.start()

    def _drain(self, stream: Any) -> None:
        try:
            for line in stream:
                self.tail.append(line.rstrip())
                if self._log:
                    self._log.write(f"{time.time():.3f} {line}")
                    self._log.flush()
        except (OSError, ValueError):  # closed under us by stop()
            pass

    def stop(self) -> None:
        stop(self.proc)
        for t in self._readers:
            t.join(timeout=5)
        if self._log:
            self._log.close()


def serve_flags() -> set[str]:
    """The options this `edgetp serve` takes (a batching engine adds --slots)."""
    out = subprocess.run([sys.executable, "-m", "edgetp", "serve", "--help"], capture_output=True, text=True,
                         timeout=60, env=child_env(), cwd=ROOT)
    return {word.strip(",[]") for word in out.stdout.split() if word.startswith("--")}


def child_env() -> dict[str, str]:
    """Daemons run this checkout's code, whatever is installed."""
    path = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": str(ROOT) + (os.pathsep + path if path else ""), "PYTHONUNBUFFERED": "1"}


def get_json(url: str, path: str, timeout: float = 5) -> dict[str, Any]:
    with urllib.request.urlopen(url + path, timeout=timeout) as resp:
        return json.load(resp)


def wait_until(check: Callable[[], Any], seconds: float, what: str) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if result := check():
                return result
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.3)
    raise RuntimeError(f"not within {seconds:.0f} s: {what}")


def start_setup(setup: str, model: Path, key: Path, args: argparse.Namespace, flags: set[str],
                daemons: list[Daemon], ctx: int = CTX, more: Sequence[str] = ()) -> Daemon:
    """Start the setup's daemons (appended to `daemons` as they start, so the caller stops every one),
    with `more` serve options; return the root once it serves."""
    extra = ["--ctx", str(ctx), *more]
    want = max(args.clients)
    if "--slots" in flags:
        extra += ["--slots", str(args.slots or want)]
    if "--queue" in flags:
        extra += ["--queue", str(want)]
    names = [f"bench-a-{os.getpid()}"] + ([f"bench-b-{os.getpid()}"] if setup == "two" else [])
    for i, name in enumerate(names):
        proc, url = start_daemon(str(model), str(key), name, priority=len(names) - i, threads=args.threads,
                                 extra=extra, env=child_env(), timeout=args.start_timeout)
        daemons.append(Daemon(proc, url, name, Path(args.logs) / f"{name}.log" if args.logs else None))
    root = daemons[0]
    wait_until(lambda: get_json(root.url, "/v1/cluster")["root"] == root.node_id, 60, f"{root.node_id} leads")
    if setup == "two":
        wait_until(lambda: sum(n["state"] == "ready" for n in get_json(root.url, "/v1/cluster")["nodes"]) == 2,
                   60, "both nodes ready in the root's view")
    return root


@contextlib.contextmanager
def serving_setup(setup: str, model: Path, args: argparse.Namespace, flags: set[str], daemons: list[Daemon],
                  ctx: int = CTX, more: Sequence[str] = ()) -> Iterator[Daemon]:
    """start_setup on a fresh cluster key (`edgetp keygen`); every daemon in `daemons` (the caller's
    list, so it can read their output after a failure) is stopped on leaving, whatever happens."""
    try:
        with tempfile.TemporaryDirectory(prefix="edgetp-bench-") as tmp:
            key = Path(tmp) / "cluster.key"
            subprocess.run([sys.executable, "-m", "edgetp", "keygen", str(key)], check=True, capture_output=True,
                           timeout=60, env=os.environ | child_env(), cwd=ROOT)
            yield start_setup(setup, model, key, args, flags, daemons, ctx, more)
    finally:
        for d in daemons:
            d.stop()


def plan_line(url: str) -> str:
    """The nodes and their FFN shares as the root sees them now."""
    view = get_json(url, "/v1/cluster")
    parts = [f"{n['node_id']} {n['state']} ffn {n['ffn_cols'][0]}-{n['ffn_cols'][1]}" for n in view["nodes"]]
    slots = view.get("slots")
    where = f"slots {slots['total']}" if slots else "no slots reported (one request at a time)"
    return f"root {view['root']}: " + "; ".join(parts) + f"; {where}"


def replans(url: str) -> int:
    """The root's count of re-plans so far (/metrics' edgetp_replans_total)."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        lines = resp.read().decode().splitlines()
    return int(sum(float(line.split()[-1]) for line in lines if line.startswith("edgetp_replans_total")))


# --------------------------------------------------------------------------- clients


@dataclass
class Stream:
    sent: float
    arrivals: list[float] = field(default_factory=list)  # perf_counter of each chunk with text
    tokens: int = 0                                       # completion tokens, from the usage chunk
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.arrivals[0] - self.sent if self.arrivals else None

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]


def prompt_ids(level: int, client: int) -> list[int]:
    """64 token ids, different for every client of every level (no prefix shared by accident)."""
    seed = 7919 * (level * 1000 + client + 1)
    return [FIRST_ID + (seed + 104729 * k * (client + 3)) % ID_SPAN for k in range(PROMPT_TOKENS)]


def token_ids(n: int, seed: int) -> list[int]:
    """n ordinary token ids; prompts of different seeds (below ID_SPAN apart) share no first id."""
    return [FIRST_ID + (seed * 7919 + k * 104729) % ID_SPAN for k in range(n)]


async def one_stream(client: Any, model: str, ids: list[int], max_tokens: int, s: Stream | None = None) -> Stream:
    """One streamed completion; its arrivals go into `s` (a new Stream unless given) as they come."""
    s = s or Stream(time.perf_counter())
    try:
        stream = await client.completions.create(model=model, prompt=ids, max_tokens=max_tokens, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                s.arrivals.append(time.perf_counter())
            if chunk.usage is not None:
                s.tokens = chunk.usage.completion_tokens
    except Exception as exc:  # noqa: BLE001 - a failed stream is a row entry, not the end of the bench
        s.error = f"{type(exc).__name__}: {str(exc)[:120]}"
    return s


async def level(url: str, model: str, clients: int, lvl: int, max_tokens: int, limit: float) -> list[Stream]:
    import openai  # noqa: PLC0415

    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=limit) as client:
        tasks = [asyncio.create_task(one_stream(client, model, prompt_ids(lvl, i), max_tokens))
                 for i in range(clients)]
        done, pending = await asyncio.wait(tasks, timeout=limit)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    out = []
    for t in tasks:
        if t in done:
            out.append(t.result())
        else:
            out.append(Stream(0.0, error=f"not finished within {limit:.0f} s"))
    return out


# --------------------------------------------------------------------------- figures


@dataclass
class Row:
    clients: int
    agg: float | None         # tok/s over every stream
    tbt50: float | None       # s
    tbt95: float | None
    tbt_max: float | None     # the longest stall of any stream
    ttft50: float | None
    ttft_max: float | None
    tokens: int
    short: int                # streams that ended before max_tokens
    errors: list[str]
    replans: int = 0          # re-plans of the cluster during the level (each replays every running sequence)
    steady: float | None = None  # tok/s while every stream decodes (after the last first token, before the first end)


def pct(values: Sequence[float], p: float) -> float | None:
    """The p-th percentile (nearest rank) of `values`; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered), max(1, math.ceil(p / 100 * len(ordered)))) - 1]


def figures(clients: int, streams: list[Stream], max_tokens: int) -> Row:
    ok = [s for s in streams if s.error is None and s.arrivals]
    errors = [s.error for s in streams if s.error is not None]
    gaps = [g for s in ok for g in s.gaps]
    ttfts = [s.ttft for s in ok if s.ttft is not None]
    agg = None
    if ok:
        start, end = min(s.arrivals[0] for s in ok), max(s.arrivals[-1] for s in ok)
        after_first = sum(max(s.tokens, len(s.arrivals)) - 1 for s in ok)
        agg = after_first / (end - start) if end > start else None
    return Row(clients, agg, pct(gaps, 50), pct(gaps, 95), max(gaps, default=None), pct(ttfts, 50),
               max(ttfts, default=None),
               sum(s.tokens for s in ok), sum(1 for s in ok if s.tokens < max_tokens), errors,
               steady=all_decoding(streams))


def all_decoding(streams: list[Stream]) -> float | None:
    """Chunks a second that arrive while every stream of the level decodes: after the last stream's first
    token, up to the end of the first stream to finish; None when a stream failed or no such window is."""
    if not streams or any(s.error is not None or len(s.arrivals) < 2 for s in streams):
        return None
    start, end = max(s.arrivals[0] for s in streams), min(s.arrivals[-1] for s in streams)
    if end <= start:
        return None
    return sum(1 for s in streams for t in s.arrivals if start < t <= end) / (end - start)


def ms(x: float | None) -> str:
    return "-" if x is None else (f"{x * 1000:.1f}" if x < 0.1 else f"{x * 1000:.0f}")


def ratio(x: float | None, base: float | None) -> str:
    return "-" if x is None or not base else f"{x / base:.2f}x"


def table(title: str, rows: list[Row], max_tokens: int) -> str:
    base = next((r for r in rows if r.clients == 1), None)
    head = ["clients", "agg tok/s", "x1", "all decoding tok/s", "x1", "TBT p50 ms", "TBT p95 ms", "p95 x1", "TBT max ms", "TTFT p50 ms",
            "TTFT max ms",
            "tokens", "notes"]
    body = []
    for r in rows:
        notes = []
        if r.short:
            notes.append(f"{r.short} stream(s) ended before {max_tokens} tokens")
        if r.errors:
            kinds = collections.Counter(e.split(":")[0] for e in r.errors)
            notes.append(f"{len(r.errors)} failed (" + ", ".join(f"{n}x {k}" for k, n in kinds.items()) + ")")
        if r.replans:
            notes.append(f"{r.replans} re-plan(s) during the level")
        body.append([str(r.clients), "-" if r.agg is None else f"{r.agg:.1f}",
                     ratio(r.agg, base.agg if base else None), "-" if r.steady is None else f"{r.steady:.1f}",
                     ratio(r.steady, base.steady if base else None), ms(r.tbt50), ms(r.tbt95),
                     ratio(r.tbt95, base.tbt95 if base else None), ms(r.tbt_max), ms(r.ttft50), ms(r.ttft_max),
                     str(r.tokens),
                     "; ".join(notes)])
    return f"### {title}\n\n" + markdown(head, body)


def markdown(head: list[str], body: list[list[str]]) -> str:
    """A markdown table, its columns padded to their widest cell."""
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, body)])


def preamble(title: str) -> str:
    """A bench's heading and its first lines: the CPU, the load, the commit and the time."""
    load = os.getloadavg()
    return (f"# {title}\n\n- {cpu_line()}, {os.cpu_count()} CPUs, load average at start "
            f"{load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}\n- commit {commit()}; {time.strftime('%Y-%m-%d %H:%M')}")


def models_of(text: str, cache_dir: str | None) -> Iterator[tuple[ModelSpec, Path]]:
    """Each comma-separated model (a built-in name or a .gguf path) and its file, found or built
    as tools/bench_local.py does."""
    cache = bench_dir(cache_dir)
    for name in (m.strip() for m in text.split(",") if m.strip()):
        spec = BUILTIN.get(name) or ModelSpec(Path(name).stem, Path(name).name, path=Path(name))
        yield spec, resolve_model(spec, cache, lambda m: print(m, file=sys.stderr, flush=True))


# --------------------------------------------------------------------------- main


def commit() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (git failed)"
    return (rev or "unknown (not a git checkout)") + (" (with uncommitted changes)" if dirty else "")


def run_setup(setup: str, spec: ModelSpec, path: Path, args: argparse.Namespace, flags: set[str],
              log: Callable[[str], None]) -> str:
    daemons: list[Daemon] = []
    rows: list[Row] = []
    plan = ""
    title = f"{spec.label}, {'one node' if setup == 'one' else 'self-formed 2-node cluster'}"
    try:
        with serving_setup(setup, path, args, flags, daemons) as root:
            model = get_json(root.url, "/v1/models")["data"][0]["id"]
            # as many streams as the most clients, so every batch shape's kernels are loaded before timing
            log(f"  warm-up ({setup}, {spec.key}, {max(args.clients)} streams of 8 tokens) ...")
            warm = asyncio.run(level(root.url, model, max(args.clients), 0, 8, args.limit))
            if failed := [w.error for w in warm if w.error]:
                raise RuntimeError(f"{len(failed)} warm-up request(s) failed: {failed[0]}")
            plan = plan_line(root.url)
            for i, n in enumerate(args.clients, start=1):
                log(f"  {n} client(s) ...")
                before = replans(root.url)
                row = figures(n, asyncio.run(level(root.url, model, n, i, args.max_tokens, args.limit)),
                              args.max_tokens)
                rows.append(replace(row, replans=replans(root.url) - before))
            plan += f" (after the last level: {plan_line(root.url).split(': ', 1)[1]})"
    except Exception as exc:  # noqa: BLE001 - one failed setup is reported, the others still run
        tails = "\n".join(f"    {d.node_id}: {line}" for d in daemons for line in list(d.tail)[-5:])
        return f"### {title}\n\nFAILED: {exc}\n{tails}"
    return table(title, rows, args.max_tokens) + f"\n\n{plan}"


def add_daemon_args(ap: argparse.ArgumentParser) -> None:
    """The options of how daemons start, shared with tools/bench_mixed.py."""
    ap.add_argument("--threads", type=int, default=1, help="numba threads per daemon (1)")
    ap.add_argument("--start-timeout", type=float, default=180.0, help="seconds a daemon may take to start")
    ap.add_argument("--cache-dir", default=None, help="where derived models live (default <edgetp cache>/bench)")
    ap.add_argument("--logs", default=None, help="a directory to keep each daemon's whole output in, every line "
                                                 "time-stamped (to read a stall after the run)")


def setups_of(ap: argparse.ArgumentParser, text: str) -> list[str]:
    """--setups parsed, or the parser's error."""
    setups = [s.strip() for s in text.split(",") if s.strip()]
    if not setups or any(s not in SETUPS for s in setups):
        ap.error(f"--setups takes {', '.join(SETUPS)}")
    return setups


def parse_clients(text: str) -> list[int]:
    counts = sorted({int(x) for x in text.split(",") if x.strip()})
    if not counts or counts[0] < 1 or counts[-1] > 256:
        raise argparse.ArgumentTypeError("client counts must lie in 1..256")
    return counts if counts[0] == 1 else [1, *counts]  # the single-stream row is the baseline


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS),
                    help=f"comma-separated: {', '.join(DEFAULT_MODELS)} or paths to .gguf files")
    ap.add_argument("--setups", default=",".join(SETUPS), help="comma-separated: one, two")
    ap.add_argument("--clients", type=parse_clients, default=parse_clients("1,2,4,8,16"),
                    help="comma-separated concurrent client counts (1 is always run, as the baseline)")
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help=f"tokens asked per stream ({MAX_TOKENS})")
    ap.add_argument("--slots", type=int, default=0, help="--slots for the daemons (default: the most clients); "
                                                         "ignored by a daemon without slots")
    ap.add_argument("--limit", type=float, default=900.0, help="seconds one level may take before it counts as "
                                                                "failed (900)")
    add_daemon_args(ap)
    args = ap.parse_args(argv)
    setups = setups_of(ap, args.setups)
    if not 1 <= args.max_tokens <= CTX - PROMPT_TOKENS:
        ap.error(f"--max-tokens must lie in 1..{CTX - PROMPT_TOKENS}")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    cache = bench_dir(args.cache_dir)
    specs = []
    for name in (m.strip() for m in args.models.split(",") if m.strip()):
        if name in BUILTIN:
            specs.append(BUILTIN[name])
        elif Path(name).is_file():
            specs.append(ModelSpec(Path(name).stem, Path(name).name, path=Path(name)))
        else:
            ap.error(f"unknown model {name!r}: use {', '.join(BUILTIN)} or a .gguf path")
    flags = serve_flags()
    print(preamble("edgetp serving benchmark") +
          f"\n- {args.threads} thread(s) per daemon, ctx {CTX}, prompt {PROMPT_TOKENS} token ids, "
          f"{args.max_tokens} tokens asked per stream, greedy; the daemons "
          f"{'take --slots' if '--slots' in flags else 'have no --slots (one request at a time)'}"
          f"\n- TBT: time between streamed chunks, pooled over streams; TTFT: request sent to first text; "
          f"x1: beside the 1-client row\n", flush=True)
    for spec in specs:
        try:
            path = resolve_model(spec, cache, log)
        except Exception as exc:  # noqa: BLE001
            print(f"### {spec.label}\n\nFAILED to find or build the model: {exc}\n", flush=True)
            continue
        for setup in setups:
            log(f"{spec.label}, setup {setup} ...")
            print(run_setup(setup, spec, path, args, flags, log) + "\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
