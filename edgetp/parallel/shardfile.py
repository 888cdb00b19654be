"""One node's slice of a model as a GGUF file of its own: what the root sends a worker.

`write_shard(mf, spec, path)` keeps every tensor of the source under its own
name but cut to the spec, by the same table `llama.load_weights` slices by:

    attn_q.weight / .bias      rows   query heads of the KV groups
    attn_k, attn_v (+ .bias)   rows   KV heads
    attn_output.weight         cols   query heads
    ffn_gate, ffn_up           rows   FFN columns
    ffn_down                   cols   FFN columns
    attn_qkv (phi3)            parts  the rows of q, k and v above, one after the other
    ffn_up (phi3: gate | up)   parts  the gate's rows of the FFN columns, then up's
    ffn_gate_exps, ffn_up_exps rows   FFN columns of every expert (a mixture: 3-D, one matrix per expert)
    ffn_down_exps              cols   FFN columns of every expert
                                      (of the spec's experts only, when it names them)
    ffn_gate_shexp, ffn_up_shexp rows the shared expert's columns (ModelConfig.shared_cols)
    ffn_down_shexp             cols   the shared expert's columns
    output.weight              rows   vocabulary rows
    token_embd.weight          rows   vocabulary rows when tied (it is the lm head), else none (the root embeds)
    anything else              whole  (norms, rope_freqs)

Row slices and block-aligned column slices are byte-exact copies of the
source blocks; a column range that splits a quant block is stored as the
exact f32 values, as load_weights does. An empty range gives a tensor with
zero rows (or columns), so every name, and with it the model's config, is
still there. All metadata is copied, plus `edgetp.shard.*`: the spec, the
source fingerprint and the true vocabulary size (the file's own token_embd
no longer shows it). `llama.load_weights` reads such a file for exactly that
spec and refuses any other.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as QT, GGUFValueType, GGUFWriter

from edgetp.model import quant
from edgetp.model.gguf import ModelFile, gguf_writer
from edgetp.model.llama import SHARD_KEYS, ShardSpec
from edgetp.parallel.plan import Range
from edgetp.store.slices import durable_replace

_BLK = re.compile(r"blk\.\d+\.(.+)")


def shard_name(fingerprint: str, spec: ShardSpec) -> str:
    """File name of a shard in a cache: source model and spec, nothing else."""
    (a, b), (c, d), (e, f) = spec.kv_groups, spec.ffn_cols, spec.vocab_rows
    layers = "" if spec.layers is None else f"-layers{spec.layers[0]}-{spec.layers[1]}"
    experts = "" if spec.experts is None else f"-experts{spec.experts[0]}-{spec.experts[1]}"
    return f"{fingerprint[:16]}-kv{a}-{b}-ffn{c}-{d}-vocab{e}-{f}{layers}{experts}.gguf"


def check_spec(mf: ModelFile, spec: ShardSpec) -> None:
    """ValueError unless every range of the spec lies inside the model."""
    cfg = mf.config
    for what, (start, stop), limit in (("kv_groups", spec.kv_groups, cfg.n_kv_heads),
                                       ("ffn_cols", spec.ffn_cols, cfg.ffn),
                                       ("vocab_rows", spec.vocab_rows, cfg.vocab)):
        if not 0 <= start <= stop <= limit:
            raise ValueError(f"{what} {start}:{stop} is not a range within 0:{limit}")
    spec.layer_range(cfg.n_layers)
    spec.expert_range(cfg.n_experts)


def slice_plan(mf: ModelFile, spec: ShardSpec) -> dict[str, tuple[str, Any]]:
    """name -> ("rows" | "cols" | "whole", range) or ("parts", row ranges) for every tensor of the
    source, in file order."""
    cfg = mf.config
    hd, g = cfg.head_dim, cfg.group_size
    kv = (spec.kv_groups[0] * hd, spec.kv_groups[1] * hd)
    qh = (kv[0] * g, kv[1] * g)
    per_layer = {
        "attn_q.weight": ("rows", qh), "attn_q.bias": ("rows", qh),
        "attn_k.weight": ("rows", kv), "attn_k.bias": ("rows", kv),
        "attn_v.weight": ("rows", kv), "attn_v.bias": ("rows", kv),
        "attn_output.weight": ("cols", qh),
        "ffn_gate.weight": ("rows", spec.ffn_cols), "ffn_up.weight": ("rows", spec.ffn_cols),
        "ffn_down.weight": ("cols", spec.ffn_cols),
        "ffn_gate_exps.weight": ("rows", spec.ffn_cols), "ffn_up_exps.weight": ("rows", spec.ffn_cols),
        "ffn_down_exps.weight": ("cols", spec.ffn_cols),
    }
    if cfg.ffn_shared:
        sh = cfg.shared_cols(spec.ffn_cols, spec.experts)
        per_layer |= {"ffn_gate_shexp.weight": ("rows", sh), "ffn_up_shexp.weight": ("rows", sh),
                      "ffn_down_shexp.weight": ("cols", sh)}
    if cfg.fused_qkv:  # q | k | v rows: a shard file holds its own heads' rows of each, in that order
        at_k, at_v = cfg.n_heads * hd, (cfg.n_heads + cfg.n_kv_heads) * hd
        per_layer["attn_qkv.weight"] = ("parts", (qh, (kv[0] + at_k, kv[1] + at_k), (kv[0] + at_v, kv[1] + at_v)))
    if cfg.fused_gate_up:  # gate | up rows
        (a, b), f = spec.ffn_cols, cfg.ffn
        per_layer["ffn_up.weight"] = ("parts", ((a, b), (a + f, b + f)))
    first, last = spec.layer_range(cfg.n_layers)
    plan: dict[str, tuple[str, Any]] = {}
    for name in mf.tensors:
        m = _BLK.fullmatch(name)
        if m and not first <= int(name.split(".")[1]) < last:
            plan[name] = ("rows", (0, 0))  # another pipeline stage's layer: its name only
        elif m and m[1] in per_layer:
            plan[name] = per_layer[m[1]]
        elif name == "output.weight" or (name == "token_embd.weight" and cfg.tied):
            plan[name] = ("rows", spec.vocab_rows)
        elif name == "token_embd.weight":
            plan[name] = ("rows", (0, 0))
        else:
            plan[name] = ("whole", (0, 0))
    return plan


def _cut(mf: ModelFile, name: str, how: str, r: Any, spec: ShardSpec) -> tuple[np.ndarray, int]:
    """(array to store, GGML type) of one tensor's slice."""
    t = mf.tensors[name]
    if how == "whole":
        return np.asarray(t.data), int(t.tensor_type)
    if how == "parts":
        w = mf.weight(name)
        return np.concatenate([w.data[a:b] for a, b in r]), w.qtype
    if len(t.shape) == 1:  # a bias: a vector of f32/f16 values
        return np.asarray(t.data)[r[0]:r[1]], int(t.tensor_type)
    if len(t.shape) == 3:  # a mixture's experts: each held one cut as a matrix, stacked again
        one, qtype = _cut_weight(mf.experts(name)[0], how, r)
        parts = [_cut_weight(w, how, r)[0] for w in _held(mf, name, spec)]
        return (np.stack(parts) if parts else np.empty((0,) + one.shape, one.dtype)), qtype
    return _cut_weight(mf.weight(name), how, r)


def _held(mf: ModelFile, name: str, spec: ShardSpec) -> tuple[quant.Weight, ...]:
    """The matrices of the experts the spec holds, of a 3-D expert tensor."""
    a, b = spec.expert_range(mf.config.n_experts)
    return mf.experts(name)[a:b]


def _cut_weight(w: quant.Weight, how: str, r: Range) -> tuple[np.ndarray, int]:
    if how == "rows":
        return w.data[r[0]:r[1]], w.qtype
    if r[0] == r[1]:
        return w.data[:, :0], w.qtype
    try:
        part = quant.slice_cols(w, *r)
    except ValueError:  # the range splits a quant block: exact f32 values, as load_weights does
        dense = np.ascontiguousarray(quant.dequantize_rows(w, 0, w.rows)[:, r[0]:r[1]])
        part = quant.Weight(int(QT.F32), w.rows, r[1] - r[0], dense.view(np.uint8))
    return part.data, part.qtype


def _table_entry(mf: ModelFile, name: str, how: str, r: Any,
                 spec: ShardSpec) -> tuple[tuple[int, ...], np.dtype, int, int]:
    """(shape, dtype, nbytes, GGML type) of what _cut will give, without copying a column slice or parts
    (of a mixture's experts: one expert's)."""
    if how == "parts":
        w = mf.weight(name)
        rows = sum(b - a for a, b in r)
        return (rows, *w.data.shape[1:]), w.data.dtype, rows * w.data[:1].nbytes, w.qtype
    if len(mf.tensors[name].shape) == 3 and how != "whole":
        n = len(_held(mf, name, spec))
        data, qtype = _cut_weight(mf.experts(name)[0], how, r)
        return (n,) + data.shape, data.dtype, data.nbytes * n, qtype
    if how == "cols" and r[0] != r[1]:
        w = mf.weight(name)
        bs = quant.block_size(w.qtype)
        qtype = w.qtype if r[0] % bs == 0 and r[1] % bs == 0 else int(QT.F32)
        rb = quant.row_bytes(qtype, r[1] - r[0])
        return (w.rows, rb), np.dtype(np.uint8), w.rows * rb, qtype
    data, qtype = _cut(mf, name, how, r, spec)  # views, no copy
    return data.shape, data.dtype, data.nbytes, qtype


def _copy_metadata(mf: ModelFile, writer: GGUFWriter) -> None:
    """Every key/value of the source with its own value types, from the values the open already read:
    no second parse of the header (seconds for a large vocabulary, at every re-plan's new slices)."""
    for name, value in mf.metadata.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        types = [GGUFValueType(t) for t in mf.value_types[name]]
        if types[0] == GGUFValueType.ARRAY:
            if not value:  # (gguf-py reads no element type for an empty array)
                continue
            if len(types) != 2:
                raise ValueError(f"{mf.path}: nested array {name!r} is not supported in a shard")
            writer.add_key_value(name, value, types[0], sub_type=types[1])
        else:
            writer.add_key_value(name, value, types[0])


def _add_shard_keys(mf: ModelFile, spec: ShardSpec, writer: GGUFWriter) -> None:
    arr, u64 = GGUFValueType.ARRAY, GGUFValueType.UINT64
    writer.add_key_value(SHARD_KEYS["kv_groups"], list(spec.kv_groups), arr, sub_type=u64)
    writer.add_key_value(SHARD_KEYS["ffn_cols"], list(spec.ffn_cols), arr, sub_type=u64)
    writer.add_key_value(SHARD_KEYS["vocab_rows"], list(spec.vocab_rows), arr, sub_type=u64)
    if spec.layers is not None:
        writer.add_key_value(SHARD_KEYS["layers"], list(spec.layers), arr, sub_type=u64)
    if spec.experts is not None:
        writer.add_key_value(SHARD_KEYS["experts"], list(spec.experts), arr, sub_type=u64)
    writer.add_key_value(SHARD_KEYS["vocab"], mf.config.vocab, u64)
    writer.add_key_value(SHARD_KEYS["source_fingerprint"], mf.fingerprint, GGUFValueType.STRING)


def write_shard(mf: ModelFile, spec: ShardSpec, path: str | os.PathLike[str]) -> Path:
    """Write the GGUF of `spec`'s slices to `path`: through `path.part`, fsynced, renamed, the directory fsynced.

    A file under the final name is whole even after a power cut; on any failure the .part is removed.
    """
    if SHARD_KEYS["kv_groups"] in mf.metadata:
        raise ValueError(f"{mf.path} is already a shard; slice the full model file")
    check_spec(mf, spec)
    path = Path(path)
    plan = slice_plan(mf, spec)
    with gguf_writer(path, mf.config.arch, replace=durable_replace) as writer:
        writer.data_alignment = int(mf.alignment)
        _copy_metadata(mf, writer)
        _add_shard_keys(mf, spec, writer)
        for name, (how, r) in plan.items():  # the tensor table first: shapes only
            shape, dtype, nbytes, qtype = _table_entry(mf, name, how, r, spec)
            writer.add_tensor_info(name, shape, dtype, nbytes, raw_dtype=QT(qtype))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name, (how, r) in plan.items():  # then the bytes, one sliced tensor in memory at a time
            writer.write_tensor_data(np.ascontiguousarray(_cut(mf, name, how, r, spec)[0]))
    return path
