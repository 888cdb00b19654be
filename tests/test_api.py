"""The HTTP API against a real server on 127.0.0.1 and a real engine (stories260K; SmolLM2 for two tests).

Expected texts come from `generate()` called directly on a second runner
over the same file, never from the server under test.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import re
import threading
import time

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from edgetp.model import gguf
from edgetp.model.generate import LocalRunner, generate
from edgetp.model.sampling import SamplingParams
from edgetp.model.tokenizer import Tokenizer
from edgetp import events
from edgetp.parallel import profile
from edgetp.serve.api import make_app, serving
from edgetp.serve.root import Engine

CTX = 256
TIMEOUT = aiohttp.ClientTimeout(total=60)


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    mf = gguf.open_model(smollm2_path)  # ~10 s: once for the module
    return mf, Tokenizer.from_metadata(mf.metadata)


@pytest.fixture
async def start():
    """start(mf, tok, name, **engine_kw) -> (base url, engine); every server stops at the end of the test."""
    async with contextlib.AsyncExitStack() as stack:
        async def go(mf, tok, name, *, ctx=CTX, runner=None, cluster_view=None, **kw):
            engine = Engine(runner or LocalRunner(mf, ctx), tok, name, **kw)
            url = await stack.enter_async_context(serving(make_app(engine, cluster_view=cluster_view)))
            return url, engine
        yield go


@pytest.fixture
async def server(start, stories):
    return await start(*stories, "stories260K", queue_size=4)


def direct(mf, tok, ids, max_tokens, ctx=CTX):
    """The greedy answer from generate() itself, on a runner of its own: (text, finish reason, tokens)."""
    evs = list(generate(LocalRunner(mf, ctx), tok, ids, SamplingParams(temperature=0), max_tokens))
    return "".join(e.text for e in evs), evs[-1].finish_reason, len(evs)


def chat_ids(tok, messages):
    text = tok.apply_chat_template(messages, add_generation_prompt=True)
    return tok.encode(text, add_special=not tok.starts_with_bos(text), parse_special=True)


def client(url):
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)


# --------------------------------------------------------------------------- the openai client


async def test_greedy_completion_through_the_openai_client_equals_generate_streaming_or_not(server, stories):
    url, _ = server
    mf, tok = stories
    want, reason, n = direct(mf, tok, tok.encode("Once upon a time", add_special=True), 40)
    async with client(url) as c:
        got = await c.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=40,
                                         temperature=0)
        assert got.choices[0].text == want
        assert got.choices[0].finish_reason == "length" == reason
        assert got.usage.completion_tokens == n == 40
        assert got.usage.prompt_tokens == len(tok.encode("Once upon a time", add_special=True))
        stream = await c.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=40,
                                            temperature=0, stream=True)
        pieces, finishes = [], []
        async for chunk in stream:
            pieces.append(chunk.choices[0].text)
            finishes.append(chunk.choices[0].finish_reason)
    assert "".join(pieces) == want
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}


async def test_greedy_chat_through_the_openai_client_equals_generate_on_the_chatml_fallback(server, stories):
    url, _ = server
    mf, tok = stories
    messages = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "A cat."}]
    want, _, n = direct(mf, tok, chat_ids(tok, messages), 30)
    async with client(url) as c:
        got = await c.chat.completions.create(model="stories260K", messages=messages, max_tokens=30, temperature=0)
        assert got.choices[0].message.content == want
        assert got.choices[0].message.role == "assistant"
        assert got.usage.completion_tokens == n
        assert got.usage.total_tokens == got.usage.prompt_tokens + n == len(chat_ids(tok, messages)) + n
        stream = await c.chat.completions.create(model="stories260K", messages=messages, max_tokens=30,
                                                 temperature=0, stream=True, stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n
    assert chunks[-2].choices[0].finish_reason == "length"


async def test_smollm2_chat_answer_through_the_openai_client_equals_generate_and_stops_at_its_end_token(
        start, smollm2):
    mf, tok = smollm2
    url, _ = await start(mf, tok, "smollm2", ctx=512)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    want, reason, n = direct(mf, tok, chat_ids(tok, messages), 48, ctx=512)
    assert reason == "stop", "the reference answer should end on its own within 48 tokens"
    async with client(url) as c:
        got = await c.chat.completions.create(model="smollm2", messages=messages, max_tokens=48, temperature=0)
    assert got.choices[0].message.content == want
    assert "Paris" in want
    assert got.choices[0].finish_reason == "stop"
    assert got.usage.completion_tokens == n


async def test_a_stop_string_ends_the_answer_with_finish_reason_stop(server, stories):
    url, _ = server
    mf, tok = stories
    want, _, _ = direct(mf, tok, tok.encode("Once upon a time", add_special=True), 40)
    word = "Lily"
    assert word in want
    async with client(url) as c:
        got = await c.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=40,
                                         temperature=0, stop=[word])
    assert got.choices[0].finish_reason == "stop"
    assert word not in got.choices[0].text
    assert want.startswith(got.choices[0].text)


# --------------------------------------------------------------------------- SSE framing


async def raw_post(url, path, body: bytes) -> tuple[bytes, bytes]:
    """An HTTP/1.0 POST over a bare socket (no chunked encoding): (head, body) exactly as sent."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(f"POST {path} HTTP/1.0\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(-1), 30)
    finally:
        writer.close()
        await writer.wait_closed()
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


async def test_the_event_stream_is_data_lines_separated_by_blank_lines_ending_with_done(server):
    url, _ = server
    body = json.dumps({"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    head, raw = await raw_post(url, "/v1/completions", body)
    assert head.startswith(b"HTTP/1.0 200") or head.startswith(b"HTTP/1.1 200")
    assert b"\r\nContent-Type: text/event-stream" in head
    assert re.fullmatch(rb"(data: [^\n]+\n\n)+", raw), raw[:200]
    assert raw.endswith(b"\n\ndata: [DONE]\n\n")
    events_ = raw.split(b"\n\n")[:-1]
    assert events_[-1] == b"data: [DONE]"
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events_[:-1]]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    _, whole = await raw_post(url, "/v1/completions", json.dumps(
        {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}).encode())
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == json.loads(whole)["choices"][0]["text"]


# --------------------------------------------------------------------------- load, memory, disconnects


async def test_32_concurrent_clients_with_a_queue_of_4_are_each_answered_or_refused_with_429(server):
    url, engine = server
    body = {"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0}

    async def one(session):
        async with session.post(url + "/v1/completions", json=body) as r:
            return r.status, r.headers.get("Retry-After"), await r.json()

    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        results = await asyncio.wait_for(asyncio.gather(*(one(s) for _ in range(32))), 60)
    statuses = [st for st, _, _ in results]
    assert set(statuses) <= {200, 429}
    assert 4 <= statuses.count(200) < 32, statuses  # the queue (4) holds at least that many
    for st, retry, payload in results:
        if st == 429:
            assert int(retry) >= 1
            assert payload["error"]["code"] == "rate_limit_exceeded" and "busy" in payload["error"]["message"]
        else:
            assert payload["usage"]["completion_tokens"] == 32
    assert engine.queue_depth == 0 and not engine.busy


def rss_bytes() -> int:
    return profile.runtime_bytes()  # from the page tables: statm's counters are per-CPU batched, inexact


async def test_memory_threads_and_tasks_stay_flat_over_200_short_requests(server):
    url, engine = server
    body = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        async def batch(n):
            for _ in range(n):
                async with s.post(url + "/v1/completions", json=body) as r:
                    assert r.status == 200
                    await r.read()
        await batch(50)  # warm-up: allocator arenas, aiohttp buffers, numba dispatch
        gc.collect()
        rss0, threads0, tasks0 = rss_bytes(), threading.active_count(), len(asyncio.all_tasks())
        await batch(200)
        gc.collect()
        grown = rss_bytes() - rss0
    # Measured: ~12 KB. Leaking one request's state (job, its queue, events, request and response objects,
    # some KB) would add >= 1 MB over 200 requests; pymalloc arena noise stays well under it.
    assert grown < 2**20, f"RSS grew by {grown / 2**20:.2f} MB over 200 requests"
    assert threading.active_count() == threads0
    assert len(asyncio.all_tasks()) <= tasks0
    assert engine.bus.subscribers == 0 and engine.queue_depth == 0


async def test_a_client_closing_mid_stream_stops_its_generation_and_frees_the_engine(start, smollm2):
    mf, tok = smollm2
    url, engine = await start(mf, tok, "smollm2", ctx=512)
    sub = engine.bus.subscribe()
    body = {"prompt": "Once upon a time, in a city by the sea,", "max_tokens": 200, "temperature": 0,
            "stream": True}
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        r = await s.post(url + "/v1/completions", json=body)
        seen = 0
        async for line in r.content:
            seen += line.startswith(b"data: ")
            if seen == 3:
                break
        r.close()  # the client goes away
        t0 = time.perf_counter()
        async with s.post(url + "/v1/completions", json=body | {"max_tokens": 2, "stream": False}) as r2:
            assert r2.status == 200
            await r2.read()
        waited = time.perf_counter() - t0
    finished = []
    while len(finished) < 2:
        rec = await asyncio.wait_for(sub.__anext__(), 10)
        if isinstance(rec, events.RequestRecord) and rec.state == "finished":
            finished.append(rec)
    sub.close()
    assert finished[0].finish_reason == "cancelled"
    assert finished[0].completion_tokens < 200
    # the whole 200 tokens would take ~13 s on this machine; the next request must not wait for them
    assert waited < 3.0, f"the next request waited {waited:.1f} s"


async def test_clients_gone_before_their_stream_starts_end_quietly_and_free_everything(server, caplog):
    # a streamed request whose client closes the socket as it is sent: the response's headers then fail
    # to go out (resp.prepare). That is a client leaving, as mid-stream, not a server error with a
    # traceback in the log (a probe: 324 of 480 such requests logged one)
    url, engine = server
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 8, "stream": True}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body

    async def leave(delay: float) -> None:
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(request)
        await writer.drain()
        await asyncio.sleep(delay)
        writer.transport.abort()  # a reset, as a client killed mid-request

    with caplog.at_level(logging.ERROR):
        for _ in range(4):
            await asyncio.gather(*(leave(i / 3000) for i in range(12)))
            await asyncio.sleep(0.2)
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            async with s.post(url + "/v1/completions", json={"prompt": "Once", "max_tokens": 2}) as r:
                assert r.status == 200
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], errors[:3]
    for _ in range(50):  # every job of those clients ends (cancelled at its next token)
        if not engine._running and not engine._waiting:
            break
        await asyncio.sleep(0.1)
    assert not engine._running and not engine._waiting


async def test_a_server_stopping_answers_its_running_and_queued_requests_that_it_is_shutting_down(smollm2):
    # the engine stopped last used to generate on while aiohttp waited its shutdown_timeout for the
    # handlers, then cut every client off with no answer (a probe: SIGTERM, 10 s, ServerDisconnected)
    mf, tok = smollm2
    engine = Engine(LocalRunner(mf, 512), tok, "smollm2", queue_size=4)
    body = {"prompt": "Once upon a time, in a city by the sea,", "max_tokens": 400, "temperature": 0}
    server = serving(make_app(engine), shutdown_timeout=5.0)
    url = await server.__aenter__()
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            streamed = await s.post(url + "/v1/completions", json=body | {"stream": True})
            assert (await streamed.content.readline()).startswith(b"data: ")  # it runs
            queued = asyncio.create_task(s.post(url + "/v1/completions", json=body))  # waits behind it
            await asyncio.sleep(0.5)
            closing, server = asyncio.create_task(server.__aexit__(None, None, None)), None
            rest = (await streamed.content.read()).decode()
            answer = await queued
            assert answer.status == 503 and "shutting down" in (await answer.json())["error"]["message"]
            events_ = [line.removeprefix("data: ") for line in rest.splitlines() if line.startswith("data: ")]
            assert "shutting down" in events_[-1] and "[DONE]" not in events_, events_[-3:]
            await closing
    finally:
        if server is not None:
            await server.__aexit__(None, None, None)


async def test_a_request_that_leaves_while_queued_gives_its_place_back(server):
    url, engine = server
    body = {"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0}

    async def until(cond):
        for _ in range(400):
            if cond():
                return True
            await asyncio.sleep(0.005)
        return False

    async def post(s):
        async with s.post(url + "/v1/completions", json=body) as r:
            return r.status

    async with aiohttp.ClientSession(timeout=TIMEOUT) as s, asyncio.TaskGroup() as tg:
        first = tg.create_task(post(s))
        assert await until(lambda: engine.busy)
        queued = [tg.create_task(post(s)) for _ in range(4)]
        assert await until(lambda: engine.queue_depth == 4)
        for q in queued:
            q.cancel()
        assert await until(lambda: engine.queue_depth == 0)
        assert engine.busy  # the first one still runs
    assert first.result() == 200


# --------------------------------------------------------------------------- bad input


BAD = [
    ("/v1/chat/completions", b'{"messages": [', "not valid JSON"),
    ("/v1/chat/completions", b'[1, 2]', "must be a JSON object"),
    ("/v1/chat/completions", {"messages": "hello"}, "'messages' must be an array"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "10"},
     "'max_tokens' must be an integer"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
     "'temperature' must be a number"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": "yes"},
     "'stream' must be a boolean"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("/v1/completions", {"prompt": "hi", "stop": 5}, "'stop' must be a string or an array"),
    ("/v1/completions", {"prompt": 3.5}, "'prompt' must be a string"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, "'max_tokens' is -5; it must be at least 1"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, "at most"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p must be in (0, 1]"),
    ("/v1/completions", {"prompt": "once upon a time " * 200}, "but the context holds 256"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "once upon a time " * 200}]},
     "but the context holds 256"),
    ("/v1/chat/completions", {"messages": []}, "'messages' is empty"),
    # what json.loads cannot take: nesting past Python's recursion limit, an integer past its 4300 digits
    ("/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    ("/v1/completions", b'{"prompt": "hi", "top_k": ' + b"9" * 5000 + b"}", "not valid JSON"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"\u00b2": 5}}, "'logit_bias' keys are token ids"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"9" * 5000: 5}}, "'logit_bias' keys are token ids"),
    # JSON's \u escapes can spell half of a UTF-16 pair, which is no character (json.dumps writes \ud83d)
    ("/v1/completions", {"prompt": "abc\ud83d"}, "'prompt' holds a lone UTF-16 surrogate (U+D83D"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]},
     "'messages[0].content' holds a lone UTF-16 surrogate"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**9},
     "'max_completion_tokens' is 1000000000 but the context holds"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4,
                              "max_tokens": "bad"}, "'max_tokens' must be an integer"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"},
     "'tool_choice' is not supported"),
    ("/v1/completions", {"prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}},
     "'stream_options.include_usage' must be a boolean"),
]


@pytest.mark.parametrize("path,body,says", BAD, ids=[b[2] for b in BAD])
async def test_each_bad_request_gets_a_400_in_openais_error_shape_with_a_clear_message(server, path, body, says):
    url, engine = server
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        async with s.post(url + path, data=data, headers={"Content-Type": "application/json"}) as r:
            text = await r.text()
            assert r.status == 400, text
    err = json.loads(text)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert says in err["message"]
    assert err["param"] is None or err["param"] in err["message"]  # the field the message names
    assert "Traceback" not in text
    assert not engine.busy and engine.queue_depth == 0


async def test_a_body_that_does_not_follow_its_content_encoding_is_a_400_and_the_next_request_is_served(server):
    url, engine = server
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        async with s.post(url + "/v1/completions", data=b"this is not gzip",
                          headers={"Content-Type": "application/json", "Content-Encoding": "gzip"}) as r:
            text = await r.text()
            assert r.status == 400, text
            assert r.headers.get("Connection", "").lower() == "close"  # the stream past the body is broken
        assert "the request body could not be read" in json.loads(text)["error"]["message"]
        async with s.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}) as r:
            assert r.status == 200, await r.text()


async def test_the_openai_client_raises_not_found_for_an_unknown_model_as_openais_api_does(server):
    url, _ = server
    async with client(url) as c:
        with pytest.raises(openai.NotFoundError, match="the model 'nope' does not exist") as caught:
            await c.completions.create(model="nope", prompt="hi", max_tokens=2)
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            await c.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["code"] == "model_not_found" and caught.value.body["param"] == "model"


async def test_an_unexpected_server_error_is_a_500_in_openais_shape_without_a_traceback(start, stories):
    def broken() -> events.ClusterView:
        raise RuntimeError("secret internals")

    url, _ = await start(*stories, "stories260K", cluster_view=broken)
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        async with s.get(url + "/v1/cluster") as r:
            text = await r.text()
            assert r.status == 500
    assert json.loads(text)["error"]["type"] == "server_error"
    assert "secret" not in text and "Traceback" not in text


async def test_a_failing_runner_ends_the_request_with_a_500_and_frees_the_engine(start, stories):
    mf, tok = stories

    class Failing(LocalRunner):
        def decode(self, rows):  # the prompt goes through, the first decode step fails
            raise RuntimeError("worker lost")

    url, engine = await start(mf, tok, "stories260K", runner=Failing(mf, CTX))
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        async with s.post(url + "/v1/completions", json={"prompt": "Once", "max_tokens": 8}) as r:
            assert r.status == 500
            assert "worker lost" in (await r.json())["error"]["message"]
    assert not engine.busy


# --------------------------------------------------------------------------- models, cluster, metrics, events


async def test_models_and_cluster_describe_the_loaded_model_and_the_single_node(server, stories):
    url, _ = server
    mf, _ = stories
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        async with s.get(url + "/v1/models") as r:
            assert [m["id"] for m in (await r.json())["data"]] == ["stories260K"]
        async with s.get(url + "/v1/cluster") as r:
            view = events.from_dict(await r.json())
    assert view.model == "stories260K" and len(view.nodes) == 1
    node = view.nodes[0]
    assert node.role == "root" and node.state == "ready"
    assert node.vocab_rows == (0, mf.config.vocab) and node.ffn_cols == (0, mf.config.ffn)


async def test_metrics_parse_as_prometheus_text_and_count_the_tokens_generated(server):
    url, _ = server
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        total = 0
        for n in (3, 7, 11):
            async with s.post(url + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": n}) as r:
                total += (await r.json())["usage"]["completion_tokens"]
        async with s.get(url + "/metrics") as r:
            assert r.headers["Content-Type"].startswith("text/plain")
            text = await r.text()
    samples = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels}
    assert samples["edgetp_tokens_generated_total"] == total
    assert samples["edgetp_request_seconds_count"] == 3
    assert samples["edgetp_token_seconds_count"] == total
    assert samples["edgetp_queue_depth"] == 0
    assert samples["edgetp_replans_total"] == 0 and samples["edgetp_elections_total"] == 0


async def test_cluster_events_on_the_bus_count_replans_and_elections(server):
    url, engine = server
    engine.bus.publish(events.ClusterEvent("replan", "node b joined", epoch=2))
    engine.bus.publish(events.ClusterEvent("election", "a is root", epoch=3))
    engine.bus.publish(events.ClusterEvent("replan", "node b left", epoch=4))
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        async with s.get(url + "/metrics") as r:
            text = await r.text()
    samples = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert samples["edgetp_replans_total"] == 2 and samples["edgetp_elections_total"] == 1


async def test_the_event_websocket_sends_a_snapshot_then_one_token_record_per_generated_token(server):
    url, _ = server
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        async with s.ws_connect(url + "/v1/events") as ws:
            snapshot = events.from_dict(await ws.receive_json(timeout=10))
            assert isinstance(snapshot, events.ClusterView) and snapshot.model == "stories260K"
            async with s.post(url + "/v1/completions",
                              json={"prompt": "Once upon a time", "max_tokens": 9, "temperature": 0}) as r:
                answer = await r.json()
            records = []
            while not (records and isinstance(records[-1], events.RequestRecord) and records[-1].state == "finished"):
                records.append(events.from_dict(await ws.receive_json(timeout=10)))
    rid = answer["id"]
    assert records[0] == events.RequestRecord(rid, "started", "Once upon a time",
                                              prompt_tokens=answer["usage"]["prompt_tokens"], slot=0)
    steps = [r for r in records if isinstance(r, events.StepRecord)]
    assert [(s.kind, s.batch) for s in steps] == [("prefill", answer["usage"]["prompt_tokens"])] + [("decode", 1)] * 8
    tokens = [r for r in records if isinstance(r, events.TokenRecord)]
    assert [t.index for t in tokens] == list(range(9))
    assert {t.request_id for t in tokens} == {rid}
    assert "".join(t.text for t in tokens) == answer["choices"][0]["text"]
    assert all(t.total_ms > 0 and t.sync_ms == 0 and t.compute_ms == t.total_ms for t in tokens)
    assert records[-1].completion_tokens == 9 and records[-1].finish_reason == "length"


async def test_a_node_that_cannot_plan_answers_503_saying_why_and_the_next_request_is_tried_afresh(server, stories):
    url, engine = server
    mf, tok = stories
    cause = ["no plan fits: node pi-3 has 12 MB free, its smallest share needs 40 MB"]

    async def between():  # what the daemon's re-plan does before each request
        if cause:
            raise RuntimeError(cause[0])

    engine.between = between
    body = {"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 5, "temperature": 0}
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        async with s.post(url + "/v1/completions", json=body) as r:
            answer = await r.json()
            assert r.status == 503 and r.headers["Retry-After"].isdigit()
            assert answer["error"]["code"] == "unavailable" and "pi-3 has 12 MB free" in answer["error"]["message"]
        assert engine.health() is not None
        cause.clear()
        async with s.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200
            assert (await r.json())["choices"][0]["text"] == direct(mf, tok, tok.encode("Once upon a time", add_special=True), 5)[0]
    assert engine.health() is None
