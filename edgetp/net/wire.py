"""The all-reduce's frames moved by compiled code: receive and add, or send, in one call.

A decode step pays two all-reduce frames per layer and link, and the Python around each (the
prefix checked, two receives, the payload wrapped, added by numpy, the frame sent) cost about
as much as the socket round trip under it (tools/bench_allreduce.py). Here each is one numba
call, with the GIL released, that makes the same system calls on the socket's descriptor
(libc's recv and send, reached as external symbols from LLVM IR, so the compiled code is cached
like every other kernel):

* `recv_values` / `recv_q8`: the 16-byte prefix, compared with the one expected; the body (the
  empty header's one byte and the payload), then its values (f32, or Q8_0 blocks decoded by the
  kernels' own q8_0_values) added into or written over an array;
* `send_values` / `send_bytes` / `send_q8`: the prefix, the empty header and an array's f32 values
  (or bytes already encoded, or its Q8_0 blocks quantized there) in one buffer, sent.

* `send_values_sealed`, `send_bytes_sealed`, `recv_values_sealed`, `recv_q8_sealed`: the same for
  a sealed link, the frame sealed or opened in place in the same call (ChaCha20-Poly1305 through
  the system's libcrypto, net/aead.py: the bytes frames.Cipher makes and opens);
* `recv_body`: a sealed frame's prefix compared and its body received, for Python to open where
  aead.py cannot (no libcrypto); `apply_values` then adds its values;
* `poll`: the wait before a frame that Python receives.

Every receive polls its socket before it waits in the kernel (`_polled`: for EDGETP_SPIN_US,
200 µs by default, and not at all for QUIET_NS after a poll found that it had lost its core):
a wait in the kernel costs the wake-up of a sleeping thread, most of a loopback round trip.

The bytes on the wire are frames.send_bare's and recv_bare's. Only what they cannot decide is
handed back to net/link.py, which knows what each means: another frame in the place of the one
expected (an ERROR), a closed connection, or an error number (EAGAIN when SO_RCVTIMEO or
SO_SNDTIMEO ran out, EINTR when a signal came first: the call is made again with `resume`, from
the bytes already moved).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

import edgetp.model  # noqa: F401  numba's cache folder (jitcache) before the decorators below
from edgetp.model.kernels import q8_0_values, quantize_q8_0_blocks
from edgetp.model.vnni import _I32, _I64, _decl
from edgetp.net import aead

OK, CLOSED, NOT_OURS, BAD_HEADER, UNOPENED, UNSEALED = 0, 1, 2, 3, 4, 5  # UNOPENED: failed authentication
TAG = aead.TAG_BYTES
HEAD = 17  # a bare frame's 16-byte prefix and its empty header
EMPTY_MAP = 0x80  # msgpack's {}: the one-byte header of every bare frame
# Linux's (x86-64 and aarch64 alike): libc's recv, send, clock_gettime and
# __errno_location by those names (link.wire_available)
MSG_NOSIGNAL, MSG_DONTWAIT, MSG_PEEK, EAGAIN, CLOCK_MONOTONIC = 0x4000, 0x40, 0x2, 11, 1

_PTR = ir.IntType(8).as_pointer()


def _syscall(name: str, flags: int):
    """An intrinsic (fd, address, n) -> libc name(fd, address, n, flags): the count, or -errno."""

    @intrinsic
    def call(typingctx, fd, addr, n):
        def codegen(context, builder, signature, args):
            f, a, k = args
            fn = _decl(builder.module, name, _I64, [_I32, _PTR, _I64, _I32])
            got = builder.call(fn, [builder.trunc(f, _I32), builder.inttoptr(a, _PTR), k, ir.Constant(_I32, flags)])
            where = builder.call(_decl(builder.module, "__errno_location", _I32.as_pointer(), []), [])
            err = builder.sext(builder.neg(builder.load(where)), _I64)
            return builder.select(builder.icmp_signed("<", got, ir.Constant(_I64, 0)), err, got)

        return types.int64(types.int64, types.int64, types.int64), codegen

    return call


_recv = _syscall("recv", 0)
_recv_now = _syscall("recv", MSG_DONTWAIT)  # -EAGAIN at once when nothing has come
_peek_now = _syscall("recv", MSG_DONTWAIT | MSG_PEEK)  # the same, leaving what came where it is
_send = _syscall("send", MSG_NOSIGNAL)


@intrinsic
def _now_ns(typingctx):
    """clock_gettime(CLOCK_MONOTONIC) in nanoseconds (the vDSO's: no system call)."""

    def codegen(context, builder, signature, args):
        ts = cgutils.alloca_once(builder, ir.ArrayType(_I64, 2))  # in the entry block: not a new slot per call in a loop
        fn = _decl(builder.module, "clock_gettime", _I32, [_I32, _PTR])
        builder.call(fn, [ir.Constant(_I32, CLOCK_MONOTONIC), builder.bitcast(ts, _PTR)])
        zero = ir.Constant(_I32, 0)
        sec = builder.load(builder.gep(ts, [zero, zero]))
        nsec = builder.load(builder.gep(ts, [zero, ir.Constant(_I32, 1)]))
        return builder.add(builder.mul(sec, ir.Constant(_I64, 1_000_000_000)), nsec)

    return types.int64(), codegen


# A poll that finds this long between two of its tries was not running meanwhile: another thread
# had its core. Receives then wait in the kernel at once for QUIET_NS: a polling thread that shares
# its core waits for the other's time slice (milliseconds) where a woken one would run at once.
GAP_NS = 50_000
QUIET_NS = 100_000_000


@njit(cache=True, nogil=True)
def _polled(fd, addr, n, tune, peek):
    # recv(fd, addr, n) without waiting, tried again and again for at most tune[0] ns, and not before
    # tune[1] (ns, _now_ns's clock): what the first try that found bytes (or a close, or an error)
    # returned, else -EAGAIN. A gap between tries sets tune[1] QUIET_NS ahead. peek: leave the bytes
    spin = tune[0]
    if spin <= 0:
        return -EAGAIN
    t = _now_ns()
    if t < tune[1]:
        return -EAGAIN
    until = t + spin
    while True:
        got = _peek_now(fd, addr, n) if peek else _recv_now(fd, addr, n)
        if got != -EAGAIN:
            return got
        now = _now_ns()
        if now - t > GAP_NS:
            tune[1] = now + QUIET_NS
            return -EAGAIN
        if now >= until:
            return -EAGAIN
        t = now


@njit(cache=True, nogil=True)
def _fill(fd, buf, state, k, tune):
    # buf's bytes from state[k] on; OK, CLOSED (nothing more will come) or -errno. Each receive polls
    # first (_polled): a wait in the kernel costs the wake-up of a sleeping thread (in a VM, of an
    # idle vCPU), most of a loopback round trip (tools/bench_allreduce.py)
    n = buf.shape[0]
    while state[k] < n:
        got = _polled(fd, buf.ctypes.data + state[k], n - state[k], tune, False)
        if got == -EAGAIN:
            got = _recv(fd, buf.ctypes.data + state[k], n - state[k])
        if got == 0:
            return CLOSED
        if got < 0:
            return got
        state[k] += got
    return OK


@njit(cache=True, nogil=True)
def poll(fd, byte, tune):
    """Return once fd has a byte to read, or when the poll gives up (_polled's rules): the poll of
    frames that Python receives (sealed ones, a step's frames). byte: a 1-byte uint8 scratch array;
    tune: int64 (poll ns, no poll before this time), which a seen gap moves."""
    _polled(fd, byte.ctypes.data, 1, tune, True)


# A kind of frame's buffers, one uint8 array a direction (few arguments: numba's dispatch costs
# per argument, and this runs twice a layer): to receive, the expected prefix, the prefix that
# came, the progress (two int64: bytes of prefix and of body) and the body; to send, the progress
# (one int64) and the frame itself, head then values.
RX_EXPECT, RX_PREFIX, RX_STATE, RX_BODY = 0, 16, 32, 48
TX_STATE, TX_FRAME = 0, 8


@njit(cache=True, nogil=True)
def _frame(fd, rx, tune, resume):
    # rx's frame: the prefix compared, the body received, its header checked (OK, CLOSED, NOT_OURS,
    # BAD_HEADER or -errno); tune: _polled's
    got = recv_body(fd, rx, tune, resume)
    if got != OK:
        return got
    return OK if rx[RX_BODY] == EMPTY_MAP else BAD_HEADER


@njit(cache=True, nogil=True)
def recv_body(fd, rx, tune, resume):
    """_frame without the header check: the prefix compared and the body received (a sealed frame's
    ciphertext and tag, which Python opens). OK, CLOSED, NOT_OURS or -errno."""
    state = rx[RX_STATE:RX_BODY].view(np.int64)
    if not resume:
        state[0] = 0
        state[1] = 0
    got = _fill(fd, rx[RX_PREFIX:RX_STATE], state, 0, tune)
    if got != OK:
        return got
    for i in range(16):
        if rx[RX_PREFIX + i] != rx[RX_EXPECT + i]:
            return NOT_OURS
    return _fill(fd, rx[RX_BODY:], state, 1, tune)


@njit(cache=True, nogil=True)
def _send_frame(fd, tx, resume):
    # tx's frame sent from its progress on (from the start unless resume): OK or -errno
    state = tx[TX_STATE:TX_FRAME].view(np.int64)
    frame = tx[TX_FRAME:]
    if not resume:
        state[0] = 0
    n = frame.shape[0]
    while state[0] < n:
        sent = _send(fd, frame.ctypes.data + state[0], n - state[0])
        if sent < 0:
            return sent
        state[0] += sent
    return OK


@njit(cache=True, nogil=True)
def recv_values(fd, rx, dst, add, tune, resume):
    """One frame whose prefix must be rx's expected one; dst (2-D f32, any layout) += its values (add)
    or = them. tune: how each receive polls (poll's). resume: go on from rx's progress (after
    -EINTR), else from nothing. OK, CLOSED, NOT_OURS (rx's prefix holds another frame's prefix,
    whole), BAD_HEADER, or -errno."""
    got = _frame(fd, rx, tune, resume)
    if got == OK:
        apply_values(rx[RX_BODY:], dst, add)
    return got


@njit(cache=True, nogil=True)
def apply_values(body, dst, add):
    """dst (2-D f32, any layout) += (add) or = the f32 values after body's one-byte header (a frame's
    body: received, or opened)."""
    vals = body[1:].view(np.float32)
    rows, cols = dst.shape
    for r in range(rows):
        for c in range(cols):
            if add:
                dst[r, c] += vals[r * cols + c]
            else:
                dst[r, c] = vals[r * cols + c]


@njit(cache=True, nogil=True)
def recv_q8(fd, rx, dst, add, tab16, tune, resume):
    """recv_values for a frame of Q8_0 blocks: dst (1-D f32, C-contiguous) += (add) or = their
    values, by kernels.q8_0_values (the arithmetic of quant.dequantize_q8_0). tab16: f16 -> f32."""
    got = _frame(fd, rx, tune, resume)
    if got == OK:
        q8_0_values(rx[RX_BODY + 1:], tab16, dst, add)
    return got


@njit(cache=True, nogil=True)
def send_bytes(fd, tx, payload, resume):
    """send_values for a payload already encoded (1-D uint8: Q8_0 blocks, say)."""
    frame = tx[TX_FRAME:]
    if not resume:
        frame[HEAD:] = payload
    return _send_frame(fd, tx, resume)


@njit(cache=True, nogil=True)
def send_q8(fd, tx, src, tab16, back, resume):
    """send_bytes of src's Q8_0 blocks (src 1-D f32, C-contiguous), quantized straight into tx by
    kernels.quantize_q8_0_blocks (ggml's quantize_row_q8_0, as quant.quantize_q8_0); back: src
    replaced by the values the blocks carry, in the same pass."""
    if not resume:
        quantize_q8_0_blocks(src, tab16, tx[TX_FRAME + HEAD :], back)
    return _send_frame(fd, tx, resume)


@njit(cache=True, nogil=True)
def send_values(fd, tx, src, resume):
    """The frame (tx's head, then src's values: 2-D f32, any layout) built in tx and sent; resume:
    go on from tx's progress (after -EINTR), else build and send from the start. OK or -errno."""
    if not resume:
        _put_values(tx[TX_FRAME + HEAD :], src)
    return _send_frame(fd, tx, resume)


@njit(cache=True, nogil=True)
def _put_values(payload, src):
    # src's values (2-D f32, any layout) into a frame's payload bytes, row after row
    vals = payload.view(np.float32)
    rows, cols = src.shape
    for r in range(rows):
        for c in range(cols):
            vals[r * cols + c] = src[r, c]


@njit(cache=True, nogil=True)
def seal_body(ctx, counter, aad, body):
    """body (uint8: the plaintext, then TAG bytes for the tag) sealed in place under an encrypting
    aead.Context's addr, nonce `counter`, aad (uint8) authenticated: 1, or 0 if libcrypto failed."""
    n = body.shape[0] - TAG
    return aead.seal(ctx, counter, aad.ctypes.data, aad.shape[0], body.ctypes.data, n, body.ctypes.data + n)


@njit(cache=True, nogil=True)
def open_body(ctx, counter, aad, body):
    """body (the ciphertext, then its tag) opened in place: 1, or 0 if it failed authentication."""
    n = body.shape[0] - TAG
    return aead.open_(ctx, counter, aad.ctypes.data, aad.shape[0], body.ctypes.data, n, body.ctypes.data + n)


@njit(cache=True, nogil=True)
def _send_sealed(fd, tx, ctx, counter, resume):
    # tx's frame (its plaintext body written) sealed, then sent; resume: only the sending goes on
    if not resume:
        frame = tx[TX_FRAME:]
        frame[16] = EMPTY_MAP  # the last frame's sealing left ciphertext here
        if not seal_body(ctx, counter, frame[:16], frame[16:]):
            return UNSEALED
    return _send_frame(fd, tx, resume)


@njit(cache=True, nogil=True)
def send_values_sealed(fd, tx, src, ctx, counter, resume):
    """send_values on a sealed link: the frame sealed in place under ctx (an encrypting
    aead.Context's addr) with nonce `counter` before it is sent. OK, UNSEALED or -errno."""
    if not resume:
        _put_values(tx[TX_FRAME + HEAD : tx.shape[0] - TAG], src)
    return _send_sealed(fd, tx, ctx, counter, resume)


@njit(cache=True, nogil=True)
def send_bytes_sealed(fd, tx, payload, ctx, counter, resume):
    """send_bytes on a sealed link (send_values_sealed's sealing)."""
    if not resume:
        tx[TX_FRAME + HEAD : tx.shape[0] - TAG] = payload
    return _send_sealed(fd, tx, ctx, counter, resume)


@njit(cache=True, nogil=True)
def send_q8_sealed(fd, tx, src, tab16, back, ctx, counter, resume):
    """send_q8 on a sealed link (send_values_sealed's sealing)."""
    if not resume:
        quantize_q8_0_blocks(src, tab16, tx[TX_FRAME + HEAD : tx.shape[0] - TAG], back)
    return _send_sealed(fd, tx, ctx, counter, resume)


@njit(cache=True, nogil=True)
def _opened(fd, rx, ctx, counter, tune, resume):
    # recv_body, then the body opened in place and its header checked: OK, UNOPENED, BAD_HEADER, ...
    got = recv_body(fd, rx, tune, resume)
    if got != OK:
        return got
    if not open_body(ctx, counter, rx[RX_PREFIX:RX_STATE], rx[RX_BODY:]):
        return UNOPENED
    return OK if rx[RX_BODY] == EMPTY_MAP else BAD_HEADER


@njit(cache=True, nogil=True)
def recv_values_sealed(fd, rx, dst, add, ctx, counter, tune, resume):
    """recv_values on a sealed link: the frame opened in place under ctx (a decrypting
    aead.Context's addr) with nonce `counter`; UNOPENED if it fails authentication (nothing applied)."""
    got = _opened(fd, rx, ctx, counter, tune, resume)
    if got == OK:
        apply_values(rx[RX_BODY:], dst, add)
    return got


@njit(cache=True, nogil=True)
def recv_q8_sealed(fd, rx, dst, add, tab16, ctx, counter, tune, resume):
    """recv_q8 on a sealed link (recv_values_sealed's opening)."""
    got = _opened(fd, rx, ctx, counter, tune, resume)
    if got == OK:
        q8_0_values(rx[RX_BODY + 1 :], tab16, dst, add)
    return got


class Buffers:
    """One kind of bare frame's buffers on a link (head: its 17 bytes before the plen-byte payload)."""

    def __init__(self, head: bytes, plen: int, tag: int = 0) -> None:
        """tag: TAG for a sealed frame (head's prefix then says so), which ends with its tag."""
        if len(head) != HEAD:
            raise ValueError(f"a bare frame's head is {HEAD} bytes, got {len(head)}")
        self.size = HEAD + plen + tag  # bytes of the frame
        self.rx = np.zeros(RX_BODY + 1 + plen + tag, np.uint8)
        self.rx[RX_EXPECT:RX_EXPECT + 16] = np.frombuffer(head[:16], np.uint8)
        self.plain = None  # a sealed frame's body opened by Python (`sealed`)
        self.tx = np.zeros(TX_FRAME + self.size, np.uint8)
        self.tx[TX_FRAME:TX_FRAME + HEAD] = np.frombuffer(head, np.uint8)

    @classmethod
    def sealed(cls, prefix: bytes, body: int, tag: int) -> "Buffers":
        """Receive buffers for a sealed bare frame that Python opens (no aead here): its 16-byte
        prefix, then `body` bytes (the header and payload encrypted, then the tag), received by
        recv_body and opened by the caller into `plain` (body - tag bytes). It sends nothing."""
        bufs = cls(prefix + bytes([EMPTY_MAP]), body - 1)
        bufs.tx = None
        bufs.plain = bytearray(body - tag)
        return bufs

    @property
    def body(self) -> memoryview:
        """The body received (after recv_body)."""
        return memoryview(self.rx)[RX_BODY:]

    @property
    def prefix(self) -> bytes:
        """The 16 bytes received where the expected prefix should have been."""
        return self.rx[RX_PREFIX:RX_STATE].tobytes()

    @property
    def started(self) -> bool:
        """Some of a frame had come when the receive stopped."""
        return bool(self.rx[RX_STATE:RX_BODY].view(np.int64).any())
