"""tools/bench_links.py marks the planner's choice on the measured row of the same plan: the same stages
over the same nodes, whatever order a tensor-parallel group lists its members in."""

from __future__ import annotations

from tools.bench_links import _same_nodes


def test_a_tensor_group_listed_in_another_order_is_the_same_plan():
    assert _same_nodes("tp: layers 0:16 on root+vm-a+vm-b", "tp: layers 0:16 on root+vm-b+vm-a")
    assert _same_nodes("pp: layers 0:7 on root; layers 7:16 on vm-a", "pp: layers 0:9 on root; layers 9:16 on vm-a")


def test_other_nodes_or_other_stages_are_another_plan():
    assert not _same_nodes("tp: layers 0:16 on root+vm-a", "tp: layers 0:16 on root+vm-b")
    assert not _same_nodes("pp: layers 0:7 on root; layers 7:16 on vm-a", "pp: layers 0:7 on vm-a; layers 7:16 on root")
    assert not _same_nodes("hybrid: layers 0:14 on root+vm-a; layers 14:16 on vm-b", "tp: layers 0:16 on root+vm-a+vm-b")
