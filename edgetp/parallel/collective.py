"""Collectives over links: the per-layer all-reduce and the candidate gather.

Topology is a star around the root. Per all-reduce every worker sends its
partial sum (n, dim) to the root; the root adds them **in node order** to its
own and sends the total back. Every node then adds the very same bytes to
its residual stream, so all nodes stay bit-identical whatever the sync type.

Sync types (a plan setting):
- "f32": 4 bytes per value, exact.
- "q8_0": ggml's Q8_0 blocks, 34 bytes per 32 values, both directions; the
  root applies the same rounded total it sends, so nodes still agree.

A partial handed over as `passes.Pieces` goes piece by piece: each node computes
a piece and sends it while it computes the next, and the root adds each piece
in node order as it arrives and sends that piece's total back at once. Every
value gets the same additions in the same order as whole, and Q8_0 blocks are
the same blocks (pieces are cut at multiples of 32): the same bits.

Calls come from the compute thread. On a link in blocking mode they use the
socket directly (on a plain link each frame is received and its values
applied, or built and sent, in one compiled call: net/wire.py); in asyncio mode
they hop through the event loop.
"""

from __future__ import annotations

import asyncio
from typing import Any, Sequence

import numpy as np

from edgetp.model import quant, sampling
from edgetp.model.passes import Pieces
from edgetp.net.frames import Frame, FrameType
from edgetp.net.link import BLOCKING, Link

SYNC_TYPES = ("f32", "q8_0")


def encode_sync(x: np.ndarray, sync: str) -> memoryview:
    """A (n, dim) f32 array as the bytes that travel for this sync type.

    Bare bytes, no dtype/shape header: the plan fixes both, so a sync frame
    is the 16-byte prefix, an empty msgpack map and the payload.
    """
    wire = np.ascontiguousarray(x, np.float32) if sync == "f32" else quant.quantize_q8_0(x.reshape(-1))
    return memoryview(wire).cast("B")


def _sized(payload: memoryview, shape: tuple[int, ...], sync: str) -> int:
    """The values of `shape`; ValueError if the payload is not their size in this sync type."""
    n = shape[0] * shape[1]
    if len(payload) != sync_bytes(n, sync):
        raise ValueError(f"sync payload of {len(payload)} bytes, expected {sync_bytes(n, sync)} for {shape} {sync}")
    return n


def decode_sync(payload: memoryview, shape: tuple[int, int], sync: str) -> np.ndarray:
    """The (n, dim) f32 values a sync payload carries."""
    n = _sized(payload, shape, sync)
    if sync == "f32":
        return np.frombuffer(payload, np.float32).reshape(shape)
    return quant.dequantize_q8_0(payload, n).reshape(shape)


def apply_sync(payload: memoryview, partial: np.ndarray, sync: str, add: bool) -> None:
    """partial = (add: +=) decode_sync(payload, ...): Q8_0 blocks straight into a C-contiguous partial."""
    if sync == "f32" or not partial.flags.c_contiguous:
        values = decode_sync(payload, partial.shape, sync)
        if add:
            partial += values
        else:
            partial[...] = values
        return
    quant.dequantize_q8_0(payload, _sized(payload, partial.shape, sync), partial, add)


def sync_bytes(n_values: int, sync: str) -> int:
    """Payload bytes of one all-reduce message of n_values values."""
    return n_values * 4 if sync == "f32" else n_values // 32 * 34


class Hot:
    """Send/receive from the compute thread, on whichever mode the link is in."""

    def __init__(self, link: Link, loop: asyncio.AbstractEventLoop | None) -> None:
        self.link = link
        self.loop = loop

    def send(self, ftype: FrameType, header: dict[str, Any], payload: Any = b"") -> None:
        if self.link.mode == BLOCKING:
            self.link.send_blocking(ftype, header, payload)
        else:
            asyncio.run_coroutine_threadsafe(self.link.send(ftype, header, payload), self.loop).result()

    def recv(self, ftype: FrameType) -> Frame:
        if self.link.mode == BLOCKING:
            return self.link.recv_blocking(ftype)
        return asyncio.run_coroutine_threadsafe(self.link.expect(ftype), self.loop).result()

    def recv_partial(self, ftype: FrameType, partial: np.ndarray, sync: str, add: bool) -> None:
        """partial (+)= the values of one all-reduce frame. On a blocking link the frame is received
        and its values applied in one compiled call (net/wire.py, through Link)."""
        if self.link.mode != BLOCKING:
            apply_sync(self.recv(ftype).payload, partial, sync, add)
        elif sync == "f32":
            self.link.recv_values_blocking(ftype, partial, add)
        elif partial.flags.c_contiguous:
            self.link.recv_q8_blocking(ftype, partial.reshape(-1), add)
        else:
            apply_sync(self.link.recv_bare_blocking(ftype, sync_bytes(partial.size, sync)), partial, sync, add)

    def send_partial(self, ftype: FrameType, partial: np.ndarray, sync: str) -> None:
        """One all-reduce frame of partial's values in the sync type."""
        if sync == "f32" and self.link.mode == BLOCKING:
            self.link.send_values_blocking(ftype, partial)
        elif self.link.mode == BLOCKING and partial.flags.c_contiguous:
            self.link.send_q8_blocking(ftype, partial.reshape(-1), back=False)
        else:
            self.send_encoded(ftype, encode_sync(partial, sync))

    def send_rounded(self, ftype: FrameType, partial: np.ndarray) -> None:
        """One q8_0 frame of partial (C-contiguous), which is replaced by the values it carries
        (quant.quantize_q8_0(back=True)): on a blocking link quantized, replaced and sent in one call."""
        if self.link.mode == BLOCKING:
            self.link.send_q8_blocking(ftype, partial.reshape(-1), back=True)
        else:
            self.send_encoded(ftype, memoryview(quant.quantize_q8_0(partial.reshape(-1), back=True)).cast("B"))

    def send_encoded(self, ftype: FrameType, wire: memoryview) -> None:
        """One all-reduce frame whose payload is encoded already (an empty header, the blocking
        links' bare frames)."""
        if self.link.mode == BLOCKING:
            self.link.send_bytes_blocking(ftype, wire)
        else:
            self.send(ftype, {}, wire)


class RootReduce:
    """The root's side of the star: gathers partials, sums in node order, sends the total."""

    def __init__(self, workers: Sequence[Hot], sync: str) -> None:
        self.workers = list(workers)
        self.sync = sync
        self.rounds = 0  # all-reduces run so far (one round trip to every worker each)

    def __call__(self, partial: np.ndarray) -> None:
        self.rounds += 1
        self._sum(partial)

    def pieces(self, p: Pieces) -> None:
        """Each piece as soon as ours is computed: the workers' pieces arrive while we compute."""
        self.rounds += 1
        for k, cols in enumerate(_columns(p)):
            p.fill(k)
            self._sum(p.out[:, cols])

    def _sum(self, partial: np.ndarray) -> None:
        for w in self.workers:
            w.recv_partial(FrameType.PARTIAL, partial, self.sync, add=True)
        if self.sync == "f32":
            for w in self.workers:
                w.send_partial(FrameType.REDUCED, partial, self.sync)
            return
        if partial.flags.c_contiguous and len(self.workers) == 1:  # the 2-node case: one compiled call
            self.workers[0].send_rounded(FrameType.REDUCED, partial)
            return
        if partial.flags.c_contiguous:  # quantized, and replaced by exactly what the workers will apply
            wire = memoryview(quant.quantize_q8_0(partial.reshape(-1), back=True)).cast("B")
        else:
            wire = encode_sync(partial, self.sync)
            partial[...] = quant.dequantize_q8_0(wire, partial.size).reshape(partial.shape)
        for w in self.workers:
            w.send_encoded(FrameType.REDUCED, wire)


class WorkerReduce:
    """A worker's side: send my partial, replace it with the total from the root."""

    def __init__(self, root: Hot, sync: str) -> None:
        self.root = root
        self.sync = sync

    def __call__(self, partial: np.ndarray) -> None:
        self.root.send_partial(FrameType.PARTIAL, partial, self.sync)
        self.root.recv_partial(FrameType.REDUCED, partial, self.sync, add=False)

    def pieces(self, p: Pieces) -> None:
        """Send each piece as soon as it is computed (a few KB: the socket takes it at once, and the
        root reads it while we compute the next), then take the totals."""
        for k, cols in enumerate(_columns(p)):
            p.fill(k)
            self.root.send_partial(FrameType.PARTIAL, p.out[:, cols], self.sync)
        for cols in _columns(p):
            self.root.recv_partial(FrameType.REDUCED, p.out[:, cols], self.sync, add=False)


def _columns(p: Pieces) -> list[slice]:
    return [slice(a, b) for a, b in zip(p.cuts[:-1], p.cuts[1:])]


def candidates_message(c: sampling.Candidates) -> tuple[dict[str, Any], np.ndarray]:
    """Candidates as a LOGITS frame (one row of candidates_rows_message)."""
    return candidates_rows_message([c])


def candidates_from(frame: Frame) -> sampling.Candidates:
    return candidates_rows_from(frame, 1)[0]


def candidates_rows_message(cs: Sequence[sampling.Candidates]) -> tuple[dict[str, Any], np.ndarray]:
    """Candidates of every row of a step as one LOGITS frame: each row's ids, lse and, where log
    probabilities were asked for, its own log-sum-exp and top in the header; the payload holds every
    row's logits, then the own logits at the ids of each row that has them."""
    parts = [c.logits for c in cs] + [c.own.at for c in cs if c.own is not None]
    logits = np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)
    own = [None if c.own is None else [c.own.lse, c.own.top_ids.tolist(), c.own.top.tolist()] for c in cs]
    return {"rows": [c.ids.tolist() for c in cs], "lse": [c.lse for c in cs], "own": own}, logits


def candidates_rows_from(frame: Frame, n: int) -> list[sampling.Candidates]:
    ids, lse, own = frame.header.get("rows"), frame.header.get("lse"), frame.header.get("own")
    if not all(isinstance(v, list) and len(v) == n for v in (ids, lse, own)):
        raise ValueError(f"LOGITS for {n} rows expected")
    if not all(o is None or (isinstance(o, list) and len(o) == 3 and isinstance(o[1], list)
                             and isinstance(o[2], list) and len(o[1]) == len(o[2])) for o in own):
        raise ValueError("a LOGITS frame's own logits are malformed")
    logits = np.array(frame.array(), dtype=np.float32)
    sizes = [len(r) for r in ids]
    want = sum(sizes) + sum(k for k, o in zip(sizes, own) if o is not None)
    if logits.size != want:
        raise ValueError(f"{want} candidate logits expected but {logits.size} came")
    out, at, extra = [], 0, sum(sizes)
    for r, k, e, o in zip(ids, sizes, lse, own):
        mine = None
        if o is not None:
            mine = sampling.Own(logits[extra:extra + k], float(o[0]), np.asarray(o[1], np.int64),
                                np.asarray(o[2], np.float32))
            extra += k
        out.append(sampling.Candidates(np.asarray(r, dtype=np.int64), logits[at:at + k], float(e), mine))
        at += k
    return out
