"""From a model file and a plan to the slice a node maps: the declarative bridge.

`model_shape` tells the planner what one unit of work costs in this file's
actual tensor types; `spec_for` turns a node's share of a plan into the
ShardSpec the forward pass loads (llama.load_weights does the slicing).
"""

from __future__ import annotations

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from edgetp.model import kvcache
from edgetp.model.gguf import ModelFile, split_block
from edgetp.model.llama import ShardSpec
from edgetp.parallel.plan import ModelShape, Plan, PlanError


def _bpw(mf: ModelFile, name: str) -> float:
    """Bytes per weight of a tensor's storage type."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(mf.tensors[name].tensor_type)]
    return size / block


def _block(mf: ModelFile, name: str) -> int:
    return GGML_QUANT_SIZES[GGMLQuantizationType(mf.tensors[name].tensor_type)][0]


def model_shape(mf: ModelFile, ctx: int, slots: int = 1, kv_type: str = "f16") -> ModelShape:
    """The planner's view of mf with KV caches of ctx positions for `slots` sequences, of kv_type values
    (ValueError, one line, for a type the model's head size cannot hold)."""
    cfg = mf.config
    row_bytes = kvcache.kv_row_bytes(kv_type, cfg.head_dim)  # one head's values at one position, as llama.Shard holds them
    head = "token_embd.weight" if cfg.tied else "output.weight"
    # FFN columns are the input columns of ffn_down: a unit must not split its quant blocks.
    # A mixture's column holds that column of every expert (all of them in memory).
    exps = "_exps" if cfg.n_experts else ""
    ffn_block = split_block(cfg.ffn, _block(mf, f"blk.0.ffn_down{exps}.weight"))
    return ModelShape(
        n_layers=cfg.n_layers,
        dim=cfg.dim,
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        ffn=cfg.ffn,
        vocab=cfg.vocab,
        ffn_block=ffn_block,
        vocab_block=32,
        attn_bpw=_bpw(mf, "blk.0.attn_qkv.weight" if cfg.fused_qkv else "blk.0.attn_q.weight"),
        ffn_bpw=_bpw(mf, f"blk.0.ffn_up{exps}.weight") * max(cfg.n_experts, 1),
        vocab_bpw=_bpw(mf, head),
        kv_bytes_per_head_pos=2 * row_bytes,  # K and V
        ctx=ctx,
        slots=slots,
        n_experts=cfg.n_experts,
        experts_used=cfg.n_experts_used,
        shared_bpw=_bpw(mf, "blk.0.ffn_up_shexp.weight") * cfg.ffn_shared / cfg.ffn if cfg.ffn_shared else 0.0,
    )


def local_slots(mf: ModelFile, ctx: int, slots: int, kv_type: str, free: int) -> int:
    """Slots whose KV caches fit `free` bytes on one node, up to `slots`: halved, as a cluster plan's
    are, until they fit beside the model's weights (or to one, which a model read from disk as it
    runs may still serve); PlanError (one line) when one slot's cache alone exceeds `free`."""
    per_slot = model_shape(mf, ctx, 1, kv_type).group_kv_bytes * mf.config.n_kv_heads
    room = free - mf.path.stat().st_size
    n = slots
    while n > 1 and n * per_slot > room:
        n //= 2
    if per_slot > free:
        raise PlanError(f"a KV cache of {ctx} positions needs {per_slot / 1e9:.2f} GB and {free / 1e9:.2f} GB "
                        "are free: lower --ctx")
    return n


def spec_for(plan: Plan, node_id: str) -> ShardSpec:
    share = plan.share(node_id)
    layers = None if share.layers is None else tuple(share.layers)
    experts = None if share.experts is None else tuple(share.experts)
    return ShardSpec(tuple(share.kv_groups), tuple(share.ffn_cols), tuple(share.vocab_rows), layers, experts)
