"""Shard transfer: the root serves each worker just its slice of the model; the worker fetches it.

    GET|HEAD /v1/cluster/shard?kv=a,b&ffn=c,d&vocab=e,f[&node=ID]

Root (`ShardServer`): the request must prove the cluster key over the exact
method, path and query (net/httpauth.py: a single-use nonce from the root,
no clock), else 403 and nothing else. The shard GGUF (parallel/shardfile.py) is written once per
(model fingerprint, spec) into the cache dir, its sha256 kept beside it in
`<name>.sha256` (both fsynced before and after their rename), and served with Range support,
`X-Edgetp-Sha256` and `X-Edgetp-Fingerprint`. With `cache_bytes`, older slices are evicted
after each new one, least recently used first, never one in use (store/slices.py). Bytes sent are counted per node (`transfers()`) for
the cluster API.

Worker (`fetch_shard`): a signed HEAD learns the source fingerprint and the
hash; a shard already in the cache under that name is used as it is. Else
store/download.fetch_url fetches it in a thread (a fresh key proof per request,
resuming `<name>.part`, sha256-checked, renamed into place only when right),
while `progress(done, total)` is called on the event loop; with `cache_bytes` the cache is
then trimmed the same way.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import AsyncIterator, Callable, Mapping

import aiohttp
import yarl
from aiohttp import web

from edgetp.model.gguf import ModelFile
from edgetp.model.llama import ShardSpec
from edgetp.net import httpauth
from edgetp.parallel.shardfile import check_spec, shard_name, write_shard
from edgetp.store import slices
from edgetp.store.download import fetch_url_once
from edgetp.store.errors import DownloadError, DownloadInterrupted

log = logging.getLogger(__name__)

SHARD_PATH = "/v1/cluster/shard"
HEADER_SHA256 = "X-Edgetp-Sha256"
HEADER_FINGERPRINT = "X-Edgetp-Fingerprint"
CHUNK = 1 << 20
_NODE = re.compile(r"[A-Za-z0-9._:-]{1,128}")

Progress = Callable[[int, int], None]  # (bytes on disk, total bytes)


class ShardRefused(DownloadError):
    """The root would not serve the shard (wrong or missing cluster key, bad spec)."""


# --------------------------------------------------------------------------- the query


def spec_query(spec: ShardSpec, node_id: str | None = None) -> str:
    q = f"kv={spec.kv_groups[0]},{spec.kv_groups[1]}&ffn={spec.ffn_cols[0]},{spec.ffn_cols[1]}" \
        f"&vocab={spec.vocab_rows[0]},{spec.vocab_rows[1]}"
    for name, r in (("layers", spec.layers), ("experts", spec.experts)):
        if r is not None:
            q += f"&{name}={r[0]},{r[1]}"
    if node_id is not None:
        if not _NODE.fullmatch(node_id):
            raise ValueError(f"node id {node_id!r} must be 1-128 of A-Z a-z 0-9 . _ : -")
        q += f"&node={node_id}"
    return q


def parse_spec(query: Mapping[str, str]) -> ShardSpec:
    """ShardSpec from kv=a,b&ffn=c,d&vocab=e,f; ValueError naming the bad parameter."""
    ranges = []
    for name in ("kv", "ffn", "vocab"):
        m = re.fullmatch(r"(\d{1,9}),(\d{1,9})", query.get(name, ""))
        if not m:
            raise ValueError(f"query parameter {name!r} must be START,STOP")
        ranges.append((int(m[1]), int(m[2])))
    optional: list[tuple[int, int] | None] = []
    for name in ("layers", "experts"):  # a pipeline stage's layers, a mixture's experts
        m = re.fullmatch(r"(\d{1,9}),(\d{1,9})", query.get(name, "0,0"))
        if not m:
            raise ValueError(f"query parameter {name!r} must be START,STOP")
        optional.append((int(m[1]), int(m[2])) if name in query else None)
    return ShardSpec(*ranges, *optional)


# --------------------------------------------------------------------------- root side


@dataclass(frozen=True)
class CachedShard:
    path: Path
    size: int
    sha256: str


@dataclass(frozen=True)
class Transfer:
    """The latest transfer to one node; `sent` counts body bytes of every request so far."""

    node: str
    shard: str       # file name: source fingerprint and spec
    size: int        # bytes of the whole shard file
    offset: int      # where the latest request started (a resume starts past 0)
    sent: int        # bytes sent to this node, all requests together
    active: bool
    updated: float   # time.time() of the last change
    done: int = 0    # how far into the file the latest request got


class ShardServer:
    """Serves shard files of one model to holders of the cluster key."""

    chunk = CHUNK  # bytes per read and write of a response body

    def __init__(self, mf: ModelFile, key: bytes, cache_dir: str | os.PathLike[str],
                 cache_bytes: int | None = None) -> None:
        self.mf, self._key = mf, key
        self.cache_dir = Path(cache_dir)
        self.cache_bytes = cache_bytes  # None: keep every slice
        self.gate = httpauth.KeyGate(key)  # replaced by the app's one gate in add_routes
        self._ready: dict[str, CachedShard] = {}
        self._building: dict[str, asyncio.Future[CachedShard]] = {}  # owned here; see close()
        self._transfers: dict[str, Transfer] = {}

    def add_routes(self, app: web.Application) -> None:
        self.gate = httpauth.gate_of(app, self._key)
        app.router.add_get(SHARD_PATH, self.handle)  # HEAD too
        app.on_cleanup.append(lambda _app: self.close())

    def transfers(self) -> dict[str, Transfer]:
        """Per node, the latest shard transfer and the bytes sent so far (a snapshot)."""
        return dict(self._transfers)

    async def close(self) -> None:
        """Wait for shard files being written (a thread cannot be cancelled half way)."""
        if self._building:
            await asyncio.gather(*self._building.values(), return_exceptions=True)

    async def prepare(self, spec: ShardSpec) -> CachedShard:
        """The shard file of `spec`, written on first use; concurrent callers share one writer."""
        name = shard_name(self.mf.fingerprint, spec)
        if name in self._ready and self._ready[name].path.exists():
            slices.touch(self._ready[name].path)  # most recently used: evicted last
            return self._ready[name]
        if name not in self._building:
            job = asyncio.ensure_future(asyncio.to_thread(self._build, spec, name))
            self._building[name] = job
            job.add_done_callback(lambda f: self._built(name, f))
        return await asyncio.shield(self._building[name])  # a client hanging up does not stop the writer

    def _built(self, name: str, job: asyncio.Future[CachedShard]) -> None:
        self._building.pop(name, None)
        if job.cancelled():
            return
        if job.exception() is not None:
            log.error("writing shard %s failed: %s", name, job.exception())
        else:
            self._ready[name] = job.result()

    def _build(self, spec: ShardSpec, name: str) -> CachedShard:
        """(in a thread) Write the shard and its .sha256 unless both are in the cache."""
        path = self.cache_dir / name
        sidecar = path.with_name(name + ".sha256")
        if not path.exists():
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            t0 = time.monotonic()
            write_shard(self.mf, spec, path)
            log.info("wrote shard %s (%d bytes) in %.1f s", name, path.stat().st_size, time.monotonic() - t0)
            sidecar.unlink(missing_ok=True)
        if sidecar.exists():
            digest = sidecar.read_text().strip()
        else:
            digest = _sha256(path)
            slices.write_text_durably(sidecar, digest + "\n")
        slices.touch(path)
        if self.cache_bytes is not None:  # shards being written by other jobs are kept, as are open ones
            slices.evict(self.cache_dir, self.cache_bytes, keep={name, *self._building})
        return CachedShard(path, path.stat().st_size, digest)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            await self.gate.verify(request)
        except httpauth.ProofError as exc:
            log.warning("refused a shard request from %s: %s", request.remote, exc)
            raise web.HTTPForbidden(text=f"cluster key required: {exc}\n") from None
        try:
            spec = parse_spec(request.query)
            check_spec(self.mf, spec)
        except ValueError as exc:
            raise web.HTTPBadRequest(text=f"bad shard request: {exc}\n") from None
        node = request.query.get("node") or request.remote or "?"
        try:
            shard = await self.prepare(spec)
        except OSError as exc:  # disk full, cache dir not writable
            raise web.HTTPServiceUnavailable(text=f"cannot write the shard: {exc}\n") from None
        start, stop = _byte_range(request, shard.size)
        resp = web.StreamResponse(status=200 if (start, stop) == (0, shard.size) else 206, headers={
            "Content-Type": "application/octet-stream", "Accept-Ranges": "bytes",
            HEADER_SHA256: shard.sha256, HEADER_FINGERPRINT: self.mf.fingerprint, "ETag": f'"{shard.sha256}"'})
        if resp.status == 206:
            resp.headers["Content-Range"] = f"bytes {start}-{stop - 1}/{shard.size}"
        resp.content_length = stop - start
        await resp.prepare(request)
        if request.method == "HEAD":
            await resp.write_eof()
            return resp
        log.info("sending shard %s to %s from byte %d of %d", shard.path.name, node, start, shard.size)
        before = self._transfers.get(node)
        t = Transfer(node, shard.path.name, shard.size, start, before.sent if before else 0, True, time.time(), start)
        self._transfers[node] = t
        try:
            async for chunk in self._chunks(shard.path, start, stop):
                await resp.write(chunk)
                t = replace(t, sent=t.sent + len(chunk), done=t.done + len(chunk), updated=time.time())
                self._transfers[node] = t
            await resp.write_eof()
        finally:
            self._transfers[node] = replace(t, active=False, updated=time.time())
        return resp

    async def _chunks(self, path: Path, start: int, stop: int) -> AsyncIterator[bytes]:
        """The file's bytes start..stop, read off the event loop."""
        with path.open("rb") as f:
            f.seek(start)
            left = stop - start
            while left:
                chunk = await asyncio.to_thread(f.read, min(self.chunk, left))
                if not chunk:
                    raise OSError(f"{path} ended {left} bytes early")
                left -= len(chunk)
                yield chunk


def _byte_range(request: web.Request, size: int) -> tuple[int, int]:
    """[start, stop) asked for by the Range header (the whole file without one); 416 if unsatisfiable."""
    unsatisfiable = web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{size}"})
    try:
        rng = request.http_range
    except ValueError:
        raise unsatisfiable from None
    start = 0 if rng.start is None else (max(0, size + rng.start) if rng.start < 0 else rng.start)
    stop = size if rng.stop is None else min(rng.stop, size)
    if start >= stop:
        raise unsatisfiable
    return start, stop


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# --------------------------------------------------------------------------- worker side


@dataclass(frozen=True)
class ShardInfo:
    fingerprint: str
    sha256: str
    size: int


async def shard_info(base_url: str, spec: ShardSpec, key: bytes, *, node_id: str | None = None) -> ShardInfo:
    """What the root would send for `spec` (a signed HEAD: no weight bytes)."""
    path_qs = f"{SHARD_PATH}?{spec_query(spec, node_id)}"
    url = yarl.URL(base_url.rstrip("/") + path_qs, encoded=True)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=600)  # the root may be writing the shard
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            try:
                headers = await httpauth.proven_headers(session, base_url, key, "HEAD", path_qs)
            except httpauth.ProofError as exc:
                raise ShardRefused(str(exc)) from None
            async with session.head(url, headers=headers) as resp:
                if resp.status in (400, 401, 403):
                    raise ShardRefused(f"{url}: the root refused the shard request (HTTP {resp.status}); "
                                       f"does this node hold the cluster key?")
                if resp.status != 200:
                    raise DownloadError(f"{url}: HTTP {resp.status} {resp.reason}")
                sha, fp = resp.headers.get(HEADER_SHA256, ""), resp.headers.get(HEADER_FINGERPRINT, "")
                if not (re.fullmatch(r"[0-9a-f]{64}", sha) and re.fullmatch(r"[0-9a-f]{64}", fp)):
                    raise DownloadError(f"{url}: the answer lacks a valid {HEADER_SHA256} or {HEADER_FINGERPRINT}")
                return ShardInfo(fp, sha, int(resp.headers.get("Content-Length", "0")))
    except aiohttp.ClientError as exc:
        raise DownloadError(f"{url}: cannot reach the root ({exc})") from None


async def fetch_shard(base_url: str, spec: ShardSpec, key: bytes, cache_dir: str | os.PathLike[str],
                      progress: Progress | None = None, *, node_id: str | None = None,
                      fingerprint: str | None = None, poll: float = 0.25, cache_bytes: int | None = None) -> Path:
    """This node's shard file from the root at `base_url`, cached in `cache_dir`.

    With `fingerprint` (the root's model fingerprint) a cached shard is returned
    without asking the root. Raises ShardRefused without the right key,
    DownloadInterrupted (the .part is kept; call again to resume), or
    VerifyError (wrong hash; nothing kept).
    """
    cache_dir = Path(cache_dir)
    if fingerprint is not None and (cached := cache_dir / shard_name(fingerprint, spec)).exists():
        slices.touch(cached)
        return cached
    info = await shard_info(base_url, spec, key, node_id=node_id)
    final = cache_dir / shard_name(info.fingerprint, spec)
    if final.exists():  # a file under this name was hash-checked before it got the name
        slices.touch(final)
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    path_qs = f"{SHARD_PATH}?{spec_query(spec, node_id)}"
    part = final.with_name(final.name + ".part")
    fetch = asyncio.ensure_future(asyncio.to_thread(
        fetch_url_once, base_url.rstrip("/") + path_qs, final, sha256=info.sha256, out=_LogLines(),
        headers=lambda: _proof_or_interrupted(base_url, key, path_qs)))
    try:
        while not fetch.done():
            await asyncio.wait({fetch}, timeout=poll)
            if progress is not None and not fetch.done():
                progress(_size(part), info.size)
    except asyncio.CancelledError:
        # a thread cannot be stopped: it runs until the transfer ends or fails, keeping its .part
        fetch.add_done_callback(_log_outcome)
        raise
    path = fetch.result()
    await asyncio.to_thread(_settle, path, cache_bytes)
    if progress is not None:
        progress(info.size, info.size)
    return path


def _settle(path: Path, cache_bytes: int | None) -> None:
    """(in a thread) A fetched slice (store/download fsynced it around its rename) marked as just
    used, then the cache trimmed to its cap around it."""
    slices.touch(path)
    if cache_bytes is not None:
        slices.evict(path.parent, cache_bytes, keep={path.name})


def _log_outcome(fetch: asyncio.Future[Path]) -> None:
    if not fetch.cancelled() and fetch.exception() is not None:
        log.warning("abandoned shard download ended: %s", fetch.exception())


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


class _LogLines:
    """A minimal text stream for fetch_url's progress lines: each line goes to the log."""

    def __init__(self) -> None:
        self._buf = ""

    def write(self, text: str) -> int:
        self._buf += text
        *lines, self._buf = self._buf.split("\n")
        for line in lines:
            if line.strip():
                log.info("%s", line.strip())
        return len(text)

    def flush(self) -> None:
        return None

    def isatty(self) -> bool:
        return False


def _proof_or_interrupted(base_url: str, key: bytes, path_qs: str) -> dict[str, str]:
    """A key proof for the next GET of a fetch; a root that gives no challenge interrupts it (.part kept)."""
    try:
        return httpauth.proven_headers_sync(base_url, key, "GET", path_qs)
    except httpauth.ProofError as exc:
        raise DownloadInterrupted(str(exc)) from None
