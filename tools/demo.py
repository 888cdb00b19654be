#!/usr/bin/env python3
"""`make demo`: one question answered on this machine, then across three processes.

1. `edgetp ask --local`: the whole model in this process, streaming.
2. The same question over a static cluster: two `edgetp worker` processes
   plus the root, with uneven weights 1:2:3, so each process holds a slice
   of every layer sized to its weight. Greedy decoding, so the two answers
   must be the same text. The workers are stopped at the end, whatever happens.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edgetp.serve.spawn import start_worker, stop  # noqa: E402

QUESTION = "What is the capital of France?"


def ask(*extra: str) -> str:
    cmd = [sys.executable, "-m", "edgetp", "ask", "--local", "--temperature", "0", "--max-tokens", "48",
           "--threads", "1", *extra, QUESTION]
    print("$ edgetp " + " ".join(cmd[3:]), flush=True)
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True).stdout
    print(out, flush=True)
    return out


def main() -> int:
    subprocess.run([sys.executable, "-m", "edgetp", "model", "pull", "smollm2"], check=True, stdout=subprocess.DEVNULL)
    print("== one process ==", flush=True)
    alone = ask("--stats")
    print("== three processes, weights 1:2:3 ==", flush=True)
    workers = []
    try:
        workers = [start_worker() for _ in range(2)]
        spread = ask("--stats", "--workers", ",".join(addr for _, addr in workers), "--weights", "1,2,3")
    finally:
        for proc, _ in workers:
            stop(proc)
    same = "the same" if spread == alone else "DIFFERENT"
    print(f"== {same} answer from one process and from three ==")
    return 0 if spread == alone else 1


if __name__ == "__main__":
    sys.exit(main())
