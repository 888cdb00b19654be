"""The warm-up a daemon runs before it says it serves (generate.warm).

On a cold numba cache the first request compiled every kernel: 60 s on the 2-core AMD EPYC
here. Whether the warm-up prepared what requests run is read from numba itself: in a fresh
process, after `warm`, requests of every kind (a long prompt in chunks, three sequences batched,
greedy and sampled, a chunk copied between running sequences, a prefix-cache hit) must add no
compiled signature to any numba dispatcher.
The check was seen to fail: with no warm-up, stories260K's requests compiled 14 kernels; after a
warm-up of one greedy prompt and token, 4 (the batched decode's, attention's, sampling's).
Which layers it runs is checked against the tensor types gguf-py reads from the file.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys

import gguf as gguf_py
import pytest

from edgetp.model import gguf
from edgetp.model.generate import warm_specs

REQUESTS = r"""
import gc, json, sys
from numba.core.registry import CPUDispatcher
from edgetp.model import gguf
from edgetp.model.batch import Scheduler, Seq
from edgetp.model.generate import LocalRunner, warm
from edgetp.model.sampling import SamplingParams
from edgetp.model.tokenizer import Tokenizer

def compiled():
    return {(d.py_func.__module__, d.py_func.__qualname__, id(d)): len(d.signatures)
            for d in gc.get_objects() if isinstance(d, CPUDispatcher)}

mf = gguf.open_model(sys.argv[1])
tok = Tokenizer.from_metadata(mf.metadata)
kv = sys.argv[2]
warm(mf, tok, kv)
before = compiled()
sched = Scheduler(LocalRunner(mf, 256, 3, kv), tok)
long = (tok.encode("Once upon a time " * 40) * 2)[:150]
seqs = [Seq(long, SamplingParams(temperature=0), 6),
        Seq(long[:40], SamplingParams(seed=5, temperature=1.1), 8),
        Seq(long[:70], SamplingParams(temperature=0.7, top_k=0, top_p=0.9, repeat_penalty=1.2), 8)]
for s in seqs:
    sched.admit(s)
for _ in range(80):
    if all(s.done for s in seqs):
        break
    sched.step()
again = Seq(long, SamplingParams(temperature=0), 4)
sched.admit(again)
for _ in range(20):
    if again.done:
        break
    sched.step()
assert all(s.done for s in seqs) and again.done and again.cached == 128
assert sum(s.cached for s in seqs) == 64  # the first and third share a whole chunk: one copied it
after = compiled()
print(json.dumps(sorted(f"{m}.{q}" for (m, q, i), n in after.items() if n > before.get((m, q, i), 0))))
"""


def compiled_after_warm(path, kv_type: str = "f16") -> list[str]:
    """What requests compiled after the warm-up, in a fresh process (an empty list: nothing)."""
    run = subprocess.run([sys.executable, "-c", REQUESTS, str(path), kv_type], capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def tiny_k_q4_k_m(llama_cpp, synth_model, model_dir):
    """The tiny-k shape quantized to Q4_K_M by llama.cpp: its first layer's attn_v and ffn_down
    are Q6_K, its second's Q4_K (llama.cpp's use_more_bits), so its layers mix types differently."""
    out = model_dir / "tiny-k-warm-q4_k_m.gguf"
    if not out.exists():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
        params.nthread = 2
        part = out.with_suffix(".part")
        assert llama_cpp.llama_model_quantize(str(synth_model("tiny-k", "f16")).encode(), str(part).encode(),
                                              ctypes.byref(params)) == 0
        part.rename(out)
    return out


def test_after_the_warm_up_requests_of_every_kind_compile_nothing(stories_path):
    assert compiled_after_warm(stories_path) == []


def test_after_the_warm_up_with_a_q8_0_cache_requests_compile_nothing(smollm2_path):
    assert compiled_after_warm(smollm2_path, "q8_0") == []


def test_after_the_warm_up_of_a_k_quant_mix_requests_compile_nothing(tiny_k_q4_k_m):
    assert compiled_after_warm(tiny_k_q4_k_m) == []


FAMILIES = {  # the tiny shapes the family tests use (test_moe, test_gemma, test_phi3, test_qwen3)
    "qwen3moe": ("tiny-headdim", "q8_0", dict(arch="qwen3moe", n_experts=8, n_experts_used=2, n_heads=4, ffn=224)),
    "gemma3": ("tiny-headdim", "q4_0", dict(arch="gemma3", swa_window=8, n_layers=7, rope_theta=1e6)),
    "gemma2": ("tiny-headdim", "q8_0", dict(arch="gemma2", swa_window=8, attn_softcap=5.0, final_softcap=3.0)),
    "phi3": ("tiny-k", "q4_k", dict(arch="phi3", swa_window=8)),
    "qwen3": ("tiny-odd", "q8_0", dict(arch="qwen3", head_dim=32)),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_after_the_warm_up_of_each_family_requests_compile_nothing(family, synth_model):
    preset, weights, shape = FAMILIES[family]
    assert compiled_after_warm(synth_model(preset, weights, **shape)) == []


def mixes(path) -> dict[int, frozenset]:
    """Each layer's (tensor name, type) pairs, as gguf-py reads them."""
    out: dict[int, set] = {}
    for t in gguf_py.GGUFReader(path).tensors:
        if t.name.startswith("blk."):
            _, i, rest = t.name.split(".", 2)
            out.setdefault(int(i), set()).add((rest, int(t.tensor_type)))
    return {i: frozenset(m) for i, m in out.items()}


def test_the_warm_up_runs_one_layer_of_each_mix_of_types_the_last_first(tiny_k_q4_k_m, smollm2_path):
    for path in (tiny_k_q4_k_m, smollm2_path):
        mf = gguf.open_model(path)
        by_layer = mixes(path)
        specs = warm_specs(mf)
        layers = [s.layers for s in specs]
        assert layers[0] == (mf.config.n_layers - 1, mf.config.n_layers)
        assert all(b == a + 1 for a, b in layers)
        assert {by_layer[a] for a, _ in layers} == set(by_layer.values())
        assert len(specs) == len(set(by_layer.values()))
        assert all(s.vocab_rows == (0, 256) for s in specs)
    assert len(warm_specs(gguf.open_model(tiny_k_q4_k_m))) == 2
