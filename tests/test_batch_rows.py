"""One decode step of several sequences (Shard.forward_rows, logits_rows) gives each
sequence the bits it gets alone: hidden states, KV cache contents and logits, whatever
the batch size, the slots' order and positions, the kernels (int8 or float), the thread
count and the ISA.

References: each row run alone through the per-op path (Shard.forward with
fast_decode=False, one token) on a copy of the shard's state; for the kernels,
intdot.reference (the canonical arithmetic in numpy) and the single-token kernel.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from edgetp.model import decode, gguf, intdot, isa, llama, quant
from edgetp.model.intdot_layouts import LAYOUTS
from edgetp.model.kernels import SPREAD
from tools import synth_gguf
from tests.isas import REPO, RUNNABLE, child_env, child_timeout, run_each, skip_unless_runnable

TYPES = sorted(LAYOUTS, key=lambda t: LAYOUTS[t].qtype.name)
IDS = [LAYOUTS[t].qtype.name for t in TYPES]
SLOTS = 8
CHILD_TIMEOUT = child_timeout(1200)
PROMPTS = [[1, 17, 42], [5, 9, 200, 31, 7, 64, 3], [2], [300, 301], [11, 12, 13, 14, 15],
           [99, 98, 97, 96, 95, 94, 93, 92, 91], [4, 8], [250, 6, 77, 120]]  # one per slot: different lengths
# a layer of a llama.cpp file mixes types: every integer layout family, an F16 k among them
MIXED = {"attn_q": "q5_0", "attn_k": "q4_0", "attn_v": "q8_0", "attn_output": "q4_k",
         "ffn_gate": "q4_1", "ffn_up": "iq4_nl", "ffn_down": "q6_k",
         "blk.1.attn_k": "f16", "blk.1.ffn_gate": "q5_k", "blk.1.ffn_up": "q2_k", "blk.1.attn_output": "q5_1",
         "output.weight": "q4_k", "token_embd": "q8_0"}


@pytest.fixture(scope="module")
def mixed_path(tmp_path_factory):
    """tiny-k (every width a multiple of 256) with the per-tensor types of MIXED."""
    return synth_gguf.write_preset(tmp_path_factory.mktemp("rows") / "mixed.gguf", "tiny-k", tensor_types=MIXED)


class Recorder:
    """A reduce that records each partial's shape and scales it (a stand-in for the other
    shards' sum: the result must flow on)."""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []

    def __call__(self, partial: np.ndarray) -> None:
        self.shapes.append(partial.shape)
        partial *= np.float32(1.25)


def _filled(mf, spec=None, kv_type="f16"):
    """A shard of SLOTS slots, slot s holding PROMPTS[s] (prefilled) plus one decoded token."""
    shard = llama.Shard(llama.load_weights(mf, spec), ctx=32, reduce=Recorder(), slots=SLOTS, kv_type=kv_type)
    for s, p in enumerate(PROMPTS):
        shard.forward(llama.embed(mf, p), 0, slot=s)
        shard.forward(llama.embed(mf, [40 + s]), len(p), slot=s)
    return shard


def _alone(shard, mf, x, slots, positions):
    """The reference: each row run alone, one token through the per-op path, on a copy of
    the shard's caches. Returns (hidden rows, logits rows, the copy)."""
    ref = llama.Shard(shard.w, shard.ctx, reduce=Recorder(), fast_decode=False, slots=shard.slots, kv_type=shard.kv_type)
    for a, b in zip(ref.k_cache + ref.v_cache, shard.k_cache + shard.v_cache):
        a[...] = b
    hs, ls = [], []
    for b, (s, p) in enumerate(zip(slots, positions)):
        h = ref.forward(x[b : b + 1].copy(), int(p), slot=int(s))
        hs.append(h[0])
        ls.append(ref.logits(h)[0])
    return np.stack(hs), np.stack(ls), ref


def _bits(a):
    a = np.ascontiguousarray(a)
    return a.view(np.uint8) if a.dtype.names else a.view(np.uint32)  # a q8_0 cache: its bytes


def _check_steps(mf, spec=None, sizes=(1, 2, 3, 5, 8), steps=2, kv_type="f16"):
    shard = _filled(mf, spec, kv_type)
    length = [len(p) + 1 for p in PROMPTS]
    rng = np.random.default_rng(7)
    n_layers = shard.w.cfg.n_layers
    for B in sizes:
        for _ in range(steps):
            slots = rng.permutation(SLOTS)[:B]
            positions = np.array([length[s] for s in slots])
            x = llama.embed(mf, [int(t) for t in rng.integers(0, shard.w.cfg.vocab, B)])
            want_h, want_l, ref = _alone(shard, mf, x, slots, positions)
            shard.reduce.shapes.clear()
            h = shard.forward_rows(x.copy(), slots, positions)
            assert shard.reduce.shapes == [(B, shard.w.cfg.dim)] * (2 * n_layers)
            assert np.array_equal(_bits(h), _bits(want_h)), f"B={B}: hidden states differ"
            for i in range(n_layers):
                assert np.array_equal(_bits(shard.k_cache[i]), _bits(ref.k_cache[i])), f"B={B}: layer {i} keys differ"
                assert np.array_equal(_bits(shard.v_cache[i]), _bits(ref.v_cache[i])), f"B={B}: layer {i} values differ"
            assert np.array_equal(_bits(shard.logits_rows(h)), _bits(want_l)), f"B={B}: logits differ"
            for s in slots:
                length[s] += 1
    return shard


def test_stories260k_rows_equal_each_sequence_alone(stories_path, threads, int8, kv_type):
    if kv_type == "q8_0":
        pytest.skip("stories260K's head size (8) cannot hold q8_0 (refused, as llama.cpp does); the mixed model runs it")
    _check_steps(gguf.open_model(stories_path), kv_type=kv_type)


def test_mixed_type_rows_equal_each_sequence_alone(mixed_path, threads, int8, kv_type):
    shard = _check_steps(gguf.open_model(mixed_path), kv_type=kv_type)
    plan = shard._row_plans[quant.int8_decode()]
    tokens = sum(len(m.tokens) for p in plan.layers for m in (p.qkv, p.o, p.gate_up, p.down))
    assert (tokens > 0) == (int8 and intdot.available(int(QT.Q4_0)))  # the several-token kernels ran


@pytest.mark.parametrize("spec", [((1, 2), (256, 512), (0, 320)), ((0, 0), (0, 96), (320, 640)),
                                  ((0, 2), (0, 0), (0, 0))], ids=["half", "no-attention", "no-ffn"])
def test_a_shards_slice_rows_equal_each_sequence_alone(mixed_path, spec, int8):
    _check_steps(gguf.open_model(mixed_path), llama.ShardSpec(*spec), sizes=(3, 8), steps=1)


@pytest.mark.parametrize("model", ["stories", "mixed"])
def test_rows_of_one_sequence_at_consecutive_positions_get_the_bits_of_one_step_each(
        stories_path, mixed_path, model, int8, kv_type):
    """A replay (batch.Scheduler._replay) feeds an answer's tokens STEP_ROWS at a time: each row
    must be what its own decode step computed, the later rows seeing the earlier rows' keys."""
    if kv_type == "q8_0" and model == "stories":
        pytest.skip("stories260K's head size (8) cannot hold q8_0 (refused, as llama.cpp does); the mixed model runs it")
    mf = gguf.open_model(stories_path if model == "stories" else mixed_path)
    shard = _filled(mf, kv_type=kv_type)
    n = llama.STEP_ROWS - 3  # 13 rows of slot 1, one each of slots 4, 0 and 6 around them
    slots = np.array([4] + [1] * n + [0, 6])
    positions = np.array([len(PROMPTS[4]) + 1, *range(len(PROMPTS[1]) + 1, len(PROMPTS[1]) + 1 + n),
                          len(PROMPTS[0]) + 1, len(PROMPTS[6]) + 1])
    x = llama.embed(mf, [int(t) for t in np.random.default_rng(3).integers(0, shard.w.cfg.vocab, len(slots))])
    want_h, want_l, ref = _alone(shard, mf, x, slots, positions)  # one row after another
    h = shard.forward_rows(x.copy(), slots, positions)
    assert np.array_equal(_bits(h), _bits(want_h))
    for i in range(shard.w.cfg.n_layers):
        assert np.array_equal(_bits(shard.k_cache[i]), _bits(ref.k_cache[i])), f"layer {i} keys differ"
        assert np.array_equal(_bits(shard.v_cache[i]), _bits(ref.v_cache[i])), f"layer {i} values differ"
    assert np.array_equal(_bits(shard.logits_rows(h)), _bits(want_l))


def test_smollm2_rows_equal_each_sequence_alone(smollm2_path):
    _check_steps(gguf.open_model(smollm2_path), sizes=(1, 5), steps=1)


def test_slot_zero_is_the_one_cache_forward_always_used(stories_path):
    # forward without a slot is today's single-sequence call: slot 0, others untouched
    mf = gguf.open_model(stories_path)
    one = llama.Shard(llama.load_weights(mf), ctx=16)
    many = llama.Shard(llama.load_weights(mf), ctx=16, slots=3)
    assert many.kv_bytes == 3 * one.kv_bytes
    a = one.forward(llama.embed(mf, [5, 6, 7]), 0)
    b = many.forward(llama.embed(mf, [5, 6, 7]), 0)
    assert np.array_equal(_bits(a), _bits(b))
    assert all(np.array_equal(c[0], d[0]) and not d[1:].any() for c, d in zip(one.k_cache, many.k_cache))


def test_bad_steps_are_refused_with_one_clear_error(stories_path):
    mf = gguf.open_model(stories_path)
    shard = llama.Shard(llama.load_weights(mf), ctx=8, slots=3)
    x = llama.embed(mf, [1, 2])
    with pytest.raises(ValueError, match="distinct"):
        shard.forward_rows(x.copy(), [1, 1], [0, 0])
    with pytest.raises(ValueError, match="each be 0 to 2"):
        shard.forward_rows(x.copy(), [0, 3], [0, 0])
    with pytest.raises(ValueError, match="one slot and position each"):
        shard.forward_rows(llama.embed(mf, [1] * 17), [0] * 17, list(range(17)))  # STEP_ROWS is 16
    with pytest.raises(ValueError, match="one slot and position each"):
        shard.forward_rows(x.copy(), [0], [0, 0])
    with pytest.raises(llama.ContextFull):
        shard.forward_rows(x.copy(), [0, 1], [0, 8])
    with pytest.raises(ValueError, match="slot 3 does not exist"):
        shard.forward(x[:1].copy(), 0, slot=3)
    with pytest.raises(ValueError, match="at least one KV slot"):
        llama.Shard(llama.load_weights(mf), ctx=8, slots=0)


# ---------------------------------------------------------------- the several-token kernels


def _inputs(qt, rows, nb, B, seed):
    rng = np.random.default_rng(seed)
    w = intdot.random_blocks(qt, rows, nb, rng)
    x = rng.standard_normal((B, nb * LAYOUTS[qt].values)).astype(np.float32)
    x[B // 2, : 32] = 0.0  # an all-zero block of one token
    return w, x


@pytest.mark.parametrize("qt", TYPES, ids=IDS)
def test_several_token_kernel_is_each_tokens_canonical_bits(qt):
    assert intdot.available(qt), "the probe failed on this CPU"
    for i, (rows, nb, B) in enumerate([(1, 1, 2), (4 * SPREAD + 7, 3, 5), (130, 2, 8), (17, 1, 1), (65, 2, 3)]):
        w, x = _inputs(qt, rows, nb, B, 30 + i)
        xr = intdot.rounded_rows(x)
        for serial in (True, False):
            out = np.full((B, rows), np.nan, np.float32)
            intdot.matvec_tokens(qt, w, xr, out, serial)
            for b in range(B):
                one = np.full(rows, np.nan, np.float32)
                intdot.matvec(qt, w, intdot.rounded(x[b]), one, serial)
                want = intdot.reference(qt, w, intdot.rounded(x[b]))
                assert np.array_equal(_bits(out[b]), _bits(want)), f"{rows}x{nb} B={B} token {b}"
                assert np.array_equal(_bits(out[b]), _bits(one))


def test_token_products_run_several_weights_and_any_count_up_to_their_rows():
    qt = int(QT.Q4_K)
    rng = np.random.default_rng(5)
    ws = [intdot.random_blocks(qt, r, 2, rng) for r in (70, 9, 64)]
    x = rng.standard_normal((6, 512)).astype(np.float32)
    xr = intdot.rounded_rows(x)
    out = np.full((6, 200), np.nan, np.float32)
    p = intdot.TokenProducts(qt, ws, xr, out, [0, 70, 100])
    p(4, False)
    for b in range(4):
        for w, a in zip(ws, [0, 70, 100]):
            want = intdot.reference(qt, w, intdot.rounded(x[b]))
            assert np.array_equal(_bits(out[b, a : a + w.shape[0]]), _bits(want))
    assert np.isnan(out[4:]).all() and np.isnan(out[:4, 79:100]).all()  # nothing else written
    with pytest.raises(ValueError, match="1 to 6"):
        p(7, False)


def test_float_weights_take_the_float_kernel_row_by_row(monkeypatch):
    rng = np.random.default_rng(9)
    data = rng.standard_normal((40, 96)).astype(np.float32)
    w = quant.Weight(int(QT.F32), 40, 96, data.view(np.uint8))
    x = rng.standard_normal((3, 96)).astype(np.float32)
    out = np.empty((3, 40), np.float32)
    decode.matvec_rows(w, x, out)
    for b in range(3):
        one = np.empty(40, np.float32)
        quant.matvec(w, x[b], one)
        assert np.array_equal(_bits(out[b]), _bits(one))
    assert np.allclose(out, x @ data.T, rtol=1e-5, atol=1e-5)


CHILD = """
import sys
import numpy as np
from edgetp.model import intdot, isa
inp = np.load(sys.argv[2])
res = {}
for k in inp.files:
    if k.startswith("w"):
        qt = int(k[1:])
        w, x = inp[k], inp["x" + k[1:]]
        out = np.empty((x.shape[0], w.shape[0]), np.float32)
        intdot.matvec_tokens(qt, w, intdot.rounded_rows(x), out)
        res["o" + k[1:]] = out
np.savez(sys.argv[1] + "/out.npz", isa=np.array(isa.current()), **res)
"""


@pytest.fixture(scope="module")
def other_isas(tmp_path_factory):
    """(inputs, {isa: outputs}): a child for each other ISA this CPU runs, as a user forces it, side by side."""
    base = tmp_path_factory.mktemp("other_isas")
    arrays = {}
    for i, qt in enumerate(TYPES):
        w, x = _inputs(qt, 4 * SPREAD + 5, 2, 5, 60 + i)
        arrays[f"w{int(qt)}"], arrays[f"x{int(qt)}"] = w, x
    np.savez(base / "in.npz", **arrays)
    names = [n for n in RUNNABLE if n != isa.current()]
    for name in names:
        (base / name).mkdir()
    run_each([([sys.executable, "-c", CHILD, str(base / name), str(base / "in.npz")], child_env(name))
              for name in names], CHILD_TIMEOUT)
    return arrays, {name: np.load(base / name / "out.npz") for name in names}


@pytest.mark.parametrize("name", [n for n in isa.ISAS if n != isa.current()])
def test_several_token_kernel_on_every_other_isa_gives_the_same_bits(name, other_isas):
    # the ISA in use runs in this process (above); each other one this CPU runs, in a child as a user forces it
    skip_unless_runnable(name)
    arrays, outputs = other_isas
    got = outputs[name]
    assert str(got["isa"]) == name
    for qt in TYPES:
        w, x = arrays[f"w{int(qt)}"], arrays[f"x{int(qt)}"]
        for b in range(x.shape[0]):
            want = intdot.reference(qt, w, intdot.rounded(x[b]))
            assert np.array_equal(_bits(got[f"o{int(qt)}"][b]), _bits(want)), f"{LAYOUTS[qt].qtype.name} token {b}"


STEPS_CHILD = """
import sys
sys.path.insert(0, sys.argv[1])
import test_batch_rows as t
from edgetp.model import gguf, isa
assert isa.current() == "generic", isa.current()
for kv_type in ("f16", "q8_0"):
    t._check_steps(gguf.open_model(sys.argv[2]), sizes=(2, 5), steps=1, kv_type=kv_type)
print("rows equal alone")
import test_kv_type
test_kv_type.test_the_q8_0_writer_is_gguf_pys_quantizer_bit_for_bit()  # f16 scales in integer code here
print("q8_0 blocks are gguf-py's")
"""


def test_rows_equal_each_sequence_alone_on_the_generic_isa(mixed_path):
    # with an f16 and a q8_0 cache: the f16 conversions are integer code on this ISA
    env = child_env("generic", EDGETP_INT8="1")
    res = subprocess.run([sys.executable, "-c", STEPS_CHILD, str(REPO / "tests"), str(mixed_path)], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=child_timeout(1800))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "rows equal alone" in res.stdout and "q8_0 blocks are gguf-py's" in res.stdout
