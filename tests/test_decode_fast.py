"""One-token decode through decode.Plan gives the per-op path's bits: hidden states,
the partial sums each shard hands to reduce, and logits, token after token."""

from __future__ import annotations

import itertools
import sys
from dataclasses import replace

import numpy as np
import pytest

from gguf import GGMLQuantizationType as QT

from edgetp.model import decode, gguf, kvcache, llama, ops, quant
from tests import isas
from tests.isas import RUNNABLE
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
        assert [len(p.qkv.products) + len(p.qkv.kept) for p in shard._plans[True].layers] == [1] * 30


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


def _lane_dots(qh, k):
    """q . each row of k (rows, hd) in the order ops.attention promises (edgetp/model/lanes.py):
    16 lanes from +0.0, lane l adding the f32 products of d = l, l + 16, ... in turn, then the
    lanes folded in halves (l += l + 8, + 4, + 2, + 1)."""
    prod = (qh[None, :] * k).astype(np.float32)
    lanes = np.zeros((k.shape[0], 16), np.float32)
    for d0 in range(0, k.shape[1], 16):
        c = prod[:, d0 : d0 + 16]
        lanes[:, : c.shape[1]] = lanes[:, : c.shape[1]] + c
    while lanes.shape[1] > 1:
        w = lanes.shape[1] // 2
        lanes = lanes[:, :w] + lanes[:, w:]
    return lanes[:, 0]


def _expf(x: np.ndarray) -> np.ndarray:
    """e**x for float32 x by Cephes' expf, written out in numpy float32 steps (the formula
    ops.exp32 promises): x = k ln2 + r with ln2 in two parts, a degree-7 polynomial in r,
    times 2**k; 0 at -87 and below, clamped at 88."""
    f = np.float32
    x = np.asarray(x, np.float32)
    y = np.minimum(np.maximum(x, f(-87.0)), f(88.0))
    k = np.floor(y * f(1.44269504088896341) + f(0.5)).astype(np.float32)
    r = (y - k * f(0.693359375)) + k * f(2.12194440e-4)
    p = np.full_like(r, f(1.9875691500e-4))
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = p * r + f(c)
    p = ((p * r) * r + r) + f(1.0)
    e = p * np.ldexp(f(1.0), k.astype(np.int32)).astype(np.float32)
    return np.where(x > f(-87.0), e, f(0.0)).astype(np.float32)


def _attention_reference(q, kc, vc, pos, group):
    """One token's attention in plain float32 steps, in the order the kernel promises:
    each score _lane_dots times the scale, softmax sums and each output value one chain over
    positions, e**x Cephes' expf in float32 steps (_expf)."""
    n_kv, _, hd = kc.shape
    out = np.empty_like(q)
    scale = np.float32(1.0 / np.sqrt(np.float64(hd)))
    for h in range(n_kv * group):
        k, v, qh = kc[h // group, : pos + 1], vc[h // group, : pos + 1], q[0, h * hd : (h + 1) * hd]
        scores = _lane_dots(qh, k) * scale
        e = _expf(scores - scores.max())
        total = np.float32(0.0)
        for x in e:
            total = np.float32(total + x)
        p = e * (np.float32(1.0) / total)
        o = np.zeros(hd, np.float32)
        for s in range(pos + 1):
            o = o + p[s] * v[s]
        out[0, h * hd : (h + 1) * hd] = o
    return out


ATTENTION_CHILD = """
import sys
import numpy as np
from edgetp.model import isa, kvcache, ops
d, inp = sys.argv[1], np.load(sys.argv[2])
for hd in (24, 64):
    kc, vc = inp[f"k{hd}"], inp[f"v{hd}"]
    for kind in ("f32", "f16"):
        k, v = (kc, vc) if kind == "f32" else (kc.astype(np.float16), vc.astype(np.float16))
        for group in (2, 4):
            q = inp[f"q{hd}g{group}"]
            out = np.empty_like(q)
            ops.attention(q, kvcache.kernel_view(k), kvcache.kernel_view(v), 11, group, out, 1)
            np.save(d + f"/{kind}{hd}g{group}.npy", out)
open(d + "/isa", "w").write(isa.current())
"""


def test_decode_attention_gives_the_reference_bits_on_every_isa_this_cpu_runs(tmp_path):
    # one child per ISA (EDGETP_ISA, as a user forces it): 16 lanes are one AVX-512 register, two
    # AVX2 ones or sixteen scalars on the generic ISA, whose f16 cache is read in integer code
    rng = np.random.default_rng(5)
    arrays = {}
    for hd in (24, 64):
        for group in (2, 4):  # the group's heads two and four at a time (lanes.scores2, scores4)
            arrays[f"q{hd}g{group}"] = rng.standard_normal((1, 2 * group * hd)).astype(np.float32)
        arrays[f"k{hd}"] = (rng.standard_normal((2, 16, hd)) * 2).astype(np.float32)
        arrays[f"v{hd}"] = rng.standard_normal((2, 16, hd)).astype(np.float32)
    np.savez(tmp_path / "in.npz", **arrays)
    assert len(RUNNABLE) >= 2 or isas.HOST[0] not in ("x86_64", "aarch64"), f"only {RUNNABLE} run here"
    for name in RUNNABLE:
        (tmp_path / name).mkdir()
    isas.run_each([([sys.executable, "-c", ATTENTION_CHILD, str(tmp_path / name), str(tmp_path / "in.npz")],
                    isas.child_env(name)) for name in RUNNABLE], isas.child_timeout(600))
    for name in RUNNABLE:
        d = tmp_path / name
        assert (d / "isa").read_text() == name
        for hd in (24, 64):
            kc, vc = arrays[f"k{hd}"], arrays[f"v{hd}"]
            for kind, group in itertools.product(("f32", "f16"), (2, 4)):
                k, v = (kc, vc) if kind == "f32" else (kc.astype(np.float16).astype(np.float32),
                                                       vc.astype(np.float16).astype(np.float32))
                want = _attention_reference(arrays[f"q{hd}g{group}"], k, v, 11, group)
                got = np.load(d / f"{kind}{hd}g{group}.npy")
                assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), \
                    f"{name}, {kind} cache, hd {hd}, group {group}"


def test_the_lane_order_differs_from_one_chain_so_the_reference_can_tell_them_apart():
    # guards the tests of the lane order: on these values one chain over d gives other bits than the lanes
    rng = np.random.default_rng(7)
    qh, k = rng.standard_normal(64).astype(np.float32), rng.standard_normal((32, 64)).astype(np.float32)
    chain = np.zeros(32, np.float32)
    for d in range(64):
        chain = chain + qh[d] * k[:, d]
    assert not np.array_equal(chain, _lane_dots(qh, k))


# positions around the four keys and values the kernel reads a step; head sizes around its 16
# lanes (stories260K's 8, SmolLM2's 64, Phi-3's 96, Qwen3's 128)
@pytest.mark.parametrize("pos,hd", [(0, 64), (2, 64), (3, 64), (4, 64), (37, 64),
                                    (9, 8), (9, 16), (9, 24), (9, 40), (9, 96), (9, 128)])
@pytest.mark.parametrize("threads,n_kv,group", [(1, 3, 3), (2, 3, 3), (2, 4, 2),  # by KV head, by head, by KV head
                                                (1, 2, 4), (1, 2, 7)])  # the 1B shape's 4 heads a KV head; 4 + 2 + 1
def test_decode_attention_is_the_canonical_float32_order_bit_for_bit(pos, hd, threads, n_kv, group):
    rng = np.random.default_rng(pos + hd)
    kc = rng.standard_normal((n_kv, 48, hd)).astype(np.float32)
    vc = rng.standard_normal((n_kv, 48, hd)).astype(np.float32)
    kc[1, pos // 2, hd // 2] = -0.0
    q = rng.standard_normal((1, n_kv * group * hd)).astype(np.float32)
    out = np.empty_like(q)
    ops.attention(q, kc, vc, pos, group, out, threads)
    assert np.array_equal(out.view(np.uint32), _attention_reference(q, kc, vc, pos, group).view(np.uint32))


def test_decode_attention_reads_a_float32_cache_whose_rows_are_not_contiguous():
    # lanes.scores* read addresses, so keys with a stride between values are copied into rows first
    rng = np.random.default_rng(11)
    n_kv, group, hd, pos = 2, 2, 24, 9
    wide = rng.standard_normal((n_kv, 16, 2 * hd)).astype(np.float32)
    kc, vc = wide[:, :, ::2], rng.standard_normal((n_kv, 16, hd)).astype(np.float32)
    q = rng.standard_normal((1, n_kv * group * hd)).astype(np.float32)
    out = np.empty_like(q)
    ops.attention(q, kc, vc, pos, group, out, 1)
    want = _attention_reference(q, np.ascontiguousarray(kc), vc, pos, group)
    assert np.array_equal(out.view(np.uint32), want.view(np.uint32))


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
    ops.attention(q, kvcache.kernel_view(kc), kvcache.kernel_view(vc), pos, group, out, 1 if serial else 2)
    want = _attention_reference(q, kc.astype(np.float32), vc.astype(np.float32), pos, group)
    assert np.array_equal(out.view(np.uint32), want.view(np.uint32))
