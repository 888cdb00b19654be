"""The frame codec: one place for every byte on the wire.

A frame is a fixed 16-byte prefix, a msgpack header (always a dict), then a
raw payload (tensor bytes, never re-encoded):

    magic   4s   b"ETP1"
    version u8   PROTOCOL_VERSION
    type    u8   FrameType
    flags   u16  reserved, carried through
    hlen    u32  msgpack header bytes
    plen    u32  payload bytes

Sizes are checked against the bounds before a byte of buffer is allocated.
Encoding returns a gather list so `sendmsg`/`writelines` send the tensor's
own buffer; decoding receives the payload straight into one bytearray that
`payload_to_array` wraps with `np.frombuffer`, without another copy. Every
decode problem is a `FrameError` with a reason; the link closes, the
process lives on.
"""

from __future__ import annotations

import asyncio
import enum
import socket
import struct
from dataclasses import dataclass, field
from typing import Any, Union

import msgpack
import numpy as np

MAGIC = b"ETP1"
PROTOCOL_VERSION = 1
PREFIX = struct.Struct("!4sBBHII")
MAX_FRAME = 64 * 2**20  # header + payload, default bound
MAX_HEADER = 64 * 2**10
TENSOR_DTYPES = ("float32", "float16", "uint8", "int8", "int32", "int64")

Buffer = Union[bytes, bytearray, memoryview]


class FrameError(Exception):
    """A frame that cannot be decoded; the reason says why."""


class FrameType(enum.IntEnum):
    HELLO = 1
    CHALLENGE = 2
    AUTH = 3
    AUTH_OK = 4
    PLAN = 5
    LOAD = 6
    READY = 7
    STEP = 8
    PARTIAL = 9
    REDUCED = 10
    LOGITS = 11
    RESET = 12
    PING = 13
    PONG = 14
    ERROR = 15
    BYE = 16
    PROFILE = 17  # measure a node's speed (append new types; numbers never change)
    PROGRESS = 18  # a worker fetching its slice: bytes done and total


@dataclass(frozen=True)
class Frame:
    type: FrameType
    header: dict[str, Any]
    payload: Buffer = b""
    flags: int = field(default=0)
    size: int = field(default=0, compare=False)  # bytes on the wire, when it was received

    def array(self) -> np.ndarray:
        """The payload as the tensor the header describes (no copy)."""
        return payload_to_array(self.header, self.payload)


# --------------------------------------------------------------------------- tensors


def tensor_header(arr: np.ndarray) -> dict[str, Any]:
    """dtype and shape of a tensor, as they travel in a frame header."""
    dtype = np.dtype(arr.dtype)
    if dtype.name not in TENSOR_DTYPES:
        raise ValueError(f"dtype {dtype} cannot travel; allowed {TENSOR_DTYPES}")
    return {"dtype": dtype.name, "shape": list(arr.shape)}


def payload_to_array(header: dict[str, Any], payload: Buffer) -> np.ndarray:
    """Wrap a payload as the little-endian tensor its header names, without a copy."""
    name, shape = header.get("dtype"), header.get("shape")
    if name not in TENSOR_DTYPES:
        raise FrameError(f"unsupported tensor dtype {name!r}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape) or len(shape) > 8:
        raise FrameError(f"bad tensor shape {shape!r}")
    dtype = np.dtype(name).newbyteorder("<")
    count = 1
    for d in shape:
        count *= d
    if count * dtype.itemsize != len(payload):
        raise FrameError(f"payload is {len(payload)} bytes, {name}{shape} needs {count * dtype.itemsize}")
    return np.frombuffer(payload, dtype=dtype).reshape(shape)


def _payload_view(payload: Buffer | np.ndarray) -> Buffer:
    if isinstance(payload, np.ndarray):
        if payload.dtype.byteorder == ">":
            raise ValueError("big-endian arrays do not travel; convert to little-endian")
        return memoryview(np.ascontiguousarray(payload)).cast("B")
    if isinstance(payload, memoryview):
        return payload.cast("B") if payload.format != "B" or payload.ndim != 1 else payload
    return payload


# --------------------------------------------------------------------------- encoding


def encode_frame(ftype: FrameType, header: dict[str, Any] | None = None, payload: Buffer | np.ndarray = b"",
                 *, flags: int = 0, max_frame: int = MAX_FRAME) -> list[Buffer]:
    """prefix+header, then the payload buffer itself: a gather list for sendmsg/writelines.

    An ndarray payload gets its dtype and shape added to the header.
    """
    header = dict(header or {})
    if isinstance(payload, np.ndarray):
        header.update(tensor_header(payload))
    body = _payload_view(payload)
    packed = msgpack.packb(header, use_bin_type=True)
    if len(packed) > MAX_HEADER or len(packed) + len(body) > max_frame:
        raise ValueError(f"frame too large: header {len(packed)} + payload {len(body)} > {max_frame}")
    head = PREFIX.pack(MAGIC, PROTOCOL_VERSION, int(FrameType(ftype)), flags, len(packed), len(body)) + packed
    return [head, body] if len(body) else [head]


def parse_prefix(prefix: Buffer, max_frame: int = MAX_FRAME) -> tuple[FrameType, int, int, int]:
    """(type, flags, header_len, payload_len) from 16 bytes, checking every bound."""
    magic, version, ftype, flags, hlen, plen = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise FrameError(f"bad magic {bytes(magic)!r}")
    if version != PROTOCOL_VERSION:
        raise FrameError(f"unsupported protocol version {version} (this side speaks {PROTOCOL_VERSION})")
    try:
        kind = FrameType(ftype)
    except ValueError:
        raise FrameError(f"unknown frame type {ftype}") from None
    if hlen > MAX_HEADER:
        raise FrameError(f"oversize header: {hlen} > {MAX_HEADER} bytes")
    if hlen + plen > max_frame:
        raise FrameError(f"oversize frame: {hlen + plen} > {max_frame} bytes")
    return kind, flags, hlen, plen


def parse_header(raw: Buffer) -> dict[str, Any]:
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises many kinds; all mean the same here
        raise FrameError(f"bad msgpack header: {exc}") from None
    if not isinstance(header, dict):
        raise FrameError(f"header is a {type(header).__name__}, not a dict")
    return header


# --------------------------------------------------------------------------- decoding


class FrameDecoder:
    """Push bytes in, get whole frames out (sans I/O); poisoned after the first error."""

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()
        self._failed: FrameError | None = None

    def feed(self, data: Buffer) -> list[Frame]:
        if self._failed:
            raise self._failed
        self._buf += data
        frames = []
        try:
            while len(self._buf) >= PREFIX.size:
                kind, flags, hlen, plen = parse_prefix(self._buf[: PREFIX.size], self.max_frame)
                end = PREFIX.size + hlen + plen
                if len(self._buf) < end:
                    break
                header = parse_header(self._buf[PREFIX.size: PREFIX.size + hlen])
                payload = bytes(self._buf[PREFIX.size + hlen: end])
                del self._buf[:end]
                frames.append(Frame(kind, header, payload, flags, PREFIX.size + hlen + plen))
        except FrameError as exc:
            self._failed = exc
            raise
        return frames

    def close(self) -> None:
        """End of stream: anything left over is a truncated frame."""
        if self._buf:
            raise FrameError(f"truncated frame: {len(self._buf)} bytes left at end of stream")


async def read_frame(reader: asyncio.StreamReader, max_frame: int = MAX_FRAME) -> Frame | None:
    """The next frame from an asyncio stream; None on a clean end of stream."""
    try:
        prefix = await reader.readexactly(PREFIX.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise FrameError(f"truncated prefix: {len(exc.partial)} of {PREFIX.size} bytes") from None
    kind, flags, hlen, plen = parse_prefix(prefix, max_frame)
    try:
        header = parse_header(await reader.readexactly(hlen))
        payload = await reader.readexactly(plen) if plen else b""
    except asyncio.IncompleteReadError as exc:
        raise FrameError(f"truncated frame: stream ended {exc.expected - len(exc.partial)} bytes short") from None
    return Frame(kind, header, payload, flags, PREFIX.size + hlen + plen)


async def write_frame(writer: asyncio.StreamWriter, ftype: FrameType, header: dict[str, Any] | None = None,
                      payload: Buffer | np.ndarray = b"") -> int:
    """Encode, write and drain one frame; returns the bytes sent."""
    parts = encode_frame(ftype, header, payload)
    writer.writelines(parts)
    await writer.drain()
    return sum(len(p) for p in parts)


def _recv_exactly(sock: socket.socket, view: memoryview, allow_eof: bool = False) -> bool:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            if allow_eof and got == 0:
                return False
            raise FrameError(f"truncated frame: connection closed {len(view) - got} bytes short")
        got += n
    return True


def recv_frame(sock: socket.socket, into: bytearray | memoryview | None = None,
               max_frame: int = MAX_FRAME) -> Frame | None:
    """The next frame from a blocking socket; None on a clean close.

    The payload is received with recv_into straight into `into` when it is
    big enough (the returned payload is then a view of it, valid until the
    caller reuses it), otherwise into a fresh bytearray of exactly its size.
    """
    prefix = bytearray(PREFIX.size)
    if not _recv_exactly(sock, memoryview(prefix), allow_eof=True):
        return None
    kind, flags, hlen, plen = parse_prefix(prefix, max_frame)
    raw = bytearray(hlen)
    _recv_exactly(sock, memoryview(raw))
    header = parse_header(raw)
    if into is not None and len(into) >= plen:
        payload = memoryview(into)[:plen]
    else:
        payload = memoryview(bytearray(plen))
    _recv_exactly(sock, payload)
    return Frame(kind, header, payload, flags, PREFIX.size + hlen + plen)


def send_frame(sock: socket.socket, ftype: FrameType, header: dict[str, Any] | None = None,
               payload: Buffer | np.ndarray = b"") -> int:
    """Encode and send one frame with sendmsg (no join of the payload); returns bytes sent."""
    parts = [memoryview(p).cast("B") for p in encode_frame(ftype, header, payload)]
    total = sum(len(p) for p in parts)
    while parts:
        sent = sock.sendmsg(parts)
        while parts and sent >= len(parts[0]):
            sent -= len(parts[0])
            parts.pop(0)
        if parts and sent:
            parts[0] = parts[0][sent:]
    return total
