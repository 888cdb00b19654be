"""Plans of every kind, and the choice between them by the cost model.

A plan is a chain of pipeline stages. Stage 0 holds the root (which embeds
every token), alone or as a tensor-parallel group with workers on fast
links; each later stage is one worker, reached through the root. The kinds:

    single   one node does everything (a worker alone: the root's stage 0 is empty)
    tp       one stage of several nodes: tensor parallelism over all of them
    pp       every working node its own stage
    hybrid   the root's tensor-parallel group, then single-node stages

Layers are split between stages by speed and memory (`stage_plan`): every
stage gets at least one layer, and the slowest stage's time is the least
the memory caps allow, which is what keeps every stage busy once several
sequences run. Within a stage, packing.make_plan splits each layer.

`choose` enumerates the candidates over every subset of the workers (a node
whose link is too slow to help is left out), predicts each with cost.py and
keeps the cheapest for the load given.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from edgetp.parallel import cost, packing
from edgetp.parallel.plan import DEFAULT_OVERHEAD, ModelShape, NodeSpec, Plan, PlanError, Share, fmt_bytes, group_speed

PARALLEL = ("auto", "tp", "pp")  # what --parallel may force
MARGIN = 0.05  # a plan on fewer nodes is preferred unless one on more is predicted this much faster
MAX_WORKERS_ENUMERATED = 6  # beyond this many workers, subsets are not enumerated (tp and pp over all only)


def stage_plan(shape: ModelShape, groups: Sequence[Sequence[NodeSpec]], *, epoch: int = 0, sync: str = "f32",
               overhead_bytes: int = DEFAULT_OVERHEAD, root_empty: bool = False) -> Plan:
    """A pipeline over `groups` (stage 0 first), layers split by speed and memory.

    With root_empty, groups[0] is the root alone and runs no layer (it embeds and samples only).
    """
    groups = [tuple(g) for g in groups]
    if not groups or any(not g for g in groups):
        raise PlanError("a pipeline needs at least one node in every stage")
    if len(groups) == 1 and not root_empty:
        return packing.make_plan(shape, groups[0], epoch=epoch, sync=sync, overhead_bytes=overhead_bytes)
    working = groups[1:] if root_empty else groups
    counts = _split_layers(shape, working, overhead_bytes)
    shares: list[Share] = []
    nodes: list[NodeSpec] = []
    if root_empty:
        root = groups[0][0]
        shares.append(Share(root.node_id, (0, shape.n_kv_heads), (0, shape.ffn), (0, 0), (0, 0)))
        nodes.append(root)
    first = 0
    for k, (group, n) in enumerate(zip(working, counts)):
        last = k == len(working) - 1
        sub = replace(shape, n_layers=n, vocab=shape.vocab if last else 0)
        try:
            part = packing.make_plan(sub, group, epoch=epoch, sync=sync, overhead_bytes=overhead_bytes)
        except PlanError as exc:
            raise PlanError(f"stage {k} (layers {first}:{first + n}): {exc}", exc.node_id) from None
        shares += [replace(x, layers=(first, first + n)) for x in part.shares]
        nodes += group
        first += n
    return Plan(epoch, sync, shape, tuple(nodes), tuple(shares), overhead_bytes)


def _split_layers(shape: ModelShape, groups: Sequence[Sequence[NodeSpec]], overhead: int) -> list[int]:
    """Layers per stage: at least one each, minimising the slowest stage's time under memory caps."""
    n = shape.n_layers
    if len(groups) > n:
        raise PlanError(f"{len(groups)} pipeline stages for {n} layers: a stage needs at least one layer")
    layer_work = (shape.n_kv_heads * shape.group_bytes + shape.n_ffn_blocks * shape.ffn_block_bytes) / n
    layer_mem = layer_work + shape.n_kv_heads * shape.group_kv_bytes / n
    vocab = shape.vocab * shape.vocab_row_bytes
    speed = [group_speed(g) for g in groups]
    room = [sum(x.mem_bytes for x in g) - overhead * len(g) - (vocab if k == len(groups) - 1 else 0)
            for k, g in enumerate(groups)]
    mem_cap = [max(0, math.floor(r / layer_mem)) for r in room]
    for k, cap in enumerate(mem_cap):
        if cap < 1:
            who = ", ".join(x.node_id for x in groups[k])
            raise PlanError(f"stage {k} ({who}): one layer needs {fmt_bytes(layer_mem)}"
                            f"{' plus the vocabulary ' + fmt_bytes(vocab) if k == len(groups) - 1 else ''}, "
                            f"it has {fmt_bytes(max(room[k], 0) + (vocab if k == len(groups) - 1 else 0))}",
                            groups[k][0].node_id if len(groups[k]) == 1 else None)
    if sum(mem_cap) < n:
        raise PlanError(f"the {n} layers ({fmt_bytes(layer_mem)} each with their KV cache) do not fit the stages' "
                        f"memory: room for {sum(mem_cap)}")

    def caps(t: float) -> list[int]:
        out = []
        for k, (s, cap) in enumerate(zip(speed, mem_cap)):
            extra = vocab if k == len(groups) - 1 else 0
            out.append(min(cap, max(0, math.floor((t * s - extra) / layer_work + 1e-9))))
        return out

    lo, hi = 0.0, (n * layer_work + vocab) / min(speed)
    for _ in range(100):
        mid = (lo + hi) / 2
        got = caps(mid)
        if sum(got) >= n and min(got) >= 1:
            hi = mid
        else:
            lo = mid
    counts = caps(hi)  # one layer per stage at least, n in all at least: every memory cap holds one, all hold n
    while sum(counts) > n:  # give back from the stage that would be slowest
        k = max((k for k in range(len(counts)) if counts[k] > 1),
                key=lambda k: (counts[k] * layer_work + (vocab if k == len(groups) - 1 else 0)) / speed[k])
        counts[k] -= 1
    return counts


@dataclass(frozen=True)
class Candidate:
    plan: Plan
    single: cost.Prediction   # one stream
    batch: cost.Prediction    # `rows` streams


def candidates(shape: ModelShape, root: NodeSpec, workers: Sequence[NodeSpec], links: Mapping[str, cost.LinkCost],
               *, parallel: str = "auto", rows: int = 1, epoch: int = 0, sync: str = "f32",
               overhead_bytes: int = DEFAULT_OVERHEAD, oh: cost.Overheads = cost.Overheads()) -> list[Candidate]:
    """Every plan `parallel` allows that fits, predicted for one stream and for `rows` streams."""
    if parallel not in PARALLEL:
        raise ValueError(f"parallel must be one of {', '.join(PARALLEL)}, got {parallel!r}")
    by_rtt = sorted(workers, key=lambda w: links[w.node_id].rtt_s)
    layouts: list[tuple[list[list[NodeSpec]], bool]] = []
    if parallel == "tp":
        layouts.append(([[root, *workers]], False))
    elif parallel == "pp":
        layouts.append(([[root]] + [[w] for w in by_rtt], False))
    else:
        subsets: list[Sequence[NodeSpec]] = [by_rtt]
        if len(by_rtt) <= MAX_WORKERS_ENUMERATED:
            subsets = [list(c) for r in range(len(by_rtt) + 1) for c in itertools.combinations(by_rtt, r)]
        for sub in subsets:
            for k in range(len(sub) + 1):  # the k workers on the fastest links share the root's stage
                layouts.append(([[root, *sub[:k]]] + [[w] for w in sub[k:]], False))
            if sub:
                layouts.append(([[root]] + [[w] for w in sub], True))
    out = []
    for groups, empty in layouts:
        try:
            plan = stage_plan(shape, groups, epoch=epoch, sync=sync, overhead_bytes=overhead_bytes, root_empty=empty)
        except PlanError:
            continue
        out.append(Candidate(plan, cost.predict(plan, links, 1, oh, root.node_id),
                             cost.predict(plan, links, rows, oh, root.node_id)))
    return out


def choose(shape: ModelShape, root: NodeSpec, workers: Sequence[NodeSpec], links: Mapping[str, cost.LinkCost],
           *, parallel: str = "auto", rows: int = 1, found: Sequence[Candidate] | None = None, **kw) -> Candidate:
    """The cheapest candidate for `rows` concurrent streams (of `found`, if candidates() gave them already):
    the least step time per row.

    PlanError when nothing fits, with the reason the plan over every node gives.
    """
    if found is None:
        found = candidates(shape, root, workers, links, parallel=parallel, rows=rows, **kw)
    if found:
        # measured speeds are noisy: a plan on fewer nodes (fewer links to depend on) within
        # MARGIN of the cheapest is taken instead
        best = min(found, key=_cost)
        close = [c for c in found if _cost(c)[0] <= _cost(best)[0] * (1 + MARGIN)]
        return min(close, key=lambda c: (len(c.plan.nodes), _cost(c)))
    if not found:
        everyone = [[root, *workers]] if parallel != "pp" else [[root]] + [[w] for w in workers]
        stage_plan(shape, everyone, epoch=kw.get("epoch", 0), sync=kw.get("sync", "f32"),
                   overhead_bytes=kw.get("overhead_bytes", DEFAULT_OVERHEAD))  # raises the reason
        raise PlanError("no plan fits")
    return min(found, key=_cost)


def _cost(c: Candidate) -> tuple[float, int]:
    return c.batch.step_s / c.batch.rows, len(c.plan.nodes)  # seconds per token; fewer nodes on a tie


def left_out(found: Sequence[Candidate], best: Candidate, node_id: str) -> str:
    """Why `best` leaves node_id out: the cheapest plan with it, beside the chosen one (per token)."""
    with_it = [c for c in found if any(n.node_id == node_id for n in c.plan.nodes)]
    ms = best.batch.step_s / best.batch.rows * 1e3
    if not with_it:
        return f"no plan with it fits; the chosen one predicts {ms:.1f} ms a token"
    other = min(with_it, key=_cost)
    return (f"the cheapest plan with it ({describe(other.plan)}) predicts {other.batch.step_s / other.batch.rows * 1e3:.1f} "
            f"ms a token, the chosen one {ms:.1f} ms")


def describe(plan: Plan) -> str:
    """One line: the kind, then each stage's layers and nodes."""
    parts = []
    for st in plan.stages:
        a, b = st[0].layers or (0, plan.shape.n_layers)
        parts.append(f"layers {a}:{b} on {'+'.join(x.node_id for x in st)}")
    return f"{plan.kind}: " + "; ".join(parts)
