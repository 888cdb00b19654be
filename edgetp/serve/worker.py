"""A worker: holds one shard and runs its slice of every layer when the root asks.

Session with a root, over one link:

    HELLO/auth  ->  PING/PONG*  ->  PROFILE -> READY{speed, mem}
    LOAD{model, fingerprint, spec, ctx, sync[, fetch_port]}  -> PROGRESS{done, total}* -> READY{rss, ...}
    RESET{params, mode}  -> hot loop on a compute thread:
        STEP{rows and/or slot, pos, ids, want} + x  ->  [PARTIAL -> REDUCED] x 2 per layer  ->  LOGITS
        (a pipeline stage of its own: no PARTIAL, and HIDDEN instead of LOGITS before the last stage)
        STEP{end}  -> back to asyncio
    (close)  -> shard dropped, next root may connect

A worker maps its shard from its own GGUF when the fingerprint matches.
Otherwise, when the LOAD names the root's HTTP port and we hold the cluster
key, it fetches just its slice from the root (serve/weights.py: signed,
hash-verified, cached in `shard_dir`, resumable), telling the root how far
it got about once a second.

One root at a time. A second root takes the worker over when it brings a
newer epoch (cluster mode), or, for a static worker, when the first root's
session sits idle between generations (that root may have lost power: its
next request finds the link closed and re-plans); otherwise it is told
"busy" and closed. Any protocol or decode error closes that link with a
logged reason; the worker keeps running and waits for the next root.

Before a peer has finished its handshake it gets little: frames of 64 KiB at
most, HANDSHAKE_TIMEOUT seconds, and a place among MAX_PENDING handshakes in
progress; connections beyond that are closed at once. Refusals are logged
at most once per LOG_EVERY seconds, with a count of the ones left out.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from gguf import GGMLQuantizationType as QT

from edgetp.parallel import profile
from edgetp.cluster.election import EpochError, EpochState, StaleEpoch
from edgetp.model import batch, generate, kvcache, llama, quant, sampling
from edgetp.model.gguf import GGUFError, ModelFile, open_model
from edgetp.net.frames import FrameType
from edgetp.net.link import BLOCKING, HANDSHAKE_TIMEOUT, MAX_ROUNDS, Link, LinkClosed
from edgetp.net.loopthread import in_daemon_thread
from edgetp.parallel.collective import Hot, WorkerReduce, candidates_rows_message
from edgetp.serve.weights import fetch_shard
from edgetp.store.errors import DownloadError

log = logging.getLogger(__name__)

IDLE_TIMEOUT = 24 * 3600.0  # a root may stay connected and idle this long
BUSY_WAIT = 3.0  # seconds a new root waits for the previous one's session to end
THREAD_WAIT = 2.0  # seconds a cancelled session waits for its compute thread to leave the cut link
PROGRESS_S = 1.0  # seconds between PROGRESS frames while fetching a slice
MAX_PENDING = 32  # connections in their handshake at once, per listening port; more are closed at once
LOG_EVERY = 10.0  # seconds between two log lines about refused connections


class _Quiet:
    """A warning logged at most once per `every` seconds, saying how many were left out."""

    def __init__(self, every: float = LOG_EVERY) -> None:
        self.every = every
        self._last = float("-inf")
        self._left_out = 0

    def warn(self, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last < self.every:
            self._left_out += 1
            return
        more = f" (and {self._left_out} more refusal(s) since the last such line)" if self._left_out else ""
        log.warning(message + more, *args)
        self._last, self._left_out = now, 0


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclass
class Worker:
    node_id: str
    key: bytes | None = None
    threads: int | None = None
    model_path: str | None = None  # our own copy; else the root's path is used
    resolve: Callable[[str], str] = str
    shard_dir: str | None = None  # where fetched slices are cached; None: never fetch
    shard_cache_bytes: int | None = None  # cap on shard_dir (least recently used out first); None: no cap
    index_dir: str | None = None  # where parsed GGUF headers are kept (fast re-opens)
    follow_epochs: bool = False   # daemon mode: admit roots by EpochState.require (cluster/election.py)
    busy: bool = field(default=False, init=False)
    epochs: EpochState = field(default_factory=EpochState, init=False)  # the term of the roots followed
    _link: Link | None = field(default=None, init=False)
    _link_epoch: int = field(default=0, init=False)
    _task: asyncio.Task | None = field(default=None, init=False)
    _current: _Session | None = field(default=None, init=False)  # the session of the root served now
    _idle: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    _pending: int = field(default=0, init=False)  # connections still in their handshake
    _over_cap: _Quiet = field(default_factory=_Quiet, init=False)
    _refused: _Quiet = field(default_factory=_Quiet, init=False)

    @property
    def epoch(self) -> int:
        return self.epochs.epoch

    async def serve(self, host: str, port: int, on_listening: Callable[[int], None] | None = None) -> None:
        """Accept roots until cancelled."""
        if self.threads:
            quant.set_threads(self.threads)
        sock = socket.create_server((host, port), reuse_port=False)
        sock.setblocking(False)
        bound = sock.getsockname()[1]
        log.info("worker %s listening on %s:%d", self.node_id, host, bound)
        if on_listening:
            on_listening(bound)
        loop = asyncio.get_running_loop()
        sessions: set[asyncio.Task] = set()
        try:
            while True:
                conn, addr = await loop.sock_accept(sock)
                if self._pending >= MAX_PENDING:
                    conn.close()
                    self._over_cap.warn("port %d: %d handshakes already in progress; closing new connections "
                                        "(from %s first) until they end", bound, MAX_PENDING, addr[0])
                    continue
                self._pending += 1
                task = asyncio.create_task(self._session(Link(conn, f"{addr[0]}:{addr[1]}")))
                sessions.add(task)
                task.add_done_callback(sessions.discard)
        finally:
            sock.close()
            for task in sessions:
                task.cancel()
            await asyncio.gather(*sessions, return_exceptions=True)

    async def _session(self, link: Link) -> None:
        try:
            async with asyncio.timeout(HANDSHAKE_TIMEOUT):
                peer, epoch = await self._greet(link)
        except (LinkClosed, TimeoutError) as exc:
            self._refused.warn("connection refused: %s", str(exc) or f"link {link.name}: no handshake within "
                                                                f"{HANDSHAKE_TIMEOUT:.0f} s")
            link.close()
            return
        finally:
            self._pending -= 1
        if self.follow_epochs:  # no split brain: an older epoch, or this one under another root, is refused
            try:
                self.epochs.require(peer, epoch)
            except EpochError as exc:
                kind = "stale" if isinstance(exc, StaleEpoch) else "conflicting"
                log.warning("refused root %s: %s", peer, exc)
                await link._try_error(f"{kind} epoch {epoch}: worker {self.node_id} follows "
                                      f"{self.epochs.leader} in epoch {self.epochs.epoch}")
                link.close()
                return
        newer = epoch > self._link_epoch
        idle = not self.follow_epochs and self._current is not None and self._current.idle
        if self.busy and self._link is not None and (newer or idle):
            if newer:
                log.warning("root %s of epoch %d replaces the root of epoch %d", peer, epoch, self._link_epoch)
            else:
                log.warning("root %s takes over from the idle root at %s", peer, self._link.name)
            self._link.cut()  # a receive blocked on it, on the compute thread or the loop, fails out
            if self._task is not None:
                self._task.cancel()  # and so does whatever else the session awaits
        deadline = asyncio.get_running_loop().time() + BUSY_WAIT
        while self.busy:  # a root re-planning may reconnect before its old session has wound down
            try:
                async with asyncio.timeout_at(deadline):
                    await self._idle.wait()
            except TimeoutError:
                await link._try_error(f"worker {self.node_id} is busy with another root")
                link.close()
                return
        self.busy, self._link, self._link_epoch = True, link, epoch
        self._task = asyncio.current_task()
        self._idle.clear()
        log.info("root %s (epoch %d) connected from %s", peer, epoch, link.name)
        self._current = _Session(self, link)
        try:
            await self._current.run()
        except LinkClosed as exc:
            log.warning("root session ended: %s", exc)
        except (GGUFError, DownloadError, ValueError, KeyError, TypeError) as exc:
            log.warning("root session %s dropped: %s", link.name, exc)
            await link._try_error(str(exc))
        except Exception as exc:  # a bug must cost the session, never the worker
            log.exception("root session %s failed", link.name)
            await link._try_error(f"worker error: {exc}")
        finally:
            lingering = self._current.lingering if self._current is not None else None
            if lingering is None:
                link.close()
            else:  # closed by the thread's own failed receive, or here once the thread ends
                lingering.add_done_callback(lambda _: link.close())
            self.busy, self._link, self._task, self._current = False, None, None, None
            self._idle.set()

    async def _greet(self, link: Link) -> tuple[str, int]:
        """Authenticate the root (when we hold a key); its node id and epoch."""
        if self.key is not None:
            peer = await link.accept_auth(self.key, self.node_id)
            hello = link.hello
        else:
            hello = (await link.expect(FrameType.HELLO)).header
            if "cluster_id" in hello:
                await link._try_error(f"worker {self.node_id} holds no cluster key; start it with --key")
                raise LinkClosed(f"link {link.name}: a keyed root, and this worker has no key", link.name)
            peer = str(hello.get("node_id", "?"))
            await link.send(FrameType.HELLO, {"node_id": self.node_id, "auth": False})
            link.trust()
        epoch = hello.get("epoch", 0)
        if not isinstance(epoch, int) or epoch < 0:
            raise LinkClosed(f"link {link.name}: bad epoch {epoch!r} in HELLO", link.name)
        return peer, epoch


class _Session:
    """The state of one root's session: its link and the shard it asked for."""

    def __init__(self, worker: Worker, link: Link) -> None:
        self.worker = worker
        self.link = link
        self.shard: llama.Shard | None = None
        self.sync = "f32"
        self.reduce = True  # all-reduces with the root (its stage); False: a pipeline stage of its own
        self.mf = None
        self.idle = False  # waiting for the root's next request (not loading, profiling or generating)
        self.lingering: asyncio.Future | None = None  # a compute thread on the link that outlived a cancel

    async def _on_link(self, fn: Callable[..., None], *args: Any) -> None:
        """fn(*args) on a compute thread that sends and receives on the link. Cancelled (a newer root
        takes over, the worker stops), the session cuts the link, so the thread's receive fails out,
        and waits for the thread before the link is closed: a close under a compiled receive frees its
        descriptor number for the next socket, which that receive would then read."""
        work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        try:
            await asyncio.shield(work)
        except asyncio.CancelledError:
            self.link.cut()
            work.add_done_callback(lambda f: f.cancelled() or f.exception())  # its LinkClosed is expected
            await asyncio.wait({work}, timeout=THREAD_WAIT)
            if not work.done():
                log.warning("link %s: the compute thread is still busy %.0f s after the link was cut; "
                            "the link closes when it ends", self.link.name, THREAD_WAIT)
                self.lingering = work
            raise

    async def run(self) -> None:
        link = self.link
        while True:
            self.idle = self.shard is not None  # before its LOAD a session is still being set up
            try:
                frame = await link.recv(IDLE_TIMEOUT)
            finally:
                self.idle = False
            handler = self.HANDLERS.get(frame.type)
            if handler is None:
                raise LinkClosed(f"unexpected {frame.type.name} from the root")
            await handler(self, frame.header)

    async def _ping(self, header: dict[str, Any]) -> None:
        if "rounds" in header:  # the root times all-reduce rounds as a generation runs them (Link.measure_rounds)
            rounds, cols = header.get("rounds"), header.get("cols")
            if not all(isinstance(v, int) and 0 < v <= most for v, most in ((rounds, MAX_ROUNDS), (cols, 1 << 20))):
                raise ValueError(f"PING asks for {rounds!r} rounds of {cols!r} values "
                                 f"(at most {MAX_ROUNDS} of {1 << 20}, each a positive integer)")
            self.link.enter_blocking()
            try:
                await self._on_link(self.link.echo_rounds, cols, rounds)
            finally:
                if not self.link.done:
                    self.link.leave_blocking()
        await self.link.send(FrameType.PONG, {} if "rounds" in header else header)

    async def _profile(self, header: dict[str, Any]) -> None:
        qtype = int(header.get("qtype", QT.Q8_0))  # the root's model's dominant type: every node times the same
        if qtype not in quant.SUPPORTED:
            raise LinkClosed(f"PROFILE asks for tensor type {qtype}, which this node does not support")
        at = header.get("at")  # a time.time() to start timing at: the root's, when it shares our machine
        if at is not None and (isinstance(at, bool) or not isinstance(at, (int, float)) or not math.isfinite(at)):
            raise LinkClosed(f"PROFILE asks to start at {at!r}, not a time")
        try:  # the root's model's token pass (none from an older root: the one matrix of qtype)
            shapes = profile.check_pass(header["pass"]) if header.get("pass") else None
        except ValueError as exc:  # the root hears why (an ERROR frame), as for a bad PING
            raise ValueError(f"PROFILE: {exc}") from None
        p = await in_daemon_thread(profile.profile, self.worker.threads, float(header.get("seconds", 0.5)), qtype,
                                   None if at is None else float(at), shapes, name="edgetp-profile")
        await self.link.send(FrameType.READY, {"speed": p.speed, "mem_free": p.mem_free, "threads": p.threads,
                                               "host": p.host, "row_cost": p.row_cost})

    async def _load(self, h: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        self.shard = None
        layers, experts = h.get("layers"), h.get("experts")
        spec = llama.ShardSpec(tuple(h["kv_groups"]), tuple(h["ffn_cols"]), tuple(h["vocab_rows"]),
                               None if layers is None else tuple(layers), None if experts is None else tuple(experts))
        kv_type = h.get("kv_type", "f16")
        if kv_type not in kvcache.KV_TYPES:
            raise ValueError(f"LOAD: kv_type must be one of {', '.join(kvcache.KV_TYPES)}, got {kv_type!r}")
        self.mf = await self._model(h, spec)
        path = self.mf.path
        self.sync = h["sync"]
        self.reduce = bool(h.get("reduce", True))
        # On daemon threads, not asyncio.to_thread: a cold start compiles the packing and every kernel for
        # minutes, and asyncio.run would wait for an executor's thread before a stop signal ends the process
        log.info("loading shard %s: its weights, then its kernels (compiled, or loaded from numba's cache)", spec)
        weights = await in_daemon_thread(llama.load_weights, self.mf, spec, name="edgetp-load")
        self.shard = llama.Shard(weights, int(h["ctx"]), slots=_positive(h.get("slots", 1), "slots"), kv_type=kv_type,
                                 sync_pieces=_positive(h.get("sync_pieces", 1), "sync_pieces"))
        await in_daemon_thread(_warm_up, self.shard, name="edgetp-warm")
        log.info("loaded shard %s of %s: %.1f MB of weights, %.1f MB KV cache (%s)",
                 spec, path, weights.nbytes / 1e6, self.shard.kv_bytes / 1e6, kv_type)
        await self.link.send(FrameType.READY, {
            "rss": rss_bytes(), "weights": weights.nbytes, "kv": self.shard.kv_bytes,
            "load_ms": (time.perf_counter() - t0) * 1000, "embeds": _embeds(self.mf)})

    async def _model(self, h: dict[str, Any], spec: llama.ShardSpec) -> ModelFile:
        """Our own copy of the root's model, or else our slice of it fetched from the root."""
        worker, fetch_port = self.worker, h.get("fetch_port")
        own = worker.model_path or (None if fetch_port else worker.resolve(h["model"]))
        if own is not None:
            mf = await asyncio.to_thread(open_model, own, worker.index_dir)
            if mf.fingerprint == h["fingerprint"]:
                return mf
            if not fetch_port:
                raise ValueError(f"{own}: not the root's model (fingerprint {mf.fingerprint[:12]} "
                                 f"!= {h['fingerprint'][:12]})")
        if not isinstance(fetch_port, int) or worker.key is None or worker.shard_dir is None:
            raise ValueError(f"worker {worker.node_id} has no copy of the root's model "
                             f"{h['fingerprint'][:12]} and cannot fetch its slice")
        host = self.link.sock.getpeername()[0]
        url = f"http://[{host}]:{fetch_port}" if ":" in host else f"http://{host}:{fetch_port}"
        log.info("fetching slice %s of model %s from %s", spec, h["fingerprint"][:12], url)
        latest = [0, 0]
        fetch = asyncio.ensure_future(fetch_shard(
            url, spec, worker.key, worker.shard_dir, lambda done, total: latest.__setitem__(slice(None), [done, total]),
            node_id=worker.node_id, fingerprint=h["fingerprint"], cache_bytes=worker.shard_cache_bytes))
        try:
            while not fetch.done():
                await asyncio.wait({fetch}, timeout=PROGRESS_S)
                if not fetch.done() and latest[1]:
                    await self.link.send(FrameType.PROGRESS, {"done": latest[0], "total": latest[1]})
        finally:
            fetch.cancel()
        path = fetch.result()
        if latest[1]:  # it came over the network (a cached slice reports nothing): the last word
            await self.link.send(FrameType.PROGRESS, {"done": latest[0], "total": latest[1]})
        mf = await asyncio.to_thread(open_model, path, worker.index_dir)
        source = mf.metadata.get(llama.SHARD_KEYS["source_fingerprint"])
        if source != h["fingerprint"] or llama.stored_spec(mf) != spec:
            raise ValueError(f"{mf.path}: not slice {spec} of model {h['fingerprint'][:12]}")
        return mf

    async def _reset(self, h: dict[str, Any]) -> None:
        if self.shard is None:
            raise ValueError("RESET before LOAD")
        hot = Hot(self.link, asyncio.get_running_loop())
        self.shard.reduce = WorkerReduce(hot, self.sync) if self.reduce else llama._no_reduce
        if h.get("mode") == BLOCKING:
            self.link.enter_blocking()
        try:
            await self._on_link(_hot_loop, hot, self.shard, self.mf, not self.reduce)
        finally:
            if not self.link.done:  # a thread that outlived a cut may still be on it
                self.link.leave_blocking()

    HANDLERS = {
        FrameType.PING: _ping,
        FrameType.PROFILE: _profile,
        FrameType.LOAD: _load,
        FrameType.RESET: _reset,
    }


def _embeds(mf: ModelFile) -> bool:
    """Whether this file holds the whole embedding table (a shard file holds its vocab rows at most)."""
    return mf.has("token_embd.weight") and llama.stored_spec(mf) is None


def _warm_up(shard: llama.Shard) -> None:
    """Compile (or load from numba's cache) every kernel before the first real token."""
    reduce, shard.reduce = shard.reduce, llama._no_reduce
    try:
        x = np.zeros((2, shard.w.cfg.dim), np.float32)
        if shard.w.cfg.dim % 32 == 0:  # the Q8_0 sync kernels too, not on the first real token
            quant.dequantize_q8_0(quant.quantize_q8_0(x[0]), shard.w.cfg.dim)
        shard.logits(shard.forward(x.copy(), 0))
        shard.logits(shard.forward(x[:1].copy(), 0))
        rows = min(2, shard.slots)  # the decode step of several sequences
        shard.logits_rows(shard.forward_rows(x[:rows].copy(), list(range(rows)), [1] * rows))
    finally:
        shard.reduce = reduce


def _positive(value: Any, name: str) -> int:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"LOAD: {name} must be a positive integer, got {value!r}")
    return value


def _feed(history: dict[int, list[int]], slot: int, pos: int, ids: list[int]) -> None:
    """ids now sit at pos.. of slot's history, in place: no copy of the whole history per token."""
    h = history.setdefault(slot, [])
    del h[pos:]
    h.extend(ids)


def _upto(history: dict[int, list[int]], slot: int, pos: int) -> list[int]:
    """slot's history through pos: the whole list, unless later rows of this step (a replay's run of
    one sequence) extended it already."""
    h = history[slot]
    return h if len(h) == pos + 1 else h[:pos + 1]


def _copy_of(copy: Any, history: dict[int, list[int]], slot: int, pos: int) -> tuple[int, int]:
    """A STEP's "copy": [src slot, a], checked: src holds the tokens of positions a..pos-1 here and slot
    holds those before a."""
    if not (isinstance(copy, list) and len(copy) == 2 and all(type(v) is int for v in copy)
            and copy[0] != slot and len(history.get(copy[0], ())) >= pos >= copy[1] >= 0
            and len(history.get(slot, ())) >= copy[1]):
        raise ValueError(f"STEP's copy is malformed: [src slot, a] with a slot other than {slot} that holds "
                         f"positions a..{pos - 1} here")
    return copy[0], copy[1]


def _scored_chunk(score: Any, slot: int, pos: int, ids: list[int] | None) -> batch.Chunk:
    """A STEP's "score": [n, a target per chunk row (-1: none)], checked, as the chunk it scores."""
    if not (ids is not None and isinstance(score, list) and len(score) == 2 and isinstance(score[1], list)
            and len(score[1]) == len(ids) and type(score[0]) is int and 0 <= score[0] <= sampling.MAX_LOGPROBS
            and all(type(t) is int and t >= -1 for t in score[1])):
        raise ValueError(f"STEP's score is malformed: [n in 0..{sampling.MAX_LOGPROBS}, one target >= -1 per "
                         "chunk row] with a chunk")
    return batch.Chunk(slot, pos, ids, score=score[0], targets=score[1])


def _hot_loop(hot: Hot, shard: llama.Shard, mf, hands_on: bool = False) -> None:
    """STEP after STEP until the root says end; runs on the compute thread.

    A STEP carries a decode step of several slots ("rows": [slot, pos, id]
    each), a prefill chunk of one slot ("slot", "pos", "ids", "want"), or both
    (a mixed step: one pass, each all-reduce over the rows and then the chunk's
    rows, Shard.forward_mixed). It carries the sampling parameters of what it
    asks candidates for ("params": the rows', then the chunk's when it wants
    candidates), and its payload carries the embeddings (rows first) only when
    this node has no embedding table of its own (or, for a later pipeline
    stage, the residual stream). Each slot's tokens are kept here for the
    repetition penalties. A chunk may first copy the KV (and tokens) of the
    positions before it from another slot ("copy": [src, a]; batch.Chunk.copy).
    With rows, LOGITS holds the candidates of each row, then the chunk's; a
    chunk alone answers its candidates (or every logit).

    A pipeline stage before the last answers no candidates: when it is a
    stage of its own (`hands_on`) it hands its residual stream back (HIDDEN)
    for the next stage, and inside the root's stage the root has it already.
    """
    history: dict[int, list[int]] = {}
    offset = shard.w.spec.vocab_rows[0]
    while True:
        frame = hot.recv(FrameType.STEP)
        h = frame.header
        if h.get("end"):
            return
        rows = h.get("rows") or []
        chunk = [int(t) for t in h["ids"]] if "ids" in h else None
        ids = [int(r[2]) for r in rows] + (chunk or [])
        if not ids:
            raise ValueError("STEP carries neither rows nor ids")
        if len(frame.payload):
            x = np.array(frame.array(), dtype=np.float32)  # own copy: the payload views a reused buffer
        else:
            x = llama.embed(mf, ids)
        slots, positions = [int(r[0]) for r in rows], [int(r[1]) for r in rows]
        for slot, pos, t in zip(slots, positions, ids):
            _feed(history, slot, pos, [t])
        if chunk is not None:
            slot, pos = int(h.get("slot", 0)), int(h["pos"])
            if "copy" in h:  # a prefix another slot holds: its KV and tokens, before the chunk after it
                src, a = _copy_of(h["copy"], history, slot, pos)
                shard.copy_kv(src, slot, a, pos)
                _feed(history, slot, a, history[src][a:pos])
            _feed(history, slot, pos, chunk)
            out = shard.forward_mixed(x, slots, positions, pos, slot) if rows else shard.forward(x, pos, slot=slot)
        else:
            out = shard.forward_rows(x, slots, positions)
        if shard.w.out_norm is None:
            if hands_on:
                hot.send(FrameType.HIDDEN, {}, out)
            continue
        want = "none" if chunk is None else h.get("want", "candidates")
        if want == "logits":
            hot.send(FrameType.LOGITS, {"all": True}, shard.logits(out))
            continue
        cands: list[sampling.Candidates] = []
        if rows:
            params = [sampling.SamplingParams(**p) for p in h["params"]]
            logits = shard.logits_rows(out[:len(rows)])
            cands = [sampling.candidates(logits[i], offset, _upto(history, s, at), p)
                     for i, (s, at, p) in enumerate(zip(slots, positions, params))]
        if "score" in h:
            cands += generate.scores(shard, out[len(rows):], offset, _scored_chunk(h["score"], slot, pos, chunk))
        if want == "candidates":
            p = h["params"][len(rows)] if rows else h["params"]
            cands.append(sampling.candidates(shard.logits(out[-1:])[0], offset, history[slot],
                                             sampling.SamplingParams(**p)))
        if cands:
            hot.send(FrameType.LOGITS, *candidates_rows_message(cands))
