"""Log probabilities (the API's `logprobs`, `top_logprobs`) against llama.cpp's own logits: the
log-softmax of the model's logits, before bias, penalties and temperature, for every answered token
and its likeliest alternatives, on one node, over vocabulary shards and through a served pipeline."""

from __future__ import annotations

import numpy as np
import pytest

from edgetp.model import gguf, sampling
from edgetp.model.generate import LocalRunner, generate
from edgetp.model.tokenizer import Tokenizer
from edgetp.serve.spawn import stop
from tests import reference
from tests.test_serve import start_server, start_worker

PROMPT = "Once upon a time, there was a little girl named Lily. She"
N = 24
# |ours - llama.cpp's| of a log probability, both with an f32 KV cache: measured at most 4.8e-6 on
# stories260K (the logits themselves agree to ~1e-4 of their spread, test_engine_reference)
TOL = 1e-4


def reference_logprobs(path, ids: list[int], answer: list[int]) -> np.ndarray:
    """llama.cpp's log-softmax (float64) at each answered position: (len(answer), vocab)."""
    x = reference.logits(path, list(ids) + list(answer))[len(ids) - 1:len(ids) - 1 + len(answer)].astype(np.float64)
    top = x.max(axis=1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(axis=1, keepdims=True))


def assert_like_reference(ref_row: np.ndarray, token: int, logprob: float, top: list[tuple[int, float]], n: int):
    assert abs(logprob - ref_row[token]) <= TOL
    assert len(top) == n
    for t, v in top:
        assert abs(v - ref_row[t]) <= TOL, (t, v, ref_row[t])
    if n:  # the n likeliest: nothing left out is likelier than the least of them (beyond rounding)
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        assert np.sort(ref_row)[::-1][n - 1] <= top[-1][1] + TOL


def test_shards_merge_to_one_nodes_log_probabilities_which_ignore_bias_penalties_and_temperature():
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(1000) * 3).astype(np.float32)
    history = rng.integers(0, 1000, 60).tolist()
    p = sampling.SamplingParams(temperature=0.6, top_k=30, frequency_penalty=0.8, presence_penalty=0.5,
                                repeat_penalty=1.2, logit_bias=((int(np.argmax(x)), -100.0), (17, 100.0)), logprobs=7)
    whole = sampling.candidates(x, 0, history, p)
    parts = sampling.merge([sampling.candidates(x[a:b], a, history, p) for a, b in ((0, 250), (250, 600), (600, 1000))])
    exact = x.astype(np.float64) - np.log(np.exp(x.astype(np.float64)).sum())  # the model's own, by formula
    want_top = np.argsort(-exact, kind="stable")[:7]
    for c in (whole, parts):
        token = int(c.ids[3])  # any candidate may be the one sampled
        lp = sampling.logprobs(c, token, 7)
        assert abs(lp.logprob - exact[token]) <= 1e-9
        assert [t for t, _ in lp.top] == want_top.tolist()
        assert max(abs(v - exact[t]) for t, v in lp.top) <= 1e-9
    assert int(whole.ids[0]) == 17 and sampling.logprobs(whole, 17, 0).top == ()  # the bias picks 17; n = 0
    # the greedy path carries them too
    g = sampling.candidates(x, 0, [], sampling.SamplingParams(temperature=0, logprobs=2))
    assert sampling.logprobs(g, int(g.ids[0]), 2).top[0][0] == int(np.argmax(x))


@pytest.fixture(scope="module")
def served(stories_path):
    """`edgetp serve` on stories260K with an f32 KV cache, as the reference runs: its URL."""
    proc, url = start_server("--model", str(stories_path), "--kv-type", "f32")
    yield url
    stop(proc)


def _client(url):
    import openai  # noqa: PLC0415

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120)


def test_a_completions_logprobs_are_llama_cpps_greedy_and_sampled(llama_cpp, served, stories_path):
    client = _client(served)
    mf = gguf.open_model(stories_path)
    tok = Tokenizer.from_metadata(mf.metadata)
    ids = reference.tokenize(stories_path, PROMPT)
    greedy = reference.greedy(stories_path, ids, N)
    sampled = sampling.SamplingParams(temperature=0.9, seed=11, frequency_penalty=0.7, logit_bias=((greedy[0], -5.0),),
                                      logprobs=3)
    # the sampled answer's ids (the same seed gives the same tokens in and out of the server)
    drawn = [ev.token_id for ev in generate(LocalRunner(mf, ctx=256, kv_type="f32"), tok, ids, sampled, N)]
    assert drawn != greedy
    for answer, n_top, kw in ((greedy, 5, dict(temperature=0)),
                              (drawn, 3, dict(temperature=0.9, seed=11, frequency_penalty=0.7,
                                              logit_bias={str(greedy[0]): -5}))):
        got = client.completions.create(model="stories260K", prompt=ids, max_tokens=N, logprobs=n_top, **kw)
        lp = got.choices[0].logprobs
        strings = [strings_of(tok, t) for t in answer]
        assert lp.tokens == strings and "".join(strings) == got.choices[0].text
        assert lp.text_offset == [sum(len(s) for s in strings[:i]) for i in range(N)]
        ref = reference_logprobs(stories_path, ids, answer)
        for i, t in enumerate(answer):
            top = sorted(lp.top_logprobs[i].items(), key=lambda kv: -kv[1])
            assert len(top) == n_top
            assert abs(lp.token_logprobs[i] - ref[i, t]) <= TOL
            for s, v in top:  # token strings: the likeliest tokens with that text
                assert min(abs(v - ref[i, u]) for u in range(ref.shape[1]) if strings_of(tok, u) == s) <= TOL
        # the model's own probabilities: the first greedy token stays the likeliest, though biased down by 5
        assert max(lp.top_logprobs[0].items(), key=lambda kv: kv[1])[0] == strings_of(tok, greedy[0])


def strings_of(tok, u: int) -> str:
    return tok.token_bytes(u).decode("utf-8", "replace")


def test_chat_logprobs_stream_as_they_answer_and_match_llama_cpp(llama_cpp, served, stories_path):
    client = _client(served)
    mf = gguf.open_model(stories_path)
    tok = Tokenizer.from_metadata(mf.metadata)
    messages = [{"role": "user", "content": "Tell me a story about a cat."}]
    whole = client.chat.completions.create(model="stories260K", messages=messages, max_tokens=N, temperature=0,
                                           logprobs=True, top_logprobs=4)
    content = whole.choices[0].logprobs.content
    streamed = []
    for chunk in client.chat.completions.create(model="stories260K", messages=messages, max_tokens=N, temperature=0,
                                                logprobs=True, top_logprobs=4, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    assert b"".join(bytes(e.bytes) for e in content).decode() == whole.choices[0].message.content
    _, ids = tok.encode_chat(messages)
    answer = reference.greedy(stories_path, ids, N)[:len(content)]
    assert [e.token for e in content] == [strings_of(tok, t) for t in answer]
    ref = reference_logprobs(stories_path, ids, answer)
    for i, (e, t) in enumerate(zip(content, answer)):
        top = [(tok_id(tok, x.bytes, ref[i]), x.logprob) for x in e.top_logprobs]
        assert_like_reference(ref[i], t, e.logprob, top, 4)


def tok_id(tok, raw: list[int], row: np.ndarray) -> int:
    """The likeliest token whose bytes are `raw` (several ids may share them)."""
    ids = [u for u in range(row.shape[0]) if tok.token_bytes(u) == bytes(raw)]
    return max(ids, key=lambda u: row[u])


def test_no_logprobs_unless_asked(served):
    client = _client(served)
    got = client.chat.completions.create(model="stories260K", messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=4, temperature=0)
    assert got.choices[0].logprobs is None
    got = client.completions.create(model="stories260K", prompt="Once", max_tokens=4, temperature=0)
    assert got.choices[0].logprobs is None


@pytest.mark.parametrize("chat, bad, field", [
    (True, dict(top_logprobs=3), "top_logprobs"),  # without logprobs: true
    (True, dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    (True, dict(logprobs=2), "logprobs"),  # chat's is a boolean
    (False, dict(logprobs=21), "logprobs"),
    (False, dict(logprobs=True), "logprobs"),  # a completion's is a count
    (False, dict(top_logprobs=2), "top_logprobs"),  # no such field for completions
    (True, dict(echo=True), "echo"),  # chat has no echo
    (False, dict(echo="yes"), "echo"),
    (False, dict(max_tokens=0), "max_tokens"),  # nothing to answer, and nothing echoed
])
def test_bad_logprobs_get_a_400_naming_the_field(served, chat, bad, field):
    import openai  # noqa: PLC0415

    client = _client(served)
    with pytest.raises(openai.BadRequestError) as err:
        if chat:
            client.chat.completions.create(model="stories260K", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=4, extra_body=bad)
        else:
            body = {"max_tokens": 4} | bad
            client.completions.create(model="stories260K", prompt="Once", max_tokens=body.pop("max_tokens"),
                                      extra_body=body)
    assert err.value.body["param"] == field


# longer than a prefill chunk (64), so the scores of two chunks join, the first chunk's last
# position scoring the second chunk's first token
LONG = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the sun. One day, she "
        "saw a big red ball in the park. She ran to the ball and kicked it very hard. The ball went up high into "
        "the sky and came down in a tree. Lily was sad because she could not reach it.")


def assert_prompt_scored_like_reference(lp, ids: list[int], ref_prompt: np.ndarray, tok, n: int) -> None:
    """OpenAI's echo: one entry per prompt token, the first null, each other token's log probability
    and top n as the log-softmax of llama.cpp's logits one position earlier."""
    assert lp.tokens[:len(ids)] == [strings_of(tok, t) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        row = ref_prompt[i - 1]
        assert abs(lp.token_logprobs[i] - row[ids[i]]) <= TOL, (i, lp.token_logprobs[i], row[ids[i]])
        top = sorted(lp.top_logprobs[i].items(), key=lambda kv: -kv[1])
        assert len(top) == n
        for s, v in top:  # token strings: the likeliest tokens with that text
            assert min(abs(v - row[u]) for u in range(row.shape[0]) if strings_of(tok, u) == s) <= TOL


def assert_offsets_index_the_text(text: str, lp, prompt_tokens: int) -> None:
    """Each token's text_offset is where its string starts in the echoed answer's text (an SPM prompt's
    first word is sent back without the space its token carries), and the answer starts after the prompt."""
    for i, (s, at) in enumerate(zip(lp.tokens, lp.text_offset)):
        assert text[at:].startswith(s) or (at == 0 and s.startswith(" ") and text.startswith(s[1:])), (i, s, at)
    if len(lp.tokens) > prompt_tokens:
        assert lp.text_offset[prompt_tokens] == len(text) - sum(len(s) for s in lp.tokens[prompt_tokens:])


def reference_prompt_logprobs(path, ids: list[int]) -> np.ndarray:
    """llama.cpp's log-softmax (float64) at every prompt position: (len(ids), vocab)."""
    x = reference.logits(path, list(ids)).astype(np.float64)
    top = x.max(axis=1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(axis=1, keepdims=True))


def test_echo_scores_the_prompt_as_llama_cpp_does(llama_cpp, served, stories_path):
    """lm-evaluation-harness's loglikelihood request (echo, logprobs, max_tokens 1), OpenAI's older
    scoring request (max_tokens 0), streamed and whole, and after the prompt sat in the prefix cache."""
    client = _client(served)
    tok = Tokenizer.from_metadata(gguf.open_model(stories_path).metadata)
    ids = reference.tokenize(stories_path, LONG)
    assert 64 < len(ids) < 200
    ref = reference_prompt_logprobs(stories_path, ids)
    prompt_text = tok.decode(ids)
    first = reference.greedy(stories_path, ids, 1)[0]
    # cached first: the scored request must read its prompt in full all the same
    client.completions.create(model="stories260K", prompt=ids, max_tokens=2, temperature=0)
    one = client.completions.create(model="stories260K", prompt=ids, max_tokens=1, temperature=0, logprobs=2,
                                    echo=True)
    lp = one.choices[0].logprobs
    assert one.choices[0].text == prompt_text + strings_of(tok, first)
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.tokens[-1] == strings_of(tok, first)
    assert_prompt_scored_like_reference(lp, ids, ref, tok, 2)
    assert_offsets_index_the_text(one.choices[0].text, lp, len(ids))
    assert one.usage.completion_tokens == 1 and one.usage.prompt_tokens_details.cached_tokens == 0

    # lm-evaluation-harness's loglikelihood request as it sends it, and its reading of the answer:
    # the continuation's summed log probability and whether greedy decoding would produce it
    ctxlen = 40
    harness = client.completions.create(model="stories260K", prompt=[ids], temperature=0, max_tokens=1, logprobs=1,
                                        seed=1234, echo=True).choices[0].logprobs
    total = sum(harness.token_logprobs[ctxlen:-1])
    assert abs(total - sum(ref[i - 1, ids[i]] for i in range(ctxlen, len(ids)))) <= TOL * (len(ids) - ctxlen)
    greedy = all(t == max(top.values()) for t, top in zip(harness.token_logprobs[ctxlen:-1],
                                                          harness.top_logprobs[ctxlen:-1]))
    assert greedy == all(int(np.argmax(ref[i - 1])) == ids[i] for i in range(ctxlen, len(ids)))

    zero = client.completions.create(model="stories260K", prompt=LONG, max_tokens=0, logprobs=3, echo=True)
    assert zero.choices[0].text == LONG and zero.choices[0].finish_reason == "length"
    assert zero.usage.completion_tokens == 0 and len(zero.choices[0].logprobs.tokens) == len(ids)
    assert_prompt_scored_like_reference(zero.choices[0].logprobs, ids, ref, tok, 3)
    assert_offsets_index_the_text(LONG, zero.choices[0].logprobs, len(ids))

    chunks = list(client.completions.create(model="stories260K", prompt=ids, max_tokens=1, temperature=0,
                                            logprobs=2, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == one.choices[0].text
    assert chunks[0].choices[0].text == prompt_text  # the prompt first, in a chunk of its own
    joined = {k: sum((getattr(c.choices[0].logprobs, k) for c in chunks if c.choices[0].logprobs), [])
              for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    assert joined == {k: getattr(lp, k) for k in joined}


def test_echo_without_logprobs_gives_the_prompt_then_the_answer(served, stories_path):
    client = _client(served)
    alone = client.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=6, temperature=0)
    echoed = client.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=6, temperature=0,
                                       echo=True)
    assert echoed.choices[0].text == "Once upon a time" + alone.choices[0].text
    assert echoed.choices[0].logprobs is None
    only = client.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=0, echo=True)
    assert only.choices[0].text == "Once upon a time" and only.usage.completion_tokens == 0


def test_a_served_pipeline_gives_llama_cpps_logprobs(llama_cpp, stories_path):
    """The last stage of a pipeline computes the logits and sends them as candidates to the root."""
    (w1, a), (w2, b) = start_worker(), start_worker()
    server = None
    try:
        server, url = start_server("--model", str(stories_path), "--workers", f"{a},{b}", "--parallel", "pp",
                                   "--kv-type", "f32")
        ids = reference.tokenize(stories_path, PROMPT)
        got = _client(url).completions.create(model="stories260K", prompt=ids, max_tokens=N, temperature=0, logprobs=2)
        answer = reference.greedy(stories_path, ids, N)
        ref = reference_logprobs(stories_path, ids, answer)
        lp = got.choices[0].logprobs
        assert len(lp.token_logprobs) == N
        assert max(abs(v - ref[i, t]) for i, (v, t) in enumerate(zip(lp.token_logprobs, answer))) <= TOL
        # the prompt scored by the last stage's worker, two chunks of it
        long_ids = reference.tokenize(stories_path, LONG)
        echoed = _client(url).completions.create(model="stories260K", prompt=long_ids, max_tokens=0, logprobs=1,
                                                 echo=True)
        tok = Tokenizer.from_metadata(gguf.open_model(stories_path).metadata)
        assert_prompt_scored_like_reference(echoed.choices[0].logprobs, long_ids,
                                            reference_prompt_logprobs(stories_path, long_ids), tok, 1)
    finally:
        if server:
            stop(server)
        stop(w1)
        stop(w2)


@pytest.mark.parametrize("score, ids", [
    ([2, [5, -1]], None),          # no chunk to score
    ([21, [5, -1]], [1, 5]),       # more alternatives than any API request asks
    ([-1, [5, -1]], [1, 5]),
    ([2, [5]], [1, 5]),            # a target per chunk row
    ([2, [5, -2]], [1, 5]),
    ([2.0, [5, -1]], [1, 5]),
    ("2", [1, 5]),
])
def test_a_worker_refuses_a_malformed_score_request(score, ids):
    from edgetp.serve.worker import _scored_chunk  # noqa: PLC0415

    with pytest.raises(ValueError, match="score is malformed"):
        _scored_chunk(score, 0, 0, ids)
    assert _scored_chunk([2, [5, -1]], 3, 64, [1, 5]).targets == [5, -1]
