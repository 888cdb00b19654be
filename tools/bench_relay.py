"""What the delaying relay (tools/relay.py) adds and costs: a ping-pong on 127.0.0.1, straight
to an echo and through a relay at each round trip asked, with the relay process's CPU time.

    python tools/bench_relay.py [--rtt-ms 0,0.3,4] [--bytes 2400] [--rounds 2000]

The reference is the setting itself beside the direct path: a relay that added exactly its
round trip would measure direct + rtt. The relay shares the testbed's cores with the nodes it
connects, so its CPU a round trip is time the nodes lose (tools/bench_links.py).
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Echo:
    """Echoes whole messages of `size` bytes, one connection at a time, until closed."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self.srv.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            with c:
                c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                buf = bytearray(self.size)
                while _fill(c, buf):
                    c.sendall(buf)


def _fill(s: socket.socket, buf: bytearray) -> bool:
    got, view = 0, memoryview(buf)
    while got < len(buf):
        n = s.recv_into(view[got:])
        if not n:
            return False
        got += n
    return True


def ping(address: str, size: int, rounds: int) -> list[float]:
    """Round trips in µs of `rounds` messages of `size` bytes."""
    host, _, port = address.rpartition(":")
    out = []
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray(size)
        for _ in range(rounds):
            t0 = time.perf_counter()
            s.sendall(buf)
            if not _fill(s, buf):
                raise RuntimeError("the connection closed mid-run")
            out.append((time.perf_counter() - t0) * 1e6)
    return out


def through_relay(to: str, rtt_ms: float, size: int, rounds: int) -> tuple[list[float], float]:
    """Round trips through a relay adding rtt_ms, and the relay's CPU µs per round trip."""
    proc = subprocess.Popen([sys.executable, "-m", "tools.relay", "--listen", "127.0.0.1:0", "--to", to,
                             "--rtt-ms", str(rtt_ms), "--jitter-ms", "0"], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True)
    try:
        line = proc.stdout.readline()
        if not line.startswith("ready "):
            raise RuntimeError(f"relay did not start: {line!r}")
        addr = line.split()[1]
        ping(addr, size, 50)  # the connection's first round trips (its threads starting)
        c0 = _cpu_s(proc.pid)
        rtts = ping(addr, size, rounds)
        cpu = (_cpu_s(proc.pid) - c0) / rounds * 1e6
    finally:
        proc.kill()
        proc.wait(timeout=10)
        proc.stdout.close()
    return rtts, cpu


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rtt-ms", default="0,0.3,4", help="round trips for the relay to add, comma-separated")
    ap.add_argument("--bytes", type=int, default=2400, help="message size (2,400: about one SmolLM2 f32 frame)")
    ap.add_argument("--rounds", type=int, default=2000)
    args = ap.parse_args(argv)
    try:
        settings = [float(x) for x in args.rtt_ms.split(",")]
    except ValueError:
        print(f"bench_relay: --rtt-ms wants numbers, got {args.rtt_ms!r}", file=sys.stderr)
        return 2
    if args.bytes < 1 or not 1 <= args.rounds <= 100_000 or any(x < 0 for x in settings):
        print("bench_relay: need --bytes >= 1, 1 <= --rounds <= 100000 and round trips >= 0", file=sys.stderr)
        return 2
    echo = Echo(args.bytes)
    direct = statistics.median(ping(echo.address, args.bytes, args.rounds))
    cpu = (platform.processor() or platform.machine())
    print(f"# relay round trips: {args.bytes}-byte ping-pong, {args.rounds} rounds, {os.cpu_count()} CPUs ({cpu}), "
          f"load {os.getloadavg()[0]:.2f}\n")
    print("| relay adds (ms) | direct + that, µs (reference) | measured median µs | p90 µs | beyond the reference µs "
          "| relay CPU µs a round trip |")
    print("|---:|---:|---:|---:|---:|---:|")
    for rtt in settings:
        rtts, used = through_relay(echo.address, rtt, args.bytes, args.rounds)
        ref = direct + rtt * 1000
        med = statistics.median(rtts)
        p90 = sorted(rtts)[int(0.9 * len(rtts))]
        print(f"| {rtt:g} | {ref:.0f} | {med:.0f} | {p90:.0f} | {med - ref:.0f} | {used:.0f} |")
    echo.srv.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
