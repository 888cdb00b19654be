"""The HTTP API: OpenAI's completions, the cluster view, Prometheus metrics, the event stream.

`make_app()` builds the application; its handlers only parse, submit to
the `Engine` (edgetp/serve/root.py) and shape the answer as OpenAI does.
Every error, even an unexpected one, leaves as OpenAI's
`{"error": {"message", "type", "param", "code"}}`, never a traceback.

    POST /v1/chat/completions, /v1/completions   (SSE when "stream": true)
    GET  /v1/models, /v1/cluster, /metrics
    GET  /v1/events                               (WebSocket: snapshot, then records)
    GET  /v1/auth/challenge                       (a nonce for a key proof; net/httpauth.py)

Who may call what (`_access`, one place for every route):

- `/v1/cluster/...` (slices, peers, profile: what members do to each other):
  a proof of the cluster key, always;
- `/v1/events` (every prompt and every token): the key, or an API token;
  anyone only while the API listens on loopback alone;
- everything else (the OpenAI API, the cluster view, metrics): an API token
  (`Authorization: Bearer`) or the key when `api_tokens` are set; anyone when
  none are set (a node that listens beyond loopback then warns loudly at start).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import socket
import time
import uuid
import weakref
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

import aiohttp
from aiohttp import WSCloseCode, web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from edgetp.model.batch import TokenEvent
from edgetp.model.chat import ChatTemplateError
from edgetp.model.sampling import Logprobs
from edgetp.net import httpauth
from edgetp import events
from edgetp.serve import openai_shape as shape
from edgetp.serve.watch import unless
from edgetp.serve.root import (Engine, EngineClosed, GenerationFailed, Job, QueueFull, Request, Unavailable,
                               local_view)

log = logging.getLogger(__name__)

ENGINE = web.AppKey("engine", Engine)
CLUSTER_VIEW = web.AppKey("cluster_view", Callable[[], events.ClusterView])
KEY = web.AppKey("key", bytes | None)
TOKENS = web.AppKey("tokens", tuple)  # API bearer tokens; () means the OpenAI API needs none
GATE = httpauth.GATE
LOOPBACK = web.AppKey("loopback", list)  # [True] while serving on loopback only (set by `serving`)
METRICS = web.AppKey("metrics", "Metrics")
SOCKETS = web.AppKey("sockets", weakref.WeakSet)
ENGINE_TASK = web.AppKey("engine_task", asyncio.Task)
ROUTE = web.AppKey("route", object)  # Callable[[], str | None] | None
LIVE = web.AppKey("live", object)  # Callable[[str], bool] | None: does the node at this URL still prove itself?

HEADER_HOPS = "X-Edgetp-Hops"
MAX_HOPS = 2  # a client -> a node -> the root is one hop; a second means the root moved meanwhile
FAILOVER_S = 8.0        # how long a request waits for a new root when the root cannot be connected to
FAILOVER_POLL_S = 0.25  # how often it asks the membership who leads meanwhile
CONNECT_S = 3.0         # a root on the LAN accepts in milliseconds; one that takes this long is gone
HEARD_S = 3.0           # a root that sent part of an answer this recently is still answering, whatever
                        # its heartbeats say (the membership's default loss timeout)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ApiError = shape.ApiError


# --------------------------------------------------------------------------- app


def make_app(engine: Engine, *, cluster_view: Callable[[], events.ClusterView] | None = None,
             key: bytes | None = None, route: Callable[[], str | None] | None = None,
             live: Callable[[str], bool] | None = None, tokens: tuple[str, ...] = ()) -> web.Application:
    """The API over one engine. The app owns the engine's serving task (started and cancelled with it).

    `key` is the cluster key (None: no cluster endpoint can be used); `tokens`
    are the API bearer tokens (see the module docstring for who may call what).

    `route`, in a cluster, says where completions go: None means this node
    (the root) serves them, a base URL means forward to the root there; it
    raises NoRoot while no root is elected. `live(url)` says whether the
    node at that URL still answers the cluster's heartbeats: a forwarded
    request whose root stops (hung, suspended, cut off) is moved or ended
    once it is lost, rather than waiting on it for ever.
    """
    app = web.Application(middlewares=[_errors, _access])
    app[ENGINE] = engine
    app[ROUTE] = route
    app[LIVE] = live
    node_id = socket.gethostname()
    config = getattr(getattr(engine.runner, "mf", None), "config", None)
    app[CLUSTER_VIEW] = cluster_view or (lambda: local_view(engine.model_name, config, node_id))
    app[KEY] = key
    app[TOKENS] = tuple(tokens)
    httpauth.gate_of(app, key)
    app[LOOPBACK] = [False]  # until `serving` knows the address: closed by default
    app[METRICS] = Metrics(engine)
    app[SOCKETS] = weakref.WeakSet()
    engine.bus.add_listener(app[METRICS].observe)
    app.cleanup_ctx.append(_serve_engine)
    app.on_shutdown.extend((_stop_engine, _close_sockets))
    app.add_routes([
        web.post("/v1/chat/completions", chat_completions),
        web.post("/v1/completions", completions),
        web.get("/v1/models", models),
        web.get("/v1/models/{model}", model),
        web.get("/v1/cluster", cluster),
        web.get("/v1/events", events_ws),
        web.get("/metrics", metrics),
    ])
    return app


async def _serve_engine(app: web.Application) -> AsyncIterator[None]:
    app[ENGINE_TASK] = asyncio.create_task(app[ENGINE].serve(), name="edgetp-engine")
    yield
    await _stop_engine(app)


async def _stop_engine(app: web.Application) -> None:
    """The engine stops first when the server does (on_shutdown, before aiohttp waits for the handlers):
    every running and waiting request then ends at once with EngineClosed, a 503 or a stream's error
    event. Stopped last, it generated on while aiohttp waited `shutdown_timeout` for the handlers,
    then cut every client off with no answer at all."""
    task = app.get(ENGINE_TASK)
    if task is None or task.done():
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _close_sockets(app: web.Application) -> None:
    for ws in list(app[SOCKETS]):
        await ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutting down")


@contextlib.asynccontextmanager
async def serving(app: web.Application, host: str = "127.0.0.1", port: int = 0,
                  shutdown_timeout: float = 5.0) -> AsyncIterator[str]:
    """Serve `app` on host:port (0: any free port) while inside; yields the base URL."""
    app[LOOPBACK][0] = is_loopback(host)
    if not app[LOOPBACK][0] and not app[TOKENS]:
        log.warning("THE API ON %s:%s IS OPEN TO THE NETWORK: no api_tokens are set, so anyone who can reach "
                    "this port can use the model; /v1/events is refused to callers without the cluster key "
                    "or a token. Set api_tokens, or listen on 127.0.0.1.", host, port)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=shutdown_timeout, access_log=None)
    await runner.setup()
    try:
        sock = socket.create_server((host, port))
        site = web.SockSite(runner, sock)
        await site.start()
        bound = sock.getsockname()
        yield f"http://{bound[0] if ':' not in bound[0] else '[' + bound[0] + ']'}:{bound[1]}"
    finally:
        await runner.cleanup()


async def run_api(app: web.Application, host: str = "127.0.0.1", port: int = 7711,
                  on_listening: Callable[[str], None] | None = None) -> None:
    """Serve until cancelled (localhost unless told otherwise); cancellation is the shutdown."""
    async with serving(app, host, port) as url:
        log.info("API listening on %s", url)
        if on_listening:
            on_listening(url)
        await asyncio.Future()


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except QueueFull as exc:
        return ApiError(429, str(exc), type="requests", code="rate_limit_exceeded",
                        headers={"Retry-After": str(exc.retry_after)}).response()
    except Unavailable as exc:  # no plan could be made, not even alone: the next request tries afresh
        return ApiError(503, str(exc), type="server_error", code="unavailable",
                        headers={"Retry-After": "5"}).response()
    except EngineClosed as exc:
        return ApiError(503, str(exc), type="server_error", code="shutting_down").response()
    except GenerationFailed as exc:
        return ApiError(500, str(exc), type="server_error", code="generation_failed").response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after", "www-authenticate")}
        text = exc.text or ""
        message = exc.reason if not text or text.startswith(f"{exc.status}:") else text
        return ApiError(exc.status, message, headers=headers).response()
    except web.RequestPayloadError as exc:  # e.g. a body that does not follow its Content-Encoding
        # the connection's stream is broken past this body: it closes after the answer
        resp = ApiError(400, f"the request body could not be read: {exc}").response()
        resp.force_close()
        return resp
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unexpected error in %s %s", request.method, request.path)
        return ApiError(500, "internal server error (logged on the server)", type="server_error").response()


def is_loopback(host: str) -> bool:
    """True when `host` (a listen address) reaches this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _needs(path: str) -> str:
    """What a path asks of its caller: "key", "watch", "api" or "open" (module docstring)."""
    if path == httpauth.CHALLENGE_PATH:
        return "open"
    if path.startswith("/v1/cluster/"):
        return "key"
    return "watch" if path == "/v1/events" else "api"


@web.middleware
async def _access(request: web.Request, handler: Handler) -> web.StreamResponse:
    app, needs = request.app, _needs(request.path)
    if needs == "key" and app[KEY] is None:
        raise ApiError(403, "this node has no cluster key, so it has no cluster endpoints",
                       type="permission_error", code="no_cluster_key")
    if needs in ("open", "key"):  # cluster endpoints check the key proof themselves, through app[GATE]
        return await handler(request)
    if app[KEY] is not None and httpauth.has_proof(request.headers):
        try:
            await app[GATE].verify(request)
        except httpauth.ProofError as exc:
            log.warning("refused %s %s from %s: %s", request.method, request.path, request.remote, exc)
            raise ApiError(401, f"cluster key refused: {exc}", type="authentication_error",
                           code="bad_key_proof") from None
        return await handler(request)
    if httpauth.token_ok(app[TOKENS], httpauth.bearer(request.headers)):
        return await handler(request)
    if not app[TOKENS] and (app[LOOPBACK][0] or needs == "api"):  # tokens set: asked for on loopback too
        return await handler(request)
    given = httpauth.bearer(request.headers) is not None
    what = "the event stream carries every prompt and token: it" if needs == "watch" else "this API"
    raise ApiError(401, f"{'invalid API token' if given else 'missing API token'}: {what} needs "
                        "'Authorization: Bearer <token>' (a token from api_tokens) or the cluster key",
                   type="authentication_error", code="invalid_api_key",
                   headers={"WWW-Authenticate": 'Bearer realm="edgetp"'})


# --------------------------------------------------------------------------- completions


class NoRoot(Exception):
    """No root is elected yet (the cluster is forming or re-electing)."""


class RootLost(Exception):
    """The root a request was forwarded to was lost from the cluster before any of its answer was passed on."""


class Heard:
    """When the root last sent something on one exchange (time.monotonic(); never: -inf)."""

    __slots__ = ("at",)

    def __init__(self) -> None:
        self.at = float("-inf")

    def now(self) -> None:
        self.at = time.monotonic()


class AnswerCut(RootLost):
    """The root closed the connection before the client got any of its answer (killed mid-answer)."""


async def _routed(request: web.Request, *, local_while_forming: bool = False) -> web.StreamResponse | None:
    """Forward the request to the root when this node is not it; None when we serve it here.

    With `local_while_forming`, a node holding a model answers itself while no root is elected.
    A root that cannot be connected to has usually just gone (killed, or its goodbye not yet heard
    here): nothing was sent, so the request waits up to FAILOVER_S for the cluster to name another
    root (maybe this node) and goes there, instead of failing the client during the failover. So
    does a request whose root was lost (no heartbeat answered: hung or suspended) or closed the
    connection (killed mid-answer) before any of its answer reached the client: it is asked again,
    once (a request that every root fails on is not carried from root to root).
    """
    route = request.app[ROUTE]
    if route is None:
        return None
    hops, body, deadline, cut = _hops(request), None, None, False
    while True:
        try:
            target = route()
        except NoRoot as exc:
            if local_while_forming and request.app[ENGINE].tokenizer is not None:
                return None
            raise ApiError(503, f"no root elected yet: {exc}", type="server_error", code="no_root",
                           headers={"Retry-After": "2"}) from None
        if target is None:
            return None
        if hops >= MAX_HOPS:
            raise ApiError(508, f"forwarded {hops} times without reaching the root: the nodes disagree on who "
                                "leads; retry in a few seconds", type="server_error", code="forward_loop",
                           headers={"Retry-After": "2"})
        body = await request.read() if body is None else body
        try:
            return await _proxy(request, target, hops, body)
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError, RootLost) as exc:
            if isinstance(exc, AnswerCut):
                if cut:
                    raise ApiError(502, f"{exc}, and this request's answer was cut once already: it is not asked a "
                                        "third time", type="server_error", code="root_unreachable") from None
                cut = True
            if request.transport is None or request.transport.is_closing():
                log.info("the client left while its root was lost (%s): not forwarded again", exc)
                return web.Response(status=499)  # nginx's "client closed request": only the access log sees it
            if deadline is None:
                deadline = time.monotonic() + FAILOVER_S
                log.info("the root at %s cannot be reached or was lost (%s): waiting for the cluster to elect "
                         "another", target, exc)
            elif time.monotonic() >= deadline:
                raise ApiError(503, f"the root at {target} cannot be reached and no other root was elected "
                                    f"within {FAILOVER_S:.0f} s: {exc}", type="server_error", code="root_unreachable",
                               headers={"Retry-After": "2"}) from None
            await asyncio.sleep(FAILOVER_POLL_S)
        except aiohttp.ClientError as exc:
            raise ApiError(502, f"the root at {target} did not answer: {exc}", type="server_error",
                           code="root_unreachable") from None


async def _proxy(request: web.Request, target: str, hops: int, body: bytes) -> web.StreamResponse:
    """Relay the request to the root at `target` and its answer back, status and all (`_exchange`),
    while the cluster still has that root (`_unless_lost`). Lost before the client got anything:
    RootLost (`_routed` waits for the next root). Lost mid-stream: the stream ends with the error
    event a root lost mid-answer gets.
    """
    begun: list[web.StreamResponse] = []
    heard = Heard()
    try:
        return await _unless_lost(request.app, target, _exchange(request, target, hops, body, begun, heard), heard)
    except RootLost:
        if not begun:
            raise
    await _lost_mid_answer(request, begun[0], target, "no heartbeat answered")
    return begun[0]


async def _lost_mid_answer(request: web.Request, resp: web.StreamResponse, target: str, cause: object) -> None:
    """End a forwarded stream whose root was lost with an error event saying so (the client may be gone too)."""
    why = f"the root at {target} was lost mid-answer; ask again"
    log.warning("%s %s: %s (%s)", request.method, request.path, why, cause)
    with contextlib.suppress(ConnectionResetError):
        await resp.write(shape.sse_error(why))
        await resp.write_eof()


async def _unless_lost(app: web.Application, target: str, aw: Awaitable[Any], heard: Heard) -> Any:
    """`aw`'s result, unless the cluster loses the root at `target` first: then `aw` is cancelled and
    RootLost raised. A root that hangs or is suspended (a laptop put to sleep) keeps its connections
    open, and its kernel accepts new ones, so only the membership's heartbeats tell it is gone. A
    root still sending on this exchange (`heard` within HEARD_S) is not lost, though: a heartbeat gap
    must not cut a stream that flows."""
    live = app[LIVE]
    if live is None:  # no membership to ask (a node outside a cluster)
        return await aw

    def lost() -> RootLost | None:
        if live(target) or time.monotonic() - heard.at <= HEARD_S:
            return None
        return RootLost(f"the root at {target} was lost from the cluster")

    return await unless(aw, lost, FAILOVER_POLL_S)


async def _exchange(request: web.Request, target: str, hops: int, body: bytes,
                    begun: list[web.StreamResponse], heard: Heard) -> web.StreamResponse:
    """The relay itself (`_relay_answer`). A whole answer is read before the client gets any of it,
    so a root that closes the connection before it is whole (killed mid-answer) has passed nothing
    on: AnswerCut, and `_routed` asks the next root. A stream is passed on as it comes (its response
    put in `begun` once the client has it); a root lost mid-stream ends it with an error event, as
    the root's own failures do, rather than a cut connection.
    """
    try:
        return await _relay_answer(request, target, hops, body, begun, heard)
    except aiohttp.ClientConnectorError:
        raise
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientPayloadError) as exc:
        if begun:
            raise
        raise AnswerCut(f"the root at {target} closed the connection before answering ({exc})") from None


async def _relay_answer(request: web.Request, target: str, hops: int, body: bytes,
                        begun: list[web.StreamResponse], heard: Heard) -> web.StreamResponse:
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_S)
    headers = {"Content-Type": "application/json", HEADER_HOPS: str(hops + 1)}
    if "Authorization" in request.headers:
        headers["Authorization"] = request.headers["Authorization"]
    async with aiohttp.ClientSession(timeout=timeout) as session:
        if request.app[KEY] is not None:  # the root trusts a member: it proves the key, whoever asked us
            headers |= await httpauth.proven_headers(session, target, request.app[KEY], request.method,
                                                     request.path_qs, body)
        async with session.request(request.method, target + request.path_qs, data=body,
                                   headers=headers) as upstream:
            heard.now()  # its status line and headers: the root is answering, though no token has come yet
            passed = {k: v for k, v in upstream.headers.items()
                      if k.lower() in ("content-type", "cache-control", "retry-after")}
            if upstream.content_type != "text/event-stream":
                return web.Response(status=upstream.status, body=await upstream.read(), headers=passed)
            resp = web.StreamResponse(status=upstream.status, headers=passed)
            await resp.prepare(request)
            begun.append(resp)
            try:
                async for chunk in upstream.content.iter_any():
                    heard.now()
                    await resp.write(chunk)
            except aiohttp.ClientError as exc:
                await _lost_mid_answer(request, resp, target, exc)
                return resp
            except ConnectionResetError:  # our client left: closing the upstream frees its slot on the root
                return resp
            await resp.write_eof()
            return resp


def _hops(request: web.Request) -> int:
    """How many nodes forwarded this request already (the X-Edgetp-Hops header; 0 from a client)."""
    text = request.headers.get(HEADER_HOPS, "0")
    return int(text) if text.isdigit() and len(text) < 4 else MAX_HOPS


async def chat_completions(request: web.Request) -> web.StreamResponse:
    if (forwarded := await _routed(request)) is not None:
        return forwarded
    engine = request.app[ENGINE]
    body = await shape.json_body(request)
    opts = shape.options(body, engine.model_name, chat=True)
    messages = shape.messages(body.get("messages"))
    tok = engine.tokenizer
    try:  # a body may be up to 1 MiB of text: tokenise off the event loop
        text, ids = await asyncio.to_thread(tok.encode_chat, messages)
    except ChatTemplateError as exc:
        raise ApiError(400, f"the model's chat template refused these messages: {exc}", param="messages") from None
    return await _complete(request, "chat", ids, text, opts)


async def completions(request: web.Request) -> web.StreamResponse:
    if (forwarded := await _routed(request)) is not None:
        return forwarded
    engine = request.app[ENGINE]
    body = await shape.json_body(request)
    opts = shape.options(body, engine.model_name, chat=False)
    text, ids = await asyncio.to_thread(shape.prompt, body.get("prompt"), engine.tokenizer)
    return await _complete(request, "text", ids, text, opts)


async def _complete(request: web.Request, kind: str, ids: list[int], text: str,
                    opts: shape.Options) -> web.StreamResponse:
    engine = request.app[ENGINE]
    vocab = engine.tokenizer.vocab_size
    if any(t >= vocab for t, _ in opts.params.logit_bias):
        raise ApiError(400, f"'logit_bias' has token ids outside 0..{vocab - 1}", param="logit_bias",
                       code="invalid_value")
    max_tokens = shape.fit(len(ids), opts.max_tokens, engine.ctx, "messages" if kind == "chat" else "prompt",
                           opts.max_name)
    if engine.slots and opts.n > engine.slots + engine.queue_size:
        raise ApiError(400, f"'n' is {opts.n}; this server runs {engine.slots} sequences at once and queues "
                       f"{engine.queue_size} more", param="n", code="invalid_value")
    first = shape.Shaper(kind, ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24],
                         engine.model_name, include_usage=opts.include_usage,
                         tok=None if opts.params.logprobs is None else engine.tokenizer)
    outs = [first] + [first.choice(i) for i in range(1, opts.n)]
    # echo: the answer starts with the prompt, scored when logprobs are asked for
    score = opts.params.logprobs if opts.echo else None
    jobs = engine.submit_all([Request(first.id if opts.n == 1 else f"{first.id}-{i}", tuple(ids), opts.seeded(i),
                                      max_tokens, opts.stop, text, score) for i in range(opts.n)])
    echo = _Echo(text, ids) if opts.echo else None
    for out in outs if echo is not None and first.tok is not None else ():
        out.echoing(text, len(ids))
    try:
        if opts.stream:
            return await _stream(request, jobs, outs, len(ids), echo)
        choices = await asyncio.gather(*(_answer(job, out, echo) for job, out in zip(jobs, outs)))
        return web.json_response(first.whole(list(choices), len(ids), sum(j.tokens for j in jobs),
                                             min(j.cached_tokens for j in jobs)), dumps=shape.dumps)
    finally:  # (a choice not finished, when another failed or the client left)
        for job in jobs:
            job.cancel()


async def _answer(job: Job, out: shape.Shaper, echo: _Echo | None) -> dict[str, Any]:
    """One choice of a whole answer, once its job has finished."""
    pieces, reason, lps = [], None, []
    async for ev in job:
        if echo is not None and not pieces:
            pieces, lps = [echo.text], echo.logprobs(ev)
        pieces.append(ev.text)
        reason = ev.finish_reason
        if ev.logprobs is not None:
            lps.append(ev.logprobs)
    return out.answer("".join(pieces), reason, lps)


@dataclasses.dataclass(frozen=True)
class _Echo:
    """A completion's prompt, sent back before its answer (`echo`)."""

    text: str
    ids: Sequence[int]

    def logprobs(self, first: TokenEvent) -> list[Logprobs]:
        """The prompt's tokens as logprobs entries: the first has none (nothing predicts it), the
        others what the first event's prompt_logprobs scored (none when logprobs were not asked)."""
        if first.prompt_logprobs is None:
            return []
        return [Logprobs(int(self.ids[0]), None, None), *first.prompt_logprobs]


async def _stream(request: web.Request, jobs: list[Job], outs: list[shape.Shaper], prompt_tokens: int,
                  echo: _Echo | None = None) -> web.StreamResponse:
    """The choices' chunks as their tokens come, each naming its choice (index)."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                       "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        await resp.prepare(request)  # (a client may be gone before its headers: the same quiet end)
        for out in outs if outs[0].kind == "chat" else ():
            await resp.write(shape.sse(out.chunk("", None, first=True)))
        echoing = [echo is not None] * len(jobs)
        lps: list[list[Logprobs]] = [[] for _ in jobs]  # of tokens whose text is not sent yet (a split character)
        async with contextlib.aclosing(_merged(jobs)) as merged:
            async for i, ev in merged:
                out = outs[i]
                if echoing[i]:  # the prompt first, in a chunk of its own
                    await resp.write(shape.sse(out.chunk(echo.text, None, logprobs=echo.logprobs(ev))))
                    echoing[i] = False
                if ev.logprobs is not None:
                    lps[i].append(ev.logprobs)
                if ev.text:
                    await resp.write(shape.sse(out.chunk(ev.text, None, logprobs=lps[i])))
                    lps[i] = []
                if ev.finish_reason is not None:
                    await resp.write(shape.sse(out.chunk("", ev.finish_reason, logprobs=lps[i])))
        if outs[0].include_usage:
            await resp.write(shape.sse(outs[0].usage_chunk(prompt_tokens, sum(j.tokens for j in jobs),
                                                           min(j.cached_tokens for j in jobs))))
        await resp.write(shape.DONE)
    except (GenerationFailed, EngineClosed) as exc:
        await resp.write(shape.sse_error(str(exc)))
    except ConnectionResetError:
        log.info("client went away during %s; generation cancelled", outs[0].id)
        return resp
    await resp.write_eof()
    return resp


async def _merged(jobs: list[Job]) -> AsyncIterator[tuple[int, TokenEvent]]:
    """(choice, event) of every job as each comes; the first job's failure is raised."""
    if len(jobs) == 1:
        async for ev in jobs[0]:
            yield 0, ev
        return
    queue: asyncio.Queue[tuple[int, TokenEvent | Exception | None]] = asyncio.Queue()

    async def pump(i: int, job: Job) -> None:
        try:
            async for ev in job:
                queue.put_nowait((i, ev))
            queue.put_nowait((i, None))
        except Exception as exc:  # noqa: BLE001 - raised where the chunks are written
            queue.put_nowait((i, exc))

    pumps = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
    try:
        running = len(jobs)
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in pumps:
            task.cancel()


# --------------------------------------------------------------------------- cluster, models, events


async def models(request: web.Request) -> web.StreamResponse:
    """The root's model: a node forwards, since the root decides what the cluster serves."""
    if (forwarded := await _routed(request, local_while_forming=True)) is not None:
        return forwarded
    return web.json_response({"object": "list", "data": [shape.model_card(request.app[ENGINE].model_name)]})


async def model(request: web.Request) -> web.StreamResponse:
    if (forwarded := await _routed(request, local_while_forming=True)) is not None:
        return forwarded
    name = request.app[ENGINE].model_name
    if request.match_info["model"] != name:
        raise ApiError(404, f"the model {request.match_info['model']!r} does not exist; this server has {name!r}",
                       param="model", code="model_not_found")
    return web.json_response(shape.model_card(name))


async def cluster(request: web.Request) -> web.Response:
    return web.json_response(events.to_dict(served_view(request.app)), dumps=shape.dumps)


def served_view(app: web.Application) -> events.ClusterView:
    """The cluster view, with the engine's slots when this node is the one serving completions."""
    view = app[CLUSTER_VIEW]()
    if view.slots is None and _serves_here(app):
        view = dataclasses.replace(view, slots=app[ENGINE].slots_view())
    return view


def _serves_here(app: web.Application) -> bool:
    """True when completions sent to this node run on its own engine (it is the root, or alone)."""
    if app[ROUTE] is None:
        return True
    try:
        return app[ROUTE]() is None
    except NoRoot:
        return False


async def events_ws(request: web.Request) -> web.WebSocketResponse:
    """A snapshot of the cluster, then every token, request and cluster record as one JSON message each.

    Tokens are made on the root: a node that is not the root relays the root's stream (proving
    the cluster key to it), so a dashboard pointed at any node sees every token.
    """
    ws = web.WebSocketResponse(heartbeat=30)
    await ws.prepare(request)
    request.app[SOCKETS].add(ws)
    if (root := _root_url(request.app)) is not None:
        await _relay(request.app, ws, root)
        return ws
    sub = request.app[ENGINE].bus.subscribe()  # before the snapshot, so nothing falls between
    try:
        await ws.send_str(shape.dumps(events.to_dict(served_view(request.app))))
        async with asyncio.TaskGroup() as tg:
            forward = tg.create_task(_forward(ws, sub))
            async for _ in ws:  # watchers only listen; this ends when they close
                pass
            forward.cancel()
    finally:
        sub.close()
    return ws


def _root_url(app: web.Application) -> str | None:
    """The root's base URL when another node is the root, else None (we are, or none is elected)."""
    if app[ROUTE] is None:
        return None
    try:
        return app[ROUTE]()
    except NoRoot:
        return None


async def _relay(app: web.Application, ws: web.WebSocketResponse, root: str) -> None:
    """Pass the root's event stream to our watcher until either side closes or the cluster loses the
    root; then close, so the watcher reconnects (and finds the new root, if it changed)."""
    why = "the root's event stream ended"
    try:
        heard = Heard()
        await _unless_lost(app, root, _pass_events(app, ws, root, heard), heard)
    except (aiohttp.ClientError, httpauth.ProofError, ConnectionResetError, RootLost) as exc:
        why = str(exc) if isinstance(exc, RootLost) else f"the root at {root} gave no event stream: {exc}"
        with contextlib.suppress(ConnectionResetError):
            await ws.send_str(shape.dumps(events.to_dict(events.ClusterEvent("error", why))))
    if not ws.closed:
        await ws.close(code=WSCloseCode.GOING_AWAY, message=why.encode()[:120])


async def _pass_events(app: web.Application, ws: web.WebSocketResponse, root: str, heard: Heard) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10)) as session:
        headers = await httpauth.proven_headers(session, root, app[KEY], "GET", "/v1/events") \
            if app[KEY] is not None else {}
        async with session.ws_connect(root + "/v1/events", headers=headers, heartbeat=30) as up:
            async def pump() -> None:
                async for msg in up:
                    heard.now()
                    if msg.type == aiohttp.WSMsgType.TEXT:
                        await ws.send_str(msg.data)

            async def watcher_leaves() -> None:
                async for _ in ws:
                    pass

            tasks = [asyncio.create_task(pump()), asyncio.create_task(watcher_leaves())]
            try:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)


async def _forward(ws: web.WebSocketResponse, sub: Any) -> None:
    told = 0
    try:
        async for record in sub:
            if sub.dropped > told:
                lost = events.ClusterEvent("error", f"this watcher fell behind: {sub.dropped - told} records dropped")
                await ws.send_str(shape.dumps(events.to_dict(lost)))
                told = sub.dropped
            await ws.send_str(shape.dumps(events.to_dict(record)))
    except ConnectionResetError:
        return
    await ws.close(code=WSCloseCode.GOING_AWAY, message=b"event stream ended")


# --------------------------------------------------------------------------- metrics


class Metrics:
    """Prometheus metrics in a registry of their own, fed by the engine's bus (every record, none dropped);
    slots and the queue are read from the engine when scraped."""

    BATCHES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)

    def __init__(self, engine: Engine) -> None:
        self.registry = r = CollectorRegistry()
        self.tokens = Counter("edgetp_tokens_generated", "Tokens generated", registry=r)
        self.requests = Counter("edgetp_requests", "Generations finished, by finish reason", ["finish_reason"],
                                registry=r)
        self.request_seconds = Histogram("edgetp_request_seconds", "Generation latency, queue excluded",
                                         buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300), registry=r)
        self.token_seconds = Histogram("edgetp_token_seconds", "Per-token latency (prefill included for the first)",
                                       buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
                                       registry=r)
        self.link_bytes = Counter("edgetp_link_bytes", "Bytes moved over cluster links during generation",
                                  ["link", "direction"], registry=r)
        self.queue_depth = Gauge("edgetp_queue_depth", "Requests waiting for a slot", registry=r)
        self.queue_depth.set_function(lambda: engine.slots_view().queued)
        self.slots_total = Gauge("edgetp_slots_total", "Sequences the engine can run at once", registry=r)
        self.slots_total.set_function(lambda: engine.slots_view().total)
        self.slots_active = Gauge("edgetp_slots_active", "Sequences holding a slot", registry=r)
        self.slots_active.set_function(lambda: engine.slots_view().active)
        self.batch_size = Gauge("edgetp_batch_size", "Sequences in the last decode step", registry=r)
        self.decode_batch = Histogram("edgetp_decode_batch", "Decode steps by the sequences they carried",
                                      buckets=self.BATCHES, registry=r)
        self.steps = Counter("edgetp_steps", "Engine steps, by kind (decode, prefill)", ["kind"], registry=r)
        self.step_seconds = Counter("edgetp_step_seconds", "Wall time of engine steps, by kind (decode, prefill, or mixed: one pass of both)", ["kind"],
                                    registry=r)
        self.prefix_hits = Counter("edgetp_prefix_cache_hits", "Requests whose prompt began with a cached prefix",
                                   registry=r)
        self.cached_tokens = Counter("edgetp_prefix_cached_tokens", "Prompt tokens taken from the prefix cache",
                                     registry=r)
        self.rounds = Gauge("edgetp_allreduce_rounds", "All-reduce rounds run by the root's current runner "
                            "(from 0 again after a re-plan)", registry=r)
        self.rounds.set_function(lambda: getattr(engine.runner, "rounds", 0))
        self.replans = Counter("edgetp_replans", "Re-plans of the cluster", registry=r)
        self.elections = Counter("edgetp_elections", "Root elections", registry=r)
        self._started: dict[str, float] = {}
        self._cached: dict[str, int] = {}  # running requests -> the cached prompt tokens counted so far

    def observe(self, record: Any) -> None:
        if isinstance(record, events.TokenRecord):
            self.tokens.inc()
            self.token_seconds.observe(record.total_ms / 1000)
            for link, b in record.links.items():
                self.link_bytes.labels(link, "sent").inc(b.sent)
                self.link_bytes.labels(link, "received").inc(b.received)
        elif isinstance(record, events.StepRecord):
            self.steps.labels(record.kind).inc()
            if not record.mixed:
                self.step_seconds.labels(record.kind).inc(record.ms / 1000)
            elif record.kind == "decode":  # one pass of both kinds: its time once
                self.step_seconds.labels("mixed").inc(record.ms / 1000)
            if record.kind == "decode":
                self.batch_size.set(record.batch)
                self.decode_batch.observe(record.batch)
        elif isinstance(record, events.RequestRecord):
            rid = record.request_id
            counted = self._cached.get(rid, 0)
            if record.cached_tokens > counted:  # a hit counted once; its tokens as they grow (the started
                if not counted:                 # record's, then what was copied from other slots meanwhile)
                    self.prefix_hits.inc()
                self.cached_tokens.inc(record.cached_tokens - counted)
                self._cached[rid] = record.cached_tokens
            if record.state == "started":
                self._started[rid] = time.perf_counter()
            else:
                self._cached.pop(rid, None)
                t0 = self._started.pop(rid, None)
                if t0 is not None:
                    self.request_seconds.observe(time.perf_counter() - t0)
                self.requests.labels(record.finish_reason or "none").inc()
        elif isinstance(record, events.ClusterEvent):
            if record.event == "replan":
                self.replans.inc()
            elif record.event == "election":
                self.elections.inc()


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=generate_latest(request.app[METRICS].registry),
                        headers={"Content-Type": CONTENT_TYPE_LATEST})
