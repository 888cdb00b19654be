"""One-token decode through decode.Plan gives the per-op path's bits: hidden states,
the partial sums each shard hands to reduce, and logits, token after token."""

from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import replace

import numpy as np
import pytest

from gguf import GGMLQuantizationType as QT

from edgetp.model import decode, gguf, kvcache, llama, ops, quant
from tools import synth_gguf

PROMPT = [1, 17, 42, 99, 7]
DECODE = [5, 300, 12, 77, 150, 3, 64, 200]  # fed one at a time after the prompt

# A layer of a llama.cpp Q4_K_M file mixes types, and q/k/v or gate/up of one layer
# need not share one: here layer 0 has q,k Q5_0 beside v Q8_0, layer 1 an F16 k (a float
# kernel inside an integer group) and gate/up of two K-quants.
MIXED = {"attn_q": "q5_0", "attn_k": "q5_0", "attn_v": "q8_0", "attn_output": "q4_k",
         "ffn_gate": "q4_k", "ffn_up": "iq4_nl", "ffn_down": "q6_k",
         "blk.1.attn_k": "f16", "blk.1.ffn_gate": "q5_k", "blk.1.ffn_up": "q2_k", "blk.1.attn_output": "q5_1",
         "output.weight": "q6_k", "token_embd": "q8_0"}


@pytest.fixture(scope="module")
def mixed_path(tmp_path_factory):
    """tiny-k (every width a multiple of 256) with the per-tensor types of MIXED."""
    return synth_gguf.write_preset(tmp_path_factory.mktemp("mixed") / "mixed.gguf", "tiny-k", tensor_types=MIXED)


def _run(mf, spec, fast: bool, flip_at: int | None = None, monkeypatch=None, biases: bool = False, kv_type="f16"):
    """Prefill PROMPT, then decode DECODE one token at a time; every forward output, every
    partial handed to reduce and every logits row, as uint32 bits."""
    seen: list[np.ndarray] = []
    w = llama.load_weights(mf, spec)
    if biases:  # q/k/v biases as qwen2 has them
        rng = np.random.default_rng(3)
        bias = lambda m: rng.standard_normal(m.rows).astype(np.float32)  # noqa: E731
        w = replace(w, layers=tuple(replace(x, bq=bias(x.wq), bk=bias(x.wk), bv=bias(x.wv)) for x in w.layers))

    def reduce(partial):
        seen.append(partial.copy().view(np.uint32))
        partial *= np.float32(1.5)  # a stand-in for the other shards' sum: the result must flow on

    shard = llama.Shard(w, ctx=64, reduce=reduce, fast_decode=fast, kv_type=kv_type)
    shard.forward(llama.embed(mf, PROMPT), 0)
    for i, t in enumerate(DECODE):
        if i == flip_at:
            monkeypatch.setenv("EDGETP_INT8", "0")
        h = shard.forward(llama.embed(mf, [t]), len(PROMPT) + i)
        seen += [h.view(np.uint32), shard.logits(h).view(np.uint32)]
    return seen, shard


def _same(mf, spec=None, biases=False, kv_type="f16"):
    fast, shard = _run(mf, spec, True, biases=biases, kv_type=kv_type)
    slow, _ = _run(mf, spec, False, biases=biases, kv_type=kv_type)
    assert len(fast) == len(slow)
    for i, (a, b) in enumerate(zip(fast, slow)):
        assert a.shape == b.shape and np.array_equal(a, b), f"record {i} differs"
    return shard


def _integer_products(shard) -> int:
    return sum(len(m.products) + len(m.kept) for plan in shard._plans.values() for p in plan.layers
               for m in (p.qkv, p.o, p.gate_up, p.down) if m is not None)


def test_stories260k_decodes_bit_identical_to_the_per_op_path(stories_path, threads, int8, kv_type):
    if kv_type == "q8_0":
        pytest.skip("stories260K's head size (8) cannot hold q8_0 (refused, as llama.cpp does); the mixed model runs it")
    _same(gguf.open_model(stories_path), kv_type=kv_type)


def test_mixed_type_model_decodes_bit_identical_to_the_per_op_path(mixed_path, threads, int8, kv_type):
    mf = gguf.open_model(mixed_path)
    types = {mf.weight(f"blk.{i}.{n}.weight").qtype for i in (0, 1)
             for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    assert len(types) == 9  # the file really mixes them
    shard = _same(mf, kv_type=kv_type)
    assert (_integer_products(shard) > 0) == (int8 and quant.intdot.available(int(QT.Q5_0)))


def test_q_k_v_biases_decode_bit_identical_to_the_per_op_path(mixed_path, int8):
    _same(gguf.open_model(mixed_path), biases=True)


@pytest.mark.parametrize("spec", [((1, 2), (256, 512), (0, 320)), ((0, 0), (0, 96), (320, 640)),
                                  ((0, 2), (0, 0), (0, 0))], ids=["half", "no-attention", "no-ffn"])
def test_a_shards_slice_decodes_bit_identical_to_the_per_op_path(mixed_path, spec, int8):
    _same(gguf.open_model(mixed_path), llama.ShardSpec(*spec))


def test_smollm2_decodes_bit_identical_to_the_per_op_path(smollm2_path, threads):
    shard = _same(gguf.open_model(smollm2_path))
    if quant.intdot.available(int(QT.Q4_1)):  # q, k and v are Q4_1: one kernel call for the three
        assert [len(p.qkv.products) for p in shard._plans[True].layers] == [1] * 30


def test_turning_int8_off_mid_decode_switches_the_fast_path_too(mixed_path, monkeypatch):
    mf = gguf.open_model(mixed_path)
    monkeypatch.setenv("EDGETP_INT8", "1")
    fast, shard = _run(mf, None, True, flip_at=3, monkeypatch=monkeypatch)
    monkeypatch.setenv("EDGETP_INT8", "1")
    slow, _ = _run(mf, None, False, flip_at=3, monkeypatch=monkeypatch)
    assert all(np.array_equal(a, b) for a, b in zip(fast, slow, strict=True))
    assert set(shard._plans) == {True, False}


def test_the_plan_keeps_no_reference_to_a_returned_hidden_state(mixed_path):
    mf = gguf.open_model(mixed_path)
    shard = llama.Shard(llama.load_weights(mf), ctx=16)
    a = shard.forward(llama.embed(mf, [5]), 0)
    keep = a.copy()
    shard.forward(llama.embed(mf, [6]), 1)
    assert np.array_equal(a, keep)
    assert isinstance(shard._plans[quant.int8_decode()], decode.Plan)


def _attention_reference(q, kc, vc, pos, group):
    """One token's attention in plain float32 steps, in the order the kernel promises:
    each score one chain over the head dimension, softmax sums and each output value one
    chain over positions, e**x from the C library's expf (what numba's math.exp calls)."""
    expf = ctypes.CDLL(ctypes.util.find_library("m")).expf
    expf.restype, expf.argtypes = ctypes.c_float, [ctypes.c_float]
    n_kv, _, hd = kc.shape
    out = np.empty_like(q)
    scale = np.float32(1.0 / np.sqrt(np.float64(hd)))
    for h in range(n_kv * group):
        k, v, qh = kc[h // group, : pos + 1], vc[h // group, : pos + 1], q[0, h * hd : (h + 1) * hd]
        acc = np.zeros(pos + 1, np.float32)
        for d in range(hd):
            acc = acc + qh[d] * k[:, d]
        scores = acc * scale
        e = np.array([expf(float(s - scores.max())) for s in scores], np.float32)
        total = np.float32(0.0)
        for x in e:
            total = np.float32(total + x)
        p = e * (np.float32(1.0) / total)
        o = np.zeros(hd, np.float32)
        for s in range(pos + 1):
            o = o + p[s] * v[s]
        out[0, h * hd : (h + 1) * hd] = o
    return out


@pytest.mark.parametrize("pos", [0, 2, 3, 4, 37])  # around the four scores the kernel runs side by side
@pytest.mark.parametrize("serial", [True, False])
def test_decode_attention_is_the_canonical_float32_order_bit_for_bit(pos, serial):
    rng = np.random.default_rng(pos)
    n_kv, group, hd = 3, 3, 64
    kc = rng.standard_normal((n_kv, 48, hd)).astype(np.float32)
    vc = rng.standard_normal((n_kv, 48, hd)).astype(np.float32)
    q = rng.standard_normal((1, n_kv * group * hd)).astype(np.float32)
    out = np.empty_like(q)
    ops.attention(q, kc, vc, pos, group, out, serial)
    assert np.array_equal(out.view(np.uint32), _attention_reference(q, kc, vc, pos, group).view(np.uint32))


@pytest.mark.parametrize("pos", [0, 5, 37])
@pytest.mark.parametrize("serial", [True, False])
def test_decode_attention_over_an_f16_cache_reads_numpys_f16_values_exactly(pos, serial):
    # the kernel reads the cache's uint16 bits; the reference is the same float32 order over
    # numpy's own widening of those f16 values (exact), so any conversion error shows as a bit
    rng = np.random.default_rng(100 + pos)
    n_kv, group, hd = 3, 3, 64
    kc = (rng.standard_normal((n_kv, 48, hd)) * 3).astype(np.float16)
    vc = (rng.standard_normal((n_kv, 48, hd)) * 3).astype(np.float16)
    kc[0, 0, :4] = [6.0e-8, -3.0e-5, 65504.0, 0.0]  # a subnormal, a small normal, the largest, zero
    q = rng.standard_normal((1, n_kv * group * hd)).astype(np.float32)
    out = np.empty_like(q)
    ops.attention(q, kvcache.kernel_view(kc), kvcache.kernel_view(vc), pos, group, out, serial)
    want = _attention_reference(q, kc.astype(np.float32), vc.astype(np.float32), pos, group)
    assert np.array_equal(out.view(np.uint32), want.view(np.uint32))
