"""Shard files: one node's slices as a GGUF of their own (edgetp/parallel/shardfile.py).

The reference for every byte is the source file read by gguf-py, cut by the
slicing rule of DESIGN.md written out again below (`expected_cut`), not by
the code under test; column slices that split a quant block are compared
with gguf-py's own dequantizer. Models: SmolLM2-135M (Q4_1, a Q8_0 tied
embedding) and the synthetic tiny-odd (Q8_0, untied, 3 KV heads, FFN of 7
blocks).

Size bound: a shard file is its header (the source's metadata plus five
edgetp.shard keys and a shorter tensor table) and the kept bytes of every
tensor, each padded to the file's alignment. So
    kept <= size - header <= kept + alignment * n_tensors
    header <= source header + 1 KiB
and size / source size is the kept share of the weight bytes up to those
few KiB.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT
from gguf.quants import dequantize

from edgetp.model import gguf, llama
from edgetp.parallel.shardfile import shard_name, write_shard

TINY_SPECS = [
    llama.ShardSpec((0, 1), (0, 96), (0, 200)),      # block-aligned everywhere
    llama.ShardSpec((1, 3), (96, 224), (200, 600)),  # the rest of the model
    llama.ShardSpec((2, 3), (40, 100), (599, 600)),  # FFN range splits Q8_0 blocks: ffn_down as f32
    llama.ShardSpec((0, 0), (0, 224), (0, 0)),       # no attention, no vocabulary
    llama.ShardSpec((0, 3), (0, 224), (0, 600)),     # everything
]
SMOL_SPECS = [
    llama.ShardSpec((0, 1), (0, 512), (0, 16384)),
    llama.ShardSpec((1, 3), (512, 1536), (16384, 49152)),
    llama.ShardSpec((0, 0), (1000, 1100), (0, 0)),   # FFN range splits Q4_1 blocks
]
CASES = [("tiny", s) for s in TINY_SPECS] + [("smol", s) for s in SMOL_SPECS]


@pytest.fixture(scope="module")
def sources(synth_model, smollm2_path):
    return {"tiny": gguf.ModelFile(synth_model("tiny-odd", "q8_0")), "smol": gguf.ModelFile(smollm2_path)}


@pytest.fixture(scope="module")
def shard_files(sources, tmp_path_factory):
    """(model, spec) -> (source ModelFile, shard ModelFile), each written once."""
    out = tmp_path_factory.mktemp("shards")
    made = {}

    def get(model: str, spec: llama.ShardSpec):
        if (model, spec) not in made:
            mf = sources[model]
            path = write_shard(mf, spec, out / shard_name(mf.fingerprint, spec))
            made[model, spec] = (mf, gguf.ModelFile(path))
        return made[model, spec]

    return get


def expected_cut(name: str, cfg: gguf.ModelConfig, spec: llama.ShardSpec) -> tuple[str, tuple[int, int]]:
    """DESIGN.md's rule: q/k/v/gate/up and the lm head by output rows, o/down by input columns."""
    hd, g = cfg.head_dim, cfg.group_size
    kv = (spec.kv_groups[0] * hd, spec.kv_groups[1] * hd)
    q = (kv[0] * g, kv[1] * g)
    suffix = name.split(".", 2)[2] if name.startswith("blk.") else name
    return {
        "attn_q.weight": ("rows", q), "attn_q.bias": ("rows", q),
        "attn_k.weight": ("rows", kv), "attn_v.weight": ("rows", kv),
        "attn_k.bias": ("rows", kv), "attn_v.bias": ("rows", kv),
        "attn_output.weight": ("cols", q),
        "ffn_gate.weight": ("rows", spec.ffn_cols), "ffn_up.weight": ("rows", spec.ffn_cols),
        "ffn_down.weight": ("cols", spec.ffn_cols),
        "output.weight": ("rows", spec.vocab_rows),
        "token_embd.weight": ("rows", spec.vocab_rows if cfg.tied else (0, 0)),
    }.get(suffix, ("whole", (0, 0)))


def raw(t) -> np.ndarray:
    """A tensor's bytes as (rows, row bytes) (1-D tensors: one row)."""
    data = np.asarray(t.data).view(np.uint8)
    rows = int(np.prod([int(s) for s in t.shape[1:]])) if len(t.shape) > 1 else 1
    return data.reshape(rows, data.size // rows if rows else 0)


@pytest.mark.parametrize("model,spec", CASES)
def test_every_stored_tensor_is_the_exact_slice_of_the_source(shard_files, model, spec):
    mf, sf = shard_files(model, spec)
    assert list(sf.tensors) == list(mf.tensors)
    for name, src in mf.tensors.items():
        got = sf.tensors[name]
        how, (a, b) = expected_cut(name, mf.config, spec)
        src_bytes = raw(src)
        if how == "whole":
            assert got.tensor_type == src.tensor_type and np.array_equal(raw(got), src_bytes), name
        elif len(src.shape) == 1:
            width = src_bytes.shape[1] // int(src.shape[0])
            assert got.tensor_type == src.tensor_type
            assert raw(got).tobytes() == src_bytes[0, a * width:b * width].tobytes(), name
        elif how == "rows":
            assert got.tensor_type == src.tensor_type and [int(s) for s in got.shape] == [int(src.shape[0]), b - a]
            assert raw(got).tobytes() == src_bytes[a:b].tobytes(), name
        else:
            block, size = GGML_QUANT_SIZES[src.tensor_type]
            assert [int(s) for s in got.shape] == [b - a, int(src.shape[1])], name
            if a % block == 0 and b % block == 0:
                assert got.tensor_type == src.tensor_type
                blocks = src_bytes.reshape(src_bytes.shape[0], -1, size)[:, a // block:b // block]
                assert raw(got).tobytes() == blocks.tobytes(), name
            else:  # the exact f32 values gguf-py dequantizes
                assert got.tensor_type == QT.F32, name
                want = dequantize(np.asarray(src.data), src.tensor_type)[:, a:b]
                assert raw(got).tobytes() == np.ascontiguousarray(want, np.float32).tobytes(), name


@pytest.mark.parametrize("model,spec", CASES)
def test_load_weights_of_the_shard_file_equals_load_weights_of_the_full_file(shard_files, model, spec):
    mf, sf = shard_files(model, spec)
    full, part = llama.load_weights(mf, spec), llama.load_weights(sf, spec)
    assert part.cfg == full.cfg and part.spec == full.spec == spec
    mats = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
    vecs = ("attn_norm", "ffn_norm", "bq", "bk", "bv")
    pairs = [(getattr(x, m), getattr(y, m)) for x, y in zip(full.layers, part.layers) for m in mats]
    pairs.append((full.lm_head, part.lm_head))
    for w, v in pairs:
        assert (w is None) == (v is None)
        if w is not None:
            assert (w.qtype, w.rows, w.cols) == (v.qtype, v.rows, v.cols)
            assert w.data.tobytes() == v.data.tobytes()
    for x, y in zip(full.layers, part.layers):
        for name in vecs:
            a, b = getattr(x, name), getattr(y, name)
            assert (a is None and b is None) or np.array_equal(a, b)
    assert np.array_equal(full.out_norm, part.out_norm)


@pytest.mark.parametrize("model,spec", CASES)
def test_a_shard_built_from_the_shard_file_computes_bit_identical_outputs(shard_files, model, spec):
    mf, sf = shard_files(model, spec)
    ids = [1, 17, 42, 5]
    outs = []
    for source in (mf, sf):
        shard = llama.Shard(llama.load_weights(source, spec), ctx=8)
        h = shard.forward(llama.embed(mf, ids[:3]), 0)          # prefill (matmul path)
        h2 = shard.forward(llama.embed(mf, ids[3:]), 3)         # one decode step (matvec path)
        outs.append((h, shard.logits(h), h2, shard.logits(h2)))
    for a, b in zip(*outs):
        assert a.shape == b.shape and a.view(np.uint32).tobytes() == b.view(np.uint32).tobytes()


def _kept_bytes(mf: gguf.ModelFile, spec: llama.ShardSpec) -> tuple[int, int]:
    """(bytes of the slices the shard must hold, bytes of all the source's tensors), from the type sizes."""
    kept = total = 0
    for name, t in mf.tensors.items():
        block, size = GGML_QUANT_SIZES[t.tensor_type]
        n_values = int(np.prod([int(s) for s in t.shape]))
        total += n_values // block * size
        how, (a, b) = expected_cut(name, mf.config, spec)
        if how == "whole":
            kept += n_values // block * size
        elif len(t.shape) == 1 or how == "rows":
            kept += (b - a) * (int(t.shape[0]) if len(t.shape) > 1 else 1) // block * size
        elif a % block == 0 and b % block == 0:
            kept += int(t.shape[1]) * (b - a) // block * size
        else:
            kept += int(t.shape[1]) * (b - a) * 4  # f32
    return kept, total


@pytest.mark.parametrize("model,spec", CASES)
def test_a_shard_file_is_its_share_of_the_weight_bytes_plus_the_header(shard_files, model, spec):
    mf, sf = shard_files(model, spec)
    kept, total = _kept_bytes(mf, spec)
    size, header = sf.path.stat().st_size, int(sf.data_offset)
    alignment = int(sf.alignment)
    assert kept <= size - header <= kept + alignment * len(sf.tensors)
    assert header <= int(mf.data_offset) + 1024
    full = mf.path.stat().st_size
    slack = (int(mf.data_offset) + 1024 + alignment * len(sf.tensors)) / full
    assert abs(size / full - kept / total) <= slack + 1e-9


def test_splitting_smollm2_in_two_gives_two_files_of_about_half_the_weights(shard_files, sources):
    mf = sources["smol"]
    a, b = (shard_files("smol", s)[1].path.stat().st_size for s in SMOL_SPECS[:2])
    # the two specs cover every head, column and row once; only the replicated norms and the
    # metadata (1.8 MB of tokenizer) are in both
    replicated = int(mf.data_offset) + sum(int(t.n_bytes) for n, t in mf.tensors.items() if "norm" in n)
    assert mf.path.stat().st_size <= a + b <= mf.path.stat().st_size + replicated + 64 * 1024


@pytest.mark.parametrize("model", ["tiny", "smol"])
def test_the_shard_file_keeps_every_metadata_key_and_adds_the_shard_keys(shard_files, model):
    spec = TINY_SPECS[0] if model == "tiny" else SMOL_SPECS[0]
    mf, sf = shard_files(model, spec)
    theirs = sf.reader().fields  # gguf-py's own parse of both files, not our metadata tables
    for key, field in mf.reader().fields.items():
        if not key.startswith("GGUF."):
            assert theirs[key].contents() == field.contents(), key
            assert theirs[key].types == field.types, key  # the same value types, element types too
            assert [p.tobytes() for p in theirs[key].parts[3:]] == [p.tobytes() for p in field.parts[3:]], key
    meta = sf.metadata
    assert meta["edgetp.shard.kv_groups"] == list(spec.kv_groups)
    assert meta["edgetp.shard.ffn_cols"] == list(spec.ffn_cols)
    assert meta["edgetp.shard.vocab_rows"] == list(spec.vocab_rows)
    assert meta["edgetp.shard.source_fingerprint"] == mf.fingerprint
    assert meta["edgetp.shard.vocab"] == mf.config.vocab


def test_a_shard_write_from_an_indexed_open_parses_no_header(smollm2_path, tmp_path, monkeypatch):
    # a re-plan writes new slices for every node: each used to parse the source's header again
    # (3 s and +150 MB for Llama 3's vocabulary), though the open had read every value already
    gguf.open_model(smollm2_path, tmp_path / "index")  # the index written
    mf = gguf.open_model(smollm2_path, tmp_path / "index")  # and read back
    monkeypatch.setattr(gguf, "_Reader", lambda *a, **k: pytest.fail("the shard write parsed the header"))
    spec = SMOL_SPECS[0]
    path = write_shard(mf, spec, tmp_path / shard_name(mf.fingerprint, spec))
    monkeypatch.undo()
    sf = gguf.ModelFile(path)
    assert {k: v for k, v in sf.metadata.items() if not k.startswith(("GGUF.", "edgetp."))} == \
        {k: v for k, v in mf.metadata.items() if not k.startswith("GGUF.")}


def test_a_source_with_an_empty_array_key_still_gets_its_shards(stories_path, tmp_path):
    # the format allows an empty array (until 7 Dec its shard write was refused as a "nested array");
    # gguf-py's reader gives one no element type and its writer cannot write one, so a shard leaves
    # it out. The key is put in by hand, as GGUF v3 lays a key out: name (u64 length, bytes), ARRAY
    # (9), element type UINT32 (4), count 0; 32 bytes, the file's alignment, so every tensor's data
    # stays where its offset says.
    raw = stories_path.read_bytes()
    magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", raw)
    key = b"test.mty"
    entry = struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, 4, 0)
    assert len(entry) == 32 and version == 3
    model = tmp_path / "with-empty.gguf"
    model.write_bytes(struct.pack("<4sIQQ", magic, version, n_tensors, n_kv + 1) + entry + raw[24:])
    mf = gguf.open_model(model)
    assert mf.metadata["test.mty"] == [] and mf.value_types["test.mty"] == [9]  # as gguf-py reads it
    cfg = mf.config
    spec = llama.ShardSpec((0, cfg.n_kv_heads), (0, cfg.ffn), (0, cfg.vocab))
    sf = gguf.ModelFile(write_shard(mf, spec, tmp_path / shard_name(mf.fingerprint, spec)))
    assert "test.mty" not in sf.metadata and llama.stored_spec(sf) == spec


def test_a_shard_file_loads_only_the_spec_it_holds(shard_files):
    spec = TINY_SPECS[0]
    _, sf = shard_files("tiny", spec)
    assert llama.stored_spec(sf) == spec
    assert llama.load_weights(sf).spec == spec  # no spec: the one stored
    others = (TINY_SPECS[1], llama.ShardSpec((0, 1), (0, 96), (0, 199)), llama.ShardSpec((0, 1), (32, 128), (0, 200)))
    for other in others:
        with pytest.raises(llama.ShardMismatch, match="holds the shard"):
            llama.load_weights(sf, other)


def test_a_full_model_file_has_no_stored_spec(sources):
    assert llama.stored_spec(sources["tiny"]) is None


@pytest.mark.parametrize("spec", [
    llama.ShardSpec((0, 4), (0, 96), (0, 10)),     # 3 KV heads
    llama.ShardSpec((0, 1), (0, 225), (0, 10)),    # FFN 224
    llama.ShardSpec((0, 1), (0, 96), (10, 5)),     # backwards
    llama.ShardSpec((0, 1), (0, 96), (0, 601)),    # vocab 600
])
def test_a_spec_outside_the_model_is_refused_and_nothing_is_written(sources, tmp_path, spec):
    with pytest.raises(ValueError, match="not a range within"):
        write_shard(sources["tiny"], spec, tmp_path / "x.gguf")
    assert list(tmp_path.iterdir()) == []


def test_a_shard_is_not_sliced_again(shard_files, tmp_path):
    _, sf = shard_files("tiny", TINY_SPECS[0])
    with pytest.raises(ValueError, match="already a shard"):
        write_shard(sf, TINY_SPECS[0], tmp_path / "again.gguf")
    assert list(tmp_path.iterdir()) == []


def test_no_part_file_is_left_after_writing(shard_files):
    _, sf = shard_files("tiny", TINY_SPECS[1])
    assert sorted(p.name for p in sf.path.parent.iterdir() if p.name.endswith(".part")) == []


MOE_SPECS = [
    llama.ShardSpec((0, 1), (0, 96), (0, 200)),       # block-aligned: every expert's blocks copied
    llama.ShardSpec((1, 3), (40, 100), (200, 600)),   # splits Q8_0 blocks: ffn_down_exps as f32
    llama.ShardSpec((0, 3), (0, 0), (0, 600)),        # no expert columns at all
    llama.ShardSpec((0, 1), (0, 224), (0, 600), None, (3, 6)),  # whole experts 3, 4, 5 (expert placement)
    llama.ShardSpec((0, 1), (32, 96), (0, 600), None, (7, 8)),  # columns of the last expert only
    llama.ShardSpec((1, 2), (0, 224), (0, 0), None, (2, 2)),    # no expert
]


@pytest.mark.parametrize("spec", MOE_SPECS)
def test_a_mixtures_shard_file_holds_each_experts_columns_and_computes_bit_identical_outputs(synth_model, tmp_path,
                                                                                           spec):
    mf = gguf.ModelFile(synth_model("tiny-odd", "q8_0", arch="mixtral", n_experts=8, n_experts_used=2))
    sf = gguf.ModelFile(write_shard(mf, spec, tmp_path / shard_name(mf.fingerprint, spec)))
    a, b = spec.ffn_cols
    e0, e1 = spec.experts or (0, 8)
    for name in (f"blk.{i}.ffn_{w}_exps.weight" for i in range(3) for w in ("gate", "up", "down")):
        src, got = mf.tensors[name], sf.tensors[name]
        if a == b or e0 == e1:
            assert got.n_bytes == 0, name
            continue
        want = dequantize(np.asarray(src.data), src.tensor_type)[e0:e1]  # (experts, rows, cols), gguf-py's values
        want = want[:, :, a:b] if "down" in name else want[:, a:b]
        assert np.array_equal(dequantize(np.asarray(got.data), got.tensor_type).reshape(want.shape), want), name
    assert sf.tensors["blk.0.ffn_gate_inp.weight"].n_bytes == mf.tensors["blk.0.ffn_gate_inp.weight"].n_bytes
    outs = []
    for source in (mf, sf):
        shard = llama.Shard(llama.load_weights(source, spec), ctx=8)
        h = shard.forward(llama.embed(mf, [1, 17, 42]), 0)
        h2 = shard.forward(llama.embed(mf, [5]), 3)
        outs.append((h, shard.logits(h), h2, shard.logits(h2)))
    for x, y in zip(*outs):
        assert x.shape == y.shape and x.view(np.uint32).tobytes() == y.view(np.uint32).tobytes()
