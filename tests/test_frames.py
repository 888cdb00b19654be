"""The frame codec: round trips over real sockets, and nothing but FrameError on bad bytes."""

from __future__ import annotations

import asyncio
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
    Frame,
    FrameDecoder,
    FrameError,
    FrameType,
    encode_frame,
    payload_to_array,
    read_frame,
    recv_frame,
    send_frame,
    tensor_header,
    write_frame,
)


def joined(parts) -> bytes:
    return b"".join(bytes(p) for p in parts)


def decode_all(data: bytes, max_frame: int = 2**20) -> list[Frame]:
    dec = FrameDecoder(max_frame)
    frames = dec.feed(data)
    dec.close()
    return frames


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
    head = joined(encode_frame(FrameType.PING, {"t": 1}, b"abc", flags=5))
    packed = msgpack.packb({"t": 1})
    assert head[:16] == struct.pack(">4sBBHII", b"ETP1", 1, FrameType.PING, 5, len(packed), 3)
    assert head[16:] == packed + b"abc"


def test_encoding_hands_back_the_tensor_buffer_itself_not_a_copy():
    arr = np.ones(1000, dtype=np.float32)
    parts = encode_frame(FrameType.PARTIAL, {}, arr)
    assert np.shares_memory(np.frombuffer(parts[-1], dtype=np.float32), arr)


def test_empty_payload_is_one_part_and_decodes_to_empty_bytes():
    parts = encode_frame(FrameType.BYE, {"why": "done"})
    assert len(parts) == 1
    [frame] = decode_all(joined(parts))
    assert frame.payload == b"" and frame.header == {"why": "done"}


def test_many_frames_fed_one_byte_at_a_time_come_out_in_order():
    data = b"".join(joined(encode_frame(FrameType.STEP, {"i": i}, bytes([i]) * i)) for i in range(20))
    dec = FrameDecoder()
    frames = [f for b in data for f in dec.feed(bytes([b]))]
    assert [f.header["i"] for f in frames] == list(range(20))
    assert [bytes(f.payload) for f in frames] == [bytes([i]) * i for i in range(20)]


def test_blocking_socketpair_receives_payload_into_the_callers_buffer_without_copy():
    a, b = socket.socketpair()
    with a, b:
        arr = np.random.default_rng(0).standard_normal(300_000).astype(np.float32)  # > socket buffer
        sender = threading.Thread(target=send_frame, args=(a, FrameType.PARTIAL, {"layer": 3}, arr))
        sender.start()
        into = bytearray(arr.nbytes + 100)
        frame = recv_frame(b, into=into)
        sender.join()
        got = frame.array()
        np.testing.assert_array_equal(got, arr)
        assert np.shares_memory(got, np.frombuffer(into, dtype=np.uint8))
        a.shutdown(socket.SHUT_WR)
        assert recv_frame(b) is None  # clean close between frames


def test_blocking_socket_closed_mid_frame_is_a_truncated_frame_error():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(joined(encode_frame(FrameType.STEP, {}, b"x" * 100))[:-10])
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(FrameError, match="truncated"):
            recv_frame(b)


@pytest.mark.asyncio
async def test_asyncio_streams_on_loopback_carry_frames_both_ways():
    got: list[Frame] = []

    async def handle(reader, writer):
        while (frame := await read_frame(reader)) is not None:
            got.append(frame)
            await write_frame(writer, FrameType.REDUCED, {"echo": frame.header["n"]}, frame.array() * 2)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for n in range(3):
            x = np.full((4, 8), n, dtype=np.float32)
            await write_frame(writer, FrameType.PARTIAL, {"n": n}, x)
            reply = await asyncio.wait_for(read_frame(reader), 5)
            assert reply.type is FrameType.REDUCED and reply.header["echo"] == n
            np.testing.assert_array_equal(reply.array(), x * 2)
        writer.close()
        await writer.wait_closed()
    assert len(got) == 3


@pytest.mark.asyncio
async def test_asyncio_reader_reports_truncation_and_clean_eof():
    reader = asyncio.StreamReader()
    reader.feed_data(joined(encode_frame(FrameType.PING, {}))[:10])
    reader.feed_eof()
    with pytest.raises(FrameError, match="truncated"):
        await read_frame(reader)
    empty = asyncio.StreamReader()
    empty.feed_eof()
    assert await read_frame(empty) is None


def test_oversize_frame_is_refused_from_the_prefix_alone():
    prefix = PREFIX.pack(MAGIC, 1, FrameType.STEP, 0, 10, 2**31)
    with pytest.raises(FrameError, match="oversize"):
        FrameDecoder(max_frame=2**20).feed(prefix)  # nothing beyond 16 bytes was needed


def test_oversize_frame_on_a_socket_is_refused_before_allocating(monkeypatch):
    import edgetp.net.frames as frames

    a, b = socket.socketpair()
    with a, b:
        a.sendall(PREFIX.pack(MAGIC, 1, FrameType.STEP, 0, 10, 3 * 2**30))
        allocations = []
        real = bytearray
        monkeypatch.setattr(frames, "bytearray", lambda n=0: allocations.append(n) or real(n), raising=False)
        with pytest.raises(FrameError, match="oversize"):
            recv_frame(b, max_frame=2**20)
        assert max(allocations) <= PREFIX.size


def test_encoder_refuses_to_build_an_oversize_frame():
    with pytest.raises(ValueError, match="too large"):
        encode_frame(FrameType.STEP, {}, b"x" * 1000, max_frame=100)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"XXXX" + joined(encode_frame(FrameType.PING, {}))[4:], "bad magic"),
        (PREFIX.pack(MAGIC, 9, 1, 0, 1, 0) + b"\x80", "unsupported protocol version"),
        (PREFIX.pack(MAGIC, 1, 200, 0, 1, 0) + b"\x80", "unknown frame type"),
        (PREFIX.pack(MAGIC, 1, 1, 0, 1, 0) + b"\xc1", "bad msgpack"),
        (PREFIX.pack(MAGIC, 1, 1, 0, 0, 0), "bad msgpack"),
        (PREFIX.pack(MAGIC, 1, 1, 0, 2, 0) + msgpack.packb([1]), "not a dict"),
        (PREFIX.pack(MAGIC, 1, 1, 0, 3, 0) + msgpack.packb({1: 2}), "bad msgpack"),
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


def test_a_failed_decoder_stays_failed():
    dec = FrameDecoder()
    with pytest.raises(FrameError):
        dec.feed(b"NOPE" + bytes(12))
    with pytest.raises(FrameError):
        dec.feed(joined(encode_frame(FrameType.PING, {})))


def _only_frame_errors(data: bytes) -> None:
    dec = FrameDecoder(max_frame=4096)
    try:
        for frame in dec.feed(data):
            assert isinstance(frame.type, FrameType) and isinstance(frame.header, dict)
        dec.close()
    except FrameError:
        pass


@settings(max_examples=500, deadline=1000)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_decode_or_raise_frame_error_only(data):
    _only_frame_errors(data)
    _only_frame_errors(MAGIC + bytes([1]) + data)  # get past the magic more often


valid_frames = st.builds(
    lambda t, h, p: joined(encode_frame(t, h, p)),
    st.sampled_from(list(FrameType)),
    st.dictionaries(st.text(max_size=5), st.integers(-(2**63), 2**64 - 1) | st.text(max_size=5) | st.binary(max_size=5), max_size=4),
    st.binary(max_size=64),
)


@settings(max_examples=500, deadline=1000)
@given(valid_frames, st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=4),
       st.integers(0, 10**6))
def test_mutated_or_truncated_frames_decode_or_raise_frame_error_only(data, flips, cut):
    buf = bytearray(data)
    for pos, value in flips:
        buf[pos % len(buf)] = value
    _only_frame_errors(bytes(buf))
    _only_frame_errors(bytes(buf[: cut % (len(buf) + 1)]))


@pytest.mark.asyncio
@settings(max_examples=200, deadline=2000)
@given(st.binary(max_size=200))
async def test_arbitrary_bytes_on_an_asyncio_stream_end_in_frame_error_or_eof(data):
    reader = asyncio.StreamReader()
    reader.feed_data(MAGIC + bytes([1]) + data)
    reader.feed_eof()
    try:
        async with asyncio.timeout(2):
            while await read_frame(reader, max_frame=4096) is not None:
                pass
    except FrameError:
        pass
