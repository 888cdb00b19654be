"""The cluster's own HTTP endpoints on every node, and `--peer` for networks without multicast.

    GET  /v1/cluster/node?nonce=N   a heartbeat: {"advert": our signed advert, "proof": heartbeat_proof}
    POST /v1/cluster/peers     key-proven (net/httpauth.py); body = the caller's advert: "I am here". Answer: our advert
    POST /v1/cluster/profile   key-proven; measure speed and free memory again, re-announce, re-plan

An advert travels as its TXT dict (`PeerAdvert.to_txt`), signed, and is
validated by the same `parse_txt` as an mDNS record.

A heartbeat is a challenge-response, so it needs no synchronised clock: the
pinger sends a fresh random nonce; the answer's proof is
HMAC(heartbeat key, nonce, advert sig), where the advert's own signature covers
node id, epoch, leader, boot id and sequence. Only a key holder can answer, and
an answer cannot be replayed to a later nonce. `check_heartbeat` is the
pinger's side. A node told "I am here" records the
caller under the address the request came from, so listing a peer on one
side is enough: both sides then know each other.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import re
from typing import Awaitable, Callable

import aiohttp
from aiohttp import web

from edgetp.cluster.discovery import DiscoveryError, PeerAdvert, parse_txt
from edgetp.net import httpauth

log = logging.getLogger(__name__)

NODE_PATH = "/v1/cluster/node"
NONCE_RE = re.compile(r"[0-9a-f]{32,128}")
PEERS_PATH = "/v1/cluster/peers"
PROFILE_PATH = "/v1/cluster/profile"
LEAVING = "this node is leaving the cluster"  # a heartbeat's 503 once our goodbye is on its way


def parse_advert(body: object, addresses: str | tuple[str, ...]) -> PeerAdvert:
    """A validated advert from a JSON body, placed at `addresses`; DiscoveryError if malformed."""
    if not isinstance(body, dict) or len(body) > 64 or not all(isinstance(v, str) for v in body.values()):
        raise DiscoveryError("an advert must be a JSON object of at most 64 strings")
    return parse_txt(body, (addresses,) if isinstance(addresses, str) else addresses)


def heartbeat_proof(key: bytes, nonce: str, sig: str) -> str:
    """Hex HMAC binding the pinger's nonce to the signed advert `sig` (a key derived for heartbeats only)."""
    hb_key = hmac.new(key, b"edgetp-heartbeat-v1", hashlib.sha256).digest()
    return hmac.new(hb_key, f"{nonce}\n{sig}".encode(), hashlib.sha256).hexdigest()


def check_heartbeat(key: bytes, nonce: str, body: object, addresses: tuple[str, ...]) -> PeerAdvert:
    """The advert of a heartbeat answer proven for `nonce`; DiscoveryError if the proof is missing or wrong.

    The advert's own signature is the PeerTable's to check (a wrong one makes the peer foreign).
    """
    if not isinstance(body, dict) or not isinstance(body.get("proof"), str):
        raise DiscoveryError("a heartbeat answer must be {advert, proof}")
    advert = parse_advert(body.get("advert"), addresses)
    given = body["proof"].encode("utf-8", "replace")  # compare_digest refuses str beyond ASCII
    if not advert.sig or not hmac.compare_digest(given, heartbeat_proof(key, nonce, advert.sig).encode()):
        raise DiscoveryError("the heartbeat answer does not prove the cluster key")
    return advert


class PeerEndpoints:
    """The three routes over one node's membership.

    `me()` is our current advert; `introduce(advert)` records a peer that
    called us; `reprofile()` measures again and returns the new advert.
    """

    def __init__(self, key: bytes, me: Callable[[], PeerAdvert], introduce: Callable[[PeerAdvert], None],
                 reprofile: Callable[[], Awaitable[PeerAdvert]], leaving: Callable[[], bool] = lambda: False) -> None:
        self._key, self._me, self._introduce, self._reprofile = key, me, introduce, reprofile
        self._leaving = leaving
        self.gate = httpauth.KeyGate(key)  # replaced by the app's one gate in add_routes
        self._profiling = asyncio.Lock()

    def add_routes(self, app: web.Application) -> None:
        self.gate = httpauth.gate_of(app, self._key)
        app.router.add_get(NODE_PATH, self.node)
        app.router.add_post(PEERS_PATH, self.peers)
        app.router.add_post(PROFILE_PATH, self.profile)

    async def node(self, request: web.Request) -> web.Response:
        """A heartbeat: our signed advert and a proof over the caller's nonce."""
        nonce = request.query.get("nonce", "")
        if not NONCE_RE.fullmatch(nonce):
            raise web.HTTPBadRequest(text="a heartbeat needs ?nonce= with 32-128 lowercase hex digits\n")
        if self._leaving():  # our goodbye is on its way: peers that challenge it must find us gone
            raise web.HTTPServiceUnavailable(text=LEAVING + "\n")
        me = self._me()
        return web.json_response({"advert": me.to_txt(), "proof": heartbeat_proof(self._key, nonce, me.sig)})

    async def peers(self, request: web.Request) -> web.Response:
        body = await self._signed(request)
        try:
            advert = parse_advert(httpauth.loads(body), request.remote or "")
        except (ValueError, DiscoveryError) as exc:
            raise web.HTTPBadRequest(text=f"bad advert: {exc}\n") from None
        self._introduce(advert)
        return web.json_response(self._me().to_txt())

    async def profile(self, request: web.Request) -> web.Response:
        await self._signed(request)
        async with self._profiling:  # one measurement at a time: two would slow each other
            advert = await self._reprofile()
        return web.json_response(advert.to_txt())

    async def _signed(self, request: web.Request) -> bytes:
        try:
            body = await self.gate.verify(request)
        except httpauth.ProofError as exc:
            log.warning("refused %s %s from %s: %s", request.method, request.path, request.remote, exc)
            raise web.HTTPForbidden(text=f"cluster key required: {exc}\n") from None
        return body


async def signed_post(session: aiohttp.ClientSession, base_url: str, path: str, key: bytes,
                      body: dict | None = None) -> dict:
    """POST a JSON body proving the key (a fresh challenge first); the JSON answer.
    aiohttp.ClientError on refusal or no answer."""
    data = json.dumps(body or {}).encode()
    try:
        proof = await httpauth.proven_headers(session, base_url, key, "POST", path, data)
    except httpauth.ProofError as exc:
        raise aiohttp.ClientError(str(exc)) from None
    headers = {"Content-Type": "application/json"} | proof
    async with session.post(base_url.rstrip("/") + path, data=data, headers=headers) as resp:
        if resp.status != 200:
            raise aiohttp.ClientResponseError(resp.request_info, resp.history, status=resp.status,
                                              message=(await resp.text()).strip()[:200])
        return await httpauth.read_json(resp)


async def introduce(session: aiohttp.ClientSession, address: tuple[str, int], key: bytes,
                    me: PeerAdvert) -> PeerAdvert:
    """Tell the node at (host, HTTP port) that we are here; its advert, placed at that host."""
    host, port = address
    answer = await signed_post(session, f"http://{f'[{host}]' if ':' in host else host}:{port}", PEERS_PATH,
                               key, me.to_txt())
    return parse_advert(answer, host)
