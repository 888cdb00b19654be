"""A persistent TCP link between two nodes, in two modes over one socket.

- **asyncio mode** (control traffic, idle time): frames move with the event
  loop's `sock_recv_into` / `sock_sendall` on a non-blocking socket. There is
  no buffering layer, so nothing sits in a stream buffer when the mode flips.
- **blocking mode** (the per-layer exchange during a generation): the compute
  thread sends and receives on the socket itself, sleeping in the kernel
  while it waits. No busy polling: a 2-core board keeps both cores for math.

`choose_mode` picks the generation-time mode from a measured round-trip time
against the measured cost of an event-loop hop, and logs the choice.

Every link counts bytes and seconds spent sending and receiving, per
direction; callers read `counters` before and after a token for per-token
figures.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgetp.net import auth, frames
from edgetp.net.frames import Frame, FrameError, FrameType

log = logging.getLogger(__name__)

BLOCKING, ASYNC = "blocking", "asyncio"
HOP_FACTOR = 20  # blocking mode pays while the RTT is under this many event-loop hops


class LinkClosed(ConnectionError):
    """The peer went away, broke the protocol, or timed out; str() says which link and why."""

    def __init__(self, message: str, link_name: str | None = None) -> None:
        super().__init__(message)
        self.link_name = link_name


@dataclass
class Counters:
    sent: int = 0          # bytes
    received: int = 0      # bytes
    send_s: float = 0.0    # seconds blocked in send
    recv_s: float = 0.0    # seconds blocked in receive (waiting for the peer included)

    def snapshot(self) -> "Counters":
        return Counters(self.sent, self.received, self.send_s, self.recv_s)

    def minus(self, before: "Counters") -> "Counters":
        return Counters(self.sent - before.sent, self.received - before.received,
                        self.send_s - before.send_s, self.recv_s - before.recv_s)


class Link:
    """One framed TCP connection; starts in asyncio mode."""

    def __init__(self, sock: socket.socket, name: str, *, timeout: float = 60.0,
                 max_frame: int = frames.MAX_FRAME) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        self.sock = sock
        self.name = name                 # peer address or node id, for messages
        self.timeout = timeout           # seconds a blocking receive may wait
        self.max_frame = max_frame
        self.mode = ASYNC
        self.hot_mode = BLOCKING         # the mode used during generations (see choose_mode)
        self.rtt: float | None = None    # seconds, measured by ping()
        self.peer_id: str | None = None  # set by the handshake
        self.embeds = False              # the peer embeds token ids itself (it maps the embedding table)
        self.hello: dict[str, Any] = {}  # the peer's HELLO header, once received
        self.counters = Counters()
        self._buf = bytearray(1 << 16)   # reused receive buffer for blocking-mode payloads

    # ------------------------------------------------------------------ asyncio mode
    @classmethod
    async def connect(cls, host: str, port: int, *, timeout: float = 10.0, **kw: Any) -> "Link":
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, kind, proto, _, addr = infos[0]
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, addr), timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            sock.close()
            raise LinkClosed(f"{host}:{port}: cannot connect ({exc or 'timed out'})") from None
        return cls(sock, f"{host}:{port}", **kw)

    async def send(self, ftype: FrameType, header: dict[str, Any] | None = None,
                   payload: Any = b"") -> None:
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        try:
            for part in frames.encode_frame(ftype, header, payload, max_frame=self.max_frame):
                await loop.sock_sendall(self.sock, part)
                self.counters.sent += len(part)
        except OSError as exc:
            raise self._closed(f"send failed ({exc})") from None
        self.counters.send_s += time.perf_counter() - t0

    async def recv(self, timeout: float | None = None) -> Frame:
        try:
            return await asyncio.wait_for(self._recv(), timeout or self.timeout)
        except asyncio.TimeoutError:
            raise self._closed(f"no frame within {timeout or self.timeout:.0f} s") from None

    async def _recv(self) -> Frame:
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()

        async def exactly(n: int) -> memoryview:
            view = memoryview(bytearray(n))
            got = 0
            while got < n:
                try:
                    k = await loop.sock_recv_into(self.sock, view[got:])
                except OSError as exc:
                    raise self._closed(f"receive failed ({exc})") from None
                if k == 0:
                    raise self._closed("connection closed by peer")
                got += k
            return view

        try:
            kind, flags, hlen, plen = frames.parse_prefix(await exactly(frames.PREFIX.size), self.max_frame)
            header = frames.parse_header(await exactly(hlen))
            payload = await exactly(plen) if plen else b""
        except FrameError as exc:
            raise self._closed(f"bad frame ({exc})") from None
        size = frames.PREFIX.size + hlen + plen
        self.counters.received += size
        self.counters.recv_s += time.perf_counter() - t0
        return Frame(kind, header, payload, flags, size)

    async def expect(self, ftype: FrameType, timeout: float | None = None) -> Frame:
        """The next frame, which must be of type ftype (an ERROR frame raises with its message)."""
        frame = await self.recv(timeout)
        return self._check(frame, ftype)

    async def request(self, ftype: FrameType, header: dict[str, Any], reply: FrameType,
                      payload: Any = b"", timeout: float | None = None) -> Frame:
        await self.send(ftype, header, payload)
        return await self.expect(reply, timeout)

    async def ping(self, count: int = 5) -> float:
        """Median round-trip time of `count` PING/PONG exchanges, in seconds."""
        samples = []
        for i in range(count):
            t0 = time.perf_counter()
            await self.request(FrameType.PING, {"i": i}, FrameType.PONG)
            samples.append(time.perf_counter() - t0)
        self.rtt = float(np.median(samples))
        return self.rtt

    # ------------------------------------------------------------------ authentication
    async def authenticate(self, key: bytes, node_id: str, extra: dict[str, Any] | None = None) -> str:
        """Run the HMAC challenge as the connecting side; returns the peer's node id.

        `extra` rides in the HELLO (e.g. the root's epoch); it is not part of the proof.
        """
        ini = auth.Initiator(key, node_id)
        hello = ini.hello() | (extra or {})
        await self.send(FrameType.HELLO, hello)
        msg = ini.on_challenge((await self.expect(FrameType.CHALLENGE, 10)).header)
        await self.send(FrameType.AUTH, msg)
        ok = await self.expect(FrameType.AUTH_OK, 10)
        try:
            ini.on_ok(ok.header)
        except auth.AuthError as exc:
            raise self._closed(f"authentication failed ({exc})") from None
        self.peer_id = ini.peer_id
        return self.peer_id

    async def accept_auth(self, key: bytes, node_id: str) -> str:
        """Run the HMAC challenge as the accepting side; returns the peer's node id."""
        res = auth.Responder(key, node_id)
        try:
            hello = (await self.expect(FrameType.HELLO, 10)).header
            self.hello = hello
            if "cluster_id" not in hello:
                raise auth.AuthError("this node requires the cluster key (--key) and the peer sent none")
            await self.send(FrameType.CHALLENGE, res.on_hello(hello))
            await self.send(FrameType.AUTH_OK, res.on_auth((await self.expect(FrameType.AUTH, 10)).header))
        except auth.AuthError as exc:
            await self._try_error(f"authentication failed: {exc}")
            raise self._closed(f"authentication failed ({exc})") from None
        self.peer_id = res.peer_id
        return self.peer_id

    async def _try_error(self, message: str) -> None:
        try:
            await asyncio.wait_for(self.send(FrameType.ERROR, {"message": message}), 1)
        except (LinkClosed, asyncio.TimeoutError):
            pass

    # ------------------------------------------------------------------ blocking mode
    def enter_blocking(self) -> None:
        """Hand the socket to a compute thread (no asyncio call may be pending)."""
        self.sock.setblocking(True)
        self.sock.settimeout(self.timeout)
        self.mode = BLOCKING

    def leave_blocking(self) -> None:
        self.sock.setblocking(False)
        self.mode = ASYNC

    def send_blocking(self, ftype: FrameType, header: dict[str, Any] | None = None, payload: Any = b"") -> None:
        t0 = time.perf_counter()
        try:
            self.counters.sent += frames.send_frame(self.sock, ftype, header, payload)
        except OSError as exc:
            raise self._closed(f"send failed ({exc})") from None
        self.counters.send_s += time.perf_counter() - t0

    def recv_blocking(self, ftype: FrameType) -> Frame:
        """The next frame (must be ftype). Its payload may view a reused buffer: use it before the next receive."""
        t0 = time.perf_counter()
        try:
            frame = frames.recv_frame(self.sock, self._buf, self.max_frame)
        except socket.timeout:
            raise self._closed(f"no frame within {self.timeout:.0f} s") from None
        except (OSError, FrameError) as exc:
            raise self._closed(f"receive failed ({exc})") from None
        if frame is None:
            raise self._closed("connection closed by peer")
        if len(frame.payload) > len(self._buf) // 2:
            self._buf = bytearray(2 * len(frame.payload))  # next time it lands in the reused buffer
        self.counters.received += frame.size
        self.counters.recv_s += time.perf_counter() - t0
        return self._check(frame, ftype)

    # ------------------------------------------------------------------ common
    def _check(self, frame: Frame, ftype: FrameType) -> Frame:
        if frame.type == FrameType.ERROR and ftype != FrameType.ERROR:
            raise self._closed(f"peer reported: {frame.header.get('message', 'error')}")
        if frame.type != ftype:
            raise self._closed(f"protocol error: expected {ftype.name}, got {frame.type.name}")
        return frame

    def _closed(self, why: str) -> LinkClosed:
        self.close()
        return LinkClosed(f"link {self.name}: {why}", self.name)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    @property
    def closed(self) -> bool:
        return self.sock.fileno() < 0


async def event_loop_hop(samples: int = 50) -> float:
    """Median seconds for a thread to get a result back through the running loop."""
    loop = asyncio.get_running_loop()

    async def nothing() -> None:
        return None

    def from_thread() -> list[float]:
        out = []
        for _ in range(samples):
            t0 = time.perf_counter()
            asyncio.run_coroutine_threadsafe(nothing(), loop).result()
            out.append(time.perf_counter() - t0)
        return out

    return float(np.median(await asyncio.to_thread(from_thread)))


def choose_mode(rtt: float, hop: float, forced: str | None = None) -> str:
    """Blocking sockets while an event-loop hop is a noticeable part of a round trip."""
    if forced in (BLOCKING, ASYNC):
        return forced
    return BLOCKING if rtt < HOP_FACTOR * hop else ASYNC


def forced_mode() -> str | None:
    """EDGETP_LINK_MODE=blocking|asyncio overrides the measured choice (benchmarks, tests)."""
    value = os.environ.get("EDGETP_LINK_MODE")
    return value if value in (BLOCKING, ASYNC) else None
