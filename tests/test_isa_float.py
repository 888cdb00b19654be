"""Where bit-identity across ISAs does not hold, and its bound, from one child process per ISA.

The integer decode kernels return the same bits on every ISA (test_intdot.py).
The float paths do not promise that:
- decode of F32/F16/BF16 weights, and of every type under EDGETP_INT8=0, sums
  f32 products in numba loops compiled with FMA contraction allowed: a target
  with FMA (avx2, neon) rounds a*b+c once, one without (the generic x86-64
  target) twice;
- prefill on the float path multiplies decoded tiles with OpenBLAS sgemm,
  whose kernel OpenBLAS picks for the CPU at run time.
Each result is within test_quant's bound of the exact product (2e-4 of
sum|w*x|, derived there), so two ISAs are within twice that of each other.
That is what this test holds them to, on every ISA this CPU runs. A mixed
cluster therefore gives the same decode bits as one node on quantized
weights, and prefill logits that differ by float rounding (~1e-6 relative).
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from tests.isas import RUNNABLE, child_env, child_timeout, run_each
from tests.test_quant import REL_TOL, random_raw, reference

DECODE = [QT.F32, QT.F16, QT.BF16, QT.Q4_K, QT.Q8_0]  # Q4_K, Q8_0: float kernels under EDGETP_INT8=0
PREFILL = [QT.F16, QT.Q4_K, QT.Q6_K, QT.Q5_0]
ROWS, COLS, TOKENS = 97, 512, 9

CHILD = """
import sys
import numpy as np
from edgetp.model import quant as Q
d, inp = sys.argv[1], np.load(sys.argv[2])
for k in inp.files:
    if k.startswith("w"):
        qt = int(k[1:])
        w = Q.Weight(qt, inp[k].shape[0], int(inp["cols"]), np.ascontiguousarray(inp[k]))
        one = np.empty(w.rows, np.float32)
        Q.matvec(w, inp["x"][0], one)
        many = np.empty((inp["x"].shape[0], w.rows), np.float32)
        Q.matmul(w, inp["x"], many)
        np.save(f"{d}/dec{qt}.npy", one)
        np.save(f"{d}/pre{qt}.npy", many)
"""


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    base = tmp_path_factory.mktemp("isa-float")
    x = np.random.default_rng(3).standard_normal((TOKENS, COLS)).astype(np.float32)
    raws = {int(qt): random_raw(qt, ROWS, COLS, seed=i) for i, qt in enumerate(sorted(set(DECODE + PREFILL)))}
    np.savez(base / "in.npz", x=x, cols=COLS, **{f"w{qt}": raw for qt, raw in raws.items()})
    for name in RUNNABLE:
        (base / name).mkdir()
    run_each([([sys.executable, "-c", CHILD, str(base / name), str(base / "in.npz")], child_env(name, EDGETP_INT8="0"))
              for name in RUNNABLE], child_timeout(900))
    got = {name: {(kind, qt): np.load(base / name / f"{kind}{qt}.npy") for qt in raws for kind in ("dec", "pre")}
           for name in RUNNABLE}
    return x, raws, got


@pytest.mark.skipif(len(RUNNABLE) < 2, reason=f"this CPU runs one ISA only ({', '.join(RUNNABLE)})")
@pytest.mark.parametrize("kind, qt", [("dec", q) for q in DECODE] + [("pre", q) for q in PREFILL],
                         ids=lambda v: v.name if isinstance(v, QT) else v)
def test_float_paths_of_two_isas_agree_within_twice_the_exact_product_bound(outputs, kind, qt):
    x, raws, got = outputs
    w = reference(raws[int(qt)], qt, COLS).astype(np.float64)
    xs = x[:1] if kind == "dec" else x
    scale = np.abs(xs.astype(np.float64)) @ np.abs(w).T  # sum |w*x| per output
    first, *others = RUNNABLE
    a = got[first][(kind, int(qt))].reshape(scale.shape)
    for name in others:
        b = got[name][(kind, int(qt))].reshape(scale.shape)
        worst = float((np.abs(a.astype(np.float64) - b) / scale).max())
        assert worst <= 2 * REL_TOL, f"{first} vs {name}: {worst:.2e} of sum|w*x|"
