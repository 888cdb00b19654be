"""qwen2moe's shared expert against independent references: llama.cpp and the float64 math of
tests/reference.py.

llama.cpp's qwen2moe graph (src/models/qwen2moe.cpp): qwen2's attention (q/k/v biases, NEOX
rope); the routed experts as build_moe_ffn computes them with norm_w false (the chosen
probabilities are not divided by their sum, unlike qwen3moe and mixtral); then, for every
token, a shared SwiGLU expert (ffn_*_shexp, expert_shared_feed_forward_length wide) times
sigmoid(ffn_gate_inp_shexp . h), added to the experts' sum. The models are synthetic
(tools/synth_gguf.py --arch qwen2moe --experts N --experts-used K --shared-ffn W): 8 experts
top-2 and 16 top-4, each with a shared expert of a width 3 processes do not divide.

The bounds are test_moe's (test_engine_reference's). In a cluster the shared expert is split
by columns like a dense FFN, its columns following each node's share of the experts' columns
(--experts columns) or of the experts (--experts place); every node computes the gate whole.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from edgetp.model import gguf, llama
from edgetp.model.generate import LocalRunner
from edgetp.parallel.shardfile import shard_name, write_shard
from tests import reference
from tests.test_cli_errors import ask, assert_one_line_error
from tests.test_decode_fast import _same
from tests.test_engine_reference import EXACT, _error, _spread
from tests.test_moe import TYPES
from tests.test_qwen3 import (_ids, _without, assert_exact_at_every_position,  # noqa: F401 (fixtures)
                              assert_int8_decode_as_close_as_llamacpp,
                              assert_never_further_from_llamacpp_than_it_is_from_exact, assert_processes_match,
                              control, float_kernels)
from tests.test_parallel import greedy

# name -> synth_gguf keys: 8 experts top-2 of 7 blocks of 32 on 4 heads of 32 (width 128), a shared
# expert of 10 blocks; 16 experts top-4 of 224 on tiny-odd's width 96 (4 heads of 24, 2 KV heads: llama.cpp
# reads qwen2moe's attn_q as dim x dim), a shared expert of 11 blocks. 3 processes divide none of those counts.
SHARED = {
    "8x2": ("tiny-headdim", dict(arch="qwen2moe", n_experts=8, n_experts_used=2, n_heads=4, ffn=224, ffn_shared=320)),
    "16x4": ("tiny-odd", dict(arch="qwen2moe", n_experts=16, n_experts_used=4, n_heads=4, n_kv_heads=2, head_dim=24,
                              ffn_shared=352)),
}


@pytest.fixture(scope="module")
def qwen2moe(synth_model):
    def make(shape: str, wt: str = "f32"):
        preset, extra = SHARED[shape]
        if wt.endswith("_k"):  # K-quants need widths of 256
            preset, extra = "tiny-k", extra | dict(ffn=256, ffn_shared=512, n_heads=4, head_dim=64)
        return synth_model(preset, wt, **extra)

    return make


def test_the_files_read_as_llamacpps_loader_reads_them(qwen2moe):
    c = gguf.open_model(qwen2moe("16x4")).config
    assert (c.arch, c.n_experts, c.n_experts_used, c.ffn, c.ffn_shared, c.expert_norm, c.qkv_bias, c.rope_neox,
            c.tied) == ("qwen2moe", 16, 4, 224, 352, False, True, True, False)
    w = llama.load_weights(gguf.open_model(qwen2moe("16x4")))
    s = w.layers[0].moe.shared
    assert (s.gate_inp.rows, s.gate_inp.cols, s.gate.rows, s.gate.cols, s.down.rows, s.down.cols) == (
        1, 96, 352, 96, 96, 352)
    assert w.layers[0].bq.shape == (96,) and w.layers[0].bk.shape == (48,)


@pytest.mark.parametrize("kind,kv_type", [(k, "f16") for k in TYPES] + [("f32", "f32")])
@pytest.mark.parametrize("shape", list(SHARED))
def test_logits_at_every_position_equal_the_exact_float64_math(qwen2moe, shape, kind, kv_type, float_kernels):
    assert_exact_at_every_position(qwen2moe(shape, kind), kv_type)


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("shape", list(SHARED))
def test_logits_are_never_further_from_llamacpp_than_llamacpp_is_from_exact(llama_cpp, qwen2moe, shape, kind,
                                                                            float_kernels):
    path = qwen2moe(shape, kind)
    assert_never_further_from_llamacpp_than_it_is_from_exact(path, _ids(path), "f16")


def test_llamacpp_computes_the_float64_math_and_its_logits_change_without_the_shared_expert(llama_cpp, qwen2moe,
                                                                                             tmp_path):
    # so the shared expert weighs in every comparison with llama.cpp and the float64 math above
    path = qwen2moe("8x2")
    ids = _ids(path)
    cpp, exact = reference.logits(path, ids), reference.exact_logits(path, ids, "f32")
    spread = _spread(exact)
    assert _error(cpp, exact, spread).max() <= EXACT
    silent = path
    for i in range(2):  # the shared expert's output zero in both layers
        silent = _without(silent, tmp_path / f"silent{i}.gguf", f"blk.{i}.ffn_down_shexp.weight",
                          instead=np.zeros((128, 320), np.float32))
    assert _error(reference.logits(silent, ids), cpp, spread).mean() > 100 * EXACT


@pytest.mark.parametrize("kind", ["q4_0", "q8_0"])
@pytest.mark.parametrize("shape", list(SHARED))
def test_int8_decode_logits_are_as_close_to_exact_as_llamacpps(llama_cpp, qwen2moe, shape, kind, monkeypatch):
    monkeypatch.delenv("EDGETP_INT8", raising=False)
    path = qwen2moe(shape, kind)
    assert_int8_decode_as_close_as_llamacpp(path, _ids(path))


@pytest.mark.parametrize("kv_type", ["f16", "f32"])
@pytest.mark.parametrize("shape", list(SHARED))
def test_greedy_continuation_is_token_identical_to_llamacpp_for_64_tokens(llama_cpp, qwen2moe, shape, kv_type):
    path = qwen2moe(shape)
    ids = _ids(path)
    assert greedy(LocalRunner(gguf.open_model(path), 256, kv_type=kv_type), ids, 64) == reference.greedy(
        path, ids, 64, kv_type)


@pytest.mark.parametrize("shape", list(SHARED))
def test_the_fused_decode_plan_runs_the_shared_expert_bit_identical_to_the_per_op_path(qwen2moe, shape, int8):
    _same(gguf.open_model(qwen2moe(shape, "q8_0")))


GENERIC_CHILD = """
import sys
import numpy as np
from edgetp.model import gguf, isa, llama, moe
assert isa.current() == "generic", isa.current()
e = llama.load_weights(gguf.open_model(sys.argv[1])).layers[1].moe
h = np.random.default_rng(5).standard_normal((64, 128)).astype(np.float32)
g = np.empty(64, np.float32)
moe.shared_gate(e.shared, h, g)
ids, w = moe.route(e, h)
np.savez(sys.argv[2], g=g, ids=ids, w=w)
"""


def test_the_generic_isa_gates_and_routes_every_row_with_the_same_bits(qwen2moe, tmp_path):
    # a mixed cluster: every node, whatever its CPU, scales the shared expert by the same gate
    import os  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from edgetp.model import moe  # noqa: PLC0415
    from tests.conftest import REPO  # noqa: PLC0415

    path = qwen2moe("8x2", "q8_0")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CPU_")} | dict(
        EDGETP_ISA="generic", PYTHONPATH=str(REPO))
    res = subprocess.run([sys.executable, "-c", GENERIC_CHILD, str(path), str(tmp_path / "g.npz")], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stderr[-3000:]
    got = np.load(tmp_path / "g.npz")
    e = llama.load_weights(gguf.open_model(path)).layers[1].moe
    h = np.random.default_rng(5).standard_normal((64, 128)).astype(np.float32)
    g = np.empty(64, np.float32)
    moe.shared_gate(e.shared, h, g)
    ids, w = moe.route(e, h)
    for name, mine in (("g", g), ("ids", ids), ("w", w)):
        assert got[name].tobytes() == mine.tobytes(), name


# ---------------------------------------------------------------- the split


@pytest.mark.parametrize("shape", list(SHARED))
def test_the_shared_experts_columns_tile_it_for_any_tiling_of_the_experts_columns_or_of_the_experts(qwen2moe,
                                                                                                     shape):
    c = gguf.open_model(qwen2moe(shape)).config
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 5))
        by_experts = bool(rng.integers(2))
        total, unit = (c.n_experts, 1) if by_experts else (c.ffn, 32)
        cuts = np.sort(rng.integers(0, total // unit + 1, n - 1)) * unit
        bounds = [0, *cuts.tolist(), total]
        parts = [c.shared_cols((0, c.ffn), (a, b)) if by_experts else c.shared_cols((a, b), None)
                 for a, b in zip(bounds, bounds[1:])]
        mixed = [mix for a, b in zip(bounds, bounds[1:]) if by_experts  # each range of experts split by columns
                 for mix in _split_by_columns(c, (a, b), rng)]
        if mixed:  # in node order they tile the shared expert; each bound within 2 blocks of its exact place
            assert mixed[0][0] == 0 and mixed[-1][1] == c.ffn_shared
            assert all(p[1] == q[0] for p, q in zip(mixed, mixed[1:]))
        assert parts[0][0] == 0 and parts[-1][1] == c.ffn_shared, parts
        assert all(p[1] == q[0] for p, q in zip(parts, parts[1:])) and all(a <= b and a % 32 == 0 for a, b in parts)
        # each node's share of the shared expert is its share of the experts', within a block
        for (a, b), (x, y) in zip(zip(bounds, bounds[1:]), parts):
            assert abs((y - x) / c.ffn_shared - (b - a) / total) <= 32 / c.ffn_shared


def _split_by_columns(c, experts, rng):
    """A range of experts split by columns among 1 to 3 nodes at random: each node's shared columns,
    checked against the exact place of each bound (2 blocks: one rounding for the experts, one within)."""
    n = int(rng.integers(1, 4))
    bounds = [0, *(np.sort(rng.integers(0, c.ffn // 32 + 1, n - 1)) * 32).tolist(), c.ffn]
    out = []
    for a, b in zip(bounds, bounds[1:]):
        x, y = c.shared_cols((a, b), experts)
        for col, got in ((a, x), (b, y)):
            exact = (experts[0] + (experts[1] - experts[0]) * col / c.ffn) / c.n_experts * c.ffn_shared
            assert abs(got - exact) <= 2 * 32, (experts, (a, b), (x, y))
        out.append((x, y))
    return out


@pytest.mark.parametrize("spec", [
    llama.ShardSpec((0, 1), (96, 224), (0, 600), None, None),  # columns: 4/7 of the experts' -> 6 of 11 blocks
    llama.ShardSpec((1, 2), (0, 224), (0, 600), None, (5, 11)),  # placed: 6 of 16 experts -> 5 of 11 blocks
    llama.ShardSpec((1, 2), (0, 224), (0, 0), None, (2, 2)),    # no expert, no shared column
    llama.ShardSpec((1, 2), (96, 224), (0, 600), None, (5, 11)),  # mixed: blocks 3..8 of the experts, 4/7 of those
])
def test_a_shard_file_holds_its_shared_columns_and_computes_bit_identical_outputs(qwen2moe, tmp_path, spec):
    from gguf import dequantize  # noqa: PLC0415

    mf = gguf.ModelFile(qwen2moe("16x4", "q8_0"))
    sf = gguf.ModelFile(write_shard(mf, spec, tmp_path / shard_name(mf.fingerprint, spec)))
    a, b = mf.config.shared_cols(spec.ffn_cols, spec.experts)
    # blocks of 32 of the shared expert's 352: experts 5..11 of 16 -> blocks round(5 * 11 / 16) = 3 to
    # round(11 * 11 / 16) = 8; columns 96..224 of 224 of those 5 blocks -> round(96 / 224 * 5) = 2 to 5
    assert (a, b) == {((96, 224), None): (160, 352), ((0, 224), (5, 11)): (96, 256), ((0, 224), (2, 2)): (32, 32),
                      ((96, 224), (5, 11)): (160, 256)}[spec.ffn_cols, spec.experts]
    for name in (f"blk.{i}.ffn_{w}_shexp.weight" for i in range(3) for w in ("gate", "up", "down")):
        src, got = mf.tensors[name], sf.tensors[name]
        want = dequantize(np.asarray(src.data), src.tensor_type)
        want = want[:, a:b] if "down" in name else want[a:b]
        if a == b:
            assert got.n_bytes == 0, name
            continue
        assert np.array_equal(dequantize(np.asarray(got.data), got.tensor_type).reshape(want.shape), want), name
    outs = []
    for source in (mf, sf):
        shard = llama.Shard(llama.load_weights(source, spec), ctx=8)
        h = shard.forward(llama.embed(mf, [1, 17, 42]), 0)
        h2 = shard.forward(llama.embed(mf, [5]), 3)
        outs.append((h, h2))
    for x, y in zip(*outs):
        assert x.shape == y.shape and x.view(np.uint32).tobytes() == y.view(np.uint32).tobytes()


# ---------------------------------------------------------------- tensor parallel, real processes


@pytest.mark.parametrize("mode", ["place", "columns"])
@pytest.mark.parametrize("shape", list(SHARED))
def test_two_three_and_four_processes_placing_experts_or_splitting_columns_give_one_nodes_tokens_and_exact_logits(
        float_workers, control, qwen2moe, shape, mode, float_kernels):
    path = qwen2moe(shape, "q8_0")
    c = gguf.open_model(path).config

    def check(plan):  # every node its columns of the shared expert, following its experts or columns
        held = [(s.ffn_cols, s.experts) for s in plan.shares]
        cols = [c.shared_cols(tuple(f), None if e is None else tuple(e)) for f, e in held]
        assert cols[0][0] == 0 and cols[-1][1] == c.ffn_shared, f"{mode}: {held} -> {cols}"
        assert all(a <= b == x for (a, b), (x, _) in zip(cols, cols[1:])), f"{mode}: {held} -> {cols}"  # in order
        assert (mode == "place") == all(e is not None for _, e in held), held

    assert_processes_match(control, path, float_workers, check, experts=mode)


def test_three_and_four_processes_mixing_whole_experts_with_columns_give_one_nodes_tokens(
        float_workers, control, qwen2moe, float_kernels):
    path = qwen2moe("16x4", "q8_0")
    c = gguf.open_model(path).config

    def check(plan):  # groups of nodes over ranges of experts, one of them a group of several
        held = [(s.ffn_cols, s.experts) for s in plan.shares]
        assert 1 < len({e for _, e in held}) < len(held), held
        cols = sorted(c.shared_cols(f, e) for f, e in held)
        assert cols[0][0] == 0 and cols[-1][1] == c.ffn_shared and all(p[1] == q[0] for p, q in zip(cols, cols[1:]))

    assert_processes_match(control, path, float_workers, check, runs=((3, [3, 1, 2]), (4, [2, 4, 1, 3])),
                           experts="mixed")


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("name", ["blk.1.ffn_gate_inp_shexp.weight", "blk.2.ffn_down_shexp.weight",
                                  "blk.0.ffn_up_shexp.weight"])
def test_a_file_without_a_shared_expert_tensor_is_refused_in_one_line_naming_it(qwen2moe, tmp_path, name):
    bad = _without(qwen2moe("16x4"), tmp_path / "no-shexp.gguf", name)
    assert_one_line_error(ask(bad), str(bad), f"{name!r} is missing")


def test_a_shared_expert_tensor_of_the_wrong_shape_is_refused_in_one_line_naming_it(qwen2moe, tmp_path):
    src = qwen2moe("16x4")
    gate = next(t for t in GGUFReader(src).tensors if t.name == "blk.1.ffn_gate_shexp.weight")
    narrow = np.asarray(gate.data)[:320]  # 320 rows where expert_shared_feed_forward_length says 352
    bad = _without(src, tmp_path / "narrow.gguf", "blk.1.ffn_gate_shexp.weight", instead=narrow)
    assert_one_line_error(ask(bad), str(bad), "'blk.1.ffn_gate_shexp.weight' has shape [96, 320], expected [96, 352]")
    bad = _without(src, tmp_path / "gate.gguf", "blk.0.ffn_gate_inp_shexp.weight", instead=np.ones(95, np.float32))
    assert_one_line_error(ask(bad), str(bad), "'blk.0.ffn_gate_inp_shexp.weight' has shape [95], expected [96]")


# ---------------------------------------------------------------- the plan's view of a shared expert


def test_the_plan_holds_and_reads_the_shared_expert_with_the_columns_or_experts_it_follows(qwen2moe):
    from dataclasses import replace  # noqa: PLC0415

    from edgetp.parallel import experts, packing, shard  # noqa: PLC0415
    from edgetp.parallel.plan import NodeSpec, expected_max  # noqa: PLC0415

    mf = gguf.open_model(qwen2moe("16x4", "q8_0"))
    s = shard.model_shape(mf, 256)
    # Q8_0: 34 bytes per 32 weights; every expert and the shared expert, 3 matrices of 96 x width, 3 layers
    q8 = 34 / 32
    routed, shared = 3 * 3 * 96 * 224 * 16 * q8, 3 * 3 * 96 * 352 * q8
    assert s.n_ffn_blocks * s.ffn_block_bytes == pytest.approx(routed + shared, rel=1e-6)  # rounded per block
    assert s.expert_bytes == pytest.approx((routed + shared) / 16) and s.expert_shared == pytest.approx(shared / 16)
    assert s.ffn_active == pytest.approx((routed * 4 / 16 + shared) / (routed + shared))
    nodes = (NodeSpec("root", 3e9, 10**12), NodeSpec("b", 1e9, 10**12), NodeSpec("c", 2e9, 10**12))
    cols = packing.make_plan(s, nodes)
    placed = experts.place(cols)
    for share in cols.shares:  # columns: the node's part of every FFN byte, routed and shared
        part = (share.ffn_cols[1] - share.ffn_cols[0]) / 224
        ffn_only = replace(share, kv_groups=(0, 0), vocab_rows=(0, 0))
        assert s.share_work(ffn_only) == pytest.approx(part * (routed + shared), rel=1e-6)
    # placed: a token waits for the node whose routed hits plus its part of the shared expert take longest
    counts = [b - a for a, b in (x.experts for x in placed.shares)]
    per_hit = [routed / 16 / n.speed for n in nodes]
    base = [c * shared / 16 / n.speed for c, n in zip(counts, nodes)]
    speed = [n.speed for n in nodes]
    rest = (max((x.kv_groups[1] - x.kv_groups[0]) * s.group_bytes / v for x, v in zip(placed.shares, speed))
            + max((x.vocab_rows[1] - x.vocab_rows[0]) * s.vocab_row_bytes / v for x, v in zip(placed.shares, speed)))
    ffn_wait = placed.makespan - rest
    assert ffn_wait == pytest.approx(expected_max(counts, per_hit, 4, base), rel=1e-6)
    assert ffn_wait > expected_max(counts, per_hit, 4)  # the shared expert costs time


# ---------------------------------------------------------------- a decode step of several rows


@pytest.mark.parametrize("spec", [None,  # one node
                                  llama.ShardSpec((0, 1), (64, 160), (0, 600), None, None),  # columns
                                  llama.ShardSpec((1, 2), (0, 224), (0, 600), None, (2, 5)),  # placed experts
                                  llama.ShardSpec((1, 2), (64, 160), (0, 600), None, (2, 5))])  # mixed: their columns
def test_rows_routed_together_through_the_experts_get_the_bits_of_each_token_alone(qwen2moe, int8, spec):
    mf = gguf.open_model(qwen2moe("8x2", "q8_0"))
    w = llama.load_weights(mf, spec)
    prompts = [[5 + s, 9, 17 + 3 * s] for s in range(8)]
    together = llama.Shard(w, ctx=16, slots=8)
    for s, p in enumerate(prompts):
        together.forward(llama.embed(mf, p), 0, slot=s)
    x = llama.embed(mf, [11 + s for s in range(8)])
    before = together.expert_hits.copy()
    rows = together.forward_rows(x.copy(), list(range(8)), [3] * 8)
    step = together.expert_hits - before
    assert step.sum() == 8 * 2 * 2 and step.max() >= 2, step  # rows share experts: they run on them together
    for s, p in enumerate(prompts):
        alone = llama.Shard(w, ctx=16)
        alone.forward(llama.embed(mf, p), 0)
        got = alone.forward(x[s : s + 1].copy(), 3)
        assert got.view(np.uint32).tobytes() == rows[s : s + 1].view(np.uint32).tobytes(), f"row {s}"
