"""Several users at once: continuous batching in the root's engine, the prefix cache, and the same
text under any load.

References: each request run alone (generate() on a runner of its own, or the same server with
nothing else running), a cold server for the prefix cache, real worker processes for the cluster,
and the real `openai` client.
"""

from __future__ import annotations

import asyncio
import contextlib

import openai
import pytest

from edgetp import events
from edgetp.model import gguf, quant
from edgetp.model.batch import PATIENCE, PREFILL_CHUNK, Scheduler, Seq
from edgetp.model.generate import LocalRunner, generate
from edgetp.model.sampling import SamplingParams
from edgetp.model.tokenizer import Tokenizer
from edgetp.net.loopthread import LoopThread
from edgetp.parallel.runner import ClusterRunner
from edgetp.serve.api import make_app, serving
from edgetp.serve.root import Engine, QueueFull, Request

CTX = 512
GREEDY = SamplingParams(temperature=0)
PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "A big red ball",
           "One day, a cat", "Tim was sad because", "The sun was hot and", "Sue had a new toy"]
LONG = " ".join(["Once upon a time there was a little girl named Lily who loved to play outside."] * 12)


@pytest.fixture
async def start():
    """start(mf, tok, slots, **engine_kw) -> (url, engine); every server stops at the end of the test."""
    async with contextlib.AsyncExitStack() as stack:
        async def go(mf, tok, slots, ctx=CTX, **kw):
            engine = Engine(LocalRunner(mf, ctx, slots), tok, "stories260K", **kw)
            url = await stack.enter_async_context(serving(make_app(engine)))
            return url, engine
        yield go


def client(url):
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)


def steps_of(engine):
    """Every StepRecord the engine publishes from now on (a listener sees all of them)."""
    seen: list[events.StepRecord] = []
    engine.bus.add_listener(lambda r: seen.append(r) if isinstance(r, events.StepRecord) else None)
    return seen


def alone(mf, tok, prompt, params, n):
    """The answer to prompt with nothing else running: generate() on a runner of its own."""
    ids = tok.encode(prompt, add_special=True)
    return "".join(ev.text for ev in generate(LocalRunner(mf, CTX), tok, ids, params, n))


def params_of(k):
    """Greedy for the even prompts, seeded sampling for the odd ones."""
    return GREEDY if k % 2 == 0 else SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=1000 + k)


async def test_eight_prompts_at_once_through_the_openai_client_each_equal_their_run_alone(start, stories):
    mf, tok = stories
    url, engine = await start(mf, tok, slots=8)
    steps = steps_of(engine)
    async with client(url) as c:
        async def one(k):
            p = params_of(k)
            extra = {} if p.greedy else {"seed": p.seed, "top_p": p.top_p, "extra_body": {"top_k": p.top_k}}
            r = await c.completions.create(model="stories260K", prompt=PROMPTS[k], max_tokens=48,
                                           temperature=p.temperature, **extra)
            return r.choices[0].text

        got = await asyncio.gather(*(one(k) for k in range(8)))
    want = [alone(mf, tok, PROMPTS[k], params_of(k), 48) for k in range(8)]
    for k in range(8):
        assert got[k] == want[k], f"prompt {k} ({PROMPTS[k]!r}) differs under load"
    assert len(set(got)) == 8  # eight different answers: nothing was shared by mistake
    decode = [s.batch for s in steps if s.kind == "decode"]
    assert max(decode) >= 4, f"the sequences never ran together: decode batch sizes {sorted(set(decode))}"
    assert engine.slots_view().active == 0 and not engine.busy


async def test_a_prompt_from_the_prefix_cache_equals_the_same_prompt_computed_cold(start, stories):
    mf, tok = stories
    n_prompt = len(tok.encode(LONG, add_special=True))
    assert n_prompt > PREFILL_CHUNK + 1
    url, engine = await start(mf, tok, slots=2)
    async with client(url) as c:
        first = await c.completions.create(model="stories260K", prompt=LONG, max_tokens=40, temperature=0)
        again = await c.completions.create(model="stories260K", prompt=LONG, max_tokens=40, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # whole chunks only, and never the last token (its logits are needed)
    assert again.usage.prompt_tokens_details.cached_tokens == (n_prompt - 1) // PREFILL_CHUNK * PREFILL_CHUNK
    assert again.choices[0].text == first.choices[0].text == alone(mf, tok, LONG, GREEDY, 40)
    view = engine.slots_view()
    assert view.prefix_hits == 1 and view.cached_tokens == again.usage.prompt_tokens_details.cached_tokens


async def test_the_second_turn_of_a_chat_reuses_the_first_and_answers_as_cold(start, stories):
    mf, tok = stories
    turn1 = [{"role": "user", "content": LONG}]
    url, engine = await start(mf, tok, slots=2)
    async with client(url) as c:
        a1 = await c.chat.completions.create(model="stories260K", messages=turn1, max_tokens=24, temperature=0)
        turn2 = turn1 + [{"role": "assistant", "content": a1.choices[0].message.content},
                         {"role": "user", "content": "And then what happened?"}]
        a2 = await c.chat.completions.create(model="stories260K", messages=turn2, max_tokens=24, temperature=0)
    url_cold, _ = await start(mf, tok, slots=1)
    async with client(url_cold) as c:
        cold = await c.chat.completions.create(model="stories260K", messages=turn2, max_tokens=24, temperature=0)
    assert a2.usage.prompt_tokens_details.cached_tokens >= PREFILL_CHUNK
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert a2.choices[0].message.content == cold.choices[0].message.content


async def test_a_long_prompt_is_read_in_chunks_between_the_tokens_of_a_running_stream(start, stories):
    mf, tok = stories
    url, engine = await start(mf, tok, slots=2, ctx=1024)
    steps = steps_of(engine)
    long = " ".join([LONG] * 2)
    chunks = -(-len(tok.encode(long, add_special=True)) // PREFILL_CHUNK)
    assert chunks >= 3
    async with client(url) as c:
        stream = await c.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=400,
                                            temperature=0, stream=True)
        got = 0
        async for _ in stream:  # the first stream is decoding before the long prompt arrives
            got += 1
            if got == 3:
                break
        second = asyncio.ensure_future(c.completions.create(model="stories260K", prompt=long, max_tokens=4,
                                                            temperature=0))
        async for _ in stream:
            pass
        await second
    kinds = [s.kind for s in steps]
    first = kinds.index("prefill", 2)  # the short prompt's one chunk came first
    reading = kinds[first:first + 2 * chunks - 1]
    # each of the long prompt's chunks is followed by a decode step of the running stream
    assert reading.count("prefill") == chunks and reading[1::2] == ["decode"] * (chunks - 1), kinds[:40]


async def test_429_only_when_every_slot_and_the_queue_are_full(start, stories):
    mf, tok = stories
    _, engine = await start(mf, tok, slots=2, queue_size=1)
    ids = tuple(tok.encode("Once upon a time", add_special=True))
    jobs = []
    try:
        for k in range(3):  # two slots and one place in the queue: no awaits, nothing finishes meanwhile
            jobs.append(engine.submit(Request(f"r{k}", ids, GREEDY, 400)))
        with pytest.raises(QueueFull):
            engine.submit(Request("r3", ids, GREEDY, 400))
    finally:
        for job in jobs:
            job.cancel()
    for _ in range(500):
        if not engine.busy and engine.queue_depth == 0:
            break
        await asyncio.sleep(0.01)
    assert not engine.busy and engine.queue_depth == 0


def test_the_scheduler_reuses_whole_chunks_only_and_frees_the_least_recently_used_slot(stories):
    mf, tok = stories
    sched = Scheduler(LocalRunner(mf, CTX, 2), tok)
    ids = tok.encode(LONG, add_special=True)

    def run(prompt):
        seq = Seq(prompt, GREEDY, 8)
        sched.admit(seq)
        slot = seq.slot
        while not seq.done:
            sched.step()
        return slot, seq.cached

    slot_a, cached = run(ids)
    assert cached == 0
    other = tok.encode("The little dog", add_special=True)
    slot_b, _ = run(other)
    assert slot_b != slot_a  # the slot with a reusable prefix stays; the other (never used) is taken
    slot_c, cached = run(ids[:PREFILL_CHUNK + 1])  # shares exactly one whole chunk with slot_a
    assert (slot_c, cached) == (slot_a, PREFILL_CHUNK)
    slot_d, cached = run(ids[:PREFILL_CHUNK])  # the last token must be computed: no whole chunk before it
    assert cached == 0 and slot_d == slot_b  # least recently used without a prefix to offer


def _fed_until_done(sched, seq, each_step, limit=400):
    """Step sched until seq is done, calling each_step() before every step: seq's fed position after each."""
    fed = []
    for _ in range(limit):
        if seq.done:
            return fed
        each_step()
        sched.step()
        fed.append(seq.fed)
    raise AssertionError(f"not done within {limit} steps")


def test_a_short_prompt_arriving_while_a_long_one_is_read_answers_at_the_next_step(stories):
    mf, tok = stories
    long_ids = tok.encode(" ".join([LONG] * 2), add_special=True)
    short_ids = tok.encode("The little dog", add_special=True)
    assert len(long_ids) > 3 * PREFILL_CHUNK
    want = [[ev.token_id for ev in generate(LocalRunner(mf, 1024), tok, ids, GREEDY, 6)]
            for ids in (long_ids, short_ids)]
    sched = Scheduler(LocalRunner(mf, 1024, 2), tok)
    long, short = Seq(long_ids, GREEDY, 6), Seq(short_ids, GREEDY, 6)
    got: dict[int, list[int]] = {id(long): [], id(short): []}
    sched.admit(long)
    sched.step()  # the long prompt's first chunk
    assert long.fed == PREFILL_CHUNK
    sched.admit(short)
    answered = sched.step()  # the short prompt whole, ahead of the rest of the long one
    assert [(seq is short, ev.index) for seq, ev in answered] == [(True, 0)]
    assert long.fed == PREFILL_CHUNK
    got[id(short)].append(answered[0][1].token_id)
    for _ in range(100):
        if long.done and short.done:
            break
        for seq, ev in sched.step():
            got[id(seq)].append(ev.token_id)
    assert [got[id(long)], got[id(short)]] == want  # the order of reading changes no token


def test_a_stream_of_short_prompts_never_starves_a_long_one(stories):
    mf, tok = stories
    long_ids = tok.encode(" ".join([LONG] * 2), add_special=True)
    n_chunks = -(-len(long_ids) // PREFILL_CHUNK)
    sched = Scheduler(LocalRunner(mf, 1024, 3), tok)
    long = Seq(long_ids, GREEDY, 1)
    sched.admit(long)
    shorts = iter(range(1000))

    def another_short():  # one token each: it is answered, and gone, in the step that reads its prompt
        while sched.free:
            sched.admit(Seq(tok.encode(PROMPTS[next(shorts) % len(PROMPTS)], add_special=True), GREEDY, 1))

    fed = _fed_until_done(sched, long, another_short)
    # a short prompt is always waiting, yet the long one is read at least every PATIENCE + 1 steps
    moved = [k for k in range(len(fed)) if fed[k] != (fed[k - 1] if k else 0)]
    assert len(moved) == n_chunks and len(fed) <= n_chunks * (PATIENCE + 1)
    assert max(b - a for a, b in zip([-1, *moved], moved)) == PATIENCE + 1, fed


def _run_together(sched, seqs, limit=4000):
    """Every seq through sched, admitted in order as slots free: (tokens of each, batch size of each step)."""
    got: dict[int, list[int]] = {id(s): [] for s in seqs}
    waiting, batches = list(seqs), []
    for _ in range(limit):
        while waiting and sched.free:
            sched.admit(waiting.pop(0))
        if not sched.seqs and not waiting:
            break
        for seq, ev in sched.step():
            got[id(seq)].append(ev.token_id)
        batches.append(sched.batch)
    return [got[id(s)] for s in seqs], batches


def test_with_a_q8_0_cache_each_sequence_and_a_cached_prefix_give_the_tokens_they_get_alone(smollm2_path):
    # SmolLM2's head size (64) holds q8_0 (stories260K's cannot). The long prompt is read in chunks
    # (BLAS attention over the dequantized cache) between the decode rows of the short ones (the
    # compiled kernel), copied by a second sequence with the same prompt, and then taken again from
    # the prefix cache: every token as it comes alone.
    mf = gguf.open_model(smollm2_path)
    tok = Tokenizer.from_metadata(mf.metadata)
    # (LONG twice: the second copies the first's whole chunks, q8_0 blocks and all)
    prompts = [tok.encode(p, add_special=True) for p in (*PROMPTS[:3], LONG, LONG)]
    assert len(prompts[-1]) > PREFILL_CHUNK + 1
    params = [params_of(k) for k in range(5)]
    want = [[ev.token_id for ev in generate(LocalRunner(mf, CTX, kv_type="q8_0"), tok, ids, p, 16)]
            for ids, p in zip(prompts, params)]
    sched = Scheduler(LocalRunner(mf, CTX, 5, "q8_0"), tok)
    seqs = [Seq(ids, p, 16) for ids, p in zip(prompts, params)]
    got, batches = _run_together(sched, seqs)
    assert got == want
    assert seqs[3].cached + seqs[4].cached == (len(prompts[-1]) - 1) // PREFILL_CHUNK * PREFILL_CHUNK
    assert max(batches) >= 3  # the short ones decoded together
    again = Seq(prompts[-1], params[-1], 16)
    got, _ = _run_together(sched, [again])
    assert again.cached == (len(prompts[-1]) - 1) // PREFILL_CHUNK * PREFILL_CHUNK and got == [want[-1]]


def shared_beginnings(tok) -> tuple[list[list[int]], list[SamplingParams]]:
    """Three prompts that begin alike (one twice, as a request's choices; one with more after it) and
    one that does not, greedy and seeded."""
    ids = tok.encode(LONG, add_special=True)
    longer = tok.encode(LONG + " Her mother said no.", add_special=True)
    assert longer[:len(ids) - 1] == ids[:-1] and len(ids) > 2 * PREFILL_CHUNK + 1
    prompts = [ids, ids, longer, tok.encode(PROMPTS[1], add_special=True)]
    return prompts, [GREEDY, SamplingParams(temperature=0.9, seed=5), GREEDY, GREEDY]


def test_prompts_that_begin_alike_copy_whole_chunks_from_each_other_and_answer_as_alone(stories):
    """Admitted together, the first reads the shared chunks and the others copy them from its slot
    (Chunk.copy) instead of reading them again: each still gets its tokens alone. A scored prompt
    (echo) is read in full."""
    mf, tok = stories
    prompts, params = shared_beginnings(tok)
    want = [[ev.token_id for ev in generate(LocalRunner(mf, CTX), tok, ids, p, 12)] for ids, p in zip(prompts, params)]
    sched = Scheduler(LocalRunner(mf, CTX, 4), tok)
    seqs = [Seq(ids, p, 12) for ids, p in zip(prompts, params)]
    read: list[int] = []
    got: dict[int, list[int]] = {id(s): [] for s in seqs}
    for s in seqs:
        sched.admit(s)
    for _ in range(400):
        if not sched.seqs:
            break
        for seq, ev in sched.step():
            got[id(seq)].append(ev.token_id)
        read += [n for kind, n, _, _ in sched.last if kind == "prefill"]
    assert [got[id(s)] for s in seqs] == want
    shared = (len(prompts[0]) - 1) // PREFILL_CHUNK * PREFILL_CHUNK
    # whoever reads a shared chunk first, the other two copy it (taking turns: PATIENCE)
    assert sum(s.cached for s in seqs[:3]) == 2 * shared and seqs[3].cached == 0
    assert sum(read) == sum(len(ids) for ids in prompts) - 2 * shared  # each shared chunk read once

    scored = Seq(prompts[0], GREEDY, 1, score=1)
    sched.cache.forget()
    sched.admit(copier := Seq(prompts[0], GREEDY, 1))
    sched.admit(scored)
    for _ in range(100):
        if not sched.seqs:
            break
        sched.step()
    assert scored.cached == 0 and copier.cached == 0


def test_a_sequence_that_takes_a_cached_prefix_and_then_copies_more_counts_one_prefix_hit(stories):
    """The scheduler's prefix_hits (/v1/cluster, `edgetp status`) counts requests, as /metrics does: a
    sequence that takes one chunk from a free slot at admission and copies the next from a running
    sequence is one hit, its tokens the sum of both."""
    mf, tok = stories
    (ids, _, longer, _), _ = shared_beginnings(tok)
    sched = Scheduler(LocalRunner(mf, CTX, 3), tok)
    firsts = [Seq(ids[:PREFILL_CHUNK + 1], GREEDY, 1) for _ in range(2)]  # two free slots holding one chunk
    for s in firsts:
        sched.admit(s)
    for _ in range(50):
        if not sched.seqs:
            break
        sched.step()
    ahead = Seq(ids, GREEDY, 4)  # takes one of them and reads on: a running slot holding two chunks
    sched.admit(ahead)
    for _ in range(50):
        if ahead.fed >= 2 * PREFILL_CHUNK:
            break
        sched.step()
    assert ahead.cached == PREFILL_CHUNK and ahead.fed >= 2 * PREFILL_CHUNK
    hits = sched.prefix_hits
    late = Seq(longer, GREEDY, 4)
    sched.admit(late)
    assert late.cached == PREFILL_CHUNK  # the other free slot's chunk
    for _ in range(100):
        if not sched.seqs:
            break
        sched.step()
    assert late.cached >= 2 * PREFILL_CHUNK  # and then at least one more, copied from ahead's slot
    assert (sched.prefix_hits, sched.cached_tokens) == (hits + 1, sum(s.cached for s in firsts + [ahead, late]))


@pytest.mark.parametrize("copy", [
    [0, 0, 1],    # [src slot, a]
    [1, 0],       # from the slot it copies into
    [2, 0],       # a slot that holds nothing here
    [0, 80],      # a past the chunk's position
    [0, -1],
    [0, 32],      # before a, the slot holds nothing here
    [0.0, 0],
    "0",
])
def test_a_worker_refuses_a_malformed_copy(copy):
    from edgetp.serve.worker import _copy_of  # noqa: PLC0415

    history = {0: list(range(70)), 1: []}
    with pytest.raises(ValueError, match="copy is malformed"):
        _copy_of(copy, history, 1, 64)
    assert _copy_of([0, 0], history, 1, 64) == (0, 0)


# --------------------------------------------------------------------------- a cluster


def test_a_batch_across_three_processes_gives_each_sequence_its_single_node_text(float_workers, stories_path,
                                                                                   monkeypatch):
    monkeypatch.setenv("EDGETP_INT8", "0")  # the workers' kernels: exact float arithmetic on every node
    quant.set_threads(1)
    mf = gguf.open_model(stories_path)
    tok = Tokenizer.from_metadata(mf.metadata)
    prompts = [tok.encode(p, add_special=True) for p in PROMPTS[:5]]
    params = [params_of(k) for k in range(5)]
    want = [[ev.token_id for ev in generate(LocalRunner(mf, CTX), tok, ids, p, 32)]
            for ids, p in zip(prompts, params)]
    with LoopThread() as lt:
        runner = lt.run(ClusterRunner.connect(mf, float_workers[:2], ctx=CTX, weights=[1, 2, 3], slots=4), timeout=300)
        try:
            assert runner.slots == 4
            sched = Scheduler(runner, tok)
            seqs = [Seq(ids, p, 32) for ids, p in zip(prompts, params)]
            got: dict[int, list[int]] = {id(s): [] for s in seqs}
            waiting, batches = list(seqs), []
            runner.begin()
            try:
                for _ in range(2000):
                    while waiting and sched.free:
                        sched.admit(waiting.pop(0))
                    if not sched.seqs and not waiting:
                        break
                    for seq, ev in sched.step():
                        got[id(seq)].append(ev.token_id)
                    batches.append(sched.batch)
            finally:
                runner.end()
        finally:
            runner.close()
    assert [got[id(s)] for s in seqs] == want
    assert max(batches) == 4  # four slots for five sequences: the fifth joined when one left


async def test_a_client_that_leaves_frees_its_slot_while_the_other_streams_go_on(start, stories):
    mf, tok = stories
    url, engine = await start(mf, tok, slots=2, ctx=1024)
    finished: list[events.RequestRecord] = []
    engine.bus.add_listener(lambda r: finished.append(r) if isinstance(r, events.RequestRecord)
                            and r.state == "finished" else None)
    async with client(url) as c:
        leaving = await c.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=900,
                                             temperature=0, stream=True)
        staying = asyncio.ensure_future(c.completions.create(model="stories260K", prompt="The little dog",
                                                             max_tokens=300, temperature=0))
        got = 0
        async for _ in leaving:
            got += 1
            if got == 5:
                break
        await leaving.close()  # the client goes away mid-answer
        for _ in range(500):
            if engine.slots_view().active <= 1:
                break
            await asyncio.sleep(0.01)
        assert engine.slots_view().active <= 1  # its slot is free while the other still runs (or is done)
        answer = await staying
    assert answer.choices[0].text == alone(mf, tok, "The little dog", GREEDY, 300)
    assert engine.slots_view().active == 0
    gone = next(r for r in finished if r.prompt == "Once upon a time")
    assert gone.finish_reason == "cancelled" and gone.completion_tokens < 900


def test_workers_copy_a_shared_beginning_between_slots_as_the_root_does(float_workers, stories_path, monkeypatch):
    """Tensor-parallel over three processes and as a pipeline of three stages: every node copies its
    part of the shared chunks (a STEP's "copy"), and each sequence gets its single-node tokens."""
    monkeypatch.setenv("EDGETP_INT8", "0")
    quant.set_threads(1)
    mf = gguf.open_model(stories_path)
    tok = Tokenizer.from_metadata(mf.metadata)
    prompts, params = shared_beginnings(tok)
    want = [[ev.token_id for ev in generate(LocalRunner(mf, CTX), tok, ids, p, 12)] for ids, p in zip(prompts, params)]
    with LoopThread() as lt:
        for parallel in ("tp", "pp"):
            runner = lt.run(ClusterRunner.connect(mf, float_workers[:2], ctx=CTX, slots=4, parallel=parallel),
                            timeout=300)
            try:
                sched = Scheduler(runner, tok)
                seqs = [Seq(ids, p, 12) for ids, p in zip(prompts, params)]
                for s in seqs:
                    sched.admit(s)
                got: dict[int, list[int]] = {id(s): [] for s in seqs}
                runner.begin()
                try:
                    for _ in range(400):
                        if not sched.seqs:
                            break
                        for seq, ev in sched.step():
                            got[id(seq)].append(ev.token_id)
                finally:
                    runner.end()
            finally:
                runner.close()
            assert [got[id(s)] for s in seqs] == want, parallel
            assert seqs[1].cached > 0 and seqs[2].cached > 0, parallel
