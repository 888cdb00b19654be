"""tools/bench_serve.py's figures: percentiles, rates and the baseline row, from hand-worked streams."""

from __future__ import annotations

import argparse

import pytest

from tools.bench_serve import PROMPT_TOKENS, Stream, all_decoding, figures, parse_clients, pct, prompt_ids, table


def test_percentiles_are_nearest_rank():
    assert pct([], 50) is None
    assert pct([3.0, 1.0], 50) == 1.0  # ceil(0.5 * 2) = rank 1
    assert pct(list(range(1, 101)), 95) == 95 and pct(list(range(1, 101)), 50) == 50
    assert pct([7.0], 95) == 7.0


def test_figures_pool_the_gaps_and_rate_tokens_after_each_first_over_the_whole_window():
    a = Stream(0.0, [1.0, 1.1, 1.2], tokens=3)
    b = Stream(0.5, [2.0, 2.5], tokens=2)
    failed = Stream(0.0, error="RateLimitError: 429")
    row = figures(3, [a, b, failed], max_tokens=3)
    assert row.agg == pytest.approx((2 + 1) / (2.5 - 1.0))  # 3 tokens after the firsts in 1.5 s
    assert (row.tbt50, row.tbt95, row.tbt_max) == (pytest.approx(0.1), pytest.approx(0.5), pytest.approx(0.5))
    assert (row.ttft50, row.ttft_max) == (1.0, 1.5)
    assert (row.tokens, row.short, row.errors) == (5, 1, ["RateLimitError: 429"])
    text = table("t", [figures(1, [a], 3), row], 3)
    assert "1 stream(s) ended before 3 tokens; 1 failed (1x RateLimitError)" in text


def test_the_all_decoding_rate_counts_only_between_the_last_first_token_and_the_first_end():
    a = Stream(0.0, [1.0, 1.1, 1.2, 1.3, 1.4], tokens=5)
    b = Stream(0.0, [1.15, 1.25, 1.35, 1.5, 1.6], tokens=5)  # its prefill ran while a decoded
    # (1.15, 1.4]: a's 1.2, 1.3, 1.4 and b's 1.25, 1.35, over 0.25 s
    assert all_decoding([a, b]) == pytest.approx(5 / 0.25)
    assert figures(2, [a, b], 5).steady == pytest.approx(20.0)
    assert all_decoding([a]) == pytest.approx(4 / 0.4)  # alone: its whole stream, the aggregate's window
    assert all_decoding([a, Stream(0.0, [1.5, 1.6], tokens=2)]) is None  # no moment when both decode
    assert all_decoding([a, Stream(0.0, error="APITimeoutError: x")]) is None
    assert "all decoding tok/s" in table("t", [figures(1, [a], 5), figures(2, [a, b], 5)], 5)


def test_the_single_client_row_is_always_measured_and_prompts_differ():
    assert parse_clients("4,2") == [1, 2, 4] and parse_clients("1,8,8") == [1, 8]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_clients("0,2")
    prompts = {tuple(prompt_ids(level, c)) for level in range(6) for c in range(16)}
    assert len(prompts) == 96 and all(len(p) == PROMPT_TOKENS for p in prompts)
