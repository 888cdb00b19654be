"""llama.cpp (through llama-cpp-python) as the reference engine for the tests."""

from __future__ import annotations

import atexit
import weakref
from functools import lru_cache

import numpy as np

GGML_TYPES = {"f32": 0, "f16": 1, "q8_0": 8}  # KV cache types: edgetp's name -> ggml_type


@lru_cache(maxsize=4)
def load(path: str, n_ctx: int = 512, kv_type: str = "f32"):
    """A llama.cpp context with a KV cache of kv_type (f16 is llama.cpp's default; a quantized V
    cache needs llama.cpp's flash attention, so q8_0 runs with it)."""
    import llama_cpp  # noqa: PLC0415

    llm = llama_cpp.Llama(
        model_path=path, n_ctx=n_ctx, n_batch=n_ctx, logits_all=True, verbose=False,
        n_threads=2, type_k=GGML_TYPES[kv_type], type_v=GGML_TYPES[kv_type], seed=0, flash_attn=kv_type == "q8_0",
        # YaRN's magnitude and betas from the file, as llama.cpp's own tools take them (common.h: -1);
        # llama-cpp-python's defaults (1, 32, 1) would override a mistral3 file's betas
        yarn_attn_factor=-1.0, yarn_beta_fast=-1.0, yarn_beta_slow=-1.0,
    )
    _OPEN.add(llm)
    return llm


# the contexts still cached at exit are closed while llama_cpp still stands: left to interpreter
# shutdown, their __del__ finds its bindings gone ("TypeError: 'NoneType' object is not callable")
_OPEN: weakref.WeakSet = weakref.WeakSet()
atexit.register(lambda: [llm.close() for llm in list(_OPEN)])


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


def exact_logits(path, ids: list[int], kv_type: str = "f32", ctx: int = 256) -> np.ndarray:
    """The forward pass written out in float64 numpy on gguf-py's dequantized weights.

    An independent statement of the llama math (RMSNorm, RoPE on adjacent pairs,
    GQA causal attention, SwiGLU) with no rounding of activations: the "exact"
    logits both engines approximate. (n, vocab) float64. kv_type "f16": the keys
    and values are stored as f16 (numpy's rounding), as an f16 KV cache holds them;
    "q8_0": as gguf-py's Q8_0 (ggml's blocks of 32 along each head) of their f32 rounding.

    Per architecture, as Hugging Face's modeling files define it, with the
    hyper-parameters llama.cpp takes from the GGUF keys (or its defaults):
    - qwen2 adds q/k/v biases; qwen2, qwen3(moe) and gemma rotate the two halves of each
      head (`rotate_half`) instead of adjacent pairs;
    - qwen3 and gemma3 RMS-norm each head of q and of k (over head_dim) before the rotation;
    - gemma2/gemma3 (modeling_gemma2/3): embeddings times sqrt(dim); the attention and MLP
      outputs RMS-normed again before each residual add; GeGLU with tanh GELU; the
      norm weights used as stored (the converter stored 1 + w); sliding-window layers
      (layer i local when i % period < period - 1; period 2 for gemma2, 6 for gemma3)
      that see keys p with pos - p < window, with their own rope base (gemma3: 10000);
      gemma2 soft-caps the attention scores and the logits, cap * tanh(x / cap).
    - phi3 (modeling_phi3): one qkv_proj whose outputs are q, then k, then v; one gate_up_proj
      whose first half is the gate (`gate, up = chunk(2)`); LongRoPE: every inverse frequency
      divided by its factor, the long ones when the context exceeds
      rope.scaling.original_context_length, and cos and sin times rope.scaling.attn_factor.
      Hugging Face picks the factors by the sequence's length; llama.cpp (and so this) by the
      context a sequence may fill, `ctx` (the tests run ours with 256 positions).
    - smollm3 (modeling_smollm3): llama's, but every 4th layer (layer + 1 a multiple of 4) is
      NoPE: neither q nor k rotates there (`no_rope_layer_interval` 4, which llama.cpp hard-codes).
    - YaRN rope scaling (rope.scaling.type "yarn", modeling_rope_utils): each inverse frequency
      blended between itself and itself / factor, by a ramp over the pairs from the one that turns
      32 times over the original context to the one that turns once; cos and sin times
      0.1 ln(factor) + 1.
    - mistral3 (modeling_ministral3): llama's layers; YaRN with the config's beta_fast, beta_slow and
      mscale_all_dim (attention_factor get_mscale(factor) / get_mscale(factor, mscale_all_dim)); and
      llama 4's query temperature, q times 1 + beta * ln(1 + floor(pos / original context)).
    - llama 3.1's rope scaling, as its GGUF stores it (rope_freqs): every inverse frequency divided
      by its factor.
    - mixtures of experts (modeling_mixtral, modeling_qwen3_moe; mixtral is llama with
      expert_count, qwen3moe is qwen3's attention): per token, the softmax of the router
      (ffn_gate_inp) over the experts, the expert_used_count most probable, their
      probabilities divided by their sum (mixtral always, Qwen3-MoE's norm_topk_prob),
      the output the sum of those experts' SwiGLU FFNs (ffn_*_exps[e]) times them.
    - qwen2moe (modeling_qwen2_moe): qwen2's attention (q/k/v biases); the experts' probabilities
      not divided by their sum (norm_topk_prob false); plus a shared expert, a SwiGLU FFN
      (ffn_*_shexp) times sigmoid(ffn_gate_inp_shexp . h), for every token.
    """
    from gguf import GGMLQuantizationType, GGUFReader, quants  # noqa: PLC0415

    reader = GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.")}
    arch = meta["general.architecture"]

    def key(name, default=None):
        return meta.get(f"{arch}.{name}", default)

    dim, nh, n_layers = key("embedding_length"), key("attention.head_count"), key("block_count")
    nkv = key("attention.head_count_kv", nh)
    hd = key("attention.key_length", dim // nh)
    rd = key("rope.dimension_count", hd)  # the leading dims of each head that rotate (Phi-4-mini: 96 of 128)
    eps = key("attention.layer_norm_rms_epsilon", 1e-5)
    theta = key("rope.freq_base", 10000.0)
    # linear rope scaling: positions divided by rope.scaling.factor (HF's "linear" rope_scaling);
    # gemma3's sliding-window layers are never scaled (its local rope has no rope_scaling)
    # (llama.cpp reads the factor so for every type but "none"; yarn's is below)
    stretch = key("rope.scaling.factor", 1.0) if key("rope.scaling.type", "linear") not in ("none", "yarn") else 1.0
    gemma, gemma2 = arch in ("gemma2", "gemma3"), arch == "gemma2"
    halves = arch in ("qwen2", "qwen2moe", "qwen3", "qwen3moe", "gemma2", "gemma3", "phi3")
    window = key("attention.sliding_window", 4096 if gemma2 else 0) if gemma else 0
    period = key("attention.sliding_window_pattern", 2 if gemma2 else 6)
    theta_local = key("rope.freq_base_swa", theta if gemma2 else 10000.0)
    attn_cap = key("attn_logit_softcapping", 50.0) if gemma2 else 0.0
    final_cap = key("final_logit_softcapping", 30.0 if gemma2 else 0.0) if gemma else 0.0
    factors = None  # each inverse frequency divided by its factor: llama 3.1's rope_freqs, else phi3's LongRoPE
    if "rope_freqs.weight" in tensors:
        factors = np.asarray(tensors["rope_freqs.weight"].data, np.float64).reshape(-1)
    elif "rope_factors_long.weight" in tensors:
        long = ctx > key("rope.scaling.original_context_length", key("context_length"))
        factors = np.asarray(tensors[f"rope_factors_{'long' if long else 'short'}.weight"].data, np.float64).reshape(-1)
    mscale = key("rope.scaling.attn_factor", 1.0)
    # YaRN (modeling_rope_utils' _compute_yarn_parameters, beta_fast 32 and beta_slow 1, as llama.cpp
    # takes them): the inverse frequencies blended between themselves and themselves / factor by a
    # ramp over the pairs, cos and sin times 0.1 ln(factor) + 1
    yarn = key("rope.scaling.type", "linear") == "yarn"
    yarn_factor = key("rope.scaling.factor", 1.0) if yarn else 1.0
    yarn_ctx = key("rope.scaling.original_context_length", key("context_length"))
    mistral3 = arch == "mistral3"  # modeling_ministral3: its config's betas and mscale_all_dim, llama 4's temperature
    beta_fast, beta_slow = (key("rope.scaling.yarn_beta_fast", 32.0), key("rope.scaling.yarn_beta_slow", 1.0)) \
        if mistral3 else (32.0, 1.0)
    mscale_all_dim = key("rope.scaling.yarn_log_multiplier", 0.0) if mistral3 else 0.0
    temperature = key("attention.temperature_scale", 0.0) if mistral3 else 0.0

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * np.log(scale) + 1.0

    if yarn:  # attention_factor: mscale / mscale_all_dim where the config has both (mscale 1), else get_mscale
        mscale *= get_mscale(yarn_factor) / get_mscale(yarn_factor, mscale_all_dim) if mscale_all_dim \
            else get_mscale(yarn_factor)
    big = gemma and n_layers == (46 if gemma2 else 62)  # gemma's 27B: queries scaled by its width per head
    scale = 1 / np.sqrt(dim / nh) if big else 1 / np.sqrt(hd)
    n = len(ids)

    def weight(name):
        t = tensors[name]
        return quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float64).reshape(
            [int(s) for s in reversed(t.shape.tolist())])

    def norm(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    def yarn_inv(inv, base):
        def correction(rotations):  # the dimension whose pair turns `rotations` times over yarn_ctx
            return rd * np.log(yarn_ctx / (rotations * 2 * np.pi)) / (2 * np.log(base))

        low, high = max(np.floor(correction(beta_fast)), 0), min(np.ceil(correction(beta_slow)), rd - 1)
        high = high + 0.001 if low == high else high
        extrapolated = 1 - np.clip((np.arange(rd // 2) - low) / (high - low), 0, 1)
        return inv / yarn_factor * (1 - extrapolated) + inv * extrapolated

    def rope(v, heads, base, factor):  # the first rd dims of each head rotate, the others pass
        inv = base ** (-np.arange(0, rd, 2) / rd) / (1.0 if factors is None else factors)
        inv = yarn_inv(inv, base) if yarn else inv
        ang = (np.arange(n) / factor)[:, None] * inv[None, :]
        cos, sin = mscale * np.cos(ang)[:, None, :], mscale * np.sin(ang)[:, None, :]
        v = v.reshape(n, heads, hd)
        r, keep = v[..., :rd], v[..., rd:]
        if halves:  # x * cos + rotate_half(x) * sin, the frequencies repeated over both halves
            c, s = np.concatenate([cos, cos], -1), np.concatenate([sin, sin], -1)
            r = r * c + np.concatenate([-r[..., rd // 2:], r[..., : rd // 2]], -1) * s
        else:
            a, b = r.reshape(n, heads, rd // 2, 2)[..., 0], r.reshape(n, heads, rd // 2, 2)[..., 1]
            r = np.stack([a * cos - b * sin, a * sin + b * cos], -1).reshape(n, heads, rd)
        return np.concatenate([r, keep], -1)

    def linear(h, name):  # h @ W.T (+ b where the file has the bias)
        out = h @ weight(name + ".weight").T
        return out + weight(name + ".bias") if name + ".bias" in tensors else out

    def qkv(h, p):  # q, k, v; phi3: one projection whose outputs are q, then k, then v
        if p + "attn_qkv.weight" not in tensors:
            return linear(h, p + "attn_q"), linear(h, p + "attn_k"), linear(h, p + "attn_v")
        out = linear(h, p + "attn_qkv")
        return out[:, : nh * hd], out[:, nh * hd: (nh + nkv) * hd], out[:, (nh + nkv) * hd:]

    def gate_up(h, p):  # phi3: one projection, the gate's outputs first
        if p + "ffn_gate.weight" not in tensors:
            return np.split(h @ weight(p + "ffn_up.weight").T, 2, axis=1)
        return h @ weight(p + "ffn_gate.weight").T, h @ weight(p + "ffn_up.weight").T

    def head_norm(v, heads, name):  # qwen3, gemma3: RMSNorm of each head's hd values
        v = v.reshape(n, heads, hd)
        return norm(v, weight(name)) if name in tensors else v

    def post_norm(v, name):  # gemma: the block's output normed before the residual add
        return norm(v, weight(name)) if gemma else v

    def cap(v, c):
        return c * np.tanh(v / c) if c else v

    def act(gate):
        if gemma:  # gelu, tanh form
            return 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate ** 3)))
        return gate / (1 + np.exp(-gate))  # silu

    def experts(h, p):  # (n, dim) -> the mixture's output (n, dim)
        logits = h @ weight(p + "ffn_gate_inp.weight").T
        probs = np.exp(logits - logits.max(1, keepdims=True))
        probs /= probs.sum(1, keepdims=True)
        gate, up, down = (weight(p + f"ffn_{w}_exps.weight") for w in ("gate", "up", "down"))
        out = np.zeros_like(h)
        for t in range(n):
            top = np.argsort(-probs[t])[: key("expert_used_count")]
            for e in top:
                ffn = (act(gate[e] @ h[t]) * (up[e] @ h[t])) @ down[e].T
                out[t] += probs[t, e] / (1.0 if arch == "qwen2moe" else probs[t, top].sum()) * ffn
        if p + "ffn_gate_inp_shexp.weight" in tensors:  # the shared expert, gated per token
            z = h @ weight(p + "ffn_gate_inp_shexp.weight")
            shared = (act(h @ weight(p + "ffn_gate_shexp.weight").T) * (h @ weight(p + "ffn_up_shexp.weight").T))
            out += (1 / (1 + np.exp(-z)))[:, None] * (shared @ weight(p + "ffn_down_shexp.weight").T)
        return out

    embd = weight("token_embd.weight")
    x = embd[ids] * (np.sqrt(dim) if gemma else 1.0)
    pos = np.arange(n)
    for layer in range(n_layers):
        p = f"blk.{layer}."
        local = window > 0 and (period == 0 or layer % period < period - 1)
        base = theta_local if local else theta
        factor = 1.0 if local and arch == "gemma3" else stretch
        seen = pos[None, :] <= pos[:, None]  # causal: query i sees key j <= i ...
        if local:
            seen &= pos[:, None] - pos[None, :] < window  # ... and only the last `window` of them
        mask = np.where(seen, 0.0, -np.inf)
        h = norm(x, weight(p + "attn_norm.weight"))
        q, k, v = qkv(h, p)
        q, k = head_norm(q, nh, p + "attn_q_norm.weight"), head_norm(k, nkv, p + "attn_k_norm.weight")
        if arch != "smollm3" or (layer + 1) % 4:  # smollm3: every 4th layer is NoPE, neither q nor k rotates
            q, k = rope(q, nh, base, factor), rope(k, nkv, base, factor)
        if temperature:  # ministral3: q times 1 + beta * ln(1 + floor(pos / original context))
            q = q * (1 + temperature * np.log(1 + np.floor(pos / yarn_ctx)))[:, None, None]
        v = v.reshape(n, nkv, hd)
        if kv_type == "f16":
            k, v = (c.astype(np.float32).astype(np.float16).astype(np.float64) for c in (k, v))
        if kv_type == "q8_0":
            k, v = (quants.dequantize(quants.quantize(c.astype(np.float32).reshape(-1, hd), GGMLQuantizationType.Q8_0),
                                      GGMLQuantizationType.Q8_0).astype(np.float64).reshape(c.shape) for c in (k, v))
        att = np.empty((n, nh, hd))
        for head in range(nh):
            kv = head // (nh // nkv)
            s = cap(q[:, head] @ k[:, kv].T * scale, attn_cap) + mask
            s = np.exp(s - s.max(1, keepdims=True))
            att[:, head] = (s / s.sum(1, keepdims=True)) @ v[:, kv]
        x = x + post_norm(att.reshape(n, -1) @ weight(p + "attn_output.weight").T, p + "post_attention_norm.weight")
        h = norm(x, weight(p + "ffn_norm.weight"))
        if p + "ffn_gate_inp.weight" in tensors:
            x = x + experts(h, p)
            continue
        gate, up = gate_up(h, p)
        x = x + post_norm((act(gate) * up) @ weight(p + "ffn_down.weight").T, p + "post_ffw_norm.weight")
    head = weight("output.weight") if "output.weight" in tensors and not gemma2 else embd
    return cap(norm(x, weight("output_norm.weight")) @ head.T, final_cap)
