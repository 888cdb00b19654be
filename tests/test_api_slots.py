"""Slots, batch sizes and prefix hits in /v1/cluster, the event stream's snapshot, /metrics and `edgetp status`.

A real server on 127.0.0.1 over the real batching engine (stories260K), driven by the `openai`
client. Expected figures come from elsewhere than the metrics under test: the engine's slot
setting, the API's usage, a listener's own count of the step records, or records the test
publishes itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from edgetp import events
from edgetp.model.batch import PREFILL_CHUNK
from edgetp.model.generate import LocalRunner
from edgetp.serve.api import NoRoot, make_app, serving
from edgetp.serve.root import Engine

CTX = 512
SLOTS = 4
TIMEOUT = aiohttp.ClientTimeout(total=60)
PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "A big red ball"]
LONG = " ".join(["Once upon a time there was a little girl named Lily who loved to play outside."] * 12)


@pytest.fixture
async def start(stories):
    """start(route=None) -> (url, engine) with SLOTS slots; every server stops at the end of the test."""
    mf, tok = stories
    async with contextlib.AsyncExitStack() as stack:
        async def go(route=None):
            engine = Engine(LocalRunner(mf, CTX, SLOTS), tok, "stories260K", queue_size=4)
            url = await stack.enter_async_context(serving(make_app(engine, route=route)))
            return url, engine
        yield go


def client(url):
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)


async def scrape(url: str) -> dict[tuple[str, tuple], float]:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        async with s.get(url + "/metrics") as r:
            assert r.status == 200
            text = await r.text()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


async def get_view(url: str) -> events.ClusterView:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        async with s.get(url + "/v1/cluster") as r:
            return events.from_dict(await r.json())


async def test_the_root_shows_its_slots_in_the_view_the_event_snapshot_and_metrics(start):
    url, _ = await start()
    want = events.SlotsView(SLOTS, 0, 0)
    assert (await get_view(url)).slots == want
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        async with s.ws_connect(url + "/v1/events") as ws:
            snapshot = events.from_dict(await ws.receive_json(timeout=10))
    assert isinstance(snapshot, events.ClusterView) and snapshot.slots == want
    m = await scrape(url)
    assert (m[("edgetp_slots_total", ())], m[("edgetp_slots_active", ())], m[("edgetp_queue_depth", ())]) == (SLOTS, 0, 0)
    assert m[("edgetp_batch_size", ())] == 0 and m[("edgetp_prefix_cache_hits_total", ())] == 0
    assert m[("edgetp_allreduce_rounds", ())] == 0  # one node: no all-reduce (a cluster's: test_mixed_step.py)


async def test_a_node_that_forwards_to_another_root_shows_no_slots(start):
    url, _ = await start(route=lambda: "http://127.0.0.1:9")
    assert (await get_view(url)).slots is None

    def forming():
        raise NoRoot("no root elected")

    url, _ = await start(route=forming)
    assert (await get_view(url)).slots is None
    url, _ = await start(route=lambda: None)  # this node is the root
    assert (await get_view(url)).slots is not None


async def test_metrics_count_the_decode_steps_of_four_requests_at_once_by_their_batch_size(start):
    url, engine = await start()
    seen: list[events.StepRecord] = []
    engine.bus.add_listener(lambda r: seen.append(r) if isinstance(r, events.StepRecord) else None)
    async with client(url) as c:
        answers = await asyncio.gather(*(c.completions.create(model="stories260K", prompt=p, max_tokens=24,
                                                              temperature=0) for p in PROMPTS))
    tokens = sum(a.usage.completion_tokens for a in answers)
    decode = [s.batch for s in seen if s.kind == "decode"]
    assert max(decode) > 1, f"the requests never shared a step: {decode}"
    # each answer's first token comes from its prefill, every later one from a decode step
    assert sum(decode) == tokens - len(answers)
    m = await scrape(url)
    assert m[("edgetp_steps_total", (("kind", "decode"),))] == len(decode)
    assert m[("edgetp_steps_total", (("kind", "prefill"),))] == sum(s.kind == "prefill" for s in seen)
    assert m[("edgetp_decode_batch_count", ())] == len(decode) and m[("edgetp_decode_batch_sum", ())] == sum(decode)
    for le in (1, 2, 3, 4):
        assert m[("edgetp_decode_batch_bucket", (("le", f"{le:.1f}"),))] == sum(b <= le for b in decode)
    assert m[("edgetp_batch_size", ())] == decode[-1]
    assert m[("edgetp_tokens_generated_total", ())] == tokens
    assert (m[("edgetp_slots_active", ())], m[("edgetp_queue_depth", ())]) == (0, 0)


async def test_a_prompt_answered_from_the_prefix_cache_counts_one_hit_and_the_tokens_usage_reports(start):
    url, _ = await start()
    async with client(url) as c:
        first = await c.completions.create(model="stories260K", prompt=LONG, max_tokens=8, temperature=0)
        again = await c.completions.create(model="stories260K", prompt=LONG, max_tokens=8, temperature=0)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0 and cached >= PREFILL_CHUNK
    m = await scrape(url)
    assert m[("edgetp_prefix_cache_hits_total", ())] == 1
    assert m[("edgetp_prefix_cached_tokens_total", ())] == cached
    view = (await get_view(url)).slots
    assert (view.prefix_hits, view.cached_tokens) == (1, cached)


async def test_a_prefix_hit_counts_once_per_request_whichever_records_carry_it(start):
    url, engine = await start()
    publish = engine.bus.publish
    publish(events.RequestRecord("a", "started", prompt_tokens=100, cached_tokens=64, slot=0))
    publish(events.RequestRecord("a", "finished", finish_reason="stop", prompt_tokens=100, completion_tokens=5,
                                 cached_tokens=64, slot=0))
    publish(events.RequestRecord("b", "started", prompt_tokens=50, slot=1))  # cold
    publish(events.RequestRecord("b", "finished", finish_reason="length", prompt_tokens=50, completion_tokens=9,
                                 slot=1))
    publish(events.RequestRecord("c", "started", prompt_tokens=80, slot=2))  # said only when it finished
    publish(events.RequestRecord("c", "finished", finish_reason="stop", prompt_tokens=80, cached_tokens=32,
                                 slot=2))
    # took 64 tokens from a free slot, then copied 128 more from a running one as it read its prompt
    publish(events.RequestRecord("d", "started", prompt_tokens=300, cached_tokens=64, slot=3))
    publish(events.RequestRecord("d", "finished", finish_reason="stop", prompt_tokens=300, completion_tokens=2,
                                 cached_tokens=192, slot=3))
    publish(events.StepRecord("prefill", 64, 120.0, active=1, queued=0))
    publish(events.StepRecord("decode", 3, 30.0, active=3, queued=0))
    publish(events.StepRecord("prefill", 32, 60.0, active=3, queued=0))  # not a decode: the batch gauge stays 3
    # one pass that carried 2 decode rows and a chunk: two records, one wall time, counted once
    publish(events.StepRecord("decode", 2, 50.0, active=3, queued=0, mixed=True))
    publish(events.StepRecord("prefill", 128, 50.0, active=3, queued=0, mixed=True))
    m = await scrape(url)
    assert m[("edgetp_prefix_cache_hits_total", ())] == 3
    assert m[("edgetp_prefix_cached_tokens_total", ())] == 64 + 32 + 192
    assert m[("edgetp_requests_total", (("finish_reason", "stop"),))] == 3
    assert m[("edgetp_batch_size", ())] == 2
    assert m[("edgetp_step_seconds_total", (("kind", "prefill"),))] == pytest.approx(0.18)
    assert m[("edgetp_step_seconds_total", (("kind", "decode"),))] == pytest.approx(0.03)
    assert m[("edgetp_step_seconds_total", (("kind", "mixed"),))] == pytest.approx(0.05)
    assert m[("edgetp_steps_total", (("kind", "prefill"),))] == 3


async def status(url: str) -> list[str]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "edgetp", "status", "--url", url,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    return out.decode().splitlines()


async def test_status_prints_the_slots_line_only_where_the_view_has_slots(start):
    url, _ = await start()
    async with client(url) as c:
        await c.completions.create(model="stories260K", prompt=LONG, max_tokens=4, temperature=0)
        again = await c.completions.create(model="stories260K", prompt=LONG, max_tokens=4, temperature=0)
    cached = again.usage.prompt_tokens_details.cached_tokens
    lines = await status(url)
    assert lines[1] == f"slots 0/{SLOTS} in use  queued 0  last batch 1  prefix hits 1 ({cached} cached tokens)"
    assert lines[2].startswith("node ")
    (node,) = (await get_view(url)).nodes  # a lone engine measures no speed: the view says 0, the table "-"
    assert node.speed == 0 and lines[3].split()[4] == "-", lines[3]
    forwarding, _ = await start(route=lambda: "http://127.0.0.1:9")
    assert not any(line.startswith("slots") for line in await status(forwarding))
