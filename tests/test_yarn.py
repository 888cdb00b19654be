"""YaRN rope scaling (rope.scaling.type "yarn") against llama.cpp and the float64 math of tests/reference.py.

A file that says yarn (Qwen3's 128K releases: factor 4 over an original context of 32,768) is
rotated by llama.cpp's ggml rope_yarn: each pair's angle blended between itself and itself times
1 / factor, by a ramp from the pair that turns 32 times over the original context to the pair that
turns once, and cos and sin times 1 + 0.1 ln(factor). These files carry factor 4 over an original
context of 64 positions under a 118-token prompt, so the ramp falls inside the pairs and most of the
prompt lies beyond the original context.

Before, such a file ran with no scaling at all, silently far from llama.cpp (the test below shows how
far). Bounds: test_engine_reference's (stated there), as in test_qwen3.
"""

from __future__ import annotations

import pytest

from edgetp.model import gguf
from tests import reference
from tests.test_cli_errors import ask, assert_one_line_error
from tests.test_engine_reference import FOX
from tests.test_qwen3 import (_rewrite, assert_each_change_far_from_llamacpp, assert_exact_at_every_position,
                              assert_greedy_as_llamacpps, assert_never_further_from_llamacpp_than_it_is_from_exact,
                              assert_processes_match, control, float_kernels)  # noqa: F401 (fixtures)

YARN = dict(rope_scale_yarn=4.0, rope_ctx_orig=64)
CASES = [("llama", "f32"), ("llama", "q8_0"), ("qwen3", "f32"), ("qwen3", "q4_k")]


@pytest.fixture(scope="module")
def yarn(synth_model):
    def make(arch: str = "llama", wt: str = "f32"):
        if wt.endswith("_k"):  # 4 heads of 64 on a width of 256: 32 rotated pairs a head
            return synth_model("tiny-k", wt, arch=arch, **YARN)
        return synth_model("tiny-headdim", wt, arch=arch, **YARN)  # 6 heads of 32: 16 pairs

    return make


def _ids(path) -> list[int]:
    ids = reference.tokenize(path, FOX)
    assert len(ids) > 64, "the prompt must outrun the original context"
    return ids


def test_a_yarn_file_reads_as_llamacpps_loader_reads_it(yarn):
    cfg = gguf.open_model(yarn()).config
    assert (cfg.rope_yarn, cfg.rope_scale, cfg.rope_ctx_orig) == (True, 0.25, 64)


@pytest.mark.parametrize("arch,wt", CASES)
@pytest.mark.parametrize("kv_type", ["f16", "f32"])
def test_logits_at_every_position_equal_the_exact_float64_math(yarn, arch, wt, kv_type, float_kernels):
    assert_exact_at_every_position(yarn(arch, wt), kv_type)


@pytest.mark.parametrize("arch,wt", CASES)
@pytest.mark.parametrize("kv_type", ["f16", "f32"])
def test_logits_are_never_further_from_llamacpp_than_llamacpp_is_from_exact(llama_cpp, yarn, arch, wt, kv_type,
                                                                            float_kernels):
    path = yarn(arch, wt)
    assert_never_further_from_llamacpp_than_it_is_from_exact(path, _ids(path), kv_type)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_no_scaling_as_before_or_linear_scaling_alone_would_be_far_from_llamacpp(llama_cpp, yarn, arch,
                                                                                 float_kernels):
    # the file read as the tree before read it (no scaling at all), or scaled linearly by the same
    # factor without the ramp and the magnitude
    path = yarn(arch)
    assert_each_change_far_from_llamacpp(path, _ids(path), [dict(rope_yarn=False, rope_scale=1.0),
                                                            dict(rope_yarn=False)])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_continuation_is_token_identical_to_llamacpp_for_64_tokens(llama_cpp, yarn, arch):
    path = yarn(arch)
    assert_greedy_as_llamacpps(path, _ids(path), "f16")


def test_two_processes_with_uneven_weights_give_the_single_nodes_tokens_and_the_exact_logits(
        float_workers, control, synth_model, float_kernels):
    # each process builds its own rope tables from the file: they must be the single node's
    path = synth_model("tiny-odd", "q8_0", arch="qwen3", head_dim=32, **YARN)
    assert_processes_match(control, path, float_workers, runs=((2, [1, 3]),))


@pytest.mark.parametrize("kind,scaled", [("longrope", True), ("none", False)])
def test_the_factor_scales_every_type_but_none_as_in_llamacpp(llama_cpp, synth_model, kind, scaled, tmp_path,
                                                               float_kernels):
    # llama.cpp: freq_scale = 1 / rope.scaling.factor unless the type is "none" (a longrope file's factor
    # was left out before)
    src = synth_model("tiny-headdim", "f32", rope_scale_linear=2.0)
    path = _rewrite(src, tmp_path / f"{kind}.gguf", meta={"llama.rope.scaling.type": kind})
    assert gguf.open_model(path).config.rope_scale == (0.5 if scaled else 1.0)
    assert_never_further_from_llamacpp_than_it_is_from_exact(path, _ids(path), "f32")


def test_an_unknown_rope_scaling_type_is_refused_in_one_line_naming_it(yarn, tmp_path):
    bad = _rewrite(yarn(), tmp_path / "dynamic.gguf", meta={"llama.rope.scaling.type": "dynamic"})
    assert_one_line_error(ask(bad), str(bad), "'dynamic'", "llama.rope.scaling.type")
    with pytest.raises(gguf.GGUFError, match="rope scaling type 'dynamic'"):
        gguf.open_model(bad)
