"""The pure speed-weighted planner: who computes which slice of every layer.

Units of work, each counted in weight bytes over all layers:

    KV group    one KV head and the n_heads/n_kv_heads query heads sharing it:
                q, k, v rows (head_dim * (q_per_kv + 2) rows of dim) and the
                matching o-proj columns (dim x q_per_kv * head_dim)
    FFN block   ffn_block columns of the FFN: gate and up rows, down columns
    vocab block vocab_block rows of the output (lm-head) matrix; the last
                block may be short when vocab is not a multiple of it

A node's time is the weight bytes it holds divided by its measured speed.
The plan minimises the largest time under each node's memory cap (weights
plus the KV cache of its groups plus a fixed overhead). Every family is
split into contiguous ranges in node order.

Method: bisection on the makespan T. For one T a small dynamic programme
over (node, groups so far) places the KV groups, the big units, where they
leave the most room (ties: the spread that evens group time per speed);
FFN blocks and then vocab rows fill what is left, greedily in node order.
When that strands a block although a packing exists (memory tight against
block sizes), small problems are packed exactly instead: a DP over (node,
FFN blocks so far) for the fill, every placement of the groups if few. Once T is fixed a second bisection lowers the fill level so that the small
units go to the least loaded nodes instead of to the first ones.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterable

SYNC_TYPES = ("f32", "q8_0")
DEFAULT_OVERHEAD = 64 * 2**20  # runtime, buffers, norms, embeddings slack per node
_BISECT_STEPS = 80
_EXACT_BUDGET = 200_000  # steps of exact packing allowed when the greedy fill strands a block

Range = tuple[int, int]


class PlanError(ValueError):
    """No plan fits: the message names what does not fit and where."""


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


def _fmt(n: float) -> str:
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

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_bpw"):
                _pos_float(f.name, value)
            else:
                _int(f.name, value, 0 if f.name == "kv_bytes_per_head_pos" else 1)
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
        """KV cache of one KV group for the whole context, all layers."""
        return self.n_layers * self.ctx * self.kv_bytes_per_head_pos

    @property
    def n_ffn_blocks(self) -> int:
        return self.ffn // self.ffn_block

    @property
    def ffn_block_bytes(self) -> int:
        """gate + up rows and down columns for ffn_block columns, all layers."""
        return round(self.n_layers * 3 * self.dim * self.ffn_block * self.ffn_bpw)

    @property
    def vocab_row_bytes(self) -> int:
        return round(self.dim * self.vocab_bpw)

    @property
    def weight_bytes(self) -> int:
        return (self.n_kv_heads * self.group_bytes + self.n_ffn_blocks * self.ffn_block_bytes
                + self.vocab * self.vocab_row_bytes)

    def share_work(self, share: Share) -> int:
        """Weight bytes a share holds (the work it does per token)."""
        g0, g1 = share.kv_groups
        c0, c1 = share.ffn_cols
        r0, r1 = share.vocab_rows
        return ((g1 - g0) * self.group_bytes + (c1 - c0) // self.ffn_block * self.ffn_block_bytes
                + (r1 - r0) * self.vocab_row_bytes)

    def share_memory(self, share: Share, overhead_bytes: int) -> int:
        g0, g1 = share.kv_groups
        return self.share_work(share) + (g1 - g0) * self.group_kv_bytes + overhead_bytes


@dataclass(frozen=True)
class NodeSpec:
    node_id: str
    speed: float  # weight bytes per second, measured
    mem_bytes: int  # free memory

    def __post_init__(self) -> None:
        if not isinstance(self.node_id, str) or not self.node_id:
            raise ValueError("node_id must be a non-empty str")
        object.__setattr__(self, "speed", _pos_float(f"node {self.node_id}: speed", self.speed))
        _int(f"node {self.node_id}: mem_bytes", self.mem_bytes)


@dataclass(frozen=True)
class Share:
    """One node's contiguous slices: [start, stop) of groups, FFN columns, vocab rows."""

    node_id: str
    kv_groups: Range
    ffn_cols: Range
    vocab_rows: Range


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
        _check_tiling("kv_groups", [x.kv_groups for x in self.shares], s.n_kv_heads, 1, False)
        _check_tiling("ffn_cols", [x.ffn_cols for x in self.shares], s.ffn, s.ffn_block, False)
        _check_tiling("vocab_rows", [x.vocab_rows for x in self.shares], s.vocab, s.vocab_block, True)

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
        return max(self.times().values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "sync": self.sync,
            "overhead_bytes": self.overhead_bytes,
            "shape": {f.name: getattr(self.shape, f.name) for f in fields(self.shape)},
            "nodes": [{"node_id": n.node_id, "speed": n.speed, "mem_bytes": n.mem_bytes} for n in self.nodes],
            "shares": [{"node_id": s.node_id, "kv_groups": list(s.kv_groups), "ffn_cols": list(s.ffn_cols),
                        "vocab_rows": list(s.vocab_rows)} for s in self.shares],
        }

    @classmethod
    def from_dict(cls, d: Any) -> Plan:
        """Parse a plan that came over the network; anything inconsistent is a ValueError."""
        try:
            _keys(d, "plan", {"epoch", "sync", "overhead_bytes", "shape", "nodes", "shares"})
            _keys(d["shape"], "shape", {f.name for f in fields(ModelShape)})
            shape = ModelShape(**d["shape"])
            nodes = tuple(NodeSpec(**_keys(n, "node", {"node_id", "speed", "mem_bytes"})) for n in _list(d["nodes"]))
            shares = tuple(
                Share(
                    node_id=x["node_id"],
                    kv_groups=tuple(_list(x["kv_groups"])),
                    ffn_cols=tuple(_list(x["ffn_cols"])),
                    vocab_rows=tuple(_list(x["vocab_rows"])),
                )
                for x in (_keys(s, "share", {"node_id", "kv_groups", "ffn_cols", "vocab_rows"})
                          for s in _list(d["shares"]))
            )
            return cls(epoch=d["epoch"], sync=d["sync"], shape=shape, nodes=nodes, shares=shares,
                       overhead_bytes=d["overhead_bytes"])
        except (TypeError, KeyError, AttributeError) as exc:
            raise ValueError(f"malformed plan: {exc!r}") from exc


def _keys(d: Any, what: str, keys: set[str]) -> dict[str, Any]:
    if not isinstance(d, dict) or set(d) != keys:
        got = sorted(map(str, d)) if isinstance(d, dict) else type(d).__name__
        raise ValueError(f"{what} must be a dict with keys {sorted(keys)}, got {got}")
    return d


def _list(v: Any) -> list[Any]:
    if not isinstance(v, (list, tuple)):
        raise ValueError(f"expected a list, got {type(v).__name__}")
    return list(v)


# --------------------------------------------------------------------------- planning


def _shares(shape: ModelShape, nodes: tuple[NodeSpec, ...], groups: list[int], cols: list[int],
            rows: list[int]) -> tuple[Share, ...]:
    out, g, c, r = [], 0, 0, 0
    for n, dg, dc, dr in zip(nodes, groups, cols, rows):
        out.append(Share(n.node_id, (g, g + dg), (c, c + dc), (r, r + dr)))
        g, c, r = g + dg, c + dc, r + dr
    return tuple(out)


def _check_nodes(nodes: Iterable[NodeSpec]) -> tuple[NodeSpec, ...]:
    nodes = tuple(nodes)
    if not nodes:
        raise PlanError("no nodes to plan over")
    ids = [n.node_id for n in nodes]
    if len(set(ids)) != len(ids):
        raise PlanError(f"duplicate node ids: {ids}")
    return nodes


def _explain_memory(shape: ModelShape, nodes: tuple[NodeSpec, ...], overhead: int) -> str | None:
    """Why the model cannot fit in memory, or None when the simple checks pass."""
    unit_g = shape.group_bytes + shape.group_kv_bytes
    smallest = min(unit_g, shape.ffn_block_bytes, shape.vocab_row_bytes * min(shape.vocab_block, shape.vocab))
    for n in nodes:
        if n.mem_bytes < overhead + smallest:
            return (f"node {n.node_id}: needs {_fmt(overhead + smallest)} for its smallest share, "
                    f"has {_fmt(n.mem_bytes)} free")
    need = shape.weight_bytes + shape.n_kv_heads * shape.group_kv_bytes + len(nodes) * overhead
    have = sum(n.mem_bytes for n in nodes)
    if need > have:
        return (f"total model {_fmt(need)} (weights {_fmt(shape.weight_bytes)}, KV cache for ctx {shape.ctx} "
                f"{_fmt(shape.n_kv_heads * shape.group_kv_bytes)}, overhead {len(nodes)} x {_fmt(overhead)}) "
                f"> total free memory {_fmt(have)}")
    fits = {n.node_id: (n.mem_bytes - overhead) // unit_g for n in nodes}
    if sum(fits.values()) < shape.n_kv_heads:
        each = ", ".join(f"node {k}: {v}" for k, v in fits.items())
        return (f"attention needs {shape.n_kv_heads} KV groups of {_fmt(unit_g)} each (weights + KV cache), "
                f"the nodes hold only {sum(fits.values())} ({each})")
    return None


def _fit(cap: int, pos: int, n_blocks: int, full: int, last: int) -> tuple[int, int]:
    """(blocks, bytes) a node with cap bytes takes from block pos on; the last block may be short."""
    k = min(n_blocks - pos, cap // full)
    if pos + k == n_blocks - 1 and cap - k * full >= last:
        k += 1  # the short last block fits where a full one would not
    return k, k * full - (full - last if k and pos + k == n_blocks else 0)


def _greedy_blocks(caps: list[int], n_blocks: int, full: int, last: int) -> list[int] | None:
    """Blocks per node taken in node order while they fit; caps shrink in place."""
    out, pos = [], 0
    for i, cap in enumerate(caps):
        k, cost = _fit(cap, pos, n_blocks, full, last)
        caps[i] -= cost
        out.append(k)
        pos += k
    return out if pos == n_blocks else None


class _Planner:
    """The fill machinery for one (shape, nodes, overhead); all sizes in bytes."""

    def __init__(self, shape: ModelShape, nodes: tuple[NodeSpec, ...], overhead: int) -> None:
        self.shape, self.nodes = shape, nodes
        self.speed = [n.speed for n in nodes]
        self.room = [n.mem_bytes - overhead for n in nodes]  # memory for weights + KV cache
        self.A, self.K = shape.group_bytes, shape.group_kv_bytes
        self.F, self.R = shape.ffn_block_bytes, shape.vocab_row_bytes
        self._small_bytes = shape.n_ffn_blocks * self.F + shape.vocab * self.R  # FFN + vocab

    def _cap(self, i: int, a: int, level: float) -> int:
        """Bytes of FFN/vocab node i can still take at this time level holding a groups."""
        by_time = level * self.speed[i] - a * self.A
        by_mem = self.room[i] - a * (self.A + self.K)
        return math.floor(min(by_time, by_mem))

    def groups(self, level: float) -> list[int] | None:
        """Groups per node leaving the most room for the rest (DP over nodes and groups so far)."""
        G = self.shape.n_kv_heads
        best: list[tuple[int, float] | None] = [(0, 0.0)] + [None] * G
        choice: list[list[int]] = []
        for i in range(len(self.nodes)):
            nxt: list[tuple[int, float] | None] = [None] * (G + 1)
            pick = [0] * (G + 1)
            for g, val in enumerate(best):
                if val is None:
                    continue
                for a in range(G - g + 1):
                    cap = self._cap(i, a, level)
                    if cap < 0:
                        break
                    cand = (val[0] + cap, val[1] - (a * self.A) ** 2 / self.speed[i])
                    if nxt[g + a] is None or cand > nxt[g + a]:
                        nxt[g + a], pick[g + a] = cand, a
            best = nxt
            choice.append(pick)
        if best[G] is None:
            return None
        out, g = [], G
        for pick in reversed(choice):
            out.append(pick[g])
            g -= pick[g]
        return out[::-1]

    def _caps(self, groups: list[int], level: float) -> list[int] | None:
        """Room per node for FFN and vocab at this level, None if the groups overflow memory."""
        if any(self._cap(i, a, math.inf) < 0 for i, a in enumerate(groups)):
            return None
        return [max(0, self._cap(i, a, level)) for i, a in enumerate(groups)]

    def _families(self) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """(blocks, bytes of a full block, bytes of the last block) for FFN and vocab."""
        s = self.shape
        n_vb = -(-s.vocab // s.vocab_block)
        last_rows = s.vocab - (n_vb - 1) * s.vocab_block
        return (s.n_ffn_blocks, self.F, self.F), (n_vb, s.vocab_block * self.R, last_rows * self.R)

    def _as_ranges(self, ffn_blocks: list[int], vocab_blocks: list[int]) -> tuple[list[int], list[int]]:
        s = self.shape
        starts = itertools.accumulate(vocab_blocks, initial=0)
        rows = [min(s.vocab, (b0 + b) * s.vocab_block) - min(s.vocab, b0 * s.vocab_block)
                for b0, b in zip(starts, vocab_blocks)]
        return [b * s.ffn_block for b in ffn_blocks], rows

    def fill(self, groups: list[int], level: float) -> tuple[list[int], list[int]] | None:
        """FFN columns and vocab rows, greedily in node order, up to the level.

        The family with the bigger blocks goes first; if that does not pack,
        the other order is tried.
        """
        caps = self._caps(groups, level)
        if caps is None:
            return None
        ffn, vocab = self._families()
        for first_ffn in sorted((True, False), key=lambda f: f != (ffn[1] >= vocab[1])):
            left = list(caps)
            if first_ffn:
                fb, vb = _greedy_blocks(left, *ffn), _greedy_blocks(left, *vocab)
            else:
                vb, fb = _greedy_blocks(left, *vocab), _greedy_blocks(left, *ffn)
            if fb is not None and vb is not None:
                return self._as_ranges(fb, vb)
        return None

    def fill_exact(self, groups: list[int], level: float) -> tuple[list[int], list[int]] | None:
        """FFN and vocab packed exactly: DP over (node, FFN blocks so far) -> most vocab blocks so far.

        More vocab blocks placed for the same FFN position is never worse (what
        is left is a suffix of what would be left), so keeping the best is exact.
        """
        caps = self._caps(groups, level)
        if caps is None or sum(caps) < self._small_bytes:
            return None  # not even a fluid packing exists
        (n_fb, F, _), vocab = self._families()
        best = [0] + [-1] * n_fb
        back: list[list[tuple[int, int, int] | None]] = []
        for cap in caps:
            nxt: list[int] = [-1] * (n_fb + 1)
            how: list[tuple[int, int, int] | None] = [None] * (n_fb + 1)
            for f, v in enumerate(best):
                if v < 0:
                    continue
                for k in range(min(n_fb - f, cap // F) + 1):
                    t, _ = _fit(cap - k * F, v, *vocab)
                    if v + t > nxt[f + k]:
                        nxt[f + k], how[f + k] = v + t, (f, k, t)
            best = nxt
            back.append(how)
        if best[n_fb] != vocab[0]:
            return None
        fb, vb, f = [], [], n_fb
        for how in reversed(back):
            step = how[f]
            assert step is not None
            f, k, t = step
            fb.append(k)
            vb.append(t)
        return self._as_ranges(fb[::-1], vb[::-1])

    def try_level(self, level: float) -> tuple[list[int], list[int], list[int]] | None:
        """Groups, FFN blocks and vocab rows per node that fit under the level, or None."""
        groups = self.groups(level)
        if groups is None:
            return None
        filled = self.pack(groups, level)
        if filled is not None:
            return groups, *filled
        # The DP ranks group placements by room left, blind to how blocks round
        # into it, and the greedy fill can strand a block: when that matters and
        # the problem is small, pack exactly, over every group placement if few.
        n, G = len(self.nodes), self.shape.n_kv_heads
        if (math.comb(G + n - 1, n - 1) + 1) * self._exact_cost() > _EXACT_BUDGET:
            return None
        for groups in _compositions(G, n):
            if all(self._cap(i, a, level) >= 0 for i, a in enumerate(groups)):
                filled = self.fill_exact(groups, level)
                if filled is not None:
                    return groups, *filled
        return None

    def _exact_cost(self) -> int:
        return len(self.nodes) * (self.shape.n_ffn_blocks + 1) ** 2

    def pack(self, groups: list[int], level: float) -> tuple[list[int], list[int]] | None:
        """The greedy fill, or the exact one when the greedy strands a block and it is cheap."""
        filled = self.fill(groups, level)
        if filled is None and self._exact_cost() <= _EXACT_BUDGET:
            filled = self.fill_exact(groups, level)
        return filled


def _compositions(total: int, parts: int) -> Iterable[list[int]]:
    for cuts in itertools.combinations_with_replacement(range(total + 1), parts - 1):
        bounds = (0, *cuts, total)
        yield [bounds[i + 1] - bounds[i] for i in range(parts)]


def _bisect(ok: Callable[[float], bool], lo: float, hi: float) -> float:
    """Smallest level in (lo, hi] that ok() accepts, assuming ok(hi)."""
    for _ in range(_BISECT_STEPS):
        mid = (lo + hi) / 2
        if mid <= lo or mid >= hi or hi - lo <= hi * 1e-10:
            break
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi


def make_plan(shape: ModelShape, nodes: Iterable[NodeSpec], *, epoch: int = 0, sync: str = "f32",
              overhead_bytes: int = DEFAULT_OVERHEAD) -> Plan:
    """The speed-weighted plan minimising max(work_i / speed_i) under memory caps."""
    nodes = _check_nodes(nodes)
    why = _explain_memory(shape, nodes, overhead_bytes)
    if why:
        raise PlanError(why)
    p = _Planner(shape, nodes, overhead_bytes)
    hi = shape.weight_bytes / min(p.speed) * (1 + 1e-9)  # any one node could do it all in this time
    if p.try_level(hi) is None:
        raise PlanError("the units do not pack into free memory: "
                        + ", ".join(f"node {n.node_id}: {_fmt(n.mem_bytes)} free" for n in nodes))
    lo = shape.weight_bytes / sum(p.speed)  # the fluid bound: no plan beats it
    top = _bisect(lambda t: p.try_level(t) is not None, lo * (1 - 1e-12), hi)
    found = p.try_level(top)
    assert found is not None
    groups = found[0]
    level = _bisect(lambda t: p.pack(groups, t) is not None, 0.0, top)
    filled = p.pack(groups, level)
    cols, rows = filled if filled is not None else found[1:]
    return Plan(epoch, sync, shape, nodes, _shares(shape, nodes, groups, cols, rows), overhead_bytes)


def _even(total: int, n: int) -> list[int]:
    return [total // n + (1 if i < total % n else 0) for i in range(n)]


def equal_plan(shape: ModelShape, nodes: Iterable[NodeSpec], *, epoch: int = 0, sync: str = "f32",
               overhead_bytes: int = DEFAULT_OVERHEAD) -> Plan:
    """The baseline: every family split as evenly as units allow, speeds ignored."""
    nodes = _check_nodes(nodes)
    n = len(nodes)
    groups = _even(shape.n_kv_heads, n)
    cols = [b * shape.ffn_block for b in _even(shape.n_ffn_blocks, n)]
    vblocks = _even(-(-shape.vocab // shape.vocab_block), n)
    rows, row = [], 0
    for b in vblocks:
        take = min(shape.vocab - row, b * shape.vocab_block)
        rows.append(take)
        row += take
    plan = Plan(epoch, sync, shape, nodes, _shares(shape, nodes, groups, cols, rows), overhead_bytes)
    for node in nodes:
        need = plan.memory_bytes(node.node_id)
        if need > node.mem_bytes:
            raise PlanError(f"node {node.node_id}: needs {_fmt(need)} for its equal share, "
                            f"has {_fmt(node.mem_bytes)} free")
    return plan
