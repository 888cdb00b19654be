"""Data-link security on loopback: limits before trust, sealed frames after it, keepalive.

Everything here runs over real sockets; the worker tests use real `edgetp worker --key` processes.
An on-path attacker is a real TCP proxy between the two ends that can replay, reorder, alter or
inject frames.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import numpy as np
import pytest

from edgetp.net import auth, link as link_mod
from edgetp.parallel import profile
from edgetp.net.frames import MAGIC, PREFIX, PROTOCOL_VERSION, SEALED, TAG_BYTES, FrameType
from edgetp.net.link import Link, LinkClosed

KEY = bytes(range(32))
OTHER = bytes(range(1, 33))


async def _tcp_pair(port_of=None) -> tuple[Link, Link]:
    """(connecting side, accepting side) over 127.0.0.1; `port_of(server_port)` may redirect the connect."""
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    loop = asyncio.get_running_loop()
    port = server.getsockname()[1]
    connecting = asyncio.ensure_future(Link.connect("127.0.0.1", port_of(port) if port_of else port))
    conn, addr = await loop.sock_accept(server)
    server.close()
    return await connecting, Link(conn, f"{addr[0]}:{addr[1]}")


async def _sealed_pair(init_key=KEY, resp_key=KEY, port_of=None) -> tuple[Link, Link]:
    a, b = await _tcp_pair(port_of)
    await asyncio.gather(a.authenticate(init_key, "root", {"epoch": 4}), b.accept_auth(resp_key, "worker"))
    return a, b


# --------------------------------------------------------------------------- the handshake, then sealed frames


async def test_a_keyed_handshake_names_both_peers_carries_the_epoch_and_seals_every_later_frame():
    a, b = await _sealed_pair()
    try:
        assert (a.peer_id, b.peer_id, b.hello["epoch"]) == ("worker", "root", 4)
        assert a.sealed and b.sealed and a.trusted and b.trusted
        x = np.arange(576, dtype=np.float32)
        before = a.counters.sent
        await a.send(FrameType.PARTIAL, {}, x)
        frame = await b.recv(5)
        np.testing.assert_array_equal(frame.array(), x)
        assert frame.flags & SEALED
        # 16-byte prefix + msgpack {dtype, shape} + payload + the tag: counted on both sides alike
        header = len(__import__("msgpack").packb({"dtype": "float32", "shape": [576]}))
        assert a.counters.sent - before == frame.size == 16 + header + 576 * 4 + TAG_BYTES
    finally:
        a.close()
        b.close()


async def test_sealed_frames_flow_both_ways_in_blocking_mode_too():
    a, b = await _sealed_pair()
    try:
        a.enter_blocking()
        b.enter_blocking()
        x = np.random.default_rng(1).standard_normal(300_000).astype(np.float32)  # > a socket buffer

        def echo() -> None:
            got = b.recv_blocking(FrameType.PARTIAL)
            b.send_blocking(FrameType.REDUCED, {"n": 1}, np.array(got.array()) * 2)

        t = threading.Thread(target=echo)
        t.start()
        a.send_blocking(FrameType.PARTIAL, {}, x)
        back = a.recv_blocking(FrameType.REDUCED)
        t.join(10)
        np.testing.assert_array_equal(back.array(), x * 2)
    finally:
        a.close()
        b.close()


async def test_a_wrong_key_closes_both_ends_with_the_reason():
    a, b = await _tcp_pair()
    results = await asyncio.gather(a.authenticate(OTHER, "root"), b.accept_auth(KEY, "worker"),
                                   return_exceptions=True)
    assert all(isinstance(r, LinkClosed) for r in results), results
    assert "another cluster" in str(results[1]) and "another cluster" in str(results[0])  # told by ERROR
    assert a.closed and b.closed


async def test_a_silent_peer_is_dropped_at_the_handshake_deadline(monkeypatch):
    monkeypatch.setattr(link_mod, "HANDSHAKE_TIMEOUT", 0.3)
    a, b = await _tcp_pair()
    try:
        with pytest.raises(LinkClosed, match=r"no handshake within"):
            await asyncio.wait_for(b.accept_auth(KEY, "worker"), 5)
        assert b.closed
    finally:
        a.close()


async def test_a_frame_over_64_kib_before_the_handshake_closes_the_link():
    a, b = await _tcp_pair()
    try:
        await asyncio.get_running_loop().sock_sendall(
            a.sock, PREFIX.pack(MAGIC, PROTOCOL_VERSION, FrameType.HELLO, 0, 10, 60 * 2**20))
        with pytest.raises(LinkClosed, match=r"before the handshake \(oversize frame: 62914570 > 65536"):
            await b.accept_auth(KEY, "worker")
    finally:
        a.close()


async def test_link_connect_to_a_refusing_port_raises_link_closed_with_the_link_name():
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there now
    with pytest.raises(LinkClosed, match=f"127.0.0.1:{port}: cannot connect") as info:
        await Link.connect("127.0.0.1", port)
    assert info.value.link_name == f"127.0.0.1:{port}"
    with pytest.raises(LinkClosed, match="cannot resolve") as info:
        await Link.connect("no-such-host.invalid", port, timeout=5)
    assert info.value.link_name == f"no-such-host.invalid:{port}"


async def test_data_links_keep_tcp_keepalive_on_with_lan_settings():
    a, b = await _tcp_pair()
    try:
        for link in (a, b):
            s = link.sock
            assert s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert (s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
                    s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
                    s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT)) == (10, 5, 3)
            assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 30_000
    finally:
        a.close()
        b.close()


def test_closing_a_link_wakes_a_thread_blocked_in_its_receive():
    async def go() -> tuple[Link, Link]:
        return await _tcp_pair()

    a, b = asyncio.run(go())
    try:
        a.enter_blocking()
        woke: list[BaseException] = []

        def wait() -> None:
            try:
                a.recv_blocking(FrameType.STEP)
            except LinkClosed as exc:
                woke.append(exc)

        t = threading.Thread(target=wait)
        t.start()
        time.sleep(0.3)
        a.close()
        t.join(5)
        assert not t.is_alive() and woke, "a blocked receive must end when its link is closed"
    finally:
        b.close()


# --------------------------------------------------------------------------- an on-path attacker


class Proxy:
    """A TCP relay on 127.0.0.1 that can tamper with the client->server direction, frame by frame.

    `tamper(index, frame_bytes) -> list[bytes]` decides what goes on for each whole frame (the
    handshake's plain frames and the sealed ones after it); the other direction is relayed as is.
    """

    def __init__(self, target_port: int, tamper) -> None:
        self.target_port = target_port
        self.tamper = tamper
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.socks: list[socket.socket] = []
        self.threads: list[threading.Thread] = []
        self._accept = threading.Thread(target=self._run, daemon=True)
        self._accept.start()

    def _run(self) -> None:
        try:
            client, _ = self.listener.accept()
        except OSError:
            return
        server = socket.create_connection(("127.0.0.1", self.target_port))
        self.socks += [client, server]
        for fn in (lambda: self._frames(client, server), lambda: self._raw(server, client)):
            t = threading.Thread(target=fn, daemon=True)
            t.start()
            self.threads.append(t)

    @staticmethod
    def _exactly(sock: socket.socket, n: int) -> bytes | None:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                return None
            data += chunk
        return data

    def _frames(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            for index in range(100_000):
                prefix = self._exactly(src, PREFIX.size)
                if prefix is None:
                    break
                _, _, _, flags, hlen, plen = PREFIX.unpack(prefix)
                body = self._exactly(src, hlen + plen + (TAG_BYTES if flags & SEALED else 0))
                if body is None:
                    break
                for out in self.tamper(index, prefix + body):
                    dst.sendall(out)
        except OSError:
            pass
        finally:
            self._shut(dst)

    @staticmethod
    def _raw(src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(1 << 16):
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            Proxy._shut(dst)

    @staticmethod
    def _shut(sock: socket.socket) -> None:
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        self.listener.close()
        for s in self.socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        for t in [self._accept, *self.threads]:
            t.join(5)


HANDSHAKE_FRAMES = 2  # client->server: HELLO, AUTH; frame 2 is the first sealed one


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1:]


ATTACKS = {
    # name: (tamper(index, frame) -> frames to pass on, expected reason on the receiving end)
    "replayed": (lambda i, f: [f, f] if i == HANDSHAKE_FRAMES else [f], "frame 1 failed authentication"),
    "reordered": (lambda i, f, held=[]: ([] if i == HANDSHAKE_FRAMES and not held.append(f)
                                         else [f, *held] if i == HANDSHAKE_FRAMES + 1 else [f]),
                  "frame 0 failed authentication"),
    "altered payload": (lambda i, f: [_flip(f, PREFIX.size + 1)] if i == HANDSHAKE_FRAMES else [f],
                        "frame 0 failed authentication"),
    "altered type": (lambda i, f: [f[:5] + bytes([FrameType.LOAD]) + f[6:]] if i == HANDSHAKE_FRAMES else [f],
                     "frame 0 failed authentication"),
    "injected plain": (lambda i, f: ([PREFIX.pack(MAGIC, PROTOCOL_VERSION, FrameType.LOAD, 0, 1, 0) + b"\x80", f]
                                     if i == HANDSHAKE_FRAMES else [f]), "unsealed frame on a sealed link"),
    "injected sealed-looking": (lambda i, f: ([PREFIX.pack(MAGIC, PROTOCOL_VERSION, FrameType.STEP, SEALED, 1, 4)
                                               + bytes(5 + TAG_BYTES), f] if i == HANDSHAKE_FRAMES else [f]),
                                "frame 0 failed authentication"),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
async def test_a_frame_replayed_reordered_altered_or_injected_on_path_closes_the_link_with_the_reason(attack):
    tamper, reason = ATTACKS[attack]
    proxies: list[Proxy] = []

    def via_proxy(port: int) -> int:
        proxies.append(Proxy(port, tamper))
        return proxies[0].port

    a, b = await _sealed_pair(port_of=via_proxy)
    try:
        for i in range(2):
            await a.send(FrameType.STEP, {"pos": i, "ids": [i]})
        with pytest.raises(LinkClosed, match=reason):
            for _ in range(3):
                await b.recv(5)
        assert b.closed
    finally:
        a.close()
        b.close()
        proxies[0].close()


async def test_the_same_relay_without_tampering_carries_the_frames():
    proxies: list[Proxy] = []

    def via_proxy(port: int) -> int:
        proxies.append(Proxy(port, lambda i, f: [f]))
        return proxies[0].port

    a, b = await _sealed_pair(port_of=via_proxy)
    try:
        for i in range(2):
            await a.send(FrameType.STEP, {"pos": i, "ids": [i]})
        assert [(await b.recv(5)).header["pos"] for _ in range(2)] == [0, 1]
    finally:
        a.close()
        b.close()
        proxies[0].close()


# --------------------------------------------------------------------------- a real worker under a flood


def _vm_rss(pid: int) -> int:
    # What the worker allocated, from the page tables (status's VmRSS is a per-CPU-batched counter
    # that has missed a whole 64 MiB allocation on a CI host; see profile.runtime_bytes).
    return profile.runtime_bytes(rollup=f"/proc/{pid}/smaps_rollup", status=f"/proc/{pid}/status")


def _flood(port: int, count: int, stop: threading.Event, opened: list[socket.socket]) -> None:
    """`count` unauthenticated connections, each announcing a 60 MiB HELLO, held open."""
    announce = PREFIX.pack(MAGIC, PROTOCOL_VERSION, FrameType.HELLO, 0, 10, 60 * 2**20) + bytes(4096)
    for _ in range(count):
        if stop.is_set():
            return
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=2)
            opened.append(s)
            s.sendall(announce)
        except OSError:
            pass  # refused or reset by the worker: what a flood should get


@pytest.fixture
def keyed_worker(tmp_path):
    from edgetp.serve.spawn import start_worker, stop  # noqa: PLC0415

    key_file = tmp_path / "cluster.key"
    auth.write_key(key_file, KEY)
    proc, addr = start_worker("--key", str(key_file))
    yield proc, addr
    stop(proc)


def test_200_connections_announcing_60_mib_cost_the_worker_under_20_mb_and_a_keyed_root_is_served(keyed_worker):
    proc, addr = keyed_worker
    port = int(addr.rsplit(":", 1)[1])
    time.sleep(1.0)  # let the fresh process settle
    base = _vm_rss(proc.pid)
    stop, opened, peak = threading.Event(), [], [base]
    flooders = [threading.Thread(target=_flood, args=(port, 100, stop, opened)) for _ in range(2)]
    served: list[str] = []

    async def legitimate() -> None:
        for _ in range(50):  # the cap may turn a connection away while the flood holds every slot
            try:
                link = await Link.connect("127.0.0.1", port)
                try:
                    await link.authenticate(KEY, "root", {"epoch": 1})
                    rtt = await link.ping(3)
                    served.append(f"{link.peer_id} rtt {rtt * 1e3:.2f} ms")
                    return
                finally:
                    link.close()
            except LinkClosed:
                await asyncio.sleep(0.1)

    try:
        for t in flooders:
            t.start()
        asyncio.run(legitimate())
        for _ in range(200):  # sample while the flood lasts (bounded)
            peak.append(_vm_rss(proc.pid))
            if not any(t.is_alive() for t in flooders):
                break
            time.sleep(0.05)
        for t in flooders:
            t.join(60)
        time.sleep(0.5)
        peak.append(_vm_rss(proc.pid))
    finally:
        stop.set()
        for s in opened:
            s.close()
    print(f"flood: {len(opened)} connections, RSS {base / 2**20:.1f} MB -> peak {max(peak) / 2**20:.1f} MB; {served}")
    assert len(opened) >= 150, f"the flood opened only {len(opened)} connections"
    assert served, "the keyed root was never served during the flood"
    assert max(peak) - base < 20 * 2**20, f"RSS grew {(max(peak) - base) / 2**20:.1f} MB"
    assert proc.poll() is None


def test_a_worker_closes_a_silent_connection_at_the_handshake_deadline_and_logs_refusals_sparingly(keyed_worker):
    proc, addr = keyed_worker
    port = int(addr.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(link_mod.HANDSHAKE_TIMEOUT + 10)
        t0 = time.monotonic()
        assert s.recv(100) == b""  # closed by the worker, having said nothing
        waited = time.monotonic() - t0
    assert link_mod.HANDSHAKE_TIMEOUT - 1 < waited < link_mod.HANDSHAKE_TIMEOUT + 10
    socks = []
    try:
        for _ in range(40):  # 40 oversize HELLOs at once: each refused, the log says so in one line
            c = socket.create_connection(("127.0.0.1", port), timeout=2)
            socks.append(c)
            c.sendall(PREFIX.pack(MAGIC, PROTOCOL_VERSION, FrameType.HELLO, 0, 10, 60 * 2**20))
        for c in socks:
            c.settimeout(5)
            try:
                assert c.recv(100) == b""
            except ConnectionResetError:
                pass
    finally:
        for c in socks:
            c.close()
    proc.terminate()
    proc.wait(10)
    err = proc.stderr.read()
    refusals = [line for line in err.splitlines() if "connection refused" in line]
    assert refusals and "no handshake within" in refusals[0]
    assert len(refusals) <= 3, refusals  # rate-limited, not one line per connection


# --------------------------------------------------------------------------- end to end: injection, then recovery


def test_a_frame_injected_into_a_workers_link_mid_answer_drops_that_link_and_the_replanned_answer_is_unchanged(
        tmp_path, stories_path):
    from edgetp.model import gguf, quant, sampling  # noqa: PLC0415
    from edgetp.model.generate import LocalRunner, generate  # noqa: PLC0415
    from edgetp.model.tokenizer import Tokenizer  # noqa: PLC0415
    from edgetp.net.loopthread import LoopThread  # noqa: PLC0415
    from edgetp.parallel.runner import ClusterRunner  # noqa: PLC0415
    from edgetp.serve.spawn import start_worker, stop  # noqa: PLC0415

    greedy = sampling.SamplingParams(temperature=0)
    mf = gguf.open_model(stories_path)
    tok = Tokenizer.from_metadata(mf.metadata)
    ids = tok.encode("Once upon a time, there was a little girl named Lily. She", parse_special=True)
    expected = [ev.token_id for ev in generate(LocalRunner(gguf.open_model(stories_path), 256), tok, ids, greedy, 40)]
    key_file = tmp_path / "cluster.key"
    auth.write_key(key_file, KEY)
    armed, injected = threading.Event(), []
    garbage = PREFIX.pack(MAGIC, PROTOCOL_VERSION, FrameType.STEP, SEALED, 1, 8) + bytes(9 + TAG_BYTES)

    def tamper(i: int, frame: bytes) -> list[bytes]:
        if armed.is_set() and not injected:
            injected.append(i)
            return [garbage, frame]
        return [frame]

    procs = [start_worker("--key", str(key_file)) for _ in range(2)]
    (keep, a), (victim, b) = procs
    proxy = Proxy(int(b.rsplit(":", 1)[1]), tamper)
    via = f"127.0.0.1:{proxy.port}"
    quant.set_threads(1)
    try:
        with LoopThread() as control:
            current = [control.run(ClusterRunner.connect(mf, [a, via], ctx=256, weights=[1, 1, 1], key=KEY),
                                   timeout=300)]

            def recover(exc):
                current[0] = control.run(current[0].without(exc.link_name), timeout=300)
                return current[0]

            try:
                got, notes = [], []
                for ev in generate(current[0], tok, ids, greedy, 40, recover=recover):
                    got.append(ev.token_id)
                    notes += [ev.note] if ev.note else []
                    if ev.index == 8:
                        armed.set()
            finally:
                current[0].close()
        assert injected, "the attacker never got to inject"
        assert got == expected
        assert len(notes) == 1 and via in notes[0]
        assert [s.node_id for s in current[0].plan.shares] == ["root", current[0].nodes[1].node_id]
        victim.terminate()
        victim.wait(10)
        log = victim.stderr.read()
        assert "failed authentication (tampered, replayed, reordered or injected)" in log, log[-2000:]
    finally:
        proxy.close()
        for proc, _ in procs:
            stop(proc)
