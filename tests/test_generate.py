"""The generation loop's stopping rules, on the real stories260K model."""

from __future__ import annotations

import random

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


@pytest.mark.parametrize("order", [1, -1])
def test_of_several_stop_strings_the_text_ends_at_the_first_to_come_whatever_their_order(story, order):
    mf, tok, ids, full = story
    stops = ["e", "th", "park"]  # ", there was": one token completes "th" and "e"
    assert all(s in full for s in stops)
    events = list(generate(LocalRunner(mf, 256), tok, ids, GREEDY, 40, stop=stops[::order]))
    assert "".join(ev.text for ev in events) == full[: min(full.index(s) for s in stops)]


class _Pieces:
    """A decoder that hands out given pieces of text, one per token id."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def feed(self, tid: int) -> str:
        return self.pieces[tid]

    def flush(self) -> str:
        return ""


def test_stop_strings_that_overlap_themselves_and_each_other_cut_where_str_find_says():
    """Random texts over two letters, cut into random pieces, against str.find: after each piece, the
    first stop string found in the text so far ends it where it starts; before that, nothing sent may
    reach into a stop string's start, and everything that cannot is sent."""
    from edgetp.model.batch import _StopFilter

    rng = random.Random(5)
    for _ in range(400):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(1, 30)))
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4))]
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 8))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        f, sent, seen = _StopFilter(_Pieces(pieces), stops), "", ""
        for i, piece in enumerate(pieces):
            seen += piece
            out, stopped = f.feed(i)
            sent += out
            found = [seen.find(s) for s in stops if s in seen]
            if found:
                assert stopped and sent == seen[: min(found)], (text, stops, pieces)
                break
            assert not stopped
            held = max((k for s in stops for k in range(1, len(s)) if seen.endswith(s[:k])), default=0)
            assert sent == seen[: len(seen) - held], (text, stops, pieces)
        else:
            assert sent + f.finish() == text
