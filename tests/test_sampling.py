"""A shard's sampling candidates (sampling.candidates) against a plain statement of them: the k
largest logits by a stable sort (ties: lower id first), and the log-sum-exp summed exactly."""

from __future__ import annotations

import math

import numpy as np
import pytest

from edgetp.model import sampling


def _want(x: np.ndarray, k: int, offset: int) -> tuple[np.ndarray, np.ndarray, float]:
    order = np.argsort(-x.astype(np.float64), kind="stable")[:k]  # equal values keep id order
    top = x.max()
    # as candidates defines it: each x - top rounded in f32, then exp and the sum in exact arithmetic
    lse = float(top) + math.log(math.fsum(math.exp(float(np.float32(v - top))) for v in x))
    return order + offset, x[order], lse


@pytest.mark.parametrize("n, k", [(128256, 40), (49152, 256), (1000, 1), (7, 40), (64, 64)])
def test_candidates_are_the_stable_top_k_and_the_exact_log_sum_exp(n, k):
    rng = np.random.default_rng(n + k)
    x = (rng.standard_normal(n) * 3).astype(np.float32)
    x[rng.integers(0, n, max(n // 8, 2))] = x.max()  # many ties at the top, across the k-th place
    x[rng.integers(0, n, max(n // 8, 2))] = np.float32(np.sort(x)[-min(k, n)])  # and at the k-th value
    x[n // 2] = -np.inf  # a masked logit
    c = sampling.candidates(x, 5, [], sampling.SamplingParams(temperature=1.0, top_k=k))
    ids, vals, lse = _want(x, min(k, n), 5)
    assert np.array_equal(c.ids, ids)
    assert np.array_equal(c.logits.view(np.uint32), vals.view(np.uint32))
    assert abs(c.lse - lse) <= 1e-12 * abs(lse) + 1e-12


def test_temperature_and_penalty_apply_before_the_selection():
    x = np.array([1.0, 3.0, 2.0, 3.0, -1.0], np.float32)
    p = sampling.SamplingParams(temperature=0.5, top_k=3, repeat_penalty=2.0)
    c = sampling.candidates(x, 0, [1], p)  # token 1 penalised: 3 / 2 = 1.5; all then / 0.5
    assert c.ids.tolist() == [3, 2, 1]
    assert c.logits.tolist() == [6.0, 4.0, 3.0]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("where", [2, 3999])
def test_a_nan_logit_on_any_shard_is_refused_in_one_line(temperature, where):
    params = sampling.SamplingParams(temperature=temperature, top_k=2)
    x = np.linspace(-3, 3, 4000).astype(np.float32)[::-1].copy()  # best first: a NaN late is past the top 2
    x[where] = np.nan  # np.argmax would pick the NaN
    shards = [sampling.candidates(x[:2000], 0, [], params), sampling.candidates(x[2000:], 2000, [], params)]
    with pytest.raises(ValueError, match=r"^the model's logits hold NaN( \(token (2|3999)\))?: its weights are corrupt"):
        sampling.Sampler(params).pick(sampling.merge(shards))
    clean = sampling.candidates(np.nan_to_num(x), 0, [], params)
    assert sampling.Sampler(params).pick(clean) in (0, 1)


def test_a_negative_seed_is_taken_modulo_2_to_the_64_as_the_api_takes_it():
    """`edgetp ask --local --seed -1` and the API's seed -1 are one seed: numpy's generator wants 0..2^64-1."""
    SamplingParams, Sampler = sampling.SamplingParams, sampling.Sampler
    assert SamplingParams(seed=-1).seed == 2**64 - 1 and SamplingParams(seed=2**64 + 5).seed == 5
    assert Sampler(SamplingParams(seed=-1)).rng.random() == np.random.default_rng(2**64 - 1).random()
