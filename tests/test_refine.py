"""The decode head's candidates are recomputed exactly (quant.refine_top), against float64 numpy."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from edgetp.model import quant as Q
from tests.test_quant import random_raw, reference


@pytest.mark.parametrize("qt", [QT.Q8_0, QT.Q6_K, QT.Q4_K, QT.Q5_0, QT.F16], ids=lambda t: t.name)
def test_the_k_largest_logits_become_the_float64_dot_rounded_once(qt):
    rows, cols, k = 300, 512, 16
    raw = random_raw(qt, rows, cols, seed=7)
    w, ref = Q.Weight(int(qt), rows, cols, raw), reference(raw, qt, cols)
    x = np.random.default_rng(8).standard_normal(cols).astype(np.float32)
    out = np.empty(rows, np.float32)
    Q.matvec(w, x, out)
    before = out.copy()
    chosen = set(np.argsort(before)[-k:].tolist())
    Q.refine_top(w, x, out, k)
    exact = ref.astype(np.float64) @ x.astype(np.float64)
    for r in range(rows):
        if r in chosen:  # one rounding of the exact dot: within half an ulp of f32 (1 ulp for the sum's own bits)
            assert abs(float(out[r]) - exact[r]) <= np.spacing(np.float32(abs(exact[r]))), r
        else:
            assert out[r] == before[r]


def test_refining_more_rows_than_exist_refines_them_all():
    raw = random_raw(QT.Q8_0, 5, 64, seed=1)
    w, ref = Q.Weight(int(QT.Q8_0), 5, 64, raw), reference(raw, QT.Q8_0, 64)
    x = np.linspace(-1, 1, 64, dtype=np.float32)
    out = np.zeros(5, np.float32)
    Q.refine_top(w, x, out, 64)
    np.testing.assert_allclose(out, ref.astype(np.float64) @ x.astype(np.float64), rtol=1e-6)
