"""Who may call a node's HTTP API (serve/api.py `_access`, net/httpauth.py), against real servers on 127.0.0.1.

"Beyond loopback" is a real bind to 0.0.0.0 (tests still only send to 127.0.0.1).
Key proofs are computed here from the documented wire format with hmac/hashlib,
not with the code under test; the OpenAI client is the real `openai` package.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging

import aiohttp
import openai
import pytest
from aiohttp import web

from edgetp import client
from edgetp.model.generate import LocalRunner
from edgetp.net import auth, httpauth
from edgetp.serve.api import GATE, make_app, serving
from edgetp.serve.root import Engine

TOKEN = "tok-0123456789abcdef"
TIMEOUT = aiohttp.ClientTimeout(total=60)
ASK = {"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}


@pytest.fixture
async def node(stories):
    """node(host, key=..., tokens=..., route=...) -> base URL on 127.0.0.1; all stop at the end of the test."""
    mf, tok = stories
    async with contextlib.AsyncExitStack() as stack:
        async def go(host="0.0.0.0", *, key=None, tokens=(), route=None, extra=None):
            app = make_app(Engine(LocalRunner(mf, 128), tok, "stories260K"), key=key, tokens=tokens, route=route)
            if extra:
                extra(app)
            url = await stack.enter_async_context(serving(app, host, 0))
            return "http://127.0.0.1:" + url.rsplit(":", 1)[1]
        yield go


def proof(key: bytes, method: str, path_qs: str, body: bytes, nonce: str) -> str:
    """The documented proof, written out independently of net/httpauth.py."""
    parts = [b"edgetp-http-2", method.encode(), path_qs.encode(), hashlib.sha256(body).digest(), nonce.encode()]
    return hmac.new(key, b"".join(len(p).to_bytes(4, "big") + p for p in parts), hashlib.sha256).hexdigest()


async def nonce(s: aiohttp.ClientSession, url: str) -> str:
    async with s.get(url + "/v1/auth/challenge") as r:
        assert r.status == 200
        return (await r.json())["nonce"]


async def post(s, url, path="/v1/completions", body=None, headers=None):
    data = json.dumps(body or ASK).encode() if not isinstance(body, bytes) else body
    async with s.post(url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})}) as r:
        return r.status, await r.json(), r.headers


async def test_with_tokens_the_openai_api_wants_a_bearer_token_and_the_openai_client_sends_it(node):
    url = await node(tokens=(TOKEN,))
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        status, body, headers = await post(s, url)
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        assert "missing API token" in body["error"]["message"] and headers["WWW-Authenticate"].startswith("Bearer")
        status, body, _ = await post(s, url, headers={"Authorization": "Bearer wrong-token-0123456789"})
        assert status == 401 and "invalid API token" in body["error"]["message"]
        status, body, _ = await post(s, url, headers={"Authorization": f"Bearer {TOKEN}"})
        assert status == 200 and body["usage"]["completion_tokens"] == 4
        for path in ("/v1/models", "/v1/cluster", "/metrics"):
            async with s.get(url + path) as r:
                assert r.status == 401, path

    def ask(api_key):
        c = openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0)
        return c.completions.create(**ASK).choices[0].text

    good = await asyncio.to_thread(ask, TOKEN)
    assert good
    with pytest.raises(openai.AuthenticationError):
        await asyncio.to_thread(ask, "not-the-token-at-all")


async def test_events_need_the_key_or_a_token_beyond_loopback_and_nothing_on_loopback(node):
    key = auth.generate_key()
    public, local = await node(key=key, tokens=(TOKEN,)), await node("127.0.0.1", key=key)
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await s.ws_connect(public + "/v1/events")
        assert refused.value.status == 401
        n = await nonce(s, public)
        for headers in ({"Authorization": f"Bearer {TOKEN}"},
                        {"X-Edgetp-Nonce": n, "X-Edgetp-Proof": proof(key, "GET", "/v1/events", b"", n)}):
            async with s.ws_connect(public + "/v1/events", headers=headers) as ws:
                assert "nodes" in await ws.receive_json(timeout=10)  # the snapshot comes first
        async with s.ws_connect(local + "/v1/events") as ws:
            assert "nodes" in await ws.receive_json(timeout=10)


async def test_ask_stats_says_why_it_has_no_records_when_the_event_stream_refuses_it(node):
    """`edgetp ask --stats` without a key, of a node beyond loopback: the answer streams (the API is
    open), the per-token records cannot (the event stream carries every prompt). It said 'no per-token
    records arrived', as if none were made."""
    url = await node()
    stats, rid, watching = client.TokenStats(), asyncio.get_running_loop().create_future(), asyncio.Event()
    await asyncio.wait_for(client.watch_tokens(url, stats, rid, watching), 30)
    assert watching.is_set() and not stats.records
    assert stats.summary().startswith("no per-token records: the event stream refused this client (HTTP 401")
    assert "--key" in stats.summary()


async def test_tokens_set_on_a_loopback_node_are_asked_for_there_too(node):
    """Loopback alone opens a node to its own machine's users only while no tokens are set: whoever sets
    api_tokens means them (another user of a shared machine, a developer testing a client's auth)."""
    local = await node("127.0.0.1", tokens=(TOKEN,))
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        assert (await post(s, local))[0] == 401
        status, body, _ = await post(s, local, headers={"Authorization": f"Bearer {TOKEN}"})
        assert status == 200 and body["usage"]["completion_tokens"] == 4
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await s.ws_connect(local + "/v1/events")
        assert refused.value.status == 401
        async with s.get(local + "/v1/models") as r:
            assert r.status == 401


async def test_without_tokens_beyond_loopback_the_api_warns_once_and_still_refuses_events(node, caplog):
    with caplog.at_level(logging.WARNING, logger="edgetp.serve.api"):
        url = await node()
    assert sum("OPEN TO THE NETWORK" in r.getMessage() for r in caplog.records) == 1
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        assert (await post(s, url))[0] == 200  # existing clients keep working
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await s.ws_connect(url + "/v1/events")
        assert refused.value.status == 401
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="edgetp.serve.api"):
        await node("127.0.0.1")
    assert not [r for r in caplog.records if "OPEN TO THE NETWORK" in r.getMessage()]


async def test_a_key_proof_is_good_once_for_that_request_only(node):
    key = auth.generate_key()
    seen = []

    async def change(request):  # a cluster endpoint checks the proof itself, through the node's one gate
        try:
            seen.append(await request.app[GATE].verify(request))
        except httpauth.ProofError as exc:
            raise web.HTTPUnauthorized(text=str(exc))
        return web.json_response({"ok": True})

    url = await node(key=key, tokens=(TOKEN,), extra=lambda app: app.router.add_post("/v1/cluster/change", change))
    keyless = await node(extra=lambda app: app.router.add_post("/v1/cluster/change", change))
    body = b'{"x": 1}'
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        n = await nonce(s, url)
        good = {"X-Edgetp-Nonce": n, "X-Edgetp-Proof": proof(key, "POST", "/v1/cluster/change", body, n)}
        assert (await post(s, url, "/v1/cluster/change", body, good))[0] == 200
        assert (await post(s, url, "/v1/cluster/change", body, good))[0] == 401  # replayed
        n = await nonce(s, url)
        tampered = {"X-Edgetp-Nonce": n, "X-Edgetp-Proof": proof(key, "POST", "/v1/cluster/change", body, n)}
        assert (await post(s, url, "/v1/cluster/change", b'{"x": 2}', tampered))[0] == 401
        n = await nonce(s, url)
        forged = {"X-Edgetp-Nonce": n, "X-Edgetp-Proof": proof(auth.generate_key(), "POST", "/v1/cluster/change",
                                                               body, n)}
        assert (await post(s, url, "/v1/cluster/change", body, forged))[0] == 401
        made_up = {"X-Edgetp-Nonce": "f" * 32, "X-Edgetp-Proof": proof(key, "POST", "/v1/cluster/change", body, "f" * 32)}
        assert (await post(s, url, "/v1/cluster/change", body, made_up))[0] == 401  # a nonce it never issued
        status, answer, _ = await post(s, keyless, "/v1/cluster/change", body, good)
        assert status == 403 and answer["error"]["code"] == "no_cluster_key"
        # a key proof also opens the OpenAI API of a node that has tokens (how members forward)
        n = await nonce(s, url)
        data = json.dumps(ASK).encode()
        member = {"X-Edgetp-Nonce": n, "X-Edgetp-Proof": proof(key, "POST", "/v1/completions", data, n)}
        assert (await post(s, url, "/v1/completions", data, member))[0] == 200
    assert seen == [body]


async def test_a_node_forwards_with_its_own_key_proof_and_stops_a_forwarding_loop(node):
    key = auth.generate_key()
    root = await node(key=key, tokens=(TOKEN,))
    member = await node(key=key, tokens=(TOKEN,), route=lambda: root)
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        status, body, _ = await post(s, member, headers={"Authorization": f"Bearer {TOKEN}"})
        assert status == 200 and body["usage"]["completion_tokens"] == 4
        assert (await post(s, member))[0] == 401  # the member checks the caller before it forwards
        status, body, _ = await post(s, member, headers={"Authorization": f"Bearer {TOKEN}", "X-Edgetp-Hops": "2"})
        assert status == 508 and body["error"]["code"] == "forward_loop"


async def test_a_watcher_of_a_node_that_is_not_the_root_sees_the_roots_tokens(node):
    from edgetp import events  # noqa: PLC0415

    key = auth.generate_key()
    root = await node(key=key, tokens=(TOKEN,))
    member = await node("127.0.0.1", key=key, route=lambda: root)
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        async with s.ws_connect(member + "/v1/events") as ws:  # loopback: no credentials needed at the member
            first = events.from_dict(await ws.receive_json(timeout=10))
            assert isinstance(first, events.ClusterView)
            status, answer, _ = await post(s, member)  # forwarded to the root, which makes the tokens
            assert status == 200
            tokens = []
            while len(tokens) < answer["usage"]["completion_tokens"]:
                record = events.from_dict(await ws.receive_json(timeout=10))
                if isinstance(record, events.TokenRecord):
                    tokens.append(record)
    assert {t.request_id for t in tokens} == {answer["id"]}
    assert "".join(t.text for t in tokens) == answer["choices"][0]["text"]
