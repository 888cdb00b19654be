"""Tensor parallelism across real processes, against the single-node engine.

Workers are real `edgetp worker` processes on 127.0.0.1; the root runs in
this process. With f32 sync and the float kernels (EDGETP_INT8=0) the greedy
tokens of 1-4 processes, on uneven weights, must equal the single-node
tokens; with Q8_0 sync the logits must stay within the bound stated at
Q8_TOLERANCE.

With the integer decode kernels (the default) that equality does not hold:
a node's partial sum adds the same exact terms in another grouping than one
node's full sum (f32, ~1e-7 apart), and the next layer's int8 rounding of
the activations turns an element that sits at a rounding boundary into a
whole rounding step. That is the kind of error Q8_0 sync makes on purpose,
so those logits are held to the same bound (test at the end).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import numpy as np
import pytest

from edgetp.model import gguf, quant, sampling
from edgetp.model.generate import LocalRunner
from edgetp.net.loopthread import LoopThread
from edgetp.parallel.runner import ClusterRunner, WorkerLost
from edgetp.serve.spawn import start_worker, stop

STORY = "Once upon a time, there was a little girl named Lily. She"
QUESTION = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            "<|im_start|>user\nWhat is the capital of France? Answer in one short sentence, and then tell "
            "me one fact about its history.<|im_end|>\n<|im_start|>assistant\n")
GREEDY = sampling.SamplingParams(temperature=0)


def _start(n: int, int8: bool) -> list:
    with pytest.MonkeyPatch.context() as mp:
        if int8:
            mp.delenv("EDGETP_INT8", raising=False)
        else:
            mp.setenv("EDGETP_INT8", "0")
        return [start_worker() for _ in range(n)]


def _serving(n: int, int8: bool):
    procs = _start(n, int8)
    try:
        yield [addr for _, addr in procs]
    finally:
        for proc, _ in procs:
            stop(proc)


@pytest.fixture(scope="module")
def workers():
    """Three workers on the float kernels: the exact mode the token-equality tests hold to."""
    yield from _serving(3, int8=False)


@pytest.fixture(scope="module")
def int8_workers():
    """Two workers on the integer decode kernels (the default)."""
    yield from _serving(2, int8=True)


@pytest.fixture(autouse=True)
def _root_kernels(request, monkeypatch):
    """The root (this process) runs the kernels its workers run."""
    if "int8_workers" in request.fixturenames:
        monkeypatch.delenv("EDGETP_INT8", raising=False)
    else:
        monkeypatch.setenv("EDGETP_INT8", "0")


@pytest.fixture(scope="module")
def control():
    quant.set_threads(1)  # root, workers and the test share two cores
    with LoopThread() as lt:
        yield lt


def greedy(runner, ids, n, params=GREEDY):
    runner.begin(params)
    try:
        history, out, pending, pos = list(ids), [], list(ids), 0
        for _ in range(n):
            tok = int(runner.run(pending, pos, history, params).ids[0])
            pos += len(pending)
            out.append(tok)
            history.append(tok)
            pending = [tok]
        return out
    finally:
        runner.end()


def cluster(control, path, addresses, weights, sync="f32", **kw):
    mf = gguf.open_model(path)
    return control.run(ClusterRunner.connect(mf, addresses, ctx=256, weights=weights, sync=sync, **kw), timeout=300)


def _model(which, stories_path, smollm2_path, synth_model):
    from edgetp.model.tokenizer import Tokenizer  # noqa: PLC0415

    if which == "stories":
        path, text = stories_path, STORY
    elif which == "smollm2":
        path, text = smollm2_path, QUESTION
    else:  # 6 heads / 3 KV heads / FFN 7 blocks of 32: nothing divides evenly over 2-4 nodes
        path, text = synth_model("tiny-odd", "q8_0"), "the quick brown fox jumps over the lazy dog"
    ids = Tokenizer.from_metadata(gguf.open_model(path).metadata).encode(text, parse_special=True)
    return path, ids


@pytest.mark.parametrize("which", ["stories", "smollm2", "tiny-odd"])
def test_greedy_tokens_of_1_to_4_processes_with_uneven_weights_equal_single_node(
        which, workers, control, stories_path, smollm2_path, synth_model):
    path, ids = _model(which, stories_path, smollm2_path, synth_model)
    expected = greedy(LocalRunner(gguf.open_model(path), 256), ids, 64)
    for n in (1, 2, 3, 4):
        runner = cluster(control, path, workers[: n - 1], [1, 2, 3, 4][:n])
        try:
            shares = [(s.kv_groups, s.ffn_cols, s.vocab_rows) for s in runner.plan.shares]
            assert greedy(runner, ids, 64) == expected, f"{n} processes, shares {shares}"
        finally:
            runner.close()


def test_penalties_and_logit_bias_reach_every_vocabulary_shard(workers, control, stories_path):
    """Each node penalises and biases its own vocabulary rows: a cluster's penalised greedy text is one node's."""
    path, ids = _model("stories", stories_path, None, None)
    plain = greedy(LocalRunner(gguf.open_model(path), 256), ids, 48)
    params = sampling.SamplingParams(temperature=0, frequency_penalty=0.5, presence_penalty=0.4, repeat_penalty=1.1,
                                     logit_bias=((plain[1], -100.0), (plain[5], -100.0)))
    expected = greedy(LocalRunner(gguf.open_model(path), 256), ids, 48, params)
    assert expected != plain
    runner = cluster(control, path, workers, [1, 2, 3, 4])
    try:
        assert len({s.vocab_rows for s in runner.plan.shares}) == 4  # the vocabulary is split four ways
        assert greedy(runner, ids, 48, params) == expected
    finally:
        runner.close()


def test_log_probabilities_over_four_vocabulary_shards_are_llama_cpps(llama_cpp, workers, control, stories_path):
    """Each worker sends the log-sum-exp and best logits of its own vocabulary rows; merged on the root
    they give the log-softmax of the whole vocabulary (llama.cpp's logits, f32 KV caches both)."""
    from tests import reference  # noqa: PLC0415
    from tests.test_logprobs import assert_like_reference, reference_logprobs  # noqa: PLC0415

    path, ids = _model("stories", stories_path, None, None)
    params = sampling.SamplingParams(temperature=0, logprobs=5)
    answer = reference.greedy(str(path), ids, 16)
    ref = reference_logprobs(path, ids, answer)
    runner = cluster(control, path, workers, [1, 2, 3, 4], kv_type="f32")
    try:
        assert len({s.vocab_rows for s in runner.plan.shares}) == 4
        runner.begin(params)
        try:
            pending, pos, history = list(ids), 0, list(ids)
            for i, t in enumerate(answer):
                c = runner.run(pending, pos, history, params)
                assert int(c.ids[0]) == t
                lp = sampling.logprobs(c, t, 5)
                assert_like_reference(ref[i], t, lp.logprob, list(lp.top), 5)
                pos, pending = pos + len(pending), [t]
                history.append(t)
        finally:
            runner.end()
    finally:
        runner.close()


def test_a_prompt_scored_over_four_vocabulary_shards_beside_a_running_stream_is_llama_cpps(llama_cpp, workers, control,
                                                                                        stories_path):
    """echo's scores: each shard's log-sum-exp, best logits and (the one that holds it) the logit of
    the prompt's next token at every position, in chunks that ride mixed steps beside another
    sequence's decode rows; merged on the root, the log-softmax of llama.cpp's logits."""
    from edgetp.model.batch import Scheduler, Seq  # noqa: PLC0415
    from edgetp.model.tokenizer import Tokenizer  # noqa: PLC0415
    from tests.test_logprobs import reference_prompt_logprobs  # noqa: PLC0415

    path, ids = _model("stories", stories_path, None, None)
    ref = reference_prompt_logprobs(path, ids)
    runner = cluster(control, path, workers, [1, 2, 3, 4], kv_type="f32", slots=2)
    try:
        sched = Scheduler(runner, Tokenizer.from_metadata(gguf.open_model(path).metadata), chunk=8)
        other = Seq(ids[:5], sampling.SamplingParams(temperature=0), 40)
        scored = Seq(ids, sampling.SamplingParams(temperature=0), 0, score=3)
        sched.admit(other)
        sched.begin()
        try:
            sched.step()  # other's prompt: it decodes from now on, beside every chunk of the scored one
            sched.admit(scored)
            mixed = 0
            while not scored.done:
                sched.step()
                mixed += any(m for _, _, _, m in sched.last)
        finally:
            runner.end()
        assert mixed == -(-len(ids) // 8)
        assert len(scored.scores) == len(ids) - 1
        for i, lp in enumerate(scored.scores):
            row = ref[i]
            assert lp.token == ids[i + 1] and abs(lp.logprob - row[ids[i + 1]]) <= 1e-4
            assert [t for t, _ in lp.top] == np.argsort(-row, kind="stable")[:3].tolist()
    finally:
        runner.close()


def test_weights_1_2_3_give_the_slow_node_the_smallest_share(workers, control, stories_path):
    runner = cluster(control, stories_path, workers[:2], [1, 2, 3])
    try:
        work = [runner.plan.shape.share_work(s) for s in runner.plan.shares]
        assert work[0] < work[1] < work[2]
    finally:
        runner.close()


# Q8_0 sync rounds every all-reduce message to 8-bit blocks: per value at most half a
# step, amax/254 of its block of 32 (0.4% of the block's largest value), on the way
# up and on the way back, twice per layer, and the rounded total lands on the
# residual stream itself. That is the rounding llama.cpp applies to activations
# before its quantized dot products (which puts its own logits up to 7.1% of their
# spread from exact math on SmolLM2, test_engine_reference), applied to the residual
# stream instead: measured on SmolLM2 with 3 nodes, max 8.1%, mean 4.0%, top-1
# agreement 92.5%. The bound: max 10% of the spread, mean 5%, top-1 >= 90%.
# f32 sync is the exact mode (token-identical above).
Q8_TOLERANCE = 0.10


@pytest.mark.parametrize("which", ["stories", "smollm2"])
def test_q8_0_sync_keeps_logits_within_the_stated_bound(which, workers, control, stories_path, smollm2_path,
                                                         synth_model):
    path, ids = _model(which, stories_path, smollm2_path, synth_model)
    exact = LocalRunner(gguf.open_model(path), 256).logits(ids, 0)
    runner = cluster(control, path, workers[:2], [1, 2, 3], sync="q8_0")
    try:
        runner.begin(GREEDY)
        try:
            got = runner.logits(ids, 0)
        finally:
            runner.end()
    finally:
        runner.close()
    err = assert_within_q8_bound(f"{which}: Q8_0 sync", got, exact)
    assert err.max() > 0, "Q8_0 sync should not be bit-exact; is the sync type ignored?"


def assert_within_q8_bound(label: str, got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Per-position max error over the spread of `want` within Q8_TOLERANCE (mean half
    that) and top-1 agreement >= 90%; returns the per-position errors."""
    spread = want.max(1) - want.min(1)
    err = np.abs(got - want).max(1) / spread
    agree = float(np.mean(got.argmax(1) == want.argmax(1)))
    print(f"{label}: max error {err.max():.3e} of the spread, mean {err.mean():.3e}, top-1 agrees {agree:.3f}")
    assert err.max() <= Q8_TOLERANCE and err.mean() <= Q8_TOLERANCE / 2
    assert agree >= 0.9
    return err


@pytest.mark.parametrize("which", ["smollm2", "tiny-odd"])
def test_integer_kernels_across_processes_keep_decode_logits_within_the_q8_bound(
        which, int8_workers, control, stories_path, smollm2_path, synth_model):
    # teacher-forced, one token at a time: every product runs the decode (integer) path
    path, ids = _model(which, stories_path, smollm2_path, synth_model)
    ids = ids[:48]
    local = LocalRunner(gguf.open_model(path), 256)
    want = np.stack([local.logits([t], p)[0] for p, t in enumerate(ids)])
    runner = cluster(control, path, int8_workers, [1, 2, 3])
    try:
        runner.begin(GREEDY)
        try:
            got = np.stack([runner.logits([t], p)[0] for p, t in enumerate(ids)])
        finally:
            runner.end()
    finally:
        runner.close()
    assert_within_q8_bound(f"{which}: int8 across 3 processes", got, want)


def test_a_worker_that_exits_mid_generation_is_reported_by_address(control, stories_path):
    proc, addr = start_worker()
    try:
        runner = cluster(control, stories_path, [addr], [1, 1])
        ids = _model("stories", stories_path, None, None)[1][:5]
        runner.begin(GREEDY)
        try:
            runner.run(ids, 0, ids, GREEDY)
            proc.kill()
            proc.wait()
            with pytest.raises(WorkerLost, match=re.escape(addr)):
                for pos in range(5, 50):
                    runner.run([7], pos, ids, GREEDY)
        finally:
            runner.end()
            runner.close()
    finally:
        stop(proc)


def test_cli_root_with_workers_prints_the_single_node_text_and_ctrl_c_leaves_workers_serving(workers, stories_path):
    base = [sys.executable, "-m", "edgetp", "ask", "--local", "--model", str(stories_path), "--raw",
            "--temperature", "0", "--max-tokens", "48", "--threads", "1", STORY]
    single = subprocess.run(base, capture_output=True, text=True, timeout=120)
    assert single.returncode == 0, single.stderr
    spread = subprocess.run(base + ["--workers", ",".join(workers[:2]), "--weights", "1,2,3"],
                            capture_output=True, text=True, timeout=120)
    assert spread.returncode == 0, spread.stderr
    assert spread.stdout == single.stdout and len(single.stdout) > 40

    # SIGINT as a terminal's Ctrl-C sends it: a shell that starts the suite in the background without
    # job control has SIGINT ignored, and children inherit that (Python then never raises KeyboardInterrupt)
    root = subprocess.Popen(base[:-3] + ["--max-tokens", "100000", "--ctx", "2048", STORY, "--workers", workers[0]],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    head = root.stdout.read(20)  # tokens are streaming
    root.send_signal(signal.SIGINT)
    out, err = root.communicate(timeout=30)
    assert root.returncode == 130, f"exit {root.returncode} after {len(head + out)} characters: {err}"
    assert err.strip().splitlines()[-1] == "edgetp: interrupted"
    assert "Traceback" not in err
    again = subprocess.run(base + ["--workers", workers[0]], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and again.stdout == single.stdout, again.stderr


@pytest.mark.parametrize("which,kill_at", [("stories", 24), ("smollm2", 4)])  # stories: a replay of 16 + 9 rows
def test_a_worker_killed_mid_answer_is_replanned_around_and_the_greedy_answer_is_unchanged(
        which, kill_at, control, stories_path, smollm2_path, synth_model):
    from edgetp.model.generate import generate  # noqa: PLC0415
    from edgetp.model.tokenizer import Tokenizer  # noqa: PLC0415

    path, ids = _model(which, stories_path, smollm2_path, synth_model)
    tok = Tokenizer.from_metadata(gguf.open_model(path).metadata)
    expected = [ev.token_id for ev in generate(LocalRunner(gguf.open_model(path), 256), tok, ids, GREEDY, 48)]
    (keep, a), (victim, b) = start_worker(), start_worker()
    current = [cluster(control, path, [a, b], [1, 1, 1])]

    def recover(exc):
        current[0] = control.run(current[0].without(exc.link_name), timeout=300)
        return current[0]

    try:
        got, notes = [], []
        for ev in generate(current[0], tok, ids, GREEDY, 48, recover=recover):
            got.append(ev.token_id)
            notes += [ev.note] if ev.note else []
            if ev.index == kill_at:
                victim.kill()
                victim.wait()
        assert got == expected
        assert len(notes) == 1 and b in notes[0]
        assert current[0].plan.epoch == 2 and len(current[0].plan.shares) == 2
    finally:
        current[0].close()
        stop(keep)
        stop(victim)


def test_a_second_root_takes_over_a_static_worker_whose_root_sits_idle(control, stories_path):
    from edgetp.model.tokenizer import Tokenizer  # noqa: PLC0415

    proc, addr = start_worker()
    try:
        mf = gguf.open_model(stories_path)
        ids = Tokenizer.from_metadata(mf.metadata).encode(STORY, add_special=True)
        alone = greedy(LocalRunner(mf, 256), ids, 12)
        assert len(set(alone)) > 3  # a real story, not a degenerate run
        first = cluster(control, stories_path, [addr], [1, 1])
        try:
            assert greedy(first, ids, 12) == alone
            # `first` now sits idle between generations, as a root that lost power would
            second = cluster(control, stories_path, [addr], [1, 1])
            try:
                assert greedy(second, ids, 12) == alone
            finally:
                second.close()
            with pytest.raises(WorkerLost, match=re.escape(addr)):  # its next answer finds the link closed
                greedy(first, ids, 12)
        finally:
            first.close()
    finally:
        stop(proc)
