"""Logit bias and the repetition, frequency and presence penalties against llama.cpp's own sampler
chain (llama_sampler_init_logit_bias, llama_sampler_init_penalties, greedy), and through the API."""

from __future__ import annotations

import numpy as np
import pytest

from edgetp.model import gguf, sampling
from edgetp.model.generate import LocalRunner, generate
from edgetp.model.tokenizer import Tokenizer
from edgetp.serve.spawn import stop
from tests import reference
from tests.test_serve import start_server


@pytest.fixture(scope="module")
def served_stories(stories_path):
    """A real `edgetp serve` process on stories260K: its URL."""
    proc, url = start_server("--model", str(stories_path))
    yield url
    stop(proc)


PROMPT = "Once upon a time, there was a little girl named Lily. She"
N = 48
SETTINGS = [
    dict(frequency_penalty=0.6, presence_penalty=0.0, repeat_penalty=1.0),
    dict(frequency_penalty=0.0, presence_penalty=0.9, repeat_penalty=1.0),
    dict(frequency_penalty=0.4, presence_penalty=0.3, repeat_penalty=1.15, bias=True),
]


def llama_cpp_greedy(path, ids: list[int], n: int, s: dict, bias: dict[int, float]) -> list[int]:
    """n tokens after ids picked by llama.cpp's sampler chain: logit bias, penalties over the last 64
    tokens (the prompt accepted into them, as llama.cpp's server does), greedy."""
    from llama_cpp._internals import LlamaSampler  # noqa: PLC0415

    llm = reference.load(str(path))
    chain = LlamaSampler()
    try:
        if bias:
            chain.add_logit_bias(llm.n_vocab(), bias)
        chain.add_penalties(n_vocab=llm.n_vocab(), penalty_last_n=64, penalty_repeat=s["repeat_penalty"],
                            penalty_freq=s["frequency_penalty"], penalty_present=s["presence_penalty"])
        chain.add_greedy()
        for t in ids:
            chain.accept(t)
        llm.reset()
        llm.eval(ids)
        out = []
        for _ in range(n):
            tok = chain.sample(llm._ctx, -1)  # accepts tok into the penalties' window
            out.append(tok)
            llm.eval([tok])
        return out
    finally:
        chain.close()


def edgetp_greedy(runner, tok, ids: list[int], n: int, params: sampling.SamplingParams) -> list[int]:
    return [ev.token_id for ev in generate(runner, tok, ids, params, n)]


@pytest.mark.parametrize("s", SETTINGS, ids=["frequency", "presence", "all-and-bias"])
def test_penalised_greedy_text_is_llama_cpps(stories_path, llama_cpp, s):
    mf = gguf.open_model(stories_path)
    tok = Tokenizer.from_metadata(mf.metadata)
    runner = LocalRunner(mf, ctx=256)
    ids = reference.tokenize(stories_path, PROMPT)
    plain = edgetp_greedy(runner, tok, ids, N, sampling.SamplingParams(temperature=0))
    assert plain == reference.greedy(stories_path, ids, N)  # the two engines agree before any penalty
    bias = {}
    if s.get("bias"):  # push the plain answer's third token down and a token it never says up
        bias = {plain[2]: -100.0, int(np.setdiff1d(np.arange(300, 400), plain)[0]): 4.5}
    params = sampling.SamplingParams(temperature=0, frequency_penalty=s["frequency_penalty"],
                                     presence_penalty=s["presence_penalty"], repeat_penalty=s["repeat_penalty"],
                                     logit_bias=tuple(bias.items()))
    got = edgetp_greedy(runner, tok, ids, N, params)
    assert got != plain  # the settings change the answer, so the comparison below tests them
    assert got == llama_cpp_greedy(stories_path, ids, N, s, bias)


def test_penalties_and_bias_on_vocabulary_shards_merge_to_one_nodes_candidates():
    """Each node penalises its own vocabulary rows (offset): the merged candidates are one node's."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(1000) * 2).astype(np.float32)
    history = rng.integers(0, 1000, 90).tolist() + [7, 7, 7, 640, 640]
    p = sampling.SamplingParams(temperature=0.7, top_k=20, repeat_penalty=1.3, frequency_penalty=0.5,
                                presence_penalty=-0.4, logit_bias=((640, 3.0), (5, -100.0), (999, 1.5)))
    whole = sampling.candidates(x, 0, history, p)
    parts = sampling.merge([sampling.candidates(x[a:b], a, history, p) for a, b in ((0, 333), (333, 640), (640, 1000))])
    k = whole.ids.size  # the merge holds every shard's top k; its first k are the whole's
    assert np.array_equal(parts.ids[:k], whole.ids) and np.array_equal(parts.logits[:k], whole.logits)
    assert abs(parts.lse - whole.lse) <= 1e-9 * abs(whole.lse)
    # token 7 occurs 3 times in the last 64 at least: llama.cpp's formula by hand, in f32
    recent = history[-64:]
    c = recent.count(7)
    v = x[7] / np.float32(1.3) if x[7] > 0 else x[7] * np.float32(1.3)
    want = (v - (np.float32(c) * np.float32(0.5) + np.float32(-0.4))) / np.float32(0.7)
    got = sampling.penalise(x, 0, history, p)[7] / np.float32(0.7)
    assert c >= 3 and got == np.float32(want)


@pytest.mark.parametrize("bad, field", [
    (dict(frequency_penalty=2.5), "frequency_penalty"),
    (dict(presence_penalty="x"), "presence_penalty"),
    (dict(logit_bias={"5": 101}), "logit_bias"),
    (dict(logit_bias={"five": 1}), "logit_bias"),
    (dict(logit_bias=[5]), "logit_bias"),
    (dict(logit_bias={"999999": 1}), "logit_bias"),
    (dict(top_logprobs=2), "top_logprobs"),
    (dict(echo=1), "echo"),  # a boolean
    (dict(best_of=3), "best_of"),
    (dict(suffix="and then"), "suffix"),
    (dict(response_format={"type": "json_object"}), "response_format"),
])
def test_the_api_refuses_what_it_cannot_do_naming_the_field(served_stories, bad, field):
    import openai  # noqa: PLC0415

    client = openai.OpenAI(base_url=f"{served_stories}/v1", api_key="unused")
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="stories260K", prompt="Once", max_tokens=4, extra_body=bad)
    assert err.value.body["param"] == field


def test_the_api_applies_penalties_and_bias_as_the_engine_does(llama_cpp, served_stories, stories_path):
    import openai  # noqa: PLC0415

    client = openai.OpenAI(base_url=f"{served_stories}/v1", api_key="unused")
    mf = gguf.open_model(stories_path)
    tok = Tokenizer.from_metadata(mf.metadata)
    ids = reference.tokenize(stories_path, PROMPT)
    params = sampling.SamplingParams(temperature=0, frequency_penalty=0.7, presence_penalty=0.2,
                                     logit_bias=((ids[-1], -50.0),))
    want = "".join(ev.text for ev in generate(LocalRunner(mf, ctx=256), tok, ids, params, 24))
    got = client.completions.create(model="stories260K", prompt=ids, max_tokens=24, temperature=0,
                                    frequency_penalty=0.7, presence_penalty=0.2, logit_bias={str(ids[-1]): -50})
    assert got.choices[0].text == want
    none = client.completions.create(model="stories260K", prompt=ids, max_tokens=24, temperature=0,
                                     frequency_penalty=0, presence_penalty=0, logit_bias={}, logprobs=None,
                                     echo=False, best_of=1)  # what asks for nothing is taken
    assert none.choices[0].text != want
