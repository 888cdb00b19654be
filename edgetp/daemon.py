"""The composition root of `edgetp serve`: builds every part and owns it until shutdown.

Three ways to serve, one engine and API in front of each:
- alone: the whole model in this process;
- static: a root over `--workers` given on the command line;
- cluster (a key and no `--workers`): every node runs a worker, the API and
  membership (mDNS + heartbeats + election). The elected root plans over
  the usable peers before each request (a join, a leave or a re-profile
  re-plans between requests); other nodes forward requests to it. A worker
  without the root's model fetches just its slice from the root's API
  (serve/weights.py); a node with no model at all never leads. A worker lost mid-answer
  is planned around and the answer goes on; a lost root is replaced by the
  next election.

Shutdown is cancellation (SIGTERM and Ctrl-C take the same path); in
cluster mode it withdraws our mDNS record first, so peers re-plan at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Awaitable, Callable, Sequence

from aiohttp import web
from gguf import GGMLQuantizationType as QT

from edgetp import store
from edgetp.parallel import pipeline, profile
from edgetp.parallel.shard import local_slots
from edgetp.cluster.discovery import PeerAdvert
from edgetp.cluster.membership import Membership, data_address, http_url, http_urls
from edgetp.cluster.peering import PeerEndpoints
from edgetp.cluster.sdnotify import Notifier
from edgetp.model import quant
from edgetp.model.batch import Rebalance, RunnerLost
from edgetp.model.generate import LocalRunner, warm
from edgetp.model.gguf import ModelFile, open_model
from edgetp.model.tokenizer import Tokenizer
from edgetp.net import auth
from edgetp.net.link import LinkClosed
from edgetp.net.loopthread import in_daemon_thread
from edgetp.parallel.runner import ClusterRunner, connect_around
from edgetp import events
from edgetp.serve.backoff import Backoff
from edgetp.serve.static import StaticRoot
from edgetp.serve.api import NoRoot, make_app, run_api, serving
from edgetp.serve.root import Engine, EventBus, local_view
from edgetp.serve.watch import unless
from edgetp.serve.weights import ShardServer
from edgetp.serve.worker import Worker

log = logging.getLogger(__name__)

WATCH_S = 0.25  # how often a plan being made checks that its peers still answer heartbeats


@dataclass(frozen=True)
class ServeOptions:
    model_path: Path | None         # None: hold no model, fetch slices from the root (cluster only)
    model_name: str
    host: str = "127.0.0.1"
    port: int = 7711
    workers: tuple[str, ...] = ()
    weights: tuple[float, ...] | None = None
    sync: str = "f32"
    sync_pieces: int = 1            # a decode step's partials in this many pieces (passes.Pieces)
    ctx: int = 2048
    slots: int = 4                  # sequences decoded at once (the planner may give fewer)
    kv_type: str = "f16"            # what every node's KV caches hold: "f16", "f32" or "q8_0"
    parallel: str = "auto"          # plan kind: "auto", "tp" or "pp" (parallel/pipeline.py)
    experts: str = "auto"           # a mixture's experts: "auto", "columns", "place" or "mixed" (parallel/experts.py)
    threads: int | None = None
    key: bytes | None = None
    queue_size: int = 8
    index_dir: Path | None = None
    cluster: bool = False           # discover peers and elect a root (needs a key)
    data_port: int = 7710
    node_id: str | None = None
    priority: int = 0
    no_root: bool = False
    interfaces: tuple[str, ...] = ()
    peers: tuple[tuple[str, int], ...] = ()  # (host, HTTP port) told we are here, where multicast cannot pass
    shard_dir: Path | None = None   # slices written for workers (root) or fetched from the root (worker)
    api_tokens: tuple[str, ...] = ()  # bearer tokens for the OpenAI API (serve/api.py: who may call what)
    max_memory: int | None = None   # bytes edgetp may use in all (parallel/profile.limit_memory); None: no cap
    slice_cache: int | None = None  # bytes of slices kept in shard_dir (store/slices.py); None: no cap
    heartbeat: tuple[float, float, float] = (1.0, 3.0, 1.0)  # seconds: interval, loss timeout, settle (Membership)


def cluster_view(runner: ClusterRunner, model: str) -> events.ClusterView:
    nodes = []
    shares = {s.node_id: s for s in runner.plan.shares}
    n_layers, n_experts = runner.plan.shape.n_layers, runner.plan.shape.n_experts
    hits = runner.shard.expert_hits.sum(axis=0)  # every node routes alike: the root's counts are everyone's
    for info in runner.nodes:
        share = shares.get(info.node_id)  # None: left out of the plan
        spans = {} if share is None else dict(kv_groups=tuple(share.kv_groups), ffn_cols=tuple(share.ffn_cols),
                                              vocab_rows=tuple(share.vocab_rows), stage=info.stage,
                                              layers=tuple(share.layers or (0, n_layers)))
        if share is not None and n_experts:
            a, b = share.experts or (0, n_experts)
            spans |= dict(experts=(a, b), expert_hits=tuple(int(h) for h in hits[a:b]))
        nodes.append(events.NodeView(
            node_id=info.node_id, address=info.address, role="root" if info.address == "local" else "worker",
            state="ready" if share is not None else "idle", speed=info.speed, mem_free=info.mem_free,
            rtt_ms=None if info.address == "local" else info.rtt_ms,
            rtt_p90_ms=None if info.address == "local" else info.rtt_p90_ms,
            mbps=None if info.address == "local" else info.mbps, machine=info.host[:8] if info.host_speed else None,
            host_speed=info.host_speed or None, **spans))
    return events.ClusterView(runner.plan.epoch, runner.nodes[0].node_id, model, tuple(nodes),
                              plan=pipeline.describe(runner.plan))


def replan_event(runner: ClusterRunner) -> events.ClusterEvent:
    """The `replan` record of a new plan: every node's shares, for the log and the dashboard."""
    return events.ClusterEvent(
        "replan", f"planned over {len(runner.plan.nodes)} node(s): {pipeline.describe(runner.plan)}", None,
        runner.plan.epoch,
        {"nodes": {s.node_id: {"kv_groups": list(s.kv_groups), "ffn_cols": list(s.ffn_cols),
                               "vocab_rows": list(s.vocab_rows)}
                   | ({"layers": list(s.layers)} if s.layers else {})
                   | ({"experts": list(s.experts)} if s.experts else {}) for s in runner.plan.shares},
         "plan": pipeline.describe(runner.plan)})


class Recovery:
    """Replaces the engine's runner when a worker is lost: called on the generation thread."""

    def __init__(self, engine: Engine, bus: EventBus, loop: asyncio.AbstractEventLoop,
                 epoch: Callable[[], int] | None = None,
                 view: Callable[[], events.ClusterView] | None = None,
                 replan: Callable[[ClusterRunner, RunnerLost], Awaitable[ClusterRunner]] | None = None) -> None:
        self.engine, self.bus, self.loop = engine, bus, loop
        self.epoch = epoch  # in a cluster the election owns epochs; alone, a re-plan starts the next one
        self.view = view    # a fresh snapshot for watchers after the re-plan
        self.replan = replan  # in a cluster, Roles.recovered: over the members; alone, the runner's own

    def __call__(self, exc: RunnerLost) -> ClusterRunner:
        old: ClusterRunner = self.engine.runner
        if isinstance(exc, Rebalance):
            self._publish(events.ClusterEvent("rebalance", f"re-planning: {exc}", None, old.plan.epoch))
        else:
            self._publish(events.ClusterEvent("leave", f"worker {exc.link_name} lost: {exc}", exc.link_name,
                                              old.plan.epoch))
        epoch = self.epoch() if self.epoch else None
        replanning = self.replan(old, exc) if self.replan else old.recovered(exc, epoch)
        try:
            new = asyncio.run_coroutine_threadsafe(replanning, self.loop).result(600)
        except BaseException:  # no plan holds now (nor a view of one): the next request plans afresh
            old.close()
            self.engine.runner = None
            raise
        self.engine.runner = new
        self._publish(replan_event(new))
        if self.view is not None:
            self._publish(self.view())
        return new

    def _publish(self, record: events.ClusterEvent) -> None:
        self.loop.call_soon_threadsafe(self.bus.publish, record)


async def serve(opts: ServeOptions, on_listening: Callable[[str], None] | None = None,
                status: Callable[[str], None] = lambda line: None,
                on_engine: Callable[[Engine], None] = lambda engine: None,
                on_roles: Callable[[Roles], None] = lambda roles: None) -> None:
    """Build the engine and the API, serve until cancelled, then close every link."""
    profile.limit_memory(opts.max_memory)
    if opts.cluster:
        return await serve_cluster(opts, on_listening, status, on_engine, on_roles)
    if opts.model_path is None:
        raise ValueError("only a cluster member (--key, no --workers) can serve without a model")
    if opts.threads:
        quant.set_threads(opts.threads)
    mf = await asyncio.to_thread(open_model, opts.model_path, opts.index_dir)
    tok = Tokenizer.from_metadata(mf.metadata)
    await _warm(mf, tok, opts.kv_type)
    bus = EventBus()
    ctx = min(opts.ctx, mf.config.ctx_train)
    static = None
    if opts.workers:  # a worker that does not answer is planned without, and taken back once it does
        static = StaticRoot(mf, opts.workers, opts.weights, bus.publish, ctx=ctx, sync=opts.sync, key=opts.key,
                            threads=opts.threads, slots=opts.slots, kv_type=opts.kv_type, parallel=opts.parallel,
                            experts=opts.experts, sync_pieces=opts.sync_pieces)
        runner = await static.connect()
    else:
        slots = local_slots(mf, ctx, opts.slots, opts.kv_type, profile.memory_free())
        if slots < opts.slots:
            log.warning("%d slots of %d positions do not fit this machine's free memory beside the model: "
                        "serving %d", opts.slots, ctx, slots)
        runner = await asyncio.to_thread(LocalRunner, mf, ctx, slots, opts.kv_type)
    engine = Engine(runner, tok, opts.model_name, queue_size=opts.queue_size, bus=bus, ctx=ctx)
    on_engine(engine)
    view = _view(engine, mf, opts.model_name, static)
    if static is not None:
        static.holder, engine.between = engine, static.between
        static.planned = lambda r: (bus.publish(replan_event(r)), bus.publish(view()))  # watchers see it at once
        engine.recover = Recovery(engine, bus, asyncio.get_running_loop(), view=view)
    app = make_app(engine, cluster_view=view, key=opts.key, tokens=opts.api_tokens)
    try:
        await run_api(app, opts.host, opts.port, on_listening)
    finally:
        close = getattr(engine.runner, "close", None)
        if close:
            close()


async def _warm(mf: ModelFile, tok: Tokenizer, kv_type: str) -> None:
    """Every kernel a request runs compiled (or loaded from numba's cache) before we say we serve."""
    log.info("compiling the kernels, or loading them from numba's cache")
    # not asyncio.to_thread: a cold start compiles for minutes, and asyncio.run would wait for an
    # executor thread before a SIGTERM or Ctrl-C could end the process
    seconds = await in_daemon_thread(warm, mf, tok, kv_type, name="edgetp-warm")
    log.info("kernels warm in %.1f s", seconds)


def _profile(mf: ModelFile | None, threads: int | None) -> profile.Profile:
    """This node's profile for its advert: its model's token pass (profile.token_pass); one Q8_0
    matrix for a node without the model (it fetches its slice later)."""
    return profile.profile(threads, 0.5, mf.dominant_type if mf else QT.Q8_0, None,
                           profile.token_pass(mf) if mf else None)


async def serve_cluster(opts: ServeOptions, on_listening: Callable[[str], None] | None = None,
                        status: Callable[[str], None] = lambda line: None,
                        on_engine: Callable[[Engine], None] = lambda engine: None,
                        on_roles: Callable[[Roles], None] = lambda roles: None) -> None:
    if opts.key is None:
        raise ValueError("a cluster needs a key: --key FILE (make one with `edgetp keygen`)")
    if opts.threads:
        quant.set_threads(opts.threads)
    mf = await asyncio.to_thread(open_model, opts.model_path, opts.index_dir) if opts.model_path else None
    if mf is not None:  # before the profile, which counts the runtime the compiled kernels take
        await _warm(mf, Tokenizer.from_metadata(mf.metadata), opts.kv_type)
    me = await asyncio.to_thread(_profile, mf, opts.threads)
    node_id = opts.node_id or f"{socket.gethostname().split('.')[0]}-{uuid.uuid4().hex[:6]}"
    bus = EventBus()
    bus.add_listener(lambda r: status(r.message) if isinstance(r, events.ClusterEvent) else None)
    ctx = min(opts.ctx, mf.config.ctx_train) if mf else opts.ctx
    engine = Engine(None, Tokenizer.from_metadata(mf.metadata) if mf else None, opts.model_name,
                    queue_size=opts.queue_size, bus=bus, ctx=ctx)
    on_engine(engine)
    shard_dir = opts.shard_dir or store.cache_dir() / "shards"
    worker = Worker(node_id, key=opts.key, threads=opts.threads, model_path=str(mf.path) if mf else None,
                    index_dir=str(opts.index_dir) if opts.index_dir else None, follow_epochs=True,
                    shard_dir=str(shard_dir), shard_cache_bytes=opts.slice_cache)
    shards = ShardServer(mf, opts.key, shard_dir, cache_bytes=opts.slice_cache) if mf else None
    loop = asyncio.get_running_loop()
    bound: asyncio.Future[int] = loop.create_future()
    roles: list[Roles] = []  # set once the HTTP port is known

    def this() -> Roles:
        if not roles:
            raise web.HTTPServiceUnavailable(text="this node is starting\n")
        return roles[0]

    app = make_app(engine, cluster_view=lambda: this().view(), key=opts.key, route=lambda: this().route(),
                   live=lambda url: this().live(url), tokens=opts.api_tokens)
    if shards is not None:
        shards.add_routes(app)
    PeerEndpoints(opts.key, lambda: this().membership.me, lambda advert: this().membership.introduced(advert),
                  lambda: this().reprofile(), leaving=lambda: bool(roles) and roles[0].membership.leaving
                  ).add_routes(app)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(worker.serve(opts.host, opts.data_port, bound.set_result))
        data_port = await bound
        async with serving(app, opts.host, opts.port) as url:
            http_port = int(url.rsplit(":", 1)[1])
            advert = PeerAdvert(node_id, auth.cluster_id(opts.key), data_port, http_port, me.speed, me.mem_free,
                                mf.fingerprint if mf else "", opts.priority, opts.no_root or mf is None)
            beat, lost, settle = opts.heartbeat
            membership = Membership(advert, interfaces=list(opts.interfaces) or None, publish=bus.publish,
                                    peers=opts.peers, key=opts.key, heartbeat=beat, timeout=lost, settle=settle)
            roles.append(Roles(engine, membership, mf, opts, node_id, ctx, http_port, shards))
            engine.between = roles[0].between
            on_roles(roles[0])
            engine.recover = Recovery(engine, bus, loop, lambda: membership.epoch, view=roles[0].view,
                                      replan=roles[0].recovered)
            tg.create_task(roles[0].follow_members(beat))
            if mf is None:
                log.info("node %s holds no model: it never leads, and fetches its slice from the root", node_id)
            if on_listening:
                on_listening(url)
            try:
                await membership.run()
            finally:
                roles[0].close()


class Roles:
    """What this node does for the cluster: root (plan and serve) or not (forward to the root)."""

    def __init__(self, engine: Engine, membership: Membership, mf: ModelFile | None, opts: ServeOptions,
                 node_id: str, ctx: int, http_port: int, shards: ShardServer | None) -> None:
        self.engine, self.membership, self.mf, self.opts = engine, membership, mf, opts
        self.node_id, self.ctx, self.http_port, self.shards = node_id, ctx, http_port, shards
        self.planned = -1  # membership.revision the current runner was planned at
        self.offered = -1  # membership.revision whose newcomers a running plan was last asked to take in
        self.fetching: dict[str, tuple[int, int]] = {}  # node id -> (done, total) of a slice download
        self.backoff = Backoff()  # data address -> how long it is left out after a failure

    def route(self) -> str | None:
        leader = self.membership.leader
        if leader is None:
            holders = self.mf is not None or any(p.advert.model for p in self.membership.usable())
            raise NoRoot("the cluster is forming" if holders else "no node holding a model has joined yet")
        if leader == self.node_id:
            return None
        peer = self.membership.peer(leader)
        if peer is None:
            raise NoRoot(f"the elected root {leader} is not reachable")
        return http_url(peer.advert)

    def live(self, url: str) -> bool:
        """Whether the member serving the API at `url` still answers heartbeats (lost after the loss timeout)."""
        return any(url in http_urls(p.advert) for p in self.membership.usable())

    async def between(self) -> None:
        """Before each request on the root: (re)plan when the members, their figures or the epoch changed.

        A peer that fails (refuses, cannot be resolved, breaks the protocol, cannot fit) is left out and
        tried again after a backoff; what is left serves. Raises only when not even this node alone can.
        """
        runner = self.engine.runner
        if self.membership.leader != self.node_id:
            if runner is not None:
                runner.close()
                self.engine.runner = None
            return
        names, want = self._wanted()
        revision = self.membership.revision
        if runner is not None and not any(link.closed for link in runner.links) and \
                runner.plan.epoch == self.membership.epoch and set(runner.options["addresses"]) == set(want) \
                and self.planned == revision:
            return
        if runner is not None:
            runner.close()
            self.engine.runner = None
        for address, strike in self.backoff.excluded(time.monotonic()).items():
            log.info("planning without %s for %.0f s more (failed %d time(s): %s)", address,
                     strike.until - time.monotonic(), strike.failures, strike.cause)
        self.engine.runner = await self._connect(want, names)
        self.planned = revision
        self.engine.bus.publish(replan_event(self.engine.runner))
        self.engine.bus.publish(self.view())  # watchers see the new shares and round trips at once

    def _wanted(self) -> tuple[dict[str, str], list[str]]:
        """The usable members by data address (-> node id), and those of them to plan over (not backing off)."""
        names = {data_address(p.advert): p.node_id for p in self.membership.usable()}
        self.backoff.forget(set(names))
        waiting = self.backoff.excluded(time.monotonic())
        return names, sorted(a for a in names if a not in waiting)

    async def follow_members(self, every: float) -> None:
        """Check every `every` s whether nodes joined or were lost while the root serves (offer_joins,
        cut_lost)."""
        while True:
            await asyncio.sleep(every)
            try:
                self.cut_lost()
                self.offer_joins()
            except Exception:  # noqa: BLE001 - a fault here must not end the daemon's task group
                log.exception("checking for nodes that joined or were lost failed")

    def cut_lost(self) -> None:
        """A worker of the running plan that the membership lost (no heartbeat answered for the loss
        timeout: powered off, suspended, cut off) can hold a step blocked on its link until TCP gives up,
        30-60 s later, and a suspended one's kernel keeps the connection up for ever. Its link is shut
        now instead: the step fails at once, as if the worker had closed it, and the engine's recovery
        re-plans without it and replays every running sequence."""
        runner = self.engine.runner
        if not isinstance(runner, ClusterRunner) or self.membership.leader != self.node_id:
            return
        live = {p.node_id for p in self.membership.usable()}
        for link in runner.links:
            if link.peer_id is not None and link.peer_id not in live and link.cut():
                log.warning("worker %s (%s) lost from the cluster (it left, or answered no heartbeat for %.0f s): "
                            "its link is cut, so the running plan re-plans without it", link.peer_id, link.name,
                            self.membership.timeout)

    def offer_joins(self) -> None:
        """Under unbroken load `between` never runs, so a node that joined would wait for a quiet moment.
        Instead the running plan's next decode step re-plans over the members now (batch.Rebalance),
        replaying every running sequence. Once per membership revision: a newcomer that cannot be
        planned with is left to `between`, with its backoff, not retried at every step."""
        runner, revision = self.engine.runner, self.membership.revision
        if not isinstance(runner, ClusterRunner) or not self.engine.busy or runner.due is not None \
                or self.membership.leader != self.node_id or revision in (self.planned, self.offered):
            return
        self.offered = revision
        names, want = self._wanted()
        joined = sorted(set(want) - set(runner.options["addresses"]))
        if joined:
            self.planned = revision  # the re-plan takes them in; if it cannot, `between` sees them missing
            runner.due = Rebalance(f"{', '.join(names[a] for a in joined)} joined", want)

    async def recovered(self, old: ClusterRunner, exc: RunnerLost) -> ClusterRunner:
        """The runner that takes over mid-answer after exc, planned as `between` plans: over the members
        that still answer heartbeats, a lost worker left out for its backoff, any peer that fails on the
        way left out too. (Planning over the old plan's other workers, as ClusterRunner.recovered does,
        waited out the handshake timeout of a second worker lost at the same moment, suspended or
        powered off, and then failed every running answer.)"""
        old.close()
        lost = None if isinstance(exc, Rebalance) else getattr(exc, "link_name", None)
        if lost:
            self.backoff.failed(lost, str(exc), time.monotonic())
        names, want = self._wanted()
        log.warning("re-planning over %d node(s), epoch %d: %s", len(want) + 1, self.membership.epoch, exc)
        return await self._connect(want, names)

    async def _connect(self, addresses: list[str], names: dict[str, str]) -> ClusterRunner:
        """A runner over every peer that works; each that fails is left out (with a backoff) and logged.

        Bounded: every failed attempt drops at least one peer, and the last one is this node alone.
        """
        def left_out(address: str, exc: Exception) -> None:
            cause = f"{type(exc).__name__}: {exc}" if not str(exc) else str(exc)
            now = time.monotonic()
            strike = self.backoff.failed(address, cause, now)
            message = (f"planning without {names.get(address, address)} ({address}) for "
                       f"{strike.until - now:.0f} s: {cause}")
            log.warning("%s", message)
            self.engine.bus.publish(events.ClusterEvent("error", message, names.get(address), self.membership.epoch))
            if isinstance(exc, LinkClosed) and address in names:  # its link failed: did it leave unheard?
                self.membership.recheck(names[address], f"a plan could not use its data port ({cause})")

        try:
            runner = await connect_around(
                self.mf, addresses, ids=names, left_out=left_out, guard=self._unless_lost, ctx=self.ctx,
                sync=self.opts.sync, key=self.opts.key, threads=self.opts.threads, epoch=self.membership.epoch,
                node_id=self.node_id, fetch_port=self.http_port, on_progress=self._progress, slots=self.opts.slots,
                kv_type=self.opts.kv_type, parallel=self.opts.parallel, experts=self.opts.experts,
                sync_pieces=self.opts.sync_pieces)
        finally:
            self.fetching.clear()
        for address in runner.options["addresses"]:
            self.backoff.succeeded(address)
        return runner

    async def _unless_lost(self, addresses: list[str], connecting: Awaitable[ClusterRunner]) -> ClusterRunner:
        """`connecting`, given up once the membership loses one of `addresses` (no heartbeat answered for
        the loss timeout): a peer suspended or powered off mid-plan would otherwise hold the plan, and every
        answer waiting on it, for the handshake's timeout or a profile's or load's (a minute). Raises
        LinkClosed naming the lost peer (its links closed before it returns)."""
        def lost() -> LinkClosed | None:
            live = {data_address(p.advert) for p in self.membership.usable()}
            gone = [a for a in addresses if a not in live]
            return LinkClosed(f"{gone[0]} was lost from the cluster while the plan was made (no heartbeat "
                              f"answered for {self.membership.timeout:.0f} s)", gone[0]) if gone else None

        return await unless(connecting, lost, WATCH_S)

    def _progress(self, node: str, done: int, total: int) -> None:
        """A worker's PROGRESS while it fetches its slice from us (about once a second, and at the end)."""
        if done >= total:
            self.fetching.pop(node, None)
            self._transfer(node, done, total, f"{node} has its slice ({total / 1e6:.1f} MB)")
        else:
            self.fetching[node] = (done, total)
            self._transfer(node, done, total, f"{node} fetching its slice: {done / 1e6:.1f} of "
                                              f"{total / 1e6:.1f} MB ({100 * done / max(total, 1):.0f}%)")

    def _transfer(self, node: str, done: int, total: int, message: str) -> None:
        log.info("%s", message)
        self.engine.bus.publish(events.ClusterEvent("transfer", message, node, self.membership.epoch,
                                                    {"done": done, "total": total}))

    async def reprofile(self) -> PeerAdvert:
        """POST /v1/cluster/profile: measure again, announce it; the root re-plans before the next request."""
        me = await asyncio.to_thread(_profile, self.mf, self.opts.threads)
        advert = replace(self.membership.me, speed=me.speed, mem_free=me.mem_free)
        await self.membership.update_me(advert)
        return advert

    def view(self) -> events.ClusterView:
        runner = self.engine.runner
        if isinstance(runner, ClusterRunner) and self.membership.leader == self.node_id:  # not a lost lead's plan
            view = cluster_view(runner, self.opts.model_name)
            lost = {p.node_id for p in self.membership.table.peers() if not self.membership.table.alive(p)}
            planned = tuple(replace(n, state="lost") if n.node_id in lost else n for n in view.nodes)
            # and the members this plan does not hold: joined since, lost before it, or of another cluster
            others = self._members(skip={n.node_id for n in planned})
            # the membership's epoch: an election since the plan (no request yet to re-plan) shows at once
            return self._with_transfers(replace(view, epoch=self.membership.epoch, nodes=planned + others))
        leader = self.membership.leader
        nodes = (events.NodeView(self.node_id, "local", "root" if leader == self.node_id else "worker", "ready",
                                 self.membership.me.speed, self.membership.me.mem_free),) + self._members()
        root = self.membership.peer(leader) if leader and leader != self.node_id else None
        return self._with_transfers(events.ClusterView(self.membership.epoch, leader, self.opts.model_name,
                                                       nodes, http_url(root.advert) if root else None))

    def _members(self, skip: set[str] | None = None) -> tuple[events.NodeView, ...]:
        """The peers this node's membership knows, as it sees them. With skip (the root: its plan's
        nodes), the others: a settled member outside the plan is idle until a re-plan takes it in."""
        leader = self.membership.leader
        settled = {p.node_id for p in self.membership.usable()}
        nodes = []
        for p in self.membership.table.peers():
            if skip is not None and p.node_id in skip:
                continue
            state = "foreign" if p.foreign else ("lost" if not self.membership.table.alive(p) else
                                                 "joining" if p.node_id not in settled else
                                                 "ready" if skip is None else "idle")
            nodes.append(events.NodeView(p.node_id, data_address(p.advert), "root" if leader == p.node_id else "worker",
                                         state, p.advert.speed, p.advert.mem_free))
        return tuple(nodes)

    def _with_transfers(self, view: events.ClusterView) -> events.ClusterView:
        """Each node's slice download from us: in progress (state "loading") or the last one done."""
        sent = {t.node: (t.done, t.size) for t in (self.shards.transfers().values() if self.shards else ())}
        nodes = []
        for n in view.nodes:
            if n.node_id in self.fetching:
                n = replace(n, transfer=self.fetching[n.node_id], state="loading")
            elif n.node_id in sent:
                n = replace(n, transfer=sent[n.node_id])
            nodes.append(n)
        return replace(view, nodes=tuple(nodes))

    def close(self) -> None:
        if self.engine.runner is not None:
            self.engine.runner.close()


def _view(engine: Engine, mf: ModelFile, model: str, static: StaticRoot | None = None) -> Callable[[], events.ClusterView]:
    def view() -> events.ClusterView:
        if isinstance(engine.runner, ClusterRunner):
            return cluster_view(engine.runner, model)
        if static is not None:  # its last re-plan failed: no plan, rather than one node holding everything
            return static.unplanned(model)
        return local_view(model, mf.config)
    return view


def run(opts: ServeOptions, on_listening: Callable[[str], None] | None = None,
        stop_signals: Sequence[int] = (signal.SIGTERM,), notifier: Notifier | None = None,
        reload: Callable[[], int | None] | None = None) -> None:
    """asyncio.run(serve(...)): stop signals cancel it like Ctrl-C; systemd hears READY, WATCHDOG, STOPPING.

    Until READY (opening the model, profiling, the first kernel compiles) systemd's start timeout is
    extended every few seconds; WATCHDOG=1 pings stop while the engine cannot serve (Engine.health).
    With `reload` (the settings read again, giving max_memory in bytes), SIGHUP applies a new memory
    cap: the node measures again and announces it, and the next request is planned under it.
    """
    notifier = notifier or Notifier()
    extender = notifier.extending(status="opening the model, timing and compiling the kernels")
    engines: list[Engine] = []
    roles: list[Roles] = []
    reloads: set[asyncio.Task] = set()  # owned here: cancelled with the daemon

    async def reloaded() -> None:
        try:
            cap = reload()
        except ValueError as exc:  # a ConfigError: one line naming the file and the key
            log.error("reload refused, settings unchanged: %s", exc)
            return
        profile.limit_memory(cap)
        log.info("reloaded: max_memory_mb %s", "unset" if cap is None else cap >> 20)
        for r in roles:
            try:
                await r.reprofile()
            except Exception as exc:  # noqa: BLE001 - the cap holds from the next plan on regardless
                log.error("re-profile after reload failed: %s", exc)

    def listening(url: str) -> None:
        extender.stop()
        notifier.ready(f"serving on {url}")
        if on_listening:
            on_listening(url)

    def health() -> str | None:
        return engines[0].health() if engines else None

    async def main() -> None:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in stop_signals:
            loop.add_signal_handler(sig, task.cancel)
        if reload is not None:
            def on_hup() -> None:
                job = loop.create_task(reloaded())
                reloads.add(job)
                job.add_done_callback(reloads.discard)
            loop.add_signal_handler(signal.SIGHUP, on_hup)
        watchdog = asyncio.create_task(notifier.run_watchdog(health=health))
        try:
            await serve(opts, listening, notifier.status, engines.append, roles.append)
        except asyncio.CancelledError:
            notifier.stopping("leaving the cluster")
            log.info("stopped")
        finally:
            for job in (watchdog, *reloads):
                job.cancel()
            await asyncio.gather(watchdog, *reloads, return_exceptions=True)

    try:
        asyncio.run(main())
    finally:
        extender.stop()
        notifier.close()
