"""Real GGUF files written by llama.cpp's own quantizer, loaded and run by edgetp.

`llama_cpp.llama_model_quantize` writes the files, so both the block bytes and
the mix of tensor types are those of real downloads: a K-quant needs widths
that are multiples of 256, so in SmolLM2 (width 576) llama.cpp falls back to
Q4_0 / Q5_0 / Q5_1 / IQ4_NL / Q8_0 for every tensor but ffn_down (width 1536),
and its "_M" mixes raise attn_v and ffn_down a type or two. Sources: SmolLM2
(Q4_1, requantized), synthetic F16 models from tools/synth_gguf.py in the
"tiny-k" shape (every width a multiple of 256, so every tensor is a K-quant)
and the "tiny-odd" shape (widths of 32-blocks only), and, marked slow, the
Llama 3.2 1B shape. SmolLM2's IQ4 files are slow too: llama.cpp takes ~70 s
to quantize each (IQ4_NL and IQ4_XS are covered quickly by the tiny files).

For each file:
(a) every tensor loads (gguf.open_model, and each 2-D tensor as a Weight), and
    each (type, width) in the file dequantizes bit-identically to gguf-py;
(b) the logits at every position of a prompt are within KV16 of the float64
    math on gguf-py's values (reference.exact_logits), and no further from
    llama.cpp's than llama.cpp is from that math, plus KV16. These are
    test_engine_reference.py's bounds, and they hold for the same reason (all three
    with the default f16 KV cache: K and V stored as f16, the math's too): we
    compute f32 dot products on the exact dequantized weights, while llama.cpp
    rounds the activations to 8-bit blocks (Q8_0/Q8_1/Q8_K) before each
    quantized dot product, so llama.cpp's own distance from the exact math
    bounds ours from it (triangle inequality) up to our f32 rounding.
    That bound alone would pass a block layout that gguf-py and we misread
    the same way (the exact math moves with us), so ours must also be within
    CPP_ROUNDING of llama.cpp at every position;
(c) no greedy-text comparison: test_engine_reference establishes that greedy
    text equals llama.cpp's only for F32 weights (on SmolLM2 Q4_1 they part at
    token 6, on a 0.12-logit near-tie inside llama.cpp's activation rounding),
    and every file here is quantized.

The float kernels are forced (as in test_engine_reference) for (b). The integer
kernels round the activations as llama.cpp does, so on the files whose types take
int8 activations they are held to llama.cpp's own standard instead, as
test_engine_reference holds Q4_0: over every position, their mean distance from the
exact logits is within INT8_VS_CPP of llama.cpp's. Every position's logits come from
the prefill tiles (intgemm.py) there.
"""

from __future__ import annotations

import ctypes

import gguf as gguf_py
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from edgetp.model import gguf
from edgetp.model import quant as Q
from edgetp.model.generate import LocalRunner
from tests import reference
from tests.test_engine_reference import FOX, INT8_VS_CPP, KV16, QUESTION, _error, _spread

pytestmark = pytest.mark.llamacpp

# Per position, max |ours - llama.cpp| as a fraction of the logits' spread. llama.cpp's
# activation rounding moved its logits at most 0.18 of the spread from the exact math on
# these files (SmolLM2 Q2_K; 0.05-0.11 for the others, 0.03 on tiny-k). Reading Q5_0's
# high bits from the wrong end of qh, in gguf-py and so in the exact math, put llama.cpp
# 0.56-1.1 of the spread away at every position (measured on SmolLM2 Q5_0).
CPP_ROUNDING = 0.3

# llama.cpp file type -> tensor types the file must contain (so the test covers them), as
# llama.cpp 0.3.36's quantizer writes them. SmolLM2: K-quants only in ffn_down (Q3_K_M
# and Q2_K raise it to Q4_K / Q3_K), 32-block fallbacks elsewhere, token_embd Q8_0.
SMOLLM2 = {
    "Q4_K_M": {QT.Q4_K, QT.Q5_0, QT.Q6_K, QT.Q8_0},
    "Q5_K_M": {QT.Q5_K, QT.Q5_1, QT.Q6_K, QT.Q8_0},
    "Q6_K": {QT.Q6_K, QT.Q8_0},
    "Q3_K_M": {QT.Q4_K, QT.Q5_K, QT.Q4_0, QT.Q5_0, QT.Q5_1},
    "Q2_K": {QT.Q3_K, QT.Q4_0},
}
SMOLLM2_SLOW = {
    "IQ4_XS": {QT.IQ4_XS, QT.IQ4_NL, QT.Q5_K},
    "IQ4_NL": {QT.IQ4_NL, QT.Q5_K},
}
# tiny-k: every width a multiple of 256; output.weight takes Q6_K
TINY_K = {
    "Q4_K_M": {QT.Q4_K, QT.Q6_K},
    "Q5_K_M": {QT.Q5_K, QT.Q6_K},
    "Q3_K_M": {QT.Q3_K, QT.Q4_K, QT.Q5_K},
    "Q2_K": {QT.Q2_K, QT.Q3_K},
    "IQ4_XS": {QT.IQ4_XS},
}
# tiny-odd: widths 96 and 224, 32-block types only
TINY_ODD = {
    "IQ4_NL": {QT.IQ4_NL},
    "Q5_0": {QT.Q5_0},
    "Q5_1": {QT.Q5_1},
}


@pytest.fixture
def float_kernels(monkeypatch):
    monkeypatch.setenv("EDGETP_INT8", "0")


@pytest.fixture(scope="module")
def quantized(llama_cpp, model_dir):
    """quantized(src, ftype_name) -> path of src quantized by llama.cpp, written once per session."""

    def make(src, ftype: str):
        out = model_dir / f"{src.stem}-llamacpp-{ftype.lower()}.gguf"
        if not out.exists():
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
            params.allow_requantize = True  # SmolLM2 is stored as Q4_1
            params.nthread = 2
            part = out.with_suffix(".part")
            rc = llama_cpp.llama_model_quantize(str(src).encode(), str(part).encode(), ctypes.byref(params))
            assert rc == 0, f"llama.cpp could not quantize {src.name} to {ftype} (return code {rc})"
            part.rename(out)
        return out

    return make


def check_every_tensor_loads_and_dequantizes_like_gguf_py(path, must_contain: set) -> None:
    gguf.open_model(path)  # the engine's loader accepts every tensor
    tensors = [t for t in gguf_py.GGUFReader(path).tensors if int(np.prod(t.shape[1:])) > 1]
    types = {QT(t.tensor_type) for t in tensors}
    assert must_contain <= types, f"{path.name}: has {sorted(t.name for t in types)}"
    checked = set()
    for t in tensors:
        w = Q.weight_from_gguf(t)
        if (w.qtype, w.cols) in checked:
            continue
        checked.add((w.qtype, w.cols))
        rows = min(w.rows, 1024)  # embeddings: a slice of the vocabulary keeps it quick
        want = gguf_py.quants.dequantize(np.asarray(t.data[:rows]), t.tensor_type).reshape(rows, w.cols)
        got = Q.dequantize_rows(w, 0, rows)
        np.testing.assert_array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32), err_msg=t.name)


def check_logits_against_exact_math_and_llamacpp(path, text: str) -> None:
    # our default f16 KV cache, against llama.cpp's (its default too) and the math storing K and V as f16
    ids = reference.tokenize(path, text, special=True)
    assert len(ids) >= 32, f"the prompt must be 32+ tokens, got {len(ids)}"
    exact = reference.exact_logits(path, ids, "f16")
    cpp = reference.logits(path, ids, "f16")
    ours = LocalRunner(gguf.open_model(path), 256).logits(ids, 0)
    spread = _spread(exact)
    ours_vs_exact = _error(ours, exact, spread)
    ours_vs_cpp = _error(ours, cpp, spread)
    cpp_vs_exact = _error(cpp, exact, spread)
    assert ours_vs_exact.max() <= KV16, f"max error {ours_vs_exact.max():.2e} of the spread > {KV16:.0e}"
    assert ours_vs_cpp.max() <= CPP_ROUNDING, f"ours vs llama.cpp {ours_vs_cpp.max():.2f} of the spread"
    worst = int(np.argmax(ours_vs_cpp - cpp_vs_exact))
    assert np.all(ours_vs_cpp <= cpp_vs_exact + KV16), (
        f"position {worst}: ours vs llama.cpp {ours_vs_cpp[worst]:.2e} > llama.cpp vs exact "
        f"{cpp_vs_exact[worst]:.2e} + {KV16:.0e}")


@pytest.mark.parametrize("ftype", [*SMOLLM2, *(pytest.param(f, marks=pytest.mark.slow) for f in SMOLLM2_SLOW)])
def test_smollm2_quantized_by_llamacpp_loads_dequantizes_and_matches_logits(ftype, smollm2_path, quantized,
                                                                            float_kernels):
    path = quantized(smollm2_path, ftype)
    check_every_tensor_loads_and_dequantizes_like_gguf_py(path, {**SMOLLM2, **SMOLLM2_SLOW}[ftype])
    check_logits_against_exact_math_and_llamacpp(path, QUESTION)


@pytest.mark.parametrize("preset,ftype", [("tiny-k", f) for f in TINY_K] + [("tiny-odd", f) for f in TINY_ODD])
def test_synthetic_f16_model_quantized_by_llamacpp_matches(preset, ftype, synth_model, quantized, float_kernels):
    path = quantized(synth_model(preset, "f16"), ftype)
    check_every_tensor_loads_and_dequantizes_like_gguf_py(path, {"tiny-k": TINY_K, "tiny-odd": TINY_ODD}[preset][ftype])
    check_logits_against_exact_math_and_llamacpp(path, FOX)


@pytest.mark.slow
def test_llama_3_2_1b_shape_q4_k_m_from_llamacpp_matches(synth_model, quantized, float_kernels):
    path = quantized(synth_model("llama-3.2-1b", "f16"), "Q4_K_M")
    check_every_tensor_loads_and_dequantizes_like_gguf_py(path, {QT.Q4_K, QT.Q6_K})
    check_logits_against_exact_math_and_llamacpp(path, FOX)


# files whose every quantized tensor prefills with int8 activations but Q5_1's (16-bit); Q8_0 and the IQ4
# code books take int8 ones as llama.cpp's do
INT8_FILES = [("smollm2", "Q4_K_M"), ("smollm2", "Q3_K_M"), ("smollm2", "Q2_K"), ("smollm2", "Q8_0"),
              ("tiny-k", "Q2_K"), ("tiny-k", "Q3_K_M"), ("tiny-k", "Q4_K_M"), ("tiny-k", "Q5_K_M"),
              ("tiny-k", "IQ4_XS"), ("tiny-odd", "IQ4_NL")]


@pytest.mark.parametrize("source,ftype", INT8_FILES)
def test_integer_prefill_of_llamacpp_files_is_as_close_to_exact_as_llamacpp(source, ftype, smollm2_path, synth_model,
                                                                           quantized, int8_prefill):
    path = quantized(smollm2_path if source == "smollm2" else synth_model(source, "f16"), ftype)
    ids = reference.tokenize(path, QUESTION if source == "smollm2" else FOX, special=True)
    exact = reference.exact_logits(path, ids)  # the integer kernels' rounding alone: f32 caches
    spread = _spread(exact)
    ours = LocalRunner(gguf.open_model(path), 256, kv_type="f32").logits(ids, 0)
    cpp = reference.logits(path, ids)
    ours_err = _error(ours, exact, spread).mean()
    cpp_err = _error(cpp, exact, spread).mean()
    assert 1e-3 < ours_err <= INT8_VS_CPP * cpp_err, f"mean error {ours_err:.2e} vs llama.cpp's {cpp_err:.2e}"
