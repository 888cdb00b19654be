"""The frame codec: round trips over real sockets (plain and sealed), and nothing but FrameError on bad bytes."""

from __future__ import annotations

import socket
import struct
import threading

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgetp.net.frames import (
    MAGIC,
    PREFIX,
    PROTOCOL_VERSION,
    SEALED,
    Cipher,
    Frame,
    FrameError,
    FrameType,
    encode_frame,
    payload_to_array,
    recv_frame,
    send_frame,
    tensor_header,
)

V = PROTOCOL_VERSION


def joined(parts) -> bytes:
    return b"".join(bytes(p) for p in parts)


def decode_all(data: bytes, max_frame: int = 2**20, cipher: Cipher | None = None) -> list[Frame]:
    """Every frame in `data`, received the production way: recv_frame on a real socket."""
    a, b = socket.socketpair()
    with a, b:
        sender = threading.Thread(target=lambda: (a.sendall(data), a.shutdown(socket.SHUT_WR)))
        sender.start()
        try:
            frames = []
            for _ in range(len(data) + 1):  # a frame takes 16 bytes at least
                frame, _ = recv_frame(b, None, max_frame, cipher)
                if frame is None:
                    return frames
                frames.append(Frame(frame.type, frame.header, bytes(frame.payload), frame.flags, frame.size))
            raise AssertionError("more frames than bytes")
        finally:
            b.shutdown(socket.SHUT_RD)
            sender.join(10)


@pytest.mark.parametrize("ftype", list(FrameType))
@pytest.mark.parametrize("dtype", ["float32", "uint8"])
def test_every_frame_type_round_trips_with_a_tensor_payload(ftype, dtype):
    arr = (np.arange(24) * 3).astype(dtype).reshape(2, 3, 4)
    wire = joined(encode_frame(ftype, {"step": 7, "layer": "x"}, arr))
    [frame] = decode_all(wire)
    assert frame.type is ftype and frame.size == len(wire)
    assert frame.header["step"] == 7 and frame.header["layer"] == "x"
    np.testing.assert_array_equal(frame.array(), arr)
    assert frame.array().dtype == np.dtype(dtype)


def test_prefix_layout_is_magic_version_type_flags_and_two_lengths():
    head = joined(encode_frame(FrameType.PING, {"t": 1}, b"abc", flags=5))  # a plain frame drops SEALED
    packed = msgpack.packb({"t": 1})
    assert head[:16] == struct.pack(">4sBBHII", b"ETP1", 3, FrameType.PING, 4, len(packed), 3)  # bit 0 is SEALED
    assert head[16:] == packed + b"abc"


def test_encoding_hands_back_the_tensor_buffer_itself_not_a_copy():
    arr = np.ones(1000, dtype=np.float32)
    parts = encode_frame(FrameType.PARTIAL, {}, arr)
    assert np.shares_memory(np.frombuffer(parts[-1], dtype=np.float32), arr)


def test_empty_payload_is_one_part_and_decodes_to_empty_bytes():
    parts = encode_frame(FrameType.ERROR, {"why": "done"})
    assert len(parts) == 1
    [frame] = decode_all(joined(parts))
    assert frame.payload == b"" and frame.header == {"why": "done"}


def test_many_frames_sent_one_byte_at_a_time_come_out_in_order():
    data = b"".join(joined(encode_frame(FrameType.STEP, {"i": i}, bytes([i]) * i)) for i in range(20))
    a, b = socket.socketpair()
    with a, b:
        def trickle() -> None:
            for i in range(len(data)):
                a.send(data[i:i + 1])

        sender = threading.Thread(target=trickle)
        sender.start()
        frames = []
        for _ in range(20):
            frame, _ = recv_frame(b)
            frames.append((frame.header["i"], bytes(frame.payload)))
        sender.join(10)
    assert frames == [(i, bytes([i]) * i) for i in range(20)]


KEY_A, KEY_B = bytes(range(32)), bytes(range(32, 64))


def test_sealed_frames_round_trip_and_cost_a_16_byte_tag_each():
    arr = np.arange(600, dtype=np.float32)
    tx = Cipher(KEY_A)
    wire = b"".join(joined(encode_frame(FrameType.PARTIAL, {"i": i}, arr, cipher=tx)) for i in range(3))
    plain = joined(encode_frame(FrameType.PARTIAL, {"i": 0}, arr))
    assert len(wire) == 3 * (len(plain) + 16)
    assert arr.tobytes() not in wire  # encrypted, not just signed
    frames = decode_all(wire, cipher=Cipher(KEY_A))
    assert [f.header["i"] for f in frames] == [0, 1, 2] and all(f.flags & SEALED for f in frames)
    np.testing.assert_array_equal(frames[2].array(), arr)


def _sealed(n: int) -> list[bytes]:
    tx = Cipher(KEY_A)
    return [joined(encode_frame(FrameType.STEP, {"i": i}, bytes([i]) * 40, cipher=tx)) for i in range(n)]


@pytest.mark.parametrize("attack", ["replay", "reorder", "drop", "flip_body", "flip_type", "wrong_key", "plain"])
def test_a_sealed_stream_refuses_replayed_reordered_dropped_altered_or_injected_frames(attack):
    f = _sealed(3)
    if attack == "replay":
        data = f[0] + f[0]
    elif attack == "reorder":
        data = f[1] + f[0]
    elif attack == "drop":
        data = f[0] + f[2]
    elif attack == "flip_body":
        data = f[0] + f[1][:30] + bytes([f[1][30] ^ 1]) + f[1][31:]
    elif attack == "flip_type":  # the prefix is authenticated: a STEP turned into a LOAD does not open
        data = f[0] + f[1][:5] + bytes([FrameType.LOAD]) + f[1][6:]
    elif attack == "wrong_key":
        data = joined(encode_frame(FrameType.STEP, {}, b"x", cipher=Cipher(KEY_B)))
    else:
        data = f[0] + joined(encode_frame(FrameType.STEP, {"i": 1}, b"x"))
    reason = "unsealed frame on a sealed link" if attack == "plain" else "failed authentication"
    with pytest.raises(FrameError, match=reason):
        decode_all(data, cipher=Cipher(KEY_A))


def test_a_sealed_frame_on_a_link_without_keys_is_refused():
    with pytest.raises(FrameError, match="sealed frame on a link without a session key"):
        decode_all(_sealed(1)[0])


def test_blocking_socketpair_receives_payload_into_the_callers_buffer_without_copy():
    a, b = socket.socketpair()
    with a, b:
        arr = np.random.default_rng(0).standard_normal(300_000).astype(np.float32)  # > socket buffer
        sender = threading.Thread(target=send_frame, args=(a, FrameType.PARTIAL, {"layer": 3}, arr))
        sender.start()
        into = bytearray(arr.nbytes + 100)
        frame, used = recv_frame(b, into=into)
        sender.join()
        assert used is into
        got = frame.array()
        np.testing.assert_array_equal(got, arr)
        assert np.shares_memory(got, np.frombuffer(into, dtype=np.uint8))
        a.shutdown(socket.SHUT_WR)
        assert recv_frame(b) == (None, None)  # clean close between frames


def test_blocking_socket_closed_mid_frame_is_a_truncated_frame_error():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(joined(encode_frame(FrameType.STEP, {}, b"x" * 100))[:-10])
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(FrameError, match="truncated"):
            recv_frame(b)


def test_oversize_frame_is_refused_from_the_prefix_alone():
    prefix = PREFIX.pack(MAGIC, V, FrameType.STEP, 0, 10, 2**31)
    with pytest.raises(FrameError, match="oversize"):
        decode_all(prefix)  # nothing beyond 16 bytes was needed


def test_oversize_frame_on_a_socket_is_refused_before_allocating(monkeypatch):
    import edgetp.net.frames as frames

    a, b = socket.socketpair()
    with a, b:
        a.sendall(PREFIX.pack(MAGIC, V, FrameType.STEP, 0, 10, 3 * 2**30))
        allocations = []
        real = bytearray
        monkeypatch.setattr(frames, "bytearray", lambda n=0: allocations.append(n) or real(n), raising=False)
        with pytest.raises(FrameError, match="oversize"):
            recv_frame(b, max_frame=2**20)
        assert max(allocations) <= PREFIX.size


def test_a_payload_buffer_grows_with_the_bytes_that_arrive_not_with_the_announced_size():
    import tracemalloc

    a, b = socket.socketpair()
    with a, b:
        data = PREFIX.pack(MAGIC, V, FrameType.STEP, 0, 1, 50 * 2**20) + msgpack.packb({}) + bytes(100_000)
        sender = threading.Thread(target=lambda: (a.sendall(data), a.shutdown(socket.SHUT_WR)))
        sender.start()  # 50 MiB announced, 100 kB sent
        tracemalloc.start()
        try:
            with pytest.raises(FrameError, match="truncated"):
                recv_frame(b, max_frame=64 * 2**20)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
            sender.join(10)
    assert peak < 1_000_000, f"{peak} bytes allocated for 100 kB received"


def test_encoder_refuses_to_build_an_oversize_frame():
    with pytest.raises(ValueError, match="too large"):
        encode_frame(FrameType.STEP, {}, b"x" * 1000, max_frame=100)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"XXXX" + joined(encode_frame(FrameType.PING, {}))[4:], "bad magic"),
        (PREFIX.pack(MAGIC, 9, 1, 0, 1, 0) + b"\x80", "unsupported protocol version"),
        (PREFIX.pack(MAGIC, V, 200, 0, 1, 0) + b"\x80", "unknown frame type"),
        (PREFIX.pack(MAGIC, V, 5, 0, 1, 0) + b"\x80", "unknown frame type 5"),  # PLAN, never sent, is gone
        (PREFIX.pack(MAGIC, V, 1, 0, 1, 0) + b"\xc1", "bad msgpack"),
        (PREFIX.pack(MAGIC, V, 1, 0, 0, 0), "bad msgpack"),
        (PREFIX.pack(MAGIC, V, 1, 0, 2, 0) + msgpack.packb([1]), "not a dict"),
        (PREFIX.pack(MAGIC, V, 1, 0, 3, 0) + msgpack.packb({1: 2}), "bad msgpack"),
        (joined(encode_frame(FrameType.PING, {}))[:-1], "truncated"),
    ],
)
def test_each_kind_of_bad_frame_gives_its_reason(data, reason):
    with pytest.raises(FrameError, match=reason):
        decode_all(data)


def test_payload_not_matching_dtype_and_shape_is_a_frame_error():
    with pytest.raises(FrameError, match="needs 16"):
        payload_to_array({"dtype": "float32", "shape": [2, 2]}, b"x" * 15)
    with pytest.raises(FrameError, match="dtype"):
        payload_to_array({"dtype": "object", "shape": [1]}, b"x" * 8)
    with pytest.raises(FrameError, match="shape"):
        payload_to_array({"dtype": "uint8", "shape": [-1]}, b"x")
    with pytest.raises(FrameError, match="shape"):
        payload_to_array({"dtype": "uint8"}, b"x")


def test_tensor_header_names_dtype_and_shape_and_refuses_objects():
    assert tensor_header(np.zeros((3, 5), np.float32)) == {"dtype": "float32", "shape": [3, 5]}
    with pytest.raises(ValueError):
        tensor_header(np.array([object()]))


def _only_frame_errors(data: bytes) -> None:
    try:
        for frame in decode_all(data, max_frame=4096):
            assert isinstance(frame.type, FrameType) and isinstance(frame.header, dict)
    except FrameError:
        pass


@settings(max_examples=500)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_decode_or_raise_frame_error_only(data):
    _only_frame_errors(data)
    _only_frame_errors(MAGIC + bytes([V]) + data)  # get past the magic more often


valid_frames = st.builds(
    lambda t, h, p: joined(encode_frame(t, h, p)),
    st.sampled_from(list(FrameType)),
    st.dictionaries(st.text(max_size=5), st.integers(-(2**63), 2**64 - 1) | st.text(max_size=5) | st.binary(max_size=5), max_size=4),
    st.binary(max_size=64),
)


@settings(max_examples=500)
@given(valid_frames, st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=4),
       st.integers(0, 10**6))
def test_mutated_or_truncated_frames_decode_or_raise_frame_error_only(data, flips, cut):
    buf = bytearray(data)
    for pos, value in flips:
        buf[pos % len(buf)] = value
    _only_frame_errors(bytes(buf))
    _only_frame_errors(bytes(buf[: cut % (len(buf) + 1)]))


@settings(max_examples=200)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_on_a_sealed_link_end_in_frame_error_or_eof(data):
    try:
        decode_all(MAGIC + bytes([V]) + data, max_frame=4096, cipher=Cipher(KEY_A))
    except FrameError:
        pass
