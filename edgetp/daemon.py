"""The composition root of `edgetp serve`: builds every part and owns it until shutdown.

What it serves today is a root over a static set of workers (`--workers`),
or the whole model alone: the engine, the OpenAI-compatible API, the
event stream and metrics. A worker lost mid-answer is planned around and
the answer goes on. Discovery and election (edgetp/cluster) will feed the
worker list here instead of the command line.

Shutdown is cancellation (SIGTERM and Ctrl-C take the same path).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from edgetp.model import quant
from edgetp.model.generate import LocalRunner
from edgetp.model.gguf import ModelFile, open_model
from edgetp.model.tokenizer import Tokenizer
from edgetp.parallel.runner import ClusterRunner, WorkerLost
from edgetp.serve import events
from edgetp.serve.api import make_app, run_api
from edgetp.serve.root import Engine, EventBus, local_view

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeOptions:
    model_path: Path
    model_name: str
    host: str = "127.0.0.1"
    port: int = 7711
    workers: tuple[str, ...] = ()
    weights: tuple[float, ...] | None = None
    sync: str = "f32"
    ctx: int = 2048
    threads: int | None = None
    key: bytes | None = None
    queue_size: int = 8
    index_dir: Path | None = None


def cluster_view(runner: ClusterRunner, model: str) -> events.ClusterView:
    nodes = []
    for info, share in zip(runner.nodes, runner.plan.shares):
        nodes.append(events.NodeView(
            node_id=info.node_id, address=info.address, role="root" if info.address == "local" else "worker",
            state="ready", speed=info.speed, mem_free=info.mem_free, kv_groups=tuple(share.kv_groups),
            ffn_cols=tuple(share.ffn_cols), vocab_rows=tuple(share.vocab_rows),
            rtt_ms=None if info.address == "local" else info.rtt_ms))
    return events.ClusterView(runner.plan.epoch, runner.nodes[0].node_id, model, tuple(nodes))


class Recovery:
    """Replaces the engine's runner when a worker is lost: called on the generation thread."""

    def __init__(self, engine: Engine, bus: EventBus, loop: asyncio.AbstractEventLoop) -> None:
        self.engine, self.bus, self.loop = engine, bus, loop

    def __call__(self, exc: WorkerLost) -> ClusterRunner:
        old: ClusterRunner = self.engine.runner
        self._publish(events.ClusterEvent("leave", f"worker {exc.link_name} lost: {exc}", exc.link_name,
                                          old.plan.epoch))
        new = asyncio.run_coroutine_threadsafe(old.without(exc.link_name), self.loop).result(600)
        self.engine.runner = new
        self._publish(events.ClusterEvent(
            "replan", f"re-planned over {len(new.nodes)} node(s)", None, new.plan.epoch,
            {"nodes": {s.node_id: {"kv_groups": list(s.kv_groups), "ffn_cols": list(s.ffn_cols),
                                   "vocab_rows": list(s.vocab_rows)} for s in new.plan.shares}}))
        return new

    def _publish(self, record: events.ClusterEvent) -> None:
        self.loop.call_soon_threadsafe(self.bus.publish, record)


async def serve(opts: ServeOptions, on_listening: Callable[[str], None] | None = None) -> None:
    """Build the engine and the API, serve until cancelled, then close every link."""
    if opts.threads:
        quant.set_threads(opts.threads)
    mf = await asyncio.to_thread(open_model, opts.model_path, opts.index_dir)
    tok = Tokenizer.from_metadata(mf.metadata)
    bus = EventBus()
    ctx = min(opts.ctx, mf.config.ctx_train)
    if opts.workers:
        runner = await ClusterRunner.connect(mf, list(opts.workers), ctx=ctx, weights=opts.weights, sync=opts.sync,
                                             key=opts.key, threads=opts.threads)
    else:
        runner = await asyncio.to_thread(LocalRunner, mf, ctx)
    engine = Engine(runner, tok, opts.model_name, queue_size=opts.queue_size, bus=bus)
    if opts.workers:
        engine.recover = Recovery(engine, bus, asyncio.get_running_loop())
    app = make_app(engine, cluster_view=_view(engine, mf, opts.model_name), key=opts.key)
    try:
        await run_api(app, opts.host, opts.port, on_listening)
    finally:
        close = getattr(engine.runner, "close", None)
        if close:
            close()


def _view(engine: Engine, mf: ModelFile, model: str) -> Callable[[], events.ClusterView]:
    def view() -> events.ClusterView:
        if isinstance(engine.runner, ClusterRunner):
            return cluster_view(engine.runner, model)
        return local_view(model, mf.config)
    return view


def run(opts: ServeOptions, on_listening: Callable[[str], None] | None = None,
        stop_signals: Sequence[int] = (signal.SIGTERM,)) -> None:
    """asyncio.run(serve(...)) with the stop signals cancelling it, like Ctrl-C does."""

    async def main() -> None:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in stop_signals:
            loop.add_signal_handler(sig, task.cancel)
        try:
            await serve(opts, on_listening)
        except asyncio.CancelledError:
            log.info("stopped")

    asyncio.run(main())
