"""Forward pass of one shard of a llama-family model (llama, mistral, qwen2, qwen3, gemma2, gemma3, phi3,
and the mixtures of experts mixtral, qwen2moe and qwen3moe: model/moe.py).

A shard holds a contiguous range of KV-head groups (with their query heads),
a range of FFN columns and a range of vocabulary rows; a single node holds
all of them. The forward pass knows nothing of the network: the two
per-layer sums of partial results go through an injected `reduce`
callable, which is the identity on a single node and an all-reduce in a
cluster (Megatron-style: q/k/v/gate/up split by output rows, o/down by
input columns).

The architectures differ by data, not by code paths: a Layer's optional tensors
(q/k biases, per-head q/k norms, post-norms) are None where the model has none,
and ModelConfig says which activation, scales, caps and windows apply
(gguf._read_config, as llama.cpp reads them). phi3's fused tensors are cut into
q, k, v and gate, up row views at load: the forward pass never sees them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType

from edgetp.model import decode, kvcache, moe, ops, pages, passes, quant
from edgetp.model.gguf import ModelConfig, ModelFile

Range = tuple[int, int]
Reduce = Callable[[np.ndarray], None]  # sums a (n, dim) partial in place across the shards


class ContextFull(Exception):
    """The KV cache cannot hold the requested positions."""


class ShardMismatch(ValueError):
    """A shard file (edgetp/parallel/shardfile.py) was asked for a slice it does not hold."""


# metadata of a shard file: the spec it holds, its source, the source's vocabulary size
SHARD_KEYS = {k: f"edgetp.shard.{k}" for k in ("kv_groups", "ffn_cols", "vocab_rows", "vocab", "source_fingerprint",
                                                 "layers", "experts")}
EXACT_TOP = 64  # logits recomputed exactly per decoded token and shard (Shard.logits)
STEP_ROWS = 16  # rows a decode step may carry however few the slots: a replay's run of one sequence's tokens


@dataclass(frozen=True)
class ShardSpec:
    """Which slice of every layer this process computes."""

    kv_groups: Range   # KV heads [start, stop); query heads follow by the group size
    ffn_cols: Range    # FFN columns [start, stop)
    vocab_rows: Range  # lm-head rows [start, stop)
    layers: Range | None = None  # a pipeline stage's layers [start, stop); None: every layer
    experts: Range | None = None  # a mixture's experts [start, stop) whose ffn_cols this shard holds; None: all

    @classmethod
    def full(cls, cfg: ModelConfig) -> "ShardSpec":
        return cls((0, cfg.n_kv_heads), (0, cfg.ffn), (0, cfg.vocab))

    def layer_range(self, n_layers: int) -> Range:
        """The layers this shard runs; ValueError unless they lie within the model's."""
        a, b = self.layers if self.layers is not None else (0, n_layers)
        if not 0 <= a <= b <= n_layers:
            raise ValueError(f"layers {a}:{b} is not a range within 0:{n_layers}")
        return a, b

    def expert_range(self, n_experts: int) -> Range:
        """The experts this shard holds; ValueError unless they lie within the model's."""
        a, b = self.experts if self.experts is not None else (0, n_experts)
        if not 0 <= a <= b <= n_experts:
            raise ValueError(f"experts {a}:{b} is not a range within 0:{n_experts}")
        return a, b


@dataclass(frozen=True)
class Layer:
    attn_norm: np.ndarray              # (dim,)
    wq: quant.Weight | None            # (heads_l * hd, dim)
    wk: quant.Weight | None            # (kv_l * hd, dim)
    wv: quant.Weight | None            # (kv_l * hd, dim)
    bq: np.ndarray | None              # (heads_l * hd,) qwen2 only
    bk: np.ndarray | None
    bv: np.ndarray | None
    wo: quant.Weight | None            # (dim, heads_l * hd)
    q_norm: np.ndarray | None          # (hd,) RMSNorm weight of every query head, before rope (qwen3)
    k_norm: np.ndarray | None          # (hd,) of every key head
    ffn_norm: np.ndarray               # (dim,)
    attn_post_norm: np.ndarray | None  # (dim,) RMSNorm of the summed attention output (gemma)
    ffn_post_norm: np.ndarray | None   # (dim,) of the summed FFN output
    w_gate: quant.Weight | None        # (ffn_l, dim)
    w_up: quant.Weight | None          # (ffn_l, dim)
    w_down: quant.Weight | None        # (dim, ffn_l)
    moe: moe.Experts | None = None     # a mixture of experts instead of w_gate/w_up/w_down (ffn_l of each expert)


@dataclass(frozen=True)
class Weights:
    cfg: ModelConfig
    spec: ShardSpec
    layers: tuple[Layer, ...]          # layers layer0.. of the model (a pipeline stage holds some)
    out_norm: np.ndarray | None        # (dim,); None on a stage before the last: it hands on the residual
    lm_head: quant.Weight | None       # (vocab_l, dim)
    rope_freqs: np.ndarray | None      # llama-3 rope scaling factors, (rope_dims/2,)
    layer0: int = 0                    # the model's index of layers[0]
    rope_long: np.ndarray | None = None   # phi3's factors for contexts beyond rope_ctx_orig, (rope_dims/2,)
    rope_short: np.ndarray | None = None  # and for the others

    @property
    def nbytes(self) -> int:
        """Bytes of this shard's matrices (what its matvecs stream per token)."""
        mats = [w for layer in self.layers for w in (layer.wq, layer.wk, layer.wv, layer.wo,
                                                     layer.w_gate, layer.w_up, layer.w_down)]
        experts = sum(layer.moe.nbytes for layer in self.layers if layer.moe is not None)
        return experts + sum(w.nbytes for w in mats + [self.lm_head] if w is not None)


def _rows(w: quant.Weight, r: Range, skip: int = 0) -> quant.Weight | None:
    """Rows r of w, after its first `skip` rows (a part of a fused tensor); a view."""
    return None if r[0] == r[1] else quant.slice_rows(w, r[0] + skip, r[1] + skip)


def rope_factors(w: Weights, ctx: int) -> np.ndarray | None:
    """The frequency factors of a shard whose sequences hold `ctx` positions, as llama.cpp's
    get_rope_factors: rope_freqs where the file has it (llama 3); else phi3's long factors when
    ctx is beyond the original training context (n_ctx_seq > n_ctx_orig_yarn), its short ones otherwise."""
    if w.rope_freqs is not None:
        return w.rope_freqs
    return w.rope_long if ctx > w.cfg.rope_ctx_orig else w.rope_short


def _cols(w: quant.Weight, r: Range) -> quant.Weight | None:
    """Input-column slice; exact f32 copy when the range splits a quant block."""
    if r[0] == r[1]:
        return None
    if r == (0, w.cols):
        return w
    try:
        return quant.slice_cols(w, *r)
    except ValueError:
        dense = np.ascontiguousarray(quant.dequantize_rows(w, 0, w.rows)[:, r[0]:r[1]])
        return quant.Weight(int(GGMLQuantizationType.F32), w.rows, r[1] - r[0], dense.view(np.uint8))


def stored_spec(mf: ModelFile) -> ShardSpec | None:
    """The spec a shard file holds, None for a whole model file."""
    meta = mf.metadata
    if SHARD_KEYS["kv_groups"] not in meta:
        return None
    ranges = (tuple(int(v) for v in meta[SHARD_KEYS[k]]) for k in ("kv_groups", "ffn_cols", "vocab_rows"))
    layers, experts = (tuple(int(v) for v in meta[SHARD_KEYS[k]]) if SHARD_KEYS[k] in meta else None
                       for k in ("layers", "experts"))
    return ShardSpec(*ranges, layers, experts)


def load_weights(mf: ModelFile, spec: ShardSpec | None = None) -> Weights:
    """Map this shard's slices of the file (zero-copy where the layout allows).

    A shard file holds one spec's slices already cut: it loads for that spec only,
    its ranges read from offset 0 of the stored slices.
    """
    cfg = mf.config
    stored = stored_spec(mf)
    spec = spec or stored or ShardSpec.full(cfg)
    local = spec  # ranges into the file's tensors
    if stored is not None:
        if spec != stored:
            raise ShardMismatch(f"{mf.path} holds the shard {stored}, not {spec}")
        cfg = replace(cfg, vocab=int(mf.metadata[SHARD_KEYS["vocab"]]))
        local = ShardSpec(*((0, b - a) for a, b in (spec.kv_groups, spec.ffn_cols, spec.vocab_rows)), spec.layers,
                          spec.experts)
    first, last = spec.layer_range(cfg.n_layers)
    hd, g = cfg.head_dim, cfg.group_size
    kv = (local.kv_groups[0] * hd, local.kv_groups[1] * hd)
    qh = (kv[0] * g, kv[1] * g)
    # fused tensors (phi3) hold the KV groups and FFN columns of the file: all, or a shard file's
    held_kv = cfg.n_kv_heads if stored is None else spec.kv_groups[1] - spec.kv_groups[0]
    held_ffn = cfg.ffn if stored is None else spec.ffn_cols[1] - spec.ffn_cols[0]
    k_at, v_at = held_kv * g * hd, held_kv * (g + 1) * hd  # first rows of k and of v in attn_qkv

    def vector(name: str) -> np.ndarray | None:
        return mf.vector(name) if mf.has(name) else None

    def bias(name: str, r: Range) -> np.ndarray | None:
        return mf.vector(name)[r[0]:r[1]].copy() if mf.has(name) else None

    def dense(name: str, cut: Callable[[quant.Weight, Range], quant.Weight | None]) -> quant.Weight | None:
        return None if cfg.n_experts else cut(mf.weight(name), local.ffn_cols)

    layers = []
    for i in range(first, last):
        p = f"blk.{i}."
        if cfg.fused_qkv:
            qkv = mf.weight(p + "attn_qkv.weight")
            wq, wk, wv = _rows(qkv, qh), _rows(qkv, kv, k_at), _rows(qkv, kv, v_at)
        else:
            wq, wk, wv = (_rows(mf.weight(p + f"attn_{x}.weight"), r) for x, r in (("q", qh), ("k", kv), ("v", kv)))
        if cfg.fused_gate_up:  # phi3: ffn_up holds gate | up
            up = mf.weight(p + "ffn_up.weight")
            w_gate, w_up = _rows(up, local.ffn_cols), _rows(up, local.ffn_cols, held_ffn)
        else:
            w_gate, w_up = dense(p + "ffn_gate.weight", _rows), dense(p + "ffn_up.weight", _rows)
        layers.append(Layer(
            attn_norm=mf.vector(p + "attn_norm.weight"),
            wq=wq,
            wk=wk,
            wv=wv,
            bq=bias(p + "attn_q.bias", qh),
            bk=bias(p + "attn_k.bias", kv),
            bv=bias(p + "attn_v.bias", kv),
            wo=_cols(mf.weight(p + "attn_output.weight"), qh),
            q_norm=mf.vector(p + "attn_q_norm.weight") if cfg.qk_norm else None,
            k_norm=mf.vector(p + "attn_k_norm.weight") if cfg.qk_norm else None,
            ffn_norm=mf.vector(p + "ffn_norm.weight"),
            attn_post_norm=mf.vector(p + "post_attention_norm.weight") if cfg.post_norms else None,
            ffn_post_norm=mf.vector(p + "post_ffw_norm.weight") if cfg.post_norms else None,
            w_gate=w_gate,
            w_up=w_up,
            w_down=dense(p + "ffn_down.weight", _cols),
            moe=_experts(mf, p, local.ffn_cols, spec, stored is not None) if cfg.n_experts else None,
        ))
    head = mf.weight("token_embd.weight" if cfg.tied else "output.weight")
    return Weights(
        cfg=cfg,
        spec=spec,
        layers=tuple(layers),
        out_norm=mf.vector("output_norm.weight") if last == cfg.n_layers else None,
        layer0=first,
        lm_head=_rows(head, local.vocab_rows),
        rope_freqs=vector("rope_freqs.weight"),
        rope_long=vector("rope_factors_long.weight"),
        rope_short=vector("rope_factors_short.weight"),
    )


def _experts(mf: ModelFile, p: str, cols: Range, spec: ShardSpec, stored: bool) -> moe.Experts:
    """Layer p's router, whole, and columns `cols` of each expert the spec holds, sliced as a dense FFN
    (None for the other experts); a shared expert's gate, whole, and its columns of the shared expert
    (ModelConfig.shared_cols). A shard file stores the held experts and columns only, from index 0."""
    cfg = mf.config
    held = spec.expert_range(cfg.n_experts)

    def cut(name: str, how: Callable[[quant.Weight, Range], quant.Weight | None]) -> tuple[quant.Weight | None, ...]:
        mats = mf.experts(p + name)
        first = held[0] if stored else 0
        return tuple(how(mats[x - first], cols) if held[0] <= x < held[1] else None for x in range(cfg.n_experts))

    return moe.Experts(
        router=mf.weight(p + "ffn_gate_inp.weight"),
        gate=cut("ffn_gate_exps.weight", _rows), up=cut("ffn_up_exps.weight", _rows),
        down=cut("ffn_down_exps.weight", _cols),
        used=cfg.n_experts_used, norm=cfg.expert_norm, scale=cfg.expert_scale,
        shared=_shared(mf, p, cfg.shared_cols(spec.ffn_cols, spec.experts), stored) if cfg.ffn_shared else None)


def _shared(mf: ModelFile, p: str, cols: Range, stored: bool) -> moe.Shared:
    """Layer p's shared expert: its gate (a vector, as a one-row f32 matrix for the exact kernel) and
    columns `cols` of its FFN (of a shard file: all it stores)."""
    z = np.ascontiguousarray(mf.vector(p + "ffn_gate_inp_shexp.weight"), np.float32)
    local = (0, cols[1] - cols[0]) if stored else cols
    return moe.Shared(
        gate_inp=quant.Weight(int(GGMLQuantizationType.F32), 1, z.shape[0], z.view(np.uint8).reshape(1, -1)),
        gate=_rows(mf.weight(p + "ffn_gate_shexp.weight"), local), up=_rows(mf.weight(p + "ffn_up_shexp.weight"), local),
        down=_cols(mf.weight(p + "ffn_down_shexp.weight"), local))


def _no_reduce(partial: np.ndarray) -> None:
    return None


@dataclass
class Shard:
    """One shard's forward pass over its own KV cache."""

    w: Weights
    ctx: int
    reduce: Reduce = _no_reduce
    fast_decode: bool = True  # one token through decode.Plan (False: the per-op path, as for batches)
    slots: int = 1  # KV caches, one per sequence a step may carry (forward's slot, forward_rows's slots)
    kv_type: str = "f16"  # what the KV caches hold: kvcache.KV_TYPES ("f16" as llama.cpp, "f32" or "q8_0")
    sync_pieces: int = 1  # a decode step's partials in this many pieces (passes.cuts), each sent while the next computes
    # per layer (slots, n_kv, ctx, head_dim) of kv_type; q8_0: (slots, n_kv, ctx, head_dim / 32) kvcache.Q8_0 blocks
    k_cache: list[np.ndarray] = field(init=False, repr=False)
    v_cache: list[np.ndarray] = field(init=False, repr=False)
    k_bits: list[np.ndarray] = field(init=False, repr=False)  # the same memory as the compiled kernels see it
    v_bits: list[np.ndarray] = field(init=False, repr=False)  # (kvcache.kernel_view: uint16 for f16, bytes for q8_0)
    _plans: dict[bool, decode.Plan] = field(init=False, repr=False, default_factory=dict)  # by int8_decode()
    _row_plans: dict[bool, decode.Plan] = field(init=False, repr=False, default_factory=dict)  # `slots` rows

    def __post_init__(self) -> None:
        cfg, spec = self.w.cfg, self.w.spec
        self.n_kv = spec.kv_groups[1] - spec.kv_groups[0]
        self.n_heads = self.n_kv * cfg.group_size
        held = spec.expert_range(cfg.n_experts)
        self.n_ffn = spec.ffn_cols[1] - spec.ffn_cols[0] if held[0] < held[1] or not cfg.n_experts else 0
        # per layer and expert: the tokens routed to it (a mixture's layers; zeros elsewhere)
        self.expert_hits = np.zeros((len(self.w.layers), cfg.n_experts), np.int64)
        if self.slots < 1:
            raise ValueError(f"a shard needs at least one KV slot, got {self.slots}")
        if not isinstance(self.sync_pieces, int) or self.sync_pieces < 1:
            raise ValueError(f"sync_pieces must be a positive integer, got {self.sync_pieces!r}")
        shape = (self.slots, self.n_kv, self.ctx, cfg.head_dim)
        self.k_cache = [kvcache.kv_cache(self.kv_type, shape) for _ in self.w.layers]
        self.v_cache = [kvcache.kv_cache(self.kv_type, shape) for _ in self.w.layers]
        self.k_bits = [kvcache.kernel_view(c) for c in self.k_cache]
        self.v_bits = [kvcache.kernel_view(c) for c in self.v_cache]
        freqs, mscale = rope_factors(self.w, self.ctx), cfg.rope_mscale()
        yarn = (cfg.rope_ctx_orig, cfg.yarn_beta_fast, cfg.yarn_beta_slow) if cfg.rope_yarn else None
        self.cos, self.sin = ops.rope_table(self.ctx, cfg.rope_dims, cfg.rope_theta, freqs, cfg.rope_scale, mscale,
                                            yarn)
        if any(cfg.is_local(i) for i in range(cfg.n_layers)):  # sliding-window layers' own rope
            self.cos_swa, self.sin_swa = ops.rope_table(self.ctx, cfg.rope_dims, cfg.rope_theta_swa, freqs,
                                                        cfg.rope_scale_swa, mscale, yarn)

    @property
    def max_rows(self) -> int:
        """Rows one decode step may carry: one per slot, and at least STEP_ROWS; rows of one slot at
        distinct positions each get the bits of their own step (every row's K and V are written
        before any row attends)."""
        return max(self.slots, STEP_ROWS)

    @property
    def kv_bytes(self) -> int:
        return sum(c.nbytes for c in self.k_cache + self.v_cache)

    def copy_kv(self, src: int, dst: int, a: int, b: int) -> None:
        """Positions a..b-1 of slot src's keys and values into slot dst, in every layer held here (a
        prompt prefix another sequence computed: the same bits a prefill of it would write)."""
        if not (0 <= src < self.slots and 0 <= dst < self.slots and src != dst and 0 <= a <= b <= self.ctx):
            raise ValueError(f"cannot copy positions {a}..{b} of KV slot {src} into slot {dst} "
                             f"({self.slots} slots of {self.ctx} positions)")
        for cache in self.k_cache + self.v_cache:
            cache[dst, :, a:b] = cache[src, :, a:b]

    def forward(self, x: np.ndarray, pos: int, slot: int = 0) -> np.ndarray:
        """Run every layer on x: (n, dim) hidden states of positions pos..pos+n-1 of one
        sequence, whose KV cache is slot `slot`, in place.

        Returns x after the final norm, (n, dim); a pipeline stage before the last
        returns the residual stream x itself, for the next stage.
        """
        return passes.run(self.forward_steps(x, pos, slot), self.reduce)

    def forward_steps(self, x: np.ndarray, pos: int, slot: int = 0) -> passes.Steps:
        """forward one half-layer at a time (passes.py): yields each partial for the caller to sum."""
        n = x.shape[0]
        if not 0 <= slot < self.slots:
            raise ValueError(f"KV slot {slot} does not exist: this shard holds slots 0 to {self.slots - 1}")
        if pos + n > self.ctx:
            raise ContextFull(f"context is full: {pos + n} positions needed, the KV cache holds {self.ctx}")
        if n == 1 and self.fast_decode:
            int8 = quant.int8_decode()
            if int8 not in self._plans:
                self._plans[int8] = decode.Plan(self, int8)
            return (yield from self._plans[int8].steps(x, np.array([slot], np.int64), np.array([pos], np.int64)))
        cfg = self.w.cfg
        h = np.empty_like(x)
        for i, layer in enumerate(self.w.layers):
            ops.rmsnorm(x, layer.attn_norm, cfg.norm_eps, h)
            partial = self._attention(i, layer, h, pos, slot)
            yield partial
            if layer.attn_post_norm is not None:
                ops.rmsnorm(partial, layer.attn_post_norm, cfg.norm_eps, partial)
            x += partial
            ops.rmsnorm(x, layer.ffn_norm, cfg.norm_eps, h)
            partial = self._ffn(i, layer, h)
            yield partial
            if layer.ffn_post_norm is not None:
                ops.rmsnorm(partial, layer.ffn_post_norm, cfg.norm_eps, partial)
            x += partial
        if self.w.out_norm is None:
            return x
        ops.rmsnorm(x, self.w.out_norm, cfg.norm_eps, h)
        return h

    def forward_rows(self, x: np.ndarray, slots, positions) -> np.ndarray:
        """One decode step of several sequences: x (B, dim), row b the token at positions[b] of
        the sequence in KV slot slots[b], in place; each (slot, position) once, so several rows of
        one slot feed its tokens at once (a replay does). Returns (B, dim) after the final norm.

        Row b's result and what it writes to its slot are the bits of
        forward(x[b:b+1], positions[b], slot=slots[b]) alone, whatever the other rows; the
        integer kernels read each weight once for all B (intdot.TokenProducts), the float
        kernels run row by row. reduce gets one (B, dim) partial per half-layer. A pipeline
        stage before the last returns the residual stream, as forward does.
        """
        return passes.run(self.rows_steps(x, slots, positions), self.reduce)

    def rows_steps(self, x: np.ndarray, slots, positions) -> passes.Steps:
        """forward_rows one half-layer at a time (passes.py): yields each partial for the caller to sum."""
        B = x.shape[0]
        sl, ps = np.asarray(slots, np.int64).reshape(-1), np.asarray(positions, np.int64).reshape(-1)
        if x.ndim != 2 or x.shape[1] != self.w.cfg.dim or x.dtype != np.float32 or not x.flags.c_contiguous:
            raise ValueError(f"x must be C-contiguous float32 (B, {self.w.cfg.dim}), got {x.dtype} {x.shape}")
        if not 1 <= B <= self.max_rows or sl.shape != (B,) or ps.shape != (B,):
            raise ValueError(f"{B} rows, {sl.shape[0]} slots and {ps.shape[0]} positions: a step carries "
                             f"1 to {self.max_rows} rows, one slot and position each")
        if sl.min() < 0 or sl.max() >= self.slots:
            raise ValueError(f"KV slots {sl.tolist()} must each be 0 to {self.slots - 1}")
        if len(set(zip(sl.tolist(), ps.tolist()))) != B:
            raise ValueError(f"rows at (slot, position) {list(zip(sl.tolist(), ps.tolist()))} must be distinct")
        if ps.min() < 0 or ps.max() >= self.ctx:
            raise ContextFull(f"context is full: position {int(ps.max())} needed, the KV cache holds {self.ctx}")
        int8 = quant.int8_decode()
        if int8 not in self._row_plans:
            self._row_plans[int8] = decode.Plan(self, int8, self.max_rows)
        return (yield from self._row_plans[int8].steps(x, sl, ps))

    def forward_mixed(self, x: np.ndarray, slots, positions, pos: int, slot: int) -> np.ndarray:
        """One step of decode rows and a prefill chunk in one pass: x (B + n, dim), its first B rows
        forward_rows's (slots, positions), the other n a chunk at pos.. of KV slot `slot` (not one
        of `slots`), in place. Returns (B + n, dim): forward_rows's rows, then forward's.

        Each half-layer's partials of both go through reduce as one (B + n, dim) array (in a
        cluster one round trip, not two); everything else is computed as the two calls alone
        compute it, so every row and cache entry is their bits.
        """
        B = len(slots)
        if not 0 < B < x.shape[0]:
            raise ValueError(f"a mixed step needs decode rows and chunk rows: {B} rows of {x.shape[0]} are decode rows")
        if slot in list(slots):
            raise ValueError(f"KV slot {slot} cannot take a prefill chunk and a decode row in one step")
        rows, chunk = passes.together([self.rows_steps(x[:B], slots, positions),
                                       self.forward_steps(x[B:], pos, slot)], self.reduce)
        return np.concatenate([rows, chunk])

    def logits_rows(self, h: np.ndarray) -> np.ndarray:
        """logits for B decoded tokens at once, h (B, dim): row b the bits of logits(h[b:b+1])[0]
        (the head read once for all rows on the integer kernels; EXACT_TOP refined per row)."""
        head = self.w.lm_head
        B = h.shape[0]
        out = np.zeros((B, 0 if head is None else head.rows), np.float32)
        if head is None or B == 0:
            return out
        if B == 1:
            return self.logits(h)
        h = np.ascontiguousarray(h, np.float32)
        decode.matvec_rows(head, h, out)
        for b in range(B):
            quant.refine_top(head, h[b], out[b], EXACT_TOP)
        return self._softcap(out)

    def logits(self, h: np.ndarray) -> np.ndarray:
        """This shard's vocabulary rows of the logits: (n, vocab_l).

        Decoding (n == 1), the EXACT_TOP largest are recomputed exactly (quant.refine_top):
        the head picks the token, and the int8 rounding of h flips near-ties. SmolLM2's
        answer to "What is the capital of France?" starts on a 0.08-logit tie between
        "The" and "L"; llama.cpp's rounding answers "L'Étoile, la Cité..." and so did
        the integer kernels alone. Exact candidates are also the same bits on every CPU.
        """
        head = self.w.lm_head
        out = np.zeros((h.shape[0], 0 if head is None else head.rows), np.float32)
        if head is not None:
            _apply(head, h, out)
            if h.shape[0] == 1:
                quant.refine_top(head, h[0], out[0], EXACT_TOP)
        return self._softcap(out)

    def _softcap(self, logits: np.ndarray) -> np.ndarray:
        """gemma2's final soft-cap, cap * tanh(logit / cap), in f32 steps as llama.cpp (elementwise:
        each shard caps its own vocabulary rows)."""
        cap = self.w.cfg.final_softcap
        if cap > 0.0:
            logits[:] = np.tanh(logits * np.float32(1.0 / cap)) * np.float32(cap)
        return logits

    def _attention(self, i: int, layer: Layer, h: np.ndarray, pos: int, slot: int) -> np.ndarray:
        cfg = self.w.cfg
        n, hd = h.shape[0], cfg.head_dim
        partial = np.zeros((n, cfg.dim), np.float32)
        if self.n_kv == 0:
            return partial
        q = np.empty((n, self.n_heads * hd), np.float32)
        k = np.empty((n, self.n_kv * hd), np.float32)
        v = np.empty((n, self.n_kv * hd), np.float32)
        hb = quant.Batch(h)
        _apply(layer.wq, hb, q)
        _apply(layer.wk, hb, k)
        _apply(layer.wv, hb, v)
        if layer.bq is not None:
            q += layer.bq
            k += layer.bk
            v += layer.bv
        if layer.q_norm is not None:
            ops.rmsnorm_heads(q, hd, layer.q_norm, cfg.norm_eps)
            ops.rmsnorm_heads(k, hd, layer.k_norm, cfg.norm_eps)
        local = cfg.is_local(self.w.layer0 + i)  # i: this shard's layer, of a pipeline stage's range
        cos, sin = (self.cos_swa, self.sin_swa) if local else (self.cos, self.sin)
        window = cfg.swa_window if local else 0
        rope_dims = cfg.layer_rope_dims(self.w.layer0 + i)  # 0: a NoPE layer (smollm3)
        ops.rope(q, self.n_heads, hd, rope_dims, pos, cos, sin, cfg.rope_neox)
        ops.rope(k, self.n_kv, hd, rope_dims, pos, cos, sin, cfg.rope_neox)
        if cfg.attn_temp_scale:  # mistral3's query temperature
            ops.temper(q, pos, cfg.attn_temp_scale, max(cfg.rope_ctx_orig, 1))
        kb, vb = self.k_bits[i][slot], self.v_bits[i][slot]
        kvcache.kv_write_rows(kb, pos, k.reshape(n, self.n_kv, hd))
        kvcache.kv_write_rows(vb, pos, v.reshape(n, self.n_kv, hd))
        att = np.empty_like(q)
        if n == 1:
            ops.attention(q, kb, vb, pos, cfg.group_size, att, quant.threads(), cfg.attn_scale, window,
                          cfg.attn_softcap)
        else:
            ops.attention_batch(q, self.k_cache[i][slot], self.v_cache[i][slot], pos, cfg.group_size, att,
                                cfg.attn_scale, window, cfg.attn_softcap)
        _apply(layer.wo, att, partial)
        return partial

    def _ffn(self, i: int, layer: Layer, h: np.ndarray) -> np.ndarray:
        n = h.shape[0]
        partial = np.zeros((n, self.w.cfg.dim), np.float32)
        if self.n_ffn == 0:
            return partial
        if layer.moe is not None:
            moe.ffn(layer.moe, h, partial, self.w.cfg.geglu, self.expert_hits[i])
            return partial
        gate = np.empty((n, self.n_ffn), np.float32)
        up = np.empty((n, self.n_ffn), np.float32)
        hb = quant.Batch(h)
        _apply(layer.w_gate, hb, gate)
        _apply(layer.w_up, hb, up)
        if self.w.cfg.geglu:
            ops.gelu_mul(gate, up)
        else:
            ops.silu_mul(gate, up)
        _apply(layer.w_down, gate, partial)
        return partial


_apply = quant.apply


def embed(mf: ModelFile, token_ids: list[int]) -> np.ndarray:
    """Embedding rows for the given tokens: (n, dim) f32 (only those rows are read, from the file)."""
    table = mf.weight("token_embd.weight")
    ids = list(token_ids)
    rows = quant.dequantize_rows(quant.Weight(table.qtype, len(ids), table.cols, pages.read_rows(table.data, ids)), 0, len(ids))
    if mf.config.embed_scale != 1.0:  # gemma: times sqrt(dim), in f32 as llama.cpp's ggml_scale
        rows *= np.float32(mf.config.embed_scale)
    return rows
