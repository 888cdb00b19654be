"""qwen3 against independent references: llama.cpp and the float64 math of tests/reference.py.

qwen3 is qwen2 without q/k/v biases, with an RMSNorm over each head of q and of k
(blk.N.attn_q_norm / attn_k_norm, head_dim values, the model's rms epsilon) before
the NEOX rotation, and a head_dim read from `qwen3.attention.key_length` that need
not be dim / n_heads (Qwen3-0.6B: 16 heads of 128 on a width of 1024). The models
here are synthetic (tools/synth_gguf.py --arch qwen3) with such a head_dim.

The bounds are test_engine_reference's, for the same reasons (stated there):
float kernels within EXACT (f32 cache) or KV16 (f16 cache) of the spread of the
float64 logits at every position; never further from llama.cpp than llama.cpp is
from the float64 math, plus that bound; the integer decode kernels on Q4_0 as close
to the float64 math on average as llama.cpp (INT8_VS_CPP); greedy text equal to
llama.cpp's for 64 tokens on F32 weights. Tensor parallelism over real processes,
f32 sync, float kernels: the single node's tokens exactly, and the float64 logits.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter

from edgetp.model import gguf, llama
from edgetp.model.generate import LocalRunner
from edgetp.model.tokenizer import Tokenizer
from tests import reference
from tests.test_cli_errors import ask, assert_one_line_error
from tests.test_decode_fast import _same
from tests.test_engine_reference import BOUND, FOX, INT8_VS_CPP, _error, _ours, _spread
from tests.test_parallel import GREEDY, cluster, greedy

# (preset, weight type, overrides): head_dim * heads != dim in each
QWEN3 = {
    "f32": ("tiny-headdim", "f32"),      # 6 heads of 32 on a width of 128, 2 KV heads
    "f16": ("tiny-headdim", "f16"),
    "q8_0": ("tiny-headdim", "q8_0"),
    "q4_0": ("tiny-headdim", "q4_0"),
    "q4_1": ("tiny-headdim", "q4_1"),
    "q4_k": ("tiny-k", "q4_k"),          # 4 heads of 128 on a width of 256 (K-quants need widths of 256)
    "q6_k": ("tiny-k", "q6_k"),
}


@pytest.fixture(scope="module")
def qwen3(synth_model):
    def make(kind: str):
        preset, wt = QWEN3[kind]
        extra = {"head_dim": 128} if preset == "tiny-k" else {}
        return synth_model(preset, wt, arch="qwen3", **extra)

    return make


@pytest.fixture
def float_kernels(monkeypatch):
    monkeypatch.setenv("EDGETP_INT8", "0")


def _ids(path) -> list[int]:
    ids = reference.tokenize(path, FOX)
    assert len(ids) >= 32
    return ids


def test_a_synthetic_qwen3_file_reads_as_llamacpp_reads_it(qwen3):
    cfg = gguf.open_model(qwen3("f32")).config
    assert (cfg.arch, cfg.head_dim, cfg.n_heads, cfg.dim, cfg.rope_neox, cfg.qk_norm, cfg.qkv_bias) == (
        "qwen3", 32, 6, 128, True, True, False)
    w = llama.load_weights(gguf.open_model(qwen3("f32")))
    assert all(x.q_norm.shape == (32,) and x.k_norm.shape == (32,) and x.bq is None for x in w.layers)


@pytest.mark.parametrize("kind,kv_type", [(k, "f16") for k in QWEN3] + [("f32", "f32"), ("q8_0", "f32")])
def test_logits_at_every_position_equal_the_exact_float64_math(qwen3, kind, kv_type, float_kernels):
    assert_exact_at_every_position(qwen3(kind), kv_type)


def assert_exact_at_every_position(path, kv_type: str) -> None:
    """The float kernels' logits of FOX within BOUND[kv_type] of the float64 math's spread, at every position."""
    ids = Tokenizer.from_metadata(gguf.open_model(path).metadata).encode(FOX)
    exact = reference.exact_logits(path, ids, kv_type)
    err = _error(_ours(path, ids, kv_type), exact, _spread(exact))
    assert err.max() <= BOUND[kv_type], f"max error {err.max():.2e} of the spread > {BOUND[kv_type]:.0e}"


@pytest.mark.parametrize("kind,kv_type", [(k, "f16") for k in QWEN3] + [("f32", "f32")])
def test_logits_are_never_further_from_llamacpp_than_llamacpp_is_from_exact(llama_cpp, qwen3, kind, kv_type,
                                                                            float_kernels):
    path = qwen3(kind)
    assert_never_further_from_llamacpp_than_it_is_from_exact(path, _ids(path), kv_type)


def assert_never_further_from_llamacpp_than_it_is_from_exact(path, ids, kv_type: str) -> None:
    """At every position: ours against llama.cpp within llama.cpp's own distance from the float64
    math plus BOUND[kv_type] (of the spread of the exact logits)."""
    cpp = reference.logits(path, ids, kv_type)
    exact = reference.exact_logits(path, ids, kv_type)
    spread = _spread(exact)
    ours_vs_cpp = _error(_ours(path, ids, kv_type), cpp, spread)
    cpp_vs_exact = _error(cpp, exact, spread)
    worst = int(np.argmax(ours_vs_cpp - cpp_vs_exact))
    assert np.all(ours_vs_cpp <= cpp_vs_exact + BOUND[kv_type]), (
        f"position {worst}: ours vs llama.cpp {ours_vs_cpp[worst]:.2e} > llama.cpp vs exact "
        f"{cpp_vs_exact[worst]:.2e} + {BOUND[kv_type]:.0e}")


def test_int8_q4_0_decode_logits_are_as_close_to_exact_as_llamacpps(llama_cpp, qwen3, monkeypatch):
    monkeypatch.delenv("EDGETP_INT8", raising=False)
    path = qwen3("q4_0")
    assert_int8_decode_as_close_as_llamacpp(path, _ids(path))


def assert_int8_decode_as_close_as_llamacpp(path, ids) -> None:
    """Decoded one token at a time on the integer kernels: on average as close to the float64 math
    as llama.cpp (INT8_VS_CPP), and not exact (the kernels really rounded)."""
    runner = LocalRunner(gguf.open_model(path), 256, kv_type="f32")
    ours = np.stack([runner.logits([t], p)[0] for p, t in enumerate(ids)])  # one token at a time: decode kernels
    exact = reference.exact_logits(path, ids)
    spread = _spread(exact)
    mine = _error(ours, exact, spread).mean()
    cpp = _error(reference.logits(path, ids), exact, spread).mean()
    assert 1e-4 < mine <= INT8_VS_CPP * cpp, f"mean error {mine:.2e} vs llama.cpp's {cpp:.2e}"


@pytest.mark.parametrize("kv_type", ["f16", "f32"])
def test_greedy_continuation_is_token_identical_to_llamacpp_for_64_tokens(llama_cpp, qwen3, kv_type):
    path = qwen3("f32")
    assert_greedy_as_llamacpps(path, _ids(path), kv_type)


def assert_greedy_as_llamacpps(path, ids, kv_type: str) -> None:
    """64 greedy tokens after ids, one node with a cache of kv_type: llama.cpp's."""
    ours = greedy(LocalRunner(gguf.open_model(path), 256, kv_type=kv_type), ids, 64)
    assert ours == reference.greedy(path, ids, 64, kv_type)


def assert_each_change_far_from_llamacpp(path, ids, changes) -> None:
    """The file read with each config change of `changes` (what a reader that left a term out would
    do) puts the logits far from llama.cpp's (100 times BOUND): the tests that hold them close can fail."""
    from dataclasses import replace  # noqa: PLC0415

    cpp = reference.logits(path, ids, "f32")
    for change in changes:
        mf = gguf.open_model(path)
        mf.config = replace(mf.config, **change)
        err = _error(LocalRunner(mf, 256, kv_type="f32").logits(ids, 0), cpp, _spread(cpp))
        assert err.max() > 100 * BOUND["f32"], change


@pytest.mark.parametrize("kind", ["q8_0", "q4_k"])
def test_the_fused_decode_plan_applies_the_head_norms_bit_identical_to_the_per_op_path(qwen3, kind, int8, kv_type):
    _same(gguf.open_model(qwen3(kind)), kv_type=kv_type)


# ---------------------------------------------------------------- tensor parallel, real processes


@pytest.fixture(scope="module")
def control():
    from edgetp.model import quant  # noqa: PLC0415
    from edgetp.net.loopthread import LoopThread  # noqa: PLC0415

    quant.set_threads(1)  # root, workers and the test share two cores
    with LoopThread() as lt:
        yield lt
    quant.set_threads(None)


def test_two_three_and_four_processes_with_uneven_weights_give_the_single_nodes_tokens_and_the_exact_logits(
        float_workers, control, synth_model, float_kernels):
    # 6 heads, 3 KV heads, FFN 7 blocks of 32: nothing divides evenly over 2 or 3 nodes
    assert_processes_match(control, synth_model("tiny-odd", "q8_0", arch="qwen3", head_dim=32), float_workers)


def assert_processes_match(control, path, workers, check=None, runs=((2, [1, 3]), (3, [3, 1, 2]), (4, [2, 4, 1, 3])),
                           **kw) -> None:
    """`runs` of real processes (default 2, 3 and 4) with uneven weights: the single node's 64 greedy tokens,
    the float64 logits. kw goes to ClusterRunner.connect (experts=...); check(plan), if given, sees each plan first."""
    ids = Tokenizer.from_metadata(gguf.open_model(path).metadata).encode(FOX)
    expected = greedy(LocalRunner(gguf.open_model(path), 256), ids, 64)
    exact = reference.exact_logits(path, ids, "f16")
    for n, weights in runs:
        runner = cluster(control, path, workers[: n - 1], weights, **kw)
        try:
            shares = [(s.kv_groups, s.ffn_cols, s.vocab_rows, s.experts) for s in runner.plan.shares]
            assert len({s[0] for s in shares}) == n, f"every process must hold a different slice: {shares}"
            if check is not None:
                check(runner.plan)
            runner.begin(GREEDY)
            try:
                got = runner.logits(ids, 0)
            finally:
                runner.end()
            err = _error(got, exact, _spread(exact))
            assert err.max() <= BOUND["f16"], f"{n} processes, shares {shares}: max error {err.max():.2e}"
            assert greedy(runner, ids, 64) == expected, f"{n} processes, shares {shares}"
        finally:
            runner.close()


# ---------------------------------------------------------------- bad input


def _without(src, dst, drop: str, instead: np.ndarray | None = None):
    """A copy of src without the tensor `drop`, or with `instead` (same type) in its place (an f32
    tensor added where src has none of that name)."""
    return _rewrite(src, dst, drop, instead=instead)


def _rewrite(src, dst, drop: str | None = None, meta: dict | None = None, arch: str | None = None,
             instead: np.ndarray | None = None):
    """A copy of src without the tensor `drop` (or with `instead` in its place), with the metadata
    values `meta` (of the keys' own types) and the architecture `arch`, where given."""
    reader = GGUFReader(src)
    writer = GGUFWriter(dst, arch or reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        writer.add_key_value(name, (meta or {}).get(name, field.contents()), field.types[0],
                             sub_type=field.types[-1] if len(field.types) > 1 else None)
    for t in reader.tensors:
        if t.name != drop or instead is not None:
            data = instead if t.name == drop else np.asarray(t.data)
            writer.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    if instead is not None and drop not in {t.name for t in reader.tensors}:
        writer.add_tensor(drop, instead)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_a_qwen3_file_without_a_q_norm_is_refused_in_one_line_naming_the_tensor(qwen3, tmp_path):
    bad = _without(qwen3("f32"), tmp_path / "no-q-norm.gguf", "blk.1.attn_q_norm.weight")
    assert_one_line_error(ask(bad), str(bad), "'blk.1.attn_q_norm.weight' is missing")
    with pytest.raises(gguf.GGUFError, match="blk.1.attn_q_norm.weight"):
        gguf.open_model(bad)
