"""Packing units of work into nodes: make_plan (speed-weighted) and equal_plan (the baseline).

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

import heapq
import itertools
import math
from typing import Callable, Iterable

from edgetp.parallel.plan import (
    DEFAULT_OVERHEAD,
    ModelShape,
    NodeSpec,
    Plan,
    PlanError,
    Share,
    busy_speeds,
    fmt_bytes,
)

_BISECT_STEPS = 80
_EXACT_BUDGET = 200_000  # steps of exact packing allowed when the greedy fill strands a block


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


def _explain_memory(shape: ModelShape, nodes: tuple[NodeSpec, ...], overhead: int) -> PlanError | None:
    """Why the model cannot fit in memory (naming the node when one is too small), or None when the simple checks pass."""
    unit_g = shape.group_bytes + shape.group_kv_bytes
    smallest = min(unit_g, shape.ffn_block_bytes, shape.vocab_row_bytes * min(shape.vocab_block, shape.vocab))
    for n in nodes:
        if n.mem_bytes < overhead + smallest:
            return PlanError(f"node {n.node_id}: needs {fmt_bytes(overhead + smallest)} for its smallest share, "
                             f"has {fmt_bytes(n.mem_bytes)} free", node_id=n.node_id)
    need = shape.weight_bytes + shape.n_kv_heads * shape.group_kv_bytes + len(nodes) * overhead
    have = sum(n.mem_bytes for n in nodes)
    if need > have:
        return PlanError(f"total model {fmt_bytes(need)} (weights {fmt_bytes(shape.weight_bytes)}, KV cache for ctx {shape.ctx} "
                         f"{fmt_bytes(shape.n_kv_heads * shape.group_kv_bytes)}, overhead {len(nodes)} x {fmt_bytes(overhead)}) "
                         f"> total free memory {fmt_bytes(have)}")
    fits = {n.node_id: (n.mem_bytes - overhead) // unit_g for n in nodes}
    if sum(fits.values()) < shape.n_kv_heads:
        each = ", ".join(f"node {k}: {v}" for k, v in fits.items())
        return PlanError(f"attention needs {shape.n_kv_heads} KV groups of {fmt_bytes(unit_g)} each (weights + KV cache), "
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
        self.speed = list(busy_speeds(nodes).values())  # a stage's nodes compute at once
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
    """The speed-weighted plan: the fastest token time (Plan.makespan) under memory caps.

    Every layer ends its attention and its FFN with an all-reduce, a barrier,
    and the vocabulary rows end the token: each family's slowest node sets
    its phase's time. So each family is balanced on its own, by water-filling
    (the next unit goes to the node that would finish it soonest), which is
    optimal for each family; KV groups go first as the coarsest units. When
    memory is too tight for that, the total-balancing packer below decides.
    """
    nodes = _check_nodes(nodes)
    why = _explain_memory(shape, nodes, overhead_bytes)
    if why:
        raise why
    balanced = _balance_families(shape, nodes, overhead_bytes)
    if balanced is not None:
        return Plan(epoch, sync, shape, nodes, _shares(shape, nodes, *balanced), overhead_bytes)
    return _pack_by_total(shape, nodes, epoch, sync, overhead_bytes)


def _balance_families(shape: ModelShape, nodes: tuple[NodeSpec, ...],
                      overhead: int) -> tuple[list[int], list[int], list[int]] | None:
    """(groups, FFN columns, vocab rows) per node, each family water-filled; None if memory runs out."""
    speeds = list(busy_speeds(nodes).values())  # a stage's nodes compute at once
    room = [n.mem_bytes - overhead for n in nodes]
    n_vb = -(-shape.vocab // shape.vocab_block)
    families = [
        (shape.n_kv_heads, shape.group_bytes, shape.group_bytes + shape.group_kv_bytes),
        (shape.n_ffn_blocks, shape.ffn_block_bytes, shape.ffn_block_bytes),
        (n_vb, shape.vocab_block * shape.vocab_row_bytes, shape.vocab_block * shape.vocab_row_bytes),
    ]
    counts = []
    for units, work, mem in families:
        got = _water_fill(units, work, mem, speeds, room)
        if got is None:
            return None
        counts.append(got)
    groups, blocks, vblocks = counts
    rows = [b * shape.vocab_block for b in vblocks]
    last = max((i for i, b in enumerate(vblocks) if b), default=0)
    rows[last] -= n_vb * shape.vocab_block - shape.vocab  # the last block may be short
    return groups, [b * shape.ffn_block for b in blocks], rows


def _water_fill(units: int, work: int, mem: int, speeds: list[float], room: list[int]) -> list[int] | None:
    """Counts per node minimising max(count_i * work / speed_i), within each node's room (updated)."""
    counts = [0] * len(speeds)
    heap = [((1 * work) / s, i) for i, s in enumerate(speeds)]
    heapq.heapify(heap)
    for _ in range(units):
        while heap and room[heap[0][1]] < mem:
            heapq.heappop(heap)  # this node is full for this family
        if not heap:
            return None
        _, i = heapq.heappop(heap)
        counts[i] += 1
        room[i] -= mem
        heapq.heappush(heap, ((counts[i] + 1) * work / speeds[i], i))
    return counts


def _pack_by_total(shape: ModelShape, nodes: tuple[NodeSpec, ...], epoch: int, sync: str,
                   overhead_bytes: int) -> Plan:
    """Fallback for tight memory: minimises max(total work_i / speed_i), packing exactly where needed."""
    p = _Planner(shape, nodes, overhead_bytes)
    hi = shape.weight_bytes / min(p.speed) * (1 + 1e-9)  # any one node could do it all in this time
    if p.try_level(hi) is None:
        raise PlanError("the units do not pack into free memory: "
                        + ", ".join(f"node {n.node_id}: {fmt_bytes(n.mem_bytes)} free" for n in nodes))
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
            raise PlanError(f"node {node.node_id}: needs {fmt_bytes(need)} for its equal share, "
                            f"has {fmt_bytes(node.mem_bytes)} free", node_id=node.node_id)
    return plan
