"""GGUF model files: validated opening, the model's hyper-parameters, tensor views.

Reading is done by gguf-py (llama.cpp's own reader), which memory-maps the
file; nothing here copies a weight. What we add is validation, so that a bad
file fails at open with one line naming the file and the fault instead of a
numpy error deep inside the forward pass.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader

from edgetp.model import quant

GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHS = ("llama", "mistral", "qwen2")


class GGUFError(Exception):
    """A model file that cannot be used; str() is one line naming the file."""


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a llama-family model, read from GGUF metadata."""

    arch: str
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    ctx_train: int
    rope_theta: float
    rope_dims: int          # leading dims of each head that rotate
    rope_neox: bool         # NEOX pairs (i, i+d/2) instead of adjacent pairs
    norm_eps: float
    tied: bool              # lm head shares token_embd
    qkv_bias: bool          # qwen2 has q/k/v biases

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.n_heads // self.n_kv_heads


class ModelFile:
    """An opened, validated GGUF file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.reader = _open_reader(self.path)
        self.tensors = {t.name: t for t in self.reader.tensors}
        _check_extents(self.path, self.reader)
        self.config = _read_config(self.path, self.reader, self.tensors)
        _check_tensor_types(self.path, self.tensors)

    @cached_property
    def metadata(self) -> dict[str, Any]:
        """Every key/value of the header as plain Python values."""
        return {name: field.contents() for name, field in self.reader.fields.items()}

    def has(self, name: str) -> bool:
        return name in self.tensors

    def weight(self, name: str) -> quant.Weight:
        """A 2-D weight, as a zero-copy view of the mapped file."""
        return quant.weight_from_gguf(self._tensor(name))

    def vector(self, name: str) -> np.ndarray:
        """A 1-D float tensor (norm weights, biases) as float32."""
        t = self._tensor(name)
        if t.tensor_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            raise GGUFError(f"{self.path}: vector {name!r} has type {t.tensor_type.name}, expected F32 or F16")
        return np.asarray(t.data).astype(np.float32).reshape(-1)

    def _tensor(self, name: str):
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path}: tensor {name!r} is missing") from None

    @cached_property
    def fingerprint(self) -> str:
        """sha256 of the header (metadata + tensor table) and the file size: cheap model identity.

        Two files with the same fingerprint have the same tensors at the same
        offsets; it is what nodes compare before mapping their own copy.
        """
        h = hashlib.sha256()
        with open(self.path, "rb") as f:
            h.update(f.read(int(self.reader.data_offset)))
        h.update(str(self.path.stat().st_size).encode())
        return h.hexdigest()

    def digest(self) -> str:
        """sha256 of the whole file (reads it once; use for identity, not per request)."""
        h = hashlib.sha256()
        with open(self.path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        return h.hexdigest()


def open_model(path: str | os.PathLike[str]) -> ModelFile:
    return ModelFile(path)


def _open_reader(path: Path) -> GGUFReader:
    if not path.exists():
        raise GGUFError(f"{path}: no such model file")
    if not path.is_file():
        raise GGUFError(f"{path}: not a regular file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        return GGUFReader(path)
    except (ValueError, IndexError, KeyError, TypeError, OverflowError, UnicodeDecodeError, MemoryError) as exc:
        raise GGUFError(f"{path}: corrupt or truncated GGUF header ({exc})") from None


def _check_extents(path: Path, reader: GGUFReader) -> None:
    """Every tensor must lie inside the file, aligned, and not overlap another."""
    size = path.stat().st_size
    spans = []
    for t in reader.tensors:
        start = int(t.data_offset)
        stop = start + int(t.n_bytes)
        if start < int(reader.data_offset) or start % reader.alignment:
            raise GGUFError(f"{path}: tensor {t.name!r} has a bad offset {start}")
        if stop > size:
            raise GGUFError(
                f"{path}: tensor {t.name!r} ends at byte {stop} but the file has {size} bytes (truncated?)"
            )
        spans.append((start, stop, t.name))
    spans.sort()
    for (_, stop, name), (start, _, other) in zip(spans, spans[1:]):
        if start < stop:
            raise GGUFError(f"{path}: tensors {name!r} and {other!r} overlap (lying offsets)")


def _read_config(path: Path, reader: GGUFReader, tensors: dict) -> ModelConfig:
    def get(key: str, default: Any = None) -> Any:
        field = reader.fields.get(key)
        if field is None:
            if default is None:
                raise GGUFError(f"{path}: metadata key {key!r} is missing")
            return default
        return field.contents()

    arch = get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise GGUFError(f"{path}: unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")
    dim = int(get(f"{arch}.embedding_length"))
    n_heads = int(get(f"{arch}.attention.head_count"))
    n_kv_heads = int(get(f"{arch}.attention.head_count_kv", n_heads))
    head_dim = int(get(f"{arch}.attention.key_length", dim // n_heads))
    if n_heads % n_kv_heads:
        raise GGUFError(f"{path}: {n_heads} heads are not a multiple of {n_kv_heads} KV heads")
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{path}: tensor 'token_embd.weight' is missing")
    vocab = int(tensors["token_embd.weight"].shape[1])
    return ModelConfig(
        arch=arch,
        n_layers=int(get(f"{arch}.block_count")),
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        ffn=int(get(f"{arch}.feed_forward_length")),
        vocab=vocab,
        ctx_train=int(get(f"{arch}.context_length", 2048)),
        rope_theta=float(get(f"{arch}.rope.freq_base", 10000.0)),
        rope_dims=int(get(f"{arch}.rope.dimension_count", head_dim)),
        rope_neox=arch == "qwen2",
        norm_eps=float(get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        tied="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
    )


def _check_tensor_types(path: Path, tensors: dict) -> None:
    for name, t in tensors.items():
        if t.tensor_type not in quant.SUPPORTED:
            raise GGUFError(
                f"{path}: tensor {name!r} has unsupported type {t.tensor_type.name} "
                f"(supported: {', '.join(sorted(GGMLQuantizationType(q).name for q in quant.SUPPORTED))})"
            )
