"""A client of a running cluster's API: find it, stream answers, read its per-token records.

Used by `edgetp ask`, `edgetp chat` and `edgetp status`. Failures are
ClientError subclasses whose `exit_code` the CLI returns:
3 no cluster found or reachable, 4 the key was refused, 5 the server failed.
"""

from __future__ import annotations

import asyncio
import json
import statistics
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import aiohttp
from aiohttp.http_exceptions import HttpProcessingError
from yarl import URL

from edgetp.cluster.discovery import PeerAdvert, browse, signature_error
from edgetp.cluster.membership import http_url
from edgetp.net import auth
from edgetp.net.httpauth import Credentials, ProofError, read_json
from edgetp import events


class ClientError(Exception):
    exit_code = 1


class NoCluster(ClientError):
    exit_code = 3


class KeyRefused(ClientError):
    exit_code = 4


class ServerError(ClientError):
    exit_code = 5


LOCAL_URL = "http://127.0.0.1:7711"  # `edgetp serve`'s default API address


async def find_url(url: str | None, key: bytes | None, seconds: float = 2.0,
                   interfaces: list[str] | None = None, local: str = LOCAL_URL) -> str:
    """The given URL, or a node found by mDNS (of our cluster when we hold its key), or else
    a daemon of this machine at `local` (where multicast is filtered or no interface carries it)."""
    if url:
        return checked_url(url)
    def ours(n: PeerAdvert) -> bool:
        return key is None or (n.cluster_id == auth.cluster_id(key) and signature_error(key, n) is None)  # no forgeries

    found = await browse(seconds, interfaces, wanted=ours)  # done ~0.5 s after the last node answers
    nodes = [n for n in found if ours(n)]
    if found and not nodes:
        raise KeyRefused(f"found {len(found)} edgetp node(s), none in the cluster of this key")
    if not nodes:
        if await _listening(local):
            return local
        raise NoCluster(f"no edgetp cluster found on the network, nor a node at {local}; "
                        "give --url or set EDGETP_URL")
    best = max(nodes, key=lambda n: (n.priority, n.speed, n.node_id))
    return http_url(best)


async def _listening(url: str, seconds: float = 1.0) -> bool:
    """Whether something accepts TCP connections at url's host and port (what answers is
    checked by the request that follows)."""
    parsed = URL(url)
    try:
        async with asyncio.timeout(seconds):
            _, writer = await asyncio.open_connection(parsed.host, parsed.port)
    except (OSError, TimeoutError):
        return False
    writer.close()
    await asyncio.gather(writer.wait_closed(), return_exceptions=True)
    return True


def checked_url(url: str) -> str:
    """`url` without its trailing slash, if it is an http(s)://HOST[:PORT] address; ClientError if not."""
    try:
        parsed = URL(url)
        ok = parsed.scheme in ("http", "https") and bool(parsed.host)
    except ValueError:
        ok = False
    if not ok:
        raise ClientError(f"--url {url!r} is not an address like http://HOST:PORT")
    return url.rstrip("/")


class NoRoom(ClientError):
    """The context has room for the prompt but not for max_tokens more (400, context_length_exceeded)."""


async def _check(resp: aiohttp.ClientResponse, url: str) -> None:
    if resp.status == 200:
        return
    try:
        error = (await read_json(resp))["error"]
        message = str(error["message"])
    except (KeyError, TypeError, ValueError, aiohttp.ClientError):  # not edgetp's (OpenAI's) error shape
        error, message = {}, f"HTTP {resp.status} {resp.reason or ''}".strip() + " (is it an edgetp API?)"
    if resp.status in (401, 403):
        raise KeyRefused(f"{url}: refused: {message}")
    if resp.status >= 500:
        raise ServerError(f"{url}: server error {resp.status}: {message}")
    if resp.status == 400 and error.get("code") == "context_length_exceeded" and error.get("param") == "max_tokens":
        raise NoRoom(f"{url}: {message}")
    raise ClientError(f"{url}: {message}")


async def stream_chat(url: str, messages: list[dict[str, str]], options: dict[str, Any],
                      creds: Credentials = Credentials()) -> AsyncIterator[tuple[str, str | None, str]]:
    """(text piece, finish_reason, request id) per SSE chunk of a streaming chat completion
    (finish_reason "context": the answer filled the node's context before max_tokens)."""
    async for piece in _stream(url, "/v1/chat/completions", {"messages": messages} | options, creds):
        yield piece


async def stream_completion(url: str, prompt: str, options: dict[str, Any],
                            creds: Credentials = Credentials()) -> AsyncIterator[tuple[str, str | None, str]]:
    """The same for a plain completion: the prompt as it is, no chat template (`ask --raw`)."""
    async for piece in _stream(url, "/v1/completions", {"prompt": prompt} | options, creds):
        yield piece


async def _stream(url: str, path: str, request: dict[str, Any],
                  creds: Credentials) -> AsyncIterator[tuple[str, str | None, str]]:
    """The answer's pieces. max_tokens is a cap, as in `ask --local`: where the prompt leaves less room
    in the context, the request goes again without it (the server then fills what room there is, and
    the finish reason "length" becomes "context": the context is full)."""
    try:
        async for piece in _stream_once(url, path, request, creds):
            yield piece
    except NoRoom:  # refused before any piece: nothing was passed on
        if "max_tokens" not in request:
            raise
        async for text, reason, rid in _stream_once(url, path, {k: v for k, v in request.items()
                                                                if k != "max_tokens"}, creds):
            yield text, "context" if reason == "length" else reason, rid


async def _stream_once(url: str, path: str, request: dict[str, Any],
                       creds: Credentials) -> AsyncIterator[tuple[str, str | None, str]]:
    body = json.dumps(request | {"stream": True}).encode()
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=600)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            headers = {"Content-Type": "application/json"} | await creds.headers(session, url, "POST", path, body)
            async with session.post(url + path, data=body, headers=headers) as resp:
                await _check(resp, url)
                done = False
                async for raw in resp.content:
                    line = raw.decode(errors="replace").strip()
                    if line == "data: [DONE]":
                        done = True
                    if not line.startswith("data: ") or done:
                        continue
                    for piece in _pieces(line[6:], url):
                        yield piece
                if not done:
                    raise ServerError(f"{url}: the answer ended without its end mark (data: [DONE]): "
                                      "is it an edgetp API?")
    except aiohttp.ClientConnectorError as exc:
        raise NoCluster(f"{url}: cannot connect ({exc.os_error or exc})") from None
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as exc:
        raise ServerError(f"{url}: the answer broke off ({exc})") from None
    except (aiohttp.ClientError, HttpProcessingError) as exc:  # HttpProcessingError: a line past 128 KiB, say
        raise ServerError(f"{url}: {type(exc).__name__}: {exc}") from None
    except ProofError as exc:
        raise KeyRefused(str(exc)) from None


def _pieces(data: str, url: str) -> list[tuple[str, str | None, str]]:
    """(text piece, finish_reason, request id) of each choice of one SSE chunk; ServerError if it is not
    an OpenAI stream chunk or it carries an error."""
    try:
        chunk = json.loads(data)
        if "error" in chunk:
            raise ServerError(f"{url}: {chunk['error'].get('message', 'error')}")
        out = []
        for choice in chunk.get("choices", []):
            text = choice["delta"].get("content") if "delta" in choice else choice.get("text")
            out.append((text or "", choice.get("finish_reason"), str(chunk["id"])))
        return out
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ServerError(f"{url}: a chunk of the answer is not OpenAI's ({type(exc).__name__}: {exc}): "
                          f"is it an edgetp API?") from None


async def get_json(url: str, path: str, creds: Credentials = Credentials()) -> Any:
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            async with session.get(url + path, headers=await creds.headers(session, url, "GET", path)) as resp:
                await _check(resp, url)
                return await read_json(resp)
    except aiohttp.ClientConnectorError as exc:
        raise NoCluster(f"{url}: cannot connect ({exc.os_error or exc})") from None
    except (aiohttp.ClientError, HttpProcessingError) as exc:
        raise ServerError(f"{url}{path}: {type(exc).__name__}: {exc}") from None
    except ValueError as exc:
        raise ServerError(f"{url}{path}: the answer is not JSON ({exc}): is it an edgetp API?") from None
    except ProofError as exc:
        raise KeyRefused(str(exc)) from None


async def cluster_view(url: str, creds: Credentials = Credentials()) -> dict[str, Any]:
    """GET /v1/cluster, checked to be a cluster view (events.ClusterView); ServerError if it is not."""
    view = await get_json(url, "/v1/cluster", creds)
    try:
        events.from_dict({**view, "type": "snapshot"})
    except (events.EventError, TypeError) as exc:
        raise ServerError(f"{url}/v1/cluster: not an edgetp cluster view ({exc})") from None
    return view


@dataclass
class TokenStats:
    """Per-token records of one request, from the event stream, and the record of its end."""

    records: list[events.TokenRecord] = field(default_factory=list)
    unread: str | None = None  # why the event stream could not be read, if it could not
    finished: events.RequestRecord | None = None  # published before the answer's last chunk is sent
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # set with `finished`

    def summary(self) -> str:
        if not self.records:
            return f"no per-token records: {self.unread}" if self.unread else "no per-token records arrived"
        totals = [r.total_ms for r in self.records]
        n = len(totals)
        decode = totals[1:] or totals
        q = statistics.quantiles(decode, n=20) if len(decode) >= 2 else [decode[0]] * 19
        compute, sync = sum(r.compute_ms for r in self.records), sum(r.sync_ms for r in self.records)
        lines = [f"{n} tokens, {len(decode) / (sum(decode) / 1000):.1f} tok/s decode | per token p50 "
                 f"{statistics.median(decode):.1f} ms, p95 {q[18]:.1f} ms | compute {compute:.0f} ms, "
                 f"sync {sync:.0f} ms ({100 * sync / max(compute + sync, 1e-9):.0f}%)"]
        steps = self.records[1:] or self.records  # the first step carries the whole prompt
        for name in sorted({name for r in steps for name in r.links}):
            sent = sum(r.links[name].sent for r in steps if name in r.links) / len(steps)
            got = sum(r.links[name].received for r in steps if name in r.links) / len(steps)
            lines.append(f"  link {name}: {sent:,.0f} B sent, {got:,.0f} B received per decoded token")
        if (f := self.finished) is not None:
            lines.append(f"  prompt {f.prompt_tokens} tokens, {f.cached_tokens} of them from the prefix cache"
                         + (f" | slot {f.slot}" if f.slot is not None else "") + f" | finished: {f.finish_reason}")
        return "\n".join(lines)


def _take(stats: TokenStats, pending: list, rid: str) -> None:
    for r in pending:
        if r.request_id != rid:
            continue
        if isinstance(r, events.TokenRecord):
            stats.records.append(r)
        elif r.state == "finished":
            stats.finished = r
            stats.ended.set()
    pending.clear()


async def watch_tokens(url: str, stats: TokenStats, request_id: asyncio.Future[str],
                       connected: asyncio.Event, creds: Credentials = Credentials()) -> None:
    """Collect the token records of one request (its id arrives once the answer starts), until its end."""
    ws_url = url.replace("http://", "ws://").replace("https://", "wss://") + "/v1/events"
    pending: list[events.TokenRecord | events.RequestRecord] = []
    try:
        async with aiohttp.ClientSession() as session, \
                session.ws_connect(ws_url, heartbeat=30,
                                   headers=await creds.headers(session, url, "GET", "/v1/events")) as ws:
            connected.set()
            async for msg in ws:
                if msg.type != aiohttp.WSMsgType.TEXT:
                    continue
                try:
                    record = events.from_dict(json.loads(msg.data))
                except (events.EventError, ValueError):
                    continue
                if isinstance(record, (events.TokenRecord, events.RequestRecord)):
                    pending.append(record)
                    if request_id.done():
                        _take(stats, pending, request_id.result())
                        if stats.ended.is_set():
                            return
    except aiohttp.WSServerHandshakeError as exc:
        stats.unread = f"the event stream refused this client (HTTP {exc.status}: it carries every prompt, " \
                       "so beyond the node's own machine it needs --key or an --api-key)" \
            if exc.status in (401, 403) else f"the event stream answered HTTP {exc.status} (is it an edgetp API?)"
        connected.set()  # no stats, but never a hang
    except (aiohttp.ClientError, ProofError) as exc:
        stats.unread = f"the event stream could not be read ({type(exc).__name__}: {exc})"
        connected.set()
