"""Several choices of one request (the API's `n`), each its own sequence in the batch: through a real
`edgetp serve` with the `openai` client.

- greedy choices are all llama.cpp's greedy answer;
- seeded sampled choice i is the answer of one sequence seeded seed + i, run alone in this process
  (so the choices differ, and a client can reproduce any one of them with n=1);
- streamed chunks name their choice, and joined per choice they are the whole answer's choices;
- usage counts the prompt once and every choice's tokens;
- n outside 1..128, or more choices than the server runs and queues, is a 400 naming `n`;
  choices are queued all or none (Engine.submit_all).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from edgetp.model import gguf, sampling
from edgetp.model.generate import LocalRunner, generate
from edgetp.model.tokenizer import Tokenizer
from edgetp.serve.root import Engine, QueueFull, Request
from edgetp.serve.spawn import stop
from tests import reference
from tests.test_serve import start_server

PROMPT = "Once upon a time, there was a little girl named Lily. She"
N = 16
SEED = 2**64 - 2  # choice 2's seed wraps to 0, as OpenAI's integers do past numpy's range


@pytest.fixture(scope="module")
def served(stories_path):
    """`edgetp serve` on stories260K with an f32 KV cache (as the reference), 4 slots, 2 queued: its URL."""
    proc, url = start_server("--model", str(stories_path), "--kv-type", "f32", "--slots", "4", "--queue", "2")
    yield url
    stop(proc)


@pytest.fixture(scope="module")
def tok(stories_path) -> Tokenizer:
    return Tokenizer.from_metadata(gguf.open_model(stories_path).metadata)


def _client(url):
    import openai  # noqa: PLC0415

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)


def alone(stories_path, tok, ids: list[int], seed: int) -> str:
    """One sequence sampled with `seed` in this process, nothing else running."""
    mf = gguf.open_model(stories_path)
    params = sampling.SamplingParams(temperature=1.0, seed=seed)
    return "".join(ev.text for ev in generate(LocalRunner(mf, ctx=256, kv_type="f32"), tok, ids, params, N))


def test_greedy_choices_are_each_llama_cpps_answer(llama_cpp, served, stories_path, tok):
    ids = reference.tokenize(stories_path, PROMPT)
    expected = b"".join(tok.token_bytes(t) for t in reference.greedy(stories_path, ids, N)).decode()
    got = _client(served).completions.create(model="stories260K", prompt=ids, max_tokens=N, temperature=0, n=3)
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == [expected] * 3
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == 3 * N


def test_seeded_choices_are_the_answers_of_seed_plus_i_and_stream_as_they_come(llama_cpp, served, stories_path, tok):
    client = _client(served)
    ids = reference.tokenize(stories_path, PROMPT)
    expected = [alone(stories_path, tok, ids, (SEED + i) % 2**64) for i in range(3)]
    assert len(set(expected)) == 3  # the seeds draw three different answers
    whole = client.completions.create(model="stories260K", prompt=ids, max_tokens=N, temperature=1.0, seed=SEED, n=3)
    assert [c.text for c in whole.choices] == expected
    one = client.completions.create(model="stories260K", prompt=ids, max_tokens=N, temperature=1.0, seed=SEED + 1)
    assert one.choices[0].text == expected[1]  # any choice, reproduced alone

    chunks = list(client.completions.create(model="stories260K", prompt=ids, max_tokens=N, temperature=1.0,
                                            seed=SEED, n=3, stream=True, stream_options={"include_usage": True}))
    texts, finished = ["", "", ""], [0, 0, 0]
    for c in chunks[:-1]:
        (choice,) = c.choices
        texts[choice.index] += choice.text
        finished[choice.index] += choice.finish_reason is not None
        assert c.id == chunks[0].id
    assert texts == expected and finished == [1, 1, 1]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3 * N
    assert chunks[-1].usage.prompt_tokens == len(ids)


def test_chat_choices_each_begin_with_the_assistant_role(served, stories_path, tok):
    client = _client(served)
    messages = [{"role": "user", "content": "Tell me a story about a cat."}]
    whole = client.chat.completions.create(model="stories260K", messages=messages, max_tokens=N, temperature=0.8,
                                           seed=7, n=2)
    assert [c.index for c in whole.choices] == [0, 1]
    assert all(c.message.role == "assistant" and c.message.content for c in whole.choices)
    seventh = client.chat.completions.create(model="stories260K", messages=messages, max_tokens=N, temperature=0.8,
                                             seed=8)
    assert whole.choices[1].message.content == seventh.choices[0].message.content
    chunks = list(client.chat.completions.create(model="stories260K", messages=messages, max_tokens=N,
                                                 temperature=0.8, seed=7, n=2, stream=True))
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]
    texts = ["", ""]
    for c in chunks:
        texts[c.choices[0].index] += c.choices[0].delta.content or ""
    assert texts == [c.message.content for c in whole.choices]


@pytest.mark.parametrize("n, says", [(0, "between 1 and 128"), (129, "between 1 and 128"), ("2", "integer"),
                                     (7, "runs 4 sequences at once and queues 2 more")])
def test_a_bad_n_gets_a_400_naming_it(served, n, says):
    body = json.dumps({"model": "stories260K", "prompt": "Once", "max_tokens": 2, "n": n}).encode()
    req = urllib.request.Request(f"{served}/v1/completions", body, {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=60)
    assert err.value.code == 400
    error = json.loads(err.value.read())["error"]
    assert error["param"] == "n" and says in error["message"], error


def test_choices_are_queued_all_or_none(stories_path, tok):
    """Room is free slots plus the queue: 2 slots and a queue of 1 take 3 choices; then not 2 more,
    nor 1 more (nothing of a refused request is left queued)."""
    engine = Engine(LocalRunner(gguf.open_model(stories_path), ctx=64, slots=2), tok, "stories260K", queue_size=1)
    ask = Request("r", (1, 2), sampling.SamplingParams(), 2)
    assert len(engine.submit_all([ask] * 3)) == 3
    for more in (2, 1):
        with pytest.raises(QueueFull):
            engine.submit_all([ask] * more)
        assert engine.queue_depth == 3
