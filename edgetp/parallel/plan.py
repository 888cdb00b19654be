"""The pure speed-weighted planner: who computes which slice of every layer.

Units of work, each counted in weight bytes over all layers:

    KV group    one KV head and the n_heads/n_kv_heads query heads sharing it:
                q, k, v rows (head_dim * (q_per_kv + 2) rows of dim) and the
                matching o-proj columns (dim x q_per_kv * head_dim)
    FFN block   ffn_block columns of the FFN: gate and up rows, down columns
                (of a mixture: those columns of every expert, all in memory, the
                experts_used of n_experts read per token; and its share of a
                shared expert, read by every token)
    expert      a mixture's whole expert, every column (parallel/experts.py places
                experts, whole on a node or split by columns within a group of nodes,
                instead of splitting every expert's columns where the cost model says so)
    vocab block vocab_block rows of the output (lm-head) matrix; the last
                block may be short when vocab is not a multiple of it

A node's time is the weight bytes it holds divided by its measured speed.
The plan minimises the largest time under each node's memory cap (weights
plus the KV cache of its groups plus a fixed overhead, DEFAULT_OVERHEAD). Every family is
split into contiguous ranges in node order.

How the units are packed (make_plan, equal_plan) lives in packing.py.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, fields
from typing import Any, Iterable, Sequence

import numpy as np

SYNC_TYPES = ("f32", "q8_0")
# What a node's memory grows by when it loads a share, beyond the share's weights and KV cache.
# Not the runtime itself (~580 MiB on a Pi, README "Memory"): each node measures its free memory in
# the running daemon after the profile's warm-up (parallel/profile.py), when the interpreter, numba
# and the compiled kernels are already resident and no longer in MemAvailable; counting them here
# again would refuse shares that fit. Measured growth from profile to a loaded, warmed-up whole
# model (anonymous memory, x86-64): 12 MiB for stories260K, 28 MiB for SmolLM2-135M Q4_1.
DEFAULT_OVERHEAD = 64 * 2**20

Range = tuple[int, int]
MAX_ROW_COST = 4.0  # a further token of a step costing more than this many first ones is a broken measurement


class PlanError(ValueError):
    """No plan fits: the message names what does not fit and where; `node_id` the node too small, if one is."""

    def __init__(self, message: str, node_id: str | None = None) -> None:
        super().__init__(message)
        self.node_id = node_id


def _int(name: str, value: Any, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _pos_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be finite and > 0, got {value}")
    return float(value)


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs to know of a model; *_bpw are bytes per weight."""

    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    ffn_block: int = 32
    vocab_block: int = 32
    attn_bpw: float = 4.0
    ffn_bpw: float = 4.0
    vocab_bpw: float = 4.0
    kv_bytes_per_head_pos: int = 0  # K and V of one KV head, one position, one layer; 0 = f32
    ctx: int = 2048
    slots: int = 1                  # sequences with a KV cache of ctx positions each
    n_experts: int = 0              # a mixture's experts per layer (0: a dense FFN)
    experts_used: int = 0           # experts per token
    # a mixture's shared expert (qwen2moe) per FFN column: its bytes / (3 * dim * ffn), 0: none. A shard's
    # part of it follows its part of the columns or of the experts (ModelConfig.shared_cols); every token reads it
    shared_bpw: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "shared_bpw":
                _pos_float(f.name, value + 1.0)  # >= 0
            elif f.name.endswith("_bpw"):
                _pos_float(f.name, value)
            else:
                _int(f.name, value, 0 if f.name in ("kv_bytes_per_head_pos", "vocab", "n_experts", "experts_used") else 1)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.ffn % self.ffn_block:
            raise ValueError(f"ffn {self.ffn} is not a multiple of ffn_block {self.ffn_block}")
        if self.kv_bytes_per_head_pos == 0:
            object.__setattr__(self, "kv_bytes_per_head_pos", 2 * self.head_dim * 4)

    @property
    def q_per_kv(self) -> int:
        return self.n_heads // self.n_kv_heads

    @property
    def group_bytes(self) -> int:
        """Weights of one KV group: q,k,v rows and o columns, all layers."""
        per_layer = self.dim * self.head_dim * (2 * self.q_per_kv + 2)
        return round(self.n_layers * per_layer * self.attn_bpw)

    @property
    def group_kv_bytes(self) -> int:
        """KV cache of one KV group for the whole context of every slot, all layers."""
        return self.n_layers * self.ctx * self.slots * self.kv_bytes_per_head_pos

    @property
    def n_ffn_blocks(self) -> int:
        return self.ffn // self.ffn_block

    @property
    def ffn_block_bytes(self) -> int:
        """gate + up rows and down columns for ffn_block columns (and their part of a shared expert), all layers."""
        return round(self.n_layers * 3 * self.dim * self.ffn_block * (self.ffn_bpw + self.shared_bpw))

    @property
    def ffn_active(self) -> float:
        """The part of the FFN's bytes a token reads: experts_used / n_experts of a mixture's experts
        and all of its shared expert, else all."""
        if not self.n_experts:
            return 1.0
        return (self.ffn_bpw * self.experts_used / self.n_experts + self.shared_bpw) / (self.ffn_bpw + self.shared_bpw)

    @property
    def expert_bytes(self) -> float:
        """One whole expert, every column, all layers, with the part of a shared expert that goes with it."""
        return self.n_ffn_blocks * self.ffn_block_bytes / max(self.n_experts, 1)

    @property
    def expert_shared(self) -> float:
        """The part of expert_bytes that is the shared expert's (every token reads it)."""
        return self.expert_bytes * self.shared_bpw / (self.ffn_bpw + self.shared_bpw)

    @property
    def vocab_row_bytes(self) -> int:
        return round(self.dim * self.vocab_bpw)

    @property
    def weight_bytes(self) -> int:
        return (self.n_kv_heads * self.group_bytes + self.n_ffn_blocks * self.ffn_block_bytes
                + self.vocab * self.vocab_row_bytes)

    def layer_fraction(self, share: Share) -> float:
        """The part of every layer-bound cost a share's layers carry (1 without a pipeline)."""
        if share.layers is None:
            return 1.0
        return (share.layers[1] - share.layers[0]) / self.n_layers

    def share_work(self, share: Share) -> int:
        """Weight bytes a share holds (the work it does per token)."""
        g0, g1 = share.kv_groups
        c0, c1 = share.ffn_cols
        r0, r1 = share.vocab_rows
        layered = (g1 - g0) * self.group_bytes + (c1 - c0) // self.ffn_block * self.ffn_block_bytes
        if share.experts is not None:  # a range of experts, its columns of each
            layered -= (c1 - c0) // self.ffn_block * self.ffn_block_bytes
            layered += round((share.experts[1] - share.experts[0]) * self.expert_bytes * (c1 - c0) / self.ffn)
        return round(layered * self.layer_fraction(share)) + (r1 - r0) * self.vocab_row_bytes

    def share_memory(self, share: Share, overhead_bytes: int) -> int:
        g0, g1 = share.kv_groups
        kv = round((g1 - g0) * self.group_kv_bytes * self.layer_fraction(share))
        return self.share_work(share) + kv + overhead_bytes


@dataclass(frozen=True)
class NodeSpec:
    node_id: str
    speed: float  # weight bytes per second, measured alone
    mem_bytes: int  # free memory
    # Nodes on one machine (one kernel: the same boot id) share its cores and its memory's bandwidth.
    # `host` names that machine ("": none of the others is on it) and `host_speed` is what all of its
    # nodes read together, measured at once (bytes/s; 0: not measured).
    host: str = ""
    host_speed: float = 0.0
    # each further token of a decode step, relative to the first, as measured (profile.Profile.row_cost):
    # the weights are read once for all of them, the arithmetic is per token. 0: not measured
    row_cost: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.node_id, str) or not self.node_id:
            raise ValueError("node_id must be a non-empty str")
        object.__setattr__(self, "speed", _pos_float(f"node {self.node_id}: speed", self.speed))
        _int(f"node {self.node_id}: mem_bytes", self.mem_bytes)
        if not isinstance(self.host, str):
            raise ValueError(f"node {self.node_id}: host must be a str")
        if self.host_speed:
            object.__setattr__(self, "host_speed", _pos_float(f"node {self.node_id}: host_speed", self.host_speed))
        if self.row_cost and not 0 < _pos_float(f"node {self.node_id}: row_cost", self.row_cost) <= MAX_ROW_COST:
            raise ValueError(f"node {self.node_id}: row_cost must be at most {MAX_ROW_COST}, got {self.row_cost}")


def busy_speeds(nodes: Iterable[NodeSpec]) -> dict[str, float]:
    """Each node's speed while all of `nodes` compute at once: nodes that share a host with a
    measured host_speed split it in proportion to their speeds alone, when together they would
    read faster than it; any other node keeps its speed."""
    nodes = list(nodes)
    demand: dict[str, float] = {}
    for n in nodes:
        if n.host and n.host_speed:
            demand[n.host] = demand.get(n.host, 0.0) + n.speed
    return {n.node_id: n.speed * min(1.0, n.host_speed / demand[n.host]) if n.host and n.host_speed else n.speed
            for n in nodes}


def group_speed(nodes: Iterable[NodeSpec]) -> float:
    """What a group of nodes reads per second while all of them compute (a tensor-parallel stage)."""
    return sum(busy_speeds(nodes).values())


@dataclass(frozen=True)
class Share:
    """One node's contiguous slices: [start, stop) of groups, FFN columns, vocab rows, of the
    layers of its pipeline stage (None: every layer, no pipeline)."""

    node_id: str
    kv_groups: Range
    ffn_cols: Range
    vocab_rows: Range
    layers: Range | None = None
    experts: Range | None = None  # a mixture's whole experts (ffn_cols then every column); None: columns of all


def _check_tiling(what: str, ranges: list[Any], total: int, block: int, last_short: bool) -> None:
    pos = 0
    for i, r in enumerate(ranges):
        if not isinstance(r, tuple) or len(r) != 2:
            raise ValueError(f"{what} range {i} must be a (start, stop) pair")
        start, stop = (_int(f"{what} range {i}", v) for v in r)
        if start != pos or stop < start:
            raise ValueError(f"{what} ranges do not tile [0, {total}) in order at range {i}: {r}")
        if (start % block and start != total) or (stop % block and not (last_short and stop == total)):
            raise ValueError(f"{what} range {i} {r} is not aligned to blocks of {block}")
        pos = stop
    if pos != total:
        raise ValueError(f"{what} ranges cover [0, {pos}), not [0, {total})")


@dataclass(frozen=True)
class Plan:
    """Who computes what, stamped with the epoch it belongs to."""

    epoch: int
    sync: str
    shape: ModelShape
    nodes: tuple[NodeSpec, ...]
    shares: tuple[Share, ...]
    overhead_bytes: int = DEFAULT_OVERHEAD

    def __post_init__(self) -> None:
        _int("epoch", self.epoch)
        _int("overhead_bytes", self.overhead_bytes)
        if self.sync not in SYNC_TYPES:
            raise ValueError(f"sync must be one of {SYNC_TYPES}, got {self.sync!r}")
        if not self.nodes or len(self.nodes) != len(self.shares):
            raise ValueError(f"{len(self.nodes)} nodes but {len(self.shares)} shares")
        ids = [n.node_id for n in self.nodes]
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate node ids in {ids}")
        if ids != [s.node_id for s in self.shares]:
            raise ValueError("shares are not in node order")
        s = self.shape
        stages = self.stages
        if any(x.layers is None for x in self.shares) and len(stages) > 1:
            raise ValueError("either every share names its layers (a pipeline) or none does")
        _check_tiling("layers", [st[0].layers or (0, s.n_layers) for st in stages], s.n_layers, 1, False)
        for k, st in enumerate(stages):
            where = "" if len(stages) == 1 else f" of stage {k}"
            _check_tiling("kv_groups" + where, [x.kv_groups for x in st], s.n_kv_heads, 1, False)
            if _placed(st):  # groups of nodes, each a range of the experts split among its nodes by columns
                groups = expert_groups(st)
                _check_tiling("experts" + where, [g[0].experts for g in groups], s.n_experts, 1, False)
                for g in groups:
                    if any(x.experts != g[0].experts for x in g):
                        raise ValueError(f"shares splitting experts {g[0].experts}{where} by columns must all hold "
                                         f"that range, not {[x.experts for x in g]}")
                    _check_tiling(f"ffn_cols of experts {g[0].experts}{where}", [x.ffn_cols for x in g],
                                  s.ffn, s.ffn_block, False)
            else:
                _check_tiling("ffn_cols" + where, [x.ffn_cols for x in st], s.ffn, s.ffn_block, False)
            vocab = s.vocab if k == len(stages) - 1 else 0  # the last stage ends the token
            _check_tiling("vocab_rows" + where, [x.vocab_rows for x in st], vocab, s.vocab_block, True)

    @property
    def stages(self) -> tuple[tuple[Share, ...], ...]:
        """The shares grouped into pipeline stages, in order: consecutive shares with the same layers.
        One stage without a pipeline (pure tensor parallelism)."""
        out: list[list[Share]] = []
        for x in self.shares:
            if out and out[-1][0].layers == x.layers:
                out[-1].append(x)
            else:
                out.append([x])
        return tuple(tuple(st) for st in out)

    @property
    def kind(self) -> str:
        """single (one node does all), tp (one stage of several), pp (stages of one node each), or hybrid."""
        working = [st for st in self.stages if st[0].layers != (0, 0)]
        if len(working) == 1:
            return "single" if len(working[0]) == 1 else "tp"
        return "pp" if all(len(st) == 1 for st in working) else "hybrid"

    def _index(self, node_id: str) -> int:
        for i, n in enumerate(self.nodes):
            if n.node_id == node_id:
                return i
        raise KeyError(node_id)

    def share(self, node_id: str) -> Share:
        return self.shares[self._index(node_id)]

    def heads(self, node_id: str) -> Range:
        """The query heads [start, stop) of a node (its KV heads are its kv_groups)."""
        g0, g1 = self.share(node_id).kv_groups
        return g0 * self.shape.q_per_kv, g1 * self.shape.q_per_kv

    def work_bytes(self, node_id: str) -> int:
        return self.shape.share_work(self.share(node_id))

    def memory_bytes(self, node_id: str) -> int:
        return self.shape.share_memory(self.share(node_id), self.overhead_bytes)

    def times(self) -> dict[str, float]:
        """Predicted seconds per token per node: work / speed."""
        return {n.node_id: self.shape.share_work(s) / n.speed for n, s in zip(self.nodes, self.shares)}

    @property
    def makespan(self) -> float:
        """Predicted seconds of one token's weight streaming, barriers included.

        Attention and FFN each end with an all-reduce in every layer, and the
        vocabulary rows end the token, so each family's slowest node sets the
        pace of its phase: the sum over families of max_i(family work_i / speed_i).
        """
        return sum(self.stage_makespan(k) for k in range(len(self.stages)))

    def stage_makespan(self, k: int, busy: Iterable[str] | None = None) -> float:
        """Plan.makespan of pipeline stage k alone: the stages of a pipeline run one after another.

        Its nodes' speeds are those while the nodes named in `busy` compute too (busy_speeds; the
        stage's own nodes if not given): nodes sharing a host share its bandwidth."""
        s, stage = self.shape, self.stages[k]
        names = {x.node_id for x in stage} if busy is None else set(busy) | {x.node_id for x in stage}
        speed = busy_speeds(n for n in self.nodes if n.node_id in names)
        total = 0.0
        total += max((sh.kv_groups[1] - sh.kv_groups[0]) * s.group_bytes * s.layer_fraction(sh) / speed[sh.node_id]
                     for sh in stage)
        if _placed(stage):  # each token waits for the node that takes longest over its experts' columns
            groups = expert_groups(stage)
            counts = [g[0].experts[1] - g[0].experts[0] for g in groups]
            member = [j for j, g in enumerate(groups) for _ in g]
            per = [s.layer_fraction(sh) * (sh.ffn_cols[1] - sh.ffn_cols[0]) / s.ffn / speed[sh.node_id]
                   for sh in stage]
            total += expected_max(counts, [(s.expert_bytes - s.expert_shared) * p for p in per], s.experts_used,
                                  [counts[j] * s.expert_shared * p for j, p in zip(member, per)], member)
        else:
            unit = s.ffn_block_bytes / s.ffn_block * s.ffn_active
            total += max((sh.ffn_cols[1] - sh.ffn_cols[0]) * unit * s.layer_fraction(sh) / speed[sh.node_id]
                         for sh in stage)
        total += max((sh.vocab_rows[1] - sh.vocab_rows[0]) * s.vocab_row_bytes / speed[sh.node_id] for sh in stage)
        return total


def _placed(stage: Sequence[Share]) -> bool:
    """Whether a stage places experts (else it splits every expert's columns)."""
    return any(x.experts is not None for x in stage)


def expert_groups(stage: Sequence[Share]) -> list[list[Share]]:
    """A placing stage's groups of nodes: consecutive shares that split one range of experts by
    columns, each share's columns starting where the one before it ended (a group's first at 0, its
    last ending at ffn > 0, so the next group starts anew). A node holding whole experts (every
    column) is a group of one; a plan that mixes has some groups of several."""
    out: list[list[Share]] = []
    for x in stage:
        if out and x.ffn_cols[0] == out[-1][-1].ffn_cols[1]:
            out[-1].append(x)
        else:
            out.append([x])
    return out


EXACT_SUBSETS = 5000  # routings enumerated exactly up to this many; sampled (fixed seed) beyond
SAMPLED = 4096


def expected_max(counts: Sequence[int], per_hit: Sequence[float], used: int,
                 base: Sequence[float] | None = None, group: Sequence[int] | None = None) -> float:
    """E[max_i base_i + hits_g(i) * per_hit_i] when a token picks `used` distinct experts uniformly
    among sum(counts), group g holding the next counts[g] of them in order and node i belonging to
    group g(i) = group[i] (each node its own group if not given): the time a token waits for the
    slowest node under expert placement (per_hit = the time of one expert's columns on each node,
    base = the time of what each node runs for every token, its part of a shared expert; 0 if not given).

    Pure: every routing enumerated when there are at most EXACT_SUBSETS, else SAMPLED routings
    of a generator with a fixed seed, so the same inputs give the same number."""
    n = int(sum(counts))
    owner = np.repeat(np.arange(len(counts)), counts)
    if math.comb(n, used) <= EXACT_SUBSETS:
        picks = np.array(list(itertools.combinations(range(n), used)), np.int64).reshape(-1, used)
    else:
        picks = np.argsort(np.random.default_rng(0).random((SAMPLED, n)), axis=1)[:, :used]
    hits = np.zeros((picks.shape[0], len(counts)))
    for j in range(used):
        np.add.at(hits, (np.arange(picks.shape[0]), owner[picks[:, j]]), 1.0)
    nodes = hits if group is None else hits[:, np.asarray(group, np.int64)]
    fixed = np.zeros(nodes.shape[1]) if base is None else np.asarray(base, np.float64)
    return float((nodes * np.asarray(per_hit, np.float64) + fixed).max(axis=1).mean())
