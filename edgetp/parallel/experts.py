"""Experts as a planning unit: whole experts on nodes (expert parallelism) beside the column split.

A mixture layer's FFN can be cut two ways, both exact (each node's part of the
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

Placement moves the same all-reduce bytes (each node its (rows, dim) part) and runs
each expert's whole matrices: fewer, longer kernel calls, at the price of the
imbalance of routing. The cost model (cost.predict, with Overheads.expert_s per
expert run) weighs the two; `choose` keeps the cheaper.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

from edgetp.parallel import cost
from edgetp.parallel.packing import _water_fill
from edgetp.parallel.plan import Plan, PlanError, _placed

MODES = ("auto", "columns", "place")  # who decides: the cost model, or forced


def place(plan: Plan) -> Plan:
    """`plan` with each stage of several nodes holding whole experts instead of every expert's
    columns: contiguous ranges in node order, counts water-filled by speed (the next expert to the
    node that would finish its share soonest) within each node's memory. PlanError if they do not fit."""
    s = plan.shape
    if not s.n_experts:
        raise PlanError("the model has no experts to place")
    shares = list(plan.shares)
    nodes = {n.node_id: n for n in plan.nodes}
    for st in plan.stages:
        if len(st) < 2 or _placed(st):
            continue
        frac = s.layer_fraction(st[0])
        room = [nodes[x.node_id].mem_bytes - plan.memory_bytes(x.node_id)
                + (x.ffn_cols[1] - x.ffn_cols[0]) // s.ffn_block * s.ffn_block_bytes * frac for x in st]
        unit = s.expert_bytes * frac
        counts = _water_fill(s.n_experts, unit, unit, [nodes[x.node_id].speed for x in st], room)
        if counts is None:
            raise PlanError(f"{s.n_experts} whole experts of {unit / 1e6:.1f} MB do not fit the memory of "
                            + ", ".join(x.node_id for x in st))
        first = 0
        for x, c in zip(st, counts):
            shares[plan.shares.index(x)] = replace(x, ffn_cols=(0, s.ffn), experts=(first, first + c))
            first += c
    return replace(plan, shares=tuple(shares))


def choose(plan: Plan, links: Mapping[str, cost.LinkCost], rows: int = 1, mode: str = "auto",
           oh: cost.Overheads = cost.Overheads()) -> Plan:
    """The column split `plan` or its expert placement: forced by `mode`, else the one the cost
    model predicts faster for `rows` rows a step (the column split when placement does not fit)."""
    if mode not in MODES:
        raise ValueError(f"experts must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "columns" or not plan.shape.n_experts or all(len(st) < 2 for st in plan.stages):
        return plan
    try:
        placed = place(plan)
    except PlanError:
        if mode == "place":
            raise
        return plan
    if mode == "place":
        return placed
    root = plan.nodes[0].node_id
    return min((plan, placed), key=lambda p: cost.predict(p, links, rows, oh, root).step_s)
