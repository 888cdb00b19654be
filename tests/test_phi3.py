"""phi3 against independent references: llama.cpp and the float64 math of tests/reference.py.

What phi3 changes from llama (llama.cpp's llama_model_phi3, Hugging Face's modeling_phi3):
q, k and v are one tensor, blk.N.attn_qkv, whose rows are q's, then k's, then v's; the
gate and up projections are one tensor, blk.N.ffn_up, of 2 * ffn rows, the gate's first;
the rope rotates the two halves of each head (NEOX) with LongRoPE's frequency factors,
rope_factors_long when a sequence's context is beyond rope.scaling.original_context_length
and rope_factors_short otherwise, and cos and sin times rope.scaling.attn_factor. llama.cpp
ignores phi3's attention.sliding_window (its loader turns it off), so the files here carry
one of 8 under a 118-token prompt: were it applied, the logits would move.

Two files per type: "long" (original context 128, so ours at 256 positions and llama.cpp at
512 both take the long factors) and "short" (original context 4096), each with Phi-3-128k's
attention factor, sqrt(1 + ln 32 / ln 4096) = 1.19. A shard loads its own heads' rows of q, k
and v and its own FFN columns' rows of gate and up from the fused tensors, as row views.

Bounds: test_engine_reference's (stated there), as in test_qwen3.
"""

from __future__ import annotations

import numpy as np
import pytest

from edgetp.model import gguf, llama
from edgetp.model.generate import LocalRunner
from tests import reference
from tests.test_cli_errors import ask, assert_one_line_error
from tests.test_decode_fast import _same
from tests.test_engine_reference import BOUND, FOX, _error, _spread
from tests.test_parallel import greedy
from tests.test_qwen3 import (_without, assert_exact_at_every_position, assert_int8_decode_as_close_as_llamacpp,
                              assert_never_further_from_llamacpp_than_it_is_from_exact, assert_processes_match,
                              control, float_kernels)  # noqa: F401 (fixtures)

ATTN_FACTOR = float(np.sqrt(1 + np.log(32) / np.log(4096)))  # Phi-3-mini-128k's: 131072 / 4096 = 32
FACTORS = {"long": dict(rope_ctx_orig=128, ctx=1024), "short": dict(rope_ctx_orig=4096, ctx=131072)}
TYPES = {"f32": "tiny-odd", "f16": "tiny-odd", "q8_0": "tiny-odd", "q4_0": "tiny-odd", "q4_1": "tiny-odd",
         "q4_k": "tiny-k", "q6_k": "tiny-k"}  # tiny-odd: 6 heads of 16, 3 KV heads; tiny-k: 4 of 64, 2 KV
# Phi-4-mini (architecture phi3 too) in small: 3/4 of each head rotates (96 of 128 there, 48 of 64 here), and the
# lm head is token_embd
PHI4_MINI = dict(preset="tiny-k", rope_dims=48, tied=True)


@pytest.fixture(scope="module")
def phi3(synth_model):
    def make(wt: str = "f32", factors: str = "long", preset: str | None = None, **extra):
        return synth_model(preset or TYPES[wt], wt, arch="phi3", swa_window=8, rope_attn_factor=ATTN_FACTOR,
                           **FACTORS[factors], **extra)

    return make


def _ids(path) -> list[int]:
    ids = reference.tokenize(path, FOX)
    assert len(ids) > 3 * 8, "the prompt must outrun the sliding window llama.cpp ignores"
    return ids


def test_a_synthetic_phi3_file_reads_as_llamacpps_loader_reads_it(phi3):
    mf = gguf.open_model(phi3())
    cfg = mf.config
    assert (cfg.arch, cfg.rope_neox, cfg.fused_qkv, cfg.fused_gate_up, cfg.swa_window, cfg.rope_ctx_orig) == (
        "phi3", True, True, True, 0, 128)
    assert cfg.rope_attn_factor == pytest.approx(ATTN_FACTOR)
    assert not mf.has("blk.0.attn_q.weight") and not mf.has("blk.0.ffn_gate.weight")
    # the factors, as llama.cpp's get_rope_factors picks them: long only beyond the original context
    w = llama.load_weights(mf)
    long, short = mf.vector("rope_factors_long.weight"), mf.vector("rope_factors_short.weight")
    assert llama.rope_factors(w, 128) is w.rope_short and np.array_equal(w.rope_short, short)
    assert llama.rope_factors(w, 129) is w.rope_long and np.array_equal(w.rope_long, long)


def test_a_shard_takes_its_heads_and_columns_as_row_views_of_the_fused_tensors(phi3):
    mf = gguf.open_model(phi3("q8_0"))
    cfg = mf.config
    hd, g = cfg.head_dim, cfg.group_size
    qkv, up = (np.asarray(mf.tensors[f"blk.1.{n}.weight"].data) for n in ("attn_qkv", "ffn_up"))
    spec = llama.ShardSpec((1, 3), (64, 160), (0, cfg.vocab))
    layer = llama.load_weights(mf, spec).layers[1]
    q_rows, kv_rows = (1 * g * hd, 3 * g * hd), (1 * hd, 3 * hd)  # KV heads 1, 2 and their query heads
    at_k, at_v = cfg.n_heads * hd, (cfg.n_heads + cfg.n_kv_heads) * hd
    want = {"wq": qkv[q_rows[0]:q_rows[1]], "wk": qkv[at_k + kv_rows[0]:at_k + kv_rows[1]],
            "wv": qkv[at_v + kv_rows[0]:at_v + kv_rows[1]], "w_gate": up[64:160], "w_up": up[cfg.ffn + 64:cfg.ffn + 160]}
    for name, rows in want.items():
        got = getattr(layer, name).data
        assert np.array_equal(got, rows), name
        assert np.shares_memory(got, qkv if name in ("wq", "wk", "wv") else up), f"{name} is a copy"


@pytest.mark.parametrize("factors", ["long", "short"])
@pytest.mark.parametrize("wt,kv_type", [(k, "f16") for k in TYPES] + [("f32", "f32"), ("q8_0", "f32")])
def test_logits_at_every_position_equal_the_exact_float64_math(phi3, wt, kv_type, factors, float_kernels):
    assert_exact_at_every_position(phi3(wt, factors), kv_type)


@pytest.mark.parametrize("factors", ["long", "short"])
@pytest.mark.parametrize("wt,kv_type", [(k, "f16") for k in TYPES] + [("f32", "f32")])
def test_logits_are_never_further_from_llamacpp_than_llamacpp_is_from_exact(llama_cpp, phi3, wt, kv_type, factors,
                                                                            float_kernels):
    path = phi3(wt, factors)
    assert_never_further_from_llamacpp_than_it_is_from_exact(path, _ids(path), kv_type)


def test_the_other_factors_no_attention_factor_or_the_window_would_be_far_from_llamacpp(llama_cpp, phi3,
                                                                                          float_kernels):
    # the test above can fail: the short factors, cos and sin left unscaled, or the sliding window the
    # file carries applied, move the logits by a large part of their spread
    from dataclasses import replace  # noqa: PLC0415

    path = phi3("f32", "long")
    ids = _ids(path)
    cpp = reference.logits(path, ids, "f32")
    cfg = gguf.open_model(path).config
    window = dict(swa_window=8, swa_layers=(True,) * cfg.n_layers, rope_theta_swa=cfg.rope_theta)
    for change in (dict(rope_ctx_orig=100_000), dict(rope_attn_factor=1.0), window):
        mf = gguf.open_model(path)
        mf.config = replace(mf.config, **change)
        err = _error(LocalRunner(mf, 256, kv_type="f32").logits(ids, 0), cpp, _spread(cpp))
        assert err.max() > 100 * BOUND["f32"], change


@pytest.mark.parametrize("kv_type", ["f16", "f32"])
def test_phi4_minis_partial_rotation_and_tied_head_equal_llamacpp_and_the_exact_math(llama_cpp, phi3, kv_type,
                                                                                     float_kernels):
    path = phi3("f32", **PHI4_MINI)
    cfg = gguf.open_model(path).config
    assert (cfg.rope_dims, cfg.head_dim, cfg.tied) == (48, 64, True)
    assert_exact_at_every_position(path, kv_type)
    ids = _ids(path)
    assert_never_further_from_llamacpp_than_it_is_from_exact(path, ids, kv_type)
    assert greedy(LocalRunner(gguf.open_model(path), 256, kv_type=kv_type), ids, 64) == reference.greedy(
        path, ids, 64, kv_type)


def test_int8_q4_0_decode_logits_are_as_close_to_exact_as_llamacpps(llama_cpp, phi3, monkeypatch):
    monkeypatch.delenv("EDGETP_INT8", raising=False)
    path = phi3("q4_0")
    assert_int8_decode_as_close_as_llamacpp(path, _ids(path))


@pytest.mark.parametrize("factors", ["long", "short"])
@pytest.mark.parametrize("kv_type", ["f16", "f32"])
def test_greedy_continuation_is_token_identical_to_llamacpp_for_64_tokens(llama_cpp, phi3, kv_type, factors):
    path = phi3("f32", factors)
    ids = _ids(path)
    ours = greedy(LocalRunner(gguf.open_model(path), 256, kv_type=kv_type), ids, 64)
    assert ours == reference.greedy(path, ids, 64, kv_type)


@pytest.mark.parametrize("wt", ["q8_0", "q4_k"])
def test_the_fused_decode_plan_gives_the_per_op_paths_bits(phi3, wt, int8, kv_type):
    _same(gguf.open_model(phi3(wt, **PHI4_MINI)), kv_type=kv_type)  # heads of 64: a q8_0 cache holds them


# ---------------------------------------------------------------- tensor parallel, real processes


def test_two_three_and_four_processes_with_uneven_weights_give_the_single_nodes_tokens_and_the_exact_logits(
        float_workers, control, phi3, float_kernels):
    # 6 heads, 3 KV heads, FFN 7 blocks of 32: nothing divides evenly over 2 or 3 nodes
    assert_processes_match(control, phi3("q8_0"), float_workers)


@pytest.mark.parametrize("spec", [llama.ShardSpec((1, 3), (64, 160), (100, 400)),
                                  llama.ShardSpec((0, 1), (40, 100), (0, 600)),  # FFN splits Q8_0 blocks
                                  llama.ShardSpec((0, 0), (0, 224), (0, 0), (1, 3))])  # no heads; a stage
def test_a_phi3_shard_file_holds_its_rows_of_the_fused_tensors_and_runs_as_its_slice(phi3, spec, tmp_path):
    from edgetp.parallel.shardfile import write_shard  # noqa: PLC0415

    mf = gguf.open_model(phi3("q8_0"))
    cfg = mf.config
    hd, g, f = cfg.head_dim, cfg.group_size, cfg.ffn
    part = gguf.open_model(write_shard(mf, spec, tmp_path / "phi3-slice.gguf"))
    (a, b), (c, d) = spec.kv_groups, spec.ffn_cols
    first, last = spec.layer_range(cfg.n_layers)
    for i in range(first, last):  # the rule written out: q rows of the heads, k rows, v rows; gate rows, up rows
        qkv, up = (np.asarray(mf.tensors[f"blk.{i}.{n}.weight"].data) for n in ("attn_qkv", "ffn_up"))
        k0, v0 = cfg.n_heads * hd, (cfg.n_heads + cfg.n_kv_heads) * hd
        want = np.concatenate([qkv[a * g * hd:b * g * hd], qkv[k0 + a * hd:k0 + b * hd], qkv[v0 + a * hd:v0 + b * hd]])
        assert np.array_equal(np.asarray(part.tensors[f"blk.{i}.attn_qkv.weight"].data).reshape(want.shape), want)
        want = np.concatenate([up[c:d], up[f + c:f + d]])
        assert np.array_equal(np.asarray(part.tensors[f"blk.{i}.ffn_up.weight"].data).reshape(want.shape), want)
    x = llama.embed(mf, [1, 42, 7, 99, 5, 300, 12, 77, 150, 3])
    whole = llama.Shard(llama.load_weights(mf, spec), 16)
    mine = llama.Shard(llama.load_weights(part, spec), 16)
    assert np.array_equal(mine.forward(x.copy(), 0), whole.forward(x.copy(), 0))


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("tensor,rows", [("blk.1.attn_qkv.weight", 96 + 2 * 48 - 16),  # a KV head's v rows short
                                         ("blk.0.ffn_up.weight", 224)])                  # up without the gate
def test_a_fused_tensor_whose_rows_do_not_match_the_heads_is_refused_in_one_line_naming_it(phi3, tensor, rows,
                                                                                             tmp_path):
    src = phi3("q8_0")
    data = np.asarray(gguf.open_model(src).tensors[tensor].data)[:rows]
    bad = _without(src, tmp_path / "bad-fused.gguf", tensor, instead=np.ascontiguousarray(data))
    assert_one_line_error(ask(bad), str(bad), repr(tensor), f"[96, {rows}]")
    with pytest.raises(gguf.GGUFError, match=tensor.replace(".", r"\.")):
        gguf.open_model(bad)



def test_rope_factors_of_the_wrong_length_are_refused_in_one_line_naming_them(phi3, tmp_path):
    src = phi3("q8_0")  # 16 rope dims: 8 factors each
    short = np.asarray(gguf.open_model(src).tensors["rope_factors_long.weight"].data)[:6].copy()
    bad = _without(src, tmp_path / "bad-factors.gguf", "rope_factors_long.weight", instead=short)
    assert_one_line_error(ask(bad), str(bad), "'rope_factors_long.weight'", "[6]", "expected [8]")


def test_llama3s_rope_freqs_factors_equal_llamacpp_and_the_exact_math(llama_cpp, synth_model, float_kernels):
    # the other factor set llama.cpp's get_rope_factors reads (first, where a file has it): llama 3.1's
    path = synth_model("tiny-headdim", "f32", rope_freqs=True)
    w = llama.load_weights(gguf.open_model(path))
    assert w.rope_freqs is not None and w.rope_freqs.max() > 10 and llama.rope_factors(w, 256) is w.rope_freqs
    ids = _ids(path)
    assert_exact_at_every_position(path, "f32")
    assert_never_further_from_llamacpp_than_it_is_from_exact(path, ids, "f32")
    assert greedy(LocalRunner(gguf.open_model(path), 256, kv_type="f32"), ids, 64) == reference.greedy(
        path, ids, 64, "f32")


def test_a_bias_on_the_fused_qkv_is_refused_in_one_line_not_left_out(phi3, tmp_path):
    bad = _without(phi3("q8_0"), tmp_path / "qkv-bias.gguf", "blk.0.attn_qkv.bias", instead=np.ones(192, np.float32))
    assert_one_line_error(ask(bad), str(bad), "'blk.0.attn_qkv.bias'", "not supported")
