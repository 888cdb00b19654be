"""A TCP relay that delays each direction: link latency and jitter where the kernel has no netem.

    python -m tools.relay --listen 10.77.0.11:7710 --to 10.77.0.12:7710 --rtt-ms 4 --jitter-ms 1

Every connection to --listen is relayed to --to. Each chunk read in one direction is
written to the other side at (time read + rtt/2 + a uniform jitter in [-jitter/2, +jitter/2]),
never before the chunk read ahead of it: bytes stay in order, and the round trip a
request/response pair sees is rtt +- jitter on top of the path's own. Threads and
time.sleep, not asyncio: a sleep on Linux lands within ~0.1 ms, an event loop's timer
within ~1 ms, which would swamp the Ethernet profile.

Rates come from tbf on the namespaces' links (tools/netns.py), or from --rate-mbit here
(each direction serialises its chunks at that rate, for loopback benchmarks without
namespaces); PROFILES name the pairs the real-links issue asks for. SIGUSR1 multiplies the
added delay and jitter by 10 from then on: a link that degrades mid-run. Prints "ready HOST:PORT" once listening; runs until killed
(tools/netns.Host.stop_processes, or SIGTERM).
"""

from __future__ import annotations

import argparse
import collections
import random
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass


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

CHUNK = 256 * 1024
_SCALE = [1.0]  # the delay's multiplier: SIGUSR1 makes it 10 (a degraded link)


class _Direction:
    """One direction of one connection: a reader thread stamps chunks, a writer thread sends them when due."""

    def __init__(self, src: socket.socket, dst: socket.socket, delay_s: float, jitter_s: float,
                 rng: random.Random, bytes_per_s: float = 0.0) -> None:
        self.src, self.dst = src, dst
        self.bytes_per_s = bytes_per_s  # 0: no rate of our own
        self.delay, self.jitter, self.rng = delay_s, jitter_s, rng
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.ready = threading.Condition()
        self.done = False
        self.threads = [threading.Thread(target=self._read, daemon=True), threading.Thread(target=self._write, daemon=True)]
        for t in self.threads:
            t.start()

    def _read(self) -> None:
        due = 0.0
        try:
            while data := self.src.recv(CHUNK):
                scale = _SCALE[0]
                arrive = time.monotonic() + scale * (self.delay + self.rng.uniform(-self.jitter, self.jitter))
                due = max(due, arrive) + (len(data) / self.bytes_per_s if self.bytes_per_s else 0.0)
                with self.ready:
                    self.queue.append((due, data))
                    self.ready.notify()
        except OSError:
            pass
        with self.ready:
            self.done = True
            self.ready.notify()

    def _write(self) -> None:
        try:
            while True:
                with self.ready:
                    while not self.queue and not self.done:
                        self.ready.wait()
                    if not self.queue:
                        break
                    due, data = self.queue.popleft()
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                self.dst.sendall(data)
            self.dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


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
