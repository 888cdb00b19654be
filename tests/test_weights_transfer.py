"""Shard transfer root -> worker over HTTP (edgetp/serve/weights.py), against a real aiohttp server.

Each test starts a ShardServer on 127.0.0.1 and stops it before it ends. The
worker side is `fetch_shard`, whose blocking download runs in a thread
while the server runs on the test's loop. References: the bytes and sha256
of the file the root wrote, the forward pass of the full model file, and
the server's own count of body bytes sent per node.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import pytest_asyncio
import yarl
from aiohttp import web
from aiohttp.test_utils import TestServer

from edgetp.model import gguf, llama
from edgetp.net import httpauth
from edgetp.parallel.shardfile import shard_name
from edgetp.serve import weights
from edgetp.serve.weights import SHARD_PATH, ShardRefused, ShardServer, fetch_shard, spec_query
from edgetp.store.errors import DownloadInterrupted, VerifyError

KEY = bytes(range(32))
WRONG_KEY = bytes(range(1, 33))
SPEC = llama.ShardSpec((1, 3), (40, 160), (100, 600))  # FFN range splits a block: ffn_down travels as f32


class CuttingServer(ShardServer):
    """A ShardServer that hangs up after `cut_after` body bytes of the next response."""

    cut_after: int | None = None

    async def _chunks(self, path, start, stop):
        sent = 0
        async for chunk in super()._chunks(path, start, stop):
            if self.cut_after is not None and sent + len(chunk) >= self.cut_after:
                keep, self.cut_after = self.cut_after - sent, None
                yield chunk[:keep]
                raise ConnectionResetError("test: hanging up mid-body")
            sent += len(chunk)
            yield chunk


@dataclass
class Root:
    server: CuttingServer
    url: str
    seen: list[tuple[str, str]]  # (method, raw path) of every request

    async def signed_get(self, path_qs: str, key: bytes = KEY) -> tuple[yarl.URL, dict[str, str]]:
        """The URL and the headers proving `key` for one GET of it (a fresh challenge from this root)."""
        return yarl.URL(self.url + path_qs, encoded=True), await proof(self.url, key, path_qs)


async def proof(url: str, key: bytes, path_qs: str) -> dict[str, str]:
    return await asyncio.to_thread(httpauth.proven_headers_sync, url, key, "GET", path_qs)


async def start_root(mf: gguf.ModelFile, cache: Path, chunk: int):
    server = CuttingServer(mf, KEY, cache)
    server.chunk = chunk
    seen: list[tuple[str, str]] = []

    @web.middleware
    async def record(request, handler):
        if request.path != httpauth.CHALLENGE_PATH:  # the nonces a key proof fetches first
            seen.append((request.method, request.raw_path))
        return await handler(request)

    app = web.Application(middlewares=[record])
    server.add_routes(app)
    ts = TestServer(app, host="127.0.0.1")
    await ts.start_server()
    return ts, Root(server, str(ts.make_url("")).rstrip("/"), seen)


@pytest.fixture(scope="module")
def tiny(synth_model) -> gguf.ModelFile:
    return gguf.ModelFile(synth_model("tiny-odd", "q8_0"))


@pytest_asyncio.fixture
async def root(tiny, tmp_path):
    ts, r = await start_root(tiny, tmp_path / "root-cache", chunk=16 * 1024)  # many chunks for a 300 KB shard
    try:
        yield r
    finally:
        await ts.close()


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def outputs(source: gguf.ModelFile, embed_from: gguf.ModelFile, spec: llama.ShardSpec):
    shard = llama.Shard(llama.load_weights(source, spec), ctx=8)
    h = shard.forward(llama.embed(embed_from, [3, 1, 4]), 0)
    h2 = shard.forward(llama.embed(embed_from, [1]), 3)
    return [a.view(np.uint32).copy() for a in (h, shard.logits(h), h2, shard.logits(h2))]


def assert_same_outputs(a, b):
    for x, y in zip(a, b):
        assert x.shape == y.shape and np.array_equal(x, y)


async def test_a_worker_fetches_just_its_slice_and_computes_what_the_full_file_computes(root, tiny, tmp_path):
    calls = []
    path = await fetch_shard(root.url, SPEC, KEY, tmp_path / "worker", progress=lambda d, t: calls.append((d, t)),
                             node_id="w1")
    served = root.server.cache_dir / shard_name(tiny.fingerprint, SPEC)
    assert path == tmp_path / "worker" / shard_name(tiny.fingerprint, SPEC)
    assert path.read_bytes() == served.read_bytes() and path.stat().st_size < tiny.path.stat().st_size
    assert sha256(path) == (served.parent / (served.name + ".sha256")).read_text().strip()
    assert_same_outputs(outputs(gguf.ModelFile(path), tiny, SPEC), outputs(tiny, tiny, SPEC))
    size = served.stat().st_size
    assert calls[-1] == (size, size) and [d for d, _ in calls] == sorted(d for d, _ in calls)
    t = root.server.transfers()["w1"]
    assert (t.sent, t.size, t.offset, t.active) == (size, size, 0, False)
    assert not list((tmp_path / "worker").glob("*.part"))


async def test_a_second_fetch_is_a_no_op(root, tiny, tmp_path):
    first = await fetch_shard(root.url, SPEC, KEY, tmp_path / "w", node_id="w1")
    sent, n_requests = root.server.transfers()["w1"].sent, len(root.seen)
    again = await fetch_shard(root.url, SPEC, KEY, tmp_path / "w", node_id="w1")
    assert again == first and root.server.transfers()["w1"].sent == sent
    assert [m for m, _ in root.seen[n_requests:]] == ["HEAD"]  # asks what the shard is; no body
    n_requests = len(root.seen)
    assert await fetch_shard(root.url, SPEC, KEY, tmp_path / "w", fingerprint=tiny.fingerprint) == first
    assert len(root.seen) == n_requests  # knowing the fingerprint, it does not even ask


async def test_an_interrupted_transfer_resumes_and_the_second_request_carries_exactly_the_remainder(root, tmp_path):
    root.server.cut_after = 100_000
    worker = tmp_path / "w"
    with pytest.raises(DownloadInterrupted, match="kept"):
        await fetch_shard(root.url, SPEC, KEY, worker, node_id="w1")
    parts = list(worker.glob("*.part"))
    assert len(parts) == 1 and not parts[0].with_suffix("").exists()
    have, sent_before = parts[0].stat().st_size, root.server.transfers()["w1"].sent
    assert have == sent_before == 100_000
    path = await fetch_shard(root.url, SPEC, KEY, worker, node_id="w1")
    size = path.stat().st_size
    t = root.server.transfers()["w1"]
    assert t.offset == have and t.sent - sent_before == size - have
    assert ("GET", f"{SHARD_PATH}?{spec_query(SPEC, 'w1')}") in root.seen
    assert path.read_bytes() == next(root.server.cache_dir.glob("*.gguf")).read_bytes()
    assert not list(worker.glob("*.part"))


async def test_no_key_or_a_wrong_key_gets_403_and_no_weight_bytes(root, tmp_path):
    path_qs = f"{SHARD_PATH}?{spec_query(SPEC, 'intruder')}"
    async with aiohttp.ClientSession() as session:
        for headers in ({}, await proof(root.url, WRONG_KEY, path_qs)):
            async with session.get(yarl.URL(root.url + path_qs, encoded=True), headers=headers) as resp:
                body = await resp.read()
                assert resp.status == 403 and b"GGUF" not in body and len(body) < 200
    with pytest.raises(ShardRefused, match="403"):
        await fetch_shard(root.url, SPEC, WRONG_KEY, tmp_path / "w", node_id="intruder")
    assert root.server.transfers() == {}
    assert not root.server.cache_dir.exists()  # not even written for them
    assert not (tmp_path / "w").exists() or not list((tmp_path / "w").iterdir())


async def test_a_replayed_signed_request_is_refused(root):
    url, headers = await root.signed_get(f"{SHARD_PATH}?{spec_query(SPEC, 'w1')}")
    async with aiohttp.ClientSession() as session:
        async with session.get(url, headers=headers) as resp:
            assert resp.status == 200 and (await resp.read())[:4] == b"GGUF"
        sent = root.server.transfers()["w1"].sent
        async with session.get(url, headers=headers) as resp:
            body = await resp.read()
            assert resp.status == 403 and b"GGUF" not in body and b"used" in body
    assert root.server.transfers()["w1"].sent == sent


async def test_the_signature_covers_the_spec_in_the_query(root):
    signed_for = f"{SHARD_PATH}?{spec_query(SPEC, 'w1')}"
    other = f"{SHARD_PATH}?{spec_query(llama.ShardSpec((0, 3), (0, 224), (0, 600)), 'w1')}"
    async with aiohttp.ClientSession() as session:
        headers = await proof(root.url, KEY, signed_for)
        async with session.get(yarl.URL(root.url + other, encoded=True), headers=headers) as resp:
            assert resp.status == 403
    assert root.server.transfers() == {}


async def test_a_corrupted_download_is_refused_and_leaves_no_file_under_the_final_name(root, tiny, tmp_path):
    shard = await root.server.prepare(SPEC)  # written and hashed
    data = bytearray(shard.path.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.path.write_bytes(bytes(data))
    worker = tmp_path / "w"
    with pytest.raises(VerifyError, match="sha256"):
        await fetch_shard(root.url, SPEC, KEY, worker, node_id="w1")
    assert not (worker / shard_name(tiny.fingerprint, SPEC)).exists()
    assert not list(worker.glob("*.part"))


async def test_range_requests_get_exactly_the_asked_bytes_and_416_past_the_end(root):
    shard = await root.server.prepare(SPEC)
    whole = shard.path.read_bytes()
    path_qs = f"{SHARD_PATH}?{spec_query(SPEC, 'w1')}"
    async with aiohttp.ClientSession() as session:
        for rng, want in (("bytes=100-199", whole[100:200]), ("bytes=-50", whole[-50:]),
                          (f"bytes={len(whole) - 10}-", whole[-10:])):
            url, headers = await root.signed_get(path_qs)
            async with session.get(url, headers={**headers, "Range": rng}) as resp:
                assert resp.status == 206 and await resp.read() == want
                assert resp.headers["Content-Range"].endswith(f"/{len(whole)}")
                assert resp.headers[weights.HEADER_SHA256] == hashlib.sha256(whole).hexdigest()
        url, headers = await root.signed_get(path_qs)
        async with session.get(url, headers={**headers, "Range": f"bytes={len(whole)}-"}) as resp:
            assert resp.status == 416 and resp.headers["Content-Range"] == f"bytes */{len(whole)}"


async def test_a_spec_outside_the_model_is_a_400(root):
    bad = f"{SHARD_PATH}?kv=0,9&ffn=0,32&vocab=0,10"
    async with aiohttp.ClientSession() as session:
        url, headers = await root.signed_get(bad)
        async with session.get(url, headers=headers) as resp:
            assert resp.status == 400 and "kv_groups" in await resp.text()
        url, headers = await root.signed_get(f"{SHARD_PATH}?kv=0,1")
        async with session.get(url, headers=headers) as resp:
            assert resp.status == 400 and "'ffn'" in await resp.text()


async def test_workers_asking_at_once_share_one_written_shard(root, tmp_path, monkeypatch):
    writes = []
    real = weights.write_shard
    monkeypatch.setattr(weights, "write_shard", lambda *a: writes.append(a[1]) or real(*a))
    paths = await asyncio.gather(*(fetch_shard(root.url, SPEC, KEY, tmp_path / f"w{i}", node_id=f"w{i}")
                                   for i in range(3)))
    assert writes == [SPEC]
    assert len({p.read_bytes() for p in paths}) == 1
    assert {n: t.sent for n, t in root.server.transfers().items()} == {f"w{i}": paths[0].stat().st_size
                                                                      for i in range(3)}


async def test_a_restarted_root_serves_the_shard_it_wrote_before_without_writing_it_again(root, tiny, monkeypatch):
    first = await root.server.prepare(SPEC)
    writes = []
    monkeypatch.setattr(weights, "write_shard", lambda *a: writes.append(a))
    again = await ShardServer(tiny, KEY, root.server.cache_dir).prepare(SPEC)
    assert again == first and writes == []


async def test_a_smollm2_slice_travels_in_megabyte_chunks_and_computes_what_the_full_file_computes(
        smollm2_path, tmp_path):
    mf = gguf.ModelFile(smollm2_path)
    spec = llama.ShardSpec((0, 1), (512, 1024), (0, 16384))
    ts, root = await start_root(mf, tmp_path / "root", chunk=weights.CHUNK)
    try:
        path = await fetch_shard(root.url, spec, KEY, tmp_path / "w", node_id="pi-1")
        assert root.server.transfers()["pi-1"].sent == path.stat().st_size > 10 * weights.CHUNK
    finally:
        await ts.close()
    assert_same_outputs(outputs(gguf.ModelFile(path), mf, spec), outputs(mf, mf, spec))


async def test_a_worker_fetches_just_its_whole_experts_of_a_mixture(synth_model, tmp_path):
    moe = gguf.ModelFile(synth_model("tiny-odd", "q8_0", arch="mixtral", n_experts=8, n_experts_used=2))
    spec = llama.ShardSpec((0, 1), (0, 224), (0, 600), None, (2, 5))  # experts 2, 3 and 4, every column
    ts, r = await start_root(moe, tmp_path / "root-cache", chunk=64 * 1024)
    try:
        path = await fetch_shard(r.url, spec, KEY, tmp_path / "worker", node_id="w1")
    finally:
        await ts.close()
    assert "experts2-5" in path.name and path.stat().st_size < moe.path.stat().st_size / 2
    assert_same_outputs(outputs(gguf.ModelFile(path), moe, spec), outputs(moe, moe, spec))
