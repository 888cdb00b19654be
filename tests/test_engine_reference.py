"""The single-node engine against two independent references.

1. `reference.exact_logits`: the llama math written out in float64 numpy on
   gguf-py's dequantizer. Our engine computes every dot product in f32 on the
   exact dequantized weights, so it must agree to float rounding (EXACT).
2. llama.cpp (llama-cpp-python). For quantized weights llama.cpp rounds the
   activations to 8-bit blocks (Q8_0/Q8_1/Q8_K) before each dot product, for
   F16/BF16 weights to F16/BF16. On SmolLM2 Q4_1 that moves its logits up to
   7% of their spread away from the exact math (measured). So the bound is:
   at every position, |ours - llama.cpp| <= |llama.cpp - exact| + EXACT; we
   are never further from llama.cpp than llama.cpp is from the exact result.
3. Greedy text must be token-identical to llama.cpp for 64 tokens where
   llama.cpp is exact too: F32 weights, i.e. stories260K and SmolLM2's real
   weights dequantized to F32. (On Q4_1 the two already part at token 6, on
   a 0.12-logit near-tie inside llama.cpp's rounding noise; our Q4_1 text
   is the F32 text.)

4. The integer kernels run on every ISA (decode: intdot.py, prefill:
   intgemm.py), so 1. and 2. hold for the float kernels only (forced there). Q4_1 prefill rounds the
   activations to 16 bits per block of 32 and must stay within WIDE of the
   exact math. Q4_0 and Q8_0 (decode and prefill) round them to Q8_0 blocks as
   llama.cpp does, and are held to llama.cpp's own standard instead: their mean
   distance from the exact logits, over every position, is within
   INT8_VS_CPP of llama.cpp's. Per-position
   maxima are no use here: a rounding that lands differently in one layer
   moves a whole position, in either engine (measured on SmolLM2 Q4_0: max
   0.21 ours, 0.12 llama.cpp, 0.17 float64 with gguf-py's Q8_0 rounding; means
   2.9e-2, 2.9e-2, 3.0e-2 of the spread).

Every bound holds for each KV cache type (KV): with "f16" (the default) the float64
math stores K and V as f16 (numpy's rounding), as both engines' caches do, and
llama.cpp runs with an f16 cache too (its own default).

Token ids come from llama.cpp's tokenizer, so these tests check the forward
pass alone (the exactness test uses ours, which is checked against
llama.cpp's in test_tokenizer.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from edgetp.model import gguf
from edgetp.model.generate import LocalRunner
from edgetp.model.tokenizer import Tokenizer
from tests import reference

STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park "
         "with her friends. One day, she saw a big red ball under a tree and")
QUESTION = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            "<|im_start|>user\nWhat is the capital of France? Answer in one short sentence, and then tell "
            "me one fact about its history.<|im_end|>\n<|im_start|>assistant\n")
FOX = "the quick brown fox jumps over the lazy dog " * 4

# f32 dot products over a few thousand terms and a few dozen layers: relative error ~1e-6.
EXACT = 1e-4  # of the logits' spread (max - min) at each position
INT8_VS_CPP = 1.25  # int8 mean error / llama.cpp mean error, both against the exact logits
# 16-bit activations: each is off by at most 2^-16 of its block's max, ~1e-5 of a dot product;
# measured through SmolLM2's 30 layers: at most 2.8e-4 of the spread (llama.cpp: 2.6e-2 on average)
WIDE = 1e-3
# An f16 KV cache rounds every key and value to 11 significant bits, and the float64 math
# (kv_type "f16") rounds its own the same way; but where our f32 value and the float64 one
# straddle a rounding midpoint (about 1 in 1000 values: f32 error ~1e-6 against an f16 step
# of ~1e-3) they land one f16 step apart, and attention carries that on through the layers.
# Measured: at most 2.7e-4 (stories260K) and 5.5e-4 (SmolLM2 Q4_1) of the spread, where the
# f16 rounding itself moves the logits 4.3e-4 and 1.0e-3 from the f32-cache math; but on a Zen 4
# (AVX-512, other f32 errors, other straddles) SmolLM2 Q4_1 came to 1.8e-3 where the rounding
# moves them 1.2e-3, while its f32 cache stayed 2.3e-6 from exact. So against the f16 math the
# bound is relative: a straddled value is off by one f16 step where the rounding moves each by
# up to half of one (KV16_STRADDLE); and our f16-cache logits are no further from the exact
# f32-cache math than the f16 math itself is (KV16_ROUNDING): measured 0.80-1.05x on every model
# here (Zen 4), where a writer that clears the last mantissa bit of every f16 gave 1.96-3.35x.
# KV16 bounds the distance to llama.cpp beyond llama.cpp's own, as before.
KV16 = 1e-3
KV16_STRADDLE = 2.0
KV16_ROUNDING = 1.25
# A q8_0 cache rounds every key and value to a step of its block of 32 (d = amax / 127, an f16),
# and the float64 math (kv_type "q8_0") rounds its own the same way (gguf-py's Q8_0). Where our
# f32 value and the float64 one straddle a rounding midpoint (f32 error ~1e-6 of the block's
# largest against a step of 1/127 of it: ~2.5e-4 of the values) they land one step apart, and
# attention carries that on through the layers: the same kind of error as the q8_0 rounding itself
# (up to half a step on every value), only on fewer values. So against the q8_0 math we are never
# further than the q8_0 rounding moves the exact logits (the q8_0 math against the f32-cache math).
# Measured, as a fraction of the spread: SmolLM2 Q4_1 1.7e-2 where the rounding moves the logits
# 2.5e-2 (Q8_0 1.5e-2 of 3.8e-2, Q4_0 1.4e-2 of 3.2e-2); tiny-k 9e-4 of 1.1e-2. KV8 bounds the
# distance to llama.cpp beyond llama.cpp's own (which also rounds q to q8_0 in its flash attention:
# 2.7e-2 to 3.3e-2 from the q8_0 math on average on SmolLM2, ours 5e-3): measured at most 7.4e-3.
KV8 = 3e-2
BOUND = {"f32": EXACT, "f16": KV16, "q8_0": KV8}  # ours against the exact math of the same KV cache type


def _ours(path, ids, kv_type="f16"):
    return LocalRunner(gguf.open_model(path), 256, kv_type=kv_type).logits(ids, 0)


def _spread(ref: np.ndarray) -> np.ndarray:
    return ref.max(axis=1) - ref.min(axis=1)


def _error(a: np.ndarray, b: np.ndarray, spread: np.ndarray) -> np.ndarray:
    """Per position: max |a - b| as a fraction of the spread."""
    return np.abs(a - b).max(axis=1) / spread


def _ids(path, text):
    ids = reference.tokenize(path, text, special=True)
    assert len(ids) >= 32, f"the prompt must be 32+ tokens, got {len(ids)}"
    return ids


@pytest.fixture(scope="module")
def requantized(smollm2_path, model_dir):
    from tools import requant_gguf  # noqa: PLC0415

    def make(target: str):  # "<type>" (token_embd stays Q8_0, as in the download), "<type>-all", or "f32"
        out = model_dir / f"smollm2-{target}.gguf"
        if not out.exists():
            qtype, _, every = target.partition("-")
            requant_gguf.requant(smollm2_path, out, qtype, all_tensors=qtype == "f32" or every == "all")
        return out

    return make


def _models(which, stories_path, smollm2_path, requantized, synth_model):
    kind, _, arg = which.partition(":")
    if kind == "stories":
        return stories_path, STORY
    if kind == "smollm2":
        return (smollm2_path if arg == "q4_1" else requantized(arg)), QUESTION
    return synth_model("tiny-k", arg), FOX


REAL = ["stories", "smollm2:q4_1", "smollm2:q8_0", "smollm2:q4_0"]
SYNTH = [f"synth:{t}" for t in ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q4_k", "q6_k")]
# every model with the default f16 KV cache, the real ones with an f32 cache too, a q8_0 cache where the
# head size holds it (not stories260K's 8)
KV = [(w, "f16") for w in REAL + SYNTH] + [(w, "f32") for w in REAL] + [(w, "q8_0") for w in ["smollm2:q4_1"] + SYNTH]


@pytest.fixture
def float_kernels(monkeypatch):
    monkeypatch.setenv("EDGETP_INT8", "0")


@pytest.mark.parametrize("which,kv_type", KV)
def test_logits_at_every_position_equal_the_exact_float64_math(which, kv_type, stories_path, smollm2_path,
                                                               requantized, synth_model, float_kernels):
    path, text = _models(which, stories_path, smollm2_path, requantized, synth_model)
    ids = Tokenizer.from_metadata(gguf.open_model(path).metadata).encode(text, parse_special=True)
    exact = reference.exact_logits(path, ids, kv_type)
    ours = _ours(path, ids, kv_type)
    spread = _spread(exact)
    err = _error(ours, exact, spread)
    if kv_type == "f32":
        assert err.max() <= EXACT, f"max error {err.max():.2e} of the spread > {EXACT:.0e}"
        return
    f32 = reference.exact_logits(path, ids, "f32")
    rounding = _error(exact, f32, spread).max()  # how far the cache's rounding moves the exact logits
    if kv_type == "q8_0":  # never further than q8_0's own rounding moves the exact logits
        assert err.max() <= KV8, f"max error {err.max():.2e} of the spread > {KV8:.0e}"
        assert err.max() <= rounding, f"max error {err.max():.2e} > the q8_0 rounding's own {rounding:.2e}"
        return
    assert err.max() <= KV16_STRADDLE * rounding + EXACT, (
        f"max error {err.max():.2e} > {KV16_STRADDLE} x the f16 rounding's own {rounding:.2e}")
    moved = _error(ours, f32, spread).max()
    assert moved <= KV16_ROUNDING * rounding + EXACT, (
        f"our f16 cache moves the logits {moved:.2e} from the f32-cache math, the f16 math {rounding:.2e}")


@pytest.mark.parametrize("which,kv_type", KV)
def test_logits_are_never_further_from_llamacpp_than_llamacpp_is_from_exact(llama_cpp, which, kv_type, stories_path,
                                                                            smollm2_path, requantized, synth_model,
                                                                            float_kernels):
    path, text = _models(which, stories_path, smollm2_path, requantized, synth_model)
    ids = _ids(path, text)
    cpp = reference.logits(path, ids, kv_type)
    exact = reference.exact_logits(path, ids, kv_type)
    ours = _ours(path, ids, kv_type)
    spread = _spread(exact)
    ours_vs_cpp = _error(ours, cpp, spread)
    cpp_vs_exact = _error(cpp, exact, spread)
    worst = int(np.argmax(ours_vs_cpp - cpp_vs_exact))
    assert np.all(ours_vs_cpp <= cpp_vs_exact + BOUND[kv_type]), (
        f"position {worst}: ours vs llama.cpp {ours_vs_cpp[worst]:.2e} > llama.cpp vs exact "
        f"{cpp_vs_exact[worst]:.2e} + {BOUND[kv_type]:.0e}")
    if kv_type == "q8_0":  # and on average no further from the q8_0 math than llama.cpp is
        ours_vs_exact = _error(ours, exact, spread).mean()
        assert ours_vs_exact <= cpp_vs_exact.mean(), f"mean error {ours_vs_exact:.2e} vs llama.cpp's {cpp_vs_exact.mean():.2e}"


@pytest.mark.parametrize("which", ["smollm2:q4_0", "synth:q4_0", "smollm2:q8_0", "synth:q8_0",
                                   "smollm2:q4_1"])  # the download: Q4_1 layers (16-bit) and a Q8_0 head (int8)
def test_int8_logits_are_as_close_to_exact_as_llamacpps(llama_cpp, which, stories_path, smollm2_path,
                                                              requantized, synth_model, int8_prefill):
    path, text = _models(which, stories_path, smollm2_path, requantized, synth_model)
    ids = _ids(path, text)
    exact = reference.exact_logits(path, ids)  # the integer kernels' rounding alone: f32 caches
    spread = _spread(exact)
    ours = _error(_ours(path, ids, "f32"), exact, spread).mean()
    cpp = _error(reference.logits(path, ids), exact, spread).mean()
    assert 1e-3 < ours <= INT8_VS_CPP * cpp, f"mean error {ours:.2e} vs llama.cpp's {cpp:.2e}"


@pytest.mark.parametrize("which", ["smollm2:q4_1-all", "synth:q4_1"])  # every tensor Q4_1, the head too
def test_16_bit_prefill_logits_stay_near_the_exact_math(which, stories_path, smollm2_path, requantized,
                                                        synth_model, int8_prefill):
    # every position's logits come from the batched (prefill) products here
    path, text = _models(which, stories_path, smollm2_path, requantized, synth_model)
    ids = Tokenizer.from_metadata(gguf.open_model(path).metadata).encode(text, parse_special=True)
    exact = reference.exact_logits(path, ids)  # the 16-bit kernels' rounding alone: an f32 cache
    err = _error(_ours(path, ids, "f32"), exact, _spread(exact))
    assert err.mean() > 5e-6, "the 16-bit kernels did not run: this is the float kernels' exactness"
    assert err.max() <= WIDE, f"max error {err.max():.2e} of the spread > {WIDE:.0e}"


def _greedy_ours(path, ids, n, kv_type):
    from tests.test_parallel import greedy  # noqa: PLC0415 - one greedy loop for every runner

    return greedy(LocalRunner(gguf.open_model(path), 256, kv_type=kv_type), ids, n)


@pytest.mark.parametrize("kv_type", ["f16", "f32"])
@pytest.mark.parametrize("which", ["stories", "smollm2:f32"])
def test_greedy_continuation_is_token_identical_to_llamacpp_for_64_tokens(llama_cpp, which, kv_type, stories_path,
                                                                         smollm2_path, requantized, synth_model):
    path, text = _models(which, stories_path, smollm2_path, requantized, synth_model)
    ids = _ids(path, text)
    assert _greedy_ours(path, ids, 64, kv_type) == reference.greedy(path, ids, 64, kv_type)


def test_smollm2_answers_the_capital_of_france_with_paris(smollm2_path):
    """A trained model reads as trained: FACTS.md's check of a correct forward pass."""
    mf = gguf.open_model(smollm2_path)
    tok = Tokenizer.from_metadata(mf.metadata)
    ids = tok.encode(QUESTION.split("What is")[0] + "What is the capital of France?<|im_end|>\n"
                     "<|im_start|>assistant\n", parse_special=True)
    text = tok.decode(_greedy_ours(smollm2_path, ids, 8, "f16"))
    assert text.startswith("The capital of France is Paris")
