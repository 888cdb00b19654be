#!/usr/bin/env python3
"""What one all-reduce costs beyond the socket round trip under it: two real processes on loopback.

The real-links issue asks that the cost of one all-reduce beyond the raw socket round trip be
at most that round trip. Each case here forks a worker pinned to core 1 (the root stays on
core 0) and measures, over one TCP loopback connection with TCP_NODELAY, as the product's links
have it:

* ``raw``: a ping-pong of exactly the bytes the all-reduce's two frames carry (prefix, msgpack
  header, payload and, sealed, the tag), recv_into and sendall on bare sockets, each receive
  waiting in the kernel;
* ``polled raw``: the same, each receive first polling the socket for as long as the product's
  links do (``link.spin_ns``, EDGETP_SPIN_US; stopping, as theirs do, if it loses its core):
  the floor of the product's way of waiting, which spares the wake-up of a sleeping thread;
* ``edgetp``: the product's all-reduce, ``collective.RootReduce`` against
  ``collective.WorkerReduce`` on ``net.link.Link`` in blocking mode (the hot path of a decode
  step): the worker sends its (rows, dim) partial, the root adds it and sends the total back,
  the worker takes it.

Both back to back with nothing computed in between; a round is timed at the root from one
total sent to the next, and the two take turns in blocks of rounds (this machine's load moves). Printed per case: the median and p90 of a round, the cost beyond the
polled raw round trip, and that over it (target <= 1; EDGETP_SPIN_US=0 makes both ways wait in the
kernel at once). Cases: the model dims of
SmolLM2 (576) and the 1B shape (2048), f32 and q8_0 sync, plain and sealed (a cluster key).

    python tools/bench_allreduce.py
    python tools/bench_allreduce.py --dims 576 --rounds 5000

Every child is waited for; every loop is bounded in count (and each socket's waits in time).
"""

from __future__ import annotations

import os

os.environ.setdefault("NUMBA_NUM_THREADS", "1")  # before numba loads: one thread a process, as the bench's peers

import argparse  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from edgetp.net import frames  # noqa: E402
from edgetp.net.frames import FrameType  # noqa: E402
from edgetp.net.link import Link, kernel_timeouts, spin_ns  # noqa: E402
from edgetp.net.wire import GAP_NS  # noqa: E402
from edgetp.parallel import collective  # noqa: E402
from tools.bench_serve import preamble  # noqa: E402

TIMEOUT = 30.0  # seconds any one receive may wait
KEYS = (bytes(range(32)), bytes(range(32, 64)))  # a bench's fixed session keys (root sends with the first)


def frame_bytes(dim: int, rows: int, sync: str, sealed: bool) -> int:
    """Bytes on the wire of one sync frame (both directions carry one): measured by encoding one."""
    payload = bytes(collective.sync_bytes(rows * dim, sync))
    cipher = frames.Cipher(KEYS[0]) if sealed else None
    return sum(len(p) for p in frames.encode_frame(FrameType.PARTIAL, {}, payload, cipher=cipher))


def _pair() -> tuple[socket.socket, int]:
    lst = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lst.bind(("127.0.0.1", 0))
    lst.listen(1)
    return lst, lst.getsockname()[1]


def _tcp(sock: socket.socket) -> socket.socket:
    """A blocking TCP socket as the product's links set theirs in blocking mode: TCP_NODELAY, and waits
    bounded in the kernel (link.kernel_timeouts), no poll before each call."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(None)
    kernel_timeouts(sock, TIMEOUT)
    return sock


def _pin(cpu: int) -> None:
    if hasattr(os, "sched_setaffinity") and cpu < (os.cpu_count() or 1):
        os.sched_setaffinity(0, {cpu})


def _child(port: int, case: dict) -> subprocess.Popen:
    """This script again as the worker side of `case`, pinned to core 1, connecting to port (a fresh
    process, not a fork: numba's threads may already run in this one)."""
    spec = json.dumps(dict(case, port=port))
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", spec], cwd=str(ROOT))


def _wait(proc: subprocess.Popen) -> None:
    try:
        if proc.wait(timeout=TIMEOUT) != 0:
            raise RuntimeError(f"the worker process exited with {proc.returncode}")
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"the worker process did not finish within {TIMEOUT:.0f} s") from None


def child(spec: dict) -> int:
    """The worker side of one case (run by _child)."""
    _pin(1)
    sock = _tcp(socket.create_connection(("127.0.0.1", spec["port"]), timeout=TIMEOUT))
    if spec["kind"] == "raw":
        echo(sock, spec["size"], spec["rounds"], spec["poll"])
    else:
        worker(sock, spec["dim"], spec["rows"], spec["sync"], spec["sealed"], spec["rounds"])
    return 0


def _rounds(stamps: list[float]) -> list[float]:
    """The gaps between consecutive stamps, in µs."""
    return [(b - a) * 1e6 for a, b in zip(stamps, stamps[1:])]


def _p(gaps: list[float], q: float) -> float:
    return sorted(gaps)[int(q * (len(gaps) - 1))]


def receive(sock: socket.socket, buf: memoryview, poll: int) -> None:
    """buf filled from sock; each receive polls for up to `poll` ns before it waits in the kernel,
    and stops polling at a gap between tries (its core went to another thread), as the product's
    receives do (net/wire.py _polled)."""
    got, size = 0, len(buf)
    while got < size:
        t = time.perf_counter_ns()
        until = t + poll
        while poll:
            try:
                got += sock.recv_into(buf[got:], 0, socket.MSG_DONTWAIT)
                break
            except BlockingIOError:
                now = time.perf_counter_ns()
                if now >= until or now - t > GAP_NS:
                    got += sock.recv_into(buf[got:])
                    break
                t = now
        else:
            got += sock.recv_into(buf[got:])


def echo(sock: socket.socket, size: int, rounds: int, poll: int) -> None:
    """The raw worker: each `size` bytes received sent back."""
    buf = memoryview(bytearray(size))
    for _ in range(rounds):
        receive(sock, buf, poll)
        sock.sendall(buf)
    sock.close()


def _timed(case: dict, rounds: int, side) -> list[float]:
    """The µs of each of `rounds` rounds at the root: side(accepted socket) -> (one round, close), the
    worker side of `case` in a child process (_child)."""
    lst, port = _pair()
    proc = _child(port, dict(case, rounds=rounds))
    stamps = []
    try:
        lst.settimeout(TIMEOUT)
        one, close = side(lst.accept()[0])
        for _ in range(rounds):
            one()
            stamps.append(time.perf_counter())
        close()
    finally:
        lst.close()
        _wait(proc)
    return _rounds(stamps)


def raw(size: int, rounds: int, poll: int = 0) -> list[float]:
    """A ping-pong of `size` bytes each way on bare sockets, each receive polling for `poll` ns
    before it waits in the kernel: the µs of each round."""
    def side(sock: socket.socket):
        sock = _tcp(sock)
        buf = memoryview(bytearray(size))

        def one() -> None:
            sock.sendall(buf)
            receive(sock, buf, poll)
        return one, sock.close

    return _timed(dict(kind="raw", size=size, poll=poll), rounds, side)


def _link(sock: socket.socket, name: str, keys: tuple[bytes, bytes] | None) -> collective.Hot:
    link = Link(sock, name, timeout=TIMEOUT)
    link.trust(keys)
    link.enter_blocking()
    return collective.Hot(link, None)


def worker(sock: socket.socket, dim: int, rows: int, sync: str, sealed: bool, rounds: int) -> None:
    """The product's worker side: WorkerReduce on a blocking Link, `rounds` times."""
    hot = _link(sock, "root", KEYS[::-1] if sealed else None)
    reduce = collective.WorkerReduce(hot, sync)
    partial = np.random.default_rng(1).standard_normal((rows, dim)).astype(np.float32)
    for _ in range(rounds):
        reduce(partial)
        partial *= np.float32(0.5)  # keep the values bounded round after round
    hot.link.close()


def product(dim: int, rows: int, sync: str, sealed: bool, rounds: int) -> list[float]:
    """RootReduce against WorkerReduce on blocking Links: the µs of each round."""
    def side(sock: socket.socket):
        hot = _link(sock, "worker", KEYS if sealed else None)
        reduce = collective.RootReduce([hot], sync)
        partial = np.random.default_rng(0).standard_normal((rows, dim)).astype(np.float32)

        def one() -> None:
            reduce(partial)
            partial[...] *= np.float32(0.5)
        return one, hot.link.close

    return _timed(dict(kind="product", dim=dim, rows=rows, sync=sync, sealed=sealed), rounds, side)


HEAD = ("| dim | sync | sealed | bytes a frame | raw round trip µs (median / p90) | polled raw µs (median / p90) "
        "| edgetp all-reduce µs (median / p90) | beyond polled raw µs | beyond ÷ polled raw (target ≤ 1) |\n"
        "|---:|---|---|---:|---:|---:|---:|---:|---:|")


def case(dim: int, rows: int, sync: str, sealed: bool, rounds: int, blocks: int) -> tuple[str, float]:
    """One case's table row and its beyond ÷ raw: raw and edgetp in turn, `blocks` blocks of rounds each
    (so that both see the same load)."""
    size = frame_bytes(dim, rows, sync, sealed)
    ours, waited, floor = [], [], []
    for _ in range(blocks):
        waited += raw(size, rounds // blocks)
        floor += raw(size, rounds // blocks, spin_ns())
        ours += product(dim, rows, sync, sealed, rounds // blocks)
    (w50, w90), (r50, r90), (p50, p90) = ((_p(g, 0.5), _p(g, 0.9)) for g in (waited, floor, ours))
    ratio = (p50 - r50) / r50
    mark = "**" if ratio > 1 else ""
    return (f"| {dim} | {sync} | {'yes' if sealed else 'no'} | {size:,} | {w50:.0f} / {w90:.0f} | {r50:.0f} / "
            f"{r90:.0f} | {p50:.0f} / {p90:.0f} | {p50 - r50:.0f} | {mark}{ratio:.2f}{mark} |"), ratio


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dims", default="576,2048", help="partial widths (model dims), comma-separated")
    ap.add_argument("--rows", type=int, default=1, help="rows a step (decode: 1; a batch of B: B)")
    ap.add_argument("--rounds", type=int, default=2000, help="all-reduces per case")
    ap.add_argument("--syncs", default=",".join(collective.SYNC_TYPES))
    ap.add_argument("--blocks", type=int, default=5, help="raw and edgetp take turns, this many blocks of rounds each")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(json.loads(args.child))
    try:
        dims = [int(d) for d in args.dims.split(",") if d]
    except ValueError:
        ap.error("--dims is comma-separated integers")
    syncs = [s for s in args.syncs.split(",") if s]
    if not dims or min(dims) < 32 or any(d % 32 for d in dims):
        ap.error("--dims: multiples of 32 (a Q8_0 block)")
    if set(syncs) - set(collective.SYNC_TYPES) or not syncs:
        ap.error(f"--syncs: of {', '.join(collective.SYNC_TYPES)}")
    if args.blocks < 1 or args.rounds < 10 * args.blocks or args.rows < 1:
        ap.error("--blocks and --rows must be at least 1, --rounds at least 10 a block")
    _pin(0)
    print(preamble("One all-reduce beyond the socket round trip (tools/bench_allreduce.py)"))
    print(f"- 2 processes, root on core 0, worker on core 1, TCP loopback with TCP_NODELAY; {args.rounds} "
          f"rounds a case in {args.blocks} blocks, raw, polled raw and edgetp in turn; {args.rows} row(s) a "
          f"partial; receives poll {spin_ns() / 1000:g} µs before they wait (EDGETP_SPIN_US)\n")
    print(HEAD)
    worst = 0.0
    for dim in dims:
        for sync in syncs:
            for sealed in (False, True):
                row, ratio = case(dim, args.rows, sync, sealed, args.rounds, args.blocks)
                worst = max(worst, ratio)
                print(row, flush=True)
    print(f"\nworst beyond ÷ polled raw: {worst:.2f} ({'met' if worst <= 1 else 'NOT MET'}: target ≤ 1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
