"""The delaying relay (tools/relay.py): the round trips it adds, bytes intact and in order, and a
real edgetp link measured through it. References: the relay's own settings (a formula: rtt +-
jitter on top of loopback), the bytes sent, and tbf's rate in a namespace testbed."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

import pytest

from edgetp.net.link import Link
from edgetp.parallel.runner import _hello
from edgetp.serve.spawn import start_worker, stop
from tools.netns import Testbed, read_line, require_root_and_netns
from tools.relay import PROFILES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The relay's round trip comes on top of the path's own (the echo or the worker answering, on a
# machine that may be busy): the bounds hold the difference to the direct path to the setting, with
# 2 ms of slack for load; twice the delay would still break them.
SLACK_MS = 2.0


def start_relay(to: str, *args: str, prefix: list[str] | None = None, listen: str = "127.0.0.1:0"):
    proc = subprocess.Popen([*(prefix or []), sys.executable, "-m", "tools.relay", "--listen", listen, "--to", to,
                             *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)
    line = read_line(proc, 20)
    assert line.startswith("ready "), (line, proc.stderr.read() if proc.poll() is not None else b"")
    return proc, line.split()[1]


def stop_relay(proc) -> None:
    proc.kill()
    proc.wait(timeout=10)
    proc.stdout.close()
    proc.stderr.close()


class Echo:
    """A plain echo server on loopback, one thread per connection, stopped by close()."""

    def __init__(self) -> None:
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.srv.settimeout(0.2)
        self.address = "127.0.0.1:%d" % self.srv.getsockname()[1]
        self.stopping = False
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.stopping:
            try:
                c, _ = self.srv.accept()
            except OSError:
                continue
            threading.Thread(target=self._echo, args=(c,), daemon=True).start()

    @staticmethod
    def _echo(c: socket.socket) -> None:
        with c:
            while data := c.recv(65536):
                c.sendall(data)

    def close(self) -> None:
        self.stopping = True
        self.thread.join(timeout=5)
        self.srv.close()


@pytest.fixture
def echo():
    e = Echo()
    yield e
    e.close()


def _round_trips(address: str, n: int) -> list[float]:
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        out = []
        for i in range(n):
            t0 = time.perf_counter()
            s.sendall(b"x" * 64)
            got = b""
            while len(got) < 64:
                got += s.recv(64 - len(got))
            out.append((time.perf_counter() - t0) * 1000)
        return out


def test_the_relay_adds_its_round_trip_and_jitter_and_no_more(echo):
    proc, addr = start_relay(echo.address, "--rtt-ms", "4", "--jitter-ms", "1")
    try:
        base = statistics.median(_round_trips(echo.address, 20))
        rtts = _round_trips(addr, 40)
    finally:
        stop_relay(proc)
    assert min(rtts) >= 3.0 - 0.05, rtts  # rtt - jitter, never less
    assert 3.5 <= statistics.median(rtts) <= base + 4.0 + 1.0 + SLACK_MS, (base, rtts)
    assert max(rtts) - min(rtts) > 0.3  # the jitter is there


def test_the_relay_carries_thousands_of_delayed_round_trips_and_each_gets_its_delay(echo):
    # every timed wait of the compiled pump, thousands in one call: its clock once took stack at each
    # read and crashed the relay within a few thousand round trips
    proc, addr = start_relay(echo.address, "--rtt-ms", "0.3")
    try:
        rtts = _round_trips(addr, 3000)
        assert proc.poll() is None
    finally:
        stop_relay(proc)
    assert min(rtts) >= 0.3 - 0.01, min(rtts)


def test_bytes_cross_the_relay_intact_and_in_order(echo):
    proc, addr = start_relay(echo.address, "--rtt-ms", "2", "--jitter-ms", "2")
    data = os.urandom(3 * 2**20)
    try:
        host, _, port = addr.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=20) as s:
            got = bytearray()
            sender = threading.Thread(target=s.sendall, args=(data,))
            sender.start()
            while len(got) < len(data):
                chunk = s.recv(1 << 20)
                assert chunk, "the relay closed early"
                got += chunk
            sender.join(timeout=20)
    finally:
        stop_relay(proc)
    assert bytes(got) == data


async def _measure(address: str):
    host, _, port = address.rpartition(":")
    link = await Link.connect(host, int(port))
    try:
        await _hello(link, None, "root", 1)
        return await link.measure()
    finally:
        link.close()


def test_a_link_to_a_real_worker_through_a_wifi_relay_measures_the_wifi_round_trip():
    worker, waddr = start_worker()
    wifi = PROFILES["wifi"]
    relay, addr = start_relay(waddr, "--profile", "wifi")
    try:
        direct = asyncio.run(_measure(waddr))
        st = asyncio.run(_measure(addr))
    finally:
        stop_relay(relay)
        stop(worker)
    assert wifi.rtt_ms - wifi.jitter_ms <= st.rtt_ms <= direct.rtt_ms + wifi.rtt_ms + wifi.jitter_ms + SLACK_MS, \
        (st, direct)
    assert st.rtt_p90_ms >= st.rtt_ms


def test_the_wifi_profile_in_namespaces_is_its_rate_and_round_trip():
    reason = require_root_and_netns()
    if reason:
        pytest.skip(reason)
    wifi = PROFILES["wifi"]
    with Testbed(2, rate=wifi.rate) as tb:
        root, far = tb[0], tb[1]
        worker, waddr = start_worker(host=far.address, prefix=far.argv([]))
        relay, addr = start_relay(waddr, "--profile", "wifi", prefix=root.argv([]), listen=f"{root.address}:0")
        try:
            code = ("import asyncio, json, sys\nfrom tests.test_relay import _measure\n"
                    "s = asyncio.run(_measure(sys.argv[1]))\nprint(json.dumps([s.rtt_ms, s.mbps]))")
            direct = float(root.run([sys.executable, "-c", code, waddr], timeout=120, cwd=REPO).stdout.split(",")[0][1:])
            out = root.run([sys.executable, "-c", code, addr], timeout=120, cwd=REPO)
            rtt, mbps = (float(v) for v in out.stdout.strip("[]\n").split(","))
        finally:
            stop_relay(relay)
            stop(worker)
    assert wifi.rtt_ms - wifi.jitter_ms <= rtt <= direct + wifi.rtt_ms + wifi.jitter_ms + SLACK_MS, (rtt, direct)
    assert 30 <= mbps <= 115  # tbf's 100 Mbit/s; a half-MiB probe over 4 ms sees part of slow start


def _echo_time(address: str, data: bytes) -> float:
    """Seconds to send data through an echo and have it all back."""
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        t0 = time.perf_counter()
        sender = threading.Thread(target=s.sendall, args=(data,))
        sender.start()
        got = 0
        while got < len(data):
            chunk = s.recv(1 << 20)
            assert chunk, "the relay closed early"
            got += len(chunk)
        sender.join(timeout=30)
        return time.perf_counter() - t0


def test_the_relays_rate_serialises_each_direction_and_sigusr1_degrades_the_delay_tenfold(echo):
    proc, addr = start_relay(echo.address, "--rtt-ms", "2", "--rate-mbit", "40")
    try:
        # 2 MB at 40 Mbit/s takes 0.4 s each way; the echo's way back overlaps the way out
        assert _echo_time(addr, os.urandom(2_000_000)) >= 0.4
        before = statistics.median(_round_trips(addr, 10))
        proc.send_signal(signal.SIGUSR1)
        time.sleep(0.2)
        after = statistics.median(_round_trips(addr, 10))
    finally:
        stop_relay(proc)
    assert before < 2.0 + 1.0 + SLACK_MS and after >= 20.0 - 0.05, (before, after)
