#!/usr/bin/env python3
"""Plan kinds over shaped links: measured tok/s beside the cost model's prediction, and the planner's pick.

For each link profile, every plan kind is run for real (root here, `edgetp worker`s
on 127.0.0.1, each behind a tools/relay.py that adds the profile's round trip,
jitter and rate), its decode tok/s measured over a greedy run and printed beside
what parallel/cost.py predicts from the same run's measured speeds and links. A
last row, `auto`, runs what `--parallel auto` plans for one stream from its own
measurements (it may leave a worker out), beside the best kind measured; with 8
streams, the aggregate tok/s of the kinds that matter is printed too. After that
table, one all-reduce's cost beyond the raw socket round trip at each model's
width (tools/bench_allreduce.py's measure, f32 sync).

    python tools/bench_links.py                      # SmolLM2 and the 1B shape Q8_0, every profile
    python tools/bench_links.py --model smollm2 --profile wifi --tokens 16
    python tools/bench_links.py --model 1b-q8_0 --profile loopback --rate-mbit 100 --pieces 3 --tokens 12

With --pieces N it measures overlap instead (issue 15): tensor parallelism over 2
processes (root pinned to core 0, a worker per setting on core 1), all-reduce partials
whole and in N pieces (ClusterRunner.connect's sync_pieces), decoding in turn, tok/s
and the sync share of the token time (the root's seconds blocked sending and receiving on its links, over the
token's seconds) for each profile, and for a rate-only relay with --rate-mbit.

Loopback profiles, not namespaces: every relay runs beside the workers on this
machine, so 3 processes share its cores. Every process started here is stopped
in a finally; every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository's root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# first: bench_parallel sets one thread per process before numba loads
from tools.bench_parallel import (GREEDY, ROOT_DIR, SMOLLM2, Procs, cluster_stats, decode, ensure_1b,  # noqa: E402
                                  prompt_for, table)
from edgetp.model import gguf, isa, quant  # noqa: E402
from edgetp.model.batch import Row  # noqa: E402
from edgetp.net.loopthread import LoopThread  # noqa: E402
from edgetp.parallel import cost, pipeline, profile  # noqa: E402
from edgetp.parallel.runner import ClusterRunner  # noqa: E402
from tools.bench_local import cpu_line  # noqa: E402
from edgetp.serve.spawn import start_worker, stop  # noqa: E402
from tools import bench_allreduce as allreduce  # noqa: E402
from tools import netns  # noqa: E402
from tools.netns import read_line  # noqa: E402

BENCH_1B = Path.home() / ".cache/edgetp/bench/llama-3.2-1b.q8_0.gguf"
CTX = 256
# the worker links of each profile: relay profile per worker (None: plain loopback)
LINKS = {"loopback": (None, None), "ethernet": ("ethernet", "ethernet"), "wifi": ("wifi", "wifi"),
         "mixed": ("ethernet", "wifi")}
# (name, layout): node indices per stage, 0 the root; an empty first stage: the root only embeds
KINDS = {2: [("single", [[0]]), ("tp", [[0, 1]]), ("pp", [[0], [1]])],
         3: [("single", [[0]]), ("tp", [[0, 1, 2]]), ("pp", [[0], [1], [2]]), ("hybrid", [[0, 1], [2]])]}
RATE_MBIT = {"ethernet": 1000.0, "wifi": 100.0}


def start_relay(procs: Procs, to: str, profile: str | None, rate_mbit: float | None = None) -> str:
    """A relay to `to` with a profile's round trip and rate (None: no added delay, rate_mbit only)."""
    rate = RATE_MBIT[profile] if rate_mbit is None else rate_mbit
    how = ["--profile", profile] if profile is not None else []
    proc = subprocess.Popen([sys.executable, "-m", "tools.relay", "--listen", "127.0.0.1:0", "--to", to, *how,
                             "--rate-mbit", str(rate)],
                            cwd=ROOT_DIR, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    procs.procs.append(proc)
    line = read_line(proc, 20)
    if not line.startswith("ready "):
        raise RuntimeError(f"relay ({profile}, {rate} Mbit/s) did not start: {line!r}")
    return line.split()[1]


def links_of(runner: ClusterRunner) -> dict[str, cost.LinkCost]:
    return {n.node_id: n.link_cost() for n in runner.nodes[1:]}


def batch_tok_s(runner: ClusterRunner, prompt: list[int], streams: int, steps: int, limit: float) -> float:
    """Aggregate decode tok/s of `streams` sequences decoded together (after a prefill each)."""
    runner.begin(GREEDY)
    try:
        hist = [list(prompt) for _ in range(streams)]
        nxt = [int(runner.prefill(s, prompt, 0, hist[s], GREEDY).ids[0]) for s in range(streams)]

        def step() -> None:
            rows = []
            for s in range(streams):
                hist[s].append(nxt[s])
                rows.append(Row(s, len(hist[s]) - 1, nxt[s], hist[s], GREEDY))
            nxt[:] = [int(c.ids[0]) for c in runner.decode(rows)]

        step()  # untimed: the several-token kernels load on every node (the first batch of a process)
        t0, done = time.perf_counter(), 0
        for _ in range(steps):
            step()
            done += streams
            if time.perf_counter() - t0 > limit:
                break
        return done / (time.perf_counter() - t0)
    finally:
        runner.end()


def run_profile(control: LoopThread, path: Path, name: str, profile: str, args) -> list[list[str]]:
    rows: list[list[str]] = []
    mf = gguf.open_model(path)
    prompt = prompt_for(path)
    for n in (2, 3):
        if profile == "mixed" and n == 2:
            continue
        with Procs() as procs:
            addrs = []
            for p in LINKS[profile][:n - 1]:
                _, addr = procs.worker()
                addrs.append(addr if p is None else start_relay(procs, addr, p))
            measured: dict[str, float] = {}
            for kind, layout in KINDS[n] + [("auto", None)]:
                # auto: what `--parallel auto` plans for one stream from its own fresh measurements
                runner = control.run(ClusterRunner.connect(mf, [] if kind == "single" else addrs, ctx=CTX, threads=1,
                                                           layout=layout, parallel="auto" if kind == "auto" else "tp",
                                                           slots=1 if kind == "auto" else args.streams), timeout=900)
                try:
                    decode(runner, prompt, 2, args.limit)  # warm-up: kernels loaded, pages touched
                    d = decode(runner, prompt, args.tokens, args.limit)
                    pred = cost.predict(runner.plan, links_of(runner), 1)
                    agg = batch_tok_s(runner, prompt, args.streams, args.batch_steps, args.limit) \
                        if args.streams > 1 and profile == "wifi" and kind != "auto" else None
                    pred_b = cost.predict(runner.plan, links_of(runner), args.streams).tok_s
                    measured[kind] = d.tok_s
                    rows.append([name, profile, str(n), kind, pipeline.describe(runner.plan), f"{pred.tok_s:.2f}",
                                 f"{d.tok_s:.2f}", f"{100 * (pred.tok_s / d.tok_s - 1):+.0f}%",
                                 f"{pred.sync_s / pred.step_s:.0%}",
                                 "-" if agg is None else f"{agg:.2f} (pred {pred_b:.2f})",
                                 "**chosen**" if kind == "auto" else ""])
                finally:
                    runner.close()
            best = max(v for k, v in measured.items() if k != "auto")
            rows.append([name, profile, str(n), "", "best kind measured / auto's measured (auto ÷ best)", "",
                         f"{best:.2f}", "", "", "", f"{measured['auto']:.2f} ({measured['auto'] / best:.2f})"])
    return rows


def run_overlap(control: LoopThread, path: Path, name: str, link: str, args) -> list[list[str]]:
    """Tensor parallelism over 2 processes, whole partials and args.pieces pieces: two runners, each with its
    own worker (pinned to core 1, behind its own relay), decoding in turn for args.rounds rounds, so that both
    see the same load on this shared machine. One row each: the median round and every round's tok/s."""
    mf = gguf.open_model(path)
    prompt = prompt_for(path)
    mine = os.sched_getaffinity(0)
    runners: dict[int, ClusterRunner] = {}
    runs: dict[int, list] = {}
    with Procs() as procs:
        os.sched_setaffinity(0, {0})
        try:
            for k, pieces in enumerate((1, args.pieces)):
                if args.at:  # workers started for us (--netns-rate): one per setting
                    addr = args.at.split(",")[k]
                else:
                    _, addr = procs.worker(cpus={1})
                if link == "rate-limited":
                    addr = start_relay(procs, addr, None, args.rate_mbit)
                elif link in LINKS and LINKS[link][0] is not None:
                    addr = start_relay(procs, addr, LINKS[link][0])
                runners[pieces] = control.run(ClusterRunner.connect(mf, [addr], ctx=CTX, threads=1, weights=[1, 1],
                                                                    rebalance=False, sync_pieces=pieces), timeout=900)
                decode(runners[pieces], prompt, 2, args.limit)  # warm-up: kernels loaded, pages touched
                runs[pieces] = []
            for _ in range(args.rounds):
                for pieces, runner in runners.items():
                    runs[pieces].append(decode(runner, prompt, args.tokens, args.limit))
        finally:
            for runner in runners.values():
                runner.close()
            os.sched_setaffinity(0, mine)
    rows = []
    for pieces, ds in runs.items():
        d = sorted(ds, key=lambda d: d.tok_s)[len(ds) // 2]
        recv, send = cluster_stats(d)
        ms = 1e3 * sum(t.dt for t in d.toks) / len(d.toks)
        rows.append([name, link, str(pieces), f"{d.tok_s:.2f}", f"{ms:.1f}", f"**{recv + send:.0%}**",
                     f"{recv * ms:.1f}", f"{1e3 * send * ms:.0f}", " ".join(f"{x.tok_s:.1f}" for x in ds)])
    return rows


def run_too_big(control: LoopThread, path: Path, name: str, args) -> list[list[str]]:
    """Every node capped below the model (--cap-mb, the runtime included): auto over wifi and mixed, beside
    the sum of the uncapped single-node speeds."""
    rows: list[list[str]] = []
    mf = gguf.open_model(path)
    prompt = prompt_for(path)
    alone = control.run(ClusterRunner.connect(mf, [], ctx=CTX, threads=1, rebalance=False), timeout=900)
    try:
        decode(alone, prompt, 2, args.limit)
        single = decode(alone, prompt, args.tokens, args.limit).tok_s
    finally:
        alone.close()
    for profile_name in ("wifi", "mixed"):
        with Procs() as procs:
            addrs = []
            for p in LINKS[profile_name]:
                _, addr = procs.worker(extra=["--max-memory-mb", str(args.cap_mb)])
                addrs.append(start_relay(procs, addr, p))
            profile.limit_memory(args.cap_mb * 2**20)
            try:
                runner = control.run(ClusterRunner.connect(mf, addrs, ctx=CTX, threads=1, parallel="auto",
                                                           rebalance=False), timeout=900)
            finally:
                profile.limit_memory(None)
            try:
                d = decode(runner, prompt, args.tokens, args.limit)
                pred = cost.predict(runner.plan, links_of(runner), 1)
                rows.append([name, profile_name, f"{args.cap_mb} MB each", pipeline.describe(runner.plan),
                             f"{pred.tok_s:.2f}", f"{d.tok_s:.2f}", f"{3 * single:.2f} (3 x {single:.2f})"])
            finally:
                runner.close()
    return rows


def overlap(args, models, chosen_models, t0: float) -> int:
    if args.netns_rate and not args.at:
        return overlap_in_namespaces(args)
    links = [f"tbf {args.netns_rate}"] if args.at else \
        (args.profile or ["loopback"]) + (["rate-limited"] if args.rate_mbit else [])
    rows: list[list[str]] = []
    with LoopThread() as control:
        for m in chosen_models:
            for link in links:
                print(f"[bench_links] overlap {models[m][0]} {link} ...", file=sys.stderr, flush=True)
                rows += run_overlap(control, models[m][1], models[m][0], link, args)
    print(f"# edgetp all-reduce in pieces: sync share of the token time\n\n- {time.strftime('%Y-%m-%d %H:%M')}, "
          f"{cpu_line()}, kernels {isa.current()}, {os.cpu_count()} CPUs, root on core 0 and worker on core 1, "
          f"1 numba thread each, weights [1, 1], f32 sync, {args.rounds} rounds of {args.tokens} greedy decode tokens "
          f"per setting, in turn; the figures of the median round; load averages "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}"
          + (f"; rate-limited: a relay of {args.rate_mbit:g} Mbit/s each way, no added delay" if args.rate_mbit else "")
          + (f"; tbf: network namespaces, each host's egress shaped by tbf to {args.netns_rate}" if args.at else "")
          + "\n")
    print(table(["model", "link", "pieces", "tok/s (median round)", "ms/token", "sync share", "root recv ms/token",
                 "root send µs/token", "tok/s of each round"], rows))
    print(f"\n_(took {time.perf_counter() - t0:.0f} s)_")
    return 0


def overlap_in_namespaces(args) -> int:
    """This bench's overlap mode run again inside host 1 of a testbed (tools/netns.py), its two workers on hosts
    2 and 3 (pinned to core 1): every link shaped by the kernel's tbf, which paces bytes without a relay's
    per-chunk wake-ups."""
    reason = netns.require_root_and_netns()
    if reason is not None:
        print(f"--netns-rate: {reason}", file=sys.stderr)
        return 2
    with netns.Testbed(hosts=3, rate=args.netns_rate) as tb:
        workers = []
        try:
            for host in tb.hosts[1:]:
                workers.append(start_worker(host=host.address, prefix=host.argv(["taskset", "-c", "1"]), timeout=120))
            argv = [*sys.argv[1:], "--at", ",".join(addr for _, addr in workers)]
            child = tb.hosts[0].popen([sys.executable, str(Path(__file__).resolve()), *argv], cwd=ROOT_DIR,
                                      stdout=subprocess.PIPE, text=True)
            try:
                out, _ = child.communicate(timeout=1800)
            finally:
                stop(child)
            print(out, end="")
            return child.returncode
        finally:
            for proc, _ in workers:
                stop(proc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", action="append", choices=["smollm2", "1b-q8_0"], help="default: both")
    ap.add_argument("--profile", action="append", choices=list(LINKS), help="default: every profile")
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens per measurement")
    ap.add_argument("--streams", type=int, default=8, help="concurrent streams of the batched rows (wifi)")
    ap.add_argument("--batch-steps", type=int, default=8, help="decode steps of the batched rows")
    ap.add_argument("--limit", type=float, default=60.0, help="seconds at most per decode loop")
    ap.add_argument("--pieces", type=int, default=0,
                    help="measure overlap instead: 2-process tensor parallelism, whole partials and in N pieces")
    ap.add_argument("--rate-mbit", type=float, default=0.0,
                    help="with --pieces: also a link through a relay of this rate and no added delay")
    ap.add_argument("--rounds", type=int, default=3, help="with --pieces: decode runs of each setting, in turn")
    ap.add_argument("--netns-rate", default=None,
                    help="with --pieces: root and workers in network namespaces whose links tbf shapes to this "
                         "rate (e.g. 100mbit; needs root), instead of loopback")
    ap.add_argument("--at", default=None, help=argparse.SUPPRESS)  # the namespaced child: ADDR,ADDR of its workers
    ap.add_argument("--cap-mb", type=int, default=0,
                    help="also serve the 1B shape with every node capped at this many MB (0: skip)")
    args = ap.parse_args(argv)
    quant.set_threads(1)
    models = {"smollm2": ("SmolLM2-135M Q4_1", SMOLLM2),
              "1b-q8_0": ("1B shape Q8_0", BENCH_1B if BENCH_1B.exists() else ensure_1b())}
    chosen_models = args.model or list(models)
    t0 = time.perf_counter()
    rows: list[list[str]] = []
    if args.pieces:
        return overlap(args, models, chosen_models, t0)
    with LoopThread() as control:
        for m in chosen_models:
            name, path = models[m]
            for profile in args.profile or list(LINKS):
                print(f"[bench_links] {name} {profile} ...", file=sys.stderr, flush=True)
                rows += run_profile(control, path, name, profile, args)
    print(f"# edgetp plan kinds over shaped links\n\n- {time.strftime('%Y-%m-%d %H:%M')}, {cpu_line()}, "
          f"kernels {isa.current()}, "
          f"{os.cpu_count()} CPUs, 1 numba thread per process, load average {os.getloadavg()[0]:.2f}; "
          f"{args.tokens} greedy tokens per row; relays on loopback: ethernet 0.3 ms / 1 Gbit, "
          f"wifi 4 +- 1 ms / 100 Mbit, mixed = worker 1 ethernet, worker 2 wifi\n")
    print(table(["model", "profile", "nodes", "kind", "plan", "predicted tok/s", "measured tok/s", "error",
                 "sync share (pred)", f"{args.streams} streams tok/s", "planner"], rows))
    print("\n## One all-reduce beyond the polled socket round trip (tools/bench_allreduce.py: root on core 0, "
          "worker on core 1, loopback, f32 sync, 2,000 rounds in 5 blocks, raw, polled raw and edgetp in turn)\n")
    print(allreduce.HEAD)
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {0})  # the root's side here, the worker's pinned to core 1 by the tool
    try:
        for m in chosen_models:
            dim = gguf.open_model(models[m][1]).config.dim
            print(allreduce.case(dim, 1, "f32", False, 2000, 5)[0], flush=True)
    finally:
        os.sched_setaffinity(0, cpus)
    if args.cap_mb:
        with LoopThread() as control:
            big = run_too_big(control, models["1b-q8_0"][1], models["1b-q8_0"][0], args)
        print("\n## Too big for any one node\n")
        print(table(["model", "profile", "memory cap", "plan (auto)", "predicted tok/s", "measured tok/s",
                     "sum of single-node speeds"], big))
    print(f"\n_(took {time.perf_counter() - t0:.0f} s)_")
    return 0


if __name__ == "__main__":
    sys.exit(main())
