"""Block formats and kernels, checked against gguf-py's independent numpy codecs.

Reference: `gguf.quants.dequantize` / `gguf.quants.quantize` (numpy ports of
ggml's C), never our own code. Products are compared with float64 matrix
products of the reference values.

Products run on two paths (fixture int8_kernels): the float kernels
(EDGETP_INT8=0), and the integer kernels, which round the activations first:
decode of every quantized type (intdot.py, any ISA) and prefill (intgemm.py,
any ISA) of every type but intgemm.WIDE's to Q8_0 blocks as llama.cpp does (the reference
x is then gguf-py's own Q8_0 round trip of x); prefill of Q4_1 and Q5_1 (WIDE) to 16 bits
per block (`as_computed` writes that rounding out). The products are then exact
integers times scales.

Tolerance for matvec/matmul: every output is a sum of `cols` f32 products.
The kernels accumulate in f32 with 32 independent lanes (matvec) or in
blocked sgemm (matmul), so at most ~cols/32 + 40 sequential roundings of
2^-24 each touch a term; the block rewrites (d*sum(q*x) + m*sum(x)) make
intermediate terms at most 16x the size of |w*x| for 4-bit types. So
|out - ref| <= 16 * (cols/32 + 40) * 2^-24 * sum|w*x| ~= 1.4e-4 * sum|w*x|
for cols <= 512; we assert 2e-4 * sum_j |w_ij x_j| (float64).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from edgetp.model import quant as Q

QUANTIZED = [QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.IQ4_NL,
             QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_XS]  # fmt: skip
TYPES = [QT.F32, QT.F16, QT.BF16, *QUANTIZED]
REL_TOL = 2e-4


def random_raw(qt: QT, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random *valid* blocks, (rows, row_bytes) uint8: random bytes, f16 scale fields finite and sane."""
    rng = np.random.default_rng(seed)
    if qt in (QT.F32, QT.F16, QT.BF16):
        vals = rng.standard_normal((rows, cols)).astype(np.float32)
        raw = {QT.F32: vals, QT.F16: vals.astype(np.float16), QT.BF16: (vals.view(np.uint32) >> 16).astype(np.uint16)}[qt]
        return np.ascontiguousarray(raw).view(np.uint8).reshape(rows, -1)
    bs, ts = GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, size=(rows, cols // bs, ts), dtype=np.uint8)
    # (byte offset of an f16 field in the block, low, high): d, and m / dmin where the type has one
    fields = {QT.Q8_0: [(0, -0.1, 0.1)], QT.Q4_0: [(0, -0.1, 0.1)], QT.Q4_1: [(0, 0, 0.1), (2, -1, 1)],
              QT.Q5_0: [(0, -0.1, 0.1)], QT.Q5_1: [(0, 0, 0.1), (2, -1, 1)], QT.IQ4_NL: [(0, -0.01, 0.01)],
              QT.Q2_K: [(80, 0, 0.01), (82, 0, 0.01)], QT.Q3_K: [(108, -0.01, 0.01)],
              QT.Q4_K: [(0, 0, 0.01), (2, 0, 0.01)], QT.Q5_K: [(0, 0, 0.01), (2, 0, 0.01)],
              QT.Q6_K: [(208, -0.01, 0.01)], QT.IQ4_XS: [(0, -0.01, 0.01)]}[qt]  # fmt: skip
    for off, lo, hi in fields:
        f16 = rng.uniform(lo, hi, size=(rows, cols // bs)).astype(np.float16)
        raw[..., off : off + 2] = f16.view(np.uint8).reshape(rows, cols // bs, 2)
    return np.ascontiguousarray(raw.reshape(rows, -1))


def reference(raw: np.ndarray, qt: QT, cols: int) -> np.ndarray:
    return gguf.quants.dequantize(raw, qt).reshape(raw.shape[0], cols)


def assert_product_close(got: np.ndarray, w_ref: np.ndarray, x: np.ndarray) -> None:
    """got ~ x @ w_ref.T (x 1-D or 2-D), within REL_TOL of sum |w*x| per output."""
    w64, x64 = w_ref.astype(np.float64), x.astype(np.float64)
    want = x64 @ w64.T
    scale = np.abs(x64) @ np.abs(w64).T
    bad = np.abs(got - want) > REL_TOL * scale + 1e-30
    assert not bad.any(), f"max err {np.abs(got - want).max()} vs scale {scale.max()}"


def as_computed(qt, x: np.ndarray, kernels: str | None, batch: bool = False) -> np.ndarray:
    """x as the kernel sees it. Int8 paths (decode of every quantized type but Q4_1's; prefill of the
    int8 types of intgemm): rounded through gguf-py's Q8_0. 16-bit paths (prefill of intgemm.WIDE, and
    decode of a WIDE type on kept panels: Q4_1):
    per block of 32, q = round(x * 32767 / max|x|) and x = q * (max|x| / 32767), written
    out here in float32 numpy."""
    from edgetp.model import intdot, intgemm  # noqa: PLC0415

    if kernels != "int8":
        return x
    wide_kept = int(qt) in intgemm.KEPT and intgemm.wide(qt) and intgemm.kept(int(qt))
    integer = (batch and intgemm.available(int(qt))) or wide_kept
    int8 = integer and not intgemm.wide(qt) if batch else int(qt) in intdot.KINDS and not wide_kept
    if int8:
        rt = gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(x), QT.Q8_0), QT.Q8_0)
        return rt.reshape(x.shape)
    if integer and intgemm.wide(qt):
        blocks = x.reshape(-1, 32).astype(np.float32)
        amax = np.abs(blocks).max(axis=1, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.rint(blocks * np.where(amax > 0, np.float32(32767) / amax, 0))
        return (q.astype(np.float64) * (amax / np.float32(32767)).astype(np.float64)).reshape(x.shape)
    return x


def weight(qt, rows=67, cols=512, seed=0) -> tuple[Q.Weight, np.ndarray]:
    raw = random_raw(qt, rows, cols, seed)
    return Q.Weight(int(qt), rows, cols, raw), reference(raw, qt, cols)


@pytest.mark.parametrize("n", [1, 4, 7, 9])
@pytest.mark.parametrize("qt", [QT.Q8_0, QT.Q4_K, QT.F16], ids=lambda t: t.name)
def test_exact_products_are_column_order_float64_sums_for_every_token(qt, n):
    # The reference: gguf-py's dequantized rows, each product taken in float64 (exact for two
    # f32s) and summed left to right by numpy's cumsum, rounded once to f32. Token counts that
    # are and are not multiples of the kernel's four side-by-side sums.
    w, ref = weight(qt, rows=9, cols=512, seed=n)
    x = np.random.default_rng(n).standard_normal((n, w.cols)).astype(np.float32)
    want = np.cumsum(ref.astype(np.float64)[None] * x.astype(np.float64)[:, None], axis=2)[..., -1].astype(np.float32)
    got = np.empty((n, w.rows), np.float32)
    Q.exact_matmul(w, x, got)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    one = np.empty(w.rows, np.float32)
    for b in range(n):
        Q.exact_matvec(w, x[b], one)
        np.testing.assert_array_equal(one.view(np.uint32), want[b].view(np.uint32))


@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
def test_dequantize_rows_is_bit_identical_to_gguf_reference(qt):
    w, ref = weight(qt)
    got = Q.dequantize_rows(w, 5, 40)
    assert got.dtype == np.float32 and got.shape == (35, w.cols)
    np.testing.assert_array_equal(got.view(np.uint32), ref[5:40].view(np.uint32))


@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
def test_matvec_equals_float64_product_of_reference_values(qt, int8_kernels):
    w, ref = weight(qt, seed=1)
    x = np.random.default_rng(2).standard_normal(w.cols).astype(np.float32)
    out = np.full(w.rows, np.nan, np.float32)
    Q.matvec(w, x, out)
    assert_product_close(out, ref, as_computed(qt, x, int8_kernels))


@pytest.mark.parametrize("qt", [QT.Q8_0, QT.Q4_0, QT.Q4_1], ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 17, 18, 19, 63, 64, 65, 130])
def test_four_row_matvec_kernels_handle_every_row_tail(qt, rows, int8_kernels):
    # Q8_0/Q4_0/Q4_1 decode walks four rows at a time (repeating the last row past the end,
    # results not stored) inside chunks of 16 rows: every remainder must come out right,
    # and nothing may be written past out[rows - 1]. The VNNI Q4_0 kernel walks rows
    # 16 apart in spans of 64 and pads an odd block count (96 columns = 3 blocks).
    w, ref = weight(qt, rows=rows, cols=96, seed=rows)
    x = np.random.default_rng(6).standard_normal(w.cols).astype(np.float32)
    buf = np.full(rows + 4, np.nan, np.float32)
    Q.matvec(w, x, buf[:rows])
    assert_product_close(buf[:rows], ref, as_computed(qt, x, int8_kernels))
    assert np.isnan(buf[rows:]).all()


@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
def test_matmul_equals_float64_product_for_a_batch_of_tokens(qt, int8_kernels):
    w, ref = weight(qt, rows=301, cols=256, seed=3)
    x = np.random.default_rng(4).standard_normal((37, w.cols)).astype(np.float32)
    out = np.full((37, w.rows), np.nan, np.float32)
    Q.matmul(w, x, out)
    assert_product_close(out, ref, as_computed(qt, x, int8_kernels, batch=True))


@pytest.mark.parametrize("qt", [QT.Q8_0, QT.Q4_0, QT.Q4_1], ids=lambda t: t.name)
@pytest.mark.parametrize("rows,n", [(1, 2), (15, 7), (16, 8), (17, 9), (33, 17), (40, 3)])
def test_matmul_handles_every_row_and_token_tail(qt, rows, n, int8_kernels):
    # the int8 prefill kernels work on panels of 16 rows (AVX-512) or 8 (the last row
    # repeated past the end, masked out of the store) and tiles of 8 or 4 tokens;
    # 96 columns = 3 blocks
    w, ref = weight(qt, rows=rows, cols=96, seed=rows + n)
    x = np.random.default_rng(n).standard_normal((n, w.cols)).astype(np.float32)
    buf = np.full(n * rows + 64, np.nan, np.float32)
    out = buf[: n * rows].reshape(n, rows)
    Q.matmul(w, x, out)
    assert_product_close(out, ref, as_computed(qt, x, int8_kernels, batch=True))
    assert np.isnan(buf[n * rows :]).all()


@pytest.mark.parametrize("threads", [1, 2])
def test_results_are_bit_identical_for_any_thread_count(threads):
    w, _ = weight(QT.Q4_1, rows=301, cols=512)
    x = np.random.default_rng(5).standard_normal((9, w.cols)).astype(np.float32)
    outs = []
    for n in (threads, 1):
        Q.set_threads(n)
        mv, mm = np.empty(w.rows, np.float32), np.empty((9, w.rows), np.float32)
        Q.matvec(w, x[0], mv)
        Q.matmul(w, x, mm)
        outs.append((mv, mm))
    Q.set_threads(2)
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][1], outs[1][1])


def test_smollm2_q4_1_layer_and_q8_0_embeddings_match_reference(smollm2_path, int8_kernels):
    reader = gguf.GGUFReader(smollm2_path)
    tensors = {t.name: t for t in reader.tensors}
    names = [n for n in tensors if n.startswith("blk.0.") and tensors[n].tensor_type == QT.Q4_1]
    assert len(names) == 7
    rng = np.random.default_rng(6)
    for name in names + ["token_embd.weight"]:
        t = tensors[name]
        w = Q.weight_from_gguf(t)
        assert (w.cols, w.rows) == tuple(int(s) for s in t.shape[:2])
        assert np.shares_memory(w.data, t.data)  # a view of the mmapped file, no copy
        rows = min(w.rows, 2048)  # embeddings: a slice of the vocabulary keeps the test quick
        ref = gguf.quants.dequantize(np.asarray(t.data[:rows]), t.tensor_type)
        np.testing.assert_array_equal(Q.dequantize_rows(w, 0, rows), ref)
        x = rng.standard_normal(w.cols).astype(np.float32)
        out = np.empty(rows, np.float32)
        Q.matvec(Q.slice_rows(w, 0, rows), x, out)
        assert_product_close(out, ref, as_computed(t.tensor_type, x, int8_kernels))
        xs = rng.standard_normal((19, w.cols)).astype(np.float32)
        outm = np.empty((19, rows), np.float32)
        Q.matmul(Q.slice_rows(w, 0, rows), xs, outm)
        assert_product_close(outm, ref, as_computed(t.tensor_type, xs, int8_kernels, batch=True))


def test_stories260k_f32_weights_match_reference(stories_path):
    reader = gguf.GGUFReader(stories_path)
    x_rng = np.random.default_rng(7)
    two_d = [t for t in reader.tensors if len(t.shape) == 2]
    assert two_d and all(t.tensor_type == QT.F32 for t in two_d)
    for t in two_d:
        w = Q.weight_from_gguf(t)
        ref = np.asarray(t.data, dtype=np.float32).reshape(w.rows, w.cols)
        np.testing.assert_array_equal(Q.dequantize_rows(w, 0, w.rows), ref)
        x = x_rng.standard_normal(w.cols).astype(np.float32)
        out = np.empty(w.rows, np.float32)
        Q.matvec(w, x, out)
        assert_product_close(out, ref, x)


def test_one_dimensional_tensors_are_not_weights(stories_path):
    norm = next(t for t in gguf.GGUFReader(stories_path).tensors if len(t.shape) == 1)
    with pytest.raises(ValueError, match="2-D"):
        Q.weight_from_gguf(norm)


@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
def test_slice_rows_is_a_view_of_the_same_rows(qt):
    w, ref = weight(qt)
    s = Q.slice_rows(w, 10, 30)
    assert s.rows == 20 and np.shares_memory(s.data, w.data)
    np.testing.assert_array_equal(Q.dequantize_rows(s, 0, 20), ref[10:30])


@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
def test_slice_cols_equals_the_same_columns_of_the_reference(qt, int8_kernels):
    w, ref = weight(qt, cols=1024)
    s = Q.slice_cols(w, 256, 768)
    assert s.cols == 512 and s.data.flags.c_contiguous and not np.shares_memory(s.data, w.data)
    assert s.nbytes == w.nbytes // 2  # memory grows with the slice only
    np.testing.assert_array_equal(Q.dequantize_rows(s, 0, w.rows), ref[:, 256:768])
    x = np.random.default_rng(8).standard_normal(512).astype(np.float32)
    out = np.empty(w.rows, np.float32)
    Q.matvec(s, x, out)
    assert_product_close(out, ref[:, 256:768], as_computed(s.qtype, x, int8_kernels))


@pytest.mark.parametrize("qt", QUANTIZED, ids=lambda t: t.name)
def test_slice_cols_rejects_bounds_that_split_a_block(qt):
    w, _ = weight(qt, cols=1024)
    bs = Q.block_size(int(qt))
    with pytest.raises(ValueError, match="block"):
        Q.slice_cols(w, bs // 2, 512)
    with pytest.raises(ValueError, match="block"):
        Q.slice_cols(w, 0, 512 + bs // 2)


def test_block_size_per_type():
    # ggml's block sizes: 32 for the legacy types and IQ4_NL, 256 for the K-quants and IQ4_XS
    assert [Q.block_size(int(t)) for t in TYPES] == [1, 1, 1] + [32] * 6 + [256] * 6


# Activations: |x| <= 1e6 keeps d = amax/127 in f16 range; |x| >= 1e-30 (or 0) keeps 1/d finite
# (ggml itself casts NaN to int8, undefined behaviour, for blocks smaller than ~1e-36).
finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False, min_value=-1e6, max_value=1e6).filter(
    lambda v: v == 0 or abs(v) >= 1e-30
)


@settings(max_examples=150, deadline=None)
@given(hnp.arrays(np.float32, st.integers(1, 8).map(lambda b: b * 32), elements=finite_f32))
def test_quantize_q8_0_is_byte_identical_to_ggml(x):
    want = gguf.quants.quantize(x.reshape(-1, 32), QT.Q8_0).reshape(-1)
    got = Q.quantize_q8_0(x)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(Q.dequantize_q8_0(got, x.shape[0]), gguf.quants.dequantize(want, QT.Q8_0).reshape(-1))


@pytest.mark.parametrize("wide", [False, True], ids=["int8", "int16"])
def test_prefill_activation_rounding_is_the_documented_formula(wide, int8_prefill):
    # int8 (Q4_0): ggml's x86 quantize_row_q8_0, d = f16(max/127), q = rint(x * 127/max);
    # int16 (Q4_1, Q8_0): d = max/32767 in f32, q = rint(x * 32767/max), each 4 columns
    # stored as (0, 2, 1, 3); rows padded with zeros to whole tiles of tokens
    from edgetp.model import intgemm  # noqa: PLC0415

    rng = np.random.default_rng(12)
    x = (rng.standard_normal((13, 320)) * rng.uniform(0.01, 100, (13, 1))).astype(np.float32)
    x[3, 64:96] = 0  # an all-zero block
    x[5, 0:32] = np.float32(0.5) * np.arange(32, dtype=np.float32) / 31 * 127 / 2  # ties at .5
    qx, dx, sums, sums16 = intgemm.quantized(x, wide)
    assert qx.shape[0] % intgemm.PAD == 0 and not qx[13:].any() and not dx[13:].any()
    top = 32767 if wide else 127
    blocks = x.reshape(13, 10, 32)
    amax = np.abs(blocks).max(axis=2, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        want = np.rint(blocks * np.where(amax > 0, np.float32(top) / amax, np.float32(0)))
    scale = (amax / np.float32(top))[..., 0]
    got = qx[:13].reshape(13, 10, 8, 4)
    got = (got[..., [0, 2, 1, 3]] if wide else got).reshape(13, 10, 32)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(dx[:13], scale if wide else scale.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(sums[:13], want.sum(axis=2))
    if not wide:  # per 16 too (Q6_K's units)
        np.testing.assert_array_equal(sums16[:13], want.reshape(13, 20, 16).sum(axis=2))


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float32, st.integers(1, 8).map(lambda b: b * 32), elements=finite_f32))
def test_quantize_q8_0_back_and_dequantize_add_are_ggmls_values(x):
    # the all-reduce's fused forms: the root replaced by the rounded total it sends, a partial added
    # straight from the blocks; both against gguf-py's (ggml's) quantize and dequantize
    values = gguf.quants.dequantize(gguf.quants.quantize(x.reshape(-1, 32), QT.Q8_0), QT.Q8_0).reshape(-1)
    y = x.copy()
    wire = Q.quantize_q8_0(y, back=True)
    np.testing.assert_array_equal(wire, Q.quantize_q8_0(x))
    np.testing.assert_array_equal(y, values)
    base = np.random.default_rng(x.size).standard_normal(x.size).astype(np.float32)
    out = base.copy()
    Q.dequantize_q8_0(wire, x.size, out, add=True)
    np.testing.assert_array_equal(out, base + values)
    with pytest.raises(ValueError, match="not the Q8_0 blocks"):
        Q.dequantize_q8_0(wire[:-1], x.size)
    with pytest.raises(ValueError, match="writes into x"):  # a copy would take the values, not x
        Q.quantize_q8_0(np.stack([x, x], 1)[:, 0], back=True)


def test_q8_0_scales_round_to_f16_as_numpy_does_at_every_edge():
    # the scale's f16 bits are made in the kernel (kernels.half_bits): against numpy's astype over the
    # subnormal halves, the normal/subnormal boundary, ties, the largest half and overflow to inf
    from numba import njit  # noqa: PLC0415

    from edgetp.model import kernels  # noqa: PLC0415

    @njit(cache=False)
    def bits(u, out):
        for i in range(u.shape[0]):
            out[i] = kernels.half_bits(np.int64(u[i]))

    u = np.concatenate([np.arange(0x32FF0000, 0x39000000, 3, dtype=np.uint32),  # 0 .. subnormal .. normal
                        np.arange(0x477F0000, 0x47810000, dtype=np.uint32),       # 65504, the tie, inf
                        np.arange(0x3F7FE000, 0x3F802000, dtype=np.uint32),       # around 1.0
                        np.array([0, 0x7F800000, 0x7F7FFFFF, 1], np.uint32)])
    u = np.concatenate([u, u | np.uint32(0x80000000)])
    got = np.empty(u.shape[0], np.uint16)
    bits(u, got)
    with np.errstate(over="ignore"):
        want = u.view(np.float32).astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(got, want)


def test_quantize_q8_0_handles_all_zero_and_tie_values():
    x = np.zeros(64, np.float32)
    x[32:] = np.arange(32, dtype=np.float32) - 15.5  # scale 16.5/127: ties and near-ties
    np.testing.assert_array_equal(Q.quantize_q8_0(x), gguf.quants.quantize(x.reshape(2, 32), QT.Q8_0).reshape(-1))
    with pytest.raises(ValueError):
        Q.quantize_q8_0(np.zeros(33, np.float32))


@pytest.mark.parametrize("qt", [QT.IQ2_XXS, QT.TQ1_0, QT.IQ3_S], ids=lambda t: t.name)
def test_unsupported_type_raises_naming_the_type(qt):
    class FakeTensor:  # the attributes weight_from_gguf reads from a gguf ReaderTensor
        name = "blk.0.ffn_up.weight"
        tensor_type = qt
        shape = np.array([256, 4])
        data = np.zeros((4, 256), np.uint8)

    with pytest.raises(Q.UnsupportedTensorType, match=qt.name):
        Q.weight_from_gguf(FakeTensor())
    with pytest.raises(ValueError, match=qt.name):
        Q.block_size(int(qt))


@pytest.mark.parametrize("qt", [QT.F32, QT.F16, QT.BF16], ids=lambda t: t.name)
def test_float_weights_of_any_width_and_subnormal_values_multiply_correctly(qt):
    raw = random_raw(qt, 9, 72, seed=11)
    if qt == QT.F16:  # subnormal, smallest, largest and signed-zero f16 values
        raw.view(np.uint16)[0, :6] = [0x0001, 0x8001, 0x03FF, 0x7BFF, 0x8000, 0x0400]
    w, ref = Q.Weight(int(qt), 9, 72, raw), reference(raw, qt, 72)
    x = np.random.default_rng(12).standard_normal(72).astype(np.float32)
    out = np.empty(9, np.float32)
    Q.matvec(w, x, out)
    assert_product_close(out, ref, x)


def test_wrong_shapes_or_dtypes_are_refused_before_any_kernel_runs():
    w, _ = weight(QT.Q8_0, rows=8, cols=64)
    with pytest.raises(ValueError, match="x must be"):
        Q.matvec(w, np.zeros(32, np.float32), np.zeros(8, np.float32))
    with pytest.raises(ValueError, match="x must be"):
        Q.matvec(w, np.zeros(64, np.float64), np.zeros(8, np.float32))
    with pytest.raises(ValueError, match="out must be"):
        Q.matmul(w, np.zeros((3, 64), np.float32), np.zeros((3, 7), np.float32))


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K,
                                   QT.IQ4_NL, QT.IQ4_XS])
@pytest.mark.parametrize("threads", [1, 2])
def test_kept_weights_decode_each_token_with_the_bits_prefill_gives_it(threads, qtype, int8_kernels):
    """Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS (intgemm.KEPT) decode and prefill read the same panels, packed
    once: a token's products are the same bits alone (matvec), beside 8 others (matmul) and in any subset of
    them (decode.matvec_rows), at any thread count."""
    from edgetp.model import decode, intgemm  # noqa: PLC0415

    w, ref = weight(qtype, rows=301, cols=512)
    if not Q.kept(w):
        pytest.skip(f"EDGETP_INT8=0: {qtype.name} runs on the float kernels" if int8_kernels == "float"
                    else "kept panels did not pass their probe here")
    assert int(qtype) in intgemm.KEPT
    x = np.random.default_rng(6).standard_normal((9, w.cols)).astype(np.float32)
    Q.set_threads(threads)
    try:
        mm, rows = np.empty((9, w.rows), np.float32), np.empty((3, w.rows), np.float32)
        Q.matmul(w, x, mm)
        decode.matvec_rows(w, x[2:5], rows)
        for i in range(9):
            mv = np.empty(w.rows, np.float32)
            Q.matvec(w, x[i], mv)
            if intgemm.available(w.qtype):  # prefill runs on the panels too (the generic ISA's prefill is sgemm's)
                np.testing.assert_array_equal(mv.view(np.uint32), mm[i].view(np.uint32))
            assert_product_close(mv, ref, as_computed(qtype, x[i], int8_kernels))
        np.testing.assert_array_equal(rows, np.stack([_matvec(w, x[i]) for i in (2, 3, 4)]))
    finally:
        Q.set_threads(2)


@pytest.mark.parametrize("which", ["avx512vnni", "avx2", "neon", "generic"])
def test_kept_panels_are_about_the_size_of_the_blocks_they_replace(which):
    """A kept weight is held twice (its file pages, reclaimable, and its panels), so its panels
    must not grow it: Q4_0's 18 bytes per 32 values stay 18 where the ISA converts f16 (20 with
    f32 scales on generic), Q4_1's 20 stay 20 (its f16 d and m; 24 in f32 on generic); Q4_K's
    144 per 256 become 148 (d, dmin and a byte per 6-bit scale
    and min: 128 + 20), 192 on generic (f32 d * sc and -(dmin * mn) per 32: 128 + 64); Q6_K's
    210 stay 210 (a nibble plane and a 2-bit plane, d and its 16 int8 scales: 128 + 64 + 18),
    256 on generic (f32 d * sc per 16: 192 + 64); Q3_K's 110 become 114 (its 96 bytes of 2-bit and
    1-bit planes, d and a byte per 16 values' scale: 96 + 18), 160 on generic (96 + 64); Q2_K's 84
    become 100 (its 64 bytes of 2-bit codes, d, dmin and a byte per 4-bit scale and min: 64 + 36),
    192 on generic (f32 d * sc and -(dmin * mn) per 16: 64 + 128); IQ4_NL's 18 per 32 stay 18 (its
    code book indices as nibbles and f16 d), 20 on generic; IQ4_XS's 136 per 256 become 138 (128 +
    d and a byte per 32 values' scale less its bias: 128 + 10), 160 on generic (f32 d * sc per 32)."""
    from edgetp.model import intgemm  # noqa: PLC0415

    P = intgemm.panel_rows(which)
    rows, cols = 4 * P, 1024  # whole panels: no repeated rows
    g = which == "generic"
    want = {QT.Q4_0: (20 if g else 18) / 32, QT.Q4_1: (24 if g else 20) / 32, QT.Q4_K: (192 if g else 148) / 256,
            QT.Q6_K: (256 if g else 210) / 256, QT.Q3_K: (160 if g else 114) / 256, QT.Q2_K: (192 if g else 100) / 256,
            QT.IQ4_NL: (20 if g else 18) / 32, QT.IQ4_XS: (160 if g else 138) / 256}
    for qt, per_value in want.items():
        w, _ = weight(qt, rows=rows, cols=cols)
        p = intgemm.pack(int(qt), w.data, Q._TAB16, which)  # packing runs anywhere: it only moves bytes
        used = p.q.nbytes + p.d.nbytes + (p.m.nbytes if p.m.size > p.q.shape[0] else 0)
        assert used == rows * cols * per_value, (qt.name, used, rows * cols * per_value)


def _matvec(w: Q.Weight, x: np.ndarray) -> np.ndarray:
    out = np.empty(w.rows, np.float32)
    Q.matvec(w, x, out)
    return out


def test_a_piece_of_a_kept_weight_reads_the_whole_weights_panels():
    """decode's pieces of o and down (quant.row_piece) view the whole weight's panels, so a
    weight is held packed once, and each piece's rows are the whole weight's bits."""
    from edgetp.model import intgemm  # noqa: PLC0415

    w, _ = weight(QT.Q4_0, rows=200, cols=512)
    if not Q.kept(w):
        pytest.skip("kept panels are off (EDGETP_INT8=0) or did not pass their probe here")
    p = intgemm.panel_rows()
    piece = Q.row_piece(w, 2 * p, 2 * p + 37)
    assert np.shares_memory(Q.panels(piece).q, Q.panels(w).q)
    assert np.shares_memory(Q.panels(piece).d, Q.panels(w).d)
    x = np.random.default_rng(7).standard_normal(w.cols).astype(np.float32)
    np.testing.assert_array_equal(_matvec(piece, x), _matvec(w, x)[2 * p : 2 * p + 37])
    odd = Q.row_piece(w, 5, 60)  # not at a panel's start: packed on its own, the same bits
    assert not np.shares_memory(Q.panels(odd).q, Q.panels(w).q)
    np.testing.assert_array_equal(_matvec(odd, x), _matvec(w, x)[5:60])
