"""Decode of a shard, one token of each of n sequences, with everything but the arithmetic done once.

Shard.forward for one token used to spend about as long in Python and numba
dispatch as in its kernels (SmolLM2-135M: 211 matvecs a token, each checking
shapes, reading the environment and allocating). A `Plan` does that work once
per shard: a buffer for every activation and rounded token, every matvec bound
to its kernel and buffers, q, k and v (gate and up) of one layout in one kernel
call, and the small steps between the matvecs fused into one compiled call each
(residual add, norm and rounding; rope, cache write, attention and rounding;
silu and rounding). It calls the same kernels on the same values in the same
order as the per-op path (`Shard.forward` for n > 1): the results are the same bits.

A step may carry one token from each of several sequences (`Shard.forward_rows`),
each at its own position of its own KV slot: every buffer then has a row per token,
the integer kernels read each weight once for all the rows (intdot.TokenProducts;
the kept panels of every quantized type but Q8_0, intgemm.Kept) and each row gets exactly the
arithmetic of a token alone, so a sequence's text does not depend on what else runs
beside it. Float kernels run row by row.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable

import numpy as np
from numba import njit, prange

from edgetp.model import intdot, intgemm, kvcache, moe, ops, passes, quant

if TYPE_CHECKING:
    from edgetp.model.llama import Layer, Shard

_JIT = dict(cache=True, nogil=True)
_NO_NORM = np.zeros(0, np.float32)  # a layer without q/k norms
_NO16 = (np.zeros((0, 32), np.int16), np.zeros((0, 1), np.float32), np.zeros((0, 1), np.int32))  # no 16-bit rounding


class Matvecs:
    """out[b] = [W_0 @ x[b], W_1 @ x[b], ...] for the first n of `rows` tokens, for weights that read
    one x (rows, cols) f32 (and its rounding xr, which the step before fills): per layout one integer
    kernel call (the single-token kernel for one token, the several-token one for more), float
    kernels for the rest, token by token. `out`, if given, is the (rows, sum of the weights' rows)
    buffer to write (matvecs that never run at once may share one). `x16`, if given, is x's 16-bit
    rounding (intgemm.quantized's tuple) that the step before fills for a WIDE type's kept panels
    (`rounds16`); without it they round x themselves (_Wide)."""

    def __init__(self, ws: list[quant.Weight], x: np.ndarray, xr: intdot.Rounded, int8: bool,
                 out: np.ndarray | None = None, at: int = 0, x16: tuple[np.ndarray, ...] | None = None) -> None:
        starts = at + np.cumsum([0] + [w.rows for w in ws])  # their columns of out (given, or their own)
        self.out = np.empty((x.shape[0], int(starts[-1])), np.float32) if out is None else out
        self.views = [self.out[:, a:b] for a, b in zip(starts[:-1], starts[1:])]
        self.products: list[intdot.Products] = []  # token 0
        self.tokens: list[intdot.TokenProducts] = []  # tokens 0..n-1
        self.kept: list[intgemm.Kept | _Wide] = []  # tokens 0..n-1, on kept panels
        self.floats: list[tuple[quant.Weight, np.ndarray, np.ndarray]] = []
        self.rounds16 = False  # whether the step before must round x to 16 bits into x16
        by_type: dict[int, list[int]] = {}
        for i, w in enumerate(ws):
            quant.check_io(w, x[0], self.views[i][0], None)
            if (int8 and quant.kept(w)) or quant.int8_kernel(w, int8):
                by_type.setdefault(w.qtype, []).append(i)
            else:
                self.floats.append((w, x, self.views[i]))
        for t, idx in by_type.items():
            data, at = [ws[i].data for i in idx], [int(starts[i]) for i in idx]
            if quant.kept(ws[idx[0]]):
                panels = [quant.panels(ws[i]) for i in idx]
                if intgemm.wide(t) and x16 is not None:  # 16-bit activations (Q4_1), the step before's
                    self.kept.append(intgemm.Kept(t, panels, x16, self.out, at))
                    self.rounds16 = True
                elif intgemm.wide(t):  # rounded from x by each call
                    self.kept.append(_Wide(t, panels, x, self.out, at))
                else:
                    self.kept.append(intgemm.Kept(t, panels, xr, self.out, at))
                continue
            self.products.append(intdot.Products(t, data, xr.row(0), self.out[0], at))
            if x.shape[0] > 1:
                self.tokens.append(intdot.TokenProducts(t, data, xr, self.out, at))
        # whether the step before must round x to int8 (16-bit kept panels read x16; a _Wide rounds its own)
        self.rounds = bool(self.products or any(not isinstance(p, _Wide) and p.rounded for p in self.kept))

    def __call__(self, n: int, serial: bool) -> None:
        for p in self.kept:
            p(n, serial)
        for p in self.products if n == 1 else ():
            p(serial)
        for p in self.tokens if n > 1 else ():
            p(n, serial)
        for w, x, out in self.floats:
            for b in range(n):
                quant.float_matvec(w, x[b], out[b])


class _Wide:
    """Kept panels of a WIDE type (Q4_1) given no x16 (a mixture's experts): each call rounds its n rows
    of x to 16 bits (intgemm.quantize16, as prefill rounds them) before the products, so a token's row
    is the bits prefill gives it."""

    def __init__(self, qtype: int, panels: list[intgemm.Panels], x: np.ndarray, out: np.ndarray,
                 starts: list[int]) -> None:
        self.x = x
        self.q = intgemm.quantized(np.zeros_like(x), True)  # (qx, dx, sums, sums16), filled by each call
        self.kept = intgemm.Kept(qtype, panels, self.q, out, starts)

    def __call__(self, n: int, serial: bool) -> None:
        qx, dx, sums, _ = self.q
        intgemm.quantize16(self.x[:n], qx[:n], dx[:n], sums[:n])
        self.kept(n, serial)


class _Split:
    """Matvecs of one weight in pieces of its rows (cuts): piece k fills columns cuts[k]:cuts[k+1] of
    out, so that a reduce can send each piece while the next computes. Each row's result is its bits
    whole: a row's dot product does not depend on the rows beside it."""

    def __init__(self, w: quant.Weight, x: np.ndarray, xr: intdot.Rounded, int8: bool, cuts: tuple[int, ...],
                 x16: tuple[np.ndarray, ...] | None = None) -> None:
        self.out = np.empty((x.shape[0], w.rows), np.float32)
        self.cuts = cuts if cuts[-1] == w.rows else (0, w.rows)
        self.parts = [Matvecs([quant.row_piece(w, a, b)], x, xr, int8, self.out, a, x16)
                      for a, b in zip(self.cuts[:-1], self.cuts[1:])]
        self.rounds, self.rounds16 = self.parts[0].rounds, self.parts[0].rounds16
        self.products = [q for part in self.parts for q in part.products]  # its integer kernel calls: one token
        self.tokens = [q for part in self.parts for q in part.tokens]  # several
        self.kept = [q for part in self.parts for q in part.kept]  # any number, on kept panels

    def __call__(self, n: int, serial: bool) -> None:
        for part in self.parts:
            part(n, serial)

    def piece(self, n: int, serial: bool, k: int) -> None:
        self.parts[k](n, serial)


class _LayerPlan:
    """One layer's matvecs and the views of their outputs, (rows, width) each."""

    def __init__(self, shard: Shard, layer: Layer, h: np.ndarray, r: dict[str, intdot.Rounded],
                 r16: dict[str, tuple[np.ndarray, ...]], int8: bool, cuts: tuple[int, ...]) -> None:
        hd = shard.w.cfg.head_dim
        self.layer = layer
        self.qkv = self.o = self.gate_up = self.down = self.moe = None
        if shard.n_kv:
            self.qkv = Matvecs([layer.wq, layer.wk, layer.wv], h, r["h"], int8, x16=r16["h"])
            self.q, self.k, self.v = self.qkv.views
            self.att = np.empty((h.shape[0], shard.n_heads * hd), np.float32)
            self.o = _Split(layer.wo, self.att, r["att"], int8, cuts, r16["att"])
        if shard.n_ffn and layer.moe is not None:  # a mixture: its experts, a token at a time
            self.moe = _Experts(layer.moe, h.shape[0], shard.w.cfg.dim, int8)
        elif shard.n_ffn:
            self.gate_up = Matvecs([layer.w_gate, layer.w_up], h, r["h"], int8, x16=r16["h"])
            self.gate, self.up = self.gate_up.views
            self.down = _Split(layer.w_down, self.gate_up.out[:, : shard.n_ffn], r["gate"], int8, cuts, r16["gate"])


class _Experts:
    """moe.ffn for the n rows of a decode step, each held expert's gate/up and down bound once to
    their kernels and buffers, as _LayerPlan binds a dense FFN's. The rows are routed together and
    each expert runs once on the rows routed to it (the several-token kernels read it once for
    them); every row gets the per-op path's bits for its token alone (Shard.forward, n == 1)."""

    def __init__(self, e: moe.Experts, rows: int, dim: int, int8: bool) -> None:
        self.e = e
        width = next(w.rows for w in e.gate if w is not None)
        n_exp, k = len(e.gate), e.used
        self.h, self.rh = np.empty((rows, dim), np.float32), intdot.Rounded.rows(rows, dim)  # the step's rows
        self.x, self.rx = np.empty((rows, dim), np.float32), intdot.Rounded.rows(rows, dim)  # one expert's rows
        self.rg = intdot.Rounded.rows(rows, max(width, 32))
        self.gate_up: dict[int, Matvecs] = {}
        self.down: dict[int, Matvecs] = {}
        gu_out, down_out = np.empty((rows, 2 * width), np.float32), np.empty((rows, dim), np.float32)  # run in turn
        for x, (gate, up, down) in enumerate(zip(e.gate, e.up, e.down)):
            if gate is not None:
                self.gate_up[x] = Matvecs([gate, up], self.x, self.rx, int8, gu_out)
                self.down[x] = Matvecs([down], gu_out[:, :width], self.rg, int8, down_out)
        self.shared = e.shared if e.shared is not None and e.shared.gate is not None else None
        if self.shared is not None:  # qwen2moe's shared expert: this shard's columns, on every row
            sh, wide = self.shared, self.shared.gate.rows
            self.rs = intdot.Rounded.rows(rows, max(wide, 32))
            self.sh_gate_up = Matvecs([sh.gate, sh.up], self.h, self.rh, int8)
            self.sh_down = Matvecs([sh.down], self.sh_gate_up.out[:, :wide], self.rs, int8)
        self.g = np.zeros(rows, np.float32)  # each row's shared gate (0: none)
        self.rounds = any(m.rounds for m in self.gate_up.values()) or (
            self.shared is not None and self.sh_gate_up.rounds)
        # routing: logits, the k experts of each row and their weights; then each expert's (row, slot) pairs
        self.logits = np.empty((rows, n_exp), np.float32)
        self.ids, self.w = np.empty((rows, k), np.int64), np.empty((rows, k), np.float32)
        self.starts, self.fill = np.empty(n_exp + 1, np.int64), np.empty(n_exp, np.int64)
        self.row_of, self.slot_of = np.empty(rows * k, np.int64), np.empty(rows * k, np.int64)
        self.parts = np.zeros((k, rows, dim), np.float32)  # parts[j, b]: row b's j-th expert, weighted
        self.no_shared = np.zeros((rows, dim), np.float32)  # what _experts_sum reads without one
        self.out = np.empty((rows, dim), np.float32)

    def __call__(self, h: np.ndarray, geglu: bool, hits: np.ndarray, serial: bool) -> np.ndarray:
        """self.out[:n] = this shard's part of the experts' output for each row of h (n, dim)."""
        n = h.shape[0]
        hn = self.h[:n]
        hn[:] = h
        for b in range(n if self.rounds else 0):
            intdot.round_into(hn[b], *self.rh.row(b))
        moe.route_into(self.e, hn, self.logits[:n], self.ids[:n], self.w[:n])
        moe.group(self.ids[:n], hits, self.starts, self.fill, self.row_of, self.slot_of)
        self.parts[:, :n] = 0.0
        starts = self.starts.tolist()
        for x in np.flatnonzero(self.starts[1:] != self.starts[:-1]).tolist():  # the experts routed to
            gu = self.gate_up.get(x)
            if gu is None:  # another shard holds it
                continue
            a, b = starts[x], starts[x + 1]
            m, rows = b - a, self.row_of[a:b]
            _gather(rows, hn, self.x, self.rounds, *self.rh, *self.rx)
            down = self.down[x]
            gu(m, serial)
            _glu(gu.out[:m], gu.views[0].shape[1], geglu, down.rounds, *self.rg, False, *_NO16)
            down(m, serial)
            _weigh(down.out, rows, self.slot_of[a:b], self.w, self.parts)
        shared = self.no_shared[:n]
        if self.shared is not None:  # moe.shared_ffn for every row
            moe.shared_gate(self.shared, hn, self.g[:n])
            gu, down = self.sh_gate_up, self.sh_down
            gu(n, serial)
            _glu(gu.out[:n], gu.views[0].shape[1], geglu, down.rounds, *self.rs, False, *_NO16)
            down(n, serial)
            shared = down.out[:n]
        _experts_sum(self.parts, shared, self.g, self.shared is not None, self.out[:n])
        return self.out[:n]


class Plan:
    """Shard.forward for one token of each of up to `rows` sequences (x (n, dim), in place), each
    token's results the per-op path's bits for it alone (Shard.forward, n == 1).

    Built for one choice of kernels (int8 = quant.int8_decode()); the shard's weights,
    KV caches and reduce are read at each call, the buffers are its own.
    """

    def __init__(self, shard: Shard, int8: bool, rows: int = 1) -> None:
        self.shard = shard
        self.rows = rows
        cfg = shard.w.cfg
        self.h = np.empty((rows, cfg.dim), np.float32)       # normed x, what q/k/v and gate/up read
        self.zeros = np.zeros((rows, cfg.dim), np.float32)   # the partial of a half this shard has no share of
        widths = {"h": cfg.dim, "att": max(shard.n_heads, 1) * cfg.head_dim, "gate": max(shard.n_ffn, 32)}
        self.r = {k: intdot.Rounded.rows(rows, c) for k, c in widths.items()}  # (empty halves round nothing)
        # the 16-bit roundings a WIDE type's kept panels read (Q4_1), filled by the same steps
        self.r16 = {k: intgemm.quantized(np.zeros((rows, -(-c // 32) * 32), np.float32), True)
                    for k, c in widths.items()}
        self.cuts = passes.cuts(cfg.dim, shard.sync_pieces)  # of every partial, when a step goes in pieces
        self.layers = [_LayerPlan(shard, layer, self.h, self.r, self.r16, int8, self.cuts)
                       for layer in shard.w.layers]

    def forward(self, x: np.ndarray, pos: int, slot: int = 0) -> np.ndarray:
        """One token x (1, dim) at position pos of KV slot `slot`."""
        return self.forward_rows(x, np.array([slot], np.int64), np.array([pos], np.int64))

    def forward_rows(self, x: np.ndarray, slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """x (n, dim), n <= rows: row b at positions[b] of KV slot slots[b] (int64 arrays, distinct slots)."""
        return passes.run(self.steps(x, slots, positions), self.shard.reduce)

    def steps(self, x: np.ndarray, slots: np.ndarray, positions: np.ndarray) -> passes.Steps:
        """forward_rows one half-layer at a time (passes.py): yields each partial for the caller to sum."""
        s, cfg = self.shard, self.shard.w.cfg
        n = x.shape[0]
        quant.use_threads()
        threads = quant.threads()
        serial = threads == 1
        h, eps = self.h[:n], cfg.norm_eps
        rh, ra, rg = self.r["h"], self.r["att"], self.r["gate"]
        wh, wa, wg = (self.r16[k][:3] for k in ("h", "att", "gate"))
        zeros = self.zeros[:n]
        cuts = self.cuts if passes.pieced(n, cfg.dim, s.sync_pieces) else None  # None: whole partials
        partial = zeros  # the sum x has yet to get (none before the first layer)
        post = _NO_NORM  # the norm that sum gets before it is added (gemma's post-norms)
        for i, p in enumerate(self.layers):
            layer = p.layer
            if p.qkv is None:
                _add_norm(x, partial, post, layer.attn_norm, eps, h, i > 0, False, *rh, False, *wh)
                partial, fill = zeros, _computed
                partial.fill(0.0)
            else:
                _add_norm(x, partial, post, layer.attn_norm, eps, h, i > 0, p.qkv.rounds, *rh, p.qkv.rounds16, *wh)
                p.qkv(n, serial)
                if layer.bq is not None:
                    p.q[:n] += layer.bq
                    p.k[:n] += layer.bk
                    p.v[:n] += layer.bv
                qn, kn = (_NO_NORM, _NO_NORM) if layer.q_norm is None else (layer.q_norm, layer.k_norm)
                local = cfg.is_local(s.w.layer0 + i)
                cos, sin = (s.cos_swa, s.sin_swa) if local else (s.cos, s.sin)
                rope_dims = cfg.layer_rope_dims(s.w.layer0 + i)  # 0: a NoPE layer (smollm3)
                # q, k and v are column views of qkv's rows, contiguous (typed "C") only for one row: passed
                # as contiguous copies for more, numba compiles _attention once, not twice (24 s cold, of
                # a 135M model's 170 s); the copy is 0.5% of a prefill chunk's layer
                q, k, v = (np.ascontiguousarray(a[:n]) for a in (p.q, p.k, p.v))
                _attention(q, k, v, s.k_bits[i], s.v_bits[i], slots, positions, qn, kn, eps,
                           cos, sin, rope_dims, cfg.rope_neox, cfg.group_size, cfg.attn_scale,
                           cfg.swa_window if local else 0, cfg.attn_softcap, cfg.attn_temp_scale,
                           max(cfg.rope_ctx_orig, 1), p.att[:n], threads, p.o.rounds, *ra, p.o.rounds16, *wa)
                partial, fill = p.o.out[:n], _start(p.o, n, serial, cuts is not None)
            yield partial if cuts is None else passes.Pieces(partial, cuts, fill)
            post = _NO_NORM if layer.attn_post_norm is None else layer.attn_post_norm
            if p.moe is not None:  # routed together, each row the bits of its token alone
                _add_norm(x, partial, post, layer.ffn_norm, eps, h, True, False, *rh, False, *wh)
                partial, fill = p.moe(h, cfg.geglu, s.expert_hits[i], serial), _computed
            elif p.gate_up is None:
                _add_norm(x, partial, post, layer.ffn_norm, eps, h, True, False, *rh, False, *wh)
                partial, fill = zeros, _computed
                partial.fill(0.0)
            else:
                _add_norm(x, partial, post, layer.ffn_norm, eps, h, True, p.gate_up.rounds, *rh,
                          p.gate_up.rounds16, *wh)
                p.gate_up(n, serial)
                _glu(p.gate_up.out[:n], p.gate.shape[1], cfg.geglu, p.down.rounds, *rg, p.down.rounds16, *wg)
                partial, fill = p.down.out[:n], _start(p.down, n, serial, cuts is not None)
            yield partial if cuts is None else passes.Pieces(partial, cuts, fill)
            post = _NO_NORM if layer.ffn_post_norm is None else layer.ffn_post_norm
        if s.w.out_norm is None:  # a pipeline stage before the last: the residual goes on
            if self.layers and post.shape[0]:
                ops.rmsnorm(partial, post, eps, partial)
            x += partial
            return x
        out = np.empty_like(h)
        _add_norm(x, partial, post, s.w.out_norm, eps, out, bool(self.layers), False, *rh, False, *wh)
        return out


def _start(split: _Split, n: int, serial: bool, pieced: bool) -> Callable[[int], None]:
    """What computes split's pieces: the reduce, piece by piece, when the step goes in pieces (passes.Pieces);
    else split is computed now."""
    if pieced:
        return functools.partial(split.piece, n, serial)
    split(n, serial)
    return _computed


def _computed(k: int) -> None:
    """Piece k of a partial computed already."""


# ---------------------------------------------------------------- the steps between matvecs


@njit(**_JIT)
def _add_norm(x, partial, post, w, eps, h, add, rnd, xq, dx, s4, s16, rnd16, q16, d16, m16):  # pragma: no cover
    # x, partial, h (n, dim): if add, x += partial (first normed in place by post (dim,) unless
    # post is empty: gemma's post-norms); h = rmsnorm(x) * w; and, if rnd, row b of h
    # rounded into row b of xq/dx/s4/s16; if rnd16, to 16 bits into row b of q16/d16/m16
    if add and post.shape[0]:
        ops.rmsnorm(partial, post, eps, partial)
    if add:
        for b in range(x.shape[0]):
            for j in range(x.shape[1]):
                x[b, j] += partial[b, j]
    ops.rmsnorm(x, w, eps, h)
    if rnd:
        for b in range(x.shape[0]):
            intdot.round_into(h[b], xq[b], dx[b], s4[b], s16[b])
    if rnd16:
        for b in range(x.shape[0]):
            intgemm.round16_row(h, q16, d16, m16, b)


@njit(parallel=True, **_JIT)
def _attention(q, k, v, kc, vc, slots, positions, qn, kn, eps, cos, sin, rope_dims, neox, group, scale, window, cap,
               temp, floor, att, threads, rnd, xq, dx, s4, s16, rnd16, q16, d16, m16):  # pragma: no cover - compiled
    # q (n, heads*hd), k and v (n, kv*hd), row b a token at positions[b] of KV slot slots[b]: norm
    # each head of its q and k by qn, kn (hd,) unless they are empty (qwen3), rope its q and k, temper
    # its q (ops.temper: temp, floor),
    # write its k and v there in the caches kc, vc (slots, kv, ctx, row: kvcache.kernel_view,
    # written by kvcache.kv_write as the per-op path writes them); att (n, heads*hd) = each row's
    # attention over its own slot (scale, window, cap, threads: ops.attention's); if rnd, each row of att
    # rounded (if rnd16, to 16 bits)
    n = q.shape[0]
    n_kv = kc.shape[1]
    hd = k.shape[1] // n_kv
    heads = n_kv * group
    for b in range(n):
        pos, sl = positions[b], slots[b]
        if qn.shape[0]:
            ops.rmsnorm_heads(q[b : b + 1], hd, qn, eps)
            ops.rmsnorm_heads(k[b : b + 1], hd, kn, eps)
        ops.rope(q[b : b + 1], heads, hd, rope_dims, pos, cos, sin, neox)
        ops.rope(k[b : b + 1], n_kv, hd, rope_dims, pos, cos, sin, neox)
        ops.temper(q[b : b + 1], pos, temp, floor)
        for g in range(n_kv):
            kvcache.kv_write(kc[sl, g, pos], k[b, g * hd : g * hd + hd])
            kvcache.kv_write(vc[sl, g, pos], v[b, g * hd : g * hd + hd])
    per_row = n_kv if ops.by_kv(n, n_kv, threads) else heads  # jobs a row
    if threads <= 1:
        for job in range(n * per_row):
            b = job // per_row
            ops.attend_job(q[b : b + 1], kc[slots[b]], vc[slots[b]], positions[b], group, att[b : b + 1],
                           job % per_row, per_row == n_kv, scale, window, cap)
    else:
        for job in prange(n * per_row):
            b = job // per_row
            ops.attend_job(q[b : b + 1], kc[slots[b]], vc[slots[b]], positions[b], group, att[b : b + 1],
                           job % per_row, per_row == n_kv, scale, window, cap)
    if rnd:
        for b in range(n):
            intdot.round_into(att[b], xq[b], dx[b], s4[b], s16[b])
    if rnd16:
        for b in range(n):
            intgemm.round16_row(att, q16, d16, m16, b)


@njit(**_JIT)
def _gather(rows, h, x, rounds, h0, h1, h2, h3, x0, x1, x2, x3):  # pragma: no cover - compiled
    # x[i] = h[rows[i]] and, if rounds, each of the rows' rounded buffers likewise (x0[i] = h0[rows[i]], ...):
    # one call where five np.take cost ~9 us an expert
    for i in range(rows.shape[0]):
        b = rows[i]
        x[i] = h[b]
        if rounds:
            x0[i] = h0[b]
            x1[i] = h1[b]
            x2[i] = h2[b]
            x3[i] = h3[b]


@njit(**_JIT)
def _weigh(y, rows, slots, w, parts):  # pragma: no cover - compiled
    # y (m, dim): one expert's outputs for rows `rows` (m,), where it is slot `slots` of each;
    # parts[slot, row] = y[i] * w[row, slot] (f32)
    for i in range(rows.shape[0]):
        b, j = rows[i], slots[i]
        for d in range(y.shape[1]):
            parts[j, b, d] = y[i, d] * w[b, j]


@njit(**_JIT)
def _experts_sum(parts, shared, g, add, out):  # pragma: no cover - compiled
    # out (n, dim) = parts[0] + parts[1] + ... + parts[k-1] (f32, in slot order, as llama.cpp adds a
    # token's experts), then, if add, + shared * g per row (its shared expert, gated)
    for b in range(out.shape[0]):
        for d in range(out.shape[1]):
            acc = parts[0, b, d]
            for j in range(1, parts.shape[0]):
                acc += parts[j, b, d]
            out[b, d] = acc + shared[b, d] * g[b] if add else acc


@njit(**_JIT)
def _glu(gu, f, gelu, rnd, xq, dx, s4, s16, rnd16, q16, d16, m16):  # pragma: no cover - compiled
    # gu (n, >= 2f) C-contiguous, gate its columns :f and up f:2f: gate <- silu(gate) * up (gelu:
    # gelu(gate) * up), and, if rnd, each row rounded (if rnd16, to 16 bits). A row of gu slices into contiguous gate and
    # up that numba vectorizes; column views of gu passed in ran 5x slower (0.53 ms, 8 x 8192)
    for b in range(gu.shape[0]):
        row = gu[b]
        if gelu:
            ops.gelu_mul_vec(row[:f], row[f : 2 * f])
        else:
            ops.silu_mul_vec(row[:f], row[f : 2 * f])
        if rnd:
            intdot.round_into(row[:f], xq[b], dx[b], s4[b], s16[b])
        if rnd16:
            intgemm.round16_row(gu[:, :f], q16, d16, m16, b)


def matvec_rows(w: quant.Weight, x: np.ndarray, out: np.ndarray) -> None:
    """out (B, rows) = W @ x[b] for each row of x (B, cols), each row the bits of quant.matvec
    on it alone: the several-token integer kernel (W read once), or the float kernel per row."""
    quant.check_io(w, x, out, x.shape[0])
    quant.use_threads()
    serial = quant.threads() == 1
    if quant.kept(w):
        intgemm.Kept(w.qtype, [quant.panels(w)], intgemm.decode_x(w.qtype, x), out, [0])(x.shape[0], serial)
    elif quant.int8_kernel(w, quant.int8_decode()):
        intdot.matvec_tokens(w.qtype, w.data, intdot.rounded_rows(x), out, serial)
    else:
        for b in range(x.shape[0]):
            quant.float_matvec(w, x[b], out[b])
