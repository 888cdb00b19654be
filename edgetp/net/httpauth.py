"""Who may use a node's HTTP API: the cluster key (challenge-response, no clock) and bearer tokens.

Two kinds of caller:

- **Cluster members and operators** hold the key. They prove it per request,
  with no synchronised clock (a Pi has no RTC): the client fetches a fresh
  nonce from the server (`GET /v1/auth/challenge`), then sends

      X-Edgetp-Nonce: <that nonce>
      X-Edgetp-Proof: hex HMAC-SHA256(key, "edgetp-http-2", METHOD, PATH?QUERY, sha256(body), nonce)

  The server made the nonce, keeps it CHALLENGE_TTL seconds by its own
  monotonic clock, and accepts it once: a recorded request replayed later
  fails, and so does one whose method, path, query or body was changed.
- **API users** (OpenAI clients) send `Authorization: Bearer <token>` with a
  token from the node's settings (`api_tokens`); OpenAI's clients send that
  header from `api_key=` already.

`KeyGate` is a node's one checker, with its one nonce store; `proven_headers` is the client side.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass
from typing import Any, Mapping

import aiohttp
from aiohttp import web

CHALLENGE_PATH = "/v1/auth/challenge"
HEADER_NONCE, HEADER_PROOF = "X-Edgetp-Nonce", "X-Edgetp-Proof"
CHALLENGE_TTL = 60.0  # seconds a nonce may wait for its request
MAX_CHALLENGES = 4096  # outstanding nonces kept; when full, the address holding the most loses its oldest
MAX_ANSWER = 1 << 20  # bytes of a peer's JSON answer read at most (a challenge, a heartbeat, an advert)


class ProofError(Exception):
    """A request's key proof is missing, stale, reused or wrong; str() says which."""


class Challenges:
    """Nonces this node issued and has not yet seen used: each is good once, for CHALLENGE_TTL seconds.

    At most `max_size` are kept. When full, the caller address holding the most gives up its oldest:
    a flood from a few addresses pushes out its own nonces, never the one a member is about to use,
    and no amount of ordinary traffic (a node forwarding many requests at once) loses any."""

    def __init__(self, ttl: float = CHALLENGE_TTL, max_size: int = MAX_CHALLENGES,
                 clock: Any = time.monotonic) -> None:
        self.ttl, self.max_size, self._clock = ttl, max_size, clock
        self._issued: collections.OrderedDict[str, tuple[float, str]] = collections.OrderedDict()  # -> expiry, source
        self._by_source: dict[str, collections.OrderedDict[str, None]] = {}

    def issue(self, source: str = "") -> str:
        self._expire()
        while len(self._issued) >= self.max_size:
            greediest = max(self._by_source.values(), key=len)
            self._drop(next(iter(greediest)))
        nonce = secrets.token_hex(16)
        self._issued[nonce] = (self._clock() + self.ttl, source)
        self._by_source.setdefault(source, collections.OrderedDict())[nonce] = None
        return nonce

    def take(self, nonce: str) -> None:
        """Use up a nonce; ProofError when it was never issued, is used, or expired."""
        self._expire()
        if not isinstance(nonce, str) or nonce not in self._issued:
            raise ProofError("unknown, used or expired nonce (fetch a new one from " + CHALLENGE_PATH + ")")
        self._drop(nonce)

    def _drop(self, nonce: str) -> None:
        _, source = self._issued.pop(nonce)
        mine = self._by_source[source]
        del mine[nonce]
        if not mine:
            del self._by_source[source]

    def _expire(self) -> None:
        now = self._clock()
        while self._issued and next(iter(self._issued.values()))[0] < now:
            self._drop(next(iter(self._issued)))

    def __len__(self) -> int:
        return len(self._issued)


def proof(key: bytes, method: str, path_qs: str, body: bytes, nonce: str) -> str:
    """Hex HMAC over the request's method, path with query, body hash and the server's nonce."""
    parts = [b"edgetp-http-2", method.upper().encode(), path_qs.encode(), hashlib.sha256(body).digest(),
             nonce.encode()]
    return hmac.new(key, b"".join(len(p).to_bytes(4, "big") + p for p in parts), hashlib.sha256).hexdigest()


def has_proof(headers: Mapping[str, str]) -> bool:
    return HEADER_PROOF in headers


def check(key: bytes, challenges: Challenges, method: str, path_qs: str, body: bytes,
          headers: Mapping[str, str]) -> None:
    """Raise ProofError unless the headers prove the key for this very request."""
    nonce, given = headers.get(HEADER_NONCE), headers.get(HEADER_PROOF)
    if not nonce or not given:
        raise ProofError(f"no key proof ({HEADER_NONCE} and {HEADER_PROOF} headers)")
    want = proof(key, method, path_qs, body, nonce)
    if not hmac.compare_digest(given.encode(), want.encode()):
        raise ProofError("wrong key proof (another cluster's key, or the request was changed)")
    challenges.take(nonce)  # after the HMAC: a stranger cannot burn our nonces


class KeyGate:
    """A node's one checker of key proofs, with its one nonce store: the API, the slice server
    and the peer endpoints all verify through the same gate."""

    def __init__(self, key: bytes | None) -> None:
        self.key = key
        self.challenges = Challenges()

    async def challenge(self, request: web.Request) -> web.Response:
        """GET CHALLENGE_PATH: a fresh nonce for one key-proven request."""
        return web.json_response({"nonce": self.challenges.issue(request.remote or ""), "ttl_s": self.challenges.ttl})

    async def verify(self, request: web.Request) -> bytes:
        """The request's body once its headers prove the key; ProofError otherwise."""
        if self.key is None:
            raise ProofError("this node holds no cluster key")
        body = await request.read()  # kept by aiohttp: a handler may read it again
        check(self.key, self.challenges, request.method, request.raw_path, body, request.headers)
        return body


GATE = web.AppKey("edgetp_gate", KeyGate)


def gate_of(app: web.Application, key: bytes | None) -> KeyGate:
    """The app's one KeyGate, made (with its challenge route) by whoever asks first."""
    if GATE not in app:
        app[GATE] = KeyGate(key)
        app.router.add_get(CHALLENGE_PATH, app[GATE].challenge)
    return app[GATE]


def proven_headers_sync(base_url: str, key: bytes, method: str, path_qs: str, body: bytes = b"",
                        timeout: float = 30) -> dict[str, str]:
    """proven_headers for blocking clients (urllib, in a thread); ProofError when no challenge comes."""
    import urllib.error  # noqa: PLC0415
    import urllib.request  # noqa: PLC0415

    try:
        with urllib.request.urlopen(base_url.rstrip("/") + CHALLENGE_PATH, timeout=timeout) as resp:
            nonce = str(loads(resp.read(MAX_ANSWER + 1))["nonce"])
    except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError) as exc:
        raise ProofError(f"{base_url} gave no key challenge: {exc}") from None
    return {HEADER_NONCE: nonce, HEADER_PROOF: proof(key, method, path_qs, body, nonce)}


def bearer(headers: Mapping[str, str]) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, else None."""
    scheme, _, token = headers.get("Authorization", "").partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


def token_ok(tokens: tuple[str, ...], given: str | None) -> bool:
    """`given` is one of `tokens` (compared in constant time, every token tried)."""
    if not given:
        return False
    found = False
    for t in tokens:
        found |= hmac.compare_digest(t.encode(), given.encode())
    return found


async def proven_headers(session: aiohttp.ClientSession, base_url: str, key: bytes, method: str, path_qs: str,
                         body: bytes = b"") -> dict[str, str]:
    """Headers proving `key` for one request to base_url (fetches a fresh challenge first).

    ProofError when the server gives no challenge; aiohttp.ClientError when it cannot be reached.
    """
    async with session.get(base_url.rstrip("/") + CHALLENGE_PATH) as resp:
        try:
            nonce = str((await read_json(resp))["nonce"]) if resp.status == 200 else None
        except (ValueError, KeyError, TypeError):
            nonce = None
    if not nonce:
        raise ProofError(f"{base_url} gave no key challenge (HTTP {resp.status}): is it an edgetp node?")
    return {HEADER_NONCE: nonce, HEADER_PROOF: proof(key, method, path_qs, body, nonce)}


@dataclass(frozen=True)
class Credentials:
    """What a client shows a node: the cluster key (proven per request), an API token, both or neither."""

    key: bytes | None = None
    token: str | None = None

    async def headers(self, session: aiohttp.ClientSession, base_url: str, method: str, path_qs: str,
                      body: bytes = b"") -> dict[str, str]:
        out = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        if self.key is not None:
            out |= await proven_headers(session, base_url, self.key, method, path_qs, body)
        return out


def loads(data: bytes) -> Any:
    """JSON from a peer or server; ValueError for anything else (too long, not JSON, nested past what
    Python parses): what another node answers must never take this one down."""
    if len(data) > MAX_ANSWER:
        raise ValueError(f"the answer is longer than {MAX_ANSWER} bytes")
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("the answer is JSON nested too deeply") from None


async def read_json(resp: aiohttp.ClientResponse) -> Any:
    """`loads` of an aiohttp answer, reading at most MAX_ANSWER + 1 bytes of it."""
    data = bytearray()
    while len(data) <= MAX_ANSWER:
        chunk = await resp.content.read(MAX_ANSWER + 1 - len(data))
        if not chunk:
            break
        data += chunk
    return loads(bytes(data))
