"""Bare frames, the all-reduce's hot path (frames.Bare, send_bare, recv_bare): the very bytes of the
general encoder, read back by either receiver, and every other frame still seen for what it is."""

from __future__ import annotations

import socket
import struct
import threading
import time

import numpy as np
import pytest

from edgetp.net.frames import (
    PREFIX,
    Bare,
    Cipher,
    Frame,
    FrameError,
    FrameType,
    encode_frame,
    recv_bare,
    recv_frame,
    send_bare,
    send_frame,
)
from edgetp.net.link import Link, LinkClosed

KEY = bytes(range(32))


def wire_of(send) -> bytes:
    """Every byte `send(sock)` writes to a real socket."""
    a, b = socket.socketpair()
    with a, b:
        got = bytearray()
        reader = threading.Thread(target=lambda: [got.extend(c) for c in iter(lambda: b.recv(1 << 16), b"")])
        reader.start()
        send(a)
        a.shutdown(socket.SHUT_WR)
        reader.join(10)
    return bytes(got)


@pytest.mark.parametrize("sealed", [False, True])
@pytest.mark.parametrize("plen", [0, 1, 2304, 300_000])  # the last one larger than a socket's buffer
def test_a_bare_frame_is_the_general_encoders_frame_byte_for_byte(sealed, plen):
    payload = memoryview(np.random.default_rng(plen).integers(0, 256, plen, dtype=np.uint8))
    bare = Bare.of(FrameType.PARTIAL, plen, sealed)
    want = wire_of(lambda s: [send_frame(s, FrameType.PARTIAL, {}, payload, Cipher(KEY) if sealed else None)])
    got = wire_of(lambda s: [send_bare(s, bare, payload, Cipher(KEY) if sealed else None)])
    assert got == want
    assert len(got) == PREFIX.size + bare.body


def test_send_bare_refuses_a_payload_or_sealing_the_frame_was_not_made_for():
    a, b = socket.socketpair()
    with a, b:
        with pytest.raises(ValueError, match="does not fit"):
            send_bare(a, Bare.of(FrameType.PARTIAL, 8, False), b"1234")
        with pytest.raises(ValueError, match="does not fit"):
            send_bare(a, Bare.of(FrameType.PARTIAL, 4, False), b"1234", Cipher(KEY))


def _stream(sealed: bool, sender) -> list:
    """What recv_bare (expecting 4 float32 REDUCED frames) and recv_frame make of sender's frames, in turn."""
    a, b = socket.socketpair()
    with a, b:
        tx, rx = (Cipher(KEY), Cipher(KEY)) if sealed else (None, None)
        t = threading.Thread(target=sender, args=(a, tx))
        t.start()
        bare, out, buf = Bare.of(FrameType.REDUCED, 16, sealed), [], None
        for k in range(4):
            if k % 2:
                frame, buf = recv_frame(b, buf, cipher=rx)
            else:  # the expected kind: its payload alone; any other frame whole
                frame, buf = recv_bare(b, bare, buf, cipher=rx)
                if isinstance(frame, memoryview):
                    frame = Frame(FrameType.REDUCED, {}, frame)
            out.append((frame.type, frame.header, bytes(frame.payload)))
        t.join(10)
        return out


@pytest.mark.parametrize("sealed", [False, True])
def test_bare_and_general_frames_interleave_on_one_stream_either_way(sealed):
    xs = [np.arange(4, dtype=np.float32) + k for k in range(4)]

    def sender(sock, tx):
        for k, x in enumerate(xs):  # general, bare, general, bare: each read by the other kind of receiver
            if k % 2:
                send_bare(sock, Bare.of(FrameType.REDUCED, 16, sealed), memoryview(x).cast("B"), tx)
            else:
                send_frame(sock, FrameType.REDUCED, {}, memoryview(x).cast("B"), tx)

    got = _stream(sealed, sender)
    assert [(t, h) for t, h, _ in got] == [(FrameType.REDUCED, {})] * 4
    assert [np.frombuffer(p, np.float32).tolist() for _, _, p in got] == [x.tolist() for x in xs]


@pytest.mark.parametrize("sealed", [False, True])
def test_a_frame_other_than_the_expected_one_comes_back_whole_and_the_stream_stays_in_step(sealed):
    def sender(sock, tx):
        send_frame(sock, FrameType.ERROR, {"message": "worker failed: out of memory"}, b"", tx)
        send_frame(sock, FrameType.REDUCED, {}, b"x" * 16, tx)
        send_frame(sock, FrameType.REDUCED, {}, b"y" * 8, tx)  # the wrong size for the plan
        send_frame(sock, FrameType.REDUCED, {}, b"z" * 16, tx)

    got = _stream(sealed, sender)  # frames 0 and 2 read by recv_bare
    assert got[0] == (FrameType.ERROR, {"message": "worker failed: out of memory"}, b"")
    assert got[1:] == [(FrameType.REDUCED, {}, b"x" * 16), (FrameType.REDUCED, {}, b"y" * 8),
                       (FrameType.REDUCED, {}, b"z" * 16)]


def test_a_tampered_or_unsealed_bare_frame_on_a_sealed_stream_is_refused():
    x = memoryview(np.arange(4, dtype=np.float32)).cast("B")
    bare = Bare.of(FrameType.REDUCED, 16, True)
    good = b"".join(bytes(p) for p in encode_frame(FrameType.REDUCED, {}, x, cipher=Cipher(KEY)))
    flipped = good[:20] + bytes([good[20] ^ 1]) + good[21:]
    plain = b"".join(bytes(p) for p in encode_frame(FrameType.REDUCED, {}, x))
    for data, reason in ((flipped, "failed authentication"), (plain, "unsealed frame on a sealed link")):
        a, b = socket.socketpair()
        with a, b:
            a.sendall(data)
            with pytest.raises(FrameError, match=reason):
                recv_bare(b, bare, None, cipher=Cipher(KEY))


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """Two ends of a loopback TCP connection (a Link sets TCP_NODELAY: not on a socketpair)."""
    with socket.create_server(("127.0.0.1", 0)) as lst:
        b = socket.create_connection(lst.getsockname(), timeout=10)
        return lst.accept()[0], b


@pytest.mark.parametrize("sealed", [False, True])
def test_a_link_reports_the_peers_error_in_place_of_a_bare_frame_and_closes(sealed):
    a, b = tcp_pair()
    root, worker = Link(a, "worker"), Link(b, "root")
    root.trust((KEY, KEY[::-1]) if sealed else None)
    worker.trust((KEY[::-1], KEY) if sealed else None)
    for link in (root, worker):
        link.enter_blocking()
    try:
        for k in range(3):  # in place, round after round
            x = np.arange(4, dtype=np.float32) + k
            worker.send_bare_blocking(FrameType.PARTIAL, memoryview(x).cast("B"))
            np.testing.assert_array_equal(np.frombuffer(root.recv_bare_blocking(FrameType.PARTIAL, 16), np.float32), x)
        worker.send_blocking(FrameType.ERROR, {"message": "boom"})
        with pytest.raises(LinkClosed, match="peer reported: boom"):
            root.recv_bare_blocking(FrameType.PARTIAL, 16)
        assert root.closed
        assert root.counters.received == worker.counters.sent > 0
    finally:
        root.close()
        worker.close()


def test_a_blocking_receive_gives_up_after_the_links_timeout_with_a_clear_reason():
    # the wait is bounded in the kernel (SO_RCVTIMEO), not by a poll before each call: measured by the clock
    a, b = tcp_pair()
    link, silent = Link(a, "worker", timeout=1.0), b
    link.trust()
    link.enter_blocking()
    try:
        t0 = time.monotonic()
        with pytest.raises(LinkClosed, match="link worker: no frame within 1 s"):
            link.recv_bare_blocking(FrameType.PARTIAL, 16)
        assert 0.9 <= time.monotonic() - t0 < 5
        assert link.closed
    finally:
        link.close()
        silent.close()


def test_a_link_back_in_asyncio_mode_has_no_kernel_timeout_left():
    a, b = tcp_pair()
    link = Link(a, "peer", timeout=2.5)
    try:
        link.enter_blocking()
        assert struct.unpack("ll", a.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16)) == (2, 500000)
        assert a.gettimeout() is None  # no Python-level poll before each call
        link.leave_blocking()
        assert struct.unpack("ll", a.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16)) == (0, 0)
        assert struct.unpack("ll", a.getsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, 16)) == (0, 0)
    finally:
        link.close()
        b.close()
