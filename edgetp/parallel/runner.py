"""The root's runner: the model spread over this process and its workers.

`ClusterRunner.connect` (a coroutine, on the control loop) links to every
worker, measures round trips and speeds, plans, and has each node map its
shard. After that the generation loop calls `begin/run/end` from its own
thread, exactly as it would a LocalRunner: the root embeds the tokens,
broadcasts them, runs its own shard with the all-reduce, and merges the
sampling candidates every node sends. A STEP is a decode step of several
slots (one row per sequence), a prefill chunk of one slot, or both at once
(a mixed step: the decode rows, then the chunk's rows); either way every
all-reduce carries all of its rows.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass, replace
from typing import Awaitable, Callable, Sequence

import numpy as np

from edgetp.parallel import profile
from edgetp.model import generate, llama, sampling
from edgetp.model.batch import Chunk, Rebalance, Row, RunnerLost, chunks
from edgetp.model.generate import feed
from edgetp.model.gguf import ModelFile
from edgetp.net.frames import Frame, FrameType
from edgetp.net.link import BLOCKING, Counters, Link, LinkClosed, choose_mode, event_loop_hop, forced_mode
from edgetp.parallel import cost, packing, pipeline, plan as planner
from edgetp.parallel import experts as expert_plan
from edgetp.parallel.rebalance import StepWatch
from edgetp.parallel.collective import Hot, RootReduce, candidates_rows_from
from edgetp.parallel.shard import model_shape, spec_for

log = logging.getLogger(__name__)

ROOT_ID = "root"
LOAD_TIMEOUT = 600.0  # seconds a worker may take to map its shard, or between two download PROGRESS frames

Progress = Callable[[str, int, int], None]  # (node id, bytes done, bytes total) of a slice download


class WorkerLost(LinkClosed, RunnerLost):
    """A worker stopped answering during a generation; .link_name is its address."""


def _lost(exc: LinkClosed) -> WorkerLost:
    return WorkerLost(str(exc), exc.link_name)


async def culprits_of(exc: Exception, addresses: Sequence[str], ids: dict[str, str]) -> set[str]:
    """Which of `addresses` a failed connect or plan is to blame on; all of them when it cannot be told.

    A LinkClosed names its link, a PlanError the node too small (by `ids`: address -> node id, or by
    its address, a node that gave no id); else each address's data port is tried (a refusal or a
    name that does not resolve shows up there). A PlanError that names no worker (the root, or the
    whole cluster too small) is not a worker's fault: it is raised.
    """
    if isinstance(exc, LinkClosed) and exc.link_name in addresses:
        return {exc.link_name}
    if isinstance(exc, planner.PlanError):
        by_id = {a: a for a in addresses} | {node: a for a, node in ids.items() if a in addresses}
        if exc.node_id in by_id:
            return {by_id[exc.node_id]}
        raise exc
    bad = {a for a, ok in zip(addresses, await asyncio.gather(*(reachable(a) for a in addresses))) if not ok}
    if not bad:
        log.warning("cannot tell which worker made planning fail (%s: %s); planning without all %d",
                    type(exc).__name__, exc, len(addresses))
    return bad or set(addresses)


async def connect_around(mf: ModelFile, addresses: Sequence[str], *, weights: Sequence[float] | None = None,
                         ids: dict[str, str] | None = None,
                         left_out: Callable[[str, Exception], None] = lambda address, exc: None,
                         guard: Callable[[list[str], Awaitable["ClusterRunner"]], Awaitable["ClusterRunner"]] | None
                         = None, **connect) -> "ClusterRunner":
    """ClusterRunner.connect over `addresses`, each worker that fails on the way left out (culprits_of;
    `left_out(address, why)` hears of it) and the plan made again. `weights`: the root's, then each
    address's; `guard(chosen, connecting)`, if given, awaits each attempt (the daemon's gives up on a
    peer its membership loses). Bounded: every failed attempt drops a worker or more; the last plans
    the root alone."""
    chosen = list(addresses)
    for _ in range(len(chosen) + 1):
        try:
            connecting = ClusterRunner.connect(mf, chosen, weights=None if weights is None else
                                               [weights[0]] + [weights[addresses.index(a) + 1] for a in chosen],
                                               **connect)
            return await (connecting if guard is None else guard(list(chosen), connecting))
        except Exception as exc:  # noqa: BLE001 - whatever a worker did, plan without it
            if not chosen:
                raise
            for address in await culprits_of(exc, chosen, ids or {}):
                left_out(address, exc)
                chosen.remove(address)
    raise AssertionError("not reached: the last attempt plans the root alone")


async def reachable(address: str, timeout: float = 3.0) -> bool:
    """Whether HOST:PORT accepts a TCP connection (closed at once)."""
    host, _, port = address.rpartition(":")
    try:
        async with asyncio.timeout(timeout):
            _, writer = await asyncio.open_connection(host.strip("[]"), int(port))
    except (OSError, asyncio.TimeoutError, ValueError):
        return False
    writer.close()
    return True


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    address: str        # "local" for the root itself
    speed: float        # measured weight bytes/s (the plan uses the given weights instead, if any)
    mem_free: int
    rtt_ms: float
    mode: str           # link mode during generations
    rss: int = 0        # resident bytes after loading the shard
    rtt_p90_ms: float = 0.0
    mbps: float = 0.0   # measured throughput toward the node, Mbit/s (0: not measured, the root itself)
    stage: int = 0      # its pipeline stage; -1: left out of the plan (idle)
    layers: tuple[int, int] | None = None  # the layers of its stage (None: every layer)
    round_ms: float = 0.0  # an all-reduce round of one row in blocking mode (0: not measured: an asyncio link)
    host: str = ""         # the machine it runs on (profile.host_id)
    host_speed: float = 0.0  # bytes/s every node on that machine read together (0: it shares the machine with none)
    row_cost: float = 0.0  # each further token of a decode step, relative to the first (profile.Profile.row_cost)

    def spec(self, speed: float) -> planner.NodeSpec:
        """This node for the planner, at `speed`; its machine named only where it shares it."""
        shared = self.host_speed > 0
        return planner.NodeSpec(self.node_id, speed, self.mem_free, self.host if shared else "", self.host_speed,
                                self.row_cost)

    def link_cost(self) -> cost.LinkCost:
        """The root's link to this node, for the cost model."""
        return cost.LinkCost(self.rtt_ms / 1e3, max(self.mbps, 1e-3) * 1e6 / 8, self.round_ms / 1e3)


class ClusterRunner:
    def __init__(self, mf: ModelFile, ctx: int, plan: planner.Plan, links: list[Link],
                 shard: llama.Shard, nodes: list[NodeInfo], loop: asyncio.AbstractEventLoop,
                 options: dict | None = None) -> None:
        self.options = options or {}  # connect() arguments, for a re-plan
        self.mf = mf
        self.ctx = ctx
        self.slots = shard.slots
        self.plan = plan
        self.links = links  # the workers of the plan, in its node order
        self.shard = shard
        self.nodes = nodes
        self.loop = loop
        self.hots = [Hot(link, loop) for link in links]
        mine = len(plan.stages[0]) - 1  # the workers in the root's stage: its tensor-parallel group
        self.group, self.chain = self.hots[:mine], self.hots[mine:]  # the chain: one worker per later stage
        if self.group:
            self.shard.reduce = RootReduce(self.group, plan.sync)
        self.answering = self.chain[-1:] if self.chain else self.group  # who sends LOGITS
        self.offset = shard.w.spec.vocab_rows[0]
        # measured speeds can change under us; given ones (--weights) cannot
        self.watch = StepWatch() if self.options.get("weights") is None and self.options.get("rebalance", True) \
            and links else None
        self.due: Rebalance | None = None  # set: the next step with decode rows re-plans instead (the watch, or joins)

    # ------------------------------------------------------------------ set-up (on the loop)
    @classmethod
    async def connect(cls, mf: ModelFile, addresses: Sequence[str], *, ctx: int, weights: Sequence[float] | None = None,
                      sync: str = "f32", key: bytes | None = None, threads: int | None = None,
                      model_ref: str | None = None, epoch: int = 1,
                      node_id: str = ROOT_ID, fetch_port: int | None = None,
                      on_progress: Progress | None = None, slots: int = 1, kv_type: str = "f16",
                      parallel: str = "tp", layout: Sequence[Sequence[int]] | None = None,
                      rebalance: bool = True, experts: str = "auto", sync_pieces: int = 1) -> "ClusterRunner":
        """Link to every worker, profile, plan and load.

        `parallel` is the plan kind: "tp" (tensor parallelism over every node), "pp" (a pipeline,
        one stage per node) or "auto" (the cost model's choice over every kind and subset of the
        workers, for `slots` concurrent streams; workers left out are let go and shown idle).
        `layout` forces the stages instead (tools/bench_links.py measures every kind): node indices
        per stage, 0 the root, the rest in address order; an empty first stage is a root that
        runs no layer. With `rebalance` (and measured speeds), decode steps that become steadily
        slower than they began raise batch.Rebalance: see `recovered`.

        With `fetch_port` (our HTTP port, serving serve/weights.py) a worker
        without our model fetches its slice from us; `on_progress(node_id,
        done, total)` hears how far each such download got. `experts` (a mixture of experts):
        "columns" splits every expert's columns, "place" places whole experts, "mixed" groups nodes
        over ranges of experts split by columns, "auto" lets the
        cost model choose (parallel/experts.py). `sync_pieces` > 1 sends a decode step's partials in that
        many pieces, each while the next computes (passes.Pieces).
        """
        options_slots = slots  # what was asked for: a re-plan asks again
        if weights is not None and len(weights) != len(addresses) + 1:
            raise ValueError(f"--weights needs {len(addresses) + 1} numbers (the root first), got {len(weights)}")
        links: list[Link] = []
        try:
            for addr in addresses:
                host, _, port = addr.rpartition(":")
                link = await Link.connect(host, int(port))
                links.append(link)
                await _hello(link, key, node_id, epoch)
            hop = await event_loop_hop()
            seconds = 0.5 if weights is None else 0.05
            shapes = profile.token_pass(mf)  # every node times the model's own matrices, as decode calls them
            mine = await asyncio.to_thread(profile.profile, threads, seconds, mf.dominant_type, None, shapes)
            infos = [NodeInfo(node_id, "local", mine.speed, mine.mem_free, 0.0, "local", host=mine.host,
                              row_cost=mine.row_cost)]
            for link in links:
                st = await link.measure()
                link.hot_mode = choose_mode(st.rtt_ms / 1e3, hop, forced_mode())
                # an all-reduce round as generations run it: in blocking mode, without the event loop's hops
                round_ms = await link.measure_rounds(mf.config.dim) * 1e3 if link.hot_mode == BLOCKING else 0.0
                log.info("link %s: rtt %.3f ms (p90 %.3f), %.0f Mbit/s, event-loop hop %.3f ms -> %s mode during "
                         "generations%s", link.name, st.rtt_ms, st.rtt_p90_ms, st.mbps, hop * 1e3, link.hot_mode,
                         f", all-reduce round {round_ms:.3f} ms" if round_ms else "")
                rep = await link.request(FrameType.PROFILE, {"seconds": seconds, "qtype": mf.dominant_type,
                                                              "pass": shapes}, FrameType.READY, timeout=60)
                infos.append(NodeInfo(link.peer_id or link.name, link.name, rep.header["speed"],
                                      int(rep.header["mem_free"]), st.rtt_ms, link.hot_mode,
                                      rtt_p90_ms=st.rtt_p90_ms, mbps=st.mbps, round_ms=round_ms,
                                      host=_host_of(rep.header), row_cost=_row_cost_of(rep.header)))
            if weights is None:
                infos = await _together(infos, links, seconds, mf.dominant_type, threads, shapes)
            speeds = [float(w) for w in weights] if weights is not None else [i.speed for i in infos]
            nodes = [i.spec(s) for i, s in zip(infos, speeds)]
            costs = {i.node_id: i.link_cost() for i in infos[1:]}
            plan, slots = _plan(mf, ctx, slots, nodes, epoch, sync, kv_type, parallel, costs, layout)
            plan = expert_plan.choose(plan, costs, slots, experts)
            log.info("plan (epoch %d, %s sync, %d slots): %s", plan.epoch, plan.sync, slots,
                     "; ".join(f"{s.node_id} kv{s.kv_groups} ffn{s.ffn_cols} vocab{s.vocab_rows}"
                               + (f" layers{s.layers}" if s.layers else "")
                               + (f" experts{s.experts}" if s.experts else "") for s in plan.shares))
            links, infos = _arrange(plan, links, infos)
            header = {"model": model_ref or str(mf.path), "fingerprint": mf.fingerprint, "ctx": ctx,
                      "sync": sync, "slots": slots, "kv_type": kv_type, "sync_pieces": sync_pieces} | ({"fetch_port": fetch_port} if fetch_port else {})
            group = {x.node_id for x in plan.stages[0]}
            for link, info in zip(links, infos[1:]):
                spec = spec_for(plan, info.node_id)
                await link.send(FrameType.LOAD, header | {"kv_groups": list(spec.kv_groups),
                                                          "ffn_cols": list(spec.ffn_cols),
                                                          "vocab_rows": list(spec.vocab_rows),
                                                          "reduce": info.node_id in group}
                                | ({"layers": list(spec.layers)} if spec.layers is not None else {})
                                | ({"experts": list(spec.experts)} if spec.experts is not None else {}))
            weights_root = await asyncio.to_thread(llama.load_weights, mf, spec_for(plan, node_id))
            shard = llama.Shard(weights_root, ctx, slots=slots, kv_type=kv_type, sync_pieces=sync_pieces)
            for n, link in enumerate(links, start=1):
                ready = await _loaded(link, infos[n].node_id, on_progress)
                infos[n] = NodeInfo(**(asdict(infos[n]) | {"rss": int(ready.header["rss"])}))
                link.embeds = bool(ready.header.get("embeds"))
        except BaseException:
            for link in links:
                link.close()
            raise
        options = dict(ctx=ctx, weights=weights, sync=sync, key=key, threads=threads,
                       model_ref=model_ref, addresses=list(addresses), node_id=node_id, fetch_port=fetch_port,
                       on_progress=on_progress, slots=options_slots, kv_type=kv_type, parallel=parallel,
                       layout=layout, rebalance=rebalance, experts=experts, sync_pieces=sync_pieces)
        return cls(mf, ctx, plan, links, shard, infos, asyncio.get_running_loop(), options)

    async def without(self, address: str, epoch: int | None = None) -> "ClusterRunner":
        """A new runner over every node but `address`, with a fresh plan (one epoch later unless given).
        A worker that fails on the way (lost at the same moment, suspended or powered off) is left
        out too (connect_around), so the answers running go on over the nodes that still answer."""
        self.close()
        opts = dict(self.options)
        addresses, weights = opts.pop("addresses"), opts.pop("weights")
        keep = [i for i, a in enumerate(addresses) if a != address]
        if weights is not None:
            weights = [weights[0]] + [weights[i + 1] for i in keep]
        opts["layout"] = None  # a forced layout names nodes that are gone: the kind's planner decides
        epoch = self.plan.epoch + 1 if epoch is None else epoch
        log.warning("worker %s lost; re-planning over %d node(s), epoch %d", address, len(keep) + 1, epoch)
        return await connect_around(self.mf, [addresses[i] for i in keep], weights=weights,
                                    ids={n.address: n.node_id for n in self.nodes}, epoch=epoch,
                                    left_out=lambda a, exc: log.warning("re-planning without %s too: %s", a, exc),
                                    **opts)

    async def replanned(self, reason: str, epoch: int | None = None,
                        addresses: Sequence[str] | None = None) -> "ClusterRunner":
        """A new runner, every speed and link measured again and planned afresh: over `addresses` when given
        (nodes that joined), else over the same nodes. When the new nodes cannot be planned with, the
        old ones are: nodes that joined must not end the answers running."""
        self.close()
        opts = dict(self.options)
        had = opts.pop("addresses")
        opts["layout"] = None
        epoch = self.plan.epoch + 1 if epoch is None else epoch
        want = had if addresses is None else list(addresses)
        log.warning("re-planning over %d node(s), epoch %d: %s", len(want) + 1, epoch, reason)
        try:
            return await ClusterRunner.connect(self.mf, want, epoch=epoch, **opts)
        except Exception as exc:  # noqa: BLE001 - whatever the newcomers did, the nodes that served go on
            if set(want) <= set(had):
                raise
            log.warning("cannot plan with %s (%s); planning over the nodes that served",
                        ", ".join(sorted(set(want) - set(had))), exc)
            return await ClusterRunner.connect(self.mf, had, epoch=epoch, **opts)

    async def recovered(self, exc: RunnerLost, epoch: int | None = None) -> "ClusterRunner":
        """The runner that takes over after exc: re-planned around a lost worker, or afresh (Rebalance)."""
        if isinstance(exc, Rebalance):
            return await self.replanned(str(exc), epoch, exc.addresses)
        return await self.without(exc.link_name, epoch)

    # ------------------------------------------------------------------ generation (compute thread)
    def begin(self, params: sampling.SamplingParams | None = None) -> None:
        for link in self.links:
            self._on_loop(link.send(FrameType.RESET, {"mode": link.hot_mode}), link)
            if link.hot_mode == BLOCKING:
                link.enter_blocking()

    def end(self) -> None:
        for hot in self.hots:
            if not hot.link.closed:
                try:
                    hot.send(FrameType.STEP, {"end": True})
                except LinkClosed:
                    pass
                if not hot.link.closed:
                    hot.link.leave_blocking()

    def prefill(self, slot, ids, pos, history, params):
        """One chunk of one slot; with params, the merged candidates for the token after it."""
        return self._step([], Chunk(slot, pos, list(ids), history, params))[1]

    def decode(self, rows: Sequence[Row]) -> list[sampling.Candidates]:
        """One token of each row's sequence; every node with vocabulary rows answers candidates for each row.

        Through a pipeline the rows go as micro-batches, one per stage: a later stage works on one
        while the stages before it work on the next.
        """
        self._due()
        t0 = time.perf_counter()
        out = self._step(rows, None)[0]
        if self.watch is not None:  # pure decode steps only: a chunk's tokens would look like a slowdown
            why = self.watch.record(len(rows), time.perf_counter() - t0, max(r.pos for r in rows))
            if why is not None and self.due is None:
                self.due = Rebalance(why)
        return out

    def mixed(self, rows: Sequence[Row], chunk: Chunk) -> tuple[list[sampling.Candidates],
                                                                 sampling.Candidates | None, list[sampling.Candidates]]:
        """decode(rows) and prefill(chunk) in one pass: one STEP to each worker carrying both, one
        all-reduce per half-layer over both, one LOGITS answer (the rows' candidates, the chunk's
        scores when it asks them, then its candidates when it ends its prompt). Through a pipeline
        the chunk rides with the first micro-batch."""
        self._due()
        return self._step(rows, chunk)

    def _due(self) -> None:
        if self.due is not None:  # before anything is sent: the workers have seen nothing of this step
            raise self.due

    def _step(self, rows: Sequence[Row], chunk: Chunk | None) -> tuple[list[sampling.Candidates],
                                                                         sampling.Candidates | None,
                                                                         list[sampling.Candidates]]:
        """rows and chunk through every stage; the merged candidates of each row, the chunk's merged
        scores (chunk.score), and the candidates after its last token when it asks for them (chunk.params)."""
        out: list[sampling.Candidates] = []
        last, scores = None, []
        for batch, c, h in self._pass(rows, chunk, "none" if chunk is None or chunk.params is None else "candidates"):
            B = len(batch)
            n_scores = 0 if c is None or c.score is None else sum(1 for t in c.targets if t >= 0)
            n_last = 1 if c is not None and c.params is not None else 0
            n = B + n_scores + n_last
            if not n:
                continue  # a prefill chunk before its prompt's last: nobody answers
            own: list[sampling.Candidates] = []
            if h is not None:
                logits = self.shard.logits_rows(h[:B])
                own = [sampling.candidates(logits[i], self.offset, r.history, r.params) for i, r in enumerate(batch)]
                if c is not None:
                    own += generate.scores(self.shard, h[B:], self.offset, c)
                if n_last:
                    own.append(sampling.candidates(self.shard.logits(h[-1:])[0], self.offset, c.history, c.params))
            try:
                theirs = [candidates_rows_from(hot.recv(FrameType.LOGITS), n) for hot in self.answering]
            except LinkClosed as exc:
                raise _lost(exc) from None
            merged = [sampling.merge(([own[i]] if own else []) + [t[i] for t in theirs]) for i in range(n)]
            out += merged[:B]
            scores += merged[B:B + n_scores]
            if n_last:
                last = merged[-1]
        return out, last, scores

    def _pass(self, rows: Sequence[Row], chunk: Chunk | None, want: str) -> list[tuple[list[Row], Chunk | None,
                                                                                      np.ndarray | None]]:
        """Send rows and chunk through every stage: (rows, chunk, final hidden states or None) per
        micro-batch. The final hidden states are the root's own (B + n, dim) when its stage is the last;
        else the last stage's worker answers for the step.

        Through a pipeline the rows go as micro-batches, one per stage (the chunk with the first): a
        later stage works on one while the stages before it work on the next.
        """
        for r in rows:
            self._check_room(r.pos + 1)
        if chunk is not None:
            self._check_room(chunk.pos + len(chunk.ids))
        m = max(1, min(len(rows), len(self.chain) + 1)) if self.chain else 1
        batches = [list(rows[i * len(rows) // m:(i + 1) * len(rows) // m]) for i in range(m)]
        sent = []
        for k, batch in enumerate(batches):  # every micro-batch through the root's stage, then on to the chain
            c = chunk if k == 0 else None
            header, x, own = self._step_of(batch, c, want)
            h = self._forward(header, x, own)
            if self.chain:
                self._send(self.chain[0], header, h)
            sent.append((batch, c, header, h))
        for k in range(1, len(self.chain)):  # each later stage gets each micro-batch as the one before hands it on
            for _, _, header, h in sent:
                self._send(self.chain[k], header, self._hidden(self.chain[k - 1], h.shape[0]))
        return [(batch, c, None if self.chain else h) for batch, c, _, h in sent]

    def _step_of(self, batch: list[Row], c: Chunk | None, want: str) -> tuple[dict, np.ndarray,
                                                                               Callable[[], np.ndarray]]:
        """A micro-batch's STEP header, its embeddings (rows first, then the chunk's) and the root's own
        pass over them."""
        header: dict = {}
        x = llama.embed(self.mf, [r.token for r in batch] + ([] if c is None else list(c.ids)))
        slots, positions = [r.slot for r in batch], [r.pos for r in batch]
        params = [asdict(r.params) for r in batch]
        if batch:
            header |= {"rows": [[r.slot, r.pos, int(r.token)] for r in batch], "params": params}
        if c is None:
            return header, x, lambda: self.shard.forward_rows(x, slots, positions)
        header |= {"slot": c.slot, "pos": c.pos, "ids": [int(t) for t in c.ids], "want": want}
        if c.copy is not None:  # every stage copies its layers' KV of the prefix first, the root too
            header["copy"] = [int(c.copy[0]), int(c.copy[1])]
        if c.score is not None:
            header["score"] = [c.score, [int(t) for t in c.targets]]
        if want == "candidates":
            chunk_params = asdict(c.params)
            header["params"] = params + [chunk_params] if batch else chunk_params

        def own() -> np.ndarray:
            if c.copy is not None:
                self.shard.copy_kv(c.copy[0], c.slot, c.copy[1], c.pos)
            if not batch:
                return self.shard.forward(x, c.pos, slot=c.slot)
            return self.shard.forward_mixed(x, slots, positions, c.pos, c.slot)
        return header, x, own

    def run(self, ids, pos, history, params):
        """ids at pos.. of slot 0 in aligned chunks; the candidates for the next token."""
        return feed(self, ids, pos, history, params)

    def logits(self, ids, pos):
        """Full logits of every position of slot 0, gathered from every node's rows (tests, Q8_0 checks)."""
        out = []
        for a, b in chunks(pos, pos + len(ids)):
            [(_, _, h)] = self._pass([], Chunk(0, a, list(ids[a - pos:b - pos])), "logits")
            rows = [] if h is None else [self.shard.logits(h)]
            try:
                rows += [np.array(hot.recv(FrameType.LOGITS).array()) for hot in self.answering]
            except LinkClosed as exc:
                raise _lost(exc) from None
            out.append(np.concatenate(rows, axis=1))
        return np.concatenate(out)

    def _check_room(self, end: int) -> None:
        if end > self.ctx:
            raise llama.ContextFull(f"context is full: {end} positions needed, the KV cache holds {self.ctx}")

    def _forward(self, header: dict, x: np.ndarray, own: Callable[[], np.ndarray]) -> np.ndarray:
        """STEP to every worker of the root's stage (one with its own embedding table gets the ids
        only), then our own shard."""
        try:
            for hot in self.group:
                hot.send(FrameType.STEP, header, b"" if hot.link.embeds else x)
            return own()
        except LinkClosed as exc:
            raise _lost(exc) from None

    def _send(self, hot: Hot, header: dict, h: np.ndarray) -> None:
        try:
            hot.send(FrameType.STEP, header, h)
        except LinkClosed as exc:
            raise _lost(exc) from None

    def _hidden(self, hot: Hot, n: int) -> np.ndarray:
        """The residual stream a stage hands back, (n, dim)."""
        try:
            frame = hot.recv(FrameType.HIDDEN)
        except LinkClosed as exc:
            raise _lost(exc) from None
        return np.array(frame.array(), dtype=np.float32).reshape(n, self.mf.config.dim)

    def counters(self) -> dict[str, Counters]:
        return {link.name: link.counters.snapshot() for link in self.links}

    @property
    def rounds(self) -> int:
        """All-reduce rounds this runner has run (none without workers in the root's stage)."""
        return self.shard.reduce.rounds if isinstance(self.shard.reduce, RootReduce) else 0

    def _on_loop(self, coro, link: Link) -> None:
        try:
            asyncio.run_coroutine_threadsafe(coro, self.loop).result()
        except LinkClosed as exc:
            raise _lost(exc) from None

    def close(self) -> None:
        for link in self.links:
            link.close()


# from asking to timing: each node makes its timing matrices and runs each once first (about 0.3 s
# here once its kernels are loaded, as they are after the first profile)
TOGETHER_LEAD_S = 1.0


def read_together(alone: Sequence[float], together: Sequence[float]) -> float:
    """What nodes of one machine read at once: the sum of their speeds timed together, bounded by
    physics: no less than the fastest of them alone, no more than all of them alone. A window outside
    that caught the machine in another phase (this VM's reads vary by 1.5x from one second to the
    next), and the plan is better off with the bound."""
    return min(max(sum(together), max(alone)), sum(alone))


def _row_cost_of(header: dict) -> float:
    """A worker's measured row cost (0, the cost model's default, from one that does not say)."""
    rc = header.get("row_cost", 0.0)
    ok = isinstance(rc, (int, float)) and not isinstance(rc, bool) and 0.0 <= rc <= planner.MAX_ROW_COST
    return float(rc) if ok else 0.0


def _host_of(header: dict) -> str:
    """A worker's machine as its PROFILE answer names it ("" from one that does not)."""
    host = header.get("host", "")
    return host if isinstance(host, str) and len(host) <= 64 else ""


async def _together(infos: list[NodeInfo], links: list[Link], seconds: float, qtype: int,
                    threads: int | None, shapes: profile.Pass | None = None) -> list[NodeInfo]:
    """Nodes that share a machine profiled again, all at once: what they read together is what a
    stage of them gets, not the sum of what each read alone (two cores of the AMD EPYC here read
    32.5 GB/s together where one alone reads 19-22). infos[0] is the root, infos[1:] the links'."""
    by_host: dict[str, list[int]] = {}
    for i, info in enumerate(infos):
        if info.host:
            by_host.setdefault(info.host, []).append(i)
    out = list(infos)
    for host, members in by_host.items():
        if len(members) < 2:
            continue
        at = time.time() + TOGETHER_LEAD_S  # one clock on one machine: every node times the same window
        ask = {"seconds": seconds, "qtype": qtype, "at": at, "pass": shapes or []}
        jobs = [asyncio.to_thread(profile.profile, threads, seconds, qtype, at, shapes) if i == 0 else
                links[i - 1].request(FrameType.PROFILE, ask, FrameType.READY, timeout=60) for i in members]
        got = await asyncio.gather(*jobs)
        speeds = [g.speed if i == 0 else float(g.header["speed"]) for i, g in zip(members, got)]
        alone = [infos[i].speed for i in members]
        host_speed = read_together(alone, speeds)
        for i in members:
            out[i] = replace(out[i], host_speed=host_speed)
        log.info("%s share a machine (%s): %.2f GB/s together (measured %.2f), %s alone",
                 ", ".join(infos[i].node_id for i in members), host[:8], host_speed / 1e9, sum(speeds) / 1e9,
                 " + ".join(f"{x / 1e9:.2f}" for x in alone))
    return out


def _plan(mf: ModelFile, ctx: int, slots: int, nodes: list, epoch: int, sync: str, kv_type: str,
          parallel: str, links: dict[str, cost.LinkCost],
          layout: Sequence[Sequence[int]] | None = None) -> tuple[planner.Plan, int]:
    """A plan of kind `parallel` (pipeline.PARALLEL) with KV caches for `slots` sequences, or for
    fewer (halving) when the nodes' memory holds no more; the slot count it got."""
    while True:
        shape = model_shape(mf, ctx, slots, kv_type)
        try:
            if layout is not None:
                groups = [[nodes[i] for i in g] for g in layout]
                empty = not groups[0]
                plan = pipeline.stage_plan(shape, [[nodes[0]]] + groups[1:] if empty else groups, epoch=epoch,
                                           sync=sync, root_empty=empty)
                return plan, slots
            if parallel == "tp":  # tensor parallelism over every node, as before there were kinds
                return packing.make_plan(shape, nodes, epoch=epoch, sync=sync), slots
            found = pipeline.candidates(shape, nodes[0], nodes[1:], links, parallel=parallel, rows=slots,
                                        epoch=epoch, sync=sync)
            best = pipeline.choose(shape, nodes[0], nodes[1:], links, parallel=parallel, rows=slots,
                                   epoch=epoch, sync=sync, found=found)
            log.info("plan chosen (%s): %s; predicted %.1f ms per token for one stream, %.1f tok/s for %d",
                     parallel, pipeline.describe(best.plan), best.single.step_s * 1e3, best.batch.tok_s, slots)
            used = {n.node_id for n in best.plan.nodes}
            for n in nodes[1:]:
                if n.node_id not in used:
                    log.info("worker %s left out of the plan, idle: %s", n.node_id,
                             pipeline.left_out(found, best, n.node_id))
            return best.plan, slots
        except planner.PlanError:
            if slots == 1:
                raise
            log.warning("%d slots of %d positions do not fit the nodes' memory; trying %d", slots, ctx, slots // 2)
            slots //= 2


def _arrange(plan: planner.Plan, links: list[Link], infos: list[NodeInfo]) -> tuple[list[Link], list[NodeInfo]]:
    """Links and infos in the plan's node order (root first), with stages and layers; the workers
    the plan leaves out are let go (their links closed) and listed last as idle (stage -1)."""
    by_id = {i.node_id: (link, i) for link, i in zip(links, infos[1:])}
    stage = {x.node_id: (k, x.layers) for k, st in enumerate(plan.stages) for x in st}
    used = [n.node_id for n in plan.nodes[1:]]
    for node_id, (link, info) in by_id.items():
        if node_id not in stage:
            link.close()  # let go: another root may use it
    root = replace(infos[0], stage=0, layers=stage[infos[0].node_id][1])
    kept = [replace(by_id[i][1], stage=stage[i][0], layers=stage[i][1]) for i in used]
    idle = [replace(i, stage=-1, mode="idle") for n, (_, i) in by_id.items() if n not in stage]
    return [by_id[i][0] for i in used], [root, *kept, *idle]


async def _loaded(link: Link, node_id: str, on_progress: Progress | None) -> Frame:
    """The worker's READY after a LOAD; PROGRESS frames on the way (a slice download) keep it alive."""
    while True:
        frame = await link.recv(LOAD_TIMEOUT)
        if frame.type != FrameType.PROGRESS:
            return link._check(frame, FrameType.READY)
        if on_progress is not None:
            on_progress(node_id, int(frame.header.get("done", 0)), int(frame.header.get("total", 0)))


async def _hello(link: Link, key: bytes | None, node_id: str, epoch: int) -> None:
    """Authenticate and seal the link when we hold a cluster key; otherwise a plain HELLO (trusted networks only).

    Either way the HELLO carries our epoch (inside the proof, with a key): workers refuse roots older
    than one they follow.
    """
    if key is not None:
        await link.authenticate(key, node_id, {"epoch": epoch})
        return
    await link.send(FrameType.HELLO, {"node_id": node_id, "epoch": epoch})
    reply = await link.recv(10)
    if reply.type == FrameType.ERROR:
        raise link._closed(str(reply.header.get("message", "refused")))
    if reply.type == FrameType.CHALLENGE:
        raise link._closed("the worker requires the cluster key (--key)")
    link.peer_id = str(reply.header.get("node_id") or link.name)
    link.trust()  # no key: frames stay plain (trusted networks only)

