"""Command line: parses arguments, then calls edgetp.commands. No logic here."""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from pathlib import Path

from edgetp import commands
from edgetp.parallel import EXPERT_MODES


_PARALLEL_HELP = ("plan kind: auto (default: the cheapest plan the cost model finds from measured speeds and links, "
                  "for --slots streams), tp (every node splits every layer) or pp (a pipeline, one stage per node)")
_EXPERTS_HELP = ("a mixture of experts: auto (default: the cost model picks), columns (every node its columns of "
                 "every expert), place (whole experts per node, sized by speed and memory) or mixed (groups of "
                 "nodes, each a range of experts split among its nodes by columns)")
_PIECES_HELP = ("send each decode step's all-reduce partials in this many pieces, each while the next computes "
                "(default 1: whole; the same bits either way; pays where transfer time shows, costs on loopback)")

def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def _addresses(text: str) -> list[str]:
    return [f"{h}:{p}" for h, p in (_address(t.strip()) for t in text.split(",") if t.strip())]


def _weights(text: str) -> list[float]:
    try:
        values = [float(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,2,3, got {text!r}") from None
    if any(not 0 < v < math.inf for v in values):
        raise argparse.ArgumentTypeError(f"weights must be positive and finite, got {text!r}")
    return values


_URL_HELP = "a node's API (default: $EDGETP_URL, else a node found by mDNS, else http://127.0.0.1:7711)"
_API_KEY = dict(default=os.environ.get("EDGETP_API_KEY"),
                help="an API token of the node (its api_tokens setting; default $EDGETP_API_KEY)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="edgetp", description="One language model across the small computers on your LAN.")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    ask = sub.add_parser("ask", help="ask the model a question and stream the answer")
    ask.add_argument("prompt", nargs="?", help="the prompt (read from stdin when omitted)")
    ask.add_argument("--local", action="store_true",
                     help="run the engine in this process (default: ask the cluster; exit 3 none found, "
                          "4 key refused, 5 server error)")
    ask.add_argument("--model", default=os.environ.get("EDGETP_MODEL", "smollm2"),
                     help="model name from the cache, or a path to a .gguf (default: smollm2)")
    ask.add_argument("--max-tokens", type=_positive, default=256)
    ask.add_argument("--temperature", type=float, default=0.8, help="0 means greedy")
    ask.add_argument("--top-k", type=int, default=40, help="0 means no top-k cut")
    ask.add_argument("--top-p", type=float, default=0.95)
    ask.add_argument("--min-p", type=float, default=0.05)
    ask.add_argument("--repeat-penalty", type=float, default=1.0)
    ask.add_argument("--frequency-penalty", type=float, default=0.0, help="-2 to 2, per repeat in the last 64 tokens")
    ask.add_argument("--presence-penalty", type=float, default=0.0, help="-2 to 2, once for any repeat in the last 64")
    ask.add_argument("--seed", type=int, default=None)
    ask.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    ask.add_argument("--ctx", type=_positive, default=2048, help="context length (KV cache size)")
    ask.add_argument("--threads", type=_positive, default=None, help="compute threads (default: all cores)")
    ask.add_argument("--stats", action="store_true", help="print timing figures at the end")
    ask.add_argument("--workers", type=_addresses, default=[],
                     help="HOST:PORT,HOST:PORT of running `edgetp worker`s to spread the model over")
    ask.add_argument("--weights", type=_weights, default=None,
                     help="relative speeds 1,2,3 in node order, the root first (default: measured)")
    ask.add_argument("--sync", choices=("f32", "q8_0"), default="f32",
                     help="all-reduce payload: exact f32 or Q8_0 blocks (3.8x fewer bytes)")
    ask.add_argument("--sync-pieces", type=_positive, default=1, help=_PIECES_HELP)
    ask.add_argument("--parallel", choices=("tp", "pp", "auto"), default="auto", help=_PARALLEL_HELP)
    ask.add_argument("--experts", choices=EXPERT_MODES, default="auto", help=_EXPERTS_HELP)
    ask.add_argument("--key", default=os.environ.get("EDGETP_KEY_FILE"), help="cluster key file")
    ask.add_argument("--api-key", **_API_KEY)
    ask.add_argument("--url", default=os.environ.get("EDGETP_URL"),
                     help=_URL_HELP)
    ask.set_defaults(func=commands.ask)

    chat = sub.add_parser("chat", help="an interactive session with the cluster (keeps the history)")
    for flag, kw in (("--url", dict(default=os.environ.get("EDGETP_URL"), help=_URL_HELP)),
                     ("--key", dict(default=os.environ.get("EDGETP_KEY_FILE"))), ("--api-key", _API_KEY),
                     ("--max-tokens", dict(type=_positive, default=512)),
                     ("--temperature", dict(type=float, default=0.8)), ("--top-k", dict(type=int, default=40)),
                     ("--top-p", dict(type=float, default=0.95)), ("--min-p", dict(type=float, default=0.05)),
                     ("--repeat-penalty", dict(type=float, default=1.0)),
                     ("--frequency-penalty", dict(type=float, default=0.0)),
                     ("--presence-penalty", dict(type=float, default=0.0)), ("--seed", dict(type=int, default=None))):
        chat.add_argument(flag, **kw)
    chat.set_defaults(func=commands.chat)

    status = sub.add_parser("status", help="the cluster as a table")
    status.add_argument("--url", default=os.environ.get("EDGETP_URL"), help=_URL_HELP)
    status.add_argument("--key", default=os.environ.get("EDGETP_KEY_FILE"))
    status.add_argument("--api-key", **_API_KEY)
    status.set_defaults(func=commands.status)

    worker = sub.add_parser("worker", help="hold a shard for a root (static cluster, no discovery)")
    worker.add_argument("--listen", type=_address, default=("127.0.0.1", 7710), help="HOST:PORT (default 127.0.0.1:7710)")
    worker.add_argument("--model", default=None, help="this node's copy of the model (default: the root's path)")
    worker.add_argument("--threads", type=_positive, default=None)
    worker.add_argument("--key", default=os.environ.get("EDGETP_KEY_FILE"), help="cluster key file")
    worker.add_argument("--node-id", default=None)
    worker.add_argument("--max-memory-mb", type=_positive, default=None,
                        help="use at most this much memory, the runtime included (the plan gives less)")
    worker.set_defaults(func=commands.worker)

    srv = sub.add_parser("serve", help="serve the API; with a cluster key, join the cluster on the LAN",
                         description="Settings come from flags, then EDGETP_* variables, then the TOML file "
                                     "(--config, default /etc/edgetp/edgetp.toml if it exists), then defaults.")
    srv.add_argument("--config", type=Path, default=os.environ.get("EDGETP_CONFIG"), help="TOML settings file")
    srv.add_argument("--model", default=None,
                     help="name or path (default smollm2); 'none' in a cluster: hold no model, fetch a slice from the root")
    srv.add_argument("--listen", type=_address, default=None,
                     help="HOST:PORT of the HTTP API (default 127.0.0.1:7711: this machine only)")
    srv.add_argument("--workers", type=_addresses, default=[],
                     help="HOST:PORT,... of `edgetp worker`s: a static cluster, no discovery")
    srv.add_argument("--weights", type=_weights, default=None, help="with --workers: relative speeds, the root first")
    srv.add_argument("--sync", choices=("f32", "q8_0"), default=None)
    srv.add_argument("--sync-pieces", type=_positive, default=None, help=_PIECES_HELP)
    srv.add_argument("--parallel", choices=("tp", "pp", "auto"), default=None, help=_PARALLEL_HELP)
    srv.add_argument("--experts", choices=EXPERT_MODES, default=None, help=_EXPERTS_HELP)
    srv.add_argument("--ctx", type=_positive, default=None)
    srv.add_argument("--threads", type=_positive, default=None)
    srv.add_argument("--slots", type=_positive, default=None,
                     help="sequences decoded at once, each with a KV cache of --ctx positions (default 4)")
    srv.add_argument("--kv-type", choices=("f16", "f32", "q8_0"), default=None,
                     help="what the KV caches hold: f16 (default, as llama.cpp), f32 (twice the memory) "
                          "or q8_0 (34 bytes per 32 values, ~53%% of f16; head size a multiple of 32)")
    srv.add_argument("--queue", type=_positive, default=8,
                     help="requests that may wait while every slot is busy; more get 429")
    srv.add_argument("--key", dest="key_file", default=None,
                     help="cluster key file; with a key and no --workers, join the cluster on the LAN (mDNS)")
    srv.add_argument("--data-port", type=int, default=None, help="cluster data links (default 7710; 0: any)")
    srv.add_argument("--node-id", default=None, help="this node's name (default: the host name)")
    srv.add_argument("--priority", type=int, default=None, help="higher wins the root election")
    srv.add_argument("--no-root", action="store_true", default=None, help="never become the root")
    srv.add_argument("--interface", dest="interfaces", action="append", default=None, metavar="ADDR",
                     help="IP address(es) to discover peers on (default: all interfaces)")
    srv.add_argument("--peer", dest="peers", action="append", default=None, metavar="HOST:PORT",
                     help="a peer's HTTP API to introduce ourselves to, where multicast cannot pass (repeatable)")
    srv.set_defaults(func=commands.serve)

    prof = sub.add_parser("profile", help="have a node measure its speed and free memory again (the root re-plans)")
    prof.add_argument("--url", default=os.environ.get("EDGETP_URL", "http://127.0.0.1:7711"),
                      help="the node's HTTP API (default: $EDGETP_URL or http://127.0.0.1:7711)")
    prof.add_argument("--key", default=os.environ.get("EDGETP_KEY_FILE"), required=False, help="cluster key file")
    prof.set_defaults(func=commands.reprofile)

    dash = sub.add_parser("dashboard", help="the live view of a cluster: nodes, shares, per-token time and bytes")
    dash.add_argument("--url", default=os.environ.get("EDGETP_URL", "http://127.0.0.1:7711"),
                      help="any node's HTTP API (default: $EDGETP_URL or http://127.0.0.1:7711)")
    dash.add_argument("--key", default=os.environ.get("EDGETP_KEY_FILE"),
                      help="cluster key file (the event stream of a node listening beyond loopback needs it, "
                           "or --api-key)")
    dash.add_argument("--api-key", **_API_KEY)
    dash.set_defaults(func=commands.dashboard)

    keygen = sub.add_parser("keygen", help="write a new cluster key file (0600); share it out of band")
    keygen.add_argument("path", help="where to write the key, e.g. /etc/edgetp/cluster.key")
    keygen.add_argument("--force", action="store_true", help="overwrite an existing key file")
    keygen.set_defaults(func=commands.keygen)

    model = sub.add_parser("model", help="manage the model cache")
    msub = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    pull = msub.add_parser("pull", help="fetch a known model (smollm2) or any GGUF by http(s) URL")
    pull.add_argument("source", help="a known name (smollm2) or an http(s) URL")
    pull.add_argument("--sha256", default=None, help="expected sha256 of the file")
    pull.add_argument("--name", default=None, help="file name in the cache (default: from the URL)")
    pull.set_defaults(func=commands.model_pull)
    lst = msub.add_parser("list", help="list the models in the cache")
    lst.set_defaults(func=commands.model_list)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    weights, workers = getattr(args, "weights", None), getattr(args, "workers", None) or []
    if args.command == "ask" and workers and not args.local:  # else asked of a cluster: the list unused
        parser.error("--workers needs --local (this process runs the model with those workers); "
                     "without it, ask goes to a running edgetp serve (--url)")
    if weights is not None and not workers:
        parser.error("--weights needs --workers (the measured speeds are used)")
    if weights is not None and len(weights) != len(workers) + 1:
        parser.error(f"--weights needs {len(workers) + 1} numbers, the root's then one for each of --workers, "
                     f"got {len(weights)}")
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command in ("worker", "serve") or getattr(args, "local", False):
            from edgetp.model import isa  # noqa: PLC0415 - LLVM loads only for a command that runs the model

            isa.require()  # a forced ISA this CPU lacks stops here, not with SIGILL in a kernel
        return args.func(args)
    except commands.client.ClientError as exc:
        print(f"edgetp: {exc}", file=sys.stderr)
        return exc.exit_code
    except commands.user_errors() as exc:  # evaluated as the error passes
        print(f"edgetp: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nedgetp: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 141


if __name__ == "__main__":
    sys.exit(main())
