"""A step that carries decode rows and a prefill chunk runs as ONE pass (Shard.forward_mixed,
runner.mixed): one all-reduce per half-layer over both, one STEP to each worker, one LOGITS
answer. Each token keeps the arithmetic it has in its own pass (prefill tiles for the chunk,
decode kernels for the rows), so everything it computes is, bit for bit, what the two passes
compute one after the other: hidden states, KV caches, logits and candidates.

References: the two separate passes (forward_rows then forward; runner.decode then
runner.prefill) on a copy of the same state or in other slots of the same runner, whose
own equality to each token alone and to llama.cpp is tested in test_batch_rows.py,
test_batching.py and test_parallel.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edgetp.model import gguf, llama, quant, sampling
from edgetp.model.batch import Chunk, Row, Scheduler, Seq
from edgetp.model.generate import LocalRunner, generate
from edgetp.net.loopthread import LoopThread
from edgetp.parallel.runner import ClusterRunner
from edgetp.serve.spawn import start_worker, stop
from tests.isas import child_env
from tests.test_batch_rows import MIXED, Recorder, _bits
from tools import synth_gguf

REPO = Path(__file__).resolve().parent.parent
GREEDY = sampling.SamplingParams(temperature=0)
SAMPLED = sampling.SamplingParams(temperature=0.8, top_k=20, repeat_penalty=1.3, seed=5)


@pytest.fixture(scope="module")
def mixed_path(tmp_path_factory):
    """tiny-k (dim 256, head size 64: every KV type) with a mix of tensor types per layer."""
    return synth_gguf.write_preset(tmp_path_factory.mktemp("mixed") / "mixed.gguf", "tiny-k", tensor_types=MIXED)


# --------------------------------------------------------------------------- one shard


def _prefilled(mf, spec, kv_type):
    """A shard whose slots 0..2 hold prompts of different lengths (positions 4, 2 and 7 come next)."""
    shard = llama.Shard(llama.load_weights(mf, spec), ctx=64, reduce=Recorder(), slots=4, kv_type=kv_type)
    for s, p in enumerate([[1, 17, 42, 5], [300, 7], [2, 9, 11, 13, 15, 17, 19]]):
        shard.forward(llama.embed(mf, p), 0, slot=s)
    return shard


def _copy(shard):
    twin = llama.Shard(shard.w, shard.ctx, reduce=Recorder(), slots=shard.slots, kv_type=shard.kv_type)
    for a, b in zip(twin.k_cache + twin.v_cache, shard.k_cache + shard.v_cache):
        a[...] = b
    return twin


def _check_mixed(mf, spec=None, kv_type="f16", chunk_lengths=(1, 3, 40)):
    """For each chunk length: a mixed pass of two decode rows (slots 0 and 2) and a chunk (slot 3,
    then slot 1 continuing its prompt) against forward_rows then forward on a copy."""
    shard = _prefilled(mf, spec, kv_type)
    dim, n_layers = shard.w.cfg.dim, len(shard.w.layers)
    rng = np.random.default_rng(11)
    for n in chunk_lengths:
        for chunk_slot, pos in ((3, 0), (1, 2)):
            ref = _copy(shard)
            slots, positions = [0, 2], [4, 7]
            xr = llama.embed(mf, [int(t) for t in rng.integers(0, shard.w.cfg.vocab, 2)])
            xc = llama.embed(mf, [int(t) for t in rng.integers(0, shard.w.cfg.vocab, n)])
            want = np.concatenate([ref.forward_rows(xr.copy(), slots, positions), ref.forward(xc.copy(), pos, chunk_slot)])
            shard.reduce.shapes.clear()
            got = shard.forward_mixed(np.concatenate([xr, xc]), slots, positions, pos, chunk_slot)
            what = f"chunk of {n} at {pos} of slot {chunk_slot}"
            assert shard.reduce.shapes == [(2 + n, dim)] * (2 * n_layers), what  # one reduce per half-layer
            assert np.array_equal(_bits(got), _bits(want)), f"{what}: hidden states differ"
            for i in range(n_layers):
                assert np.array_equal(_bits(shard.k_cache[i]), _bits(ref.k_cache[i])), f"{what}: layer {i} keys"
                assert np.array_equal(_bits(shard.v_cache[i]), _bits(ref.v_cache[i])), f"{what}: layer {i} values"
            if shard.w.out_norm is not None:
                assert np.array_equal(_bits(shard.logits_rows(got[:2])), _bits(ref.logits_rows(want[:2])))
                assert np.array_equal(_bits(shard.logits(got[-1:])), _bits(ref.logits(want[-1:])))
            shard = ref  # the next round starts from the same state on both sides again
            shard.reduce = Recorder()
    return shard


def test_stories260k_mixed_pass_is_the_bits_of_the_two_passes(stories_path, threads, int8):
    _check_mixed(gguf.open_model(stories_path))


def test_mixed_type_mixed_pass_is_the_bits_of_the_two_passes(mixed_path, threads, int8, kv_type):
    _check_mixed(gguf.open_model(mixed_path), kv_type=kv_type)


def test_a_phi3_mixed_pass_is_the_bits_of_the_two_passes(synth_model, int8):
    # fused q|k|v and gate|up cut into row views per shard: the mixed pass reads them as each pass alone does
    path = synth_model("tiny-k", "q4_0", arch="phi3", rope_ctx_orig=128, ctx=1024)
    _check_mixed(gguf.open_model(path), chunk_lengths=(1, 9))
    _check_mixed(gguf.open_model(path), llama.ShardSpec((1, 2), (256, 512), (0, 320)), chunk_lengths=(5,))


@pytest.mark.parametrize("spec", [((1, 2), (256, 512), (0, 320), None), ((0, 0), (0, 96), (320, 640), None),
                                  ((0, 2), (0, 0), (0, 0), None), ((0, 2), (0, 512), (0, 0), (0, 1))],
                         ids=["half", "no-attention", "no-ffn", "first-stage"])
def test_a_shards_slice_mixed_pass_is_the_bits_of_the_two_passes(mixed_path, spec, int8):
    _check_mixed(gguf.open_model(mixed_path), llama.ShardSpec(*spec), chunk_lengths=(1, 9))


def test_a_mixed_pass_refuses_a_slot_in_both_parts_and_a_missing_part(stories_path):
    mf = gguf.open_model(stories_path)
    shard = llama.Shard(llama.load_weights(mf), ctx=16, slots=3)
    x = llama.embed(mf, [1, 2, 3])
    with pytest.raises(ValueError, match="cannot take a prefill chunk and a decode row"):
        shard.forward_mixed(x.copy(), [0], [0], 0, 0)
    with pytest.raises(ValueError, match="needs decode rows and chunk rows"):
        shard.forward_mixed(x.copy(), [0, 1, 2], [0, 0, 0], 0, 2)
    with pytest.raises(llama.ContextFull):
        shard.forward_mixed(x.copy(), [0], [0], 15, 1)


# --------------------------------------------------------------------------- runners


def _script(runner, base, mixed):
    """Two sequences decoding (slots base, base+1) while a 129-token prompt is read in slot base+2 in
    two chunks (128 tokens, then 1: the prefill tiles, then the one-token path), then all three
    decoding. Separate: runner.decode then runner.prefill per step; mixed: one runner.mixed.
    Every candidate (ids, logits, lse) in order."""
    rng = np.random.default_rng(3)
    prompts = [[1] + [int(t) for t in rng.integers(3, 500, k)] for k in (6, 3)]
    long = [1] + [int(t) for t in rng.integers(3, 500, 128)]
    params = [GREEDY, SAMPLED]
    hist = [list(p) for p in prompts]
    got = []
    for k, p in enumerate(prompts):
        c = runner.prefill(base + k, p, 0, hist[k], params[k])
        got.append(c)
        hist[k].append(int(c.ids[np.argmax(c.logits)]))
    long_hist = list(long)
    chunks = [Chunk(base + 2, 0, long[:128]), Chunk(base + 2, 128, long[128:], long_hist, GREEDY)]
    for chunk in chunks:
        rows = [Row(base + k, len(hist[k]) - 1, hist[k][-1], hist[k], params[k]) for k in range(2)]
        if mixed:
            cands, last, _ = runner.mixed(rows, chunk)
        else:
            cands = runner.decode(rows)
            last = runner.prefill(chunk.slot, chunk.ids, chunk.pos, chunk.history, chunk.params)
        assert (last is None) == (chunk.params is None)
        got += cands + ([last] if last is not None else [])
        for k, c in enumerate(cands):
            hist[k].append(int(c.ids[np.argmax(c.logits)]))
    long_hist.append(int(got[-1].ids[np.argmax(got[-1].logits)]))
    hist.append(long_hist)
    for _ in range(3):  # every slot decodes on: their KV caches are read
        rows = [Row(base + k, len(h) - 1, h[-1], h, params[k % 2]) for k, h in enumerate(hist)]
        for k, c in enumerate(runner.decode(rows)):
            got.append(c)
            hist[k].append(int(c.ids[np.argmax(c.logits)]))
    return got


def _same(a, b):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert np.array_equal(x.ids, y.ids), f"candidate {i}: ids differ"
        assert np.array_equal(_bits(x.logits), _bits(y.logits)), f"candidate {i}: logits differ"
        assert np.float64(x.lse).tobytes() == np.float64(y.lse).tobytes(), f"candidate {i}: lse differs"


def test_a_local_runners_mixed_steps_are_the_bits_of_separate_steps(stories_path, threads, int8):
    mf = gguf.open_model(stories_path)
    runner = LocalRunner(mf, 256, slots=2 * 3)
    separate, mixed = _script(runner, 0, False), _script(runner, 3, True)
    _same(separate, mixed)
    for i in range(len(runner.shard.w.layers)):  # the slots hold the same KV caches, slot for slot
        for cache in (runner.shard.k_cache[i], runner.shard.v_cache[i]):
            assert np.array_equal(_bits(cache[:3]), _bits(cache[3:])), f"layer {i}"


class Rounds:
    """Counts the root's all-reduces and the rows each carried."""

    def __init__(self, reduce) -> None:
        self.reduce, self.rows = reduce, []

    def __call__(self, partial: np.ndarray) -> None:
        self.rows.append(partial.shape[0])
        self.reduce(partial)


@pytest.fixture(scope="module", params=[("1", 1), ("0", 1), ("1", 2), ("0", 2)],
                ids=["int8-1thread", "float-1thread", "int8-2threads", "float-2threads"])
def workers(request):
    """Two real `edgetp worker` processes with the kernels (EDGETP_INT8) and threads of the param;
    their addresses and the param."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EDGETP_INT8", request.param[0])
        procs = [start_worker(threads=request.param[1]) for _ in range(2)]
    try:
        yield [addr for _, addr in procs], request.param
    finally:
        for proc, _ in procs:
            stop(proc)


def test_mixed_steps_across_three_processes_are_the_bits_of_separate_steps(workers, stories_path, monkeypatch):
    addresses, (int8, threads) = workers
    monkeypatch.setenv("EDGETP_INT8", int8)
    quant.set_threads(threads)
    mf = gguf.open_model(stories_path)
    n_layers = mf.config.n_layers
    try:
        with LoopThread() as lt:
            runner = lt.run(ClusterRunner.connect(mf, addresses, ctx=256, weights=[1, 2, 3], slots=2 * 3), timeout=300)
            try:
                assert len(runner.group) == 2 and all(s.ffn_cols[0] < s.ffn_cols[1] for s in runner.plan.shares)
                rounds = runner.shard.reduce = Rounds(runner.shard.reduce)
                runner.begin()
                try:
                    separate = _script(runner, 0, False)
                    rounds_separate, rounds.rows = rounds.rows, []
                    mixed = _script(runner, 3, True)
                finally:
                    runner.end()
            finally:
                runner.close()
    finally:
        quant.set_threads(None)
    _same(separate, mixed)
    per_pass = 2 * n_layers
    # two prompt prefills, two steps, three decode steps: separate steps pay 2 + 2*2 + 3 passes, mixed 2 + 2 + 3
    assert len(rounds_separate) == (2 + 4 + 3) * per_pass and len(rounds.rows) == (2 + 2 + 3) * per_pass
    assert rounds.rows[2 * per_pass:3 * per_pass] == [2 + 128] * per_pass  # rows and chunk in one reduce
    assert rounds.rows[3 * per_pass:4 * per_pass] == [2 + 1] * per_pass
    assert rounds.reduce.rounds == len(rounds_separate) + len(rounds.rows)  # what /metrics reports


# --------------------------------------------------------------------------- pipelines


@pytest.mark.parametrize("layout", [[[0], [1], [2]], [[0, 1], [2]], [[], [1]]],
                         ids=["pp over three", "hybrid", "a worker alone"])
def test_mixed_steps_through_a_pipeline_are_the_bits_of_separate_steps(layout, float_workers, stories_path,
                                                                       monkeypatch):
    monkeypatch.setenv("EDGETP_INT8", "0")
    quant.set_threads(1)
    mf = gguf.open_model(stories_path)
    with LoopThread() as lt:
        runner = lt.run(ClusterRunner.connect(mf, float_workers[:2], ctx=256, weights=[1, 2, 3], slots=2 * 3,
                                              layout=layout), timeout=300)
        try:
            assert len(runner.plan.stages) == len(layout)
            runner.begin()
            try:
                _same(_script(runner, 0, False), _script(runner, 3, True))
            finally:
                runner.end()
        finally:
            runner.close()


def test_the_scheduler_through_a_pipeline_mixes_steps_and_gives_each_sequence_its_single_node_tokens(
        float_workers, stories, monkeypatch):
    monkeypatch.setenv("EDGETP_INT8", "0")
    quant.set_threads(1)
    mf, tok = stories
    prompts = [tok.encode(p, add_special=True) for p in ("Once upon a time", "The little dog")]
    prompts.append(tok.encode(" ".join(["Lily and Tom went to the park to play with a ball."] * 14), add_special=True))
    assert len(prompts[-1]) > 128
    params = [GREEDY, SAMPLED, GREEDY]
    want = [[ev.token_id for ev in generate(LocalRunner(mf, 512), tok, ids, p, 12)] for ids, p in zip(prompts, params)]
    with LoopThread() as lt:
        runner = lt.run(ClusterRunner.connect(mf, float_workers[:2], ctx=512, weights=[1, 2, 3], slots=3,
                                              layout=[[0, 1], [2]]), timeout=300)
        try:
            sched = Scheduler(runner, tok)
            seqs = [Seq(ids, p, 12) for ids, p in zip(prompts, params)]
            got: dict[int, list[int]] = {id(s): [] for s in seqs}
            kinds = []
            runner.begin()
            try:
                for k, s in enumerate(seqs):
                    sched.admit(s)
                    for _ in range(2 if k < 2 else 0):  # the short ones are decoding when the long one comes
                        for seq, ev in sched.step():
                            got[id(seq)].append(ev.token_id)
                for _ in range(200):
                    if not sched.seqs:
                        break
                    for seq, ev in sched.step():
                        got[id(seq)].append(ev.token_id)
                    kinds.append(tuple(k for k, *_ in sched.last))
            finally:
                runner.end()
        finally:
            runner.close()
    assert [got[id(s)] for s in seqs] == want
    assert ("decode", "prefill") in kinds  # the long prompt's chunks rode with decode rows


# --------------------------------------------------------------------------- the generic ISA

GENERIC_CHILD = """
import sys
sys.path.insert(0, sys.argv[1])
import test_mixed_step as t
from edgetp.model import gguf, isa
assert isa.current() == "generic", isa.current()
for kv_type in ("f16", "q8_0"):
    t._check_mixed(gguf.open_model(sys.argv[2]), kv_type=kv_type, chunk_lengths=(1, 9))
print("mixed equals separate")
"""


def test_a_mixed_pass_is_the_bits_of_the_two_passes_on_the_generic_isa(mixed_path):
    env = child_env("generic", EDGETP_INT8="1")
    res = subprocess.run([sys.executable, "-c", GENERIC_CHILD, str(REPO / "tests"), str(mixed_path)], env=env,
                         cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "mixed equals separate" in res.stdout
