"""tools/synth_gguf.py and tools/requant_gguf.py, checked against independent readers.

References: gguf-py's GGUFReader and gguf.quants.dequantize (not the code that
wrote the blocks), and llama.cpp through the `llama_cpp` fixture (skips loudly
when llama-cpp-python is missing).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gguf
from gguf import GGMLQuantizationType as QT

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

import requant_gguf  # noqa: E402
import synth_gguf  # noqa: E402

# weight type -> (preset that suits it, expected ggml type)
TYPE_CASES = {
    "f32": ("tiny-odd", QT.F32),
    "f16": ("tiny-odd", QT.F16),
    "bf16": ("tiny-odd", QT.BF16),
    "q8_0": ("tiny-odd", QT.Q8_0),
    "q4_0": ("tiny-odd", QT.Q4_0),
    "q4_1": ("tiny-odd", QT.Q4_1),
    "q5_0": ("tiny-odd", QT.Q5_0),
    "q5_1": ("tiny-odd", QT.Q5_1),
    "iq4_nl": ("tiny-odd", QT.IQ4_NL),
    "q2_k": ("tiny-k", QT.Q2_K),
    "q3_k": ("tiny-k", QT.Q3_K),
    "q4_k": ("tiny-k", QT.Q4_K),
    "q5_k": ("tiny-k", QT.Q5_K),
    "q6_k": ("tiny-k", QT.Q6_K),
    "iq4_xs": ("tiny-k", QT.IQ4_XS),
}
# llama.cpp's llama_ftype codes (LLAMA_FTYPE_MOSTLY_*; Q3_K and Q5_K files are the "_S" kinds)
FILE_TYPES = {"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7, "q4_0": 2, "q4_1": 3, "q5_0": 8, "q5_1": 9,
              "iq4_nl": 25, "q2_k": 10, "q3_k": 11, "q4_k": 14, "q5_k": 16, "q6_k": 18, "iq4_xs": 30}


def _fields(reader: gguf.GGUFReader) -> dict:
    return {f.name: f.contents() for f in reader.fields.values() if not f.name.startswith("GGUF.")}


def _dequant(t) -> np.ndarray:
    """Dequantize a reader tensor with gguf-py to float32 (rows, cols)."""
    if t.tensor_type == QT.F32:
        return np.asarray(t.data, dtype=np.float32)
    if t.tensor_type == QT.F16:
        return np.asarray(t.data).astype(np.float32)
    return gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)


@pytest.fixture(scope="module")
def synth_models(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("synth")
    paths = {}
    for wtype, (preset, _) in TYPE_CASES.items():
        paths[wtype] = synth_gguf.write_preset(out / f"{preset}-{wtype}.gguf", preset, weight_type=wtype, seed=1)
    return paths


# ---------------------------------------------------------------------------
# synth_gguf: read back with gguf-py
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("wtype", list(TYPE_CASES))
def test_synth_reads_back_with_requested_shapes_and_types(synth_models, wtype):
    preset, qtype = TYPE_CASES[wtype]
    p = synth_gguf.PRESETS[preset]
    dim, ffn, vocab, n_layers = p["dim"], p["ffn"], p["vocab"], p["n_layers"]
    hd = p.get("head_dim") or dim // p["n_heads"]
    q_out, kv_out = p["n_heads"] * hd, p["n_kv_heads"] * hd

    reader = gguf.GGUFReader(synth_models[wtype])
    kv = _fields(reader)
    assert kv["general.architecture"] == "llama"
    assert kv["llama.embedding_length"] == dim
    assert kv["llama.block_count"] == n_layers
    assert kv["llama.feed_forward_length"] == ffn
    assert kv["llama.attention.head_count"] == p["n_heads"]
    assert kv["llama.attention.head_count_kv"] == p["n_kv_heads"]
    assert kv["llama.rope.dimension_count"] == hd
    assert kv["llama.context_length"] == p["ctx"]
    assert kv["llama.vocab_size"] == vocab
    assert kv["general.file_type"] == FILE_TYPES[wtype]
    assert kv["llama.rope.freq_base"] == pytest.approx(p["rope_theta"])
    assert kv["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    if hd * p["n_heads"] != dim:
        assert kv["llama.attention.key_length"] == hd
        assert kv["llama.attention.value_length"] == hd
    else:
        assert "llama.attention.key_length" not in kv

    expected = {"token_embd.weight": (dim, vocab), "output_norm.weight": (dim,)}
    if not p["tied"]:
        expected["output.weight"] = (dim, vocab)
    for i in range(n_layers):
        b = f"blk.{i}."
        expected.update({
            b + "attn_norm.weight": (dim,), b + "ffn_norm.weight": (dim,),
            b + "attn_q.weight": (dim, q_out), b + "attn_k.weight": (dim, kv_out),
            b + "attn_v.weight": (dim, kv_out), b + "attn_output.weight": (q_out, dim),
            b + "ffn_gate.weight": (dim, ffn), b + "ffn_up.weight": (dim, ffn),
            b + "ffn_down.weight": (ffn, dim),
        })
    got = {t.name: tuple(int(x) for x in t.shape) for t in reader.tensors}
    assert got == expected  # ggml order: ne[0] = input width

    for t in reader.tensors:
        if len(t.shape) == 1:
            assert t.tensor_type == QT.F32
            w = np.asarray(t.data)
            assert np.all(np.isfinite(w)) and abs(float(w.mean()) - 1.0) < 0.05
            continue
        assert t.tensor_type == qtype, t.name
        w = _dequant(t)
        cols, rows = (int(x) for x in t.shape)
        assert w.reshape(-1).size == rows * cols
        w = w.reshape(rows, cols).astype(np.float64)
        assert np.all(np.isfinite(w)), t.name
        std = 1.0 / np.sqrt(cols)  # fan_in = input width (embeddings: 1/sqrt(dim))
        rms = float(np.sqrt(np.mean(w ** 2)))
        assert 0.8 * std < rms < 1.25 * std, (t.name, rms, std)
        assert abs(float(w.mean())) < 0.1 * std, (t.name, float(w.mean()), std)
        # not degenerate: rows differ from one another
        assert np.unique(w[:4].round(6), axis=0).shape[0] == min(4, rows)


def test_synth_spm_vocab(synth_models):
    reader = gguf.GGUFReader(synth_models["q8_0"])
    kv = _fields(reader)
    tokens = kv["tokenizer.ggml.tokens"]
    types = kv["tokenizer.ggml.token_type"]
    scores = kv["tokenizer.ggml.scores"]
    vocab = synth_gguf.PRESETS["tiny-odd"]["vocab"]
    assert kv["tokenizer.ggml.model"] == "llama"
    assert len(tokens) == len(types) == len(scores) == vocab
    assert len(set(tokens)) == vocab
    assert tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert tokens[3:259] == [f"<0x{i:02X}>" for i in range(256)]
    assert types[3:259] == [6] * 256 and types[:3] == [2, 3, 3] and set(types[259:]) == {1}
    assert "▁the" in tokens and "▁" in tokens
    assert kv["tokenizer.ggml.bos_token_id"] == 1 and kv["tokenizer.ggml.eos_token_id"] == 2
    assert kv["tokenizer.ggml.add_bos_token"] is True


def test_synth_big_vocab_is_exact_and_unique():
    tokens, scores, types = synth_gguf.spm_vocab(128256)
    assert len(tokens) == len(scores) == len(types) == 128256
    assert len(set(tokens)) == 128256


def test_synth_rejects_unquantizable_shapes(tmp_path):
    with pytest.raises(ValueError, match="multiple of 256"):
        synth_gguf.write_preset(tmp_path / "x.gguf", "tiny-odd", weight_type="q4_k")
    with pytest.raises(ValueError, match="multiple of 32"):
        synth_gguf.write_model(tmp_path / "y.gguf", dim=80, n_layers=1, n_heads=5, n_kv_heads=5, ffn=128,
                               vocab=400, weight_type="q8_0")
    with pytest.raises(ValueError, match="n_kv_heads"):
        synth_gguf.write_model(tmp_path / "z.gguf", dim=96, n_layers=1, n_heads=6, n_kv_heads=4, ffn=128,
                               vocab=400)
    with pytest.raises(ValueError, match="attn_temp_scale: mistral3's keys, not qwen3's"):  # llama.cpp reads them not
        synth_gguf.write_preset(tmp_path / "w.gguf", "tiny-headdim", arch="qwen3", attn_temp_scale=0.1)
    assert list(tmp_path.iterdir()) == []  # nothing, not even a .part, is left behind


def test_synth_mixed_types_tied_and_deterministic(tmp_path):
    kw = dict(dim=256, n_layers=1, n_heads=4, n_kv_heads=1, ffn=256, vocab=400, weight_type="q4_k",
              embd_type="q8_0", output_type="q6_k")
    a = synth_gguf.write_model(tmp_path / "a.gguf", seed=3, **kw)
    b = synth_gguf.write_model(tmp_path / "b.gguf", seed=3, **kw)
    c = synth_gguf.write_model(tmp_path / "c.gguf", seed=4, **kw)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(a).tensors}
    assert types["token_embd.weight"] == QT.Q8_0
    assert types["output.weight"] == QT.Q6_K
    assert types["blk.0.ffn_down.weight"] == QT.Q4_K
    assert not list(tmp_path.glob("*.part"))
    t = synth_gguf.write_model(tmp_path / "t.gguf", tied=True, **kw)
    assert "output.weight" not in {x.name for x in gguf.GGUFReader(t).tensors}


def test_q4_k_scale_packing_matches_gguf_unpacking():
    rng = np.random.default_rng(0)
    sc = rng.integers(0, 64, (50, 8), dtype=np.uint8)
    mn = rng.integers(0, 64, (50, 8), dtype=np.uint8)
    got_sc, got_mn = gguf.quants.Q4_K.get_scale_min(synth_gguf.pack_q4_k_scales(sc, mn))
    np.testing.assert_array_equal(got_sc, sc)
    np.testing.assert_array_equal(got_mn, mn)


def test_synth_cli(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "tools" / "synth_gguf.py"), "--help"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--preset" in r.stdout
    out = tmp_path / "cli.gguf"
    assert synth_gguf.main([str(out), "--preset", "tiny-odd", "--type", "q4_0", "--layers", "1", "-q"]) == 0
    kv = _fields(gguf.GGUFReader(out))
    assert kv["llama.block_count"] == 1 and kv["general.file_type"] == 2
    assert synth_gguf.main([str(tmp_path / "bad.gguf"), "--preset", "tiny-odd", "--type", "q6_k", "-q"]) == 2
    r = subprocess.run([sys.executable, str(REPO / "tools" / "requant_gguf.py"), "--help"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--type" in r.stdout


def test_synth_per_tensor_types_follow_the_longest_matching_name(tmp_path):
    out = tmp_path / "mix.gguf"
    assert synth_gguf.main([str(out), "--preset", "tiny-k", "--layers", "2", "--type", "q4_0", "-q",
                            "--tensor-type", "attn_v=q8_0", "--tensor-type", "blk.1.attn_v=f16",
                            "--tensor-type", "output.weight=q6_k"]) == 0
    types = {t.name: QT(t.tensor_type) for t in gguf.GGUFReader(out).tensors}  # gguf-py reads it back
    assert types["blk.0.attn_v.weight"] == QT.Q8_0 and types["blk.1.attn_v.weight"] == QT.F16
    assert types["output.weight"] == QT.Q6_K and types["blk.0.attn_output.weight"] == QT.Q4_0
    assert types["blk.1.attn_norm.weight"] == QT.F32
    with pytest.raises(SystemExit) as exc:  # argparse's one-line usage error
        synth_gguf.main([str(tmp_path / "bad.gguf"), "--preset", "tiny-k", "--tensor-type", "attn_v"])
    assert exc.value.code == 2
    assert synth_gguf.main([str(tmp_path / "bad.gguf"), "--preset", "tiny-k", "--tensor-type", "attn_v=q9"]) == 2
    assert not (tmp_path / "bad.gguf").exists()


# ---------------------------------------------------------------------------
# synth_gguf: llama.cpp loads it
# ---------------------------------------------------------------------------

def _llama_logits(llama_cpp, path: Path, ids: list[int]) -> np.ndarray:
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=2)
    try:
        llm.eval(ids)
        return np.array(llm.scores[: llm.n_tokens], dtype=np.float32)
    finally:
        llm.close()


@pytest.mark.llamacpp
@pytest.mark.parametrize("wtype", list(TYPE_CASES))
def test_llama_cpp_loads_synthetic_model(llama_cpp, synth_models, wtype):
    preset = TYPE_CASES[wtype][0]
    vocab = synth_gguf.PRESETS[preset]["vocab"]
    ids = [1, 300, 301, 450, 17, 302]
    logits = _llama_logits(llama_cpp, synth_models[wtype], ids)
    assert logits.shape == (len(ids), vocab)
    assert np.all(np.isfinite(logits))
    std = logits.std(axis=1)
    assert np.all(std > 0.05) and np.all(std < 50), std
    # different positions give different predictions
    assert len({int(i) for i in logits.argmax(axis=1)}) > 1


@pytest.mark.llamacpp
@pytest.mark.parametrize("wtype", ["f32", "q8_0", "q4_k", "iq4_xs"])
@pytest.mark.parametrize("arch", [a for a in synth_gguf.ARCHS if a != "llama"])
def test_every_architecture_the_writer_knows_holds_its_own_tensors_and_loads_in_llama_cpp(
        llama_cpp, tmp_path, arch, wtype):
    preset = TYPE_CASES[wtype][0]
    # phi3, qwen2moe: heads * head_dim = dim
    head_dim = None if arch in synth_gguf.FUSED + synth_gguf.SQUARE else 32 if preset == "tiny-odd" else 128
    moe = dict(n_experts=4, n_experts_used=2) if arch in synth_gguf.MOE_ARCHS else {}
    path = synth_gguf.write_preset(tmp_path / f"{arch}-{wtype}.gguf", preset, weight_type=wtype, arch=arch,
                                   head_dim=head_dim, **moe)
    reader = gguf.GGUFReader(path)
    file_arch = synth_gguf.FILE_ARCH.get(arch, arch)  # mixtral is written as llama with experts
    assert _fields(reader)["general.architecture"] == file_arch
    # every tensor is one gguf-py lists for this architecture (its MODEL_TENSORS table)
    known = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[next(k for k, v in gguf.MODEL_ARCH_NAMES.items()
                                                                    if v == file_arch)]}
    names = {t.name.removesuffix(".weight").removesuffix(".bias") for t in reader.tensors}
    assert {n if not n.startswith("blk.") else "blk.{bid}." + n.split(".", 2)[2] for n in names} <= known
    ids = [1, 300, 301, 450, 17, 302]
    logits = _llama_logits(llama_cpp, path, ids)
    assert logits.shape == (len(ids), synth_gguf.PRESETS[preset]["vocab"]) and np.all(np.isfinite(logits))


@pytest.mark.llamacpp
def test_llama_cpp_tokenizes_and_decodes_synthetic_vocab(llama_cpp, synth_models):
    llm = llama_cpp.Llama(model_path=str(synth_models["q8_0"]), n_ctx=64, verbose=False, n_threads=2)
    try:
        ids = llm.tokenize(b"the cat sat")
        assert ids[0] == 1 and len(ids) > 2
        assert llm.detokenize(ids[1:]).strip() == b"the cat sat"
        out = []
        for tok in llm.generate(ids, temp=0.0, top_k=1):
            out.append(tok)
            if len(out) == 12:
                break
        assert all(0 <= t < synth_gguf.PRESETS["tiny-odd"]["vocab"] for t in out)
    finally:
        llm.close()


# ---------------------------------------------------------------------------
# requant_gguf
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_q8(smollm2_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("requant") / "smollm2-q8_0.gguf"
    report = requant_gguf.requant(smollm2_path, out, "q8_0")
    # parsing SmolLM2's 49k-token / 49k-merge arrays takes seconds: read each file once
    return smollm2_path, out, report, gguf.GGUFReader(smollm2_path), gguf.GGUFReader(out)


def _q8_0_error_bound(orig_blocks: np.ndarray, new_blocks: np.ndarray) -> np.ndarray:
    """Per-block bound on |x - dequant(quant_q8_0(x))|.

    quantize: d = amax/127 (f32), q = round(x/d) so |x - q d| <= d/2; the
    stored scale is d16 = f16(d), and |q| <= 127, hence
    |x - q d16| <= d/2 + 127 |d - d16|; plus a few f32 ulps for x * (1/d).
    """
    d = np.abs(orig_blocks).max(axis=1) / np.float32(127)
    d16 = new_blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(-1)
    return 0.5 * d + 127 * np.abs(d - d16) + 1e-6 * np.abs(orig_blocks).max(axis=1)


def test_requant_smollm2_q8_0_error_within_bound(smollm2_q8):
    src, dst, report, r0, r1 = smollm2_q8
    t0 = {t.name: t for t in r0.tensors}
    t1 = {t.name: t for t in r1.tensors}
    assert list(t0) == list(t1)
    assert len(report.requantized) == 210 and not report.skipped
    n_checked = 0
    for name, a in t0.items():
        b = t1[name]
        assert [int(x) for x in a.shape] == [int(x) for x in b.shape], name
        if a.tensor_type == QT.Q4_1 and len(a.shape) == 2:
            assert b.tensor_type == QT.Q8_0, name
            x = gguf.quants.dequantize(np.asarray(a.data), QT.Q4_1).reshape(-1, 32)
            y = gguf.quants.dequantize(np.asarray(b.data), QT.Q8_0).reshape(-1, 32)
            bound = _q8_0_error_bound(x, np.asarray(b.data).reshape(-1, 34))
            err = np.abs(x - y).max(axis=1)
            assert np.all(err <= bound), (name, float((err - bound).max()))
            n_checked += 1
        else:
            # F32 norms and the Q8_0 token_embd are copied byte for byte
            assert b.tensor_type == a.tensor_type, name
            assert np.array_equal(np.asarray(a.data), np.asarray(b.data)), name
    assert n_checked == 210
    assert t1["token_embd.weight"].tensor_type == QT.Q8_0


def test_requant_smollm2_metadata_identical(smollm2_q8):
    src, dst, _, r0, r1 = smollm2_q8
    k0 = [f.name for f in r0.fields.values() if not f.name.startswith("GGUF.")]
    k1 = [f.name for f in r1.fields.values() if not f.name.startswith("GGUF.")]
    assert sorted(k0) == sorted(k1)
    for key in k0:
        f0, f1 = r0.fields[key], r1.fields[key]
        assert f0.types == f1.types, key
        if key == "general.file_type":
            assert f0.contents() == 3 and f1.contents() == 7
            continue
        assert f0.contents() == f1.contents(), key
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):  # byte-exact strings
        f0, f1 = r0.fields[key], r1.fields[key]
        assert [bytes(f0.parts[i]) for i in f0.data] == [bytes(f1.parts[i]) for i in f1.data]
    assert len(r1.fields["tokenizer.ggml.tokens"].data) == 49152
    assert len(r1.fields["tokenizer.ggml.merges"].data) == 48900
    assert "im_start" in r1.fields["tokenizer.chat_template"].contents()
    assert not list(dst.parent.glob("*.part"))


@pytest.mark.llamacpp
def test_requant_smollm2_llama_cpp_agrees(llama_cpp, smollm2_q8):
    src, dst, *_ = smollm2_q8
    ids = [1, 4093, 314, 260, 3575, 282, 4649, 47, 2]  # arbitrary in-vocab ids
    a = _llama_logits(llama_cpp, src, ids)
    b = _llama_logits(llama_cpp, dst, ids)
    assert np.all(np.isfinite(b))
    # Q8_0 of the Q4_1 weights is a tiny perturbation: same top token almost everywhere
    assert np.mean(a.argmax(axis=1) == b.argmax(axis=1)) >= 0.75
    assert np.abs(a - b).max() < 0.1 * np.abs(a).max()


def test_requant_q4_0_synthetic_with_all(tmp_path, synth_models):
    src = synth_models["q4_1"]
    dst = tmp_path / "q4_0.gguf"
    rep = requant_gguf.requant(src, dst, "q4_0", all_tensors=True)
    r0, r1 = gguf.GGUFReader(src), gguf.GGUFReader(dst)
    assert _fields(r1)["general.file_type"] == 2
    assert "token_embd.weight" in rep.requantized
    for a, b in zip(r0.tensors, r1.tensors):
        assert a.name == b.name
        if len(a.shape) == 1:
            assert b.tensor_type == QT.F32
            continue
        assert b.tensor_type == QT.Q4_0, a.name
        x = gguf.quants.dequantize(np.asarray(a.data), QT.Q4_1).reshape(-1, 32)
        y = gguf.quants.dequantize(np.asarray(b.data), QT.Q4_0).reshape(-1, 32)
        # Q4_0: d = -max/8 with max the signed value of largest magnitude; values
        # (q - 8) d with q in 0..15, so the far end may clip by up to one step:
        # |err| <= |d| + 8 |d - d16|.
        d = np.abs(x).max(axis=1) / 8
        d16 = np.abs(np.asarray(b.data).reshape(-1, 18)[:, :2].copy().view(np.float16).astype(np.float32)[:, 0])
        bound = d + 8 * np.abs(d - d16) + 1e-6 * d
        assert np.all(np.abs(x - y).max(axis=1) <= bound), a.name


def test_requant_keeps_float_weights_unless_asked(tmp_path, synth_models):
    src = synth_models["f16"]
    rep = requant_gguf.requant(src, tmp_path / "same.gguf", "q8_0")
    assert rep.requantized == []
    rep = requant_gguf.requant(src, tmp_path / "q8.gguf", "q8_0", include_float=True)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(tmp_path / "q8.gguf").tensors}
    assert types["blk.0.ffn_up.weight"] == QT.Q8_0 and types["token_embd.weight"] == QT.F16
    assert types["output_norm.weight"] == QT.F32
