"""Nodes on one machine share its cores and memory bandwidth: the planner and the cost model use what
they read together, measured at once, wherever they compute at once.

References: the proportional-sharing formula and the plans' weight bytes, computed by hand here; the
kernel's boot id read from /proc by the test itself; a real worker process.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from edgetp.commands import shared_lines
from edgetp.daemon import cluster_view
from edgetp.model import gguf
from edgetp.net.loopthread import LoopThread
from edgetp.parallel import cost, packing, pipeline, profile
from edgetp.parallel.plan import NodeSpec, busy_speeds, group_speed
from edgetp.parallel.runner import ClusterRunner, NodeInfo, _host_of, _together, read_together
from edgetp.serve.spawn import start_worker, stop
from tests.test_cost import GIB, LAYER, OH, SHAPE, VOCAB

ROW = VOCAB // SHAPE.vocab  # one vocabulary row's bytes


def test_nodes_of_one_machine_split_what_it_reads_in_proportion_to_their_speeds_alone():
    a, b = NodeSpec("a", 2e9, GIB, "m1", 1.5e9), NodeSpec("b", 1e9, GIB, "m1", 1.5e9)
    c = NodeSpec("c", 1e9, GIB)  # a machine of its own
    assert busy_speeds([a, b, c]) == pytest.approx({"a": 1e9, "b": 0.5e9, "c": 1e9})
    assert group_speed([a, b, c]) == pytest.approx(2.5e9)
    assert busy_speeds([a, c]) == pytest.approx({"a": 1.5e9, "c": 1e9})  # alone on m1: a reads at most m1's 1.5
    assert busy_speeds([b, c]) == pytest.approx({"b": 1e9, "c": 1e9})  # under what m1 reads: its speed alone
    unmeasured = NodeSpec("d", 1e9, GIB, "m1")
    assert busy_speeds([unmeasured, NodeSpec("e", 1e9, GIB, "m1")]) == {"d": 1e9, "e": 1e9}
    with pytest.raises(ValueError, match="host_speed"):
        NodeSpec("x", 1e9, GIB, "m1", -1.0)


def test_a_tensor_parallel_pair_on_one_machine_takes_the_time_of_what_it_reads_together():
    r, w = NodeSpec("r", 1e9, GIB, "m", 1.5e9), NodeSpec("w", 1e9, GIB, "m", 1.5e9)
    plan = packing.make_plan(SHAPE, [r, w])
    # each node half of every layer and 16 of the 32 vocab blocks (512 rows, the other 488), at 1.5/2 GB/s
    assert plan.makespan == pytest.approx((8 * LAYER + 512 * ROW) / 0.75e9)
    link = cost.LinkCost(rtt_s=1e-4, bytes_per_s=1e9)
    assert cost.predict(plan, {"w": link}, 1, OH).compute_s == pytest.approx((8 * LAYER + 512 * ROW) / 0.75e9)
    apart = packing.make_plan(SHAPE, [NodeSpec("r", 1e9, GIB), NodeSpec("w", 1e9, GIB)])
    assert apart.makespan == pytest.approx((8 * LAYER + 512 * ROW) / 1e9)


def test_shares_follow_the_speeds_nodes_have_while_they_compute_together():
    # a and b share a machine that reads no faster than one of them: c, alone on its own, is worth both
    a, b = NodeSpec("a", 1e9, GIB, "m", 1e9), NodeSpec("b", 1e9, GIB, "m", 1e9)
    plan = packing.make_plan(SHAPE, [a, b, NodeSpec("c", 1e9, GIB)])
    width = {x.node_id: (x.kv_groups[1] - x.kv_groups[0], x.ffn_cols[1] - x.ffn_cols[0]) for x in plan.shares}
    assert width == {"a": (1, 256), "b": (1, 256), "c": (2, 512)}


def test_a_stage_of_nodes_on_one_machine_gets_the_layers_of_what_it_reads_together():
    a, b = NodeSpec("a", 1e9, GIB, "m", 1e9), NodeSpec("b", 1e9, GIB, "m", 1e9)
    c = NodeSpec("c", 1e9, GIB)
    plan = pipeline.stage_plan(SHAPE, [[a, b], [c]])
    # both stages read 1 GB/s: 8 layers each, the vocabulary (0.26 of a layer) fitting within the last stage's
    assert [st[0].layers for st in plan.stages] == [(0, 8), (8, 16)]
    apart = pipeline.stage_plan(SHAPE, [[NodeSpec("a", 1e9, GIB), NodeSpec("b", 1e9, GIB)], [c]])
    assert [st[0].layers for st in apart.stages] == [(0, 11), (11, 16)]


def test_pipeline_stages_on_one_machine_share_it_once_every_stage_works_at_once():
    r, w = NodeSpec("r", 1e9, GIB, "m", 1.5e9), NodeSpec("w", 1e9, GIB, "m", 1.5e9)
    plan = pipeline.stage_plan(SHAPE, [[r], [w]])
    (a, b), (c, d) = plan.stages[0][0].layers, plan.stages[1][0].layers
    t0, t1 = (b - a) * LAYER, (d - c) * LAYER + 1000 * ROW  # bytes of each stage
    link = cost.LinkCost(rtt_s=4e-3, bytes_per_s=12.5e6)
    hop1, hop4 = (4e-3 + 2 * n * 256 * 4 / 12.5e6 + 50e-6 for n in (1, 4))
    # one stream: one stage computes at a time, each at its speed alone
    assert cost.predict(plan, {"w": link}, 1, OH).step_s == pytest.approx(t0 / 1e9 + t1 / 1e9 + hop1)
    # 8 rows, two micro-batches of 4: the fill at full speed, then both stages at once at 0.75 GB/s each
    s0, s1 = t0 / 1e9 * 2.5, t1 / 1e9 * 2.5 + hop4
    b0, b1 = t0 / 0.75e9 * 2.5, t1 / 0.75e9 * 2.5 + hop4
    assert cost.predict(plan, {"w": link}, 8, OH).step_s == pytest.approx(s0 + s1 + max(b0, b1))


def test_what_nodes_read_together_is_bounded_by_what_they_read_alone():
    assert read_together([25e9, 25e9], [15e9, 16e9]) == pytest.approx(31e9)
    assert read_together([20e9, 21e9], [30e9, 15e9]) == pytest.approx(41e9)  # more than both alone: another phase
    assert read_together([25e9, 20e9], [10e9, 9e9]) == pytest.approx(25e9)  # less than the fastest alone


def test_the_machine_is_named_by_the_kernels_boot_id(tmp_path):
    boot = tmp_path / "boot_id"
    boot.write_text("4f1c2e0a-9b7d-4e21-8c3f-0d5e6a7b8c9d\n")
    assert profile.host_id(str(boot)) == "4f1c2e0a-9b7d-4e21-8c3f-0d5e6a7b8c9d"
    assert profile.host_id(str(tmp_path / "missing")) == ""
    assert _host_of({"host": "4f1c2e0a"}) == "4f1c2e0a"
    for bad in ({}, {"host": 7}, {"host": "x" * 65}, {"host": None}):
        assert _host_of(bad) == ""


def test_nodes_on_machines_of_their_own_are_not_profiled_again():
    infos = [NodeInfo("r", "local", 1e9, GIB, 0.0, "local", host="m1"),
             NodeInfo("a", "a:1", 1e9, GIB, 0.1, "blocking", host="m2"),
             NodeInfo("b", "b:1", 1e9, GIB, 0.1, "blocking", host="")]
    with LoopThread() as lt:  # no link to ask: a second profile would fail on the empty list
        assert lt.run(_together(infos, [], 0.05, 8, 1)) == infos
    assert [i.spec(1e9).host for i in infos] == ["", "", ""]  # named only where shared


def test_a_worker_on_this_machine_is_profiled_with_the_root_at_once(stories_path):
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    proc, addr = start_worker()
    try:
        mf = gguf.open_model(stories_path)
        with LoopThread() as lt:
            runner = lt.run(ClusterRunner.connect(mf, [addr], ctx=64), timeout=300)
            try:
                nodes, specs = runner.nodes, runner.plan.nodes
                view = cluster_view(runner, "stories260K")
            finally:
                runner.close()
    finally:
        stop(proc)
    assert [n.host for n in nodes] == [boot_id, boot_id]
    assert nodes[0].host_speed > 0 and nodes[1].host_speed == nodes[0].host_speed
    for spec in specs:  # whatever the plan kept, each node carries its machine
        assert (spec.host, spec.host_speed) == (boot_id, nodes[0].host_speed)
    assert {n.machine for n in view.nodes} == {boot_id[:8]}
    lines = shared_lines([vars(n) for n in view.nodes])
    assert len(lines) == 1 and all(n.node_id in lines[0] for n in nodes) and f"machine {boot_id[:8]}" in lines[0]


def test_a_timing_given_a_start_waits_for_it_and_a_past_start_does_not_delay_it():
    ws = profile.timing_set([[profile.random_weight(8, 256, 256)]], cache=0)  # Q8_0
    t0 = time.time()
    profile.step_seconds(ws, 1, 0.01, start_at=t0 + 0.3)
    assert time.time() - t0 >= 0.3
    t0 = time.time()
    profile.step_seconds(ws, 1, 0.01, start_at=t0 - 100)
    assert time.time() - t0 < 5  # not the 100 s back, nor MAX_WAIT_S
