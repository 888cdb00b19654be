"""llama.cpp (through llama-cpp-python) as the reference engine for the tests."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

GGML_TYPES = {"f32": 0, "f16": 1}  # KV cache types: edgetp's name -> ggml_type


@lru_cache(maxsize=4)
def load(path: str, n_ctx: int = 512, kv_type: str = "f32"):
    """A llama.cpp context with a KV cache of kv_type (f16 is llama.cpp's default)."""
    import llama_cpp  # noqa: PLC0415

    return llama_cpp.Llama(
        model_path=path, n_ctx=n_ctx, n_batch=n_ctx, logits_all=True, verbose=False,
        n_threads=2, type_k=GGML_TYPES[kv_type], type_v=GGML_TYPES[kv_type], seed=0,
    )


def tokenize(path, text: str, add_bos: bool = True, special: bool = False) -> list[int]:
    return list(load(str(path)).tokenize(text.encode(), add_bos=add_bos, special=special))


def logits(path, ids: list[int], kv_type: str = "f32") -> np.ndarray:
    """Logits at every position of ids: (n, vocab) f32."""
    llm = load(str(path), kv_type=kv_type)
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: llm.n_tokens], dtype=np.float32)


def greedy(path, ids: list[int], n: int, kv_type: str = "f32") -> list[int]:
    """n greedy tokens after ids, argmax of llama.cpp's own logits at each step."""
    llm = load(str(path), kv_type=kv_type)
    llm.reset()
    llm.eval(ids)
    out = []
    for _ in range(n):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(tok)
        llm.eval([tok])
    return out


def exact_logits(path, ids: list[int], kv_type: str = "f32") -> np.ndarray:
    """The forward pass written out in float64 numpy on gguf-py's dequantized weights.

    An independent statement of the llama math (RMSNorm, RoPE on adjacent pairs,
    GQA causal attention, SwiGLU) with no rounding of activations: the "exact"
    logits both engines approximate. Per architecture, as Hugging Face's modeling
    files define it: qwen2 adds q/k/v biases; qwen2 and qwen3 rotate the two halves
    of each head (`rotate_half`) instead of adjacent pairs; qwen3 RMS-norms each
    head of q and of k (q_norm, k_norm over head_dim) before the rotation. (n, vocab) float64. kv_type "f16": the keys
    and values are stored as f16 (numpy's rounding), as an f16 KV cache holds them.
    """
    from gguf import GGUFReader, quants  # noqa: PLC0415

    reader = GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.")}
    arch = meta["general.architecture"]
    dim, nh = meta[f"{arch}.embedding_length"], meta[f"{arch}.attention.head_count"]
    nkv = meta.get(f"{arch}.attention.head_count_kv", nh)
    hd = meta.get(f"{arch}.attention.key_length", dim // nh)
    eps = meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    theta = meta.get(f"{arch}.rope.freq_base", 10000.0)
    halves = arch in ("qwen2", "qwen3")
    n = len(ids)

    def weight(name):
        t = tensors[name]
        return quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float64).reshape(
            [int(s) for s in reversed(t.shape.tolist())])

    def norm(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    ang = np.arange(n)[:, None] * theta ** (-np.arange(0, hd, 2) / hd)[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def rope(v, heads):
        if halves:  # x * cos + rotate_half(x) * sin, the frequencies repeated over both halves
            v = v.reshape(n, heads, hd)
            c, s = np.concatenate([cos, cos], -1), np.concatenate([sin, sin], -1)
            return v * c + np.concatenate([-v[..., hd // 2:], v[..., : hd // 2]], -1) * s
        v = v.reshape(n, heads, hd // 2, 2)
        a, b = v[..., 0], v[..., 1]
        return np.stack([a * cos - b * sin, a * sin + b * cos], -1).reshape(n, heads, hd)

    def linear(h, name):  # h @ W.T (+ b where the file has the bias)
        out = h @ weight(name + ".weight").T
        return out + weight(name + ".bias") if name + ".bias" in tensors else out

    def head_norm(v, heads, name):  # qwen3: RMSNorm of each head's hd values
        v = v.reshape(n, heads, hd)
        return norm(v, weight(name)) if name in tensors else v

    embd = weight("token_embd.weight")
    x = embd[ids]
    causal = np.triu(np.full((n, n), -np.inf), 1)
    for layer in range(meta[f"{arch}.block_count"]):
        p = f"blk.{layer}."
        h = norm(x, weight(p + "attn_norm.weight"))
        q = rope(head_norm(linear(h, p + "attn_q"), nh, p + "attn_q_norm.weight"), nh)
        k = rope(head_norm(linear(h, p + "attn_k"), nkv, p + "attn_k_norm.weight"), nkv)
        v = linear(h, p + "attn_v").reshape(n, nkv, hd)
        if kv_type == "f16":
            k, v = (c.astype(np.float32).astype(np.float16).astype(np.float64) for c in (k, v))
        att = np.empty((n, nh, hd))
        for head in range(nh):
            kv = head // (nh // nkv)
            s = q[:, head] @ k[:, kv].T / np.sqrt(hd) + causal
            s = np.exp(s - s.max(1, keepdims=True))
            att[:, head] = (s / s.sum(1, keepdims=True)) @ v[:, kv]
        x = x + att.reshape(n, -1) @ weight(p + "attn_output.weight").T
        h = norm(x, weight(p + "ffn_norm.weight"))
        gate, up = h @ weight(p + "ffn_gate.weight").T, h @ weight(p + "ffn_up.weight").T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ weight(p + "ffn_down.weight").T
    head = weight("output.weight") if "output.weight" in tensors else embd
    return norm(x, weight("output_norm.weight")) @ head.T
