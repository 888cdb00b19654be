"""The cost model (parallel/cost.py) against the formulas it states, computed by hand here."""

from __future__ import annotations

import pytest

from edgetp.parallel import cost, pipeline
from edgetp.parallel.plan import ModelShape, NodeSpec

GIB = 2**30
# one layer: 4 KV groups of 256*32*6 bytes + 1024 FFN columns of 3*256 bytes = 983040 bytes; vocab 256000 bytes
SHAPE = ModelShape(n_layers=16, dim=256, n_heads=8, n_kv_heads=4, head_dim=32, ffn=1024, vocab=1000,
                   attn_bpw=1.0, ffn_bpw=1.0, vocab_bpw=1.0, ctx=64)
LAYER, VOCAB = 983040, 256000
OH = cost.Overheads(message_s=50e-6, row_cost=0.5, layer_s=0.0, value_s=0.0)


def test_one_node_costs_its_weights_over_its_speed():
    plan = pipeline.stage_plan(SHAPE, [[NodeSpec("r", 1e9, GIB)]])
    p = cost.predict(plan, {}, 1, OH)
    assert p.step_s == pytest.approx((16 * LAYER + VOCAB) / 1e9) and p.sync_s == 0
    p4 = cost.predict(plan, {}, 4, OH)  # 4 rows: weights once, each extra row half the first
    assert p4.step_s == pytest.approx((16 * LAYER + VOCAB) / 1e9 * (1 + 0.5 * 3))
    assert p4.tok_s == pytest.approx(4 / p4.step_s)
    slow = cost.Overheads(message_s=50e-6, row_cost=0.5, layer_s=1e-4, value_s=0.0)  # 0.1 ms a layer
    assert cost.predict(plan, {}, 1, slow).step_s == pytest.approx((16 * LAYER + VOCAB) / 1e9 + 16 * 1e-4)


def test_a_layer_costs_each_node_its_activations_beyond_its_weights():
    # per layer: 10 us, and 1 ns per value: dim 256 + the node's query heads (2 per KV group, 32 wide) + its FFN
    oh = cost.Overheads(message_s=50e-6, row_cost=0.5, layer_s=1e-5, value_s=1e-9)
    one = pipeline.stage_plan(SHAPE, [[NodeSpec("r", 1e9, GIB)]])
    assert cost.predict(one, {}, 1, oh).step_s == pytest.approx(
        (16 * LAYER + VOCAB) / 1e9 + 16 * (1e-5 + (256 + 256 + 1024) * 1e-9))
    r, w = NodeSpec("r", 1e9, GIB), NodeSpec("w", 3e9, GIB)  # w three times as fast: the larger share
    tp = pipeline.stage_plan(SHAPE, [[r, w]])
    big = max(tp.shares, key=lambda x: x.ffn_cols[1] - x.ffn_cols[0])
    kv, ffn = big.kv_groups[1] - big.kv_groups[0], big.ffn_cols[1] - big.ffn_cols[0]
    assert big.node_id == "w" and ffn > 512
    link = cost.LinkCost(rtt_s=1e-4, bytes_per_s=1e9)
    assert cost.predict(tp, {"w": link}, 1, oh).compute_s == pytest.approx(
        tp.makespan + 16 * (1e-5 + (256 + kv * 64 + ffn) * 1e-9), rel=1e-9)


def test_tensor_parallelism_pays_two_round_trips_per_layer_and_one_for_the_answers():
    r, w = NodeSpec("r", 1e9, GIB), NodeSpec("w", 1e9, GIB)
    plan = pipeline.stage_plan(SHAPE, [[r, w]])
    link = cost.LinkCost(rtt_s=2e-3, bytes_per_s=10e6)
    p = cost.predict(plan, {"w": link}, 1, OH)
    reduce = 2e-3 + 2 * 256 * 4 / 10e6 + 50e-6  # round trip, partial out and total back, one message
    sync = 2 * 16 * reduce + (2e-3 + 50e-6)
    assert p.sync_s == pytest.approx(sync)
    assert p.compute_s == pytest.approx(plan.makespan)
    assert p.step_s == pytest.approx(plan.makespan + sync)
    q8 = pipeline.stage_plan(SHAPE, [[r, w]], sync="q8_0")
    assert cost.predict(q8, {"w": link}, 1, OH).sync_s == pytest.approx(
        2 * 16 * (2e-3 + 2 * 256 * 34 / 32 / 10e6 + 50e-6) + 2e-3 + 50e-6)


def test_a_pipeline_pays_one_hop_per_stage_and_overlaps_micro_batches():
    r, w = NodeSpec("r", 1e9, GIB), NodeSpec("w", 1e9, GIB)
    plan = pipeline.stage_plan(SHAPE, [[r], [w]])
    (a, b), (c, d) = plan.stages[0][0].layers, plan.stages[1][0].layers
    t0 = (b - a) * LAYER / 1e9
    t1 = (d - c) * LAYER / 1e9 + VOCAB / 1e9
    link = cost.LinkCost(rtt_s=4e-3, bytes_per_s=12.5e6)
    hop = 4e-3 + 2 * 256 * 4 / 12.5e6 + 50e-6
    one = cost.predict(plan, {"w": link}, 1, OH)
    assert one.step_s == pytest.approx(t0 + t1 + hop)
    # 8 rows: two micro-batches of 4; the fill, then the slowest stage once more
    eight = cost.predict(plan, {"w": link}, 8, OH)
    s0 = t0 * (1 + 0.5 * 3)
    s1 = t1 * (1 + 0.5 * 3) + 4e-3 + 2 * 4 * 256 * 4 / 12.5e6 + 50e-6
    assert eight.step_s == pytest.approx(s0 + s1 + max(s0, s1))


def test_on_wifi_the_planner_keeps_tensor_parallelism_off_the_slow_link():
    shape = ModelShape(n_layers=16, dim=2048, n_heads=32, n_kv_heads=8, head_dim=64, ffn=8192, vocab=32000,
                       attn_bpw=1.0625, ffn_bpw=1.0625, vocab_bpw=1.0625, ctx=512)
    # 10 GB/s: a 1B Q8_0 model at 9 tokens a second on one node, as one core of the AMD EPYC here decodes it
    root, a, b = NodeSpec("r", 10e9, 8 * GIB), NodeSpec("a", 10e9, 8 * GIB), NodeSpec("b", 10e9, 8 * GIB)
    wifi = {n: cost.LinkCost(4e-3, 12.5e6) for n in ("a", "b")}
    best = pipeline.choose(shape, root, [a, b], wifi, rows=1)
    assert best.plan.kind == "single" and best.plan.nodes[0].node_id == "r"
    ethernet = {n: cost.LinkCost(0.3e-3, 125e6) for n in ("a", "b")}
    best = pipeline.choose(shape, root, [a, b], ethernet, rows=1)
    assert best.plan.kind == "tp" and len(best.plan.nodes) == 3
    mixed = {"a": cost.LinkCost(0.3e-3, 125e6), "b": cost.LinkCost(4e-3, 12.5e6)}
    best = pipeline.choose(shape, root, [a, b], mixed, rows=1)
    assert "b" not in {x.node_id for x in best.plan.stages[0]}  # no all-reduce crosses the Wi-Fi link


def test_a_model_too_big_for_any_node_is_split_into_stages_on_wifi():
    shape = ModelShape(n_layers=16, dim=2048, n_heads=32, n_kv_heads=8, head_dim=64, ffn=8192, vocab=32000,
                       attn_bpw=1.0625, ffn_bpw=1.0625, vocab_bpw=1.0625, ctx=512)
    cap = int(shape.weight_bytes * 0.6)  # no node holds it alone, two do
    root, a, b = NodeSpec("r", 10e9, cap), NodeSpec("a", 10e9, cap), NodeSpec("b", 10e9, cap)
    wifi = {n: cost.LinkCost(4e-3, 12.5e6) for n in ("a", "b")}
    best = pipeline.choose(shape, root, [a, b], wifi, rows=1)
    assert best.plan.kind == "pp", pipeline.describe(best.plan)
    for n in best.plan.nodes:
        assert best.plan.memory_bytes(n.node_id) <= cap
    tp = pipeline.choose(shape, root, [a, b], wifi, rows=1, parallel="tp")
    # 33 round trips of 4 ms against one per stage after the root's
    assert best.single.step_s < tp.single.step_s
    hop = 4e-3 + 2 * 2048 * 4 / 12.5e6 + cost.Overheads().message_s  # out and back, f32 residual
    assert best.single.sync_s == pytest.approx((len(best.plan.stages) - 1) * hop)
    assert tp.single.sync_s > 33 * 4e-3


def test_a_worker_left_out_is_told_why_with_the_cheapest_plan_that_has_it():
    root, a = NodeSpec("r", 10e9, 8 * GIB), NodeSpec("a", 10e9, 8 * GIB)
    links = {"a": cost.LinkCost(40e-3, 1e6)}  # a terrible link
    found = pipeline.candidates(SHAPE, root, [a], links)
    best = pipeline.choose(SHAPE, root, [a], links, found=found)
    assert [n.node_id for n in best.plan.nodes] == ["r"]
    # a worker predicted 3% faster alone than the root: not worth a link (pipeline.MARGIN, 5%)
    fast = NodeSpec("a", 10.3e9, 8 * GIB)
    near = {"a": cost.LinkCost(1e-6, 1e12)}
    assert [n.node_id for n in pipeline.choose(SHAPE, root, [fast], near).plan.nodes] == ["r"]
    faster = NodeSpec("a", 12e9, 8 * GIB)  # 20% faster: it does the work, the root only embeds
    assert pipeline.choose(SHAPE, root, [faster], near).plan.kind == "single"
    assert pipeline.choose(SHAPE, root, [faster], near).plan.share("a").layers == (0, 16)
    why = pipeline.left_out(found, best, "a")
    cheapest_with_a = min((c for c in found if "a" in {n.node_id for n in c.plan.nodes}),
                          key=lambda c: c.batch.step_s)
    assert f"{cheapest_with_a.batch.step_s * 1e3:.1f} ms" in why and f"{best.batch.step_s * 1e3:.1f} ms" in why


def test_a_measured_all_reduce_round_stands_for_the_round_trip_its_bytes_and_the_message_cost():
    # one f32 row is what the round carried: more rows add their bytes each way, q8_0 takes its saving off
    oh = cost.Overheads()
    measured = cost.LinkCost(rtt_s=170e-6, bytes_per_s=1e9, round_s=15e-6)
    assert measured.all_reduce(1, 2048, "f32", oh) == pytest.approx(15e-6)
    assert measured.all_reduce(4, 2048, "f32", oh) == pytest.approx(15e-6 + 2 * 2048 * 3 * 4 / 1e9)
    assert measured.all_reduce(1, 2048, "q8_0", oh) == pytest.approx(15e-6 - 2 * 2048 * (4 - 34 / 32) / 1e9)
    asyncio_only = cost.LinkCost(rtt_s=4e-3, bytes_per_s=12.5e6)
    assert asyncio_only.all_reduce(2, 576, "f32", oh) == pytest.approx(4e-3 + 2 * 2 * 576 * 4 / 12.5e6 + oh.message_s)


def test_a_stage_stretches_by_the_row_cost_its_nodes_measured_and_by_the_constant_where_none_did():
    r, w = NodeSpec("r", 1e9, GIB, row_cost=0.2), NodeSpec("w", 1e9, GIB, row_cost=0.1)
    plan = pipeline.stage_plan(SHAPE, [[r], [w]])
    (a, b), (c, d) = plan.stages[0][0].layers, plan.stages[1][0].layers
    t0, t1 = (b - a) * LAYER / 1e9, ((d - c) * LAYER + VOCAB) / 1e9
    link = cost.LinkCost(rtt_s=4e-3, bytes_per_s=12.5e6)
    hop4 = 4e-3 + 2 * 4 * 256 * 4 / 12.5e6 + 50e-6
    s0, s1 = t0 * (1 + 0.2 * 3), t1 * (1 + 0.1 * 3) + hop4  # two micro-batches of 4 rows, each stage its own cost
    assert cost.predict(plan, {"w": link}, 8, OH).step_s == pytest.approx(s0 + s1 + max(s0, s1))
    tp = pipeline.stage_plan(SHAPE, [[r, w]])  # one stage: it waits for the node that measured the most
    near = cost.LinkCost(rtt_s=1e-4, bytes_per_s=1e9)
    assert cost.predict(tp, {"w": near}, 4, OH).compute_s == pytest.approx(tp.makespan * (1 + 0.2 * 3))
    unmeasured = pipeline.stage_plan(SHAPE, [[NodeSpec("r", 1e9, GIB), NodeSpec("w", 1e9, GIB)]])
    assert cost.predict(unmeasured, {"w": near}, 4, OH).compute_s == pytest.approx(unmeasured.makespan * 2.5)
    with pytest.raises(ValueError, match="row_cost"):
        NodeSpec("x", 1e9, GIB, row_cost=5.0)
