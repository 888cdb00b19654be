"""The KV cache type (issue 14 item 5): f16 by default, f32 and q8_0 as settings.

References: numpy's own float32 -> float16 conversion (round to nearest even) of what
the f32 cache holds; gguf-py's Q8_0 quantize/dequantize (gguf.quants, the bits of ggml's
quantize_row_q8_0_ref) of it; and the memory formula layers x ctx x slots x KV heads x
head_dim x 2 (K and V) x bytes per value (q8_0: 34 bytes per 32 values).
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants
from numba import njit

from edgetp import config
from edgetp.model import gguf, kvcache, llama
from edgetp.parallel import packing
from edgetp.parallel import plan as planner
from edgetp.parallel.runner import _plan
from edgetp.parallel.shard import model_shape

PROMPT = [1, 17, 42, 99, 7, 250, 3]
BYTES = {"f16": 2, "f32": 4, "q8_0": 34 / 32}  # per value
Q8 = GGMLQuantizationType.Q8_0


@pytest.fixture(scope="module")
def tiny_k(tmp_path_factory):
    """A model whose head size (64) can hold q8_0 (stories260K's, 8, cannot)."""
    from tools import synth_gguf  # noqa: PLC0415

    return synth_gguf.write_preset(tmp_path_factory.mktemp("kv") / "tiny-k.gguf", "tiny-k")


@njit(cache=False)
def _soft_writes(x, out):  # pragma: no cover - compiled
    for i in range(x.shape[0]):
        out[i] = kvcache.f2h_soft(x[i])


@njit(cache=False)
def _soft_reads(h, out):  # pragma: no cover - compiled
    for i in range(h.shape[0]):
        out[i] = kvcache.h2f_soft(h[i])


def test_the_generic_isas_integer_f16_conversions_are_numpys_bits():
    # what the generic ISA's kernels use instead of the CPU's conversion instructions
    every = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    got = np.empty(65536, np.float32)
    _soft_reads(every, got)
    want = every.view(np.float16).astype(np.float32)
    finite = ~np.isnan(want)
    assert np.array_equal(got[finite].view(np.uint32), want[finite].view(np.uint32)) and np.isnan(got[~finite]).all()
    # writes: every midpoint between neighbouring f16 values (the ties), one f32 step either side of
    # it, every f16 value itself, and random f32 bit patterns
    ladder = want[finite & (want >= 0)].astype(np.float64)
    ladder = np.unique(np.concatenate([ladder, [65536.0]]))
    mids = ((ladder[:-1] + ladder[1:]) / 2).astype(np.float32)  # exact in f32
    rng = np.random.default_rng(5)
    x = np.concatenate([mids, np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(np.inf)), want[finite],
                        rng.integers(0, 2**32, 1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32),
                        np.float32([0.0, np.inf, 1e-45, 3e38])])
    x = np.concatenate([x, -x])
    x = x[~np.isnan(x)]
    out = np.empty(x.shape, np.uint16)
    _soft_writes(x, out)
    with np.errstate(over="ignore"):
        assert np.array_equal(out, x.astype(np.float16).view(np.uint16))


def _run(mf, kv_type: str) -> llama.Shard:
    """A 3-slot shard after a prefill (numpy writes the cache), three one-token decode steps
    (the compiled step writes it) and a two-row step (the several-row compiled step)."""
    shard = llama.Shard(llama.load_weights(mf), ctx=32, slots=3, kv_type=kv_type)
    shard.forward(llama.embed(mf, PROMPT), 0, slot=0)
    for i, t in enumerate([5, 300, 12]):
        shard.forward(llama.embed(mf, [t]), len(PROMPT) + i, slot=0)
    shard.forward_rows(llama.embed(mf, [77, 150]), [0, 2], [len(PROMPT) + 3, 0])
    return shard


def test_an_f16_cache_holds_numpys_rounding_of_the_f32_caches_first_layer(stories_path):
    # layer 0's k and v depend only on the token (not on earlier cache contents), so the f16
    # shard must hold exactly numpy's float16 of what the f32 shard holds, whoever wrote it
    mf = gguf.open_model(stories_path)
    wide, half = _run(mf, "f32"), _run(mf, "f16")
    assert half.k_cache[0].dtype == np.float16 and wide.k_cache[0].dtype == np.float32
    filled = len(PROMPT) + 4
    assert np.abs(wide.k_cache[0][0, :, :filled]).min(axis=-1).max() > 0  # every written row holds values
    for got, ref in ((half.k_cache[0], wide.k_cache[0]), (half.v_cache[0], wide.v_cache[0])):
        assert np.array_equal(got.view(np.uint16), ref.astype(np.float16).view(np.uint16))
    # deeper layers read the rounded cache: close to f32, not equal
    deep = half.k_cache[-1][0, :, :filled].astype(np.float32), wide.k_cache[-1][0, :, :filled]
    assert np.allclose(*deep, rtol=0.05, atol=0.05) and not np.array_equal(*deep)


def _q8_0(values: np.ndarray) -> np.ndarray:
    """gguf-py's Q8_0 blocks of f32 rows (..., head_dim), as bytes (..., head_dim / 32 * 34)."""
    rows = values.reshape(-1, values.shape[-1])
    return quants.quantize(rows, Q8).reshape(values.shape[:-1] + (-1,))


def test_the_q8_0_writer_is_gguf_pys_quantizer_bit_for_bit():
    # the ties of roundf (x.5 goes away from zero, not to even), a zero block, huge and tiny
    # scales (f16 subnormal, f16 overflow is not reachable: |x| / 127), signs, random rows
    rng = np.random.default_rng(3)
    rows = [np.r_[127.0, np.arange(31) - 15.5], np.r_[-127.0, np.arange(31) * 0.5 - 7.25], np.zeros(32),
            np.r_[1e-6, rng.standard_normal(31) * 1e-7], np.r_[6e4, rng.standard_normal(31) * 1e4], np.full(32, -0.5)]
    rows = np.concatenate([np.concatenate(rows).reshape(-1, 64),
                           (rng.standard_normal((300, 64)) * rng.uniform(1e-3, 1e2, (300, 1)))]).astype(np.float32)
    cache = kvcache.kv_cache("q8_0", (1, len(rows), 64))
    kvcache.kv_write_rows(kvcache.kernel_view(cache), 0, rows[:, None, :])
    want = _q8_0(rows)
    assert np.array_equal(kvcache.kernel_view(cache)[0], want)
    assert np.array_equal(kvcache.kv_values(cache)[0], quants.dequantize(want, Q8).reshape(rows.shape))
    assert cache["qs"][0, 0, 0, 1] == -16 and cache["qs"][0, 0, 0, 2] == -15  # -15.5 -> -16, -14.5 -> -15


def test_a_q8_0_cache_holds_gguf_pys_q8_0_of_the_f32_caches_first_layer(tiny_k):
    # as for f16: layer 0's k and v depend only on the token, so the q8_0 shard holds exactly
    # gguf-py's Q8_0 of what the f32 shard holds, whichever path (prefill, decode, rows) wrote it
    mf = gguf.open_model(tiny_k)
    wide, q8 = _run(mf, "f32"), _run(mf, "q8_0")
    assert q8.k_cache[0].dtype == kvcache.Q8_0 and q8.k_bits[0].dtype == np.uint8
    filled = len(PROMPT) + 4
    assert np.abs(wide.k_cache[0][0, :, :filled]).min(axis=-1).max() > 0
    for got, ref in ((q8.k_bits[0], wide.k_cache[0]), (q8.v_bits[0], wide.v_cache[0])):
        assert np.array_equal(got, _q8_0(ref))
    # deeper layers read the rounded cache: near f32 (q8_0 steps are 1/127 of a block's largest), not equal
    deep = kvcache.kv_values(q8.k_cache[-1][0, :, :filled]), wide.k_cache[-1][0, :, :filled]
    assert np.allclose(*deep, rtol=0.05, atol=0.05) and not np.array_equal(*deep)


def test_the_cache_takes_two_four_or_34_32nds_bytes_per_value(stories_path, tiny_k):
    for path, types in ((stories_path, ("f16", "f32")), (tiny_k, ("f16", "f32", "q8_0"))):
        mf = gguf.open_model(path)
        cfg = mf.config
        for kv_type in types:
            shard = llama.Shard(llama.load_weights(mf), ctx=16, slots=3, kv_type=kv_type)
            assert shard.kv_bytes == cfg.n_layers * 3 * cfg.n_kv_heads * 16 * cfg.head_dim * 2 * BYTES[kv_type]
    half = llama.Shard(llama.load_weights(mf), ctx=16, slots=3, kv_type="f16")
    assert shard.kv_bytes / half.kv_bytes == 34 / 64  # q8_0: 53% of f16


def test_an_unknown_cache_type_is_one_clear_error(stories_path):
    w = llama.load_weights(gguf.open_model(stories_path))
    with pytest.raises(ValueError, match=r"^KV cache type 'bf16' is not one of f16, f32, q8_0$"):
        llama.Shard(w, ctx=8, kv_type="bf16")
    with pytest.raises(ValueError, match=r"^KV cache type 'q4' is not one of f16, f32, q8_0$"):
        model_shape(gguf.open_model(stories_path), 8, 1, "q4")


def test_q8_0_is_refused_in_one_line_for_a_head_size_not_a_multiple_of_32(stories_path):
    # as llama.cpp refuses it: a q8_0 block is 32 values along one head
    mf = gguf.open_model(stories_path)
    line = r"^KV cache type 'q8_0' needs a head size that is a multiple of 32, this model's is 8 \(use f16 or f32\)$"
    with pytest.raises(ValueError, match=line):
        llama.Shard(llama.load_weights(mf), ctx=8, kv_type="q8_0")
    with pytest.raises(ValueError, match=line):
        model_shape(mf, 8, 1, "q8_0")


def test_the_planner_counts_the_cache_type_chosen(smollm2_path):
    mf = gguf.open_model(smollm2_path)
    cfg = mf.config
    ctx = 1024
    for kv_type, size in BYTES.items():
        shape = model_shape(mf, ctx, 4, kv_type)
        assert shape.group_kv_bytes == cfg.n_layers * ctx * 4 * 2 * cfg.head_dim * size
    assert model_shape(mf, ctx, 4, "q8_0").kv_bytes_per_head_pos == 2 * cfg.head_dim // 32 * 34
    assert model_shape(mf, ctx).kv_bytes_per_head_pos == 2 * cfg.head_dim * 2  # f16 by default
    # one node with room for the weights and 4 slots of f16 (= 2 slots of f32), and a little over
    shape = model_shape(mf, ctx, 4, "f16")
    mem = shape.weight_bytes + cfg.n_kv_heads * shape.group_kv_bytes + planner.DEFAULT_OVERHEAD + (1 << 20)
    nodes = [planner.NodeSpec("solo", 1e9, mem)]
    packing.make_plan(shape, nodes)
    with pytest.raises(planner.PlanError):
        packing.make_plan(model_shape(mf, ctx, 4, "f32"), nodes)
    assert _plan(mf, ctx, 4, nodes, 1, "f32", "f16", "tp", {})[1] == 4
    assert _plan(mf, ctx, 4, nodes, 1, "f32", "f32", "tp", {})[1] == 2  # half the slots at twice the bytes
    # the same memory holds 7 slots of q8_0 where it held 4 of f16 (4 x 64 / 34 = 7.5), not 8
    packing.make_plan(model_shape(mf, ctx, 7, "q8_0"), nodes)
    with pytest.raises(planner.PlanError):
        packing.make_plan(model_shape(mf, ctx, 8, "q8_0"), nodes)


def test_the_setting_comes_from_file_environment_or_flag(tmp_path):
    assert config.load_settings({}, {}, None, default_path=tmp_path / "none.toml").kv_type == "f16"
    p = tmp_path / "edgetp.toml"
    p.write_text('kv_type = "f32"\n')
    assert config.load_settings({}, {}, p).kv_type == "f32"
    assert config.load_settings({}, {"EDGETP_KV_TYPE": "f16"}, p).kv_type == "f16"
    assert config.load_settings({"kv_type": "f32"}, {"EDGETP_KV_TYPE": "f16"}, p).kv_type == "f32"
    assert config.load_settings({"kv_type": "q8_0"}, {}, p).kv_type == "q8_0"
    p.write_text('kv_type = "q4_0"\n')
    with pytest.raises(config.ConfigError, match=r"edgetp.toml: kv_type: expected one of f16, f32, q8_0, got 'q4_0'"):
        config.load_settings({}, {}, p)
    with pytest.raises(config.ConfigError, match=r"^EDGETP_KV_TYPE: kv_type: expected one of"):
        config.load_settings({}, {"EDGETP_KV_TYPE": "half"}, None, default_path=tmp_path / "none.toml")


@pytest.fixture(scope="module")
def worker():
    """One `edgetp worker` process on loopback (float kernels, as the root here runs)."""
    from edgetp.serve.spawn import start_worker, stop  # noqa: PLC0415

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EDGETP_INT8", "0")
        proc, addr = start_worker()
    try:
        yield addr
    finally:
        stop(proc)


def test_a_two_process_cluster_runs_the_cache_type_it_was_given(worker, stories_path, monkeypatch):
    # both ends hold f32 (or f16) caches: the cluster's logits sit at f32 noise from a single
    # node of the same type, much further from one of the other type. Measured as the mean
    # distance, not the largest: the cluster's sums differ from one node's in their last bits,
    # so now and then a key or value straddles an f16 rounding midpoint and lands one f16 step
    # (~1e-3 relative) from the single node's, which attention carries on. On an Emerald Rapids
    # one such straddle put a logit 1.3e-3 off (the largest), where the two cache types lie
    # 8.1e-3 apart at most; the means were 3.3e-5 from its own type and 8.2e-4 from the other.
    from edgetp.model.generate import LocalRunner  # noqa: PLC0415
    from edgetp.net.loopthread import LoopThread  # noqa: PLC0415
    from edgetp.parallel.runner import ClusterRunner  # noqa: PLC0415

    monkeypatch.setenv("EDGETP_INT8", "0")
    mf = gguf.open_model(stories_path)
    ids = PROMPT * 4
    local = {t: LocalRunner(mf, 64, kv_type=t).logits(ids, 0) for t in ("f16", "f32")}
    apart = np.abs(local["f16"] - local["f32"]).mean()
    with LoopThread() as lt:
        for kv_type, other in (("f32", "f16"), ("f16", "f32")):
            runner = lt.run(ClusterRunner.connect(mf, [worker], ctx=64, weights=[1, 1], kv_type=kv_type), timeout=300)
            try:
                assert runner.shard.kv_type == kv_type and runner.plan.shares[1].kv_groups[1] > runner.plan.shares[1].kv_groups[0]
                runner.begin()
                try:
                    got = runner.logits(ids, 0)
                finally:
                    runner.end()
            finally:
                runner.close()
            assert np.abs(got - local[kv_type]).mean() < apart / 10 < np.abs(got - local[other]).mean()


def test_a_two_process_cluster_runs_a_q8_0_cache(worker, tiny_k, monkeypatch):
    # the worker's LOAD carries q8_0: the cluster's logits sit near a single node's with a q8_0
    # cache, far from one with an f16 cache
    from edgetp.model.generate import LocalRunner  # noqa: PLC0415
    from edgetp.net.loopthread import LoopThread  # noqa: PLC0415
    from edgetp.parallel.runner import ClusterRunner  # noqa: PLC0415

    monkeypatch.setenv("EDGETP_INT8", "0")
    mf = gguf.open_model(tiny_k)
    ids = PROMPT * 4
    local = {t: LocalRunner(mf, 64, kv_type=t).logits(ids, 0) for t in ("q8_0", "f16")}
    apart = np.abs(local["q8_0"] - local["f16"]).max()
    with LoopThread() as lt:
        runner = lt.run(ClusterRunner.connect(mf, [worker], ctx=64, weights=[1, 1], kv_type="q8_0"), timeout=300)
        try:
            assert runner.shard.kv_type == "q8_0" and runner.plan.shares[1].kv_groups[1] > runner.plan.shares[1].kv_groups[0]
            runner.begin()
            try:
                got = runner.logits(ids, 0)
            finally:
                runner.end()
        finally:
            runner.close()
    assert np.abs(got - local["q8_0"]).max() < apart / 10


def test_a_load_asking_for_an_unknown_cache_type_is_refused_in_one_line(worker, stories_path):
    from edgetp.net.frames import FrameType  # noqa: PLC0415
    from edgetp.net.link import Link, LinkClosed  # noqa: PLC0415
    from edgetp.net.loopthread import LoopThread  # noqa: PLC0415
    from edgetp.parallel.runner import _hello  # noqa: PLC0415

    async def load():
        host, _, port = worker.rpartition(":")
        link = await Link.connect(host, int(port))
        try:
            await _hello(link, None, "root-test", 1)
            header = {"model": str(stories_path), "fingerprint": gguf.open_model(stories_path).fingerprint, "ctx": 16, "sync": "f32", "slots": 1, "kv_type": "bf16",
                      "kv_groups": [0, 1], "ffn_cols": [0, 32], "vocab_rows": [0, 32]}
            with pytest.raises(LinkClosed, match=r"LOAD: kv_type must be one of f16, f32, q8_0, got 'bf16'") as err:
                await link.request(FrameType.LOAD, header, FrameType.READY, timeout=60)
            assert "\n" not in str(err.value)
        finally:
            link.close()

    with LoopThread() as lt:
        lt.run(load(), timeout=120)


def test_serving_a_model_whose_head_size_cannot_hold_q8_0_stops_with_one_line(stories_path, tmp_path):
    import os  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    (tmp_path / "empty.toml").write_text("")
    repo = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(repo))
    p = subprocess.run([sys.executable, "-m", "edgetp", "serve", "--model", str(stories_path), "--kv-type", "q8_0",
                        "--listen", "127.0.0.1:0", "--config", str(tmp_path / "empty.toml")],
                       capture_output=True, text=True, timeout=300, env=env, cwd=repo)
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr == ("edgetp: KV cache type 'q8_0' needs a head size that is a multiple of 32, "
                        "this model's is 8 (use f16 or f32)\n")


@pytest.mark.parametrize("kv_type,value_bytes", [("f16", 2), ("f32", 4)])
def test_one_node_serves_as_many_slots_as_fit_beside_the_weights_halving_as_a_plan_does(smollm2_path, kv_type,
                                                                                       value_bytes):
    from edgetp.parallel.shard import local_slots

    mf = gguf.open_model(smollm2_path)
    cfg, weights = mf.config, smollm2_path.stat().st_size
    per_slot = 2 * cfg.n_layers * cfg.n_kv_heads * 1024 * cfg.head_dim * value_bytes  # K and V, every layer
    assert local_slots(mf, 1024, 8, kv_type, weights + 8 * per_slot) == 8
    assert local_slots(mf, 1024, 8, kv_type, weights + 8 * per_slot - 1) == 4
    assert local_slots(mf, 1024, 8, kv_type, weights + 3 * per_slot) == 2
    assert local_slots(mf, 1024, 3_000_000, kv_type, weights + per_slot) == 1
    assert local_slots(mf, 1024, 4, kv_type, per_slot) == 1  # the weights then come from disk as they are read
    with pytest.raises(planner.PlanError, match="a KV cache of 1024 positions needs .* lower --ctx"):
        local_slots(mf, 1024, 1, kv_type, per_slot - 1)
