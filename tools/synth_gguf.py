#!/usr/bin/env python3
"""Write synthetic llama-family GGUF models with random weights (llama, qwen3, gemma2, gemma3, phi3,
and the mixtures of experts qwen3moe, mixtral and qwen2moe, the last with a shared expert).

For tests and benchmarks: any shape, any of the common tensor types, a
synthetic SentencePiece-style vocabulary, and the metadata llama.cpp needs to
load the file.  The weights are random but scaled so a forward pass stays
numerically sane (every linear layer's weights have std ~ 1/sqrt(fan_in),
norm weights ~ 1), so logits are finite and of order one.

Quantized tensors are produced directly as random, valid blocks (random quant
bits, f16 scales chosen so the dequantized values have the intended std); no
per-element Python loops, so the 1B preset in Q8_0 takes seconds, not minutes.

    python tools/synth_gguf.py OUT.gguf --preset llama-3.2-1b --type q8_0
    python tools/synth_gguf.py OUT.gguf --dim 96 --layers 3 --heads 6 \\
        --kv-heads 3 --ffn 224 --vocab 600 --type q4_0
    python tools/synth_gguf.py OUT.gguf --preset tiny-headdim --arch qwen3
    python tools/synth_gguf.py OUT.gguf --preset tiny-headdim --arch gemma2 --swa-window 8
    python tools/synth_gguf.py OUT.gguf --preset tiny-odd --head-dim 16 --arch phi3 --rope-ctx-orig 128
    python tools/synth_gguf.py OUT.gguf --preset tiny-odd --arch qwen3moe --experts 8 --experts-used 2
    python tools/synth_gguf.py OUT.gguf --preset tiny-odd --arch qwen2moe --experts 16 --experts-used 4 --shared-ffn 320

Library use: ``write_model(path, dim=..., ...)`` or
``write_preset(path, "tiny-odd", weight_type="q8_0")``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

import gguf

from edgetp.model.gguf import gguf_writer
from gguf import GGMLQuantizationType as QT
from gguf import LlamaFileType, TokenType

QK_K = 256

#: name -> (ggml type, llama file type)
TYPES: dict[str, tuple[QT, LlamaFileType]] = {
    "f32": (QT.F32, LlamaFileType.ALL_F32),
    "f16": (QT.F16, LlamaFileType.MOSTLY_F16),
    "bf16": (QT.BF16, LlamaFileType.MOSTLY_BF16),
    "q8_0": (QT.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (QT.Q4_0, LlamaFileType.MOSTLY_Q4_0),
    "q4_1": (QT.Q4_1, LlamaFileType.MOSTLY_Q4_1),
    "q5_0": (QT.Q5_0, LlamaFileType.MOSTLY_Q5_0),
    "q5_1": (QT.Q5_1, LlamaFileType.MOSTLY_Q5_1),
    "iq4_nl": (QT.IQ4_NL, LlamaFileType.MOSTLY_IQ4_NL),
    "q2_k": (QT.Q2_K, LlamaFileType.MOSTLY_Q2_K),
    "q3_k": (QT.Q3_K, LlamaFileType.MOSTLY_Q3_K_S),
    "q4_k": (QT.Q4_K, LlamaFileType.MOSTLY_Q4_K_S),
    "q5_k": (QT.Q5_K, LlamaFileType.MOSTLY_Q5_K_S),
    "q6_k": (QT.Q6_K, LlamaFileType.MOSTLY_Q6_K),
    "iq4_xs": (QT.IQ4_XS, LlamaFileType.MOSTLY_IQ4_XS),
}

#: architectures this writer knows: name -> per-layer norm weights beyond llama's tensors, each
#: with its width ("head": head_dim, "dim"). qwen3: an RMSNorm for every head of q and of k;
#: gemma2: norms of the attention and FFN outputs; gemma3: both. (Gemma's norm weights are
#: stored as 1 + w, as llama.cpp's converter writes them: random values around 1 here too.)
#: phi3 has none, but fuses tensors (FUSED) and carries rope factors (ROPE_FACTORS).
_QK = (("attn_q_norm.weight", "head"), ("attn_k_norm.weight", "head"))
_POST = (("post_attention_norm.weight", "dim"), ("post_ffw_norm.weight", "dim"))
ARCHS: dict[str, tuple[tuple[str, str], ...]] = {
    "llama": (),
    "qwen3": _QK,
    "gemma2": _POST,
    "gemma3": _QK + _POST,
    "phi3": (),
    "qwen3moe": _QK,  # qwen3's attention, a mixture of experts for the FFN
    "mixtral": (),    # llama with a mixture of experts, written as general.architecture "llama"
    "qwen2moe": (),   # qwen2's attention (q/k/v biases), experts and a shared expert (SHARED)
    "smollm3": (),    # llama's tensors; every 4th layer takes no rope (llama.cpp: hard-coded, no key)
    "mistral3": (),   # llama's tensors; YaRN and a query temperature (MISTRAL3_KEYS)
}
#: mistral3's keys beyond llama's, written only when given: YaRN's betas and log multiplier, the query temperature
MISTRAL3_KEYS = ("yarn_beta_fast", "yarn_beta_slow", "yarn_log_mul", "attn_temp_scale")
MOE_ARCHS = ("qwen3moe", "mixtral", "qwen2moe")  # need --experts and --experts-used
#: q, k and v with biases (qwen2's attention), and a shared expert every token goes through beside the
#: routed ones, gated per token by a sigmoid of ffn_gate_inp_shexp . h; llama.cpp requires output.weight
#: llama.cpp reads its attn_q and attn_output as dim x dim (SQUARE)
BIASED = SHARED = UNTIED = SQUARE = ("qwen2moe",)
FILE_ARCH = {"mixtral": "llama"}     # general.architecture where it is not the name here
#: phi3's fused tensors, as llama.cpp's converter writes them: attn_qkv holds the rows of q, then k,
#: then v; ffn_up holds 2 * ffn rows, the gate's then up's (there is no attn_q/k/v nor ffn_gate)
FUSED = ("phi3",)
#: phi3's rope frequency factors (rope_dims / 2 each), model-wide: llama.cpp takes the long ones when
#: a sequence's context exceeds rope.scaling.original_context_length, the short ones otherwise
ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")
#: llama 3.1's rope scaling as its converter stores it: one factor per rotated pair, whatever the context
ROPE_FREQS = "rope_freqs.weight"

PRESETS: dict[str, dict[str, Any]] = {
    # Real shapes (random weights): for benchmarks.
    "llama-3.2-1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn=8192, vocab=128256,
                         head_dim=64, ctx=8192, rope_theta=500000.0, norm_eps=1e-5, tied=True),
    "llama-3.2-3b": dict(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn=8192, vocab=128256,
                         head_dim=128, ctx=8192, rope_theta=500000.0, norm_eps=1e-5, tied=True),
    "tinyllama-1.1b": dict(dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, ffn=5632, vocab=32000,
                           ctx=2048, rope_theta=10000.0, norm_eps=1e-5, tied=False),
    # A small mixture, 16 experts top-4 (0.5B in all, 0.16B read per token): qwen3moe's layout.
    "qwen3moe-16x4": dict(dim=1024, n_layers=8, n_heads=16, n_kv_heads=4, head_dim=64, ffn=1024, vocab=32000,
                          ctx=4096, rope_theta=1e6, norm_eps=1e-6, tied=False, arch="qwen3moe", n_experts=16,
                          n_experts_used=4),
    # The other families at their own small shapes (phi3's smallest is 3.8B: the llama 1B shape instead).
    "qwen3-1.7b": dict(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, ffn=6144, vocab=151936,
                       ctx=40960, rope_theta=1e6, norm_eps=1e-6, tied=True, arch="qwen3"),
    "gemma3-1b": dict(dim=1152, n_layers=26, n_heads=4, n_kv_heads=1, head_dim=256, ffn=6912, vocab=262144,
                      ctx=32768, rope_theta=1e6, norm_eps=1e-6, tied=True, arch="gemma3", swa_window=512,
                      rope_theta_swa=10000.0),
    # gemma2's smallest is 2B: its layers (soft-caps, a 4096 window every 2nd layer) at the Gemma 3 1B shape
    "gemma2-1b": dict(dim=1152, n_layers=26, n_heads=4, n_kv_heads=1, head_dim=256, ffn=6912, vocab=256000,
                      ctx=8192, rope_theta=10000.0, norm_eps=1e-6, tied=True, arch="gemma2", swa_window=4096),
    "phi3-1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64, ffn=8192, vocab=32064,
                    ctx=4096, rope_theta=10000.0, norm_eps=1e-5, tied=False, arch="phi3", rope_ctx_orig=4096,
                    name="synthetic-1b"),  # llama.cpp wants Phi-3's special tokens of a model named phi3
    # SmolLM3-3B: llama's layers, every 4th without rope
    "smollm3-3b": dict(dim=2048, n_layers=36, n_heads=16, n_kv_heads=4, head_dim=128, ffn=11008, vocab=128256,
                       ctx=65536, rope_theta=5e6, norm_eps=1e-6, tied=True, arch="smollm3"),
    # Ministral-3-3B: llama's layers, YaRN 16x over 16,384 positions and a query temperature of 0.1
    "ministral3-3b": dict(dim=3072, n_layers=26, n_heads=32, n_kv_heads=8, head_dim=128, ffn=9216, vocab=131072,
                          ctx=262144, rope_theta=1e6, norm_eps=1e-5, tied=True, arch="mistral3",
                          rope_scale_yarn=16.0, rope_ctx_orig=16384, yarn_beta_fast=32.0, yarn_beta_slow=1.0,
                          yarn_log_mul=1.0, attn_temp_scale=0.1),
    "smollm2-135m": dict(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn=1536, vocab=49152,
                         ctx=8192, rope_theta=100000.0, norm_eps=1e-5, tied=True),
    # Tiny shapes for tests.
    # Heads (6), KV heads (3) and FFN width (224 = 7 blocks of 32) do not all
    # split evenly over 2, 3 or 4 nodes; dim 96 = 3 blocks of 32.
    "tiny-odd": dict(dim=96, n_layers=3, n_heads=6, n_kv_heads=3, head_dim=16, ffn=224, vocab=600,
                     ctx=256, rope_theta=10000.0, tied=False),
    # Prime counts everywhere: 5 heads, 1 KV head, FFN 11 blocks of 32.
    "tiny-prime": dict(dim=160, n_layers=2, n_heads=5, n_kv_heads=1, head_dim=32, ffn=352, vocab=611,
                       ctx=256, rope_theta=10000.0, tied=True),
    # head_dim * n_heads != dim (needs key_length/value_length).
    "tiny-headdim": dict(dim=128, n_layers=2, n_heads=6, n_kv_heads=2, head_dim=32, ffn=256, vocab=512,
                         ctx=256, rope_theta=10000.0, tied=False),
    # Every input width a multiple of 256, so K-quants and iq4_xs work.
    "tiny-k": dict(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, ffn=512, vocab=640,
                   ctx=256, rope_theta=10000.0, tied=False),
}


# ---------------------------------------------------------------------------
# Random tensors
# ---------------------------------------------------------------------------

def _f16_bytes(x: np.ndarray) -> np.ndarray:
    """float array of shape (n,) -> uint8 (n, 2) holding little-endian f16."""
    return x.astype("<f2").view(np.uint8).reshape(-1, 2)


def _block_scale(rng: np.random.Generator, n: int, base: float) -> np.ndarray:
    """Per-block scales base * U(0.5, 1.5); E[u^2] = 13/12 is divided out by callers."""
    return (base * rng.uniform(0.5, 1.5, n)).astype(np.float32)


_EU2 = 13.0 / 12.0  # E[u^2] for u ~ U(0.5, 1.5)


def _q8_0(rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
    # qs uniform over int8 [-128, 127]: E[q^2] = (256^2 - 1)/12 + 0.25
    blocks = rng.integers(0, 256, (n_blocks, 34), dtype=np.uint8)
    eq2 = (256 ** 2 - 1) / 12 + 0.25
    d = _block_scale(rng, n_blocks, std / np.sqrt(eq2 * _EU2))
    blocks[:, 0:2] = _f16_bytes(d)
    return blocks


def _q4_0(rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
    # value = d * (q - 8), q uniform 0..15: E[(q-8)^2] = 21.25 + 0.25; random sign of d
    blocks = rng.integers(0, 256, (n_blocks, 18), dtype=np.uint8)
    d = _block_scale(rng, n_blocks, std / np.sqrt(21.5 * _EU2))
    d *= np.where(rng.integers(0, 2, n_blocks, dtype=np.uint8) == 1, 1.0, -1.0).astype(np.float32)
    blocks[:, 0:2] = _f16_bytes(d)
    return blocks


def _with_min(rng: np.random.Generator, n_blocks: int, std: float, nbytes: int, levels: int) -> np.ndarray:
    # Q4_1 (20 B, 16 levels) and Q5_1 (24 B, 32 levels): d f16 | m f16 | ...; value = d*q + m
    # with m = -(levels-1)/2 d: zero mean, E[...^2] = d^2 (levels^2 - 1)/12 (21.25, 85.25)
    blocks = rng.integers(0, 256, (n_blocks, nbytes), dtype=np.uint8)
    d = _block_scale(rng, n_blocks, std / np.sqrt((levels * levels - 1) / 12 * _EU2))
    blocks[:, 0:2] = _f16_bytes(d)
    blocks[:, 2:4] = _f16_bytes(-(levels - 1) / 2 * d)
    return blocks


def _q4_1(rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
    return _with_min(rng, n_blocks, std, 20, 16)  # d | m | nibbles 16


def pack_q4_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Pack 8 six-bit scales and 8 six-bit mins per block into ggml's 12 bytes.

    Inverse of gguf.quants.Q4_K.get_scale_min; sc, mn: uint8 (n_blocks, 8) in 0..63.
    """
    sc = sc.astype(np.uint8)
    mn = mn.astype(np.uint8)
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (mn[:, 0:4] & 0x3F) | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((mn[:, 4:8] & 0x0F) << 4)
    return out


def _qk_with_mins(rng: np.random.Generator, n_blocks: int, std: float, nbytes: int, levels: int) -> np.ndarray:
    # Q4_K (144 B, 16 levels) and Q5_K (176 B, 32 levels): d f16 | dmin f16 | scales 12 | ...
    # Sub-block j (32 values): value = d*sc_j*q - dmin*m_j, q in 0..levels-1. With
    # dmin = (levels-1)/2 d and m_j = sc_j the value is d*sc_j*(q - (levels-1)/2): zero mean,
    # E[...^2] = d^2 E[sc^2] (levels^2 - 1)/12 (21.25 for Q4_K, 85.25 for Q5_K).
    blocks = rng.integers(0, 256, (n_blocks, nbytes), dtype=np.uint8)
    sc = rng.integers(32, 64, (n_blocks, 8), dtype=np.uint8)
    esc2 = float(np.mean(np.arange(32, 64, dtype=np.float64) ** 2))
    d = _block_scale(rng, n_blocks, std / np.sqrt(esc2 * (levels * levels - 1) / 12 * _EU2))
    blocks[:, 0:2] = _f16_bytes(d)
    blocks[:, 2:4] = _f16_bytes((levels - 1) / 2 * d)
    blocks[:, 4:16] = pack_q4_k_scales(sc, sc)
    return blocks


def _q4_k(rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
    return _qk_with_mins(rng, n_blocks, std, 144, 16)  # d | dmin | scales 12 | qs 128


def _q6_k(rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
    # layout: ql 128 | qh 64 | scales int8 16 | d f16. value = d*sc*(q - 32), q in 0..63
    blocks = rng.integers(0, 256, (n_blocks, 210), dtype=np.uint8)
    mag = np.arange(32, 128, dtype=np.float64)
    esc2 = float(np.mean(mag ** 2))
    sc = rng.integers(32, 128, (n_blocks, 16), dtype=np.int16)
    sc *= np.where(rng.integers(0, 2, (n_blocks, 16), dtype=np.uint8) == 1, 1, -1).astype(np.int16)
    blocks[:, 192:208] = sc.astype(np.int8).view(np.uint8)
    eq2 = (64 ** 2 - 1) / 12 + 0.25
    d = _block_scale(rng, n_blocks, std / np.sqrt(esc2 * eq2 * _EU2))
    blocks[:, 208:210] = _f16_bytes(d)
    return blocks


def _signs(rng: np.random.Generator, n: int) -> np.ndarray:
    return np.where(rng.integers(0, 2, n, dtype=np.uint8) == 1, 1.0, -1.0).astype(np.float32)


def _q5_0(rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
    # layout: d f16 | qh u32 | nibbles 16; value = d * (q - 16), q uniform 0..31:
    # E[(q-16)^2] = 85.25 + 0.25; random sign of d
    blocks = rng.integers(0, 256, (n_blocks, 22), dtype=np.uint8)
    d = _block_scale(rng, n_blocks, std / np.sqrt(85.5 * _EU2)) * _signs(rng, n_blocks)
    blocks[:, 0:2] = _f16_bytes(d)
    return blocks


def _q5_1(rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
    return _with_min(rng, n_blocks, std, 24, 32)  # d | m | qh u32 | nibbles 16


_EKV2 = float(np.mean(np.array(gguf.quants.IQ4_NL.kvalues, dtype=np.float64) ** 2))  # E[kvalue^2], q uniform


def _iq4_nl(rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
    # layout: d f16 | nibbles 16; value = d * kvalues[q]; the code book's mean is not 0,
    # so d takes a random sign
    blocks = rng.integers(0, 256, (n_blocks, 18), dtype=np.uint8)
    d = _block_scale(rng, n_blocks, std / np.sqrt(_EKV2 * _EU2)) * _signs(rng, n_blocks)
    blocks[:, 0:2] = _f16_bytes(d)
    return blocks


def _q2_k(rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
    # layout: scales 16 (low nibble sc, high nibble m) | qs 64 | d f16 | dmin f16.
    # value = d*sc*q - dmin*m, q in 0..3; with m = sc and dmin = 1.5 d: d*sc*(q - 1.5),
    # zero mean, E[...^2] = d^2 E[sc^2] 1.25
    blocks = rng.integers(0, 256, (n_blocks, 84), dtype=np.uint8)
    sc = rng.integers(8, 16, (n_blocks, 16), dtype=np.uint8)
    esc2 = float(np.mean(np.arange(8, 16, dtype=np.float64) ** 2))
    blocks[:, 0:16] = sc | (sc << 4)
    d = _block_scale(rng, n_blocks, std / np.sqrt(esc2 * 1.25 * _EU2))
    blocks[:, 80:82] = _f16_bytes(d)
    blocks[:, 82:84] = _f16_bytes(1.5 * d)
    return blocks


def _q3_k(rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
    # layout: hmask 32 | qs 64 | scales 12 | d f16. value = d*(s - 32)*q with random 6-bit
    # s (E[(s-32)^2] = 341.25 + 0.25) and q uniform in -4..3 (E[q^2] = 5.5)
    blocks = rng.integers(0, 256, (n_blocks, 110), dtype=np.uint8)
    d = _block_scale(rng, n_blocks, std / np.sqrt(341.5 * 5.5 * _EU2))
    blocks[:, 108:110] = _f16_bytes(d)
    return blocks


def _q5_k(rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
    return _qk_with_mins(rng, n_blocks, std, 176, 32)  # d | dmin | scales 12 | qh 32 | qs 128


def _iq4_xs(rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
    # layout: d f16 | scales_h u16 | scales_l 4 | qs 128; value = d*(s - 32)*kvalues[q],
    # random 6-bit s: E[(s-32)^2] = 341.5
    blocks = rng.integers(0, 256, (n_blocks, 136), dtype=np.uint8)
    d = _block_scale(rng, n_blocks, std / np.sqrt(341.5 * _EKV2 * _EU2)) * _signs(rng, n_blocks)
    blocks[:, 0:2] = _f16_bytes(d)
    return blocks


_BLOCK_GEN: dict[QT, Callable[[np.random.Generator, int, float], np.ndarray]] = {
    QT.Q8_0: _q8_0,
    QT.Q4_0: _q4_0,
    QT.Q4_1: _q4_1,
    QT.Q5_0: _q5_0,
    QT.Q5_1: _q5_1,
    QT.IQ4_NL: _iq4_nl,
    QT.Q2_K: _q2_k,
    QT.Q3_K: _q3_k,
    QT.Q4_K: _q4_k,
    QT.Q5_K: _q5_k,
    QT.Q6_K: _q6_k,
    QT.IQ4_XS: _iq4_xs,
}


def random_tensor(rng: np.random.Generator, rows: int, cols: int, qtype: QT, std: float) -> np.ndarray:
    """A random weight of ggml shape [cols, rows] as the array GGUFWriter stores.

    Float types: (rows, cols) float32/float16.  BF16 and quantized types:
    uint8 (rows, bytes_per_row) to be written with raw_dtype=qtype.
    """
    if qtype in (QT.F32, QT.F16, QT.BF16):
        w = rng.standard_normal((rows, cols), dtype=np.float32)
        w *= np.float32(std)
        if qtype == QT.F16:
            return w.astype(np.float16)
        if qtype == QT.BF16:
            return gguf.quants.quantize(w, QT.BF16)
        return w
    gen = _BLOCK_GEN.get(qtype)
    if gen is None:
        raise ValueError(f"unsupported tensor type {qtype.name}")
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if cols % block:
        raise ValueError(f"{qtype.name} needs the input width to be a multiple of {block}, got {cols}")
    n_blocks = rows * (cols // block)
    return gen(rng, n_blocks, std).reshape(rows, (cols // block) * type_size)


def dequantize_rows(data: np.ndarray, qtype: QT) -> np.ndarray:
    """Dequantize a stored tensor array (as random_tensor returns it) to float32 rows."""
    if qtype in (QT.F32, QT.F16):
        return np.asarray(data, dtype=np.float32)
    return gguf.quants.dequantize(data, qtype)


def check_tensor(name: str, data: np.ndarray, qtype: QT, std: float, max_rows: int = 64) -> float:
    """Dequantize (a sample of) a generated tensor with gguf-py; require finite values of the
    intended scale.  Returns the measured std of the sample."""
    sample = dequantize_rows(data[:max_rows], qtype)
    if not np.all(np.isfinite(sample)):
        raise AssertionError(f"{name}: non-finite values after dequantizing")
    if sample.size >= 256:
        got = float(np.sqrt(np.mean(sample.astype(np.float64) ** 2)))
        if not (0.7 * std <= got <= 1.4 * std):
            raise AssertionError(f"{name}: dequantized rms {got:.4g}, intended {std:.4g}")
        return got
    return float(np.std(sample))


# ---------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------

_COMMON = ("the of and to a in is that it was for on with as he she his her they at be this from "
           "have or by one had not but what all were when we there can an your which their said if "
           "do will each about how up out them then many some so these would other into has more "
           "time two like him see could no make than first been its who now people my made over "
           "did down only way find use may water long little very after words called just where "
           "most know once upon day cat dog Lily Tom happy big small").split()


def spm_vocab(vocab: int, seed: int = 0) -> tuple[list[str], list[float], list[int]]:
    """A synthetic SentencePiece ("llama") vocabulary of exactly `vocab` entries.

    <unk>, <s>, </s>, 256 byte tokens <0x00>..<0xFF> (type BYTE), then
    normal tokens: "▁", letters and digits, "▁"+letter, common words, then
    unique random words.  Scores decrease with the id, as in real SPM models.
    """
    n_fixed = 3 + 256
    if vocab < n_fixed + 64:
        raise ValueError(f"an spm vocabulary needs at least {n_fixed + 64} entries, got {vocab}")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    types = [int(TokenType.UNKNOWN), int(TokenType.CONTROL), int(TokenType.CONTROL)] + [int(TokenType.BYTE)] * 256
    normal: list[str] = ["▁"]
    letters = "abcdefghijklmnopqrstuvwxyz"
    normal += list(letters) + list(letters.upper()) + list("0123456789.,!?'\"-:;()")
    normal += ["▁" + c for c in letters + letters.upper()]
    normal += ["▁" + w for w in _COMMON] + _COMMON[:40]
    seen: set[str] = set()
    uniq = []
    for t in normal:
        if t not in seen:
            seen.add(t)
            uniq.append(t)
    rng = np.random.default_rng([seed, 7])
    # letter frequencies roughly like English so words look word-like
    freq = np.array([8.2, 1.5, 2.8, 4.3, 12.7, 2.2, 2.0, 6.1, 7.0, 0.2, 0.8, 4.0, 2.4,
                     6.7, 7.5, 1.9, 0.1, 6.0, 6.3, 9.1, 2.8, 1.0, 2.4, 0.2, 2.0, 0.1])
    freq /= freq.sum()
    need = vocab - n_fixed
    while len(uniq) < need:
        k = need - len(uniq)
        lens = rng.integers(2, 9, 2 * k + 16)
        chars = rng.choice(26, size=int(lens.sum()), p=freq)
        space = rng.random(lens.size) < 0.6
        pos = 0
        for ln, sp in zip(lens.tolist(), space.tolist()):
            w = "".join(letters[c] for c in chars[pos:pos + ln])
            pos += ln
            if sp:
                w = "▁" + w
            if w not in seen:
                seen.add(w)
                uniq.append(w)
                if len(uniq) == need:
                    break
    uniq = uniq[:need]
    tokens += uniq
    types += [int(TokenType.NORMAL)] * len(uniq)
    scores = [0.0] * n_fixed + [-float(i) for i in range(len(uniq))]
    return tokens, scores, types


# ---------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------

@dataclass
class TensorSpec:
    name: str
    rows: int  # numpy rows = ggml ne[1] (output features); 0 for 1-D
    cols: int  # numpy cols = ggml ne[0] (input features)
    qtype: QT
    std: float  # intended std (norms: 1-D ones + noise)
    experts: int = 0  # a 3-D expert tensor: this many (rows, cols) matrices, ggml [cols, rows, experts]
    centred: bool = False  # a 1-D tensor of values around 0 of this std (biases, gates), not a norm around 1

    @property
    def is_norm(self) -> bool:
        return self.rows == 0

    def shape_and_dtype(self) -> tuple[tuple[int, ...], np.dtype, int]:
        """(numpy shape as passed to add_tensor_info, numpy dtype, nbytes)."""
        if self.is_norm:
            return (self.cols,), np.dtype(np.float32), self.cols * 4
        lead = (self.experts,) if self.experts else ()
        n = self.rows * max(self.experts, 1)
        if self.qtype == QT.F32:
            return lead + (self.rows, self.cols), np.dtype(np.float32), n * self.cols * 4
        if self.qtype == QT.F16:
            return lead + (self.rows, self.cols), np.dtype(np.float16), n * self.cols * 2
        block, type_size = gguf.GGML_QUANT_SIZES[self.qtype]
        row_bytes = self.cols // block * type_size
        return lead + (self.rows, row_bytes), np.dtype(np.uint8), n * row_bytes


def _qtype(name: str | None, default: QT) -> QT:
    if name is None:
        return default
    key = name.lower()
    if key not in TYPES:
        raise ValueError(f"unknown tensor type {name!r}; choose from {', '.join(TYPES)}")
    return TYPES[key][0]


def model_tensors(*, dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn: int, vocab: int,
                  head_dim: int | None = None, weight_type: str = "f32", embd_type: str | None = None,
                  output_type: str | None = None, tied: bool = False,
                  tensor_types: dict[str, str] | None = None, arch: str = "llama",
                  rope_dims: int | None = None, rope_freqs: bool = False, n_experts: int = 0,
                  ffn_shared: int = 0) -> list[TensorSpec]:
    """The tensors of a llama-family model, in file order, validated for the chosen types.

    tensor_types: per-tensor types over weight_type, as llama.cpp's mixes have them: a key
    names a tensor by a dot-bounded part of its name ("attn_v" in every layer, "blk.1.attn_k"
    in one, "output.weight"); the longest matching key wins. Norms stay F32.
    n_experts: a mixture's layers hold a router ffn_gate_inp (F32, as llama.cpp's quantizer
    leaves it) and n_experts matrices of width ffn in each of ffn_gate_exps, ffn_up_exps and
    ffn_down_exps instead of ffn_gate, ffn_up and ffn_down; ffn_shared (qwen2moe): also a shared
    expert that wide (ffn_gate_shexp, ffn_up_shexp, ffn_down_shexp) and its gate ffn_gate_inp_shexp,
    a vector of dim (F32, as llama.cpp's quantizer leaves 1-D tensors).
    """
    if head_dim is None:
        if dim % n_heads:
            raise ValueError(f"dim {dim} is not divisible by n_heads {n_heads}; pass head_dim")
        head_dim = dim // n_heads
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads {n_heads} must be a multiple of n_kv_heads {n_kv_heads}")
    if head_dim % 2:
        raise ValueError(f"head_dim {head_dim} must be even (rotary embedding)")
    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; choose from {', '.join(ARCHS)}")
    if arch in FUSED + SQUARE and head_dim * n_heads != dim:
        raise ValueError(f"{arch} needs head_dim * n_heads == dim (llama.cpp reads attn_output as "
                         f"dim x dim), got {head_dim} * {n_heads} != {dim}")
    wt = _qtype(weight_type, QT.F32)
    et = _qtype(embd_type, wt)
    ot = _qtype(output_type, wt)
    q_out, kv_out = n_heads * head_dim, n_kv_heads * head_dim
    specs = [TensorSpec("token_embd.weight", vocab, dim, et, 1.0 / np.sqrt(dim)),
             TensorSpec("output_norm.weight", 0, dim, QT.F32, 1.0)]
    if not tied:
        specs.append(TensorSpec("output.weight", vocab, dim, ot, 1.0 / np.sqrt(dim)))
    fused = arch in FUSED
    if fused:
        specs += [TensorSpec(name, 0, (rope_dims or head_dim) // 2, QT.F32, 1.0) for name in ROPE_FACTORS]
    if rope_freqs:
        specs.append(TensorSpec(ROPE_FREQS, 0, (rope_dims or head_dim) // 2, QT.F32, 1.0))
    for i in range(n_layers):
        p = f"blk.{i}."
        if fused:
            attn = [TensorSpec(p + "attn_qkv.weight", q_out + 2 * kv_out, dim, wt, 1.0 / np.sqrt(dim))]
            ffn_in = [TensorSpec(p + "ffn_up.weight", 2 * ffn, dim, wt, 1.0 / np.sqrt(dim))]
        else:
            attn = [TensorSpec(p + f"attn_{x}.weight", rows, dim, wt, 1.0 / np.sqrt(dim))
                    for x, rows in (("q", q_out), ("k", kv_out), ("v", kv_out))]
            if arch in BIASED:
                attn += [TensorSpec(p + f"attn_{x}.bias", 0, rows, QT.F32, 0.2, centred=True)
                         for x, rows in (("q", q_out), ("k", kv_out), ("v", kv_out))]
            ffn_in = [TensorSpec(p + f"ffn_{x}.weight", ffn, dim, wt, 1.0 / np.sqrt(dim)) for x in ("gate", "up")]
        specs += [
            TensorSpec(p + "attn_norm.weight", 0, dim, QT.F32, 1.0),
            *attn,
            TensorSpec(p + "attn_output.weight", dim, q_out, wt, 1.0 / np.sqrt(q_out)),
            TensorSpec(p + "ffn_norm.weight", 0, dim, QT.F32, 1.0),
        ]
        if n_experts:
            specs += [
                TensorSpec(p + "ffn_gate_inp.weight", n_experts, dim, QT.F32, 1.0 / np.sqrt(dim)),
                TensorSpec(p + "ffn_gate_exps.weight", ffn, dim, wt, 1.0 / np.sqrt(dim), n_experts),
                TensorSpec(p + "ffn_down_exps.weight", dim, ffn, wt, 1.0 / np.sqrt(ffn), n_experts),
                TensorSpec(p + "ffn_up_exps.weight", ffn, dim, wt, 1.0 / np.sqrt(dim), n_experts),
            ]
        else:
            specs += [*ffn_in, TensorSpec(p + "ffn_down.weight", dim, ffn, wt, 1.0 / np.sqrt(ffn))]
        if ffn_shared:
            specs += [
                TensorSpec(p + "ffn_gate_inp_shexp.weight", 0, dim, QT.F32, 1.0 / np.sqrt(dim), centred=True),
                TensorSpec(p + "ffn_gate_shexp.weight", ffn_shared, dim, wt, 1.0 / np.sqrt(dim)),
                TensorSpec(p + "ffn_down_shexp.weight", dim, ffn_shared, wt, 1.0 / np.sqrt(ffn_shared)),
                TensorSpec(p + "ffn_up_shexp.weight", ffn_shared, dim, wt, 1.0 / np.sqrt(dim)),
            ]
        specs += [TensorSpec(p + suffix, 0, head_dim if width == "head" else dim, QT.F32, 1.0)
                  for suffix, width in ARCHS[arch]]
    for s in specs:
        keys = [k for k in (tensor_types or {}) if "." + k in "." + s.name]
        if keys and not s.is_norm:
            s.qtype = _qtype(tensor_types[max(keys, key=len)], s.qtype)
    bad = []
    for s in specs:
        if s.is_norm or s.qtype in (QT.F32, QT.F16, QT.BF16):
            continue
        block = gguf.GGML_QUANT_SIZES[s.qtype][0]
        if s.cols % block:
            bad.append(f"{s.name} (input width {s.cols}, {s.qtype.name} needs a multiple of {block})")
    if bad:
        shown = "; ".join(bad[:4]) + (f"; ... {len(bad) - 4} more" if len(bad) > 4 else "")
        raise ValueError(f"shape not quantizable: {shown}")
    return specs


def write_model(path: str | os.PathLike[str], *, dim: int, n_layers: int, n_heads: int, n_kv_heads: int,
                ffn: int, vocab: int, head_dim: int | None = None, ctx: int = 2048,
                rope_theta: float = 10000.0, norm_eps: float = 1e-5, arch: str = "llama",
                weight_type: str = "f32", embd_type: str | None = None, output_type: str | None = None,
                tied: bool = False, seed: int = 0, tokenizer: str = "spm", name: str = "synthetic",
                check: bool = True, progress: Callable[[str], None] | None = None,
                tensor_types: dict[str, str] | None = None, swa_window: int | None = None,
                swa_pattern: int | None = None, rope_theta_swa: float | None = None,
                attn_softcap: float | None = None, final_softcap: float | None = None,
                rope_scale_linear: float | None = None, rope_scale_yarn: float | None = None,
                rope_ctx_orig: int | None = None,
                rope_attn_factor: float | None = None, rope_dims: int | None = None,
                rope_freqs: bool = False, n_experts: int = 0, n_experts_used: int = 0,
                ffn_shared: int | None = None, yarn_beta_fast: float | None = None,
                yarn_beta_slow: float | None = None, yarn_log_mul: float | None = None,
                attn_temp_scale: float | None = None) -> Path:
    """Write a synthetic llama-family GGUF model to `path` (via path.part, then rename).

    Gemma keys, written only when given (llama.cpp then uses its defaults): `swa_window`
    (attention.sliding_window), `swa_pattern` (attention.sliding_window_pattern),
    `rope_theta_swa` (rope.freq_base_swa), `attn_softcap` and `final_softcap` (the logit
    soft-caps); `rope_scale_linear`: linear rope scaling by that factor (any arch), `rope_scale_yarn`: YaRN
    by that factor over `rope_ctx_orig` positions (any arch); mistral3's MISTRAL3_KEYS (llama.cpp reads
    them for mistral3 alone). gemma2 is always tied: llama.cpp reads its lm head from token_embd.
    `rope_dims`: the leading dims of each head that rotate (rope.dimension_count; default all,
    Phi-4-mini rotates 96 of 128); `rope_freqs`: llama 3.1's rope_freqs.weight factors. phi3 keys: `rope_ctx_orig` (rope.scaling.original_context_length: longer contexts take the
    long rope factors) and `rope_attn_factor` (rope.scaling.attn_factor); `swa_window` is
    written for phi3 too (its converter does), though llama.cpp ignores it there.
    qwen3moe and mixtral need `n_experts` and `n_experts_used` (expert_count, expert_used_count);
    `ffn` is then the width of one expert (qwen3moe also writes it as expert_feed_forward_length).
    qwen2moe adds a shared expert `ffn_shared` wide (default `ffn`; expert_shared_feed_forward_length)
    and is never tied (llama.cpp requires its output.weight).

    Norm weights are F32; token_embd uses `embd_type` and output.weight
    `output_type` (both default to `weight_type`); output.weight is omitted
    when `tied`.  `tokenizer`: "spm" (synthetic SentencePiece vocab) or
    "none" (no tokenizer keys; llama.cpp will not load that).  With `check`,
    every tensor is sampled back through gguf.quants.dequantize and must be
    finite with the intended scale.  Returns the final path.
    """
    path = Path(path)
    tied = (tied or arch == "gemma2") and arch not in UNTIED
    if ffn_shared is not None and arch not in SHARED:
        raise ValueError(f"only {', '.join(SHARED)} has a shared expert, not {arch}")
    ffn_shared = (ffn_shared or ffn) if arch in SHARED else 0
    if (arch in MOE_ARCHS) != bool(n_experts) or (n_experts and not 1 <= n_experts_used <= n_experts):
        raise ValueError(f"{', '.join(MOE_ARCHS)} and only they need experts, 1 <= experts used <= experts: "
                         f"arch {arch}, {n_experts} experts, {n_experts_used} used")
    wt_key = weight_type.lower()
    if wt_key not in TYPES:
        raise ValueError(f"unknown weight_type {weight_type!r}; choose from {', '.join(TYPES)}")
    hd = head_dim if head_dim is not None else (dim // n_heads if dim % n_heads == 0 else None)
    specs = model_tensors(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, ffn=ffn,
                          vocab=vocab, head_dim=head_dim, weight_type=weight_type, embd_type=embd_type,
                          output_type=output_type, tied=tied, tensor_types=tensor_types, arch=arch,
                          rope_dims=rope_dims, rope_freqs=rope_freqs, n_experts=n_experts,
                          ffn_shared=ffn_shared)
    assert hd is not None

    with gguf_writer(path, FILE_ARCH.get(arch, arch)) as writer:
        writer.add_name(name)
        writer.add_type("model")
        writer.add_context_length(ctx)
        writer.add_embedding_length(dim)
        writer.add_block_count(n_layers)
        writer.add_feed_forward_length(ffn)
        writer.add_head_count(n_heads)
        writer.add_head_count_kv(n_kv_heads)
        writer.add_rope_freq_base(float(rope_theta))
        writer.add_layer_norm_rms_eps(float(norm_eps))
        if rope_dims is not None and not (0 < rope_dims <= hd and rope_dims % 2 == 0):
            raise ValueError(f"rope_dims {rope_dims} must be even and within the head size {hd}")
        writer.add_rope_dimension_count(rope_dims or hd)
        if hd * n_heads != dim:
            writer.add_key_length(hd)
            writer.add_value_length(hd)
        if swa_window is not None:
            writer.add_sliding_window(int(swa_window))
        if swa_pattern is not None:
            writer.add_sliding_window_pattern(int(swa_pattern))
        if rope_theta_swa is not None:
            writer.add_rope_freq_base_swa(float(rope_theta_swa))
        if attn_softcap is not None:
            writer.add_attn_logit_softcapping(float(attn_softcap))
        if final_softcap is not None:
            writer.add_final_logit_softcapping(float(final_softcap))
        if rope_scale_linear is not None and rope_scale_yarn is not None:
            raise ValueError("rope scaling is linear or yarn, not both")
        if rope_scale_yarn is not None:
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(float(rope_scale_yarn))
        given = [k for k, v in zip(MISTRAL3_KEYS, (yarn_beta_fast, yarn_beta_slow, yarn_log_mul, attn_temp_scale))
                 if v is not None]
        if given and arch != "mistral3":  # llama.cpp would not read them: a test of them would test nothing
            raise ValueError(f"{', '.join(given)}: mistral3's keys, not {arch}'s")
        for value, add in ((yarn_beta_fast, writer.add_rope_scaling_yarn_beta_fast),
                           (yarn_beta_slow, writer.add_rope_scaling_yarn_beta_slow),
                           (yarn_log_mul, writer.add_rope_scaling_yarn_log_mul),
                           (attn_temp_scale, writer.add_attn_temperature_scale)):
            if value is not None:
                add(float(value))
        if rope_scale_linear is not None:
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(float(rope_scale_linear))
        if rope_ctx_orig is not None:
            writer.add_rope_scaling_orig_ctx_len(int(rope_ctx_orig))
        if rope_attn_factor is not None:
            writer.add_rope_scaling_attn_factors(float(rope_attn_factor))
        if n_experts:
            writer.add_expert_count(n_experts)
            writer.add_expert_used_count(n_experts_used)
            if arch != "mixtral":
                writer.add_expert_feed_forward_length(ffn)
        if ffn_shared:
            writer.add_expert_shared_feed_forward_length(ffn_shared)
        writer.add_file_type(int(TYPES[wt_key][1]))
        writer.add_vocab_size(vocab)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        if tokenizer == "spm":
            tokens, scores, types = spm_vocab(vocab, seed)
            writer.add_tokenizer_model("llama")
            writer.add_token_list(tokens)
            writer.add_token_scores(scores)
            writer.add_token_types(types)
            writer.add_unk_token_id(0)
            writer.add_bos_token_id(1)
            writer.add_eos_token_id(2)
            writer.add_add_bos_token(True)
            writer.add_add_eos_token(False)
        elif tokenizer != "none":
            raise ValueError(f"unknown tokenizer {tokenizer!r}: use 'spm' or 'none'")

        for s in specs:
            shape, dtype, nbytes = s.shape_and_dtype()
            raw = None if dtype != np.uint8 else s.qtype
            writer.add_tensor_info(s.name, shape, dtype, nbytes, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for idx, s in enumerate(specs):
            rng = np.random.default_rng([seed, idx])
            if s.name in ROPE_FACTORS or s.name == ROPE_FREQS:
                data = rope_factors(rng, s.cols, long=s.name != ROPE_FACTORS[1])
            elif s.centred:
                data = (s.std * rng.standard_normal(s.cols)).astype(np.float32)
            elif s.is_norm:
                data = (1.0 + 0.05 * rng.standard_normal(s.cols)).astype(np.float32)
            else:
                n = max(s.experts, 1)
                data = random_tensor(rng, s.rows * n, s.cols, s.qtype, s.std)
                if check:
                    check_tensor(s.name, data, s.qtype, s.std)
                if s.experts:
                    data = data.reshape(s.experts, s.rows, -1)
            writer.write_tensor_data(data)
            if progress is not None:
                progress(s.name)
            del data
    return path


def rope_factors(rng: np.random.Generator, n: int, long: bool) -> np.ndarray:
    """Rope frequency factors shaped like Phi-3's: ~1 for the fast frequencies, rising towards the
    slow ones (the long set to ~40, the short set to ~1.5), each angle divided by its factor."""
    rise = np.linspace(0.0, 1.0, n) ** 2
    top = 40.0 if long else 0.5
    return (1.0 + top * rise * rng.uniform(0.8, 1.2, n)).astype(np.float32)


def write_preset(path: str | os.PathLike[str], preset: str, **overrides: Any) -> Path:
    """write_model with a named preset's shape; keyword arguments override it."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    kw: dict[str, Any] = dict(PRESETS[preset])
    kw.setdefault("name", preset)
    kw.update(overrides)
    return write_model(path, **kw)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Write a synthetic llama-family GGUF model with random weights.")
    ap.add_argument("out", nargs="?", help="output .gguf path")
    ap.add_argument("--preset", choices=sorted(PRESETS), help="named shape (flags below override it)")
    ap.add_argument("--list-presets", action="store_true", help="print the presets and exit")
    ap.add_argument("--type", dest="weight_type", default="f32", choices=list(TYPES), help="type of the 2-D weights")
    ap.add_argument("--embd-type", choices=list(TYPES), help="type of token_embd (default: --type)")
    ap.add_argument("--output-type", choices=list(TYPES), help="type of output.weight (default: --type)")
    ap.add_argument("--tensor-type", dest="tensor_types", action="append", default=[], metavar="NAME=TYPE",
                    help="a type for the tensors NAME names (attn_v, blk.1.attn_k, output.weight); repeatable")
    ap.add_argument("--dim", type=int)
    ap.add_argument("--layers", dest="n_layers", type=int)
    ap.add_argument("--heads", dest="n_heads", type=int)
    ap.add_argument("--kv-heads", dest="n_kv_heads", type=int)
    ap.add_argument("--head-dim", type=int)
    ap.add_argument("--ffn", type=int)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--ctx", type=int)
    ap.add_argument("--rope-theta", type=float)
    ap.add_argument("--norm-eps", type=float)
    ap.add_argument("--arch", default="llama", choices=list(ARCHS))
    ap.add_argument("--swa-window", type=int, help="sliding window of the local layers (gemma)")
    ap.add_argument("--swa-pattern", type=int, help="every Nth layer global, the rest local (gemma)")
    ap.add_argument("--rope-theta-swa", type=float, help="rope base of the local layers (gemma)")
    ap.add_argument("--attn-softcap", type=float, help="attention logit soft-cap (gemma2)")
    ap.add_argument("--final-softcap", type=float, help="final logit soft-cap (gemma2)")
    ap.add_argument("--rope-scale-linear", type=float, help="linear rope scaling factor (rope.scaling.factor)")
    ap.add_argument("--rope-scale-yarn", type=float, help="YaRN rope scaling factor (rope.scaling.type yarn)")
    ap.add_argument("--rope-ctx-orig", type=int, help="original context: longer ones take the long rope factors "
                    "(phi3); YaRN's original context")
    ap.add_argument("--rope-attn-factor", type=float, help="rope's attention factor (rope.scaling.attn_factor)")
    ap.add_argument("--rope-dims", type=int, help="leading dims of each head that rotate (default: all)")
    ap.add_argument("--rope-freqs", action="store_true", default=None, help="write llama 3.1's rope_freqs factors")
    ap.add_argument("--experts", dest="n_experts", type=int, help="experts per layer (qwen3moe, mixtral)")
    ap.add_argument("--experts-used", dest="n_experts_used", type=int, help="experts per token (top-k)")
    ap.add_argument("--shared-ffn", dest="ffn_shared", type=int, help="width of the shared expert (qwen2moe; "
                    "default --ffn)")
    tie = ap.add_mutually_exclusive_group()
    tie.add_argument("--tied", dest="tied", action="store_true", default=None, help="no output.weight")
    tie.add_argument("--untied", dest="tied", action="store_false", help="write output.weight")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", default="spm", choices=["spm", "none"])
    ap.add_argument("--no-check", action="store_true", help="skip dequantizing a sample of every tensor")
    ap.add_argument("-q", "--quiet", action="store_true")
    args = ap.parse_args(argv)

    if args.list_presets:
        for k, v in PRESETS.items():
            print(f"{k}: " + ", ".join(f"{a}={b}" for a, b in v.items()))
        return 0
    if not args.out:
        ap.error("the output path is required")
    kw: dict[str, Any] = dict(PRESETS[args.preset]) if args.preset else {}
    if args.preset:
        kw["name"] = args.preset
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn", "vocab", "ctx",
                "rope_theta", "norm_eps", "tied", "swa_window", "swa_pattern", "rope_theta_swa",
                "attn_softcap", "final_softcap", "rope_scale_linear", "rope_scale_yarn", "rope_ctx_orig",
                "rope_attn_factor", "rope_dims", "rope_freqs", "n_experts", "n_experts_used", "ffn_shared"):
        val = getattr(args, key)
        if val is not None:
            kw[key] = val
    missing = [k for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn", "vocab") if k not in kw]
    if missing:
        ap.error("give --preset or all of --dim --layers --heads --kv-heads --ffn --vocab (missing: "
                 + ", ".join(missing) + ")")
    pairs = [t.partition("=") for t in args.tensor_types]
    if any(not name or not typ for name, _, typ in pairs):
        ap.error("--tensor-type takes NAME=TYPE, e.g. attn_v=q8_0")
    kw.update(weight_type=args.weight_type, embd_type=args.embd_type, output_type=args.output_type,
              arch=args.arch, seed=args.seed, tokenizer=args.tokenizer, check=not args.no_check,
              tensor_types={name: typ for name, _, typ in pairs} or None)
    t0 = time.perf_counter()
    try:
        out = write_model(args.out, **kw)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not args.quiet:
        size = out.stat().st_size
        print(f"wrote {out} ({size / 1e6:.1f} MB) in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
