#!/usr/bin/env python3
"""A mixture of experts over 1 to 4 local processes: whole experts placed against every expert's
columns split and (3 processes or more) the best mix of the two, measured decode tok/s and bytes
per token beside the cost model's prediction, and the choice `experts="auto"` makes from the same
run's measured speeds and links marked.

    python tools/bench_moe.py                          # qwen3moe 16 experts top-4 (0.5B) Q8_0, 2 and 4 processes
    python tools/bench_moe.py --model PATH.gguf --nodes 2,3 --tokens 16

The root runs here, `edgetp worker`s on 127.0.0.1 (one compute thread each), so every
process shares this machine's cores: the figures compare the two splits on the same
machine, not what separate boards would reach. Every process started here is stopped in
a finally; every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository's root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# first: bench_parallel sets one thread per process before numba loads
from tools.bench_parallel import Procs, decode, prompt_for, table  # noqa: E402
from edgetp.model import gguf  # noqa: E402
from edgetp.net.loopthread import LoopThread  # noqa: E402
from edgetp.parallel import cost, experts  # noqa: E402
from edgetp.parallel.runner import ClusterRunner  # noqa: E402
from tools.bench_links import links_of  # noqa: E402
from tools.bench_local import bench_dir, cpu_line  # noqa: E402

CTX = 256


def ensure_model(cache: Path) -> Path:
    from tools import synth_gguf  # noqa: PLC0415

    path = cache / "qwen3moe-16x4.q8_0.gguf"
    if not path.exists():
        synth_gguf.write_preset(path, "qwen3moe-16x4", weight_type="q8_0")
    return path


def run(control: LoopThread, path: Path, n: int, args) -> list[list[str]]:
    mf = gguf.open_model(path)
    prompt = prompt_for(path)
    rows, figures = [], {}
    with Procs() as procs:
        addrs = [procs.worker()[1] for _ in range(n - 1)]
        for mode in ("columns", "place", "mixed")[:2 if n < 3 else 3]:
            runner = control.run(ClusterRunner.connect(mf, addrs, ctx=CTX, threads=1, experts=mode), timeout=900)
            try:
                decode(runner, prompt, 2, args.limit)  # warm-up: kernels loaded, pages touched
                d = decode(runner, prompt, args.tokens, args.limit)
                figures.setdefault("links", links_of(runner))  # one set of links for every prediction and the choice
                pred = cost.predict(runner.plan, figures["links"], 1)
                sent = sum(c.sent + c.received for t in d.toks for c in t.links.values()) / max(len(d.toks), 1)
                held = " ".join((f"{s.experts[0]}-{s.experts[1]}" if s.experts else "")
                                + ("" if s.experts and s.ffn_cols == (0, mf.config.ffn)
                                   else f"c{s.ffn_cols[0]}-{s.ffn_cols[1]}") for s in runner.plan.shares)
                figures[mode] = runner.plan
                rows.append([path.name, str(n), mode, held, f"{pred.tok_s:.2f}", f"{d.tok_s:.2f}",
                             f"{sent / 1e3:.1f}", ""])
            finally:
                runner.close()
    auto = experts.layout(experts.choose(figures["columns"], figures["links"], 1))
    for r in rows:
        if r[2] == auto:
            r[-1] = "**chosen**"
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a mixture-of-experts .gguf (default: the synthetic qwen3moe 16x4 Q8_0)")
    ap.add_argument("--nodes", default="2,4", help="process counts, root included (default 2,4)")
    ap.add_argument("--tokens", type=int, default=32, help="decoded tokens per run")
    ap.add_argument("--limit", type=float, default=60.0, help="seconds per run at most")
    args = ap.parse_args(argv)
    path = Path(args.model) if args.model else ensure_model(bench_dir(None))
    print(f"{cpu_line()}; one compute thread per process; {args.tokens} greedy tokens after {len(prompt_for(path))}")
    rows = []
    with LoopThread() as control:
        for n in (int(x) for x in args.nodes.split(",")):
            rows += run(control, path, n, args)
    print(table(["model", "processes", "experts", "shares (experts, c: their columns)", "predicted tok/s",
                 "measured tok/s", "kB/token on the links", "auto"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
