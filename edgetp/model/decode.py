"""One-token decode of a shard, with everything but the arithmetic done once.

Shard.forward for one token used to spend about as long in Python and numba
dispatch as in its kernels (SmolLM2-135M: 211 matvecs a token, each checking
shapes, reading the environment and allocating). A `Plan` does that work once
per shard: a buffer for every activation and rounded token, every matvec bound
to its kernel and buffers, and q, k and v (gate and up) of one layout run in one
kernel call. It calls the same kernels on the same values in the same order as
the per-op path (`Shard.forward` for n > 1), so its results are the same bits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np

from edgetp.model import intdot, ops, quant

if TYPE_CHECKING:
    from edgetp.model.llama import Layer, Shard


class _Matvecs:
    """out = [W_0 @ x, W_1 @ x, ...] for weights that read one x (cols,) f32: one integer
    kernel call per layout (x rounded once), float kernels for the rest."""

    def __init__(self, ws: list[quant.Weight], x: np.ndarray, int8: bool) -> None:
        starts = np.cumsum([0] + [w.rows for w in ws])
        self.out = np.empty(int(starts[-1]), np.float32)  # every weight's rows in turn
        self.views = [self.out[a:b] for a, b in zip(starts[:-1], starts[1:])]
        self.x = x
        self.rounded: intdot.Rounded | None = None
        self.products: list[intdot.Products] = []
        self.floats: list[Callable[[], None]] = []
        by_type: dict[int, list[int]] = {}
        for i, w in enumerate(ws):
            quant._check_io(w, x, self.views[i], None)
            if quant.int8_kernel(w, int8):
                by_type.setdefault(w.qtype, []).append(i)
            else:
                self.floats.append(lambda w=w, out=self.views[i]: quant.float_matvec(w, x, out))
        if by_type:
            c = x.shape[0]
            self.rounded = intdot.Rounded(np.empty(c, np.int8), np.empty(c // 32, np.float32),
                                          np.empty(c // 4, np.int32), np.empty(c // 16, np.int32))
        for t, idx in by_type.items():
            self.products.append(intdot.Products(t, [ws[i].data for i in idx], self.rounded, self.out,
                                                 [int(starts[i]) for i in idx]))

    def __call__(self, serial: bool) -> None:
        if self.rounded is not None:
            intdot.round_into(self.x, *self.rounded)
        for p in self.products:
            p(serial)
        for f in self.floats:
            f()


class _LayerPlan:
    """One layer's matvecs and the views of their outputs, (1, width) each."""

    def __init__(self, shard: Shard, layer: Layer, h: np.ndarray, int8: bool) -> None:
        hd = shard.w.cfg.head_dim
        self.layer = layer
        self.qkv = self.o = self.gate_up = self.down = None
        if shard.n_kv:
            self.qkv = _Matvecs([layer.wq, layer.wk, layer.wv], h[0], int8)
            self.q, self.k, self.v = (a[None] for a in self.qkv.views)
            self.att = np.empty((1, shard.n_heads * hd), np.float32)
            self.o = _Matvecs([layer.wo], self.att[0], int8)
            self.k_row = self.k.reshape(shard.n_kv, hd)  # what the caches get at pos
            self.v_row = self.v.reshape(shard.n_kv, hd)
        if shard.n_ffn:
            self.gate_up = _Matvecs([layer.w_gate, layer.w_up], h[0], int8)
            self.gate, self.up = (a[None] for a in self.gate_up.views)
            self.down = _Matvecs([layer.w_down], self.gate[0], int8)


class Plan:
    """Shard.forward for one token (x (1, dim), in place), per-op results bit for bit.

    Built for one choice of kernels (int8 = quant.int8_decode()); the shard's weights,
    KV caches and reduce are read at each call, the buffers are its own.
    """

    def __init__(self, shard: Shard, int8: bool) -> None:
        self.shard = shard
        dim = shard.w.cfg.dim
        self.h = np.empty((1, dim), np.float32)       # normed x, what q/k/v and gate/up read
        self.zeros = np.zeros((1, dim), np.float32)   # the partial of a half this shard has no share of
        self.layers = [_LayerPlan(shard, layer, self.h, int8) for layer in shard.w.layers]

    def forward(self, x: np.ndarray, pos: int) -> np.ndarray:
        s, cfg = self.shard, self.shard.w.cfg
        quant._use_threads()
        serial = quant.threads() == 1
        h, eps, hd = self.h, cfg.norm_eps, cfg.head_dim
        for i, p in enumerate(self.layers):
            layer = p.layer
            ops.rmsnorm(x, layer.attn_norm, eps, h)
            if p.qkv is None:
                partial = self.zeros
                partial.fill(0.0)
            else:
                p.qkv(serial)
                if layer.bq is not None:
                    p.q += layer.bq
                    p.k += layer.bk
                    p.v += layer.bv
                ops.rope(p.q, s.n_heads, hd, cfg.rope_dims, pos, s.cos, s.sin, cfg.rope_neox)
                ops.rope(p.k, s.n_kv, hd, cfg.rope_dims, pos, s.cos, s.sin, cfg.rope_neox)
                kc, vc = s.k_cache[i], s.v_cache[i]
                kc[:, pos, :] = p.k_row
                vc[:, pos, :] = p.v_row
                ops.attention(p.q, kc, vc, pos, cfg.group_size, p.att, serial)
                p.o(serial)
                partial = p.o.out[None]
            s.reduce(partial)
            x += partial
            ops.rmsnorm(x, layer.ffn_norm, eps, h)
            if p.gate_up is None:
                partial = self.zeros
                partial.fill(0.0)
            else:
                p.gate_up(serial)
                ops.silu_mul(p.gate, p.up)
                p.down(serial)
                partial = p.down.out[None]
            s.reduce(partial)
            x += partial
        out = np.empty_like(h)
        ops.rmsnorm(x, s.w.out_norm, eps, out)
        return out
