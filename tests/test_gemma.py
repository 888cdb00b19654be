"""gemma2 and gemma3 against independent references: llama.cpp and the float64 math of tests/reference.py.

What the two add to llama (llama.cpp's llama_model_gemma2/3, Hugging Face's
modeling_gemma2/3): embeddings times sqrt(dim); the attention and FFN outputs
RMS-normed again (post_attention_norm, post_ffw_norm) before each residual add,
with the norm weights used as stored (the converter stored 1 + w); GeGLU with
tanh GELU; sliding-window layers beside global ones (gemma2 every 2nd layer
global, gemma3 every 6th), with their own rope base (gemma3: 10000); gemma2
soft-caps the attention scores and the logits; gemma3 norms each head of q and k.

The synthetic models (tools/synth_gguf.py) are built so each of those shows: a
window of 8 keys under a 118-token prompt, soft-caps of 5 and 3 that bend
scores and logits of order one (real files carry 50 and 30), seven gemma3
layers so that one is global, and a head_dim that is not dim / heads.

Bounds: test_engine_reference's (stated there) for ours against the float64
math. llama.cpp is not exact on these models even with F32 weights: ggml's GELU
looks its input up in an f16 table (GGML_GELU_FP16), which puts its logits
~3e-4 of their spread from the float64 math (measured: 2.1e-4 to 3.8e-4); ours
stay at float rounding (< 1e-6), so against llama.cpp the rule is the one used
for quantized types: never further from llama.cpp than llama.cpp is from the
float64 math, plus our own bound. Greedy text must still equal llama.cpp's for
64 tokens on F32 weights: a flip would need a near-tie under 1e-3 of the spread.
"""

from __future__ import annotations

import numpy as np
import pytest

from edgetp.model import gguf, llama
from edgetp.model.generate import LocalRunner
from edgetp.model.tokenizer import Tokenizer
from tests import reference
from tests.test_cli_errors import ask, assert_one_line_error
from tests.test_decode_fast import _same
from tests.test_engine_reference import BOUND, FOX, _error, _ours, _spread
from edgetp.parallel.runner import ClusterRunner
from tests.test_parallel import greedy
from tests.test_qwen3 import (_without, assert_exact_at_every_position, assert_int8_decode_as_close_as_llamacpp,
                              assert_never_further_from_llamacpp_than_it_is_from_exact, assert_processes_match,
                              control, float_kernels)  # noqa: F401 (fixtures)

SHAPES = {  # arch -> synth_gguf keys beyond the preset
    "gemma2": dict(swa_window=8, attn_softcap=5.0, final_softcap=3.0),
    "gemma3": dict(swa_window=8, n_layers=7, rope_theta=1e6),
}
TYPES = ["f32", "f16", "q8_0", "q4_0", "q4_1", "q4_k"]


@pytest.fixture(scope="module")
def gemma(synth_model):
    def make(arch: str, wt: str = "f32", preset: str | None = None, **extra):
        preset = preset or ("tiny-k" if wt.endswith("_k") else "tiny-headdim")
        if preset == "tiny-k":
            extra.setdefault("head_dim", 128)  # 4 heads of 128 on a width of 256
        return synth_model(preset, wt, arch=arch, **(SHAPES[arch] | extra))

    return make


def _ids(path) -> list[int]:
    ids = reference.tokenize(path, FOX)
    assert len(ids) > 3 * SHAPES["gemma2"]["swa_window"], "the prompt must outrun the sliding window"
    return ids


def test_the_files_read_as_llamacpps_loader_reads_them(gemma):
    g2 = gguf.open_model(gemma("gemma2")).config
    assert g2.swa_layers == (True, False) and g2.swa_window == 8 and g2.rope_theta_swa == g2.rope_theta
    assert (g2.attn_softcap, g2.final_softcap, g2.tied, g2.qk_norm) == (5.0, 3.0, True, False)
    assert g2.embed_scale == pytest.approx(np.sqrt(128)) and g2.attn_scale == pytest.approx(1 / np.sqrt(32))
    g3 = gguf.open_model(gemma("gemma3")).config
    assert g3.swa_layers == (True,) * 5 + (False, True) and g3.rope_theta_swa == 10000.0
    assert (g3.attn_softcap, g3.final_softcap, g3.qk_norm, g3.rope_theta) == (0.0, 0.0, True, 1e6)


@pytest.mark.parametrize("kv_type", ["f16", "f32"])
@pytest.mark.parametrize("wt", TYPES)
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_logits_at_every_position_equal_the_exact_float64_math(gemma, arch, wt, kv_type, float_kernels):
    assert_exact_at_every_position(gemma(arch, wt), kv_type)


@pytest.mark.parametrize("wt", TYPES)
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_logits_are_never_further_from_llamacpp_than_llamacpp_is_from_exact(llama_cpp, gemma, arch, wt,
                                                                            float_kernels):
    path = gemma(arch, wt)
    assert_never_further_from_llamacpp_than_it_is_from_exact(path, _ids(path), "f16")


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_int8_q4_0_decode_logits_are_as_close_to_exact_as_llamacpps(llama_cpp, gemma, arch, monkeypatch):
    monkeypatch.delenv("EDGETP_INT8", raising=False)
    path = gemma(arch, "q4_0")
    assert_int8_decode_as_close_as_llamacpp(path, _ids(path))


@pytest.mark.parametrize("kv_type", ["f16", "f32"])
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_greedy_continuation_is_token_identical_to_llamacpp_for_64_tokens(llama_cpp, gemma, arch, kv_type):
    path = gemma(arch)
    ids = _ids(path)
    ours = greedy(LocalRunner(gguf.open_model(path), 256, kv_type=kv_type), ids, 64)
    assert ours == reference.greedy(path, ids, 64, kv_type)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_a_batched_decode_step_gives_each_row_the_bits_of_that_row_alone(gemma, arch, int8):
    mf = gguf.open_model(gemma(arch, "q8_0"))
    prompts = [[1, 17, 42, 99, 7, 300, 12, 77, 150, 3, 64, 200], [5, 9, 11]]  # the first outruns the window

    def primed(*ids):  # a shard with prompt s in KV slot s
        shard = llama.Shard(llama.load_weights(mf), ctx=64, slots=len(ids))
        for s, prompt in enumerate(ids):
            shard.forward(llama.embed(mf, prompt), 0, slot=s)
        return shard

    both = primed(*prompts)
    got = both.logits_rows(both.forward_rows(llama.embed(mf, [33, 44]), [0, 1], [len(p) for p in prompts]))
    for b, (prompt, tok) in enumerate(zip(prompts, [33, 44])):
        alone = primed(prompt)
        want = alone.logits(alone.forward(llama.embed(mf, [tok]), len(prompt)))
        assert np.array_equal(got[b].view(np.uint32), want[0].view(np.uint32)), f"row {b}"


@pytest.mark.parametrize("wt", ["q8_0", "q4_k"])
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_the_fused_decode_plan_gives_the_per_op_paths_bits(gemma, arch, wt, int8, kv_type):
    # post-norms, GeGLU, soft-caps, windows and both rope tables inside decode.Plan's fused steps
    # (test_decode_fast._same: 5 prompt tokens then 8 decoded, past gemma's window of 8)
    _same(gguf.open_model(gemma(arch, wt)), kv_type=kv_type)


# ---------------------------------------------------------------- tensor parallel, real processes


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_two_three_and_four_processes_with_uneven_weights_give_the_single_nodes_tokens_and_the_exact_logits(
        arch, float_workers, control, gemma, float_kernels):
    # 6 heads, 3 KV heads, FFN 7 blocks of 32: nothing divides evenly over 2 or 3 nodes
    assert_processes_match(control, gemma(arch, "q8_0", preset="tiny-odd", head_dim=32), float_workers)


@pytest.mark.parametrize("layout", [[[0], [1], [2]], [[0, 1], [2]]], ids=["pp-over-three", "hybrid"])
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_pipeline_stages_give_the_single_nodes_tokens(arch, layout, float_workers, control, gemma, float_kernels):
    # a stage's layers keep their own kind (local or global, by the model's layer index: gemma3's
    # stages, split after layer 4 or earlier, would otherwise take global layer 5 for a local one)
    # and a stage's last post-norm goes on the residual it hands on
    path = gemma(arch, "q8_0", preset="tiny-odd", head_dim=32, n_layers=7)
    mf = gguf.open_model(path)
    ids = Tokenizer.from_metadata(mf.metadata).encode(FOX)
    expected = greedy(LocalRunner(mf, 256), ids, 48)
    runner = control.run(ClusterRunner.connect(mf, float_workers[:2], ctx=256, weights=[1, 2, 3], layout=layout), timeout=300)
    try:
        layers = [(n.node_id, n.stage, n.layers) for n in runner.nodes]
        assert len(runner.plan.stages) == len(layout), layers
        assert greedy(runner, ids, 48) == expected, layers
    finally:
        runner.close()


def test_a_gemma_stage_slice_file_opens_and_runs_as_its_stage(gemma, tmp_path):
    from edgetp.parallel.shardfile import write_shard  # noqa: PLC0415

    mf = gguf.open_model(gemma("gemma3", "q8_0"))
    cfg = mf.config
    full = (0, cfg.n_kv_heads), (0, cfg.ffn)
    spec = llama.ShardSpec(*full, (0, cfg.vocab), (3, cfg.n_layers))
    part = gguf.open_model(write_shard(mf, spec, tmp_path / "stage.gguf"))  # other layers' norms: names only
    x = llama.embed(mf, [1, 42, 7, 99, 5, 300, 12, 77, 150, 3])  # past the window of 8
    first = llama.Shard(llama.load_weights(mf, llama.ShardSpec(*full, (0, 0), (0, 3))), 16)
    whole = llama.Shard(llama.load_weights(mf), 16)
    stage = llama.Shard(llama.load_weights(part, spec), 16)
    want = whole.logits(whole.forward(x.copy(), 0))
    assert np.array_equal(stage.logits(stage.forward(first.forward(x.copy(), 0), 0)), want)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("arch,tensor", [("gemma2", "blk.1.post_ffw_norm.weight"),
                                         ("gemma3", "blk.0.attn_k_norm.weight")])
def test_a_gemma_file_without_a_tensor_it_needs_is_refused_in_one_line_naming_it(gemma, arch, tensor, tmp_path):
    bad = _without(gemma(arch), tmp_path / f"{arch}-missing.gguf", tensor)
    assert_one_line_error(ask(bad), str(bad), f"'{tensor}' is missing")


# ---------------------------------------------------------------- linear rope scaling


@pytest.mark.parametrize("arch", ["gemma3", "gemma2", "llama"])
def test_linear_rope_scaling_matches_llamacpp_and_the_exact_math(llama_cpp, synth_model, arch, float_kernels):
    # Gemma 3 4B and up carry rope.scaling.type linear, factor 8: llama.cpp scales the global
    # layers' angles by 1/8 and leaves gemma3's sliding-window layers alone (gemma2 scales both)
    path = synth_model("tiny-headdim", "f32", arch=arch, rope_scale_linear=8.0, **SHAPES.get(arch, {}))
    assert gguf.open_model(path).config.rope_scale == 1 / 8
    ids = _ids(path)
    exact = reference.exact_logits(path, ids, "f32")
    spread = _spread(exact)
    ours = _ours(path, ids, "f32")
    assert _error(ours, exact, spread).max() <= BOUND["f32"]
    cpp = reference.logits(path, ids, "f32")
    assert np.all(_error(ours, cpp, spread) <= _error(cpp, exact, spread) + BOUND["f32"])


# ---------------------------------------------------------------- chat templates

# Gemma 2's and Gemma 3's templates as their tokenizer_config.json carry them (Gemma 3's
# image item left out): Gemma 2 refuses a system turn, Gemma 3 folds it into the first
# user turn. llama.cpp's own Gemma formatting (llama_chat_apply_template, which knows the
# template by its <start_of_turn>) is the reference; it leaves the BOS to the tokenizer.
GEMMA2_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""
TURNS = [{"role": "user", "content": " Hi there \n"}, {"role": "assistant", "content": "Hello! "},
         {"role": "user", "content": "What is 2+2?"}]
SYSTEM = [{"role": "system", "content": "Answer in French."}]


def _llamacpp_chat(llama_cpp, template: str, messages: list[dict], add_generation_prompt: bool) -> str:
    import ctypes  # noqa: PLC0415

    chat = (llama_cpp.llama_chat_message * len(messages))(
        *[llama_cpp.llama_chat_message(m["role"].encode(), m["content"].encode()) for m in messages])
    buf = ctypes.create_string_buffer(1 << 14)
    n = llama_cpp.llama_chat_apply_template(template.encode(), chat, len(messages), add_generation_prompt, buf,
                                            len(buf))
    assert 0 < n < len(buf)
    return buf.raw[:n].decode()


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("template,messages", [(GEMMA2_TEMPLATE, TURNS), (GEMMA3_TEMPLATE, TURNS),
                                               (GEMMA3_TEMPLATE, SYSTEM + TURNS)],
                         ids=["gemma2", "gemma3", "gemma3-system"])
def test_gemma_chat_templates_render_as_llamacpp_formats_gemma(llama_cpp, template, messages, add_generation_prompt):
    from edgetp.model.chat import render_chat_template  # noqa: PLC0415

    ours = render_chat_template(template, messages, add_generation_prompt=add_generation_prompt, bos_token="<bos>")
    assert ours == "<bos>" + _llamacpp_chat(llama_cpp, template, messages, add_generation_prompt)


def test_gemma2s_template_refuses_a_system_turn_in_one_clear_error():
    from edgetp.model.chat import ChatTemplateError, render_chat_template  # noqa: PLC0415

    with pytest.raises(ChatTemplateError, match="System role not supported"):
        render_chat_template(GEMMA2_TEMPLATE, SYSTEM + TURNS)
