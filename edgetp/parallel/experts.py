"""Experts as a planning unit: experts placed on nodes (expert parallelism) beside the column split.

A mixture layer's FFN can be cut three ways, all exact (each node's part of the
weighted sum goes through the layer's usual all-reduce):

    columns    every node holds its ffn_cols of every expert. A token's k experts
               run on every node, node i reading cols_i / ffn of each: its time
               k * cols_i/ffn * b / s_i for an expert of b bytes (all layers), and
               k expert runs per layer on every node.
    placement  node i holds whole experts [e0, e1), every column. A token's expert
               runs only where it lives: node i's time hits_i * b / s_i, hits_i of
               the token's k experts; a step waits for E[max_i hits_i * b / s_i]
               over the routings (plan.expected_max, every k-subset of the
               experts taken as equally likely), and the busiest node runs
               E[max_i hits_i] experts per layer instead of k.
    mixed      the stage's nodes form consecutive groups; group g holds whole experts
               [e0, e1) and splits them among its nodes by columns. Node i of group g
               waits hits_g * cols_i/ffn * b / s_i; a step E[max_i] of that, and the
               busiest node runs E[max_g hits_g] experts a layer. Columns is one group
               of every node, placement a group per node.

Placement moves the same all-reduce bytes (each node its (rows, dim) part) and runs
each expert's whole matrices: fewer, longer kernel calls, at the price of the
imbalance of routing. Groups trade between the two: fewer groups route more
evenly, more groups make fewer calls per node. The cost model (cost.predict, with
Overheads.expert_s per expert run) weighs them; `choose` keeps the cheapest.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import replace
from typing import Mapping, Sequence

from edgetp.parallel import EXPERT_MODES, cost
from edgetp.parallel.packing import _water_fill
from edgetp.parallel.plan import Plan, PlanError, _placed

log = logging.getLogger(__name__)

MODES = EXPERT_MODES  # who decides: the cost model, or forced
MAX_CANDIDATES = 256  # group layouts a stage's choice weighs at most (a stage of n nodes has 2^(n-1))


def place(plan: Plan, groups: Mapping[int, Sequence[int]] | None = None) -> Plan:
    """`plan` with each stage of several nodes placing experts instead of splitting every expert's
    columns. groups[k]: the sizes of stage k's consecutive groups of nodes (default: one node each,
    whole experts). Each group holds a contiguous range of experts, counts water-filled by the
    group's summed speed (the next expert to the group that would finish its share soonest) within
    its members' memory; within a group the experts' columns are water-filled by each member's speed
    and memory. PlanError if they do not fit."""
    s = plan.shape
    if not s.n_experts:
        raise PlanError("the model has no experts to place")
    shares = list(plan.shares)
    nodes = {n.node_id: n for n in plan.nodes}
    for k, st in enumerate(plan.stages):
        if len(st) < 2 or _placed(st):
            continue
        sizes = tuple((groups or {}).get(k, (1,) * len(st)))
        if sum(sizes) != len(st) or min(sizes) < 1:
            raise ValueError(f"groups {sizes} do not split the {len(st)} nodes of stage {k}")
        frac = s.layer_fraction(st[0])
        room = [nodes[x.node_id].mem_bytes - plan.memory_bytes(x.node_id)
                + (x.ffn_cols[1] - x.ffn_cols[0]) // s.ffn_block * s.ffn_block_bytes * frac for x in st]
        speed = [nodes[x.node_id].speed for x in st]
        cuts = list(itertools.accumulate(sizes, initial=0))
        members = [range(a, b) for a, b in zip(cuts, cuts[1:])]
        unit = s.expert_bytes * frac
        counts = _water_fill(s.n_experts, unit, unit, [sum(speed[i] for i in g) for g in members],
                             [sum(room[i] for i in g) for g in members])
        if counts is None:
            raise PlanError(f"{s.n_experts} whole experts of {unit / 1e6:.1f} MB do not fit the memory of "
                            + ", ".join(x.node_id for x in st))
        first = 0
        for g, c in zip(members, counts):
            cols = _columns(s, c * unit, [speed[i] for i in g], [room[i] for i in g])
            if cols is None:
                raise PlanError(f"{c} experts of {unit / 1e6:.1f} MB do not fit the memory of "
                                + ", ".join(st[i].node_id for i in g) + " split by columns")
            for i, r in zip(g, cols):
                shares[plan.shares.index(st[i])] = replace(st[i], ffn_cols=r, experts=(first, first + c))
            first += c
    return replace(plan, shares=tuple(shares))


def _columns(s, held: float, speed: list[float], room: list[float]) -> list[tuple[int, int]] | None:
    """The FFN columns of a group's experts (`held` bytes in all) split among its members by speed
    within their memory, in blocks of ffn_block: contiguous ranges tiling [0, ffn)."""
    if len(speed) == 1:
        return [(0, s.ffn)] if held <= room[0] else None
    blocks = s.ffn // s.ffn_block
    counts = _water_fill(blocks, held / blocks, held / blocks, speed, list(room))
    if counts is None:
        return None
    cuts = list(itertools.accumulate((c * s.ffn_block for c in counts), initial=0))
    return list(zip(cuts, cuts[1:]))


def layouts(n: int) -> list[tuple[int, ...]]:
    """Every split of n nodes into consecutive groups but the single group (that is the column
    split, planned as such): whole experts first (n groups of one), then by fewer groups."""
    out = [tuple(b - a for a, b in zip((0,) + cut, cut + (n,)))
           for r in range(n - 1, 0, -1) for cut in itertools.combinations(range(1, n), r)]
    return out[:MAX_CANDIDATES]


def layout(plan: Plan) -> str:
    """Which of MODES' layouts `plan` has: "columns" (no stage places experts), "place" (every node
    of a placing stage holds whole experts) or "mixed"."""
    placing = [st for st in plan.stages if _placed(st)]
    if not placing:
        return "columns"
    return "place" if all(x.ffn_cols == (0, plan.shape.ffn) for st in placing for x in st) else "mixed"


def mixes(sizes: Sequence[int]) -> bool:
    """Whether a layout mixes: several groups, one of them of several nodes."""
    return 1 < len(sizes) < sum(sizes)


def choose(plan: Plan, links: Mapping[str, cost.LinkCost], rows: int = 1, mode: str = "auto",
           oh: cost.Overheads = cost.Overheads()) -> Plan:
    """The column split `plan`, its expert placement, or a mix of the two: forced by `mode`
    ("mixed": the best layout that mixes), else the one the cost model predicts fastest for `rows`
    rows a step. Layouts are weighed a stage at a time (for one stage: every layout); those that do
    not fit in memory drop out, and the column split stays when none fits."""
    if mode not in MODES:
        raise ValueError(f"experts must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "columns" or not plan.shape.n_experts or all(len(st) < 2 for st in plan.stages):
        if mode in ("place", "mixed"):
            why = "the model has no experts" if not plan.shape.n_experts else \
                "every stage of the plan is one node, which holds all of its experts"
            log.warning("experts %r has nothing to lay out: %s", mode, why)
        return plan
    root = plan.nodes[0].node_id

    def step(p: Plan) -> float:
        return cost.predict(p, links, rows, oh, root).step_s

    if mode == "place":
        return place(plan)
    multi = [k for k, st in enumerate(plan.stages) if len(st) >= 2]
    chosen = {k: (1,) * len(plan.stages[k]) for k in multi}
    best: tuple[float, Plan] | None = None
    for k in multi:  # a stage at a time, the others as chosen so far
        n = len(plan.stages[k])
        for sizes in layouts(n):
            if mode == "mixed" and n >= 3 and not mixes(sizes):
                continue
            try:
                candidate = place(plan, chosen | {k: sizes})
            except PlanError:
                continue
            t = step(candidate)
            if best is None or t < best[0]:
                best, chosen[k] = (t, candidate), sizes
    if mode == "mixed":
        if best is None or not any(mixes(v) for v in chosen.values()):
            raise PlanError("no layout mixes whole experts with columns here: that needs a stage of 3 or more "
                            "nodes whose memory holds it")
        return best[1]
    if best is None or step(plan) <= best[0]:
        return plan
    return best[1]
