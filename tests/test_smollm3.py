"""smollm3 against independent references: llama.cpp and the float64 math of tests/reference.py.

What smollm3 changes from llama (llama.cpp's llm_build_smollm3, Hugging Face's modeling_smollm3):
every 4th layer, the layers whose index + 1 is a multiple of 4, is NoPE: neither q nor k is
rotated there, so those layers attend by content alone. llama.cpp sets the step to 4 in its loader
and reads it from no key, so a file cannot say otherwise. Everything else is llama's (adjacent-pair
rope, llama's tensors; the head is token_embd where the file has no output.weight, as in SmolLM3-3B).

The synthetic files have 8 layers (4 for the K-quants, at widths of 256), so layers 3 and 7 are NoPE,
and a pipeline stage can start at a layer that is not a multiple of 4: a stage that counted its
layers from its own first one would rotate the wrong ones.

Bounds: test_engine_reference's (stated there), as in test_qwen3.
"""

from __future__ import annotations

import pytest

from edgetp.model import gguf
from edgetp.model.generate import LocalRunner
from edgetp.model.tokenizer import Tokenizer
from edgetp.parallel.runner import ClusterRunner
from tests import reference
from tests.test_decode_fast import _same
from tests.test_engine_reference import FOX
from tests.test_parallel import greedy
from tests.test_qwen3 import (assert_each_change_far_from_llamacpp, assert_exact_at_every_position,
                              assert_greedy_as_llamacpps, assert_int8_decode_as_close_as_llamacpp,
                              assert_never_further_from_llamacpp_than_it_is_from_exact, assert_processes_match,
                              control, float_kernels)  # noqa: F401 (fixtures)

TYPES = ["f32", "f16", "q8_0", "q4_0", "q4_1", "q4_k", "q6_k"]


@pytest.fixture(scope="module")
def smollm3(synth_model):
    def make(wt: str = "f32", **extra):
        if wt.endswith("_k"):  # 4 heads of 64 on a width of 256, 2 KV heads: K-quant widths
            return synth_model("tiny-k", wt, arch="smollm3", n_layers=4, tied=True, **extra)
        return synth_model("tiny-odd", wt, arch="smollm3", n_layers=8, tied=True, **extra)  # 6 heads of 16, 3 KV

    return make


def _ids(path) -> list[int]:
    ids = reference.tokenize(path, FOX)
    assert len(ids) >= 32
    return ids


def test_a_synthetic_smollm3_file_reads_as_llamacpps_loader_reads_it(smollm3):
    cfg = gguf.open_model(smollm3()).config
    assert (cfg.arch, cfg.n_layers, cfg.rope_neox, cfg.tied, cfg.qk_norm, cfg.qkv_bias) == (
        "smollm3", 8, False, True, False, False)
    assert [cfg.layer_rope_dims(i) for i in range(8)] == [16, 16, 16, 0, 16, 16, 16, 0]


@pytest.mark.parametrize("wt,kv_type", [(w, "f16") for w in TYPES] + [("f32", "f32"), ("q8_0", "f32")])
def test_logits_at_every_position_equal_the_exact_float64_math(smollm3, wt, kv_type, float_kernels):
    assert_exact_at_every_position(smollm3(wt), kv_type)


@pytest.mark.parametrize("wt,kv_type", [(w, "f16") for w in TYPES] + [("f32", "f32")])
def test_logits_are_never_further_from_llamacpp_than_llamacpp_is_from_exact(llama_cpp, smollm3, wt, kv_type,
                                                                            float_kernels):
    path = smollm3(wt)
    assert_never_further_from_llamacpp_than_it_is_from_exact(path, _ids(path), kv_type)


def test_rotating_every_layer_as_llama_does_would_be_far_from_llamacpp(llama_cpp, smollm3, float_kernels):
    path = smollm3("f32")
    assert_each_change_far_from_llamacpp(path, _ids(path), [dict(nope_step=0)])


def test_int8_q4_0_decode_logits_are_as_close_to_exact_as_llamacpps(llama_cpp, smollm3, monkeypatch):
    monkeypatch.delenv("EDGETP_INT8", raising=False)
    path = smollm3("q4_0")
    assert_int8_decode_as_close_as_llamacpp(path, _ids(path))


@pytest.mark.parametrize("kv_type", ["f16", "f32"])
def test_greedy_continuation_is_token_identical_to_llamacpp_for_64_tokens(llama_cpp, smollm3, kv_type):
    path = smollm3("f32")
    assert_greedy_as_llamacpps(path, _ids(path), kv_type)


@pytest.mark.parametrize("wt", ["q8_0", "q4_k"])
def test_the_fused_decode_plan_gives_the_per_op_paths_bits(smollm3, wt, int8, kv_type):
    extra = {} if wt.endswith("_k") else {"head_dim": 32}  # heads of 32 or 64: a q8_0 cache holds them
    _same(gguf.open_model(smollm3(wt, **extra)), kv_type=kv_type)


# ---------------------------------------------------------------- tensor parallel and pipelines, real processes


def test_two_three_and_four_processes_with_uneven_weights_give_the_single_nodes_tokens_and_the_exact_logits(
        float_workers, control, smollm3, float_kernels):
    # 6 heads, 3 KV heads, FFN 7 blocks of 32: nothing divides evenly over 2 or 3 nodes
    assert_processes_match(control, smollm3("q8_0"), float_workers)


@pytest.mark.parametrize("layout", [[[0], [1], [2]], [[0, 1], [2]]], ids=["pp-over-three", "hybrid"])
def test_pipeline_stages_rotate_the_models_layers_not_their_own_and_give_the_single_nodes_tokens(
        layout, float_workers, control, smollm3, float_kernels):
    mf = gguf.open_model(smollm3("q8_0"))
    ids = Tokenizer.from_metadata(mf.metadata).encode(FOX)
    expected = greedy(LocalRunner(mf, 256), ids, 48)
    # weights 1:1:4 put a stage's first layer off a multiple of 4 in both layouts
    runner = control.run(ClusterRunner.connect(mf, float_workers[:2], ctx=256, weights=[1, 1, 4], layout=layout),
                         timeout=300)
    try:
        layers = [(n.node_id, n.stage, n.layers) for n in runner.nodes]
        assert len(runner.plan.stages) == len(layout), layers
        starts = {first for _, _, (first, _) in layers}
        assert any(first % 4 for first in starts), f"no stage starts off a multiple of 4: {layers}"
        assert greedy(runner, ids, 48) == expected, layers
    finally:
        runner.close()
