"""Partials sent in pieces (passes.Pieces, Shard.sync_pieces) give the bits of whole partials.

Over real `edgetp worker` processes on 127.0.0.1 (2 and 3 workers, uneven
weights, f32 and Q8_0 sync): every decode step's final hidden states and
candidates of a cluster whose partials go in pieces equal, bit for bit, those of
the same cluster sending whole partials; the link counters show the pieces
really travelled as separate frames (one frame prefix and empty header more per
extra piece, each way); and greedy text equals a single node's.
"""

from __future__ import annotations

import numpy as np
import pytest

from edgetp.model import gguf, sampling
from edgetp.model.batch import Chunk, Row
from edgetp.model.generate import LocalRunner
from edgetp.model.passes import cuts
from edgetp.model.tokenizer import Tokenizer
from edgetp.parallel.runner import ClusterRunner
from tests.test_parallel import _serving, control  # noqa: F401 - control: the root's event loop, one thread

STORY = "Once upon a time, there was a little girl named Lily. She"
OTHER = "The little dog ran to the park"
TOP = sampling.SamplingParams(temperature=1.0, top_k=16, top_p=1.0, min_p=0.0)  # 16 logits and the lse per node
GREEDY = sampling.SamplingParams(temperature=0)
FRAME_OVERHEAD = 16 + 1  # a frame's 16-byte prefix and its empty msgpack map, restated from the protocol
STEPS = 6


@pytest.fixture(scope="module")
def workers():
    """Three workers on the default kernels (SmolLM2 on the integer ones; stories260K is f32 throughout)."""
    yield from _serving(3, int8=True)


def test_cuts_are_near_even_whole_q8_0_blocks():
    for dim in (32, 64, 96, 576, 2048, 4096):
        for pieces in range(1, 7):
            c = cuts(dim, pieces)
            widths = np.diff(c)
            assert c[0] == 0 and c[-1] == dim and all(x % 32 == 0 for x in c)
            assert len(widths) == min(pieces, dim // 32) and widths.min() > 0
            assert widths.max() - widths.min() <= 32  # as even as whole blocks allow
    assert cuts(100, 3) == (0, 100)  # no whole blocks: one piece


def _trace(runner: ClusterRunner, prompts: list[list[int]]) -> tuple[list[np.ndarray], list, list[int], int]:
    """Two sequences prefilled, then STEPS decode steps, in turn both as rows and as a row beside a one-token
    chunk (a mixed step, whose one reduce over both goes whole): the root's final hidden states of each step's
    rows, every merged candidate, the tokens of sequence 0, and the bytes the root received over its links
    during the decode steps."""
    seen: list[np.ndarray] = []
    shard = runner.shard
    logits_rows = shard.logits_rows
    shard.logits_rows = lambda h: (h.shape[0] and seen.append(h.copy()), logits_rows(h))[1]  # decode rows
    histories = [list(p) for p in prompts]
    runner.begin(TOP)
    try:
        nxt = [int(runner.prefill(s, p, 0, histories[s], TOP).ids[0]) for s, p in enumerate(prompts)]
        before = runner.counters()
        cands, tokens = [], []
        for step in range(STEPS):
            for s in (0, 1):
                histories[s].append(nxt[s])
            rows = [Row(s, len(h) - 1, nxt[s], list(h), TOP) for s, h in enumerate(histories)]
            if step % 2 == 0:
                out = runner.decode(rows)
            else:  # sequence 1's token as a chunk beside sequence 0's row: one pass (passes.together)
                h = histories[1]
                out, last, _ = runner.mixed(rows[:1], Chunk(1, len(h) - 1, [nxt[1]], list(h), TOP))
                out.append(last)
            for s, c in enumerate(out):
                cands.append((c.ids.tolist(), c.logits.view(np.uint32).tolist(), c.lse))
                nxt[s] = int(c.ids[np.argmax(c.logits)])
            tokens.append(nxt[0])
        after = runner.counters()
    finally:
        runner.end()
        shard.logits_rows = logits_rows
    received = sum(after[k].received - before[k].received for k in after)
    return seen, cands, tokens, received


def _connect(control, path, addresses, weights, sync, pieces) -> ClusterRunner:
    mf = gguf.open_model(path)
    return control.run(ClusterRunner.connect(mf, addresses, ctx=128, weights=weights, sync=sync, slots=2,
                                             sync_pieces=pieces), timeout=300)


def _prompts(path) -> list[list[int]]:
    tok = Tokenizer.from_metadata(gguf.open_model(path).metadata)
    return [tok.encode(STORY, parse_special=True), tok.encode(OTHER, parse_special=True)]


@pytest.mark.parametrize("sync", ["f32", "q8_0"])
@pytest.mark.parametrize("which,weights", [("stories", [1, 3, 2, 1]), ("stories", [2, 1, 1]),
                                           ("smollm2", [3, 1, 2]), ("smollm2", [2, 3, 1, 2])])
def test_decode_steps_in_pieces_give_the_bits_of_whole_partials(which, weights, sync, workers, control, stories_path,
                                                                smollm2_path):
    path = stories_path if which == "stories" else smollm2_path
    cfg = gguf.open_model(path).config
    n_workers = len(weights) - 1
    pieces = 3
    k = len(cuts(cfg.dim, pieces)) - 1
    assert k >= 2
    traces = {}
    for p in (1, pieces):
        runner = _connect(control, path, workers[:n_workers], weights, sync, p)
        try:
            traces[p] = _trace(runner, _prompts(path))
        finally:
            runner.close()
    (h1, c1, t1, r1), (hp, cp, tp, rp) = traces[1], traces[pieces]
    assert len(h1) == len(hp) == STEPS
    for step, (a, b) in enumerate(zip(h1, hp)):
        assert a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"step {step}"
    assert cp == c1 and tp == t1
    # per decode step of rows alone, each all-reduce (2 per layer) came back from every worker in k frames, not 1
    rows_steps = (STEPS + 1) // 2
    assert rp - r1 == n_workers * rows_steps * 2 * cfg.n_layers * (k - 1) * FRAME_OVERHEAD


@pytest.mark.parametrize("weights", [[1, 2], [3, 1, 2, 2]])
def test_greedy_text_in_pieces_equals_a_single_node(weights, workers, control, stories_path):
    mf = gguf.open_model(stories_path)
    tok = Tokenizer.from_metadata(mf.metadata)
    ids = tok.encode(STORY, parse_special=True)
    runners = {"single": LocalRunner(mf, 128),
               "pieces": _connect(control, stories_path, workers[:len(weights) - 1], weights, "f32", 2)}
    texts = {}
    try:
        for name, runner in runners.items():
            runner.begin(GREEDY)
            try:
                history, out, pending, pos = list(ids), [], list(ids), 0
                for _ in range(24):
                    t = int(runner.run(pending, pos, history, GREEDY).ids[0])
                    pos += len(pending)
                    out.append(t)
                    history.append(t)
                    pending = [t]
            finally:
                runner.end()
            texts[name] = tok.decode(out)
    finally:
        runners["pieces"].close()
    assert texts["pieces"] == texts["single"]
    assert "Lily" in tok.decode(ids) and len(texts["single"]) > 40
