"""The speed-weighted planner, checked against an independent brute force.

The optimum in `brute_force` enumerates every way to give each node a count
of KV groups, FFN blocks and vocab blocks (contiguous ranges in node order
are then fixed by the counts), with unit sizes computed here from the
formulas in DESIGN.md, not from the planner's properties. That is the exact
optimum of the same problem, so "within one unit of it" is a real bound.
The slack allowed is one FFN block or one vocab block (the larger) on the
slowest node: the bisection is exact up to float tolerance, and only the
rounding of these small blocks into each node's room is approximate.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgetp.parallel.packing import equal_plan, make_plan
from edgetp.parallel.plan import ModelShape, NodeSpec, Plan, PlanError, Share

OVERHEAD = 1000


def units(shape: ModelShape) -> dict[str, int]:
    """Unit sizes in bytes, straight from the definitions."""
    q = shape.n_heads // shape.n_kv_heads
    qkv_rows = (q + 2) * shape.head_dim  # q rows for q heads, one k and one v head
    o_cols = q * shape.head_dim
    group = shape.n_layers * (qkv_rows * shape.dim + shape.dim * o_cols) * shape.attn_bpw
    ffn = shape.n_layers * (2 * shape.ffn_block * shape.dim + shape.dim * shape.ffn_block) * shape.ffn_bpw
    return {
        "group": round(group),
        "kv": shape.n_layers * shape.ctx * shape.kv_bytes_per_head_pos,
        "ffn": round(ffn),
        "row": round(shape.dim * shape.vocab_bpw),
    }


def compositions(total: int, parts: int):
    for cuts in itertools.combinations_with_replacement(range(total + 1), parts - 1):
        bounds = (0, *cuts, total)
        yield [bounds[i + 1] - bounds[i] for i in range(parts)]


def brute_force(shape: ModelShape, nodes: list[NodeSpec], overhead: int) -> float | None:
    """The exact optimal token time, or None when nothing fits memory.

    Token time: every layer's attention and FFN end in an all-reduce (a
    barrier) and the vocabulary rows end the token, so it is the sum over the
    three families of the slowest node's time for that family.
    By design a node that cannot hold even its smallest unit makes the plan
    infeasible (it is named in the error) rather than silently left idle.
    """
    u = units(shape)
    n = len(nodes)
    smallest = min(u["group"] + u["kv"], u["ffn"], u["row"] * min(shape.vocab, shape.vocab_block))
    if any(node.mem_bytes < overhead + smallest for node in nodes):
        return None
    n_vblocks = -(-shape.vocab // shape.vocab_block)
    best = None
    for g in compositions(shape.n_kv_heads, n):
        for f in compositions(shape.ffn // shape.ffn_block, n):
            for v in compositions(n_vblocks, n):
                phases, start = [0.0, 0.0, 0.0], 0
                for node, gi, fi, vi in zip(nodes, g, f, v):
                    rows = min(shape.vocab, (start + vi) * shape.vocab_block) - min(shape.vocab, start * shape.vocab_block)
                    start += vi
                    if gi * (u["group"] + u["kv"]) + fi * u["ffn"] + rows * u["row"] + overhead > node.mem_bytes:
                        break
                    for k, work in enumerate((gi * u["group"], fi * u["ffn"], rows * u["row"])):
                        phases[k] = max(phases[k], work / node.speed)
                else:
                    total = sum(phases)
                    best = total if best is None else min(best, total)
    return best


def check_tiles(plan: Plan) -> None:
    s = plan.shape
    for attr, total in (("kv_groups", s.n_kv_heads), ("ffn_cols", s.ffn), ("vocab_rows", s.vocab)):
        pos = 0
        for share in plan.shares:
            start, stop = getattr(share, attr)
            assert start == pos and stop >= start
            pos = stop
        assert pos == total


small_shapes = st.builds(
    lambda layers, dim, kv, q, hd, nf, vocab, bpw, ctx: ModelShape(
        n_layers=layers, dim=dim, n_heads=kv * q, n_kv_heads=kv, head_dim=hd, ffn=32 * nf, vocab=vocab,
        ffn_block=32, vocab_block=32, attn_bpw=bpw[0], ffn_bpw=bpw[1], vocab_bpw=bpw[2], ctx=ctx),
    st.integers(1, 2), st.sampled_from([32, 64]), st.integers(1, 3), st.integers(1, 3),
    st.sampled_from([8, 16, 32]), st.integers(1, 5), st.integers(1, 128),
    st.tuples(*[st.sampled_from([0.5, 1.0625, 4.0])] * 3), st.integers(1, 8),
)


@st.composite
def cases(draw, max_nodes=3):
    shape = draw(small_shapes)
    n = draw(st.integers(1, max_nodes))
    total = shape.weight_bytes + shape.n_kv_heads * units(shape)["kv"]
    nodes = [
        NodeSpec(f"n{i}", draw(st.sampled_from([1.0, 2.0, 3.0, 5.0, 7.5])),
                 OVERHEAD + int(total * draw(st.floats(0.2, 1.2))))
        for i in range(n)
    ]
    return shape, nodes


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_plan_is_within_one_unit_per_family_of_the_brute_force_optimum_or_says_why_not(case):
    shape, nodes = case
    opt = brute_force(shape, nodes, OVERHEAD)
    if opt is None:
        with pytest.raises(PlanError):
            make_plan(shape, nodes, overhead_bytes=OVERHEAD)
        return
    plan = make_plan(shape, nodes, overhead_bytes=OVERHEAD)
    check_tiles(plan)
    u = units(shape)
    slowest = min(n.speed for n in nodes)
    one_unit_each = (u["group"] + u["ffn"] + u["row"] * shape.vocab_block) / slowest
    assert plan.makespan >= opt * (1 - 1e-12)
    assert plan.makespan <= opt + one_unit_each + 1e-9
    for n in nodes:
        assert plan.memory_bytes(n.node_id) <= n.mem_bytes


@settings(max_examples=100)
@given(small_shapes, st.lists(st.tuples(st.floats(0.1, 100), st.integers(0, 10**7)), min_size=1, max_size=9))
def test_every_unit_is_assigned_exactly_once_and_memory_caps_hold(shape, specs):
    nodes = [NodeSpec(f"node-{i}", sp, OVERHEAD + mem) for i, (sp, mem) in enumerate(specs)]
    try:
        plan = make_plan(shape, nodes, overhead_bytes=OVERHEAD)
    except PlanError as exc:
        assert "node" in str(exc) or "total" in str(exc)
        return
    check_tiles(plan)
    u = units(shape)
    for node, share in zip(nodes, plan.shares):
        g = share.kv_groups[1] - share.kv_groups[0]
        work = g * u["group"] + (share.ffn_cols[1] - share.ffn_cols[0]) // 32 * u["ffn"] \
            + (share.vocab_rows[1] - share.vocab_rows[0]) * u["row"]
        assert work + g * u["kv"] + OVERHEAD <= node.mem_bytes
        assert plan.times()[node.node_id] == pytest.approx(work / node.speed)


def big_shape(**kw) -> ModelShape:
    base = dict(n_layers=30, dim=576, n_heads=9, n_kv_heads=3, head_dim=64, ffn=1536, vocab=49152,
                attn_bpw=0.625, ffn_bpw=0.625, vocab_bpw=1.0625, ctx=512)
    return ModelShape(**{**base, **kw})


def nodes_with(speeds, mem=4 * 10**9):
    return [NodeSpec(f"pi-{i}", s, mem) for i, s in enumerate(speeds)]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7])
def test_equal_speeds_split_work_evenly_to_within_one_unit(n):
    shape = big_shape(n_kv_heads=9 if n > 3 else 3)
    plan = make_plan(shape, nodes_with([2e9] * n))
    works = [plan.work_bytes(s.node_id) for s in plan.shares]
    u = units(shape)
    # Each family is split to within one of its units (KV groups are the largest).
    one_each = u["group"] + u["ffn"] + u["row"] * shape.vocab_block
    assert max(works) - min(works) <= one_each
    assert plan.makespan <= shape.weight_bytes / (n * 2e9) + one_each / 2e9


def test_speeds_one_two_three_get_about_one_two_three_of_the_work():
    shape = big_shape(n_layers=32, dim=4096, n_heads=32, n_kv_heads=32, head_dim=128, ffn=11008,
                      vocab=32000, ffn_block=256)
    plan = make_plan(shape, nodes_with([1e9, 2e9, 3e9], mem=10**11))
    works = [plan.work_bytes(s.node_id) for s in plan.shares]
    for w, expected in zip(works, (1 / 6, 2 / 6, 3 / 6)):
        assert w / sum(works) == pytest.approx(expected, abs=0.01)
    # the fluid bound, plus what whole units cost (32 KV groups split 5/11/16, not 5.33/10.67/16)
    u = units(shape)
    fluid = shape.weight_bytes / 6e9
    assert fluid <= plan.makespan <= fluid + (u["group"] + u["ffn"] + u["row"] * shape.vocab_block) / 1e9


def test_more_nodes_than_kv_heads_leaves_some_nodes_without_attention_but_with_ffn_work():
    shape = big_shape()  # 3 KV heads
    plan = make_plan(shape, nodes_with([1e9] * 5))
    groups = [s.kv_groups[1] - s.kv_groups[0] for s in plan.shares]
    assert sum(groups) == 3 and groups.count(0) >= 2
    for s in plan.shares:
        assert plan.work_bytes(s.node_id) > 0
    assert plan.heads("pi-4") == (plan.share("pi-4").kv_groups[0] * 3, plan.share("pi-4").kv_groups[1] * 3)


def test_faster_plan_beats_the_equal_split_on_uneven_nodes():
    shape = big_shape()
    nodes = nodes_with([1e9, 3e9, 0.5e9])
    assert make_plan(shape, nodes).makespan < 0.6 * equal_plan(shape, nodes).makespan


def test_equal_plan_splits_each_family_evenly():
    shape = big_shape()
    plan = equal_plan(shape, nodes_with([1e9, 5e9]))
    assert [s.kv_groups for s in plan.shares] == [(0, 2), (2, 3)]
    assert [s.ffn_cols for s in plan.shares] == [(0, 768), (768, 1536)]
    assert [s.vocab_rows for s in plan.shares] == [(0, 24576), (24576, 49152)]


def test_a_node_too_small_for_any_share_is_named():
    nodes = nodes_with([1e9, 1e9, 1e9])
    nodes[1] = NodeSpec("pi-1", 1e9, 10**6)
    with pytest.raises(PlanError, match=r"node pi-1: needs .* for its smallest share, has 1.00 MB free"):
        make_plan(big_shape(), nodes)


def test_a_model_larger_than_all_memory_says_total_against_total():
    with pytest.raises(PlanError, match=r"total model .* > total free memory 200.00 MB"):
        make_plan(big_shape(), nodes_with([1e9, 1e9], mem=100 * 10**6))


def test_kv_groups_that_fit_no_node_are_reported():
    shape = big_shape(ctx=20_000)  # each group's KV cache is 307 MB: one per node fits, not two
    with pytest.raises(PlanError, match=r"attention needs 3 KV groups .*only 2 \(node pi-0: 1, node pi-1: 1\)"):
        make_plan(shape, nodes_with([1e9, 1e9], mem=600 * 10**6))


def test_equal_plan_names_the_node_whose_even_share_does_not_fit():
    nodes = [NodeSpec("big", 1e9, 4 * 10**9), NodeSpec("small", 1e9, 120 * 10**6)]
    with pytest.raises(PlanError, match="node small: needs"):
        equal_plan(big_shape(), nodes)
    make_plan(big_shape(), nodes)  # the weighted planner can route around it


def test_share_is_frozen_and_plan_is_hashable_value():
    plan = make_plan(big_shape(), nodes_with([1e9]))
    with pytest.raises(AttributeError):
        plan.shares[0].kv_groups = (0, 1)  # type: ignore[misc]
    assert plan.shares[0] == Share("pi-0", (0, 3), (0, 1536), (0, 49152))
