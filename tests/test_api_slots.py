"""Slots, batch sizes and prefix hits in /v1/cluster, the event stream's snapshot and /metrics.

A real server on 127.0.0.1 over a real engine (stories260K). Step and request records are
published on the engine's bus as the batching engine publishes them; the expected figures are
counted from the records the test publishes, not read back from the code under test.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from edgetp import events
from edgetp.model import gguf
from edgetp.model.generate import LocalRunner
from edgetp.model.tokenizer import Tokenizer
from edgetp.serve.api import NoRoot, make_app, serving
from edgetp.serve.root import Engine

CTX = 128
TIMEOUT = aiohttp.ClientTimeout(total=60)


class SlottedEngine(Engine):
    """Today's engine with the slots report a batching engine gives: four slots, its own queue."""

    def slots_view(self) -> events.SlotsView:
        return events.SlotsView(4, int(self.busy), self.queue_depth, batch=3, prefix_hits=2, cached_tokens=96)


@pytest.fixture(scope="module")
def stories(stories_path):
    mf = gguf.open_model(stories_path)
    return mf, Tokenizer.from_metadata(mf.metadata)


@pytest.fixture
async def start(stories):
    """start(engine class, route=None) -> (url, engine); every server stops at the end of the test."""
    mf, tok = stories
    async with contextlib.AsyncExitStack() as stack:
        async def go(cls=Engine, route=None):
            engine = cls(LocalRunner(mf, CTX), tok, "stories260K", queue_size=4)
            url = await stack.enter_async_context(serving(make_app(engine, route=route)))
            return url, engine
        yield go


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


async def test_an_engine_without_slots_reports_none_in_the_view_and_one_slot_in_metrics(start):
    url, _ = await start()
    assert (await get_view(url)).slots is None
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        async with s.post(url + "/v1/completions", json={"prompt": "Once", "max_tokens": 4}) as r:
            assert r.status == 200
    m = await scrape(url)
    assert m[("edgetp_slots_total", ())] == 1      # one generation at a time is one slot
    assert m[("edgetp_slots_active", ())] == 0     # and it is free again
    assert m[("edgetp_queue_depth", ())] == 0
    assert m[("edgetp_batch_size", ())] == 0       # this engine publishes no decode steps
    assert m[("edgetp_prefix_cache_hits_total", ())] == 0


async def test_the_root_serves_its_engines_slots_in_the_view_and_the_event_snapshot(start):
    url, engine = await start(SlottedEngine)
    want = events.SlotsView(4, 0, 0, batch=3, prefix_hits=2, cached_tokens=96)
    assert (await get_view(url)).slots == want
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        async with s.ws_connect(url + "/v1/events") as ws:
            snapshot = events.from_dict(await ws.receive_json(timeout=10))
    assert isinstance(snapshot, events.ClusterView) and snapshot.slots == want
    m = await scrape(url)
    assert (m[("edgetp_slots_total", ())], m[("edgetp_slots_active", ())], m[("edgetp_queue_depth", ())]) == (4, 0, 0)


async def test_a_node_that_forwards_to_another_root_shows_no_slots(start):
    url, _ = await start(SlottedEngine, route=lambda: "http://127.0.0.1:9")
    assert (await get_view(url)).slots is None

    def forming():
        raise NoRoot("no root elected")

    url, _ = await start(SlottedEngine, route=forming)
    assert (await get_view(url)).slots is None
    url, _ = await start(SlottedEngine, route=lambda: None)  # this node is the root
    assert (await get_view(url)).slots is not None


async def test_metrics_count_steps_by_kind_and_decode_steps_by_batch_size(start):
    url, engine = await start()
    steps = [("prefill", 64, 120.0), ("decode", 1, 20.0), ("decode", 2, 21.0), ("prefill", 32, 60.0),
             ("decode", 3, 22.0), ("decode", 8, 30.0), ("decode", 8, 30.0), ("decode", 5, 25.0)]
    for kind, batch, ms in steps:
        engine.bus.publish(events.StepRecord(kind, batch, ms, active=min(batch, 4), queued=0))
    m = await scrape(url)
    decode = [b for k, b, _ in steps if k == "decode"]
    assert m[("edgetp_steps_total", (("kind", "decode"),))] == len(decode) == 6
    assert m[("edgetp_steps_total", (("kind", "prefill"),))] == 2
    assert m[("edgetp_step_seconds_total", (("kind", "prefill"),))] == pytest.approx(0.18)
    assert m[("edgetp_batch_size", ())] == 5  # the last decode step's, not the last step's
    assert m[("edgetp_decode_batch_count", ())] == 6
    assert m[("edgetp_decode_batch_sum", ())] == sum(decode) == 27
    for le in (1, 2, 4, 8):
        assert m[("edgetp_decode_batch_bucket", (("le", f"{le:.1f}"),))] == sum(b <= le for b in decode)


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
    m = await scrape(url)
    assert m[("edgetp_prefix_cache_hits_total", ())] == 2
    assert m[("edgetp_prefix_cached_tokens_total", ())] == 64 + 32
    assert m[("edgetp_requests_total", (("finish_reason", "stop"),))] == 2


async def test_status_prints_the_slots_line_only_when_the_root_reports_slots(start):
    async def status(url: str) -> str:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "edgetp", "status", "--url", url,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        return out.decode()

    slotted, _ = await start(SlottedEngine)
    lines = (await status(slotted)).splitlines()
    assert lines[1] == "slots 0/4 in use  queued 0  last batch 3  prefix hits 2 (96 cached tokens)"
    assert lines[2].startswith("node ")
    plain, _ = await start()
    assert not any(line.startswith("slots") for line in (await status(plain)).splitlines())
