"""Where the dashboard's records come from, and how it asks the cluster a question.

`EventSource` yields records of `GET /v1/events` and `ConnectionStatus`
values; `WebSocketSource` is the real one, reconnecting by itself with a
bounded backoff, `ScriptedSource` plays a script for tests. `Asker` streams
an answer; `HttpAsker` posts to the OpenAI-compatible chat endpoint.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator, Iterable, Protocol, Sequence

import aiohttp

from edgetp.net.httpauth import Credentials, ProofError
from edgetp.events import EventError, from_dict

from .state import AskChunk, ConnectionStatus, Notice

log = logging.getLogger(__name__)


class EventSource(Protocol):
    """Records and connection status, in the order they happen."""

    def __aiter__(self) -> AsyncIterator[Any]: ...


class Asker(Protocol):
    """Ask the cluster; the answer streams back in pieces of text, each with the answer's id."""

    def ask(self, prompt: str) -> AsyncIterator[AskChunk]: ...


class AskError(Exception):
    """The API refused or broke off an answer."""


class WebSocketSource:
    """`{url}/v1/events` over a WebSocket, reconnecting after `first`, 2×, 4× … at most `cap` seconds."""

    def __init__(self, url: str, first: float = 1.0, cap: float = 10.0, heartbeat: float = 10.0,
                 creds: Credentials = Credentials()) -> None:
        self.url = url.rstrip("/")
        self.first, self.cap, self.heartbeat, self.creds = first, cap, heartbeat, creds

    def delay(self, attempt: int) -> float:
        """Seconds to wait before reconnect attempt `attempt` (0-based): doubling, bounded by `cap`."""
        return min(self.cap, self.first * 2 ** min(attempt, 30))

    async def __aiter__(self) -> AsyncIterator[Any]:
        endpoint = f"{self.url}/v1/events"
        attempt = 0
        async with aiohttp.ClientSession() as session:
            while True:
                yield ConnectionStatus("connecting", f"connecting to {self.url}")
                reason = "connection closed"
                try:
                    headers = await self.creds.headers(session, self.url, "GET", "/v1/events")
                    async with session.ws_connect(endpoint, heartbeat=self.heartbeat, headers=headers) as ws:
                        attempt = 0
                        yield ConnectionStatus("connected", f"connected to {self.url}")
                        async for msg in ws:
                            if msg.type == aiohttp.WSMsgType.TEXT:
                                yield _record(msg.data)
                            elif msg.type == aiohttp.WSMsgType.ERROR:
                                reason = f"connection error: {ws.exception()}"
                                break
                except aiohttp.WSServerHandshakeError as exc:
                    reason = f"refused: HTTP {exc.status}" + (" (give --key or --api-key)" if exc.status == 401 else "")
                except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ProofError) as exc:
                    reason = str(exc) or type(exc).__name__
                wait = self.delay(attempt)
                attempt += 1
                log.info("event stream %s lost (%s), retrying in %g s", endpoint, reason, wait)
                yield ConnectionStatus("disconnected", reason, retry_in=wait)
                await asyncio.sleep(wait)


def _record(data: str) -> Any:
    """The record a text message holds, or a Notice saying why it holds none."""
    try:
        return from_dict(json.loads(data))
    except (EventError, ValueError) as exc:
        log.warning("bad event record: %s", exc)
        return Notice(f"bad event record: {exc}")


class ScriptedSource:
    """Plays `records` after `delays` seconds each (one number for all); `hold` then waits forever."""

    def __init__(self, records: Iterable[Any], delays: float | Sequence[float] = 0.0, hold: bool = False) -> None:
        self.records = list(records)
        if isinstance(delays, (int, float)):
            self.delays = [float(delays)] * len(self.records)
        else:
            self.delays = [float(d) for d in delays]
            if len(self.delays) != len(self.records):
                raise ValueError(f"{len(self.delays)} delays for {len(self.records)} records")
        self.hold = hold

    async def __aiter__(self) -> AsyncIterator[Any]:
        for record, delay in zip(self.records, self.delays):
            await asyncio.sleep(delay)
            yield record
        if self.hold:
            await asyncio.Event().wait()


class HttpAsker:
    """`POST {url}/v1/chat/completions` with `stream: true`; yields each delta's content."""

    def __init__(self, url: str, model: str | None = None, max_tokens: int | None = None,
                 creds: Credentials = Credentials()) -> None:
        self.url, self.creds = url.rstrip("/"), creds
        self.model, self.max_tokens = model, max_tokens  # model None: whatever the cluster serves

    async def ask(self, prompt: str) -> AsyncIterator[AskChunk]:
        body: dict[str, Any] = {"stream": True, "messages": [{"role": "user", "content": prompt}]}
        if self.model is not None:
            body["model"] = self.model
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        data = json.dumps(body).encode()
        async with aiohttp.ClientSession(timeout=timeout) as session:
            try:
                headers = {"Content-Type": "application/json"} | \
                    await self.creds.headers(session, self.url, "POST", "/v1/chat/completions", data)
            except ProofError as exc:
                raise AskError(str(exc)) from None
            async with session.post(f"{self.url}/v1/chat/completions", data=data, headers=headers) as resp:
                if resp.status != 200:
                    raise AskError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                async for raw in resp.content:
                    chunk = _sse_delta(raw.decode("utf-8", "replace"))
                    if chunk is _DONE:
                        return
                    if chunk is not None:
                        yield chunk


_DONE = object()


def _sse_delta(line: str) -> Any:
    """The text of one SSE `data:` line of a chat completion stream, as an AskChunk with the answer's id;
    None when it carries no text, _DONE at the end."""
    line = line.strip()
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return _DONE
    try:
        chunk = json.loads(data)
    except ValueError as exc:
        raise AskError(f"bad stream chunk: {exc}") from None
    if "error" in chunk:
        raise AskError(str(chunk["error"].get("message", chunk["error"]) if isinstance(chunk["error"], dict)
                           else chunk["error"]))
    choices = chunk.get("choices") or [{}]
    text = (choices[0].get("delta") or {}).get("content")
    return AskChunk(text, chunk.get("id")) if text else None


class ScriptedAsker:
    """Answers every prompt with the same pieces, `delay` seconds apart, as answer `request_id`;
    remembers the prompts."""

    def __init__(self, pieces: Sequence[str], delay: float = 0.0, request_id: str | None = None) -> None:
        self.pieces, self.delay, self.request_id = list(pieces), delay, request_id
        self.prompts: list[str] = []

    async def ask(self, prompt: str) -> AsyncIterator[AskChunk]:
        self.prompts.append(prompt)
        for piece in self.pieces:
            await asyncio.sleep(self.delay)
            yield AskChunk(piece, self.request_id)
