"""A TCP relay that delays each direction: link latency and jitter where the kernel has no netem.

    python -m tools.relay --listen 10.77.0.11:7710 --to 10.77.0.12:7710 --rtt-ms 4 --jitter-ms 1

Every connection to --listen is relayed to --to. Each chunk read in one direction is
written to the other side at (time read + rtt/2 + a uniform jitter in [-jitter/2, +jitter/2]),
never before the chunk read ahead of it: bytes stay in order, and the round trip a
request/response pair sees is rtt +- jitter on top of the path's own.

Each direction is one thread in compiled code (`_pump`, numba, the GIL released): it waits in
ppoll for the next chunk or the next due time, whichever comes first, with the timer slack at
1 ns; a timed wait ends early by the lateness its wake-ups have shown, and spins the rest. The
relay shares the testbed's cores with the nodes it connects, so what it costs matters. On a
2-vCPU Zen 3 VM (tools/bench_relay.py: 2,400-byte ping-pong, 2,000 round trips; 29 Nov) the
Python relay before it (a reader and a writer thread a direction, handing chunks over) took
190-215 us of CPU a round trip at --rtt-ms 0.3 and measured 580-592 us, 149-166 at --rtt-ms 0;
this one takes 95-115 us of CPU and measures 403-419 us, 94 at 0 (a relay of two C threads
that only forward: 60-74 us, 30-35 us of CPU). An event loop's timer lands within ~1 ms,
which would swamp the Ethernet profile.

Rates come from tbf on the namespaces' links (tools/netns.py), or from --rate-mbit here
(each direction serialises its chunks at that rate, for loopback benchmarks without
namespaces); PROFILES name the pairs the real-links issue asks for. SIGUSR1 multiplies the
added delay and jitter by 10 from then on: a link that degrades mid-run. Prints "ready HOST:PORT" once listening; runs until killed
(tools/netns.Host.stop_processes, or SIGTERM).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import random
import signal
import socket
import sys
import threading
from dataclasses import dataclass

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from edgetp.model.vnni import _I32, _I64, _decl
from edgetp.net.wire import EAGAIN, _PTR, _now_ns, _recv, _send


@dataclass(frozen=True)
class Profile:
    rate: str          # tbf rate of each host's link
    rtt_ms: float      # round trip added by a relay
    jitter_ms: float   # +- on that round trip


PROFILES = {
    "ethernet": Profile("1gbit", 0.3, 0.0),
    "wifi": Profile("100mbit", 4.0, 1.0),
}
# "mixed": two nodes on ethernet, one on wifi: a testbed shaped "ethernet" with a wifi relay
# in front of the one node (tests/test_relay.py builds it).

CHUNK = 256 * 1024  # the most one read takes: at a rate, each chunk is due after its own time on the wire
_SCALE = np.ones(1)  # the delay's multiplier: SIGUSR1 makes it 10 (a degraded link)


class _Direction:
    """One direction of one connection: a thread that runs `_pump` (compiled, the GIL released)."""

    def __init__(self, src: socket.socket, dst: socket.socket, delay_s: float, jitter_s: float,
                 rng: random.Random, bytes_per_s: float = 0.0) -> None:
        self.src, self.dst = src, dst
        self.args = (int(delay_s * 1e9), int(jitter_s * 1e9), float(bytes_per_s), rng.getrandbits(63) | 1)
        self.threads = [threading.Thread(target=self._run, daemon=True)]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        _fine_timers()
        _pump(self.src.fileno(), self.dst.fileno(), np.empty(RING, np.uint8), np.empty((SLOTS, 3), np.int64),
              *self.args, _SCALE)
        with contextlib.suppress(OSError):
            self.dst.shutdown(socket.SHUT_WR)


RING = 4 << 20  # bytes a direction holds while they wait their time; a full ring stops its reads
SLOTS = 4096  # chunks it holds
POLLIN, EINTR = 1, 4


@intrinsic
def _ppoll(typingctx, fds, nfds, timeout):
    """libc ppoll(fds, nfds, timeout, NULL): fds and timeout addresses (timeout 0: none, wait for
    ever); the count ready, or -errno."""

    def codegen(context, builder, signature, args):
        f, n, t = args
        fn = _decl(builder.module, "ppoll", _I32, [_PTR, _I64, _PTR, _PTR])
        got = builder.call(fn, [builder.inttoptr(f, _PTR), n, builder.inttoptr(t, _PTR), ir.Constant(_PTR, None)])
        where = builder.call(_decl(builder.module, "__errno_location", _I32.as_pointer(), []), [])
        got = builder.select(builder.icmp_signed("<", got, ir.Constant(_I32, 0)), builder.neg(builder.load(where)), got)
        return builder.sext(got, _I64)

    return types.int64(types.int64, types.int64, types.int64), codegen


@njit(cache=True, nogil=True)
def _pump(src, dst, ring, slots, delay_ns, jitter_ns, bytes_per_s, seed, scale):  # pragma: no cover - compiled
    # src's bytes to dst, each chunk written when due: read time + scale[0] * (delay + a uniform jitter
    # in [-jitter, +jitter]), never before the chunk ahead of it, plus its time at bytes_per_s (0: none).
    # Returns when src has closed (or failed) and every chunk is written, or dst failed.
    # ring: bytes waiting, slots: (due ns, start in ring, length) in a circle. A timed wait here ends
    # ~40 us late (the wake-up of an idle vCPU): waits end early by the lateness seen so far (`late`,
    # an average of each capped at LATE_MAX), and the last of it is spun.
    fds = np.zeros(2, np.int32)  # struct pollfd: fd, events | revents << 16
    fds[0] = src
    ts = np.zeros(2, np.int64)  # struct timespec
    cap, nslots = ring.shape[0], slots.shape[0]
    head = count = 0  # slots: first, how many
    used = wpos = 0  # ring: bytes held, where the next read goes
    due, x, reading, late = 0, np.uint64(seed), True, 0
    while True:
        now = _now_ns()
        while count and slots[head, 0] - now <= late:  # due, or as good as: spin the rest
            while now < slots[head, 0]:
                now = _now_ns()
            at, n = slots[head, 1], slots[head, 2]
            sent = 0
            while sent < n:
                w = _send(dst, ring.ctypes.data + at + sent, n - sent)
                if w < 0 and w != -EINTR:
                    return
                sent += max(w, 0)
            used -= n
            if used == 0:
                wpos = 0  # an empty ring starts again at its beginning: reads stay large
            head = (head + 1) % nslots
            count -= 1
            now = _now_ns()
        if not reading and not count:
            return
        wait = slots[head, 0] - now - late if count else -1  # ns to wait; -1: until src has bytes
        if wait >= 0:
            ts[0], ts[1] = wait // 1_000_000_000, wait % 1_000_000_000
        listen = reading and cap - used > 0 and count < nslots
        fds[1] = POLLIN
        got = _ppoll(fds.ctypes.data, 1 if listen else 0, ts.ctypes.data if wait >= 0 else 0)
        if got == 0 and wait >= 0:  # timed out: how late
            late = (7 * late + min(max(_now_ns() - now - wait, 0), LATE_MAX)) // 8
        if got <= 0 or not listen:
            continue
        n = _recv(src, ring.ctypes.data + wpos, min(cap - wpos, cap - used, CHUNK))  # contiguous free bytes
        if n == 0 or (n < 0 and n != -EINTR and n != -EAGAIN):
            reading = False
        elif n > 0:
            x ^= x << np.uint64(13)  # xorshift64
            x ^= x >> np.uint64(7)
            x ^= x << np.uint64(17)
            u = float(x >> np.uint64(11)) / 9007199254740992.0  # uniform in [0, 1)
            arrive = _now_ns() + int(scale[0] * (delay_ns + (2.0 * u - 1.0) * jitter_ns))
            due = max(due, arrive) + (int(n * 1e9 / bytes_per_s) if bytes_per_s > 0 else 0)
            k = (head + count) % nslots
            slots[k, 0], slots[k, 1], slots[k, 2] = due, wpos, n
            count += 1
            used += n
            wpos = (wpos + n) % cap


LATE_MAX = 60_000  # ns: the most a wait ends early (and is spun); one wake-up's lateness counts no more


def _warm() -> None:
    """_pump compiled (or loaded from numba's cache) before the first connection waits on it."""
    a, b = socket.socketpair()
    with a, b:
        b.shutdown(socket.SHUT_WR)
        _pump(a.fileno(), b.fileno(), np.empty(1, np.uint8), np.empty((1, 3), np.int64), 0, 0, 0.0, 1, _SCALE)


def _fine_timers() -> None:
    """This thread's ppoll timeouts end when asked, not up to 50 us later (Linux's default timer
    slack), where prctl is there to ask."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_TIMERSLACK, ctypes.c_ulong(1), 0, 0, 0)
    except (OSError, AttributeError):
        pass


PR_SET_TIMERSLACK = 29


def _serve_one(client: socket.socket, target: tuple[str, int], delay_s: float, jitter_s: float, seed: int,
               bytes_per_s: float = 0.0) -> None:
    try:
        upstream = socket.create_connection(target, timeout=10)
    except OSError:
        client.close()
        return
    upstream.settimeout(None)
    for s in (client, upstream):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rng = random.Random(seed)
    ways = [_Direction(client, upstream, delay_s, jitter_s, rng, bytes_per_s),
            _Direction(upstream, client, delay_s, jitter_s, rng, bytes_per_s)]
    for way in ways:
        for t in way.threads:
            t.join()
    client.close()
    upstream.close()


def serve(listen: tuple[str, int], target: tuple[str, int], rtt_ms: float, jitter_ms: float,
          seed: int = 1, on_ready=None, rate_mbit: float = 0.0) -> None:
    """Relay every connection to `listen` to `target`, rtt_ms +- jitter_ms added per round trip,
    each direction at rate_mbit (0: as fast as the path)."""
    _warm()
    srv = socket.create_server(listen, reuse_port=False)
    if on_ready is not None:
        on_ready(srv.getsockname()[:2])
    delay, jitter = rtt_ms / 2000, jitter_ms / 2000
    n = 0
    while True:
        client, _ = srv.accept()
        n += 1
        threading.Thread(target=_serve_one, args=(client, target, delay, jitter, seed + n, rate_mbit * 1e6 / 8),
                         daemon=True).start()


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="relay.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--listen", type=_address, required=True, help="HOST:PORT to accept on (port 0: any)")
    ap.add_argument("--to", type=_address, required=True, help="HOST:PORT to relay to")
    ap.add_argument("--rtt-ms", type=float, default=None, help="round trip to add (default: the profile's)")
    ap.add_argument("--jitter-ms", type=float, default=None, help="+- on it (default: the profile's)")
    ap.add_argument("--profile", choices=sorted(PROFILES), default=None)
    ap.add_argument("--rate-mbit", type=float, default=0.0, help="each direction's rate (default: unlimited)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    prof = PROFILES.get(args.profile or "", Profile("", 0.0, 0.0))
    rtt = prof.rtt_ms if args.rtt_ms is None else args.rtt_ms
    jitter = prof.jitter_ms if args.jitter_ms is None else args.jitter_ms
    if rtt < 0 or jitter < 0 or jitter > rtt or args.rate_mbit < 0:
        print(f"relay: need 0 <= jitter ({jitter}) <= rtt ({rtt}) and a rate >= 0", file=sys.stderr)
        return 2
    signal.signal(signal.SIGUSR1, lambda *_: _SCALE.__setitem__(0, 10.0))
    try:
        serve(args.listen, args.to, rtt, jitter, args.seed,
              on_ready=lambda addr: print(f"ready {addr[0]}:{addr[1]}", flush=True), rate_mbit=args.rate_mbit)
    except OSError as exc:
        print(f"relay: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
