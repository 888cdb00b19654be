"""The all-reduce's compiled path (net/wire.py through Link.recv_values_blocking and
send_values_blocking) against the general frame codec: the very bytes of frames.encode_frame on
the wire, values read back from frames.send_frame's, and every failure named as the Python path
names it; sealed frames received by the compiled path and opened as the Python path opens them,
every attack refused with the same reason. The poll before each receive, by its rules. Real TCP
sockets on loopback; signals from a real interval timer."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from edgetp.net import link as link_mod
from edgetp.net import wire
from edgetp.net.frames import PREFIX, Cipher, FrameType, encode_frame, send_frame
from edgetp.net.link import SPIN_US, Link, LinkClosed, SpinError, forced_mode, spin_ns

KEY = bytes(range(32))


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as lst:
        b = socket.create_connection(lst.getsockname(), timeout=10)
        return lst.accept()[0], b


def blocking(sock: socket.socket, name: str, timeout: float = 10.0, keys: tuple[bytes, bytes] | None = None) -> Link:
    link = Link(sock, name, timeout=timeout)
    link.trust(keys)
    link.enter_blocking()
    return link


def raw(values: np.ndarray) -> bytes:
    """The payload of a sync frame: the f32 values' bytes alone (no dtype or shape: the plan fixes them)."""
    return np.ascontiguousarray(values, np.float32).tobytes()


def frame_bytes(ftype: FrameType, values: np.ndarray) -> bytes:
    return b"".join(bytes(p) for p in encode_frame(ftype, {}, raw(values)))


def read_all(sock: socket.socket, n: int) -> bytes:
    got = bytearray()
    while len(got) < n:
        chunk = sock.recv(n - len(got))
        assert chunk, "closed early"
        got += chunk
    return bytes(got)


@pytest.fixture
def peer():
    """make(timeout=10) -> a plain blocking Link named "worker" and the bare socket at its other end;
    every pair made is closed after the test."""
    made: list[tuple[Link, socket.socket]] = []

    def make(timeout: float = 10.0, keys: tuple[bytes, bytes] | None = None) -> tuple[Link, socket.socket]:
        a, b = tcp_pair()
        made.append((blocking(a, "worker", timeout, keys), b))
        return made[-1]

    yield make
    for link, b in made:
        link.close()
        b.close()


def test_the_bytes_sent_are_the_general_encoders_for_whole_arrays_and_column_slices(peer):
    link, b = peer()
    x = np.random.default_rng(0).standard_normal((3, 40)).astype(np.float32)
    for src in (x, x[:, 8:24], x[1:2]):
        link.send_values_blocking(FrameType.PARTIAL, src)
        want = frame_bytes(FrameType.PARTIAL, src)
        assert read_all(b, len(want)) == want
    assert link.counters.sent == sum(len(frame_bytes(FrameType.PARTIAL, s)) for s in (x, x[:, 8:24], x[1:2]))


def test_values_from_the_general_encoder_are_added_or_written_exactly_and_nothing_else_moves(peer):
    link, b = peer()
    rng = np.random.default_rng(1)
    dst = rng.standard_normal((2, 64)).astype(np.float32)
    before = dst.copy()
    part = rng.standard_normal((2, 16)).astype(np.float32)
    send_frame(b, FrameType.PARTIAL, {}, raw(part))
    link.recv_values_blocking(FrameType.PARTIAL, dst[:, 16:32], add=True)
    want = before.copy()
    want[:, 16:32] += part  # numpy's f32 add: the bits every node must get
    np.testing.assert_array_equal(dst.view(np.uint32), want.view(np.uint32))
    send_frame(b, FrameType.REDUCED, {}, raw(part[:1]))
    link.recv_values_blocking(FrameType.REDUCED, dst[1:2, :16], add=False)
    want[1, :16] = part[0]
    np.testing.assert_array_equal(dst.view(np.uint32), want.view(np.uint32))
    assert link.counters.received == len(frame_bytes(FrameType.PARTIAL, part)) + len(frame_bytes(FrameType.REDUCED, part[:1]))


@pytest.fixture(params=["compiled", "python"])
def sealing(request, monkeypatch):
    """Sealed all-reduce frames sealed and opened by the compiled path (net/aead.py), or by Python
    (EDGETP_AEAD=0: frames.Cipher, as where no libcrypto is found); links made after it take it."""
    monkeypatch.setenv("EDGETP_AEAD", "1" if request.param == "compiled" else "0")
    if request.param == "compiled" and not link_mod.sealing_available():
        pytest.skip("no libcrypto with ChaCha20-Poly1305 here: sealed frames take the Python way")
    return request.param


@pytest.mark.parametrize("sealed", [False, True])
def test_two_links_exchange_round_after_round_sealed_or_not(sealed, sealing):
    a, b = tcp_pair()
    root = blocking(a, "worker", keys=(KEY, KEY[::-1]) if sealed else None)
    worker = blocking(b, "root", keys=(KEY[::-1], KEY) if sealed else None)
    try:
        total = np.zeros((1, 32), np.float32)
        for k in range(5):
            mine = np.full((1, 32), k, np.float32)
            worker.send_values_blocking(FrameType.PARTIAL, mine + 1)
            root.recv_values_blocking(FrameType.PARTIAL, total, add=True)
            root.send_values_blocking(FrameType.REDUCED, total)
            worker.recv_values_blocking(FrameType.REDUCED, mine, add=False)
            np.testing.assert_array_equal(mine, total)
        assert total[0, 0] == sum(range(1, 6))
        assert root.counters.received == worker.counters.sent and worker.counters.received == root.counters.sent
    finally:
        root.close()
        worker.close()


def test_a_peers_error_in_place_of_the_frame_is_reported_and_the_link_closed(peer):
    link, b = peer()
    send_frame(b, FrameType.ERROR, {"message": "boom"})
    with pytest.raises(LinkClosed, match="link worker: peer reported: boom"):
        link.recv_values_blocking(FrameType.PARTIAL, np.zeros((1, 8), np.float32), add=True)
    assert link.closed


def test_a_frame_of_another_size_or_header_is_refused_as_a_protocol_error(peer):
    for send, reason in ((lambda s: send_frame(s, FrameType.PARTIAL, {}, raw(np.zeros(4))), "protocol error"),
                         (lambda s: send_frame(s, FrameType.PARTIAL, {"x": 1}, raw(np.zeros(8))), "protocol error"),
                         (lambda s: send_frame(s, FrameType.REDUCED, {}, raw(np.zeros(8))), "expected PARTIAL, got REDUCED")):
        link, b = peer()
        send(b)
        with pytest.raises(LinkClosed, match=reason):
            link.recv_values_blocking(FrameType.PARTIAL, np.zeros((1, 8), np.float32), add=True)


def test_a_peer_that_closes_before_or_inside_a_frame_is_named_for_each(peer):
    whole = frame_bytes(FrameType.PARTIAL, np.zeros((1, 8), np.float32))
    for sent, reason in ((b"", "connection closed by peer"), (whole[:PREFIX.size + 5], "truncated")):
        link, b = peer()
        b.sendall(sent)
        b.close()
        with pytest.raises(LinkClosed, match=reason):
            link.recv_values_blocking(FrameType.PARTIAL, np.zeros((1, 8), np.float32), add=True)


def test_a_receive_gives_up_after_the_links_timeout(peer):
    link, b = peer(1.0)
    t0 = time.monotonic()
    with pytest.raises(LinkClosed, match="link worker: no frame within 1 s"):
        link.recv_values_blocking(FrameType.PARTIAL, np.zeros((1, 8), np.float32), add=True)
    assert 0.9 <= time.monotonic() - t0 < 5


def _interrupted(run, then, delay: float = 0.4):
    """run() on this (the main) thread while SIGALRM fires every 50 ms (a Python handler counting),
    then() on another thread after `delay` s; run()'s result and the signals handled meanwhile."""
    seen = []
    old = signal.signal(signal.SIGALRM, lambda *_: seen.append(1))

    def later():
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})  # the signals are for the blocked call
        time.sleep(delay)
        then()

    helper = threading.Thread(target=later)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05, 0.05)
        helper.start()
        result = run()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, old)
        helper.join(10)
    return result, len(seen)


@pytest.mark.parametrize("sealed", [False, True])
def test_signals_while_blocked_in_a_receive_run_their_handlers_and_the_frame_still_arrives(peer, sealed):
    link, b = peer(keys=(KEY, KEY[::-1]) if sealed else None)
    part = np.arange(16, dtype=np.float32).reshape(1, 16)
    dst = np.ones((1, 16), np.float32)
    whole = _sealed_bytes(Cipher(KEY[::-1]), FrameType.PARTIAL, {}, raw(part)) if sealed else \
        frame_bytes(FrameType.PARTIAL, part)

    def two_halves():
        b.sendall(whole[:10])  # the prefix itself comes in two pieces, signals between
        time.sleep(0.2)
        b.sendall(whole[10:])

    _, handled = _interrupted(lambda: link.recv_values_blocking(FrameType.PARTIAL, dst, add=True), two_halves)
    np.testing.assert_array_equal(dst, part + 1)
    assert handled >= 4


@pytest.mark.parametrize("sealed", [False, True])
def test_signals_while_blocked_in_a_send_run_their_handlers_and_every_byte_goes_once(peer, sealed):
    link, b = peer(keys=(KEY, KEY[::-1]) if sealed else None)
    link.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)
    src = np.random.default_rng(2).standard_normal((1, 2_000_000)).astype(np.float32)  # 8 MB: the send blocks
    want = _sealed_bytes(Cipher(KEY), FrameType.REDUCED, {}, raw(src)) if sealed else frame_bytes(FrameType.REDUCED, src)
    got: list[bytes] = []
    # sealing 8 MB first takes ~0.2 s under qemu, with no system call for a signal to interrupt
    _, handled = _interrupted(lambda: link.send_values_blocking(FrameType.REDUCED, src),
                              lambda: got.append(read_all(b, len(want))), 1.0 if sealed else 0.4)
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    assert got and got[0] == want
    assert handled >= 4


def test_q8_0_frames_decode_as_gguf_py_decodes_the_blocks_and_encoded_bytes_go_as_they_are(peer):
    import gguf  # noqa: PLC0415  (the reference decoder of GGUF blocks)
    from gguf import GGMLQuantizationType as QT  # noqa: PLC0415

    link, b = peer()
    x = np.random.default_rng(3).standard_normal(96).astype(np.float32)
    blocks = gguf.quants.quantize(x.reshape(1, -1), QT.Q8_0).reshape(-1)
    values = gguf.quants.dequantize(blocks, QT.Q8_0).reshape(-1).astype(np.float32)
    dst = np.ones(96, np.float32)
    send_frame(b, FrameType.REDUCED, {}, blocks.tobytes())
    link.recv_q8_blocking(FrameType.REDUCED, dst, add=True)
    np.testing.assert_array_equal(dst.view(np.uint32), (values + np.float32(1)).view(np.uint32))
    send_frame(b, FrameType.REDUCED, {}, blocks.tobytes())
    link.recv_q8_blocking(FrameType.REDUCED, dst, add=False)
    np.testing.assert_array_equal(dst.view(np.uint32), values.view(np.uint32))
    link.send_bytes_blocking(FrameType.PARTIAL, memoryview(blocks).cast("B"))
    want = b"".join(bytes(p) for p in encode_frame(FrameType.PARTIAL, {}, blocks.tobytes()))
    assert read_all(b, len(want)) == want


# ---------------------------------------------------------------- polling before the kernel's wait


@pytest.fixture
def spin(monkeypatch):
    """spin(us): receives poll for `us` µs from now on (EDGETP_SPIN_US), with no quiet period pending."""

    def set_to(us: int) -> None:
        monkeypatch.setenv("EDGETP_SPIN_US", str(us))
        spin_ns.cache_clear()
        link_mod._TUNE[1] = 0

    yield set_to
    spin_ns.cache_clear()
    link_mod._TUNE[1] = 0


def _received_after(delay: float, sealed: bool) -> tuple[np.ndarray, float, float]:
    """A PARTIAL sent `delay` s after the receive starts: the values taken, the receiving thread's CPU
    seconds and the wall seconds of the receive."""
    a, b = tcp_pair()
    keys = (KEY, KEY[::-1]) if sealed else None
    link, peer_link = blocking(a, "worker", keys=keys), blocking(b, "root", keys=keys[::-1] if keys else None)
    part = np.arange(32, dtype=np.float32).reshape(1, 32)
    dst = np.zeros((1, 32), np.float32)
    sender = threading.Timer(delay, peer_link.send_values_blocking, (FrameType.PARTIAL, part))
    try:
        c0, t0 = time.thread_time(), time.monotonic()
        sender.start()
        link.recv_values_blocking(FrameType.PARTIAL, dst, add=True)
        return dst - part, time.thread_time() - c0, time.monotonic() - t0
    finally:
        sender.join(10)
        link.close()
        peer_link.close()


def test_the_setting_is_read_and_checked_as_the_commands_check_it():
    assert spin_ns("") == SPIN_US * 1000 and spin_ns("0") == 0 and spin_ns(" 350 ") == 350_000
    for bad in ("abc", "-1", "1000001", "2.5"):
        with pytest.raises(SpinError, match=f"EDGETP_SPIN_US must be a whole number of microseconds from 0 to 1000000, got '{bad}'"):
            spin_ns(bad)


def test_the_link_mode_switch_is_blocking_asyncio_or_unset():
    assert forced_mode("") is None and forced_mode("blocking") == "blocking" and forced_mode(" AsyncIO ") == "asyncio"
    for bad in ("fast", "block", "1"):
        with pytest.raises(SpinError, match=f"EDGETP_LINK_MODE must be blocking or asyncio, got '{bad}'"):
            forced_mode(bad)


@pytest.mark.parametrize("sealed", [False, True])
def test_a_receive_polls_while_the_frame_is_on_its_way_and_waits_in_the_kernel_without_polling(spin, sealed):
    # a polling thread keeps its core (its CPU time grows with the wait) unless it finds it lost the
    # core to another thread (a busy machine), which it records; waiting in the kernel costs none.
    # Either way the frame comes whole.
    spin(1_000_000)
    off, cpu, wall = _received_after(0.3, sealed)
    assert not off.any() and wall >= 0.25
    assert cpu >= 0.02 or link_mod._TUNE[1] > 0, f"{cpu:.4f} s of CPU in a 0.3 s wait, and no lost core seen"
    spin(0)
    off, cpu, wall = _received_after(0.3, sealed)
    assert not off.any() and wall >= 0.25
    assert cpu < 0.02, f"{cpu:.4f} s of CPU in a 0.3 s wait: the receive polled"


@pytest.mark.parametrize("sealed", [False, True])
def test_polling_stops_after_its_time_and_the_frame_still_comes_from_the_kernels_wait(spin, sealed):
    spin(30_000)  # 30 ms, then the kernel's wait for the rest of 0.5 s
    off, cpu, wall = _received_after(0.5, sealed)
    assert not off.any() and wall >= 0.45
    assert cpu < 0.2, f"{cpu:.4f} s of CPU in a 0.5 s wait: polling went on past its 30 ms"


def test_a_poll_returns_at_once_when_bytes_wait_when_off_or_while_quiet_and_takes_nothing(peer):
    link, b = peer()
    fd, byte = link.sock.fileno(), np.zeros(1, np.uint8)
    wire.poll(fd, byte, np.array([0, 0], np.int64))  # compiled (or loaded) before anything is timed
    for tune in (np.array([0, 0], np.int64), np.array([10**9, time.monotonic_ns() + 10**10], np.int64)):
        t0 = time.monotonic()
        wire.poll(fd, byte, tune)  # nothing to read: off, or quiet for 10 s more
        assert time.monotonic() - t0 < 0.5
    b.sendall(b"abc")
    time.sleep(0.05)
    tune = np.array([10**9, 0], np.int64)
    t0 = time.monotonic()
    wire.poll(fd, byte, tune)
    assert time.monotonic() - t0 < 0.5 and tune[1] == 0
    assert link.sock.recv(3) == b"abc"  # peeked, not taken


def test_a_poll_with_nothing_to_read_lasts_its_time_unless_it_lost_its_core(peer):
    link, _ = peer()
    wire.poll(link.sock.fileno(), np.zeros(1, np.uint8), np.array([0, 0], np.int64))  # compiled before timing
    tune = np.array([50_000_000, 0], np.int64)  # 50 ms
    t0 = time.monotonic()
    wire.poll(link.sock.fileno(), np.zeros(1, np.uint8), tune)
    took = time.monotonic() - t0
    assert took >= 0.045 or tune[1] > time.monotonic_ns(), f"gave up after {took:.4f} s with no lost core seen"


OFF_CORE = """
import socket, sys, time
import numpy as np
from edgetp.net import wire
a, b = socket.socketpair()
wire.poll(a.fileno(), np.zeros(1, np.uint8), np.array([0, 0], np.int64))  # compiled (or loaded) first
tune = np.array([5_000_000_000, 0], np.int64)  # poll for up to 5 s
print("polling", flush=True)
t0 = time.monotonic()
wire.poll(a.fileno(), np.zeros(1, np.uint8), tune)
took = time.monotonic() - t0
quiet_left = (int(tune[1]) - time.monotonic_ns()) / 1e9
t1 = time.monotonic()
wire.poll(a.fileno(), np.zeros(1, np.uint8), tune)
print(took, quiet_left, time.monotonic() - t1, flush=True)
"""


def test_a_poll_that_loses_its_core_stops_and_the_next_waits_at_once():
    # the poller is stopped for 50 ms (SIGSTOP: off every core, as when another thread takes its
    # core for a time slice): it must see the gap, give up, and not poll again for a while
    proc = subprocess.Popen([sys.executable, "-c", OFF_CORE], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "polling"
        time.sleep(0.3)
        proc.send_signal(signal.SIGSTOP)
        time.sleep(0.05)
        proc.send_signal(signal.SIGCONT)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    took, quiet_left, again = map(float, out.split())
    assert took < 4.0, f"polled {took:.3f} s though it lost its core after 0.3 s"
    assert 0 < quiet_left <= wire.QUIET_NS / 1e9 and again < 0.01


def test_a_receive_that_polls_still_gives_up_after_the_links_timeout(spin, peer):
    spin(200_000)
    link, b = peer(1.0)
    t0 = time.monotonic()
    with pytest.raises(LinkClosed, match="link worker: no frame within 1 s"):
        link.recv_values_blocking(FrameType.PARTIAL, np.zeros((1, 8), np.float32), add=True)
    assert 0.9 <= time.monotonic() - t0 < 5


# ---------------------------------------------------------------- sealed frames: received compiled, opened in Python


def _sealed_bytes(cipher: Cipher, ftype: FrameType, header: dict, payload: bytes) -> bytes:
    return b"".join(bytes(p) for p in encode_frame(ftype, header, payload, cipher=cipher))


def _sealed_peer() -> tuple[Link, socket.socket, Cipher]:
    a, b = tcp_pair()
    return blocking(a, "worker", keys=(KEY, KEY[::-1])), b, Cipher(KEY[::-1])  # the cipher the peer seals with


@pytest.mark.parametrize("q8", [False, True])
def test_sealed_all_reduce_frames_open_to_the_values_sent_in_order(q8, sealing):
    link, b, tx = _sealed_peer()
    try:
        rng = np.random.default_rng(3)
        for k in range(3):
            x = rng.standard_normal(64).astype(np.float32)
            payload = quantize(x.reshape(-1, 32), GGMLQuantizationType.Q8_0).tobytes() if q8 else raw(x)
            b.sendall(_sealed_bytes(tx, FrameType.REDUCED, {}, payload))
            dst = np.ones(64, np.float32) if q8 else np.ones((1, 64), np.float32)
            if q8:
                link.recv_q8_blocking(FrameType.REDUCED, dst, add=True)
                want = 1 + dequantize(np.frombuffer(payload, np.uint8), GGMLQuantizationType.Q8_0).reshape(-1)
            else:
                link.recv_values_blocking(FrameType.REDUCED, dst, add=True)
                want = 1 + x.reshape(1, 64)
            np.testing.assert_array_equal(dst, want)
        assert link.counters.received == 3 * len(_sealed_bytes(Cipher(KEY), FrameType.REDUCED, {}, payload))
    finally:
        link.close()
        b.close()


@pytest.mark.parametrize("attack", ["altered", "replayed", "unsealed", "error", "other size"])
def test_a_sealed_all_reduce_frame_altered_replayed_unsealed_or_refused_closes_the_link_with_the_reason(attack,
                                                                                                      sealing):
    link, b, tx = _sealed_peer()
    good = _sealed_bytes(tx, FrameType.REDUCED, {}, raw(np.arange(64, dtype=np.float32)))
    data, reason = {
        "altered": (good[:30] + bytes([good[30] ^ 1]) + good[31:], "frame 0 failed authentication"),
        "replayed": (good + good, "frame 1 failed authentication"),
        "unsealed": (frame_bytes(FrameType.REDUCED, np.zeros((1, 64), np.float32)), "unsealed frame on a sealed link"),
        "error": (_sealed_bytes(Cipher(KEY[::-1]), FrameType.ERROR, {"message": "boom"}, b""), "peer reported: boom"),
        "other size": (_sealed_bytes(Cipher(KEY[::-1]), FrameType.REDUCED, {}, raw(np.zeros(8))), "protocol error"),
    }[attack]
    try:
        b.sendall(data)
        dst = np.zeros((1, 64), np.float32)
        with pytest.raises(LinkClosed, match=reason):
            for _ in range(2):
                link.recv_values_blocking(FrameType.REDUCED, dst, add=False)
        assert link.closed
    finally:
        link.close()
        b.close()


@pytest.mark.parametrize("sealed", [False, True])
def test_frames_sent_by_the_compiled_path_are_the_general_encoders_bytes_sealed_or_not(sealed, sealing):
    # f32 values, bytes already encoded and Q8_0 blocks quantized in the call, with general frames
    # (sealed by frames.Cipher in Python) between them: one stream of numbers in each direction
    import gguf  # noqa: PLC0415  (the reference codec of GGUF blocks)
    from gguf import GGMLQuantizationType as QT  # noqa: PLC0415

    a, b = tcp_pair()
    link = blocking(a, "worker", keys=(KEY, KEY[::-1]) if sealed else None)
    ref = Cipher(KEY) if sealed else None  # what the peer's frames.Cipher expects, frame after frame
    total = 0  # bytes of every frame sent
    try:
        x = np.random.default_rng(5).standard_normal((2, 64)).astype(np.float32)
        blocks = gguf.quants.quantize(x.reshape(1, -1), QT.Q8_0).reshape(-1)
        values = gguf.quants.dequantize(blocks, QT.Q8_0).reshape(x.shape).astype(np.float32)
        for k in range(3):
            link.send_values_blocking(FrameType.PARTIAL, x[:, ::2])  # a column slice
            want = b"".join(bytes(p) for p in encode_frame(FrameType.PARTIAL, {}, raw(x[:, ::2]), cipher=ref))
            assert read_all(b, len(want)) == want
            link.send_blocking(FrameType.PING, {"k": k})
            ping = b"".join(bytes(p) for p in encode_frame(FrameType.PING, {"k": k}, cipher=ref))
            assert read_all(b, len(ping)) == ping
            link.send_bytes_blocking(FrameType.REDUCED, memoryview(blocks).cast("B"))
            q8 = b"".join(bytes(p) for p in encode_frame(FrameType.REDUCED, {}, blocks.tobytes(), cipher=ref))
            assert read_all(b, len(q8)) == q8
            total += len(want) + len(ping) + len(q8)
            for back in (False, True):
                y = x.copy()
                link.send_q8_blocking(FrameType.PARTIAL, y.reshape(-1), back=back)
                want = b"".join(bytes(p) for p in encode_frame(FrameType.PARTIAL, {}, blocks.tobytes(), cipher=ref))
                assert read_all(b, len(want)) == want
                total += len(want)
                np.testing.assert_array_equal(y.view(np.uint32), (values if back else x).view(np.uint32))
        assert link.counters.sent == total
        python_way = link._wire[(FrameType.PARTIAL, 4 * 64)] is link_mod._SEALED  # frames.Cipher's, not aead's
        assert python_way == (sealed and sealing == "python")
    finally:
        link.close()
        b.close()


CLOCK_LOOP = """
import time
from numba import njit
from edgetp.net import wire

@njit(cache=False)
def last_of(n):
    t = 0
    for _ in range(n):
        t = wire._now_ns()
    return t

before = time.monotonic_ns()
got = last_of(3_000_000)
after = time.monotonic_ns()
print(before <= got <= after)
"""


def test_the_compiled_clock_is_the_monotonic_clock_and_reading_it_in_a_loop_keeps_the_stack_flat():
    # 3 million reads in one compiled loop: each took a new 16-byte stack slot until 29 Nov, 48 MB,
    # far past a thread's 8 MB stack (the delaying relay's waits crashed on it). Its own process:
    # a crash is a failure here, not pytest's end
    out = subprocess.run([sys.executable, "-c", CLOCK_LOOP], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True"]
