"""Mixtures of experts (qwen3moe, and mixtral as llama with experts) against independent
references: llama.cpp and the float64 math of tests/reference.py.

llama.cpp's build_moe_ffn, for both: the router's softmax over the experts, the
expert_used_count most probable, their probabilities divided by their sum, the
weighted SwiGLU outputs of those experts added in order. qwen3moe has qwen3's
attention (per-head q/k norms, NEOX rope) and reads the experts' width from
expert_feed_forward_length; mixtral is general.architecture "llama" with
llama.expert_count. The models are synthetic (tools/synth_gguf.py --arch
qwen3moe|mixtral --experts N --experts-used K): 8 experts top-2 and 16 top-4.

The bounds are test_engine_reference's (stated there): float kernels within
EXACT / KV16 of the float64 logits' spread at every position; never further from
llama.cpp than llama.cpp is from the float64 math, plus that bound; the integer
kernels on Q4_0 and Q8_0 as close to the float64 math on average as llama.cpp
(INT8_VS_CPP); 64 greedy tokens equal to llama.cpp's on F32 weights. Tensor
parallelism over real processes, float kernels: the single node's 64 tokens and
the float64 logits, on 3 nodes for 8 and 16 experts and 4 query heads (3 divides
none of them).
"""

from __future__ import annotations

import numpy as np
import pytest

from edgetp.model import gguf, llama
from edgetp.model.generate import LocalRunner
from tests import reference
from tests.isas import child_env
from tests.test_cli_errors import ask, assert_one_line_error
from tests.test_decode_fast import _same
from tests.test_engine_reference import _error, _spread
from tests.test_qwen3 import (_ids, _rewrite, _without, assert_exact_at_every_position,  # noqa: F401 (fixtures)
                              assert_int8_decode_as_close_as_llamacpp,
                              assert_never_further_from_llamacpp_than_it_is_from_exact, assert_processes_match,
                              control, float_kernels)

# arch -> synth_gguf keys: qwen3moe 8 experts top-2 on 4 heads of 32 (width 128, 2 KV heads), experts
# 7 blocks of 32 wide; mixtral 16 experts top-4 on tiny-odd's width 96 with 4 heads of 16 (2 KV heads),
# experts 224 wide. 3 processes divide none of those counts.
MOE = {
    "qwen3moe": ("tiny-headdim", dict(n_experts=8, n_experts_used=2, n_heads=4, ffn=224)),
    "mixtral": ("tiny-odd", dict(n_experts=16, n_experts_used=4, n_heads=4, n_kv_heads=2)),
}
TYPES = ["f32", "f16", "q8_0", "q4_0", "q4_k"]


@pytest.fixture(scope="module")
def moe(synth_model):
    def make(arch: str, wt: str = "f32"):
        preset, extra = MOE[arch]
        if wt.endswith("_k"):  # K-quants need widths of 256
            preset, extra = "tiny-k", extra | dict(ffn=256, n_heads=4, head_dim=64)
        return synth_model(preset, wt, arch=arch, **extra)

    return make


def test_the_files_read_as_llamacpps_loader_reads_them(moe):
    q = gguf.open_model(moe("qwen3moe")).config
    assert (q.arch, q.n_experts, q.n_experts_used, q.ffn, q.qk_norm, q.rope_neox, q.expert_norm) == (
        "qwen3moe", 8, 2, 224, True, True, True)
    m = gguf.open_model(moe("mixtral")).config
    assert (m.arch, m.n_experts, m.n_experts_used, m.ffn, m.qk_norm, m.rope_neox, m.expert_norm) == (
        "llama", 16, 4, 224, False, False, True)
    w = llama.load_weights(gguf.open_model(moe("mixtral")))
    e = w.layers[0].moe
    assert w.layers[0].w_gate is None and len(e.gate) == 16 and e.router.rows == 16
    assert {(g.rows, g.cols, d.rows, d.cols) for g, d in zip(e.gate, e.down)} == {(224, 96, 96, 224)}


@pytest.mark.parametrize("kind,kv_type", [(k, "f16") for k in TYPES] + [("f32", "f32")])
@pytest.mark.parametrize("arch", list(MOE))
def test_logits_at_every_position_equal_the_exact_float64_math(moe, arch, kind, kv_type, float_kernels):
    assert_exact_at_every_position(moe(arch, kind), kv_type)


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("arch", list(MOE))
def test_logits_are_never_further_from_llamacpp_than_llamacpp_is_from_exact(llama_cpp, moe, arch, kind,
                                                                            float_kernels):
    path = moe(arch, kind)
    assert_never_further_from_llamacpp_than_it_is_from_exact(path, _ids(path), "f16")


@pytest.mark.parametrize("kind", ["q4_0", "q8_0"])
@pytest.mark.parametrize("arch", list(MOE))
def test_int8_decode_logits_are_as_close_to_exact_as_llamacpps(llama_cpp, moe, arch, kind, monkeypatch):
    monkeypatch.delenv("EDGETP_INT8", raising=False)
    path = moe(arch, kind)
    assert_int8_decode_as_close_as_llamacpp(path, _ids(path))


@pytest.mark.parametrize("kv_type", ["f16", "f32"])
@pytest.mark.parametrize("arch", list(MOE))
def test_greedy_continuation_is_token_identical_to_llamacpp_for_64_tokens(llama_cpp, moe, arch, kv_type):
    path = moe(arch)
    ids = _ids(path)
    ours = LocalRunner(gguf.open_model(path), 256, kv_type=kv_type)
    from tests.test_parallel import greedy  # noqa: PLC0415

    assert greedy(ours, ids, 64) == reference.greedy(path, ids, 64, kv_type)


@pytest.mark.parametrize("arch", list(MOE))
def test_the_fused_decode_plan_runs_the_experts_bit_identical_to_the_per_op_path(moe, arch, int8):
    shard = _same(gguf.open_model(moe(arch, "q8_0")))
    hits = shard.expert_hits
    used = gguf.open_model(moe(arch)).config.n_experts_used
    assert np.all(hits.sum(axis=1) == hits[0].sum()) and hits[0].sum() % used == 0  # k experts per token, every layer


def test_several_rows_in_one_step_each_get_the_bits_of_their_token_alone(moe, int8):
    mf = gguf.open_model(moe("mixtral", "q4_0"))
    w = llama.load_weights(mf)
    prompts = [[5, 9, 17, 3], [40, 2, 8], [77]]
    together = llama.Shard(w, ctx=32, slots=3)
    for s, p in enumerate(prompts):
        together.forward(llama.embed(mf, p), 0, slot=s)
    x = llama.embed(mf, [11, 12, 13])
    rows = together.forward_rows(x.copy(), [0, 1, 2], [len(p) for p in prompts])
    for s, p in enumerate(prompts):
        alone = llama.Shard(w, ctx=32)
        alone.forward(llama.embed(mf, p), 0)
        assert np.array_equal(alone.forward(x[s : s + 1].copy(), len(p)), rows[s : s + 1]), f"row {s}"


# ---------------------------------------------------------------- tensor parallel, real processes


@pytest.mark.parametrize("arch", list(MOE))
def test_two_three_and_four_processes_splitting_every_experts_columns_give_the_single_nodes_tokens_and_exact_logits(
        float_workers, control, moe, arch, float_kernels):
    assert_processes_match(control, moe(arch, "q8_0"), float_workers)


# ---------------------------------------------------------------- bad input


def test_an_expert_count_the_router_does_not_have_is_refused_in_one_line_naming_the_tensor(moe, tmp_path):
    bad = _rewrite(moe("qwen3moe"), tmp_path / "count.gguf", meta={"qwen3moe.expert_count": 6})
    assert_one_line_error(ask(bad), str(bad), "'blk.0.ffn_gate_inp.weight' has shape [128, 8], expected [128, 6]")


def test_more_experts_per_token_than_experts_is_refused_in_one_line_naming_the_router(moe, tmp_path):
    bad = _rewrite(moe("mixtral"), tmp_path / "topk.gguf", meta={"llama.expert_used_count": 17})
    assert_one_line_error(ask(bad), str(bad), "expert_used_count 17", "'blk.0.ffn_gate_inp.weight'")


def test_a_mixtral_file_without_an_expert_tensor_is_refused_in_one_line_naming_it(moe, tmp_path):
    bad = _without(moe("mixtral"), tmp_path / "no-up.gguf", "blk.2.ffn_up_exps.weight")
    assert_one_line_error(ask(bad), str(bad), "'blk.2.ffn_up_exps.weight' is missing")


def test_a_shared_expert_in_a_qwen3moe_file_is_refused_in_one_line_not_left_out(moe, tmp_path):
    # qwen3moe has no shared expert: one in the file would be dropped from every token's sum
    bad = _without(moe("qwen3moe"), tmp_path / "shexp.gguf", "blk.0.ffn_up_shexp.weight",
                   instead=np.ones((64, 128), np.float32))
    assert_one_line_error(ask(bad), str(bad), "'blk.0.ffn_up_shexp.weight' (a shared expert) is not supported",
                          "qwen3moe")


def test_an_unsupported_architecture_is_named_with_the_list_including_the_mixtures(moe, tmp_path):
    bad = _rewrite(moe("qwen3moe"), tmp_path / "arch.gguf", arch="deepseek2")
    assert_one_line_error(ask(bad), str(bad), "unsupported architecture 'deepseek2'", "qwen3moe", "llama")


# ---------------------------------------------------------------- expert placement


def test_experts_placed_whole_or_mixed_with_columns_give_the_tokens_of_column_splitting_and_of_one_node(
        float_workers, control, moe, float_kernels):
    from edgetp.parallel.runner import ClusterRunner  # noqa: PLC0415
    from tests.test_parallel import greedy  # noqa: PLC0415

    path = moe("mixtral", "q8_0")  # 16 experts top-4 over 3 processes of speeds 3 : 1 : 2
    ids = _ids(path)
    expected = greedy(LocalRunner(gguf.open_model(path), 256), ids, 64)
    for mode in ("place", "mixed", "columns"):
        runner = control.run(ClusterRunner.connect(gguf.open_model(path), float_workers[:2], ctx=256, weights=[3, 1, 2],
                                                   experts=mode), timeout=300)
        try:
            held = [s.experts for s in runner.plan.shares]
            cols = [s.ffn_cols for s in runner.plan.shares]
            if mode == "place":
                sizes = [b - a for a, b in held]
                assert sum(sizes) == 16 and sizes[1] < sizes[2] < sizes[0], f"experts by speed: {held}"
                assert cols == [(0, 224)] * 3
            elif mode == "mixed":  # one node alone with whole experts, two splitting the rest by columns
                ranges = sorted(set(held))
                assert len(ranges) == 2 and ranges[0][0] == 0 and ranges[0][1] == ranges[1][0] and ranges[1][1] == 16
                assert sorted(cols).count((0, 224)) == 1 and len(set(cols)) == 3, f"{held} {cols}"
            else:
                assert held == [None] * 3
            assert greedy(runner, ids, 64) == expected, f"{mode}: {held} {cols}"
            assert_status_shows_experts_and_hits(runner, len(ids) + 63)
        finally:
            runner.close()


def assert_status_shows_experts_and_hits(runner, tokens: int) -> None:
    """`edgetp status`'s view: each node's experts (placed: its range; columns: all) and their hits,
    which add up to every token's 4 experts in each of the 3 layers."""
    from edgetp.commands import expert_lines  # noqa: PLC0415
    from edgetp.daemon import cluster_view  # noqa: PLC0415
    from edgetp.events import to_dict  # noqa: PLC0415

    view = cluster_view(runner, "mixtral")
    for node, share in zip(view.nodes, runner.plan.shares):
        assert node.experts == (share.experts or (0, 16)) and len(node.expert_hits) == node.experts[1] - node.experts[0]
    held = {n.experts: n.expert_hits for n in view.nodes}  # nodes splitting one range by columns count it once
    assert sum(sum(h) for h in held.values()) == tokens * 4 * 3
    lines = expert_lines(to_dict(view)["nodes"])
    assert len(lines) == 3
    for line, share in zip(lines, runner.plan.shares):
        whole = share.experts is not None and share.ffn_cols == (0, 224)
        assert ("(whole)" if whole else f"(columns {share.ffn_cols[0]}-{share.ffn_cols[1]})") in line, line


ISA_CHILD = """
import sys
import numpy as np
from edgetp.model import gguf, isa, llama, moe
from edgetp.model.generate import LocalRunner
assert isa.current() == "generic", isa.current()
mf = gguf.open_model(sys.argv[1])
ids = [int(t) for t in sys.argv[2].split(",")]
runner = LocalRunner(mf, 256, kv_type="f32")
logits = np.stack([runner.logits([t], p)[0] for p, t in enumerate(ids)])  # one token at a time: decode kernels
h = np.random.default_rng(7).standard_normal((64, mf.config.dim)).astype(np.float32)
routes = moe.route(llama.load_weights(mf).layers[0].moe, h)[0]
np.savez(sys.argv[3], logits=logits, routes=routes)
"""


def test_the_generic_isa_routes_as_avx2_does_and_decodes_as_close_to_exact_as_llamacpp(llama_cpp, moe, tmp_path,
                                                                                      monkeypatch):
    # h after an all-reduce is the same bits on every node, and the router's exact kernel makes its
    # choice the same on every ISA: a mixed cluster routes alike. (Whole logits are not bit-equal
    # across ISAs, for dense models either: the float steps between the integer kernels differ.)
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from tests.conftest import REPO  # noqa: PLC0415
    from tests.test_engine_reference import INT8_VS_CPP  # noqa: PLC0415

    monkeypatch.delenv("EDGETP_INT8", raising=False)
    path = moe("mixtral", "q4_0")
    ids = _ids(path)
    env = child_env("generic", EDGETP_INT8="1")
    res = subprocess.run([sys.executable, "-c", ISA_CHILD, str(path), ",".join(map(str, ids)), str(tmp_path / "g.npz")],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stderr[-3000:]
    got = np.load(tmp_path / "g.npz")
    mf = gguf.open_model(path)
    h = np.random.default_rng(7).standard_normal((64, mf.config.dim)).astype(np.float32)
    from edgetp.model import moe as mixture  # noqa: PLC0415

    assert np.array_equal(got["routes"], mixture.route(llama.load_weights(mf).layers[0].moe, h)[0])
    exact = reference.exact_logits(path, ids)
    spread = _spread(exact)
    mine = _error(got["logits"], exact, spread).mean()
    cpp = _error(reference.logits(path, ids), exact, spread).mean()
    assert 1e-4 < mine <= INT8_VS_CPP * cpp, f"generic ISA: mean error {mine:.2e} vs llama.cpp's {cpp:.2e}"


def test_edgetp_ask_places_whole_experts_when_told_and_names_them_in_its_stats(float_workers, moe):
    from tests.test_cli_errors import edgetp  # noqa: PLC0415

    res = edgetp("ask", "--local", "--model", str(moe("mixtral", "q8_0")), "--workers", ",".join(float_workers[:2]),
                 "--weights", "3,1,2", "--experts", "place", "--stats", "--max-tokens", "4", "hello", timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    nodes = [line for line in res.stderr.splitlines() if line.startswith("node ")]
    assert len(nodes) == 3 and all(" experts (" in line for line in nodes), res.stderr[-2000:]
    bad = edgetp("ask", "--local", "--model", str(moe("mixtral")), "--experts", "rows", "hello")
    assert bad.returncode != 0 and "--experts" in bad.stderr and "Traceback" not in bad.stderr


def test_a_hybrid_plan_places_experts_inside_its_tensor_parallel_stage_and_gives_one_nodes_tokens(
        float_workers, control, moe, float_kernels):
    from edgetp.parallel.runner import ClusterRunner  # noqa: PLC0415
    from tests.test_parallel import greedy  # noqa: PLC0415

    path = moe("qwen3moe", "q8_0")
    ids = _ids(path)
    expected = greedy(LocalRunner(gguf.open_model(path), 256), ids, 64)
    runner = control.run(ClusterRunner.connect(gguf.open_model(path), float_workers[:2], ctx=256, weights=[2, 1, 1],
                                               layout=[[0, 1], [2]], experts="place"), timeout=300)
    try:
        first, second = runner.plan.stages
        assert [x.experts for x in second] == [None], "a stage of one node keeps its whole FFN"
        assert sorted(x.experts for x in first)[0][0] == 0 and sum(b - a for a, b in (x.experts for x in first)) == 8
        assert greedy(runner, ids, 64) == expected, [(x.layers, x.experts) for x in runner.plan.shares]
    finally:
        runner.close()
