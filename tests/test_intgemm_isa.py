"""The integer prefill tiles (intgemm.py) return the same bits on every ISA, and those bits
are the documented arithmetic, evaluated here independently in numpy.

One child process per ISA this CPU runs (EDGETP_ISA, as a user forces it) multiplies the
same weights by the same activations for each type intgemm multiplies, on shapes that are past a
whole panel of rows (8 or 16) and a whole tile of tokens. The definition, per row r and
token t, units u in order (a unit is a block of 32 values, or each 16 of it where the type
scales each 16: Q2_K, Q3_K, Q6_K), all in f32:
  i   = exact integer sum over the unit of w[r, u, j] * qx[t, u, j]  (w the type's integer
        code: nibble - 8 for Q4_0, 6-bit code - 32 for Q6_K, ...)
  acc = fma(f32(i) * dx[t, b], d[r, u], acc)               (dx per 32: b the unit's block)
  offset types (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K):
  acc = fma(dx[t, b] * f32(sum over the unit of qx[t]), m[r, u], acc)
The codes, d and m are read with intdot_layouts (a K-quant's d = d * sc, m = -(dmin * mn)),
whose values this test also holds to gguf-py's dequantizer.
numpy has no fused multiply-add: `_fma` rounds a*b+c once to f32 (the product of two f32
is exact in f64; the f64 sum is made round-to-odd, after which rounding to f32 is exact).
"""

from __future__ import annotations

import json
import sys
from fractions import Fraction

import gguf.quants
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from edgetp.model import intdot_layouts, intgemm, isa
from tests.isas import HOST, RUNNABLE, child_env, child_timeout, run_each

CHILD_TIMEOUT = child_timeout(900)
QTYPES = sorted(intgemm.KINDS)  # Q4_0..Q8_0, Q2_K..Q6_K
ROWS, NB, TOKENS = 37, 24, intgemm.PAD + 5  # rows past 16-row panels, tokens past every tile; 3 K blocks

CHILD = """
import json, os, sys
import numpy as np
from edgetp.model import intdot, intgemm, isa
from edgetp.model.kernels import f16_table
d, inp = sys.argv[1], np.load(sys.argv[2])
x = inp["x"]
for which in [None, *sys.argv[3:]]:  # this process's ISA, then any other named (their outputs in d/<name>)
    at = d if which is None else os.path.join(d, which)
    os.makedirs(at, exist_ok=True)
    for qt in intgemm.KINDS:
        w = inp[f"w{qt}"]
        xq = intgemm.quantized(x, intgemm.wide(qt))
        out = np.full((x.shape[0], w.shape[0]), np.nan, np.float32)
        intgemm.matmul(qt, w, f16_table(), xq, out, which)
        kept = {}
        if qt in intgemm.KEPT:  # decode on kept panels: tokens 1, 2..4 and all of them, rounded as decode rounds
            p = intgemm.pack(qt, w, f16_table(), which)
            for n in (1, 3, x.shape[0]):
                got = np.full((n, w.shape[0]), np.nan, np.float32)
                intgemm.Kept(qt, [p], intgemm.decode_x(qt, x[-n:]), got, [0], which)(n, n == 1)
                kept[f"kept{n}"] = got
        np.savez(at + f"/out{qt}.npz", out=out, qx=xq[0], dx=xq[1], sums=xq[2], **kept)
json.dump({"isa": isa.current(), "available": intgemm.available()}, open(d + "/isa.json", "w"))
"""
# ISAs this CPU lacks whose tiles another ISA's process can still execute: avxvnni's 256-bit
# vpdpbusd/vpdpwssd exist on AVX-512 VNNI (with VL) in their EVEX encoding. What such a run
# cannot check is the VEX encoding itself, which the cross-compile test below reads.
BORROWED = {"avxvnni": "avx512vnni"}


def _child_env(name: str) -> dict[str, str]:
    env = child_env(name)
    env.pop("EDGETP_INT8", None)
    return env


def _weights(qt: int, rng: np.random.Generator) -> np.ndarray:
    """Random GGUF blocks of qt: any quant bytes, f16 scales (and offsets) of mixed
    sign and size, so the float steps round."""
    k = intgemm.KINDS[qt]
    nb = NB // k.sub  # the K-quants' integer scales and mins are any bytes
    blocks = rng.integers(0, 256, (ROWS, nb, k.nbytes), dtype=np.uint8)
    blocks[:2] = 255  # every code at its largest: the 16-bit partial sums at their bound
    blocks[2] = 0x80  # signed codes (Q8_0) at -128: |code| x 127 pairs at their bound (32512)
    for at in k.halves:
        halves = (rng.uniform(0.5, 2, (ROWS, nb)) * rng.choice([-1, 1], (ROWS, nb))
                  * np.float32(2.0) ** rng.integers(-12, -2, (ROWS, nb)))
        blocks[:, :, at : at + 2] = halves.astype(np.float16).view(np.uint8).reshape(ROWS, nb, 2)
    return np.ascontiguousarray(blocks.reshape(ROWS, nb * k.nbytes))


def _values(qt: int, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Integer weights (rows, NB * units, 32 / units), scales d and offsets m (rows, NB * units)
    f32 of each unit (a block of 32, or of 16 where the type scales each 16), read with
    intdot_layouts and held here to gguf-py's dequantizer."""
    units = intgemm.KINDS[qt].units
    codes, ws, wm = intdot_layouts.decode(intdot_layouts.LAYOUTS[qt], w)
    wm = np.zeros_like(ws) if wm is None else wm
    dq = gguf.quants.dequantize(w, QT(qt)).reshape(ROWS, NB * 32)
    assert np.array_equal(dq, ws.repeat(16, 1) * codes.astype(np.float32) + wm.repeat(16, 1))
    step = 2 // units
    return codes.reshape(ROWS, NB * units, 32 // units), ws[:, ::step], wm[:, ::step]


def _fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """f32 a*b+c rounded once (all f32 arrays)."""
    p = a.astype(np.float64) * b.astype(np.float64)  # exact: 24 + 24 bits
    c = c.astype(np.float64)
    s = p + c
    bb = s - p
    e = (p - (s - bb)) + (c - bb)  # TwoSum: s + e == p + c exactly
    even = (s.view(np.int64) & 1) == 0
    odd = np.where((e != 0) & even, np.nextafter(s, np.where(e > 0, np.inf, -np.inf)), s)  # round to odd
    return odd.astype(np.float32)


def reference(qt: int, w: np.ndarray, qx: np.ndarray, dx: np.ndarray) -> np.ndarray:
    """out (tokens, rows) by the definition above, from the child's rounded activations."""
    k = intgemm.KINDS[qt]
    n, units = TOKENS, k.units
    vals, d, m = _values(qt, w)
    q = qx[:n].reshape(n, NB, 8, 4)
    q = (q[..., [0, 2, 1, 3]] if k.wide else q).reshape(n, NB * units, 32 // units).astype(np.int64)
    ints = np.einsum("rbj,tbj->trb", vals, q)  # exact; to f32 rounds to nearest even, as sitofp does
    sums = q.sum(axis=2)  # (n, NB * units): the activations' integer sum over each unit
    acc = np.zeros((n, ROWS), np.float32)
    for bu in range(NB * units):
        b = bu // units
        acc = _fma(ints[:, :, bu].astype(np.float32) * dx[:n, b, None], np.broadcast_to(d[None, :, bu], acc.shape), acc)
        if k.offset:
            sx = dx[:n, b] * sums[:, bu].astype(np.float32)
            acc = _fma(np.broadcast_to(sx[:, None], acc.shape), np.broadcast_to(m[None, :, bu], acc.shape), acc)
    return acc


@pytest.fixture(scope="module")
def isa_outputs(tmp_path_factory):
    """{isa: {qtype: npz}} from one child process per ISA this CPU runs, on the same inputs."""
    base = tmp_path_factory.mktemp("intgemm_isas")
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((TOKENS, NB * 32)) * rng.uniform(0.01, 50, (TOKENS, 1))).astype(np.float32)
    x[2, 32:64] = 0  # an all-zero block
    x[3], x[4] = 1, -1  # every activation +-127: with rows 0-1, the 16-bit partial sums at their bound
    arrays = {"x": x, **{f"w{qt}": _weights(qt, rng) for qt in QTYPES}}
    np.savez(base / "inputs.npz", **arrays)
    results = {}
    extras = {name: [o for o, host in BORROWED.items() if host == name and o not in RUNNABLE] for name in RUNNABLE}
    for name in RUNNABLE:
        (base / name).mkdir()
    run_each([([sys.executable, "-c", CHILD, str(base / name), str(base / "inputs.npz"), *extras[name]],
               _child_env(name)) for name in RUNNABLE], CHILD_TIMEOUT)
    for name, extra in extras.items():
        d = base / name
        info = json.loads((d / "isa.json").read_text())
        assert info == {"isa": name, "available": name != "generic"}, info  # generic prefill: sgemm (vnni.wanted)
        for which, at in [(name, d), *((o, d / o) for o in extra)]:
            results[which] = {qt: dict(np.load(at / f"out{qt}.npz")) for qt in QTYPES}
    return arrays, results


@pytest.mark.parametrize("name", isa.ISAS)
def test_prefill_tiles_of_each_isa_return_the_bits_of_the_numpy_definition(name, isa_outputs):
    arrays, results = isa_outputs
    if name not in results:
        pytest.skip(f"{name} cannot run on this {HOST[0]} CPU: it needs {isa.WHERE[name]}")
    for qt in QTYPES:
        r = results[name][qt]
        want = reference(qt, arrays[f"w{qt}"], r["qx"], r["dx"])
        got = r["out"]
        assert not np.isnan(got).any(), "a row or token was not written"
        bad = got.view(np.uint32) != want.view(np.uint32)
        assert not bad.any(), (f"{QT(qt).name}: {bad.sum()} of {bad.size} differ, "
                               f"max {np.abs(got - want)[bad].max()}")


@pytest.mark.parametrize("name", isa.ISAS)
def test_decode_on_kept_panels_gives_each_token_its_prefill_bits_on_each_isa(name, isa_outputs):
    """Decode of a KEPT type (every type but Q8_0) reads panels packed once: one token, or several, each
    token's row is what prefill computes for it, so a sequence's text does not depend on
    how its tokens were batched, and (test above) that is the numpy definition's."""
    _, results = isa_outputs
    if name not in results:
        pytest.skip(f"{name} cannot run on this {HOST[0]} CPU: it needs {isa.WHERE[name]}")
    assert intgemm.KEPT
    for qt in intgemm.KEPT:
        r = results[name][qt]
        for n in (1, 3, TOKENS):
            got, want = r[f"kept{n}"], r["out"][TOKENS - n : TOKENS]
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"{QT(qt).name}, {n} tokens"


def test_every_isa_this_cpu_runs_gives_the_same_prefill_bits(isa_outputs):
    _, results = isa_outputs
    assert len(results) >= 2 or HOST[0] not in ("x86_64", "aarch64"), f"only {list(results)} ran"
    first, *others = results
    for name in others:
        for qt in QTYPES:
            for key in ("qx", "dx", "sums", "out"):
                a, b = results[first][qt][key], results[name][qt][key]
                assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"{first} and {name} differ in {key} of {qt}"


def _fma_exact(a: np.float32, b: np.float32, c: np.float32) -> np.float32:
    """a*b+c in rationals, rounded once to the nearest f32 (ties to even)."""
    v = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    f = np.float32(float(v))
    near = [f, np.nextafter(f, np.float32(np.inf)), np.nextafter(f, np.float32(-np.inf))]
    return min(near, key=lambda g: (abs(Fraction(float(g)) - v), int(np.float32(g).view(np.uint32)) & 1))


def test_fma_emulation_rounds_once_as_exact_arithmetic_does():
    rng = np.random.default_rng(3)
    a = (rng.standard_normal(3000) * 2.0 ** rng.integers(-8, 8, 3000)).astype(np.float32)
    b = (rng.standard_normal(3000) * 2.0 ** rng.integers(-8, 8, 3000)).astype(np.float32)
    c = (-(a.astype(np.float64) * b) * rng.choice([1.0, 1 + 2.0**-24, 1 - 2.0**-20, 0.5], 3000)).astype(np.float32)
    # near-ties: c cancels most of a*b, or sits half an f32 step from it
    want = np.array([_fma_exact(*t) for t in zip(a, b, c)], np.float32)
    got = _fma(a, b, c)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    twice = (a * b + c).astype(np.float32)  # rounded twice: must differ somewhere, or the cases are too easy
    assert not np.array_equal(twice.view(np.uint32), want.view(np.uint32))


# ISA -> (LLVM triple, a CPU that has it, instructions its tiles must be made of)
CROSS = {
    "avx512vnni": ("x86_64-unknown-linux-gnu", "icelake-server", {0: ["vpdpbusd", "zmm"], 2: ["vpdpwssd", "zmm"]}),
    "avxvnni": ("x86_64-unknown-linux-gnu", "alderlake", {0: ["{vex}", "vpdpbusd"], 2: ["{vex}", "vpdpwssd"]}),
    "avx2": ("x86_64-unknown-linux-gnu", "haswell", {0: ["vpmaddubsw", "vpmaddwd"], 2: ["vpmaddwd"]}),
    "neon": ("aarch64-unknown-linux-gnu", "cortex-a76", {0: ["sdot"], 2: ["smull"]}),
    "generic": ("x86_64-unknown-linux-gnu", "x86-64", {0: ["pmaddwd"], 2: ["pmaddwd"]}),
}


@pytest.mark.parametrize("name", isa.ISAS)
def test_every_isas_tiles_compile_for_its_cpu_and_use_its_instructions(name):
    # compile only (nothing runs): the tiles and panel packing of ISAs this CPU lacks are at
    # least valid LLVM IR that selects to their own instructions; the bit tests above run them
    # where the CPU can
    import llvmlite.binding as llvm  # noqa: PLC0415
    from llvmlite import ir  # noqa: PLC0415

    llvm.initialize_all_targets()
    llvm.initialize_all_asmprinters()
    triple, cpu, want = CROSS[name]
    for qt, k in intgemm.KINDS.items():
        mod = ir.Module(name="tile")
        mod.triple = triple
        fn = ir.Function(mod, ir.FunctionType(ir.VoidType(), [ir.IntType(64)] * 14), name="tile")
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        intgemm._emit_tile(b, qt, name, list(fn.args))
        b.ret_void()
        pack = ir.Function(mod, ir.FunctionType(ir.VoidType(), [ir.IntType(64)] * 7), name="pack")
        b = ir.IRBuilder(pack.append_basic_block("entry"))
        intgemm._emit_pack(b, qt, name, list(pack.args))
        b.ret_void()
        m = llvm.parse_assembly(str(mod))
        m.verify()
        asm = llvm.Target.from_triple(triple).create_target_machine(cpu=cpu, opt=3).emit_assembly(m)
        for word in want.get(2 if k.wide else 0, []):  # int8 kinds multiply as Q4_0
            assert word in asm, f"{name} {QT(qt).name}: no {word} in its code for {cpu}"
