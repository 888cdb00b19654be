"""mistral3 (Ministral 3) against independent references: llama.cpp and the float64 math of tests/reference.py.

What mistral3 changes from llama (llama.cpp's llama_model_mistral3, Hugging Face's modeling_ministral3):
YaRN rope scaling whose betas come from the file (rope.scaling.yarn_beta_fast / yarn_beta_slow), with
a log multiplier (rope.scaling.yarn_log_multiplier, HF's mscale_all_dim) that sets the magnitude of cos
and sin; and llama 4's query temperature: after the rotation, q times
1 + attention.temperature_scale * ln(floor(pos / original context) + 1), so positions past the first
original context attend more sharply. Ministral 3's releases carry factor 16 over 16,384 positions,
betas 32 and 1, mscale_all_dim 1 and a temperature of 0.1.

These files carry factor 16 over 32 positions under a 118-token prompt (floor 0 to 3), betas 16 and
2, a log multiplier of 1 and a temperature of 0.5, so each term moves the logits. llama.cpp runs with
its own tools' defaults (tests/reference.py): the betas from the file.

Bounds: test_engine_reference's (stated there), as in test_qwen3.
"""

from __future__ import annotations

import pytest

from edgetp.model import gguf
from tests import reference
from tests.test_decode_fast import _same
from tests.test_engine_reference import FOX
from tests.test_qwen3 import (assert_each_change_far_from_llamacpp, assert_exact_at_every_position,
                              assert_greedy_as_llamacpps, assert_never_further_from_llamacpp_than_it_is_from_exact,
                              assert_processes_match, control, float_kernels)  # noqa: F401 (fixtures)

KEYS = dict(rope_scale_yarn=16.0, rope_ctx_orig=32, yarn_beta_fast=16.0, yarn_beta_slow=2.0, yarn_log_mul=1.0,
            attn_temp_scale=0.5)
TYPES = ["f32", "f16", "q8_0", "q4_0", "q4_k"]


@pytest.fixture(scope="module")
def mistral3(synth_model):
    def make(wt: str = "f32", **extra):
        preset = "tiny-k" if wt.endswith("_k") else "tiny-headdim"  # K-quants: widths of 256
        return synth_model(preset, wt, arch="mistral3", **(KEYS | extra))

    return make


def _ids(path) -> list[int]:
    ids = reference.tokenize(path, FOX)
    assert len(ids) > 3 * 32, "the prompt must outrun three original contexts"
    return ids


def test_a_synthetic_mistral3_file_reads_as_llamacpps_loader_reads_it(mistral3):
    cfg = gguf.open_model(mistral3()).config
    assert (cfg.arch, cfg.rope_neox, cfg.rope_yarn, cfg.rope_scale, cfg.rope_ctx_orig) == (
        "mistral3", False, True, 1 / 16, 32)
    assert (cfg.yarn_beta_fast, cfg.yarn_beta_slow, cfg.yarn_log_mul, cfg.attn_temp_scale) == (16.0, 2.0, 1.0, 0.5)


@pytest.mark.parametrize("wt,kv_type", [(w, "f16") for w in TYPES] + [("f32", "f32")])
def test_logits_at_every_position_equal_the_exact_float64_math(mistral3, wt, kv_type, float_kernels):
    assert_exact_at_every_position(mistral3(wt), kv_type)


@pytest.mark.parametrize("wt,kv_type", [(w, "f16") for w in TYPES] + [("f32", "f32")])
def test_logits_are_never_further_from_llamacpp_than_llamacpp_is_from_exact(llama_cpp, mistral3, wt, kv_type,
                                                                            float_kernels):
    path = mistral3(wt)
    assert_never_further_from_llamacpp_than_it_is_from_exact(path, _ids(path), kv_type)


def test_each_term_left_out_would_be_far_from_llamacpp(llama_cpp, mistral3, float_kernels):
    # the file read without its temperature, with llama's betas, or without its log multiplier
    path = mistral3()
    assert_each_change_far_from_llamacpp(path, _ids(path), [dict(attn_temp_scale=0.0),
                                                            dict(yarn_beta_fast=32.0, yarn_beta_slow=1.0),
                                                            dict(yarn_log_mul=0.0)])


@pytest.mark.parametrize("kv_type", ["f16", "f32"])
def test_greedy_continuation_is_token_identical_to_llamacpp_for_64_tokens(llama_cpp, mistral3, kv_type):
    path = mistral3()
    assert_greedy_as_llamacpps(path, _ids(path), kv_type)


@pytest.mark.parametrize("wt", ["q8_0", "q4_k"])
def test_the_fused_decode_plan_tempers_q_bit_identical_to_the_per_op_path(mistral3, wt, int8, kv_type):
    # an original context of 4: the 13 positions run take floors 0 to 3
    _same(gguf.open_model(mistral3(wt, rope_ctx_orig=4)), kv_type=kv_type)


def test_two_processes_with_uneven_weights_give_the_single_nodes_tokens_and_the_exact_logits(
        float_workers, control, synth_model, float_kernels):
    path = synth_model("tiny-odd", "q8_0", arch="mistral3", head_dim=32, **KEYS)
    assert_processes_match(control, path, float_workers, runs=((2, [1, 3]),))
