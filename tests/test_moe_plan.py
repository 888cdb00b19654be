"""Experts as a planning unit (parallel/experts.py, plan.expected_max): pure, no sockets.

References: the expected wait of a routing worked out by hand or by the
hypergeometric law, placements checked against every split of the experts by
brute force, and the choice between placement and column splitting against the
arithmetic of the two regimes written out in each test.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest

from edgetp.parallel import cost, experts, packing
from edgetp.parallel.plan import ModelShape, NodeSpec, PlanError, expected_max


def test_the_expected_wait_of_two_of_eight_experts_on_two_nodes_is_the_hand_count():
    # C(8,2) = 28 routings: 2 * C(4,2) = 12 put both on one node (wait 2), 16 split them (wait 1)
    assert expected_max([4, 4], [1.0, 1.0], 2) == pytest.approx((12 * 2 + 16 * 1) / 28)
    assert expected_max([8], [0.5], 2) == pytest.approx(1.0)  # one node: always both experts
    assert expected_max([2, 6], [3.0, 1.0], 2) == pytest.approx(
        (1 * 6 + 2 * 6 * 3 + 15 * 2) / 28)  # both on the slow node / one each / both on the fast one


def test_the_sampled_wait_of_a_large_routing_agrees_with_the_hypergeometric_law():
    # 8 of 128 experts, 64 on each node: hits on node 0 is hypergeometric, the wait max(H, 8 - H)
    law = sum(math.comb(64, h) * math.comb(64, 8 - h) * max(h, 8 - h) for h in range(9)) / math.comb(128, 8)
    got = expected_max([64, 64], [1.0, 1.0], 8)
    assert got == pytest.approx(law, abs=0.05)  # 4096 samples: the mean's std is under 0.02
    assert got == expected_max([64, 64], [1.0, 1.0], 8)  # a fixed seed: the same number every time


def _shape(dim: int, ffn: int, n_layers: int = 2) -> ModelShape:
    # 16 experts top-4; ffn_bpw counts every expert's weights of a column (1 byte each), as model_shape does
    return ModelShape(n_layers=n_layers, dim=dim, n_heads=4, n_kv_heads=2, head_dim=dim // 4, ffn=ffn, vocab=640,
                      attn_bpw=1.0, ffn_bpw=16.0, vocab_bpw=1.0, n_experts=16, experts_used=4)


NODES = (NodeSpec("root", 3e9, 10**12), NodeSpec("b", 1e9, 10**12), NodeSpec("c", 2e9, 10**12))
LINKS = {"b": cost.LinkCost(1e-4, 1e9), "c": cost.LinkCost(1e-4, 1e9)}


def test_whole_experts_go_to_nodes_by_speed_as_the_best_split_does():
    plan = experts.place(packing.make_plan(_shape(256, 512), NODES))
    got = [b - a for a, b in (s.experts for s in plan.shares)]
    speeds = [n.speed for n in NODES]
    best = min(max(c / s for c, s in zip(split, speeds))
               for split in itertools.product(range(17), repeat=3) if sum(split) == 16)
    assert max(c / s for c, s in zip(got, speeds)) == pytest.approx(best)
    assert all(s.ffn_cols == (0, 512) for s in plan.shares)
    assert [s.kv_groups for s in plan.shares] == [s.kv_groups for s in packing.make_plan(_shape(256, 512), NODES).shares]


def test_a_node_short_of_memory_holds_only_the_experts_that_fit():
    shape = _shape(256, 512)
    base = packing.make_plan(shape, NODES)
    one = shape.expert_bytes  # bytes of one whole expert, all layers
    tight = (NODES[0], NodeSpec("b", 1e9, base.memory_bytes("b") + int(1.5 * one)), NodeSpec("c", 2e9, 10**12))
    plan = experts.place(packing.make_plan(shape, tight))
    b = plan.share("b").experts
    assert b[1] - b[0] <= 1 + (base.share("b").ffn_cols[1] - base.share("b").ffn_cols[0]) * 16 // 512
    for n in tight:
        assert plan.memory_bytes(n.node_id) <= n.mem_bytes
    # memory a byte short of each node's column split: 16 blocks of columns are 16 experts' bytes,
    # each node's room now a byte short of its whole number of experts
    short = tuple(NodeSpec(n.node_id, n.speed, base.memory_bytes(n.node_id) - 1) for n in NODES)
    with pytest.raises(PlanError, match="do not fit"):
        experts.place(replace(base, nodes=short))


def test_small_experts_are_placed_whole_and_large_ones_split_by_columns():
    # Small (64 x 32, 2 layers: 12 kB, 4 us on the slowest node): each run costs Overheads.expert_s (30 us)
    # beyond its bytes, so a column split pays 4 runs per layer on every node, placement only the most
    # any node holds of a token's 4 (1.9 on average here): placement is cheaper.
    small = packing.make_plan(_shape(64, 32), NODES)
    assert experts.choose(small, LINKS).shares[0].experts is not None
    # Large (2048 x 4096: 50 MB, 17 to 50 ms): the bytes dominate. Columns by speed read 4 * 50 MB / 6e9 B/s
    # = 33 ms a token; placement waits for the node with the most of a token's experts per speed,
    # at least 4 * 50 MB / 6e9 on average and more with routing's imbalance: columns are cheaper.
    large = packing.make_plan(_shape(2048, 4096), NODES)
    assert experts.choose(large, LINKS).shares[0].experts is None
    placed = experts.place(large)
    assert placed.makespan > large.makespan


def test_a_forced_choice_is_taken_and_a_dense_model_is_left_alone(caplog):
    plan = packing.make_plan(_shape(2048, 4096), NODES)
    assert experts.choose(plan, LINKS, mode="place").shares[0].experts is not None
    assert experts.choose(packing.make_plan(_shape(64, 32), NODES), LINKS, mode="columns").shares[0].experts is None
    assert not caplog.records
    dense = ModelShape(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn=64, vocab=640)
    assert experts.choose(packing.make_plan(dense, NODES), LINKS, mode="place").shares[0].experts is None
    assert caplog.records[-1].getMessage() == "experts 'place' has nothing to lay out: the model has no experts"
    one = packing.make_plan(_shape(64, 32), NODES[:1])
    assert experts.choose(one, {}, mode="mixed") is one
    assert "every stage of the plan is one node" in caplog.records[-1].getMessage()
    with pytest.raises(ValueError, match="experts must be one of"):
        experts.choose(plan, LINKS, mode="rows")


# ---------------------------------------------------------------- groups: whole experts mixed with columns


def test_the_expected_wait_of_nodes_sharing_a_groups_experts_is_the_hand_count():
    # 8 experts top-2, group 0 (node 0) holds 4 whole, group 1 (nodes 1, 2) splits the other 4 by
    # columns, nodes 1 and 2 taking 1.0 and 0.5 a hit. C(8,2) = 28 routings:
    # both in group 0 (6): node 0 waits 2; one each (16): max(1, 1, 0.5) = 1; both in group 1 (6): 2.
    assert expected_max([4, 4], [1.0, 1.0, 0.5], 2, group=[0, 1, 1]) == pytest.approx((6 * 2 + 16 * 1 + 6 * 2) / 28)
    # a node's fixed part (its piece of a shared expert) adds before the max: node 2 waits 3 + 0.5 * hits
    # of group 1, so 3, 3.5 and 4 over the same three kinds of routing
    assert expected_max([4, 4], [1.0, 1.0, 0.5], 2, [0.0, 0.0, 3.0], [0, 1, 1]) == pytest.approx(
        (6 * 3 + 16 * 3.5 + 6 * 4) / 28)


def test_a_mixed_layout_tiles_experts_by_group_and_columns_by_speed_within_each():
    shape = _shape(128, 128)
    plan = experts.place(packing.make_plan(shape, NODES), {0: (1, 2)})  # root alone; b and c together
    root, b, c = plan.shares
    assert root.ffn_cols == (0, 128) and b.experts == c.experts and root.experts[1] == b.experts[0]
    assert (root.experts[0], b.experts[1]) == (0, 16)
    # experts by the groups' speeds, 3 : (1 + 2): the best split of 16 is 8 / 8
    assert root.experts == (0, 8)
    # the pair's columns by speed 1 : 2 in blocks of 32: 128 columns, the best split 32 / 96
    assert (b.ffn_cols, c.ffn_cols) == ((0, 32), (32, 128))
    # what each holds: its experts' part of its columns, so the stage's FFN bytes add up to every expert's
    ffn_only = [replace(x, kv_groups=(0, 0), vocab_rows=(0, 0)) for x in plan.shares]
    assert sum(shape.share_work(x) for x in ffn_only) == pytest.approx(16 * shape.expert_bytes, rel=1e-9)
    assert shape.share_work(ffn_only[1]) == pytest.approx(8 * shape.expert_bytes / 4, rel=1e-9)
    # the wait: every routing of 4 of 16 enumerated here, each node's hits of its group times its bytes
    per_expert = [shape.expert_bytes * (x.ffn_cols[1] - x.ffn_cols[0]) / 128 / n.speed for x, n in zip(plan.shares, NODES)]
    group = [0, 1, 1]
    waits = []
    for routing in itertools.combinations(range(16), 4):
        hits = [sum(e < 8 for e in routing), sum(e >= 8 for e in routing)]
        waits.append(max(hits[g] * t for g, t in zip(group, per_expert)))
    rest = (max((x.kv_groups[1] - x.kv_groups[0]) * shape.group_bytes / n.speed for x, n in zip(plan.shares, NODES))
            + max((x.vocab_rows[1] - x.vocab_rows[0]) * shape.vocab_row_bytes / n.speed
                  for x, n in zip(plan.shares, NODES)))
    assert plan.makespan - rest == pytest.approx(sum(waits) / len(waits), rel=1e-9)


def test_a_layout_that_does_not_tile_is_refused():
    plan = experts.place(packing.make_plan(_shape(128, 128), NODES), {0: (1, 2)})
    root, b, c = plan.shares
    with pytest.raises(ValueError, match="ffn_cols of experts"):
        replace(plan, shares=(root, b, replace(c, ffn_cols=(32, 96))))
    with pytest.raises(ValueError, match="must all hold that range"):
        replace(plan, shares=(root, b, replace(c, experts=(9, 16))))
    with pytest.raises(ValueError, match="do not split the 3 nodes"):
        experts.place(packing.make_plan(_shape(128, 128), NODES), {0: (2, 2)})


def test_the_choice_runs_between_columns_mixes_and_placement_as_experts_grow():
    # Each expert run costs Overheads.expert_s (30 us) beyond its bytes. Columns make every node run
    # all 4 of a token's experts; placement makes the busiest node run the most any one node holds of
    # the 4, and a token waits for that node's bytes; a group of nodes in between. Tiny experts: the
    # runs dominate and placement wins. Large ones: bytes dominate, and columns win (no routing
    # imbalance). In between a mix: one group of two nodes routes more evenly than two nodes apart.
    got = {dims: experts.layout(experts.choose(packing.make_plan(_shape(*dims), NODES), LINKS))
           for dims in ((64, 32), (128, 128), (2048, 4096))}
    assert got == {(64, 32): "place", (128, 128): "mixed", (2048, 4096): "columns"}
    plan = packing.make_plan(_shape(128, 128), NODES)
    steps = {mode: cost.predict(experts.choose(plan, LINKS, mode=mode), LINKS).step_s
             for mode in ("columns", "place", "mixed")}
    assert steps["mixed"] < min(steps["columns"], steps["place"])
    two = packing.make_plan(_shape(128, 128), NODES[:2])  # two nodes: no layout mixes
    with pytest.raises(PlanError, match="3 or more"):
        experts.choose(two, {"b": LINKS["b"]}, mode="mixed")
