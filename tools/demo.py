#!/usr/bin/env python3
"""`make demo`: a local three-node cluster forms by itself and answers a question.

1. The answer from one process (`edgetp ask --local`), for comparison.
2. Three `edgetp serve --key` daemons on this machine (loopback mDNS) find
   each other, elect a root and plan a speed-weighted share of every layer.
3. `edgetp ask --stats` asks a node that is not the root: the request is
   forwarded, and the per-token figures come from the cluster's event stream.
4. The daemons leave cleanly (SIGTERM), whatever happened.
Greedy decoding, so both answers must be the same text.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edgetp.serve.spawn import start_daemon, stop  # noqa: E402

QUESTION = "What is the capital of France?"
EDGETP = [sys.executable, "-m", "edgetp"]


def run(*args: str, stats: bool = False) -> str:
    print("$ edgetp " + " ".join(args), flush=True)
    out = subprocess.run(EDGETP + list(args), stdout=subprocess.PIPE, text=True, check=True).stdout
    print(out, flush=True)
    return out


def cluster_model_path() -> str:
    return subprocess.run(EDGETP + ["model", "pull", "smollm2"], check=True, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True).stdout.strip()


def cluster(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/v1/cluster", timeout=5) as resp:
        return json.load(resp)


def formed(url: str) -> bool:
    """A root is elected and this node sees all three members answering."""
    view = cluster(url)
    return view["root"] is not None and sum(n["state"] == "ready" for n in view["nodes"]) == 3


def main() -> int:
    subprocess.run(EDGETP + ["model", "pull", "smollm2"], check=True, stdout=subprocess.DEVNULL)
    print("== one process ==", flush=True)
    alone = run("ask", "--local", "--temperature", "0", "--max-tokens", "48", "--threads", "1", QUESTION)
    daemons = []
    with tempfile.TemporaryDirectory() as tmp:
        key = Path(tmp) / "cluster.key"
        subprocess.run(EDGETP + ["keygen", str(key)], check=True, stdout=subprocess.DEVNULL)
        try:
            print("== three daemons on this machine: forming (pi-c keeps no model: it fetches its slice) ==",
                  flush=True)
            for name, model, priority in (("pi-a", "smollm2", 1), ("pi-b", "smollm2", 0), ("pi-c", "none", 0)):
                # the demo splits every layer three ways on purpose: on one machine's loopback the planner's
                # own choice (--parallel auto, the default) would let the root answer alone
                env = {"EDGETP_PARALLEL": "tp"}
                if model == "none":
                    env["EDGETP_CACHE_DIR"] = str(Path(tmp) / name)
                daemons.append(start_daemon(model, str(key), name, priority=priority, env=env))
            url = daemons[1][1]
            deadline = time.monotonic() + 30
            while not formed(url) and time.monotonic() < deadline:
                time.sleep(0.5)
            print(f"formed: root {cluster(url)['root']}; asking pi-b at {url}", flush=True)
            spread = run("ask", "--url", url, "--temperature", "0", "--max-tokens", "48", "--stats", QUESTION)
            run("status", "--url", daemons[0][1])
            fetched = {n["node_id"]: n.get("transfer") for n in cluster(daemons[0][1])["nodes"]}.get("pi-c")
            if fetched:
                print(f"pi-c keeps no model: it fetched its {fetched[1] / 1e6:.1f} MB slice from the root "
                      f"(the whole file is {Path(cluster_model_path()).stat().st_size / 1e6:.1f} MB)", flush=True)
        finally:
            for proc, _ in daemons:
                stop(proc)
    same = "the same" if spread == alone else "DIFFERENT"
    print(f"== {same} answer from one process and from the cluster; daemons stopped ==")
    return 0 if spread == alone else 1


if __name__ == "__main__":
    sys.exit(main())
