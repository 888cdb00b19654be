"""Integer decode kernels (edgetp.model.intdot) against gguf-py and across ISAs.

References are independent of the code under test: gguf-py's dequantizers and
its own Q8_0 round trip of x, evaluated in float64. Bit-identity across ISAs is
shown with real child processes, one per ISA (EDGETP_ISA in their environment).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import quants

from edgetp.model import intdot, isa
from edgetp.model.intdot_layouts import LAYOUTS, decode
from tests.isas import HOST, REPO, RUNNABLE, child_env, child_timeout, run_each, skip_unless_runnable

TYPES = sorted(LAYOUTS, key=lambda t: LAYOUTS[t].qtype.name)
IDS = [LAYOUTS[t].qtype.name for t in TYPES]
# where the f16 "d" of each type with an offset sits: a block with d zeroed dequantizes to its offsets alone
D_FIELD = {QT.Q4_1: 0, QT.Q5_1: 0, QT.Q4_K: 0, QT.Q5_K: 0, QT.Q2_K: 80}


def _weights(qt, rows, nb, seed):
    return intdot.random_blocks(qt, rows, nb, np.random.default_rng(seed))


def _x(cols, seed):
    return np.random.default_rng(seed).standard_normal(cols).astype(np.float32)


@pytest.mark.parametrize("qt", TYPES, ids=IDS)
def test_every_layout_row_dequantizes_to_gguf_bits(qt):
    w = _weights(qt, 5, 3, 1)
    codes, ws, wm = decode(LAYOUTS[qt], w)
    ours = np.repeat(ws, 16, axis=1) * codes.astype(np.float32)
    ours = ours + np.repeat(wm, 16, axis=1) if wm is not None else ours
    want = quants.dequantize(w, qt).reshape(5, -1).astype(np.float32)
    assert np.array_equal(ours.view(np.uint32), want.view(np.uint32))


def test_activation_rounding_is_ggml_q8_0_and_sums_are_its_integers():
    x = _x(32 * 37, 2)
    x[64:96] = 0.0  # an all-zero block: d = 0, q = 0
    r = intdot.rounded(x)
    # gguf-py's Q8_0 blocks (an f16 d, then 32 int8): it rounds with 1/d and half away from
    # zero where ggml's x86 code uses 127/amax and half to even: equal on these inputs
    blocks = quants.quantize(x, QT.Q8_0).reshape(37, 34)
    d = blocks[:, :2].copy().view(np.float16)[:, 0].astype(np.float32)
    q = blocks[:, 2:].copy().view(np.int8).astype(np.int64)
    assert r.xq.shape == (10 * 128,) and np.array_equal(r.xq[: 37 * 32], q.reshape(-1)) and not r.xq[37 * 32 :].any()
    # by quad: lane l of quad g is chunk 4g + l % 4, its first 16 values for l < 4, its last 16 after
    for c in range(40):
        for h in range(2):
            i = c // 4 * 8 + 4 * h + c % 4
            want_d, want_s = (d[c], q[c, 16 * h : 16 * h + 16].sum()) if c < 37 else (0.0, 0)
            assert r.dq[i] == want_d and r.sq[i] == want_s, (c, h)
            assert r.xs[i].view(np.uint32) == (np.float32(want_d) * np.float32(want_s)).view(np.uint32), (c, h)


def _float64_reference(qt, w, x):
    """(out, bound): sum_j w_j * x^_j in float64, with gguf's w and gguf's rounded x^ = q*d.

    The kernel's f32 steps: per unit of 16 ws*dx and (ws*dx)*I (2 roundings), per lane one add
    per 128 columns (cols/128 <= cols/32), 7 adds across lanes, and for the offsets dx*S,
    wm*X and one add per 128 columns (<= one per sub-block);
    and gguf's own w_j = fl(ws*code) + wm rounds twice more. With u = 2**-24, each is a
    relative error <= u on partial sums bounded by sum_j (|ws_j code_j| + |wm_j|) |x^_j|,
    so |kernel - exact| <= n u sum(...) for n = cols/32 + 16 + (cols/16 for offsets)
    (first-order; n u << 1). |ws code| + |wm| <= |w| + 2|wm|, and wm is what gguf returns
    for the block with d zeroed.
    """
    rows = w.shape[0]
    wf = quants.dequantize(w, qt).reshape(rows, -1).astype(np.float64)
    cols = wf.shape[1]
    xh = quants.dequantize(quants.quantize(x, QT.Q8_0), QT.Q8_0).astype(np.float64)
    mag = np.abs(wf)
    n = cols / 32 + 16
    if qt in D_FIELD:
        z = w.reshape(rows, -1, LAYOUTS[qt].nbytes).copy()
        z[:, :, D_FIELD[qt] : D_FIELD[qt] + 2] = 0
        mag = mag + 2 * np.abs(quants.dequantize(z.reshape(rows, -1), qt).reshape(rows, -1))
        n += cols / 16
    return wf @ xh, n * 2.0**-24 * (mag @ np.abs(xh)) + 1e-30


@pytest.mark.parametrize("qt", TYPES, ids=IDS)
def test_integer_kernel_matches_the_float64_dot_of_gguf_weights_and_rounded_x(qt):
    assert intdot.available(qt), "the probe failed on this CPU"
    for i, (rows, nb) in enumerate([(1, 1), (3, 3), (17, 5), (63, 3), (64, 7), (65, 1), (130, 3)]):
        L = LAYOUTS[qt]
        w = _weights(qt, rows, nb, 10 + i)
        x = _x(nb * L.values, 20 + i)
        out = np.full(rows, np.nan, np.float32)
        intdot.matvec(qt, w, intdot.rounded(x), out)
        want, bound = _float64_reference(qt, w, x)
        err = np.abs(out - want)
        assert np.all(err <= bound), f"{rows}x{nb} blocks: worst error {err.max():.3g}, bound {bound[err.argmax()]:.3g}"


# ---------------------------------------------------------------- across ISAs, in child processes

CHILD = """
import json, sys
import numpy as np
from edgetp.model import intdot, isa
d = sys.argv[1]
inp = np.load(sys.argv[2])
for k in inp.files:
    if k.startswith("w"):
        qt = int(k[1:])
        w = inp[k]
        out = np.empty(w.shape[0], np.float32)
        intdot.matvec(qt, w, intdot.rounded(inp["x"][: w.shape[1] // intdot.LAYOUTS[qt].nbytes * intdot.LAYOUTS[qt].values]), out)
        np.save(d + f"/out{qt}.npy", out)
json.dump({"isa": isa.current()}, open(d + "/isa.json", "w"))
"""
CHILD_TIMEOUT = child_timeout(900)


@pytest.fixture(scope="module")
def isa_outputs(tmp_path_factory):
    """{isa: {qtype: out}} from one child process per ISA this CPU runs, on the same inputs."""
    base = tmp_path_factory.mktemp("isas")
    arrays = {"x": _x(256 * 5, 3)}
    for i, qt in enumerate(TYPES):
        nb = 5 if LAYOUTS[qt].values == 256 else 37
        arrays[f"w{int(qt)}"] = _weights(qt, 130, nb, 40 + i)
    np.savez(base / "inputs.npz", **arrays)
    results = {}
    for name in RUNNABLE:
        (base / name).mkdir()
    run_each([([sys.executable, "-c", CHILD, str(base / name), str(base / "inputs.npz")], child_env(name))
              for name in RUNNABLE], CHILD_TIMEOUT)
    for name in RUNNABLE:
        d = base / name
        assert json.loads((d / "isa.json").read_text())["isa"] == name
        results[name] = {int(qt): np.load(d / f"out{int(qt)}.npy") for qt in TYPES}
    return arrays, results


def test_every_isa_this_cpu_runs_returns_the_same_bits(isa_outputs):
    _, results = isa_outputs
    assert len(results) >= 2 or HOST[0] not in ("x86_64", "aarch64"), f"only {list(results)} ran"
    first, *others = results
    for name in others:
        for qt in TYPES:
            a, b = results[first][int(qt)], results[name][int(qt)]
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"{first} and {name} differ on {LAYOUTS[qt].qtype.name}"


@pytest.mark.parametrize("name", isa.ISAS)
def test_isa_returns_the_canonical_bits_of_the_numpy_reference(name, isa_outputs):
    skip_unless_runnable(name)
    arrays, results = isa_outputs
    for qt in TYPES:
        w = arrays[f"w{int(qt)}"]
        cols = w.shape[1] // LAYOUTS[qt].nbytes * LAYOUTS[qt].values
        want = intdot.reference(qt, w, intdot.rounded(arrays["x"][:cols]))
        assert np.array_equal(results[name][int(qt)].view(np.uint32), want.view(np.uint32)), LAYOUTS[qt].qtype.name


ASM_CHILD = """
import re, sys
import numpy as np
from edgetp.model import intdot
from gguf import GGMLQuantizationType as QT
for qt in (QT.Q4_0, QT.Q8_0, QT.Q4_K):
    w = intdot.random_blocks(qt, 8, 1, np.random.default_rng(0))
    intdot.matvec(qt, w, intdot.rounded(np.ones(intdot.LAYOUTS[qt].values, np.float32)), np.empty(8, np.float32))
    by_tokens = int(qt) in intdot.ONE_BY_TOKENS.get(intdot.isa.current(), ())  # the kernel matvec ran
    k = (intdot._kernel_tokens if by_tokens else intdot._kernel)(int(qt), intdot.isa.current())
    asm = k.inspect_asm(k.signatures[0])
    print(qt.name, " ".join(sorted(set(re.findall(r"\\b(vpmaddubsw|vpmaddwd|vpdpbusd|vpsignb|sdot|vfmadd\\w*)\\b", asm)))))
"""


@pytest.mark.parametrize("name, want", [("avx2", {"vpmaddubsw", "vpmaddwd"}), ("avxvnni", {"vpdpbusd"}),
                                        ("avx512vnni", {"vpdpbusd"})])
def test_compiled_kernel_uses_the_isas_multiply_instructions_and_no_fma(name, want, tmp_path):
    skip_unless_runnable(name)
    env = dict(child_env(name), NUMBA_CACHE_DIR=str(tmp_path))  # a fresh cache: numba shows no asm of cached code
    res = subprocess.run([sys.executable, "-c", ASM_CHILD], capture_output=True, text=True, env=env, cwd=REPO,
                         timeout=child_timeout(600))
    assert res.returncode == 0, res.stderr[-2000:]
    for line in res.stdout.splitlines():
        qt, *found = line.split()
        assert want <= set(found), f"{qt}: {found}"
        assert not any(f.startswith("vfmadd") for f in found), f"{qt} fuses multiply-adds: {found}"


# ISA -> (what each type's decode kernels must contain, compiled for test_intgemm_isa.CROSS's CPU:
# the ISA's multiply and its prefetch; one of which a 32-value type's must: for avx512vnni the word
# permutation that picks a quad's scales, vpermw, or vpermt2w/vpermi2w from two loads)
DECODE_ASM = {
    "avx512vnni": (["vpdpbusd", "prefetcht1"], ["vpermw", "vpermt2w", "vpermi2w"]),
    "avxvnni": (["{vex}", "vpdpbusd", "prefetcht1"], []),
    "avx2": (["vpmaddubsw", "vpmaddwd", "prefetcht1"], []),
    "neon": (["sdot", "prfm\tpldl2keep"], []),
    "generic": (["prefetcht1"], []),  # plain LLVM vectors: whatever x86-64 selects for them
}


@pytest.mark.parametrize("name", isa.ISAS)
def test_every_isas_decode_kernels_compile_for_its_cpu_and_use_its_instructions(name):
    # compile only: the single- and several-token kernels of ISAs this CPU lacks (avxvnni's VEX
    # encoding, NEON) are valid IR that selects to their instructions; the bit tests run them where
    # the CPU can (and tools/arm64_testbed.sh runs NEON under qemu)
    import llvmlite.binding as llvm  # noqa: PLC0415
    from llvmlite import ir  # noqa: PLC0415

    from edgetp.model import intdot_ir  # noqa: PLC0415
    from tests.test_intgemm_isa import CROSS  # noqa: PLC0415

    llvm.initialize_all_targets()
    llvm.initialize_all_asmprinters()
    triple, cpu, _ = CROSS[name]
    every, one_of = DECODE_ASM[name]
    for qt in TYPES:
        L, i64 = LAYOUTS[qt], ir.IntType(64)
        mod = ir.Module(name="decode")
        mod.triple = triple
        one = ir.Function(mod, ir.FunctionType(ir.VoidType(), [i64] * 11), name="rows")
        b = ir.IRBuilder(one.append_basic_block("entry"))
        a = list(one.args)
        intdot_ir.emit_rows(b, L, name, a[:4], a[4:8], a[8], a[9], a[10])
        b.ret_void()
        several = ir.Function(mod, ir.FunctionType(ir.VoidType(), [i64] * 13), name="tokens")
        b = ir.IRBuilder(several.append_basic_block("entry"))
        a = list(several.args)
        intdot_ir.emit_rows_tokens(b, L, name, a[:4], a[4:8], a[8], a[9], a[10], a[11], a[12])
        b.ret_void()
        m = llvm.parse_assembly(str(mod))
        m.verify()
        asm = llvm.Target.from_triple(triple).create_target_machine(cpu=cpu, opt=3).emit_assembly(m)
        for word in every:
            assert word in asm, f"{name} {L.qtype.name}: no {word} in its decode code for {cpu}"
        if one_of and L.values == 32:
            assert any(w in asm for w in one_of), f"{name} {L.qtype.name}: none of {one_of} for {cpu}"
        if name == "avx512vnni":  # the several-token kernel takes two rows a 512-bit dot (the one-token one, none)
            assert re.search(r"vpdpbusd\s[^\n]*%zmm", asm), f"{L.qtype.name}: no 512-bit vpdpbusd for {cpu}"


def test_a_forced_isa_the_cpu_lacks_imports_quietly_and_leaves_the_kernels_off():
    lacking = next((n for n in isa.ISAS if n not in RUNNABLE), None)
    if lacking is None:  # pragma: no cover - a CPU that runs every ISA does not exist
        pytest.skip("this CPU runs every ISA")
    code = (
        "from edgetp.model import intdot, isa\n"
        "assert not intdot.available(2)\n"
        "try:\n    isa.require()\nexcept isa.IsaError as e:\n    print(e)\nelse:\n    raise SystemExit('no IsaError')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env(lacking), cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stderr
    assert f"EDGETP_ISA={lacking} cannot run" in res.stdout
