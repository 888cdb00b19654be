"""A node that is not the root forwards requests to it; these are the ways a root fails under a request.

Real servers on 127.0.0.1 (stories260K), asked through the `openai` client with its retries off (they
would hide a failure). What a failed root leaves behind is real too: a port nobody listens on (a
killed root refuses connections), and a listening socket nobody accepts on (a suspended root's
kernel still completes the handshake, then nothing answers). `route` and `live` stand for the
daemon's membership and change as its heartbeats would; the daemons themselves go through the same
failures in tests/test_daemon.py. Expected text: `generate` on the model, outside any server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

import aiohttp
import openai
import pytest
from aiohttp import web

from edgetp.model import sampling
from edgetp.model.generate import LocalRunner, generate
from edgetp.serve import api
from edgetp.serve.api import make_app, serving
from edgetp.serve.root import Engine

PROMPT = "Once upon a time"
TOKENS = 24


@pytest.fixture
def expected(stories) -> str:
    mf, tok = stories
    greedy = sampling.SamplingParams(temperature=0)
    return "".join(ev.text for ev in generate(LocalRunner(mf, 128), tok, tok.encode(PROMPT), greedy, TOKENS))


@pytest.fixture
async def member(stories):
    """member(route, live=None) -> base URL of a node holding the model that forwards as `route` says."""
    mf, tok = stories
    async with contextlib.AsyncExitStack() as stack:
        async def go(route, live=None):
            app = make_app(Engine(LocalRunner(mf, 128), tok, "stories260K"), route=route, live=live)
            return await stack.enter_async_context(serving(app))
        yield go


@pytest.fixture
def refusing() -> str:
    """The URL of a port nobody listens on: a killed root's."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def silent():
    """The URL of a socket that listens and never accepts: a suspended root's."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


class Cutting:
    """A root that reads each request and closes the connection without a byte of answer, as a root killed
    mid-answer does; with `dies`, it then stops listening too (the killed process's port refuses)."""

    def __init__(self, dies: bool) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.dies, self.requests, self.stop = dies, 0, threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        deadline = time.monotonic() + 30
        while not self.stop.is_set() and time.monotonic() < deadline:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(5)
                seen = b""
                while b"prompt" not in seen and len(seen) < 1 << 16:  # the body has arrived: the root is at work
                    seen += conn.recv(4096) or b"x" * (1 << 16)
                self.requests += 1
            if self.dies:
                break
        self.sock.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


@pytest.fixture
def cutting():
    made = []

    def make(dies: bool) -> Cutting:
        made.append(Cutting(dies))
        return made[-1]
    yield make
    for c in made:
        c.close()


WORDS = [f"w{i} " for i in range(10)]


@pytest.fixture(params=[0.25, 1.5], ids=["flowing", "first-token-after-the-loss"])
async def trickling(request):
    """The URL of a root that streams a completion of WORDS, one every 0.25 s (a slow cluster's tokens),
    the first after `request.param` s (a long prompt's prefill: its headers are sent, then nothing)."""
    first_s = request.param

    async def complete(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, word in enumerate(WORDS):
            await asyncio.sleep(first_s if i == 0 else 0.25)
            chunk = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "stories260K",
                     "choices": [{"index": 0, "text": word, "logprobs": None,
                                  "finish_reason": "length" if i == len(WORDS) - 1 else None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = socket.create_server(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        await runner.cleanup()


def until(seconds: float, then, before):
    """A membership whose answer changes `seconds` from now (a re-election, a loss)."""
    at = time.monotonic() + seconds

    def answer(*_):
        return then if time.monotonic() >= at else before
    return answer


async def ask(url: str, stream: bool) -> str:
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30) as client:
        answer = await client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=TOKENS,
                                                 temperature=0, stream=stream)
        if not stream:
            return answer.choices[0].text
        return "".join([chunk.choices[0].text async for chunk in answer])


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_to_a_killed_root_waits_for_the_next_root_and_gets_its_answer(member, refusing, expected,
                                                                                      stream):
    t0 = time.monotonic()  # before the membership's clock starts: the server's start is no part of the second
    url = await member(until(1.0, None, refusing))  # this node is elected 1 s from now
    assert await ask(url, stream) == expected
    assert time.monotonic() - t0 >= 1.0  # it followed the membership: not answered here before the election


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_whose_root_is_killed_before_answering_is_asked_again_of_the_next_root(
        member, cutting, expected, stream):
    """The root reads the request and dies: nothing reached the client, so the request moves. Before, a
    whole (not streamed) answer was a 502 and a stream a failed request."""
    root = cutting(dies=True)
    url = await member(until(1.0, None, root.url))  # this node is elected 1 s from now
    assert await ask(url, stream) == expected
    assert root.requests == 1


async def test_a_request_cut_by_two_roots_is_not_asked_a_third_time(member, cutting):
    """A request every root fails on is a 502 after its second cut answer, not carried from root to root."""
    root = cutting(dies=False)
    url = await member(lambda: root.url)
    with pytest.raises(openai.APIStatusError) as err:
        await ask(url, stream=False)
    assert err.value.status_code == 502 and "not asked a third time" in err.value.message, err.value.message
    assert root.requests == 2


async def test_a_root_refusing_with_no_other_elected_in_time_is_a_503_with_retry_after(member, refusing,
                                                                                     monkeypatch):
    monkeypatch.setattr(api, "FAILOVER_S", 1.0)
    url = await member(lambda: refusing)
    with pytest.raises(openai.APIStatusError) as err:
        await ask(url, stream=False)
    assert err.value.status_code == 503 and err.value.response.headers["Retry-After"] == "2"
    assert err.value.body["code"] == "root_unreachable" and "no other root was elected" in err.value.message


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_held_by_a_silent_root_moves_to_the_next_root_once_the_cluster_loses_it(
        member, silent, expected, stream):
    t0 = time.monotonic()  # before the membership's clock starts (a loaded run took 0.4 s to start the server)
    held = until(1.0, False, True)  # heartbeats unanswered: the root is lost 1 s from now, and this node elected
    url = await member(lambda: silent if held() else None, live=lambda target: target == silent and held())
    assert await ask(url, stream) == expected  # before: it waited on the silent root until the client gave up
    assert time.monotonic() - t0 >= 1.0


async def test_a_stream_that_flows_is_not_cut_when_its_roots_heartbeats_stop_reaching_the_cluster(member, trickling):
    """Only a root that also stopped sending is lost: here the membership loses the root 0.5 s into a
    stream that keeps flowing (a heartbeat gap, not a dead root). Before, the stream ended there with
    the lost-mid-answer error; and where the first token came after the loss (a prefill, or a slow
    start of the client: CI saw it) it did still, as only tokens counted as the root sending, not its
    headers."""
    url = await member(lambda: trickling, live=until(0.5, False, True))
    assert await ask(url, stream=True) == "".join(WORDS)


async def test_a_silent_root_still_in_the_cluster_keeps_the_request_waiting(member, silent):
    """Only the membership says a root is lost: a slow root is waited for (here until the client's timeout)."""
    url = await member(lambda: silent, live=lambda target: True)
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=2) as client:
        with pytest.raises(openai.APITimeoutError):
            await client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=TOKENS, temperature=0)


async def test_a_watcher_relayed_from_a_silent_root_is_told_and_let_go_once_the_cluster_loses_it(member, silent):
    """The dashboard at a node that is not the root watches the root's event stream through it."""
    held = until(1.0, False, True)  # the root is lost 1 s from now
    url = await member(lambda: silent, live=lambda target: target == silent and held())
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
        async with s.ws_connect(url + "/v1/events") as ws:
            said = await ws.receive_json(timeout=10)  # before: nothing, ever (the upgrade never answered)
            closed = await ws.receive(timeout=10)
    assert said["type"] == "cluster" and said["event"] == "error", said
    assert said["message"] == f"the root at {silent} was lost from the cluster"
    assert closed.type == aiohttp.WSMsgType.CLOSE and closed.data == aiohttp.WSCloseCode.GOING_AWAY
