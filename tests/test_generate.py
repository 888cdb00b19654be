"""The generation loop's stopping rules, on the real stories260K model."""

from __future__ import annotations

import pytest

from edgetp.model import gguf, sampling
from edgetp.model.generate import ContextError, LocalRunner, generate
from edgetp.model.tokenizer import Tokenizer

GREEDY = sampling.SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def story(stories_path):
    mf = gguf.open_model(stories_path)
    tok = Tokenizer.from_metadata(mf.metadata)
    ids = tok.encode("Once upon a time")
    full = "".join(ev.text for ev in generate(LocalRunner(mf, 256), tok, ids, GREEDY, 40))
    return mf, tok, ids, full


@pytest.mark.parametrize("stop", ["there was", "Lily", "girl named", ".", "park"])
def test_text_stops_right_before_a_stop_string_even_when_it_spans_tokens(story, stop):
    mf, tok, ids, full = story
    assert stop in full
    events = list(generate(LocalRunner(mf, 256), tok, ids, GREEDY, 40, stop=[stop]))
    assert "".join(ev.text for ev in events) == full[: full.index(stop)]
    assert events[-1].finish_reason == "stop"


def test_a_stop_string_that_never_comes_holds_back_nothing_at_the_end(story):
    mf, tok, ids, full = story
    events = list(generate(LocalRunner(mf, 256), tok, ids, GREEDY, 40, stop=["Lily!!!"]))
    assert "".join(ev.text for ev in events) == full
    assert events[-1].finish_reason == "length"


def test_a_full_context_stops_with_its_own_reason_and_never_wraps(story):
    mf, tok, ids, _ = story
    events = list(generate(LocalRunner(mf, len(ids) + 5), tok, ids, GREEDY, 40))
    # 5 free positions hold 5 answer tokens; a 6th is sampled from the last one but never fed back
    assert len(events) == 6 and events[-1].finish_reason == "context"


def test_a_prompt_longer_than_the_context_is_refused(story):
    mf, tok, ids, _ = story
    with pytest.raises(ContextError, match="context holds"):
        list(generate(LocalRunner(mf, 4), tok, ids, GREEDY, 4))
