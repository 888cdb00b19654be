"""GGUF model files: validated opening, the model's hyper-parameters, tensor views.

Reading is done by gguf-py (llama.cpp's own reader), which memory-maps the
file; nothing here copies a weight. What we add is validation, so that a bad
file fails at open with one line naming the file and the fault instead of a
numpy error deep inside the forward pass.
"""

from __future__ import annotations

import hashlib
import math
import os
import dataclasses
from dataclasses import dataclass
from contextlib import contextmanager
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Iterator

import msgpack
import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from edgetp.model import pages, quant

GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen2moe", "qwen3", "qwen3moe", "gemma2", "gemma3", "phi3", "smollm3",
                   "mistral3")
# rope on pairs (i, i + d/2), as llama.cpp's LLAMA_ROPE_TYPE_NEOX
NEOX_ARCHS = ("qwen2", "qwen2moe", "qwen3", "qwen3moe", "gemma2", "gemma3", "phi3")
ROPE_SCALINGS = ("none", "linear", "yarn", "longrope")  # rope.scaling.type, as llama.cpp reads it
MOE_ARCHS = ("qwen2moe", "qwen3moe")  # always mixtures (llama is one when it has llama.expert_count)


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
    qk_norm: bool = False   # qwen3, gemma3: RMSNorm over each head of q and of k (attn_q_norm, attn_k_norm), before rope
    # Gemma (2 and 3), as llama.cpp reads it; the defaults are llama's
    embed_scale: float = 1.0        # token embeddings times this (gemma: sqrt(dim))
    post_norms: bool = False        # RMSNorm of the attention and FFN outputs before the residual add
    geglu: bool = False             # gelu_tanh(gate) * up instead of silu(gate) * up
    attn_scale: float = 0.0         # query scale; 0: 1/sqrt(head_dim)
    attn_softcap: float = 0.0       # attention scores -> cap * tanh(score / cap) (gemma2); 0: none
    final_softcap: float = 0.0      # logits -> cap * tanh(logit / cap) (gemma2); 0: none
    swa_window: int = 0             # sliding-window layers see the keys p with pos - p < swa_window
    swa_layers: tuple[bool, ...] = ()  # per layer: a sliding-window (local) layer
    rope_theta_swa: float = 0.0     # rope base of the sliding-window layers
    rope_scale: float = 1.0         # rope scaling: angles times this (1 / rope.scaling.factor)
    rope_yarn: bool = False         # ... by YaRN over rope_ctx_orig positions (rope.scaling.type "yarn")
    rope_scale_swa: float = 1.0     # the same for the sliding-window layers (gemma3: never scaled)
    # phi3, as llama.cpp reads it; the defaults are llama's
    fused_qkv: bool = False         # blk.N.attn_qkv holds the rows of q | k | v (no attn_q/k/v)
    fused_gate_up: bool = False     # blk.N.ffn_up holds 2 * ffn rows: the gate's, then up's (no ffn_gate)
    rope_attn_factor: float = 1.0   # rope's cos and sin times this (rope.scaling.attn_factor)
    rope_ctx_orig: int = 0          # longer contexts take rope_factors_long (rope.scaling.original_context_length)
    # Mixture of experts (mixtral: llama with llama.expert_count; qwen2moe, qwen3moe), as llama.cpp's
    # build_moe_ffn; then `ffn` is the width of one expert
    n_experts: int = 0              # experts per layer (ffn_gate_inp rows); 0: a dense FFN
    n_experts_used: int = 0         # experts each token goes through (top-k of the router's softmax)
    expert_norm: bool = False       # the k chosen probabilities divided by their sum (mixtral, qwen3moe)
    expert_scale: float = 0.0       # then times this (expert_weights_scale; 0: not scaled)
    ffn_shared: int = 0             # the shared expert's width (qwen2moe: every token, gated); 0: none
    shared_block: int = 32          # columns a split of the shared expert keeps together (ffn_down_shexp's block)
    # smollm3: every nope_step-th layer (layer + 1 a multiple of it) rotates neither q nor k (NoPE), as
    # llama.cpp's n_no_rope_layer_step, which its loader sets to 4 for smollm3 and reads from no key; 0: none
    nope_step: int = 0
    # mistral3 (Ministral 3), as llama.cpp reads it; the defaults are everyone else's
    yarn_beta_fast: float = 32.0    # YaRN's ramp: from the pair that turns this many times over rope_ctx_orig
    yarn_beta_slow: float = 1.0     # ... to the one that turns this many times
    yarn_log_mul: float = 0.0       # rope.scaling.yarn_log_multiplier: HF's mscale_all_dim (0: none)
    attn_temp_scale: float = 0.0    # q times 1 + this * ln(floor(pos / rope_ctx_orig) + 1) (llama 4's; 0: none)

    def is_local(self, layer: int) -> bool:
        """Whether layer `layer` attends over a sliding window (with rope_theta_swa)."""
        return self.swa_window > 0 and bool(self.swa_layers) and self.swa_layers[layer]

    def rope_mscale(self) -> float:
        """What cos and sin are multiplied by before YaRN's own magnitude (ops.rope_table): llama.cpp's
        yarn_attn_factor times rope.scaling.attn_factor (llama_context's cparams)."""
        if not self.rope_yarn:
            return self.rope_attn_factor
        factor = 1.0 / self.rope_scale

        def mscale(m: float) -> float:
            return 1.0 if factor <= 1.0 else 0.1 * m * math.log(factor) + 1.0

        attn = mscale(1.0) / mscale(self.yarn_log_mul) if self.yarn_log_mul else mscale(1.0)
        return attn / (1.0 + 0.1 * math.log(factor)) * self.rope_attn_factor

    def layer_rope_dims(self, layer: int) -> int:
        """The leading dims of each head that layer `layer` rotates: rope_dims, or 0 on a NoPE layer."""
        return 0 if self.nope_step and (layer + 1) % self.nope_step == 0 else self.rope_dims

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.n_heads // self.n_kv_heads

    def shared_cols(self, ffn_cols: tuple[int, int], experts: tuple[int, int] | None) -> tuple[int, int]:
        """The shared expert's columns of a shard that holds `ffn_cols` of the experts `experts` (None:
        all): the experts' part of the shared expert's width, then the columns' part of that,
        each bound at shared_block boundaries, rounded half up. A column split (experts None) is the
        second map alone, whole experts placed (every column) the first alone; a group of nodes
        splitting a range of experts by columns (a mixed plan) both. Each bound maps alone by an
        increasing function whose ends are the range's, so the shares of a stage, which tile the
        experts x columns, tile the shared expert as well."""
        def part(c: int, total: int, blocks: int) -> int:
            return (2 * c * blocks + total) // (2 * total)

        blocks = self.ffn_shared // self.shared_block
        a, b = (0, blocks) if experts is None else (part(e, self.n_experts, blocks) for e in experts)
        return tuple((a + part(c, self.ffn, b - a)) * self.shared_block for c in ffn_cols)  # type: ignore


def split_block(width: int, block: int) -> int:
    """The columns a split of a matrix `width` wide keeps together, its input's quant block being
    `block`: the block (at least 32) where it divides the width, else 32, else 1."""
    unit = max(32, block)
    return unit if width % unit == 0 else 32 if width % 32 == 0 else 1


@dataclass(frozen=True, eq=False)
class TensorInfo:
    """One tensor of the file: what gguf-py's ReaderTensor tells us, plus its mapped bytes."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]   # ggml order: [cols, rows, ...]
    data_offset: int         # absolute, in the file
    n_bytes: int
    data: np.ndarray         # read-only view of the mapped file (float32/float16 for those types, else uint8 rows)


class ModelFile:
    """An opened, validated GGUF file.

    The header is parsed by gguf-py (_Reader). That parse costs seconds on a
    large vocabulary (it builds a numpy view per string), so with `index_dir` its
    result (metadata, tensor table) is kept in a small index file keyed by
    the file's path, size, mtime and inode; later opens map the tensors from
    the index in milliseconds. Any doubt about an index means a fresh parse.
    """

    def __init__(self, path: str | os.PathLike[str], index_dir: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path)
        index = _index_path(self.path, index_dir) if index_dir else None
        head = _read_index(index) if index else None
        if head is None:  # the reader is not kept (see reader())
            head = _head_from_reader(_open_reader(self.path))
            if index:
                _write_index(index, head)
        self.metadata: dict[str, Any] = head["metadata"]
        # each key's GGUF value types as gguf-py's ReaderField.types: [type], or [ARRAY, element type]
        self.value_types: dict[str, list[int]] = head["value_types"]
        self.data_offset: int = head["data_offset"]
        self.alignment: int = head["alignment"]
        self.tensors = _map_tensors(self.path, head["tensors"])
        _check_extents(self.path, self.tensors.values(), self.data_offset, self.alignment)
        self.config = _read_config(self.path, self.metadata, self.tensors)
        _check_layers(self.path, self.config, self.tensors, self.metadata)
        _check_tensor_types(self.path, self.tensors)

    def reader(self) -> GGUFReader:
        """gguf-py's full reader, parsed afresh for each call and kept by no one here, for whoever needs
        more than `metadata` and `value_types` (a shard's header is written from those). Its parse
        holds a numpy view per string of the header: it raised RSS by 334 MB for Llama 3's 128,256-token
        vocabulary (150 MB since _Reader's views are plain ndarrays), which a daemon that kept it would
        carry for its whole life."""
        return _open_reader(self.path)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def experts(self, name: str) -> tuple[quant.Weight, ...]:
        """A 3-D expert tensor (ggml [cols, rows, experts]) as one zero-copy Weight per expert."""
        t = self._tensor(name)
        if len(t.shape) != 3:
            raise GGUFError(f"{self.path}: tensor {name!r} has shape {list(t.shape)}, expected 3 dimensions")
        cols, rows, n = (int(d) for d in t.shape)
        data = np.asarray(t.data).view(np.uint8).reshape(n, rows, quant.row_bytes(int(t.tensor_type), cols))
        return tuple(quant.Weight(int(t.tensor_type), rows, cols, data[e]) for e in range(n))

    def weight(self, name: str) -> quant.Weight:
        """A 2-D weight, as a zero-copy view of the mapped file."""
        return quant.weight_from_gguf(self._tensor(name))

    def vector(self, name: str) -> np.ndarray:
        """A 1-D float tensor (norm weights, biases) as float32."""
        t = self._tensor(name)
        if t.tensor_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            raise GGUFError(f"{self.path}: vector {name!r} has type {t.tensor_type.name}, expected F32 or F16")
        return np.asarray(t.data).astype(np.float32).reshape(-1)

    @cached_property
    def dominant_type(self) -> int:
        """The type that holds the most bytes of the layers' 2-D weights: what decode mostly reads."""
        by_type: dict[int, int] = {}
        for t in self.tensors.values():
            if t.name.startswith("blk.") and len(t.shape) >= 2 and t.shape[1] > 1:
                by_type[int(t.tensor_type)] = by_type.get(int(t.tensor_type), 0) + t.n_bytes
        return max(by_type, key=by_type.__getitem__) if by_type else int(GGMLQuantizationType.F32)

    def _tensor(self, name: str) -> TensorInfo:
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
            h.update(f.read(self.data_offset))
        h.update(str(self.path.stat().st_size).encode())
        return h.hexdigest()

    def digest(self) -> str:
        """sha256 of the whole file (reads it once; use for identity, not per request)."""
        h = hashlib.sha256()
        with open(self.path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        return h.hexdigest()


def open_model(path: str | os.PathLike[str], index_dir: str | os.PathLike[str] | None = None) -> ModelFile:
    return ModelFile(path, index_dir)


@contextmanager
def gguf_writer(path: str | os.PathLike[str], arch: str,
                replace: Callable[[Path, Path], None] = os.replace) -> Iterator[GGUFWriter]:
    """A GGUFWriter on `path.part`, renamed to `path` by `replace` only when the block completes.

    On any failure the partial file is removed: a file under its final name is whole.
    """
    path = Path(path)
    part = path.with_name(path.name + ".part")
    writer = GGUFWriter(part, arch)
    try:
        yield writer
        writer.close()
        replace(part, path)
    except BaseException:
        try:
            writer.close()
        except Exception:  # noqa: BLE001 - best effort before removing the partial file
            pass
        part.unlink(missing_ok=True)
        raise


INDEX_VERSION = 2  # 2: each key's GGUF value types


def _index_path(path: Path, index_dir: str | os.PathLike[str]) -> Path | None:
    try:
        st = path.stat()
    except OSError:
        return None  # the slow path reports the missing file
    ident = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|{INDEX_VERSION}"
    return Path(index_dir) / f"{hashlib.sha256(ident.encode()).hexdigest()[:32]}.msgpack"


def _head_from_reader(reader: GGUFReader) -> dict[str, Any]:
    return {
        "version": INDEX_VERSION,
        "metadata": {name: field.contents() for name, field in reader.fields.items()},
        "value_types": {name: [int(t) for t in field.types] for name, field in reader.fields.items()},
        "data_offset": int(reader.data_offset),
        "alignment": int(reader.alignment),
        "tensors": [[t.name, int(t.tensor_type), [int(d) for d in t.shape], int(t.data_offset), int(t.n_bytes)]
                    for t in reader.tensors],
    }


def _read_index(index: Path) -> dict[str, Any] | None:
    try:
        head = msgpack.unpackb(index.read_bytes(), raw=False, strict_map_key=False)
        if head.get("version") != INDEX_VERSION or not isinstance(head.get("tensors"), list) \
                or not isinstance(head.get("value_types"), dict) or head["value_types"].keys() != head["metadata"].keys():
            return None
        return head
    except (OSError, ValueError, TypeError, AttributeError, msgpack.UnpackException):
        return None


def _write_index(index: Path, head: dict[str, Any]) -> None:
    """Best effort: a cache that cannot be written only costs the next open some time."""
    try:
        index.parent.mkdir(parents=True, exist_ok=True)
        part = index.with_name(f"{index.name}.{os.getpid()}.part")
        part.write_bytes(msgpack.packb(head, use_bin_type=True))
        os.replace(part, index)
    except (OSError, ValueError, TypeError):
        pass


def _map_tensors(path: Path, table: list) -> dict[str, TensorInfo]:
    """Views of every tensor's bytes in one read-only map of the file."""
    mm = pages.map_file(path)
    size = mm.shape[0]
    tensors = {}
    for name, qtype, shape, offset, n_bytes in table:
        try:
            kind = GGMLQuantizationType(qtype)
        except ValueError:
            raise GGUFError(f"{path}: tensor {name!r} has an unknown type code {qtype}") from None
        raw = mm[offset:offset + n_bytes] if offset + n_bytes <= size else mm[0:0]
        tensors[name] = TensorInfo(name, kind, tuple(shape), offset, n_bytes, _typed(raw, kind, shape))
    return tensors


def _typed(raw: np.ndarray, kind: GGMLQuantizationType, shape: list[int]) -> np.ndarray:
    """The bytes as gguf-py presents them: float arrays in numpy order, else uint8 rows."""
    dims = list(reversed(shape))  # numpy order: rows first
    if raw.size == 0:
        return raw
    if kind == GGMLQuantizationType.F32:
        return raw.view(np.float32).reshape(dims)
    if kind == GGMLQuantizationType.F16:
        return raw.view(np.float16).reshape(dims)
    return raw.reshape(*dims[:-1], -1) if len(dims) > 1 else raw


class _Reader(GGUFReader):
    """gguf-py's reader, slicing a plain ndarray view of its map instead of the np.memmap itself.

    The reader slices its map a few times for every header value, every string of an array included:
    ~1.5 million slices for Llama 3's vocabulary and merges. np.memmap's Python-level `__getitem__`
    and `__array_finalize__` on each were most of the parse (7.7 s of it on an AVX2 EPYC core; 2.9 s
    with the plain view). The view's base is the memmap, which keeps the map alive."""

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, value: np.ndarray) -> None:  # gguf-py's __init__ assigns its np.memmap here
        self._plain = value.view(np.ndarray)


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
        return _Reader(path)
    except (ValueError, IndexError, KeyError, TypeError, OverflowError, UnicodeDecodeError, MemoryError) as exc:
        raise GGUFError(f"{path}: corrupt or truncated GGUF header ({exc})") from None


def _check_extents(path: Path, tensors, data_offset: int, alignment: int) -> None:
    """Every tensor must lie inside the file, aligned, and not overlap another."""
    size = path.stat().st_size
    spans = []
    for t in tensors:
        start = int(t.data_offset)
        stop = start + int(t.n_bytes)
        if start < data_offset or start % alignment:
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


def _read_config(path: Path, metadata: dict[str, Any], tensors: dict) -> ModelConfig:
    def get(key: str, default: Any = None) -> Any:
        value = metadata.get(key)
        if value is None:
            if default is None:
                raise GGUFError(f"{path}: metadata key {key!r} is missing")
            return default
        return value

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
    n_layers = int(get(f"{arch}.block_count"))
    # llama.cpp: freq_scale = 1 / rope.scaling.factor for every type but "none"; "linear" (also its default
    # type) and "longrope" (phi3's, whose factors are tensors) are that alone, "yarn" blends it with the
    # unscaled angles per pair (ops.rope_table). llama.cpp stops at any other type.
    factor = float(metadata.get(f"{arch}.rope.scaling.factor") or 0.0)
    scaling = metadata.get(f"{arch}.rope.scaling.type", "linear")
    if scaling not in ROPE_SCALINGS:
        raise GGUFError(f"{path}: rope scaling type {scaling!r} is not supported "
                        f"({arch}.rope.scaling.type; supported: {', '.join(ROPE_SCALINGS)})")
    rope_scale = 1.0 / factor if factor and scaling != "none" else 1.0
    ctx_train = int(get(f"{arch}.context_length", 2048))
    fused_qkv = "blk.0.attn_qkv.weight" in tensors  # llama.cpp: attn_qkv where the file has it, else q, k, v
    gemma = _gemma(path, arch, metadata, n_layers, dim, n_heads, head_dim) if arch.startswith("gemma") else {}
    gemma.setdefault("rope_scale_swa", rope_scale)
    moe = _moe(path, arch, metadata, tensors) if arch in MOE_ARCHS or metadata.get(f"{arch}.expert_count") else {}
    ffn = moe.pop("ffn", None) or int(get(f"{arch}.feed_forward_length"))
    return ModelConfig(
        arch=arch,
        n_layers=n_layers,
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        ffn=ffn,
        vocab=vocab,
        ctx_train=ctx_train,
        rope_theta=float(get(f"{arch}.rope.freq_base", 10000.0)),
        rope_dims=int(get(f"{arch}.rope.dimension_count", head_dim)),
        rope_neox=arch in NEOX_ARCHS,
        norm_eps=float(get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        tied=arch == "gemma2" or "output.weight" not in tensors,  # llama.cpp's gemma2 reads token_embd
        qkv_bias="blk.0.attn_q.bias" in tensors,
        qk_norm=arch in ("qwen3", "qwen3moe", "gemma3"),
        rope_scale=rope_scale,
        rope_yarn=scaling == "yarn",
        fused_qkv=fused_qkv,
        fused_gate_up=arch == "phi3",
        # llama.cpp: yarn_attn_factor *= rope.scaling.attn_factor, on every architecture
        rope_attn_factor=float(metadata.get(f"{arch}.rope.scaling.attn_factor") or 1.0),
        rope_ctx_orig=int(metadata.get(f"{arch}.rope.scaling.original_context_length") or ctx_train),
        nope_step=4 if arch == "smollm3" else 0,
        **(_mistral3(arch, metadata) if arch == "mistral3" else {}),
        **gemma,
        **moe,
    )


def _mistral3(arch: str, metadata: dict[str, Any]) -> dict[str, Any]:
    """mistral3's keys as llama_model_mistral3 reads them: YaRN's betas and log multiplier, and the
    query temperature scale (its positions counted in original contexts, rope_ctx_orig)."""
    def value(key: str, default: float) -> float:
        got = metadata.get(f"{arch}.{key}")
        return default if got is None else float(got)

    return dict(yarn_beta_fast=value("rope.scaling.yarn_beta_fast", 32.0),
                yarn_beta_slow=value("rope.scaling.yarn_beta_slow", 1.0),
                yarn_log_mul=value("rope.scaling.yarn_log_multiplier", 0.0),
                attn_temp_scale=value("attention.temperature_scale", 0.0))


def _moe(path: Path, arch: str, metadata: dict[str, Any], tensors: dict) -> dict[str, Any]:
    """Mixture-of-experts hyper-parameters as llama.cpp's loader reads them: expert_count and
    expert_used_count (both required), the experts' width from expert_feed_forward_length (qwen2moe,
    qwen3moe; else feed_forward_length / expert_used_count there, and feed_forward_length itself for
    llama's mixtral), the chosen weights renormalised (mixtral and qwen3moe pass norm_w, qwen2moe
    does not), expert_weights_scale if given. qwen2moe's shared expert is expert_shared_feed_forward_length
    wide, else feed_forward_length (llama_model_qwen2moe::load_arch_tensors)."""
    def need(key: str) -> int:
        value = metadata.get(f"{arch}.{key}")
        if value is None:
            raise GGUFError(f"{path}: metadata key {arch}.{key!r} is missing (a mixture-of-experts model needs it)")
        return int(value)

    n, used = need("expert_count"), need("expert_used_count")
    if not 1 <= used <= n:
        raise GGUFError(f"{path}: {arch}.expert_used_count {used} is not within 1..{n}, the experts of each "
                        f"router ('blk.0.ffn_gate_inp.weight' and on, {arch}.expert_count)")
    ffn = metadata.get(f"{arch}.expert_feed_forward_length")
    if ffn is None and arch in MOE_ARCHS:
        ffn = need("feed_forward_length") // used
    shared = {}
    if arch == "qwen2moe":
        width = int(metadata.get(f"{arch}.expert_shared_feed_forward_length") or need("feed_forward_length"))
        down = tensors.get("blk.0.ffn_down_shexp.weight")  # missing: _check_layers says so
        block = 32 if down is None else quant.block_size(int(down.tensor_type))
        shared = dict(ffn_shared=width, shared_block=split_block(width, block))
    return dict(n_experts=n, n_experts_used=used, expert_norm=arch != "qwen2moe",
                expert_scale=float(metadata.get(f"{arch}.expert_weights_scale") or 0.0),
                **({"ffn": int(ffn)} if ffn else {}), **shared)


def _gemma(path: Path, arch: str, metadata: dict[str, Any], n_layers: int, dim: int, n_heads: int,
           head_dim: int) -> dict[str, Any]:
    """Gemma 2 / 3 hyper-parameters as llama.cpp's loader sets them (llama_model_gemma2/3::load_arch_hparams).

    gemma2: sliding window 4096 unless the file says, every 2nd layer global (layer i is local
    when i % period < period - 1, the period from attention.sliding_window_pattern), the local
    rope base rope.freq_base_swa (else the global one), attention and final logit soft-caps
    from the file, else 50 and 30. gemma3: period 6, local rope base 10000 and no rope scaling
    on the local layers, sliding window only when the file gives one, no attention cap, a final cap only when the file gives one. Both: a
    query scale of 1/sqrt(dim / heads) for the 27B shapes (46 and 62 layers), else 1/sqrt(head_dim).
    """
    def value(key: str, default: Any) -> Any:
        v = metadata.get(f"{arch}.{key}")
        return default if v is None else v

    g2 = arch == "gemma2"
    window = int(value("attention.sliding_window", 4096 if g2 else 0))
    pattern = value("attention.sliding_window_pattern", 2 if g2 else 6)
    if isinstance(pattern, list):
        if len(pattern) != n_layers:
            raise GGUFError(f"{path}: {arch}.attention.sliding_window_pattern has {len(pattern)} entries "
                            f"for {n_layers} layers")
        local = tuple(bool(p) for p in pattern)
    else:
        period = int(pattern)
        local = tuple(period == 0 or i % period < period - 1 for i in range(n_layers))
    big = n_layers == (46 if g2 else 62)
    theta = float(value("rope.freq_base", 10000.0))
    return dict(
        embed_scale=float(np.sqrt(np.float32(dim))),
        post_norms=True,
        geglu=True,
        attn_scale=float(1.0 / np.sqrt(dim / n_heads if big else head_dim)),
        attn_softcap=float(value("attn_logit_softcapping", 50.0)) if g2 else 0.0,
        final_softcap=float(value("final_logit_softcapping", 30.0 if g2 else 0.0)),
        swa_window=window,
        swa_layers=local if window > 0 else (),
        rope_theta_swa=float(value("rope.freq_base_swa", theta if g2 else 10000.0)),
        **({} if g2 else {"rope_scale_swa": 1.0}),
    )


def _layer_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...] | None]:
    """The tensors every layer must hold: suffix -> ggml shape, None where any shape goes
    (the matrices, whose shapes are checked where they are sliced)."""
    qkv = ("attn_qkv.weight",) if cfg.fused_qkv else ("attn_q.weight", "attn_k.weight", "attn_v.weight")
    gate = () if cfg.fused_gate_up else ("ffn_gate.weight",)
    names: dict[str, tuple[int, ...] | None] = dict.fromkeys(
        ("attn_norm.weight", *qkv, "attn_output.weight", "ffn_norm.weight", *gate, "ffn_up.weight", "ffn_down.weight"))
    if cfg.qk_norm:
        names["attn_q_norm.weight"] = names["attn_k_norm.weight"] = (cfg.head_dim,)
    if cfg.post_norms:
        names["post_attention_norm.weight"] = names["post_ffw_norm.weight"] = (cfg.dim,)
    if cfg.n_experts:  # a router and 3-D expert tensors instead of the dense FFN
        for dense in ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"):
            del names[dense]
        names["ffn_gate_inp.weight"] = (cfg.dim, cfg.n_experts)
        names["ffn_gate_exps.weight"] = names["ffn_up_exps.weight"] = (cfg.dim, cfg.ffn, cfg.n_experts)
        names["ffn_down_exps.weight"] = (cfg.ffn, cfg.dim, cfg.n_experts)
    if cfg.ffn_shared:  # qwen2moe's shared expert and its gate (one logit per token)
        names["ffn_gate_inp_shexp.weight"] = (cfg.dim,)
        names["ffn_gate_shexp.weight"] = names["ffn_up_shexp.weight"] = (cfg.dim, cfg.ffn_shared)
        names["ffn_down_shexp.weight"] = (cfg.ffn_shared, cfg.dim)
    return names


def _check_layers(path: Path, cfg: ModelConfig, tensors: dict, metadata: dict[str, Any]) -> None:
    """Every tensor the architecture needs is there (at open: no partial load), 1-D ones of their shape.

    A pipeline stage's shard file keeps every name but holds data for its own layers only
    (edgetp.shard.layers, parallel/shardfile.py): shapes are checked in those."""
    need = ["output_norm.weight"] + [f"blk.{i}.{s}" for i in range(cfg.n_layers) for s in _layer_tensors(cfg)]
    for name in need:
        if name not in tensors:
            raise GGUFError(f"{path}: tensor {name!r} is missing (architecture {cfg.arch} needs it)")
    if "blk.0.attn_qkv.bias" in tensors:  # no phi3 has one; refused rather than left out of the sums
        raise GGUFError(f"{path}: tensor 'blk.0.attn_qkv.bias' (a bias on a fused qkv) is not supported")
    if not cfg.ffn_shared:  # a shared expert where the architecture has none: refused (llama.cpp
        # refuses it too), never left out of the sums
        extra = [n for n in ("ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
                 if f"blk.0.{n}.weight" in tensors]
        if extra:
            raise GGUFError(f"{path}: tensor 'blk.0.{extra[0]}.weight' (a shared expert) is not supported in "
                            f"architecture {cfg.arch} (qwen2moe has one)")
    for name in ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"):  # llama.cpp: {n_rot/2}
        if name in tensors and tuple(tensors[name].shape) != (cfg.rope_dims // 2,):
            raise GGUFError(f"{path}: tensor {name!r} has shape {list(tensors[name].shape)}, expected "
                            f"[{cfg.rope_dims // 2}] (one factor per rotated pair of {cfg.rope_dims} rope dims)")
    held = metadata.get("edgetp.shard.layers") or (0, cfg.n_layers)
    cols = metadata.get("edgetp.shard.ffn_cols")  # a shard file's experts hold these columns only
    experts = metadata.get("edgetp.shard.experts")  # ... of these experts only
    layer_cfg = cfg
    if cols is not None:
        a, b = cfg.shared_cols((int(cols[0]), int(cols[1])), None if experts is None else tuple(map(int, experts)))
        layer_cfg = dataclasses.replace(cfg, ffn=int(cols[1]) - int(cols[0]), ffn_shared=b - a)
    why = (f"head_dim {cfg.head_dim}" + (f", {cfg.n_experts} experts of {layer_cfg.ffn}" if cfg.n_experts else "")
           + (f", a shared expert of {layer_cfg.ffn_shared}" if cfg.ffn_shared else ""))
    shapes = {suffix: (shape, why) for suffix, shape in _layer_tensors(layer_cfg).items()}
    if experts is not None and cfg.n_experts:
        n = int(experts[1]) - int(experts[0])
        shapes = {k: (v[:2] + (n,) if "_exps." in k else v, w) for k, (v, w) in shapes.items()}
    shapes |= _fused_shapes(cfg, metadata)
    for i in range(int(held[0]), int(held[1])):
        for suffix, (shape, why) in shapes.items():
            t = tensors[f"blk.{i}.{suffix}"]
            if shape is not None and tuple(t.shape) != shape:
                raise GGUFError(f"{path}: tensor 'blk.{i}.{suffix}' has shape {list(t.shape)}, "
                                f"expected {list(shape)} ({why})")


def _fused_shapes(cfg: ModelConfig, metadata: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """phi3's fused tensors: suffix -> (ggml shape, what its rows are), for the KV groups and FFN
    columns the file holds (all of them, or a shard file's): a wrong row count would slice into the
    wrong heads."""
    a, b = metadata.get("edgetp.shard.kv_groups") or (0, cfg.n_kv_heads)
    c, d = metadata.get("edgetp.shard.ffn_cols") or (0, cfg.ffn)
    n_kv, hd, g = int(b) - int(a), cfg.head_dim, cfg.group_size
    shapes = {}
    if cfg.fused_qkv:
        shapes["attn_qkv.weight"] = ((cfg.dim, n_kv * (g + 2) * hd),
                                     f"the rows of q | k | v: {n_kv * g} heads and twice {n_kv} KV heads of {hd}")
    if cfg.fused_gate_up:
        shapes["ffn_up.weight"] = ((cfg.dim, 2 * (int(d) - int(c))), f"the rows of gate | up: twice {int(d) - int(c)}")
    return shapes


def _check_tensor_types(path: Path, tensors: dict) -> None:
    for name, t in tensors.items():
        if t.tensor_type not in quant.SUPPORTED:
            raise GGUFError(
                f"{path}: tensor {name!r} has unsupported type {t.tensor_type.name} "
                f"(supported: {', '.join(sorted(GGMLQuantizationType(q).name for q in quant.SUPPORTED))})"
            )
