"""The generation service on the root: slots for several sequences, a bounded queue, an event bus.

    handler --submit()--> Engine._waiting (deque, bounded) --> generation thread: batch.Scheduler
       ^                                                      (up to runner.slots sequences at once)
       +---- Job (asyncio.Queue of TokenEvents) <--call_soon_threadsafe--+
                                                   EventBus <- Token/Request/StepRecords

The runner is not re-entrant, so one thread steps it: each step decodes one
token of every running sequence and reads one prefill chunk (batch.py).
Waiting jobs take free slots between steps; a job waits in the queue only
while every slot is busy, and gets 429 only when the queue is full too.
Each token goes back to the loop with `call_soon_threadsafe`: into the job
(its consumer streams it) and onto the bus as a `TokenRecord`. A consumer
that goes away cancels its job: a queued job leaves the queue, a running
one leaves its slot at the next step.

The bus never blocks generation: each subscriber has a bounded queue and a
slow one loses records (counted in `Subscription.dropped`). Listeners
(metrics) are plain callbacks run inline, so they see every record.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

from edgetp.parallel.plan import PlanError
from edgetp.parallel.profile import mem_available
from edgetp.model.batch import ContextError, RunnerLost, Scheduler, Seq, TokenEvent
from edgetp.model.sampling import SamplingParams
from edgetp.model.tokenizer import Tokenizer
from edgetp import events

log = logging.getLogger(__name__)

STOP_GRACE_S = 30.0  # at shutdown, how long to wait for the running generation to reach its next token


class QueueFull(Exception):
    """Too many requests waiting; retry_after is a guess in whole seconds."""

    def __init__(self, waiting: int, retry_after: int) -> None:
        super().__init__(f"the server is busy: {waiting} requests are already waiting; retry in {retry_after} s")
        self.retry_after = retry_after


class EngineClosed(Exception):
    """The engine is shutting down and takes no more requests."""


class Unavailable(EngineClosed):
    """This node cannot serve the request now (no plan, even alone); the message says why. The next one is tried afresh."""


class GenerationFailed(Exception):
    """The runner raised during a generation (a worker lost, the context full...)."""


# --------------------------------------------------------------------------- event bus


class Subscription:
    """One watcher's bounded queue of records; async-iterate it until the bus closes."""

    def __init__(self, bus: EventBus, maxsize: int) -> None:
        self._bus = bus
        self._queue: asyncio.Queue[Any] = asyncio.Queue(maxsize)
        self.dropped = 0

    def _offer(self, record: Any) -> None:
        try:
            self._queue.put_nowait(record)
        except asyncio.QueueFull:
            self.dropped += 1

    def _end(self) -> None:
        while True:  # make room for the end marker, dropping the oldest record
            try:
                self._queue.put_nowait(None)
                return
            except asyncio.QueueFull:
                self._queue.get_nowait()
                self.dropped += 1

    def close(self) -> None:
        self._bus._subs.discard(self)

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Any:
        record = await self._queue.get()
        if record is None:
            raise StopAsyncIteration
        return record


class EventBus:
    """Fan-out of records to subscribers (bounded, lossy) and listeners (inline, complete). Loop thread only."""

    def __init__(self, maxsize: int = 1024) -> None:
        self.maxsize = maxsize
        self._subs: set[Subscription] = set()
        self._listeners: list[Callable[[Any], None]] = []

    def subscribe(self, maxsize: int | None = None) -> Subscription:
        sub = Subscription(self, maxsize or self.maxsize)
        self._subs.add(sub)
        return sub

    def add_listener(self, fn: Callable[[Any], None]) -> None:
        self._listeners.append(fn)

    @property
    def subscribers(self) -> int:
        return len(self._subs)

    def publish(self, record: Any) -> None:
        for fn in self._listeners:
            try:
                fn(record)
            except Exception:  # a broken listener must not stop generation
                log.exception("event listener %r failed on %s record", fn, getattr(record, "type", "?"))
        for sub in self._subs:
            sub._offer(record)

    def close(self) -> None:
        for sub in list(self._subs):
            sub._end()
        self._subs.clear()


# --------------------------------------------------------------------------- jobs


@dataclass(frozen=True)
class Request:
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    max_tokens: int
    stop: tuple[str, ...] = ()
    prompt: str = ""  # for the request record
    score: int | None = None  # score the prompt (the API's echo with logprobs): see batch.Seq.score


@dataclass(eq=False)
class Job:
    """A submitted request. Iterate it for TokenEvents; leaving `async with` cancels it if unfinished."""

    request: Request
    _engine: Engine
    _out: asyncio.Queue[TokenEvent | BaseException | None] = field(default_factory=asyncio.Queue)
    _stop: threading.Event = field(default_factory=threading.Event)
    done: bool = False
    tokens: int = 0
    cached_tokens: int = 0            # prompt tokens its slot already held (the prefix cache)
    finish_reason: str | None = None  # the last event's, or "cancelled" / "error"

    def cancel(self) -> None:
        if not self.done:
            self._stop.set()
            self._engine._drop(self)

    async def __aenter__(self) -> Job:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[TokenEvent]:
        while True:
            item = await self._out.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


# --------------------------------------------------------------------------- engine


class Engine:
    """One runner, its tokenizer and the model's name, serving up to runner.slots generations at once."""

    def __init__(self, runner: Any, tokenizer: Tokenizer, model_name: str, *, queue_size: int = 8,
                 bus: EventBus | None = None, recover: Callable[[Exception], Any] | None = None,
                 ctx: int | None = None) -> None:
        self.runner = runner
        self.recover = recover  # replaces self.runner when a node is lost mid-answer (see batch.Scheduler)
        self.between: Callable[[], Awaitable[None]] | None = None  # runs while no sequence runs: re-plans go here
        self._ctx = ctx
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.queue_size = queue_size
        self.bus = bus or EventBus()
        self._waiting: collections.deque[Job] = collections.deque()
        self._lock = threading.Lock()      # _waiting is shared with the generation thread
        self._wake = asyncio.Event()
        self._running: list[Job] = []      # jobs holding a slot (read on the loop for views)
        self._sched: Scheduler | None = None
        self._closed = False
        self._serving = False   # serve() is running
        self.failure: str | None = None  # why the last attempt to serve failed, until one succeeds
        self._durations: collections.deque[float] = collections.deque(maxlen=16)

    @property
    def ctx(self) -> int:
        return self.runner.ctx if self.runner is not None else self._ctx

    @property
    def slots(self) -> int:
        return getattr(self.runner, "slots", 1) if self.runner is not None else 0

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a slot (the running ones not counted)."""
        return len(self._waiting)

    @property
    def busy(self) -> bool:
        return bool(self._running)

    def slots_view(self) -> events.SlotsView:
        sched = self._sched
        return events.SlotsView(self.slots, len(self._running), len(self._waiting),
                                sched.batch if sched else 0, sched.prefix_hits if sched else 0,
                                sched.cached_tokens if sched else 0)

    def health(self) -> str | None:
        """None while this node can serve; else why not (its serve loop is gone, or it cannot plan even alone)."""
        if self._closed or not self._serving:
            return "the generation loop is not running"
        return self.failure

    def submit(self, request: Request) -> Job:
        """Queue a request; QueueFull when every slot is busy and `queue_size` are already waiting."""
        return self.submit_all([request])[0]

    def submit_all(self, requests: Sequence[Request]) -> list[Job]:
        """Queue every request (a request's choices), or none: QueueFull unless the free slots and the
        queue have room for all of them."""
        if self._closed:
            raise EngineClosed("the server is shutting down")
        with self._lock:
            free = self.slots - len(self._running) if self.runner is not None else 0
            if len(self._waiting) + len(requests) - max(free, 0) > self.queue_size:
                raise QueueFull(len(self._waiting), self.retry_after())
            jobs = [Job(request, self) for request in requests]
            self._waiting.extend(jobs)
        self._wake.set()
        return jobs

    def retry_after(self) -> int:
        """Seconds until a queue slot is likely free: one recent mean request time, at least 1."""
        mean = sum(self._durations) / len(self._durations) if self._durations else 1.0
        return max(1, math.ceil(mean))

    def _drop(self, job: Job) -> None:
        """A cancelled job: out of the queue if it waits there (a running one leaves its slot at the next step)."""
        with self._lock:
            waiting = job in self._waiting
            if waiting:
                self._waiting.remove(job)
        if waiting:
            self._finish(job, "cancelled", None)

    def _finish(self, job: Job, reason: str | None, error: BaseException | None) -> None:
        if job.done:
            return
        job.done = True
        job.finish_reason = reason
        job._out.put_nowait(error)

    async def serve(self) -> None:
        """Run queued jobs until cancelled; then every waiting and running job ends with EngineClosed."""
        loop = asyncio.get_running_loop()
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edgetp-generate")
        self._serving = True
        stop = threading.Event()
        try:
            while True:
                while not self._waiting:
                    self._wake.clear()
                    await self._wake.wait()
                if self.between is not None:
                    if not await self._prepare():
                        continue
                    if not self._waiting:
                        continue
                fut = loop.run_in_executor(pool, self._batch, loop, stop)
                try:
                    await asyncio.shield(fut)
                except asyncio.CancelledError:  # shutdown: stop at the next step, without blocking the loop
                    stop.set()
                    await asyncio.wait([fut], timeout=STOP_GRACE_S)
                    raise
                except Exception as exc:  # noqa: BLE001 - a bug costs the requests it held, never the engine
                    log.exception("the generation loop failed")
                    self._sched = None  # nothing it held is sure
                    with self._lock:
                        running, self._running = list(self._running), []
                    for job in running:
                        self._finish(job, "error", GenerationFailed(f"generation failed: {exc}"))
        finally:
            self._serving = False
            self._closed = True
            with self._lock:
                waiting, self._waiting = list(self._waiting), collections.deque()
            for job in waiting + self._running:
                self._finish(job, "cancelled", EngineClosed("the server is shutting down"))
            pool.shutdown(wait=False)
            self.bus.close()

    async def _prepare(self) -> bool:
        """Run `between` (connect, plan, load); on failure the oldest waiting job gets a 503 saying why.

        Serving goes on: the next job calls `between` afresh.
        """
        try:
            await self.between()
        except Exception as exc:  # noqa: BLE001 - any failure to plan must leave the loop serving
            why = f"{type(exc).__name__}: {exc}" if not str(exc) or isinstance(exc, (KeyError, TypeError)) else str(exc)
            log.error("cannot serve: %s", why, exc_info=not isinstance(exc, (OSError, ValueError, Unavailable)))
            self.failure = why
            self.bus.publish(events.ClusterEvent("error", f"cannot serve: {why}"))
            with self._lock:
                job = self._waiting.popleft() if self._waiting else None
            if job is not None:
                self._finish(job, "error", Unavailable(f"this node cannot serve now: {why}; retry later"))
            return False
        self.failure = None
        return True

    # ---------------------------------------------------------------- generation thread

    def _batch(self, loop: asyncio.AbstractEventLoop, stop: threading.Event) -> None:
        """Step every admitted sequence until none runs and none waits (or shutdown)."""
        if self._sched is None or self._sched.runner is not self.runner:
            self._sched = Scheduler(self.runner, self.tokenizer, self._recover)
        sched = self._sched
        jobs: dict[int, tuple[Job, float]] = {}   # id(seq) -> (job, start time)
        began = False
        try:
            while not stop.is_set():
                self._admit(sched, jobs, loop)
                for seq in list(sched.seqs):  # cancelled: leave at this step
                    job = seq.tag
                    if job._stop.is_set():
                        sched.drop(seq)
                        self._ended(loop, jobs.pop(id(seq)), seq, "cancelled", None)
                if not sched.seqs:
                    if not self._waiting:
                        return
                    continue
                try:
                    if not began:
                        began = True  # (ended, even half begun: runner.end skips links that are gone)
                        sched.begin()
                    runner, before = self.runner, self._counters()
                    produced = sched.step()
                except Exception as exc:  # noqa: BLE001 - every running job learns why; the engine serves on
                    self._step_failed(loop, sched, jobs, exc)
                    began = False
                    if self.runner is not sched.runner:  # a failed re-plan left none: plan before the next
                        return
                    continue
                after = self._counters()
                if self.runner is not runner:  # recovered mid-step: the new links counted from 0 in this step
                    before = {}
                self._publish_step(loop, sched)
                shares = _split(before, after, len(produced))
                for (seq, ev), (b, a) in zip(produced, shares):
                    job = seq.tag
                    _post(loop, self._deliver, job, ev, token_record(job.request.request_id, ev, b, a))
                    if ev.finish_reason is not None:
                        self._ended(loop, jobs.pop(id(seq)), seq, ev.finish_reason, None)
        finally:
            if began:
                try:
                    sched.runner.end()
                except Exception:  # noqa: BLE001 - a link that is gone ends nothing
                    log.debug("runner.end failed", exc_info=True)
            for seq in sched.drop_all() if stop.is_set() else ():
                self._ended(loop, jobs.pop(id(seq)), seq, "cancelled", EngineClosed("the server is shutting down"))

    def _recover(self, exc: Exception) -> Any:
        if self.recover is None:
            raise exc
        return self.recover(exc)

    def _admit(self, sched: Scheduler, jobs: dict[int, tuple[Job, float]], loop: asyncio.AbstractEventLoop) -> None:
        """Waiting jobs into free slots, oldest first; a prompt that cannot run ends at once."""
        while sched.free:
            with self._lock:
                if not self._waiting:
                    return
                job = self._waiting.popleft()
                self._running.append(job)
            req = job.request
            seq = Seq(req.prompt_ids, req.params, req.max_tokens, req.stop, tag=job, score=req.score)
            try:
                sched.admit(seq)
            except ContextError as exc:
                self._ended(loop, (job, time.perf_counter()), seq, "error", GenerationFailed(f"generation failed: {exc}"))
                continue
            jobs[id(seq)] = (job, time.perf_counter())
            job.cached_tokens = seq.cached
            _post(loop, self.bus.publish, events.RequestRecord(
                req.request_id, "started", req.prompt, prompt_tokens=len(req.prompt_ids),
                cached_tokens=seq.cached, slot=seq.slot))

    def _step_failed(self, loop, sched: Scheduler, jobs: dict[int, tuple[Job, float]], exc: Exception) -> None:
        """A step raised: nothing in the KV caches is sure any more, so every running job fails with the reason."""
        # a lost node, or a re-plan that found no plan (memory), is said in one line; anything else is a bug
        log.error("generation step failed: %s", exc, exc_info=not isinstance(exc, (RunnerLost, PlanError)))
        _post(loop, self.bus.publish, events.ClusterEvent("error", f"generation failed: {exc}"))
        for seq in sched.drop_all():  # a node lost for good is a 503 to retry, not a server fault
            error = (Unavailable(f"a node was lost and no plan could be made without it: {exc}; retry later")
                     if isinstance(exc, (RunnerLost, PlanError)) else GenerationFailed(f"generation failed: {exc}"))
            self._ended(loop, jobs.pop(id(seq)), seq, "error", error)
        try:
            sched.runner.end()
        except Exception:  # noqa: BLE001
            log.debug("runner.end failed", exc_info=True)

    def _ended(self, loop, entry: tuple[Job, float], seq: Seq, reason: str, error: BaseException | None) -> None:
        job, t0 = entry
        req = job.request
        with self._lock:
            if job in self._running:
                self._running.remove(job)
        self._durations.append(time.perf_counter() - t0)
        record = events.RequestRecord(req.request_id, "finished", req.prompt, reason, len(req.prompt_ids),
                                      seq.index, seq.cached, seq.slot if seq.slot >= 0 else None)

        cached = seq.cached  # (with what was copied from other slots while it read its prompt)

        def finish() -> None:
            job.cached_tokens = cached
            self.bus.publish(record)
            self._finish(job, reason, error)

        _post(loop, finish)

    def _publish_step(self, loop, sched: Scheduler) -> None:
        for kind, n, ms, mixed in sched.last:
            _post(loop, self.bus.publish, events.StepRecord(kind, n, ms, len(sched.seqs), len(self._waiting), mixed))

    def _counters(self) -> dict[str, Any]:
        """Link counters of the runner in use (a recovery may have replaced it)."""
        counters = getattr(self.runner, "counters", None)
        return counters() if counters else {}

    def _deliver(self, job: Job, ev: TokenEvent, record: events.TokenRecord) -> None:
        if not job.done:
            job._out.put_nowait(ev)
        if ev.answered:  # (a scored prompt's token-less finish is no token)
            job.tokens += 1
            self.bus.publish(record)


def _post(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    """fn(*args) on the loop, from the generation thread; nothing once the loop is closed (shutdown)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        log.debug("event loop closed; dropped %s", fn)


def _split(before: dict[str, Any], after: dict[str, Any], n: int) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The step's link counters (before, after) for each of its n tokens: the first token carries
    the step's traffic, the others none, so per-token records add up to what the links moved."""
    return [(before, after)] + [(after, after)] * (n - 1) if n else []


def token_record(request_id: str, ev: TokenEvent, before: dict[str, Any], after: dict[str, Any]) -> events.TokenRecord:
    """A TokenRecord from an event and the runner's link counters around its step (sync = time blocked on links)."""
    links: dict[str, events.LinkBytes] = {}
    sync_s = 0.0
    for name, now in after.items():
        was = before.get(name)
        d = now.minus(was) if was is not None else now
        links[name] = events.LinkBytes(d.sent, d.received)
        sync_s += d.send_s + d.recv_s
    sync_ms = min(sync_s * 1000, ev.ms)
    return events.TokenRecord(request_id, ev.index, ev.text, ev.ms, ev.ms - sync_ms, sync_ms, links)


def local_view(model_name: str, config: Any = None, node_id: str | None = None) -> events.ClusterView:
    """The cluster of one node: this process, the root, holding every slice of `config` (a ModelConfig)."""
    shares = {}
    if config is not None:
        shares = {"kv_groups": (0, config.n_kv_heads), "ffn_cols": (0, config.ffn), "vocab_rows": (0, config.vocab)}
    node = events.NodeView(node_id or socket.gethostname(), "local", "root", "ready", 0.0, mem_available(), **shares)
    return events.ClusterView(0, node.node_id, model_name, (node,))
