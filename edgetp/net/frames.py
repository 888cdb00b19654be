"""The frame codec: one place for every byte on the wire.

A frame is a fixed 16-byte prefix, a msgpack header (always a dict), then a
raw payload (tensor bytes, never re-encoded):

    magic   4s   b"ETP1"
    version u8   PROTOCOL_VERSION
    type    u8   FrameType
    flags   u16  bit 0: SEALED; other bits reserved, carried through
    hlen    u32  msgpack header bytes
    plen    u32  payload bytes

A **sealed** frame (every frame after a keyed handshake) carries the same
prefix in clear, then header and payload encrypted together with
ChaCha20-Poly1305 and a 16-byte tag. The prefix is the associated data, so
its type and sizes are authenticated too, and the nonce is the frame's
number in its direction (`Cipher`): a frame replayed, reordered, injected
or altered fails to open.

Sizes are checked against the bounds before a byte of buffer is allocated,
and a payload's buffer grows as its bytes arrive (never to an announced size
that has not been sent). Encoding returns a gather list so `sendmsg` sends a
plain tensor's own buffer; decoding receives into a reused buffer that
`payload_to_array` wraps with `np.frombuffer`, without another copy. Every
decode problem is a `FrameError` with a reason; the link closes, the process
lives on.
"""

from __future__ import annotations

import enum
import socket
import struct
from dataclasses import dataclass, field
from typing import Any, Union

import msgpack
import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from edgetp.net import LINK_KEY_BYTES as KEY_BYTES
from edgetp.net import PROTOCOL_VERSION

MAGIC = b"ETP1"
PREFIX = struct.Struct("!4sBBHII")
MAX_FRAME = 64 * 2**20  # header + payload, default bound once a peer has authenticated
PREAUTH_MAX_FRAME = 64 * 2**10  # header + payload, before it has
MAX_HEADER = 64 * 2**10
FIRST_CHUNK = 64 * 2**10  # a payload's buffer starts this big and doubles as its bytes arrive
SEALED = 0x1  # flags bit: header and payload are ChaCha20-Poly1305 ciphertext, a tag follows
TAG_BYTES = 16
TENSOR_DTYPES = ("float32", "float16", "uint8", "int8", "int32", "int64")

Buffer = Union[bytes, bytearray, memoryview]


class FrameError(Exception):
    """A frame that cannot be decoded; the reason says why."""


class FrameType(enum.IntEnum):
    HELLO = 1
    CHALLENGE = 2
    AUTH = 3
    AUTH_OK = 4
    LOAD = 6  # 5 was PLAN, never sent; numbers never change
    READY = 7
    STEP = 8
    PARTIAL = 9
    REDUCED = 10
    LOGITS = 11
    RESET = 12
    PING = 13
    PONG = 14
    ERROR = 15
    PROFILE = 17  # measure a node's speed (16 was BYE, never sent; append new types)
    PROGRESS = 18  # a worker fetching its slice: bytes done and total
    HIDDEN = 19  # a pipeline stage's residual stream, handed back for the next stage


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


# --------------------------------------------------------------------------- sealing


class Cipher:
    """One direction of a sealed link: ChaCha20-Poly1305 under that direction's key.

    The nonce is the frame's number in this direction (0, 1, 2, ...), never
    sent: both ends count, so a frame opens only in its own place in the
    stream. Each key serves one direction of one link, so no nonce repeats.
    """

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a link key is {KEY_BYTES} bytes, got {len(key)}")
        self._aead = ChaCha20Poly1305(key)
        self._key = key
        self._context = None
        self.counter = 0

    def context(self, encrypt: bool):
        """This direction's context for compiled sealing (net/aead.py; its caller has checked
        aead.available()), made at first use: it seals (encrypt) or opens with this key, and each
        frame sealed or opened with it takes `counter` as its nonce, then counts it."""
        if self._context is None:
            from edgetp.net import aead  # noqa: PLC0415 - loads libcrypto, only where it is used

            self._context = aead.Context(self._key, encrypt)
        return self._context

    def _nonce(self) -> bytes:
        nonce = self.counter.to_bytes(12, "little")
        self.counter += 1
        return nonce

    def seal(self, prefix: bytes, header: bytes, payload: Buffer) -> bytes:
        """header + payload encrypted, then the tag; the prefix is authenticated, not encrypted."""
        return self._aead.encrypt(self._nonce(), b"".join((header, payload)), prefix)

    def open(self, prefix: Buffer, body: Buffer, out: bytearray | None = None) -> memoryview:
        """The plaintext of a sealed body (into `out` when it is big enough), or FrameError."""
        n = len(body) - TAG_BYTES
        if n < 0:
            raise FrameError("sealed frame shorter than its tag")
        number = self.counter
        view = memoryview(out)[:n] if out is not None and len(out) >= n else memoryview(bytearray(n))
        try:
            self._aead.decrypt_into(self._nonce(), body, bytes(prefix), view)
        except InvalidTag:
            raise unopened(number) from None
        return view


def unopened(number: int) -> FrameError:
    """The error of a sealed frame that failed to open, the number-th in its direction."""
    return FrameError(f"frame {number} failed authentication (tampered, replayed, reordered or injected)")


# --------------------------------------------------------------------------- encoding


def encode_frame(ftype: FrameType, header: dict[str, Any] | None = None, payload: Buffer | np.ndarray = b"",
                 *, flags: int = 0, max_frame: int = MAX_FRAME, cipher: Cipher | None = None) -> list[Buffer]:
    """prefix+header, then the payload buffer itself: a gather list for sendmsg.

    An ndarray payload gets its dtype and shape added to the header. With a
    cipher the list is the prefix and the sealed header, payload and tag.
    """
    header = dict(header or {})
    if isinstance(payload, np.ndarray):
        header.update(tensor_header(payload))
    body = _payload_view(payload)
    packed = msgpack.packb(header, use_bin_type=True)
    if len(packed) > MAX_HEADER or len(packed) + len(body) > max_frame:
        raise ValueError(f"frame too large: header {len(packed)} + payload {len(body)} > {max_frame}")
    flags = (flags | SEALED) if cipher is not None else (flags & ~SEALED)
    prefix = PREFIX.pack(MAGIC, PROTOCOL_VERSION, int(FrameType(ftype)), flags, len(packed), len(body))
    if cipher is not None:
        return [prefix, cipher.seal(prefix, packed, body)]
    head = prefix + packed
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


def body_bytes(flags: int, hlen: int, plen: int, cipher: Cipher | None) -> int:
    """Bytes after the prefix; refuses a frame whose sealing does not match the link's."""
    sealed = bool(flags & SEALED)
    if cipher is not None and not sealed:
        raise FrameError("unsealed frame on a sealed link (injected?)")
    if cipher is None and sealed:
        raise FrameError("sealed frame on a link without a session key")
    return hlen + plen + (TAG_BYTES if sealed else 0)


def split_body(prefix: Buffer, body: memoryview, hlen: int, cipher: Cipher | None,
               out: bytearray | None = None) -> tuple[dict[str, Any], memoryview]:
    """(header, payload view) of a received body, opened first when sealed."""
    plain = cipher.open(prefix, body, out) if cipher is not None else body
    return parse_header(plain[:hlen]), plain[hlen:]


def parse_header(raw: Buffer) -> dict[str, Any]:
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises many kinds; all mean the same here
        raise FrameError(f"bad msgpack header: {exc}") from None
    if not isinstance(header, dict):
        raise FrameError(f"header is a {type(header).__name__}, not a dict")
    return header


# --------------------------------------------------------------------------- blocking sockets


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


def recv_growing(sock: socket.socket, n: int, reuse: bytearray | None = None) -> tuple[bytearray, memoryview]:
    """n bytes from a blocking socket: (buffer, view of its first n bytes).

    Into `reuse` when it is big enough; otherwise into a new buffer that
    starts at FIRST_CHUNK and doubles only as bytes arrive, so an announced
    size costs memory only once the peer has really sent it.
    """
    if reuse is not None and len(reuse) >= n:
        view = memoryview(reuse)[:n]
        _recv_exactly(sock, view)
        return reuse, view
    buf = bytearray(min(n, FIRST_CHUNK))
    got = 0
    while True:
        with memoryview(buf) as mv:
            with mv[got:] as rest:
                _recv_exactly(sock, rest)
        got = len(buf)
        if got == n:
            return buf, memoryview(buf)
        buf.extend(bytes(min(n - got, got)))


def recv_frame(sock: socket.socket, into: bytearray | None = None, max_frame: int = MAX_FRAME,
               cipher: Cipher | None = None, plain: bytearray | None = None) -> tuple[Frame | None, bytearray | None]:
    """The next frame from a blocking socket (None on a clean close), and the receive buffer used.

    The body lands in `into` when it is big enough, else in a grown buffer
    (returned, for the caller to keep). A sealed body opens into `plain`
    when that is big enough. The payload views one of these buffers: valid
    until the caller reuses them.
    """
    prefix = bytearray(PREFIX.size)
    if not _recv_exactly(sock, memoryview(prefix), allow_eof=True):
        return None, into
    return _rest_of_frame(sock, prefix, into, max_frame, cipher, plain)


def _rest_of_frame(sock: socket.socket, prefix: bytearray, into: bytearray | None, max_frame: int,
                   cipher: Cipher | None, plain: bytearray | None) -> tuple[Frame, bytearray | None]:
    kind, flags, hlen, plen = parse_prefix(prefix, max_frame)
    n = body_bytes(flags, hlen, plen, cipher)
    buf, body = recv_growing(sock, n, into)
    header, payload = split_body(prefix, body, hlen, cipher, plain)
    return Frame(kind, header, payload, flags, PREFIX.size + n), buf


# --------------------------------------------------------------------------- bare frames: the hot path
#
# A decode step's all-reduce sends frames of one type, an empty header and a payload whose size the
# plan fixes, two per layer and link. Their prefix is known before they are sent or received, so
# it is made once (Bare) and compared, not parsed: the same bytes on the wire as send_frame and
# recv_frame, with a fraction of the Python around each (tools/bench_allreduce.py).

EMPTY_HEADER = msgpack.packb({}, use_bin_type=True)


@dataclass(frozen=True)
class Bare:
    """The fixed parts of a frame of type `type`, an empty header and `plen` payload bytes."""

    type: FrameType
    plen: int
    sealed: bool
    prefix: bytes  # the 16 bytes that start it
    head: bytes    # prefix + empty header: what precedes a plain payload
    body: int      # bytes after the prefix: the header, the payload and, sealed, the tag

    @classmethod
    def of(cls, ftype: FrameType, plen: int, sealed: bool) -> "Bare":
        prefix = PREFIX.pack(MAGIC, PROTOCOL_VERSION, int(ftype), SEALED if sealed else 0, len(EMPTY_HEADER), plen)
        return cls(FrameType(ftype), plen, sealed, prefix, prefix + EMPTY_HEADER,
                   len(EMPTY_HEADER) + plen + (TAG_BYTES if sealed else 0))


def send_bare(sock: socket.socket, bare: Bare, payload: Buffer, cipher: Cipher | None = None) -> int:
    """send_frame(sock, bare.type, {}, payload, cipher), its prefix made once: the same bytes."""
    if len(payload) != bare.plen or (cipher is not None) != bare.sealed:
        raise ValueError(f"a {len(payload)}-byte payload, {'' if cipher else 'un'}sealed, does not fit {bare}")
    parts = [bare.prefix, cipher.seal(bare.prefix, EMPTY_HEADER, payload)] if cipher is not None else [bare.head, payload]
    sent = sock.sendmsg(parts)  # all of it at once, the usual case; else the rest follows
    return sent if sent == PREFIX.size + bare.body else _sendmsg_all(sock, parts, sent)


def recv_bare(sock: socket.socket, bare: Bare, into: bytearray | None = None, max_frame: int = MAX_FRAME,
              cipher: Cipher | None = None,
              plain: bytearray | None = None) -> tuple[memoryview | Frame | None, bytearray | None]:
    """recv_frame, expecting a frame of `bare`'s kind: when the 16 bytes that arrive are its prefix the
    body is read and opened with no parsing, and its payload (a view, as recv_frame's) comes back
    alone; any other frame (an ERROR, a protocol error) is received and checked as recv_frame does
    and comes back whole, a Frame, for the caller to see. None: a clean close."""
    prefix = bytearray(PREFIX.size)
    got = sock.recv_into(prefix)
    if got == 0:
        return None, into
    if got < PREFIX.size:
        _recv_exactly(sock, memoryview(prefix)[got:])
    if prefix != bare.prefix or (cipher is not None) != bare.sealed:
        return _rest_of_frame(sock, prefix, into, max_frame, cipher, plain)
    buf = into if into is not None and len(into) >= bare.body else bytearray(bare.body)
    body = memoryview(buf)[: bare.body]
    got = sock.recv_into(body)
    if got < bare.body:
        _recv_exactly(sock, body[got:])
    opened = cipher.open(prefix, body, plain) if cipher is not None else body
    if opened[0] != EMPTY_HEADER[0]:
        raise FrameError(f"a {bare.type.name} frame's one-byte header is not an empty map")
    return opened[1:], buf


def send_frame(sock: socket.socket, ftype: FrameType, header: dict[str, Any] | None = None,
               payload: Buffer | np.ndarray = b"", cipher: Cipher | None = None) -> int:
    """Encode (and seal) one frame and send it with sendmsg (no join of a plain payload); bytes sent."""
    return _sendmsg_all(sock, encode_frame(ftype, header, payload, cipher=cipher))


def _sendmsg_all(sock: socket.socket, buffers: list[Buffer], sent: int = 0) -> int:
    """Every byte of buffers, in order, by sendmsg (a gather: no join), the first `sent` of them
    already sent; the bytes of them all."""
    parts = [memoryview(p).cast("B") for p in buffers]
    total = sum(len(p) for p in parts)
    while True:
        while parts and sent >= len(parts[0]):
            sent -= len(parts[0])
            parts.pop(0)
        if not parts:
            return total
        if sent:
            parts[0] = parts[0][sent:]
        sent = sock.sendmsg(parts)
