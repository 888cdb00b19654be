"""The cost model: what one step of a plan costs, from measured speeds and links.

Pure arithmetic over a Plan (parallel/plan.py), the links from the root to
each worker and a few per-message constants. A step carries `rows` tokens
(one per sequence of a decode step, or one prompt chunk's worth):

    compute of stage k   (Plan.stage_makespan(k) + L_k * rest_k) * (1 + row_cost * (b - 1))
                         for b rows: weights are read once per step, each
                         extra row costs row_cost of the first (the most any
                         node of the stage measured, NodeSpec.row_cost; the
                         Overheads constant where none did); rest_k is what a
                         layer costs its busiest node beyond its weights
                         (`layer_rest`: layer_s, the interpreter between kernels,
                         plus value_s per value of the node's activations: norms
                         and roundings of the residual stream, rope and attention
                         of its query heads, the GLU of its FFN columns); a
                         mixture's layers add expert_s per expert run on the
                         busiest node (parallel/experts.py)
    sync of stage k      a stage of several nodes all-reduces twice per layer
                         through the root: 2 * L_k * max over its workers of
                         (rtt + 2 * b * dim * sync_bytes / throughput + message),
                         plus one round trip for the STEP out and the answers back;
                         where a link measured an all-reduce round as generations
                         run it (round: one row of dim f32 values, in blocking mode),
                         that round stands for rtt + its bytes + message
    hop into stage k>0   a stage of one worker gets the residual stream and
                         hands it (or its candidates) back through the root:
                         rtt + 2 * b * dim * 4 / throughput + message

One stream runs the stages one after another: its token time is the sum of
the stage times. With several sequences the rows are cut into micro-batches,
one per working stage, and the stages work on different micro-batches at
once: a step is the pipeline's fill plus the slowest stage once per further
micro-batch, sum(t_k) + (m - 1) * max(t'_k), where t'_k is stage k's time
while every stage computes.

Nodes on one machine (NodeSpec.host) share its cores and memory bandwidth:
while several of them compute at once (a tensor-parallel stage, or every
stage past a pipeline's fill) they read no faster together than they were
measured to read at once (NodeSpec.host_speed; plan.busy_speeds).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from edgetp.parallel.plan import Plan, _placed, expected_max, expert_groups

SYNC_BYTES = {"f32": 4.0, "q8_0": 34 / 32}  # bytes per value of an all-reduce payload
HIDDEN_BYTES = 4.0  # the residual stream crosses a stage boundary as f32


@dataclass(frozen=True)
class LinkCost:
    """The root's link to one worker, as Link.measure() found it."""

    rtt_s: float          # median round trip of a small message (through both ends' event loops)
    bytes_per_s: float    # throughput of a bulk transfer
    round_s: float = 0.0  # median all-reduce round of one row of f32 as generations run it (0: not measured)

    def all_reduce(self, rows: float, dim: int, sync: str, oh: "Overheads") -> float:
        """One all-reduce of `rows` rows of dim values in `sync`: the measured round with the bytes
        beyond its one f32 row, or the round trip, the bytes and the per-message cost."""
        if self.round_s:
            return self.round_s + 2 * dim * (rows * SYNC_BYTES[sync] - 4.0) / self.bytes_per_s
        return self.rtt_s + 2 * rows * dim * SYNC_BYTES[sync] / self.bytes_per_s + oh.message_s


@dataclass(frozen=True)
class Overheads:
    """What the arithmetic above does not see: software costs per message and per extra row."""

    # one all-reduce (a message each way) beyond the wire's round trip: tools/bench_allreduce.py measured
    # 55-62 us with every frame through the general codec, 28-35 us with bare frames (f32 sync, loopback)
    message_s: float = 30e-6
    # an extra row of a step, relative to the first (weights read once, math per row), where no node
    # measured its own (NodeSpec.row_cost, profile.py: on the Zen 4 VM here, Q4_0, Q4_K and Q8_0 at one
    # and two threads, 0.08-0.20 with the avx512vnni kernels, 0.25-0.46 with the avx2 ones)
    row_cost: float = 0.7
    # a layer beyond its weight reads (profile.py's token pass times the kernels as decode calls them):
    # a fixed part, the interpreter between kernels, and a part per value of the node's activations
    # (dim + its query heads' width + its FFN columns). tools/bench_profile.py on one and two cores of the
    # AMD EPYC here (Zen 4, avx512vnni): SmolLM2 (2,688 values) 35-60 us a layer beyond its pass-timed
    # weights, the 1B shape (12,288) 220-270 us, at 8-40 positions; these price them at 51 and 214 us.
    # A slower CPU takes longer; not scaled.
    layer_s: float = 5e-6
    value_s: float = 17e-9
    # one expert's run in a mixture's layer beyond its weight reads (its two kernel calls, the GLU,
    # the weighted add): 25 to 36 us measured on one core of the same AMD EPYC (decode._Experts on
    # 8 to 16 experts of 224 x 96 Q8_0, whose bytes take well under a microsecond), route aside
    expert_s: float = 30e-6


@dataclass(frozen=True)
class Prediction:
    step_s: float      # one step of `rows` rows
    compute_s: float   # of which compute (the stages' compute : sync ratio applied to the step)
    sync_s: float      # of which all-reduces and stage hops
    rows: int

    @property
    def tok_s(self) -> float:
        return self.rows / self.step_s


def micro_batches(plan: Plan, rows: int) -> int:
    """How many micro-batches a step of `rows` rows is cut into: one per working stage, at most one per row."""
    return max(1, min(rows, len(working_stages(plan))))


def working_stages(plan: Plan) -> list[int]:
    """Indices of the stages that run layers (a root that only embeds has an empty stage 0)."""
    return [k for k, st in enumerate(plan.stages) if st[0].layers != (0, 0)]


def _expert_runs(plan: Plan, stage) -> float:
    """Experts the busiest node of a stage runs per layer and token: every node all k of them when
    the stage splits columns, the most a group of nodes holds of a token's k when it places experts
    (whole on a node, or split by columns within a group); and a shared expert's part on each."""
    k, shared = plan.shape.experts_used, float(plan.shape.shared_bpw > 0)
    if not plan.shape.n_experts or not _placed(stage):
        return k + shared
    groups = expert_groups(stage)
    return expected_max([g[0].experts[1] - g[0].experts[0] for g in groups], [1.0] * len(groups), k) + shared


def layer_rest(plan: Plan, stage, oh: Overheads) -> float:
    """What a layer costs the busiest node of a stage beyond its weights: layer_s, and value_s per value
    of its activations (the residual stream's dim, its query heads' width, its FFN columns; a mixture's
    experts count by expert_s instead)."""
    s = plan.shape
    group = s.n_heads // s.n_kv_heads * s.head_dim

    def values(x) -> int:
        ffn = 0 if s.n_experts else x.ffn_cols[1] - x.ffn_cols[0]
        return s.dim + (x.kv_groups[1] - x.kv_groups[0]) * group + ffn

    return oh.layer_s + oh.value_s * max(values(x) for x in stage)


def row_cost(plan: Plan, stage, oh: Overheads) -> float:
    """What a further row of a step costs a stage, relative to its first: the most any of its nodes
    measured (the stage waits for its slowest), the constant where none did."""
    measured = {n.node_id: n.row_cost for n in plan.nodes}
    costs = [measured[x.node_id] for x in stage if measured[x.node_id]]
    return max(costs) if costs else oh.row_cost


def predict(plan: Plan, links: Mapping[str, LinkCost], rows: int = 1, oh: Overheads = Overheads(),
            root: str | None = None) -> Prediction:
    """The predicted time of one step of `rows` rows under `plan`; links by worker node id.

    `root` is the node that drives the step (the first node of the plan unless given): it needs no link.
    """
    if rows < 1:
        raise ValueError(f"a step carries at least one row, got {rows}")
    root = plan.nodes[0].node_id if root is None else root
    s = plan.shape
    m = micro_batches(plan, rows)
    b = rows / m
    times, busy_times, compute, sync = [], [], 0.0, 0.0
    last = len(plan.stages) - 1
    everyone = [x.node_id for k in working_stages(plan) for x in plan.stages[k]]
    for k, stage in enumerate(plan.stages):
        far = [links[x.node_id] for x in stage if x.node_id != root]
        n_layers = (stage[0].layers[1] - stage[0].layers[0]) if stage[0].layers else s.n_layers
        per_layer = n_layers * (layer_rest(plan, stage, oh) + _expert_runs(plan, stage) * oh.expert_s)
        stretch = 1 + row_cost(plan, stage, oh) * (b - 1)
        c = (plan.stage_makespan(k) + per_layer) * stretch
        if root in (x.node_id for x in stage):
            y = 2 * n_layers * max((lk.all_reduce(b, s.dim, plan.sync, oh) for lk in far), default=0.0)
            y += max((lk.rtt_s + oh.message_s for lk in far), default=0.0) if k == last else 0.0
        else:
            if len(stage) > 1:
                raise ValueError(f"stage {k} is a tensor-parallel group without the root: not supported")
            lk = links[stage[0].node_id]
            y = lk.rtt_s + 2 * b * s.dim * HIDDEN_BYTES / lk.bytes_per_s + oh.message_s
        times.append(c + y)
        # past the pipeline's fill every stage works at once: nodes sharing a host share it
        busy_times.append((plan.stage_makespan(k, everyone) + per_layer) * stretch + y if m > 1 else c + y)
        compute += c
        sync += y
    step = sum(times) + (m - 1) * max(busy_times)
    share = compute / (compute + sync) if compute + sync else 1.0
    return Prediction(step, step * share, step * (1 - share), rows)
