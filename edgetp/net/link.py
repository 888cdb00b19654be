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

Before the handshake a link trusts nothing: frames are held to
PREAUTH_MAX_FRAME (64 KiB), the handshake to a deadline, and no buffer is
ever sized from an announced length before those bytes arrive. After a keyed
handshake every frame is sealed (net/frames.py `Cipher`, keys from
net/auth.py): one that fails to open closes the link with the reason.
Data links keep TCP keepalive on (idle 10 s, then 3 probes 5 s apart) and a
30 s TCP user timeout, so a peer that lost power is noticed in ~25 s even by
a thread blocked in a receive.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import os
import socket
import struct
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgetp.net import auth, frames
from edgetp.net.frames import Frame, FrameError, FrameType

log = logging.getLogger(__name__)

BLOCKING, ASYNC = "blocking", "asyncio"
HOP_FACTOR = 20  # blocking mode pays while the RTT is under this many event-loop hops
HANDSHAKE_TIMEOUT = 10.0  # seconds, the whole handshake, either side
KEEPALIVE = {"TCP_KEEPIDLE": 10, "TCP_KEEPINTVL": 5, "TCP_KEEPCNT": 3}  # seconds, seconds, probes: a LAN's
USER_TIMEOUT_MS = 30_000  # unacknowledged data older than this closes the connection


class LinkClosed(ConnectionError):
    """The peer went away, broke the protocol, or timed out; str() says which link and why."""

    def __init__(self, message: str, link_name: str | None = None) -> None:
        super().__init__(message)
        self.link_name = link_name


PROBE_BYTES = 512 * 1024  # payload of each throughput probe (measure)
HOT_ROUNDS = 64  # all-reduce rounds timed by measure_rounds (tens of microseconds each on a LAN)
MAX_ROUNDS = 1024  # the most a peer echoes for one PING


@dataclass(frozen=True)
class LinkStats:
    """What a link measured at connect: round trips in ms (median, p90), throughput in Mbit/s."""

    rtt_ms: float
    rtt_p90_ms: float
    mbps: float


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
        _keepalive(sock)
        sock.setblocking(False)
        self.sock = sock
        self.name = name                 # peer address or node id, for messages
        self.timeout = timeout           # seconds a blocking receive may wait
        self.max_frame = max_frame
        self.mode = ASYNC
        self.hot_mode = BLOCKING         # the mode used during generations (see choose_mode)
        self.rtt: float | None = None    # seconds, measured by ping() or measure()
        self.stats: LinkStats | None = None  # measured by measure()
        self.peer_id: str | None = None  # set by the handshake
        self._cut = False  # shut down by `cut`
        self.embeds = False              # the peer embeds token ids itself (it maps the embedding table)
        self.hello: dict[str, Any] = {}  # the peer's HELLO header, once received
        self.counters = Counters()
        self.trusted = False             # the handshake is done: max_frame applies, not PREAUTH_MAX_FRAME
        self._tx: frames.Cipher | None = None  # seals what we send, once a keyed handshake is done
        self._rx: frames.Cipher | None = None  # opens what we receive
        self._buf: bytearray | None = None     # reused receive buffers for blocking-mode frames
        self._plain: bytearray | None = None
        self._bare: dict[tuple[int, int, bool], frames.Bare] = {}  # the hot path's frame kinds, made once
        self._wire: dict[tuple[int, int], Any] = {}  # their compiled path's buffers (net/wire.py), made once
        self._sealed_rx: dict[tuple[int, int], Any] = {}  # a sealed link's: compiled receives, opened in Python

    @property
    def sealed(self) -> bool:
        return self._tx is not None

    @property
    def limit(self) -> int:
        """Largest frame (header + payload) accepted now."""
        return self.max_frame if self.trusted else min(self.max_frame, frames.PREAUTH_MAX_FRAME)

    def trust(self, keys: tuple[bytes, bytes] | None = None) -> None:
        """The handshake is done; with (send, receive) keys every later frame is sealed."""
        if keys is not None:
            self._tx, self._rx = frames.Cipher(keys[0]), frames.Cipher(keys[1])
        self.trusted = True
        self._wire.clear()  # made for a plain link: sealed frames take frames.py's way
        self._sealed_rx.clear()

    # ------------------------------------------------------------------ asyncio mode
    @classmethod
    async def connect(cls, host: str, port: int, *, timeout: float = 10.0, **kw: Any) -> "Link":
        """A link to host:port (each address it resolves to, in turn); LinkClosed names it on failure."""
        name = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, asyncio.TimeoutError) as exc:
            raise LinkClosed(f"link {name}: cannot resolve {host!r} ({exc or 'timed out'})", name) from None
        why = "no address"
        for family, kind, proto, _, addr in infos:
            sock = socket.socket(family, kind, proto)
            sock.setblocking(False)
            try:
                async with asyncio.timeout(timeout):
                    await loop.sock_connect(sock, addr)
            except (OSError, asyncio.TimeoutError) as exc:
                sock.close()
                why = str(exc) or "timed out"
                continue
            except BaseException:
                sock.close()
                raise
            return cls(sock, name, **kw)
        raise LinkClosed(f"link {name}: cannot connect ({why})", name)

    async def send(self, ftype: FrameType, header: dict[str, Any] | None = None,
                   payload: Any = b"") -> None:
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        try:
            for part in frames.encode_frame(ftype, header, payload, max_frame=self.max_frame, cipher=self._tx):
                await loop.sock_sendall(self.sock, part)
                self.counters.sent += len(part)
        except OSError as exc:
            raise self._closed(f"send failed ({exc})") from None
        self.counters.send_s += time.perf_counter() - t0

    async def recv(self, timeout: float | None = None) -> Frame:
        try:
            async with asyncio.timeout(timeout or self.timeout):  # not wait_for: see cluster/election.py
                return await self._recv()
        except asyncio.TimeoutError:
            raise self._closed(f"no frame within {timeout or self.timeout:.0f} s") from None

    async def _recv(self) -> Frame:
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()

        async def exactly(n: int) -> memoryview:
            """n bytes; the buffer grows (from FIRST_CHUNK, doubling) only as they arrive."""
            buf = bytearray(min(n, frames.FIRST_CHUNK))
            got = 0
            while got < n:
                if got == len(buf):
                    buf.extend(bytes(min(n - got, got)))
                try:
                    with memoryview(buf) as mv, mv[got:] as rest:
                        k = await loop.sock_recv_into(self.sock, rest)
                except OSError as exc:
                    raise self._closed(f"receive failed ({exc})") from None
                if k == 0:
                    raise self._closed("connection closed by peer")
                got += k
            return memoryview(buf)

        try:
            prefix = await exactly(frames.PREFIX.size)
            kind, flags, hlen, plen = frames.parse_prefix(prefix, self.limit)
            body = frames.body_bytes(flags, hlen, plen, self._rx)
            header, payload = frames.split_body(prefix, await exactly(body), hlen, self._rx)
        except FrameError as exc:
            raise self._closed(f"bad frame{'' if self.trusted else ' before the handshake'} ({exc})") from None
        size = frames.PREFIX.size + body
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

    async def measure(self, pings: int = 9, probe_bytes: int = PROBE_BYTES, probes: int = 3) -> LinkStats:
        """Round trips (median, p90) of `pings` PING/PONGs, then the throughput toward the peer:
        `probes` PINGs carrying probe_bytes each (the PONG is a header only), best of them, with
        one median round trip taken off each. Sized to take a few round trips, not a transfer
        that would disturb serving: 512 KiB is 84 ms on 50 Mbit/s Wi-Fi."""
        samples = []
        for i in range(pings):
            t0 = time.perf_counter()
            await self.request(FrameType.PING, {"i": i}, FrameType.PONG)
            samples.append(time.perf_counter() - t0)
        self.rtt = float(np.median(samples))
        payload = bytes(probe_bytes)
        best = 0.0
        for i in range(probes):
            t0 = time.perf_counter()
            await self.request(FrameType.PING, {"i": pings + i}, FrameType.PONG, payload)
            seconds = max(time.perf_counter() - t0 - self.rtt, 1e-6)
            best = max(best, probe_bytes * 8 / seconds / 1e6)
        self.stats = LinkStats(self.rtt * 1e3, float(np.percentile(samples, 90)) * 1e3, best)
        return self.stats

    async def measure_rounds(self, cols: int, rounds: int = HOT_ROUNDS) -> float:
        """Median seconds of an all-reduce round as a generation runs it: a (1, cols) f32 frame each
        way, both ends in blocking mode on their compute threads (compiled receives that poll, or
        sealed frames), after a PING asking the peer to echo (`echo_rounds`). The event loop's own
        hops, which a PING's round trip carries, are not in it."""
        await self.send(FrameType.PING, {"rounds": rounds, "cols": cols})
        self.enter_blocking()
        try:
            took = await asyncio.to_thread(self._rounds, cols, rounds)
        finally:
            if not self.closed:
                self.leave_blocking()
        await self.expect(FrameType.PONG)
        return took

    def _rounds(self, cols: int, rounds: int) -> float:
        x, samples = np.ones((1, cols), np.float32), []
        for _ in range(rounds):
            t0 = time.perf_counter()
            self.send_values_blocking(FrameType.PARTIAL, x)
            self.recv_values_blocking(FrameType.REDUCED, x, add=False)
            samples.append(time.perf_counter() - t0)
        return float(np.median(samples))

    def echo_rounds(self, cols: int, rounds: int) -> None:
        """The peer's side of measure_rounds, in blocking mode on a thread: each frame sent back."""
        x = np.empty((1, cols), np.float32)
        for _ in range(rounds):
            self.recv_values_blocking(FrameType.PARTIAL, x, add=False)
            self.send_values_blocking(FrameType.REDUCED, x)

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
        """Run the HMAC challenge as the connecting side, then seal the link; returns the peer's node id.

        `extra` rides in the HELLO (e.g. the root's epoch), inside the proof.
        """
        ini = auth.Initiator(key, node_id, extra)
        try:
            async with asyncio.timeout(HANDSHAKE_TIMEOUT):
                await self.send(FrameType.HELLO, ini.hello())
                await self.send(FrameType.AUTH, ini.on_challenge((await self.expect(FrameType.CHALLENGE)).header))
                await self.expect(FrameType.AUTH_OK)
        except auth.AuthError as exc:
            raise self._closed(f"authentication failed ({exc})") from None
        except TimeoutError:
            raise self._closed(f"no handshake within {HANDSHAKE_TIMEOUT:.0f} s") from None
        self.peer_id = ini.peer_id
        self.trust(ini.keys)
        return str(self.peer_id)

    async def accept_auth(self, key: bytes, node_id: str) -> str:
        """Run the HMAC challenge as the accepting side, then seal the link; returns the peer's node id."""
        res = auth.Responder(key, node_id)
        try:
            async with asyncio.timeout(HANDSHAKE_TIMEOUT):
                await self.send(FrameType.CHALLENGE, res.on_hello((await self.expect(FrameType.HELLO)).header))
                self.hello = res.hello
                res.on_auth((await self.expect(FrameType.AUTH)).header)
                await self.send(FrameType.AUTH_OK, {})
        except auth.AuthError as exc:
            await self._try_error(f"authentication failed: {exc}")
            raise self._closed(f"authentication failed ({exc})") from None
        except TimeoutError:
            raise self._closed(f"no handshake within {HANDSHAKE_TIMEOUT:.0f} s") from None
        self.peer_id = res.peer_id
        self.trust(res.keys)
        return str(self.peer_id)

    async def _try_error(self, message: str) -> None:
        try:
            async with asyncio.timeout(1):
                await self.send(FrameType.ERROR, {"message": message})
        except (LinkClosed, asyncio.TimeoutError):
            pass

    # ------------------------------------------------------------------ blocking mode
    def enter_blocking(self) -> None:
        """Hand the socket to a compute thread (no asyncio call may be pending).

        The wait for a frame is bounded by the kernel (SO_RCVTIMEO, SO_SNDTIMEO: a call that
        waits that long fails with EAGAIN), not by Python's socket timeout, which polls before
        every call: one system call fewer per frame on the all-reduce's path."""
        self.sock.setblocking(True)
        kernel_timeouts(self.sock, self.timeout)
        self.mode = BLOCKING

    def leave_blocking(self) -> None:
        kernel_timeouts(self.sock, 0.0)
        self.sock.setblocking(False)
        self.mode = ASYNC

    def send_blocking(self, ftype: FrameType, header: dict[str, Any] | None = None, payload: Any = b"") -> None:
        t0 = time.perf_counter()
        try:
            self.counters.sent += frames.send_frame(self.sock, ftype, header, payload, self._tx)
        except BlockingIOError:  # SO_SNDTIMEO ran out
            raise self._closed(f"send failed (the peer took nothing for {self.timeout:g} s)") from None
        except OSError as exc:
            raise self._closed(f"send failed ({exc})") from None
        self.counters.send_s += time.perf_counter() - t0

    def recv_blocking(self, ftype: FrameType) -> Frame:
        """The next frame (must be ftype). Its payload may view a reused buffer: use it before the next receive.
        Polls first, as an all-reduce's receive does (a step's frame and its answers come within a token)."""
        _poll(self.sock)
        return self._check(self._received(frames.recv_frame), ftype)

    def send_bare_blocking(self, ftype: FrameType, payload: memoryview) -> None:
        """send_blocking(ftype, {}, payload), the hot path's way (frames.send_bare): the same bytes."""
        t0 = time.perf_counter()
        try:
            self.counters.sent += frames.send_bare(self.sock, self._bare_of(ftype, len(payload)), payload, self._tx)
        except BlockingIOError:  # SO_SNDTIMEO ran out
            raise self._closed(f"send failed (the peer took nothing for {self.timeout:g} s)") from None
        except OSError as exc:
            raise self._closed(f"send failed ({exc})") from None
        self.counters.send_s += time.perf_counter() - t0

    def recv_bare_blocking(self, ftype: FrameType, plen: int) -> memoryview:
        """The payload of the next frame, which must be ftype with an empty header, received the hot
        path's way (frames.recv_bare): a view, as recv_blocking's. An ERROR or a frame of another
        type is refused as recv_blocking refuses it; one of this type but another size is handed on
        (the caller checks the size it needs)."""
        bare = self._bare_of(ftype, plen)
        _poll(self.sock)
        got = self._received(frames.recv_bare, bare)
        if isinstance(got, Frame):
            return self._check(got, ftype).payload
        size = frames.PREFIX.size + bare.body
        if self._rx is not None and (self._plain is None or len(self._plain) < size):
            self._plain = bytearray(size)  # the next one opens in place
        self.counters.received += size
        return got

    def recv_values_blocking(self, ftype: FrameType, dst: np.ndarray, add: bool) -> None:
        """dst (2-D f32) += (add) or = the values of the next frame, which must be ftype with an empty
        header and dst's size: recv_bare_blocking and the sum in one compiled call (net/wire.py),
        the GIL released. On a sealed link the frame is received by compiled code and opened here
        (_opened); a system without the compiled path takes recv_bare_blocking's way."""
        bufs = self._wire.get((ftype, 4 * dst.size)) or self._wire_buffers(ftype, 4 * dst.size)
        if bufs is _SEALED and self._tx is not None and wire_available():
            _wire().apply_values(self._opened(ftype, 4 * dst.size), dst, add)
        elif bufs is _SEALED:
            self._recv_values_sealed(ftype, dst, add)
        elif self._rx is not None:
            self._recv_sealed(ftype, bufs, _wire().recv_values_sealed, dst, add)
        else:
            self._recv_wire(ftype, bufs, _wire().recv_values, dst, add, _tune())

    def recv_q8_blocking(self, ftype: FrameType, dst: np.ndarray, add: bool) -> None:
        """recv_values_blocking for a frame of Q8_0 blocks (quant.dequantize_q8_0's values); dst
        1-D f32, C-contiguous."""
        plen = dst.size // 32 * 34
        bufs = self._wire.get((ftype, plen)) or self._wire_buffers(ftype, plen)
        if bufs is _SEALED:
            quant = _quant()
            payload = self._opened(ftype, plen)[1:] if self._tx is not None and wire_available() else \
                self.recv_bare_blocking(ftype, plen)
            quant.dequantize_q8_0(payload, dst.size, dst, add)
        elif self._rx is not None:
            self._recv_sealed(ftype, bufs, _wire().recv_q8_sealed, dst, add, _quant()._TAB16)
        else:
            self._recv_wire(ftype, bufs, _wire().recv_q8, dst, add, _quant()._TAB16, _tune())

    def send_values_blocking(self, ftype: FrameType, src: np.ndarray) -> None:
        """send_bare_blocking(ftype, src's f32 bytes), built and sent in one compiled call
        (net/wire.py), the GIL released; src 2-D f32 of any layout. A sealed link (or a system
        without the compiled path) takes send_bare_blocking's way."""
        bufs = self._wire.get((ftype, 4 * src.size)) or self._wire_buffers(ftype, 4 * src.size)
        if bufs is _SEALED:
            self.send_bare_blocking(ftype, memoryview(np.ascontiguousarray(src, np.float32)).cast("B"))
        elif self._tx is not None:
            self._send_sealed(ftype, bufs, _wire().send_values_sealed, src)
        else:
            self._send_wire(ftype, bufs, _wire().send_values, src)

    def send_bytes_blocking(self, ftype: FrameType, payload: memoryview) -> None:
        """send_values_blocking for a payload already encoded (bytes: Q8_0 blocks, say)."""
        bufs = self._wire.get((ftype, len(payload))) or self._wire_buffers(ftype, len(payload))
        if bufs is _SEALED:
            self.send_bare_blocking(ftype, payload)
        elif self._tx is not None:
            self._send_sealed(ftype, bufs, _wire().send_bytes_sealed, np.frombuffer(payload, np.uint8))
        else:
            self._send_wire(ftype, bufs, _wire().send_bytes, np.frombuffer(payload, np.uint8))

    def send_q8_blocking(self, ftype: FrameType, src: np.ndarray, back: bool) -> None:
        """send_bytes_blocking(ftype, quant.quantize_q8_0(src, back)), quantized into the frame and sent
        in one compiled call; src 1-D f32, C-contiguous (back: replaced by the values sent)."""
        if src.dtype != np.float32 or src.ndim != 1 or not src.flags.c_contiguous or src.size % 32:
            raise ValueError(f"Q8_0 blocks are made of 1-D C-contiguous float32 in 32s, got {src.dtype} {src.shape}")
        plen = src.size // 32 * 34
        bufs = self._wire.get((ftype, plen)) or self._wire_buffers(ftype, plen)
        if bufs is _SEALED:
            self.send_bare_blocking(ftype, memoryview(_quant().quantize_q8_0(src, back=back)).cast("B"))
        elif self._tx is not None:
            self._send_sealed(ftype, bufs, _wire().send_q8_sealed, src, _quant()._TAB16, back)
        else:
            self._send_wire(ftype, bufs, _wire().send_q8, src, _quant()._TAB16, back)

    def _recv_wire(self, ftype: FrameType, bufs: Any, call, *args: Any) -> None:
        t0 = time.perf_counter()
        got = call(self.sock.fileno(), bufs.rx, *args, False)
        while got == -errno.EINTR:  # a signal came first: Python ran its handler, the frame goes on
            got = call(self.sock.fileno(), bufs.rx, *args, True)
        if got:
            raise self._recv_failed(got, ftype, bufs)
        self.counters.received += bufs.size
        self.counters.recv_s += time.perf_counter() - t0

    def _send_wire(self, ftype: FrameType, bufs: Any, call, *args: Any) -> None:
        t0 = time.perf_counter()
        got = call(self.sock.fileno(), bufs.tx, *args, False)
        while got == -errno.EINTR:
            got = call(self.sock.fileno(), bufs.tx, *args, True)
        if got in (-errno.EAGAIN, -errno.EWOULDBLOCK):  # SO_SNDTIMEO ran out
            raise self._closed(f"send failed (the peer took nothing for {self.timeout:g} s)")
        if got:
            why = "libcrypto did not seal the frame" if got == _wire().UNSEALED else os.strerror(-got)
            raise self._closed(f"send failed ({why})")
        self.counters.sent += bufs.size
        self.counters.send_s += time.perf_counter() - t0

    def _recv_sealed(self, ftype: FrameType, bufs: Any, call, *args: Any) -> None:
        """_recv_wire on a sealed link: the frame opened by the same compiled call, with the next
        number of this direction as its nonce, counted once it opened."""
        number = self._rx.counter
        self._recv_wire(ftype, bufs, call, *args, self._rx.context(False).addr, number, _tune())
        self._rx.counter = number + 1

    def _send_sealed(self, ftype: FrameType, bufs: Any, call, *args: Any) -> None:
        """_send_wire on a sealed link: the frame sealed by the same compiled call with the next number
        of this direction as its nonce (counted at once: a send that fails closes the link)."""
        number = self._tx.counter
        self._tx.counter = number + 1
        self._send_wire(ftype, bufs, call, *args, self._tx.context(True).addr, number)

    def _opened(self, ftype: FrameType, plen: int) -> np.ndarray:
        """The next frame, which must be a sealed ftype with an empty header and a plen-byte payload,
        received by compiled code (net/wire.py recv_body: the poll, the prefix compared, the body) and
        opened here: its plaintext, the header byte then the payload (a reused buffer: use it before
        the next receive). Anything else is refused as recv_bare_blocking refuses it."""
        bufs = self._sealed_rx.get((ftype, plen))
        if bufs is None:
            bare = self._bare_of(ftype, plen)
            bufs = self._sealed_rx[(ftype, plen)] = _wire().Buffers.sealed(bare.prefix, bare.body, frames.TAG_BYTES)
        self._recv_wire(ftype, bufs, _wire().recv_body, _tune())
        try:
            plain = self._rx.open(bufs.prefix, bufs.body, bufs.plain)
        except FrameError as exc:
            raise self._closed(f"bad frame ({exc})") from None
        if plain[0] != frames.EMPTY_HEADER[0]:
            raise self._closed(f"bad frame (a {ftype.name} frame's one-byte header is not an empty map)")
        return np.frombuffer(bufs.plain, np.uint8)

    def _recv_values_sealed(self, ftype: FrameType, dst: np.ndarray, add: bool) -> None:
        payload = self.recv_bare_blocking(ftype, 4 * dst.size)
        if len(payload) != 4 * dst.size:  # the same type, another size: as the compiled path says it
            raise self._closed(f"protocol error: a {ftype.name} frame with a {len(payload)}-byte payload, "
                               f"expected {4 * dst.size}")
        values = np.frombuffer(payload, np.float32).reshape(dst.shape)
        if add:
            dst += values
        else:
            dst[...] = values

    def _recv_failed(self, got: int, ftype: FrameType, bufs: Any) -> LinkClosed:
        wire = _wire()
        if got == wire.NOT_OURS:  # an ERROR, say: read and refused as recv_bare_blocking refuses it
            frame = self._check(self._received(frames._rest_of_frame, bytearray(bufs.prefix)), ftype)
            return self._closed(f"protocol error: a {ftype.name} frame of {frame.size} bytes, expected {bufs.size}")
        if got == wire.CLOSED:
            return self._closed("bad frame (truncated: connection closed mid-frame)" if bufs.started
                                else "connection closed by peer")
        if got == wire.BAD_HEADER:
            return self._closed(f"bad frame (a {ftype.name} frame's one-byte header is not an empty map)")
        if got == wire.UNOPENED:
            return self._closed(f"bad frame ({frames.unopened(self._rx.counter)})")
        if got in (-errno.EAGAIN, -errno.EWOULDBLOCK):  # SO_RCVTIMEO ran out
            return self._closed(f"no frame within {self.timeout:g} s")
        return self._closed(f"receive failed ({os.strerror(-got)})")

    def _wire_buffers(self, ftype: FrameType, plen: int) -> Any:
        """The compiled path's buffers for frames of ftype and a plen-byte payload, made at the
        first use; _SEALED where frames take the Python way (no compiled path here, or a sealed
        link without compiled sealing: net/aead.py)."""
        sealed = self._tx is not None
        if not wire_available() or (sealed and not sealing_available()):
            bufs = _SEALED
        else:
            bufs = _wire().Buffers(self._bare_of(ftype, plen).head, plen, frames.TAG_BYTES if sealed else 0)
        self._wire[(ftype, plen)] = bufs
        return bufs

    def _received(self, recv, *lead: Any) -> Frame | memoryview:
        """recv(sock, *lead, buffers...)'s frame or payload; a closed link, a timeout or a bad frame as LinkClosed."""
        t0 = time.perf_counter()
        try:
            got, self._buf = recv(self.sock, *lead, self._buf, self.limit, self._rx, self._plain)
        except (socket.timeout, BlockingIOError):  # BlockingIOError: SO_RCVTIMEO ran out
            raise self._closed(f"no frame within {self.timeout:g} s") from None
        except FrameError as exc:
            raise self._closed(f"bad frame ({exc})") from None
        except OSError as exc:
            raise self._closed(f"receive failed ({exc})") from None
        if got is None:
            raise self._closed("connection closed by peer")
        if isinstance(got, Frame):
            if self._rx is not None and (self._plain is None or len(self._plain) < got.size):
                self._plain = bytearray(got.size)  # the next sealed frame of this size opens in place
            self.counters.received += got.size
        self.counters.recv_s += time.perf_counter() - t0
        return got

    def _bare_of(self, ftype: FrameType, plen: int) -> frames.Bare:
        key = (ftype, plen, self._tx is not None)
        bare = self._bare.get(key)
        if bare is None:
            bare = self._bare[key] = frames.Bare.of(ftype, plen, self._tx is not None)
        return bare

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
        """Close the socket; a thread blocked in a receive on it wakes up (shutdown first)."""
        if self.sock.fileno() >= 0:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        try:
            self.sock.close()
        except OSError:
            pass

    def cut(self) -> bool:
        """Shut the socket down from any thread, keeping it open: a receive blocked on it, here or in a
        compute thread, returns at once and closes the link there, as when the peer closes it. (Closing
        it here could hand its descriptor to a new socket under that receive.) False if closed or cut before."""
        if self._cut:
            return False
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # closed, or never connected
            return False
        self._cut = True
        return True

    @property
    def closed(self) -> bool:
        return self.sock.fileno() < 0

    @property
    def done(self) -> bool:
        """Closed, or cut: nothing more will cross it."""
        return self._cut or self.closed


_SEALED = object()  # Link._wire's mark: this kind of frame goes through frames.py (Python)

# How long a compute thread polls its socket for an all-reduce frame before it waits in the kernel
# (net/wire.py): a wait there costs the wake-up of a sleeping thread (of an idle vCPU in a VM), which
# was most of a loopback all-reduce here (tools/bench_allreduce.py). A poll that finds it lost its core
# meanwhile (another thread ran there) stops, and receives wait at once for a while (wire._polled):
# a woken thread runs at once where a polling one waits for the other's time slice. EDGETP_SPIN_US
# sets it (0: wait at once).
SPIN_US = 200


class SpinError(ValueError):
    """EDGETP_SPIN_US is not a whole number of microseconds from 0 to 1000000, or EDGETP_LINK_MODE
    is not blocking or asyncio (`check_env`)."""


@functools.cache
def spin_ns(text: str | None = None) -> int:
    """The polling time of an all-reduce receive, ns: EDGETP_SPIN_US's (or text's), else SPIN_US's."""
    text = os.environ.get("EDGETP_SPIN_US") if text is None else text
    if text is None or not text.strip():
        return SPIN_US * 1000
    try:
        us = int(text.strip())
    except ValueError:
        us = -1
    if not 0 <= us <= 1_000_000:
        raise SpinError(f"EDGETP_SPIN_US must be a whole number of microseconds from 0 to 1000000, got {text!r}")
    return us * 1000


@functools.cache
def _wire():
    """net/wire.py, imported at the first use: it compiles with numba, which a link without a
    generation (a CLI call, discovery) need not load."""
    from edgetp.net import wire  # noqa: PLC0415

    return wire


@functools.cache
def _quant():
    """edgetp.model.quant (Q8_0's codec), imported at the first use, as net/wire.py is."""
    from edgetp.model import quant  # noqa: PLC0415

    return quant


def _poll(sock: socket.socket) -> None:
    """net/wire.py's poll before a receive of a frame that Python takes (sealed ones, a step's
    frames): it returns once sock has bytes to read, or when polling would not pay. Where the
    compiled path does not run, the receive waits in the kernel at once."""
    if wire_available():
        _wire().poll(sock.fileno(), _PEEK, _tune())


_PEEK = np.zeros(1, np.uint8)  # the byte a poll peeks at (never read: the frame's receive takes it)
_TUNE = np.zeros(2, np.int64)  # this process's polling: ns to poll, and no poll before (wire._polled)


def _tune() -> np.ndarray:
    _TUNE[0] = spin_ns()
    return _TUNE


def wire_available() -> bool:
    """The compiled all-reduce path runs here (Linux: libc's names); net/wire.py."""
    return sys.platform.startswith("linux")


def sealing_available() -> bool:
    """Sealed all-reduce frames are sealed and opened by that compiled path too (net/aead.py: a
    libcrypto with ChaCha20-Poly1305 that agrees with `cryptography`). EDGETP_AEAD=0 keeps them
    in Python."""
    if os.environ.get("EDGETP_AEAD", "1") == "0" or not wire_available():
        return False
    from edgetp.net import aead  # noqa: PLC0415

    return aead.available()


def kernel_timeouts(sock: socket.socket, seconds: float) -> None:
    """Bound each blocking receive and send on sock by `seconds` in the kernel (0: no bound): a call
    that waits that long fails with EAGAIN (BlockingIOError), with no poll before each call."""
    whole = int(seconds)
    tv = struct.pack("ll", whole, int(round((seconds - whole) * 1e6)))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def _keepalive(sock: socket.socket) -> None:
    """TCP keepalive and a user timeout suited to a LAN (where the platform has them)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in KEEPALIVE.items():
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, USER_TIMEOUT_MS)


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


def forced_mode(text: str | None = None) -> str | None:
    """EDGETP_LINK_MODE=blocking|asyncio (or text) overrides the measured choice (benchmarks, tests);
    unset or empty leaves it to the measurement, anything else is a SpinError."""
    text = os.environ.get("EDGETP_LINK_MODE") if text is None else text
    if text is None or not text.strip():
        return None
    if text.strip().lower() not in (BLOCKING, ASYNC):
        raise SpinError(f"EDGETP_LINK_MODE must be {BLOCKING} or {ASYNC}, got {text!r}")
    return text.strip().lower()


def check_env() -> None:
    """The links' variables (EDGETP_SPIN_US, EDGETP_LINK_MODE) checked before anything starts:
    one line (SpinError) instead of a failure at the first connection."""
    spin_ns()
    forced_mode()
