"""Pipeline stages across real processes, and the planner's plan kinds.

Real `edgetp worker` processes on 127.0.0.1, the root in this process. Every
layout (a pipeline of single-node stages, the root's tensor-parallel group
followed by a stage, a worker alone behind a root that only embeds) must give
the single-node engine's greedy tokens: a stage hands its residual stream on
as f32, so with f32 sync and the float kernels the arithmetic is the single
node's, in the same order. The pure parts (layer split, plan kinds) are held
to formulas.
"""

from __future__ import annotations

import numpy as np
import pytest

from edgetp.model import gguf, quant, sampling
from edgetp.model.batch import Row
from edgetp.model.generate import LocalRunner
from edgetp.net.loopthread import LoopThread
from edgetp.parallel import pipeline
from edgetp.parallel.plan import ModelShape, NodeSpec, PlanError
from edgetp.parallel.runner import ClusterRunner
from edgetp.serve.spawn import start_worker, stop
from tests.test_parallel import greedy

GREEDY = sampling.SamplingParams(temperature=0)
STORY = "Once upon a time, there was a little girl named Lily. She"


@pytest.fixture(autouse=True)
def _float_kernels(monkeypatch):
    monkeypatch.setenv("EDGETP_INT8", "0")


@pytest.fixture(scope="module")
def control():
    quant.set_threads(1)
    with LoopThread() as lt:
        yield lt


LAYOUTS = {
    "pp over three": [[0], [1], [2]],
    "hybrid: root+w1, then w2": [[0, 1], [2]],
    "a worker alone behind an embedding root": [[], [1]],
    "pp over two, the first worker left idle": [[0], [2]],
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_gives_the_single_node_greedy_tokens(name, float_workers, control, stories_path):
    from edgetp.model.tokenizer import Tokenizer  # noqa: PLC0415

    mf = gguf.open_model(stories_path)
    ids = Tokenizer.from_metadata(mf.metadata).encode(STORY)
    expected = greedy(LocalRunner(mf, 256), ids, 48)
    runner = control.run(ClusterRunner.connect(mf, float_workers[:2], ctx=256, weights=[1, 2, 3],
                                               layout=LAYOUTS[name]),
                         timeout=300)
    try:
        layers = [(n.node_id, n.stage, n.layers) for n in runner.nodes]
        assert len(runner.plan.stages) == len(LAYOUTS[name]), layers
        assert greedy(runner, ids, 48) == expected, f"{name}: {layers}"
    finally:
        runner.close()


def test_a_batch_through_a_pipeline_gives_each_sequence_its_single_node_tokens(float_workers, control,
                                                                            stories_path):
    """Four sequences decoded together, cut into micro-batches across three stages."""
    from edgetp.model.tokenizer import Tokenizer  # noqa: PLC0415

    mf = gguf.open_model(stories_path)
    tok = Tokenizer.from_metadata(mf.metadata)
    prompts = [tok.encode(p) for p in ("Once upon a time", "The dog", "Lily and Ben went", "A big red ball")]
    expected = [greedy(LocalRunner(mf, 128), p, 16) for p in prompts]
    runner = control.run(ClusterRunner.connect(mf, float_workers[:2], ctx=128, slots=4, layout=[[0], [1], [2]]),
                         timeout=300)
    try:
        runner.begin()
        try:
            history = [list(p) for p in prompts]
            got = [[] for _ in prompts]
            nxt = [int(runner.prefill(s, p, 0, history[s], GREEDY).ids[0]) for s, p in enumerate(prompts)]
            for _ in range(16):
                rows = []
                for s in range(4):
                    got[s].append(nxt[s])
                    history[s].append(nxt[s])
                    rows.append(Row(s, len(history[s]) - 1, nxt[s], history[s], GREEDY))
                nxt = [int(c.ids[0]) for c in runner.decode(rows)]
        finally:
            runner.end()
    finally:
        runner.close()
    assert got == expected


# --------------------------------------------------------------------------- the pure planner

SHAPE = ModelShape(n_layers=16, dim=256, n_heads=8, n_kv_heads=4, head_dim=32, ffn=1024, vocab=1000,
                   attn_bpw=1.0, ffn_bpw=1.0, vocab_bpw=1.0, ctx=64)
GIB = 2**30


def test_layers_split_so_each_stage_takes_the_same_time_by_speed():
    # one layer is 4 groups of 256*32*(2*2+2) bytes + 32 FFN blocks of 3*256*32 bytes = 983040 bytes; the vocab
    # (256000 bytes) sits on the last stage. Speeds 3:1 and no vocab would give 12:4; with it the last stage
    # carries 0.26 layers more, so the first takes 12 of 16 and the second 4 (times 12/3 = 4.0 vs 4.26).
    fast, slow = NodeSpec("a", 3e9, GIB), NodeSpec("b", 1e9, GIB)
    plan = pipeline.stage_plan(SHAPE, [[fast], [slow]])
    assert [st[0].layers for st in plan.stages] == [(0, 12), (12, 16)]
    assert plan.kind == "pp"
    assert plan.share("a").vocab_rows == (0, 0) and plan.share("b").vocab_rows == (0, 1000)
    # the plan's work is the model's: each stage a fraction of every layer
    assert sum(plan.work_bytes(n) for n in ("a", "b")) == pytest.approx(SHAPE.weight_bytes, rel=1e-6)


def test_a_stage_short_of_memory_takes_fewer_layers_and_a_hopeless_one_is_refused():
    layer = 983040 + 4 * 64 * 2 * 32 * 4 * 16 // 16  # weights and f32 KV cache of one layer
    small = NodeSpec("b", 9e9, 64 * 2**20 + 3 * layer + 256000)  # room for 3 layers and the vocab
    plan = pipeline.stage_plan(SHAPE, [[NodeSpec("a", 1e9, GIB)], [small]])
    assert plan.stages[1][0].layers == (13, 16)
    with pytest.raises(PlanError, match="stage 1"):
        pipeline.stage_plan(SHAPE, [[NodeSpec("a", 1e9, GIB)], [NodeSpec("b", 1e9, 64 * 2**20 + 1000)]])


def test_plan_kinds_are_named_by_their_stages():
    a, b, c = NodeSpec("a", 1e9, GIB), NodeSpec("b", 1e9, GIB), NodeSpec("c", 1e9, GIB)
    assert pipeline.stage_plan(SHAPE, [[a, b, c]]).kind == "tp"
    assert pipeline.stage_plan(SHAPE, [[a, b], [c]]).kind == "hybrid"
    assert pipeline.stage_plan(SHAPE, [[a], [b], [c]]).kind == "pp"
    alone = pipeline.stage_plan(SHAPE, [[a], [b]], root_empty=True)
    assert alone.kind == "single" and alone.share("a").layers == (0, 0) and alone.share("b").layers == (0, 16)
    assert np.isclose(alone.makespan, SHAPE.weight_bytes / 1e9)


def test_a_stage_slice_file_holds_its_layers_only_and_runs_as_the_stage_does(tmp_path, stories_path):
    from edgetp.model import llama  # noqa: PLC0415
    from edgetp.parallel.shardfile import write_shard  # noqa: PLC0415

    mf = gguf.open_model(stories_path)
    cfg = mf.config
    spec = llama.ShardSpec((0, cfg.n_kv_heads), (0, cfg.ffn), (0, cfg.vocab), (2, cfg.n_layers))
    path = tmp_path / "stage.gguf"
    write_shard(mf, spec, path)
    part = gguf.open_model(path)
    assert llama.stored_spec(part) == spec
    assert part.weight("blk.0.attn_q.weight").rows == 0  # the first stage's layers: names only
    x = llama.embed(mf, [1, 42, 7])
    first = llama.Shard(llama.load_weights(mf, llama.ShardSpec((0, cfg.n_kv_heads), (0, cfg.ffn), (0, 0), (0, 2))), 16)
    h = first.forward(x.copy(), 0)
    from_file = llama.Shard(llama.load_weights(part, spec), 16)
    from_source = llama.Shard(llama.load_weights(mf, spec), 16)
    assert np.array_equal(from_file.logits(from_file.forward(h.copy(), 0)),
                          from_source.logits(from_source.forward(h.copy(), 0)))
    with pytest.raises(ValueError, match="layers 2:99"):
        llama.load_weights(mf, llama.ShardSpec((0, 1), (0, 32), (0, 0), (2, 99)))


# --------------------------------------------------------------------------- a Wi-Fi cluster in namespaces

def test_over_wifi_the_planner_keeps_tensor_parallelism_off_the_slow_links_and_the_text_is_one_nodes(
        stories_path):
    """Three hosts in network namespaces at Wi-Fi's rate (tbf), each worker behind a relay that adds
    Wi-Fi's 4 +- 1 ms round trip; the root is `edgetp ask --parallel auto` in its own namespace."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from tests.test_relay import REPO, start_relay, stop_relay  # noqa: PLC0415
    from tools.netns import Testbed, require_root_and_netns  # noqa: PLC0415
    from tools.relay import PROFILES  # noqa: PLC0415

    reason = require_root_and_netns()
    if reason:
        pytest.skip(reason)
    base = [sys.executable, "-m", "edgetp", "ask", "--local", "--model", str(stories_path), "--raw",
            "--temperature", "0", "--max-tokens", "32", "--threads", "1", STORY]
    single = subprocess.run(base, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert single.returncode == 0, single.stderr
    with Testbed(3, rate=PROFILES["wifi"].rate) as tb:
        root = tb[0]
        procs, relays = [], []
        try:
            for far in (tb[1], tb[2]):
                procs.append(start_worker(host=far.address, prefix=far.argv([])))
                relays.append(start_relay(procs[-1][1], "--profile", "wifi", prefix=root.argv([]),
                                          listen=f"{root.address}:0"))
            out = root.run(base + ["--workers", ",".join(a for _, a in relays), "--parallel", "auto", "--stats"],
                           timeout=300, check=False, cwd=REPO)
        finally:
            for proc, _ in relays:
                stop_relay(proc)
            for proc, _ in procs:
                stop(proc)
    assert out.returncode == 0, out.stderr
    plan = next(line for line in out.stderr.splitlines() if line.startswith("plan "))
    first_stage = plan.split(";")[0]
    assert "+" not in first_stage, f"an all-reduce crosses a Wi-Fi link: {plan}"
    assert out.stdout == single.stdout and len(single.stdout) > 20
