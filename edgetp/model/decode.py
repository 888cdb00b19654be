"""One-token decode of a shard, with everything but the arithmetic done once.

Shard.forward for one token used to spend about as long in Python and numba
dispatch as in its kernels (SmolLM2-135M: 211 matvecs a token, each checking
shapes, reading the environment and allocating). A `Plan` does that work once
per shard: a buffer for every activation and rounded token, every matvec bound
to its kernel and buffers, q, k and v (gate and up) of one layout in one kernel
call, and the small steps between the matvecs fused into one compiled call each
(residual add, norm and rounding; rope, cache write, attention and rounding;
silu and rounding). It calls the same kernels on the same values in the same
order as the per-op path (`Shard.forward` for n > 1): the results are the same bits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np
from numba import njit, prange

from edgetp.model import intdot, ops, quant

if TYPE_CHECKING:
    from edgetp.model.llama import Layer, Shard

_JIT = dict(cache=True, nogil=True)


class _Matvecs:
    """out = [W_0 @ x, W_1 @ x, ...] for weights that read one x (cols,) f32 (and its rounding
    xr, which the step before fills): one integer kernel call per layout, float kernels for the rest."""

    def __init__(self, ws: list[quant.Weight], x: np.ndarray, xr: intdot.Rounded, int8: bool) -> None:
        starts = np.cumsum([0] + [w.rows for w in ws])
        self.out = np.empty(int(starts[-1]), np.float32)  # every weight's rows in turn
        self.views = [self.out[a:b] for a, b in zip(starts[:-1], starts[1:])]
        self.products: list[intdot.Products] = []
        self.floats: list[Callable[[], None]] = []
        by_type: dict[int, list[int]] = {}
        for i, w in enumerate(ws):
            quant.check_io(w, x, self.views[i], None)
            if quant.int8_kernel(w, int8):
                by_type.setdefault(w.qtype, []).append(i)
            else:
                self.floats.append(lambda w=w, out=self.views[i]: quant.float_matvec(w, x, out))
        for t, idx in by_type.items():
            self.products.append(intdot.Products(t, [ws[i].data for i in idx], xr, self.out,
                                                 [int(starts[i]) for i in idx]))
        self.rounds = bool(self.products)  # whether the step before must round x

    def __call__(self, serial: bool) -> None:
        for p in self.products:
            p(serial)
        for f in self.floats:
            f()


class _LayerPlan:
    """One layer's matvecs and the views of their outputs, (1, width) each."""

    def __init__(self, shard: Shard, layer: Layer, h: np.ndarray, r: dict[str, intdot.Rounded], int8: bool) -> None:
        hd = shard.w.cfg.head_dim
        self.layer = layer
        self.qkv = self.o = self.gate_up = self.down = None
        if shard.n_kv:
            self.qkv = _Matvecs([layer.wq, layer.wk, layer.wv], h[0], r["h"], int8)
            self.q, self.k, self.v = (a[None] for a in self.qkv.views)
            self.att = np.empty((1, shard.n_heads * hd), np.float32)
            self.o = _Matvecs([layer.wo], self.att[0], r["att"], int8)
        if shard.n_ffn:
            self.gate_up = _Matvecs([layer.w_gate, layer.w_up], h[0], r["h"], int8)
            self.gate, self.up = (a[None] for a in self.gate_up.views)
            self.down = _Matvecs([layer.w_down], self.gate[0], r["gate"], int8)


class Plan:
    """Shard.forward for one token (x (1, dim), in place), per-op results bit for bit.

    Built for one choice of kernels (int8 = quant.int8_decode()); the shard's weights,
    KV caches and reduce are read at each call, the buffers are its own.
    """

    def __init__(self, shard: Shard, int8: bool) -> None:
        self.shard = shard
        cfg = shard.w.cfg
        self.h = np.empty((1, cfg.dim), np.float32)       # normed x, what q/k/v and gate/up read
        self.zeros = np.zeros((1, cfg.dim), np.float32)   # the partial of a half this shard has no share of
        empty = intdot.Rounded.empty
        self.r = {"h": empty(cfg.dim), "att": empty(max(shard.n_heads, 1) * cfg.head_dim),
                  "gate": empty(max(shard.n_ffn, 32))}  # (empty halves round nothing)
        self.layers = [_LayerPlan(shard, layer, self.h, self.r, int8) for layer in shard.w.layers]

    def forward(self, x: np.ndarray, pos: int) -> np.ndarray:
        s, cfg = self.shard, self.shard.w.cfg
        quant.use_threads()
        serial = quant.threads() == 1
        h, eps, rh, ra, rg = self.h, cfg.norm_eps, self.r["h"], self.r["att"], self.r["gate"]
        partial = self.zeros  # the sum x has yet to get (none before the first layer)
        for i, p in enumerate(self.layers):
            layer = p.layer
            if p.qkv is None:
                _add_norm(x, partial, layer.attn_norm, eps, h, i > 0, False, *rh)
                partial = self.zeros
                partial.fill(0.0)
            else:
                _add_norm(x, partial, layer.attn_norm, eps, h, i > 0, p.qkv.rounds, *rh)
                p.qkv(serial)
                if layer.bq is not None:
                    p.q += layer.bq
                    p.k += layer.bk
                    p.v += layer.bv
                _attention(p.q, p.k, p.v, s.k_cache[i], s.v_cache[i], pos, s.cos, s.sin, cfg.rope_dims,
                           cfg.rope_neox, cfg.group_size, p.att, serial, p.o.rounds, *ra)
                p.o(serial)
                partial = p.o.out[None]
            s.reduce(partial)
            if p.gate_up is None:
                _add_norm(x, partial, layer.ffn_norm, eps, h, True, False, *rh)
                partial = self.zeros
                partial.fill(0.0)
            else:
                _add_norm(x, partial, layer.ffn_norm, eps, h, True, p.gate_up.rounds, *rh)
                p.gate_up(serial)
                _silu(p.gate, p.up, p.down.rounds, *rg)
                p.down(serial)
                partial = p.down.out[None]
            s.reduce(partial)
        out = np.empty_like(h)
        _add_norm(x, partial, s.w.out_norm, eps, out, bool(self.layers), False, *rh)
        return out


# ---------------------------------------------------------------- the steps between matvecs


@njit(**_JIT)
def _add_norm(x, partial, w, eps, h, add, rnd, xq, dx, s4, s16):  # pragma: no cover - compiled
    # if add, x += partial (1, dim); h = rmsnorm(x) * w; and, if rnd, h rounded into xq/dx/s4/s16
    if add:
        for j in range(x.shape[1]):
            x[0, j] += partial[0, j]
    ops.rmsnorm(x, w, eps, h)
    if rnd:
        intdot.round_into(h[0], xq, dx, s4, s16)


@njit(parallel=True, **_JIT)
def _attention(q, k, v, kc, vc, pos, cos, sin, rope_dims, neox, group, att, serial, rnd, xq, dx, s4, s16):  # pragma: no cover
    # q (1, heads*hd), k and v (1, kv*hd): rope q and k, write k and v at pos of the caches
    # kc, vc (kv, ctx, hd), att (1, heads*hd) = attention of q over them; if rnd, att rounded
    n_kv, _, hd = kc.shape
    ops.rope(q, n_kv * group, hd, rope_dims, pos, cos, sin, neox)
    ops.rope(k, n_kv, hd, rope_dims, pos, cos, sin, neox)
    for g in range(n_kv):
        for d in range(hd):
            kc[g, pos, d] = k[0, g * hd + d]
            vc[g, pos, d] = v[0, g * hd + d]
    if serial:
        for job in range(n_kv * group):
            ops.attend_head(q, kc, vc, pos, group, att, job)
    else:
        for job in prange(n_kv * group):
            ops.attend_head(q, kc, vc, pos, group, att, job)
    if rnd:
        intdot.round_into(att[0], xq, dx, s4, s16)


@njit(**_JIT)
def _silu(gate, up, rnd, xq, dx, s4, s16):  # pragma: no cover - compiled
    # gate (1, f) <- silu(gate) * up, and, if rnd, rounded
    ops.silu_mul_row(gate, up, 0)
    if rnd:
        intdot.round_into(gate[0], xq, dx, s4, s16)
