"""Element-wise and attention kernels against float64 numpy written out here."""

from __future__ import annotations

import math

import numpy as np
import pytest
from numba import njit

from edgetp.model import ops

ULP = 2.0**-24  # float32's relative rounding unit


@njit(cache=False)
def _exp_all(x, out):
    for i in range(x.shape[0]):
        out[i] = ops.exp32(x[i])


def test_exp32_is_within_two_ulp_of_float64_exp_and_zero_below_its_range():
    x = np.concatenate([np.linspace(-87, 88, 1_000_001), [-1e-30, 0.0, 1e-30]]).astype(np.float32)
    x = x[x > -87]
    got = np.empty_like(x)
    _exp_all(x, got)
    want = np.exp(x.astype(np.float64))
    assert (np.abs(got - want) / want).max() <= 2 * ULP
    low = np.array([-87.0, -88.5, -1e4, -np.inf], np.float32)
    out = np.empty_like(low)
    _exp_all(low, out)
    assert not out.any()


def test_silu_mul_equals_float64_formula():
    rng = np.random.default_rng(1)
    gate = (rng.standard_normal((7, 333)) * 6).astype(np.float32)
    up = rng.standard_normal((7, 333)).astype(np.float32)
    g64 = gate.astype(np.float64)
    want = g64 / (1 + np.exp(-g64)) * up
    ops.silu_mul(gate, up)
    np.testing.assert_allclose(gate, want, rtol=8 * ULP, atol=1e-30)


def _attention64(q, k, v, pos0, group):
    """Causal attention in float64, one query head and position at a time."""
    n = q.shape[0]
    n_kv, _, hd = k.shape
    out = np.zeros((n, n_kv * group * hd))
    for t in range(n):
        for h in range(n_kv * group):
            kv, seen = h // group, pos0 + t + 1
            s = k[kv, :seen].astype(np.float64) @ q[t, h * hd : (h + 1) * hd].astype(np.float64) / math.sqrt(hd)
            p = np.exp(s - s.max())
            out[t, h * hd : (h + 1) * hd] = (p / p.sum()) @ v[kv, :seen].astype(np.float64)
    return out


@pytest.mark.parametrize("kv", [np.float32, np.float16])
@pytest.mark.parametrize("n,pos0", [(2, 0), (70, 5), (130, 0), (64, 64)])
def test_attention_batch_equals_float64_causal_attention(n, pos0, kv):
    # blocks of QBLOCK query rows, a partial last block, and keys already in the cache; an f16
    # cache is read as its values (the float64 reference widens the same f16 values)
    rng = np.random.default_rng(n + pos0)
    n_kv, group, hd, ctx = 2, 3, 16, 256
    q = rng.standard_normal((n, n_kv * group * hd)).astype(np.float32)
    k = (rng.standard_normal((n_kv, ctx, hd)) * 2).astype(kv)
    v = rng.standard_normal((n_kv, ctx, hd)).astype(kv)
    k[:, pos0 + n :] = v[:, pos0 + n :] = np.nan  # past the last position: never read
    out = np.full_like(q, np.nan)
    ops.attention_batch(q, k, v, pos0, group, out)
    np.testing.assert_allclose(out, _attention64(q, k, v, pos0, group), rtol=1e-5, atol=1e-5)
