"""The slice cache on a real directory: over its cap it evicts the least recently used slice, never one in use.

Slices are real shard files (parallel/shardfile.py) of the synthetic tiny-odd model. Which slice is least
recently used is set by the test (file mtimes, the cache's use stamp); the expected survivors are computed
here from those stamps, the file sizes and the cap, not by the code under test.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from pathlib import Path

import pytest

from edgetp.model import gguf, llama
from edgetp.parallel.shardfile import shard_name, write_shard
from edgetp.serve.weights import ShardServer, fetch_shard
from edgetp.store import slices
from tests.test_weights_transfer import KEY, start_root

SPECS = [llama.ShardSpec((0, 1), (0, 96), (0, 200)), llama.ShardSpec((1, 2), (96, 160), (200, 400)),
         llama.ShardSpec((2, 3), (160, 224), (400, 600)), llama.ShardSpec((0, 3), (0, 224), (0, 600))]


@pytest.fixture(scope="module")
def tiny(synth_model) -> gguf.ModelFile:
    return gguf.ModelFile(synth_model("tiny-odd", "q8_0"))


def fill(tiny: gguf.ModelFile, directory: Path) -> list[Path]:
    """Four slices, each with its .sha256, used (stamped) oldest first in list order."""
    paths = []
    for age, spec in enumerate(SPECS):
        path = write_shard(tiny, spec, directory / shard_name(tiny.fingerprint, spec))
        path.with_name(path.name + ".sha256").write_text("0" * 64 + "\n")
        stamp = 1_700_000_000 + age * 60
        os.utime(path, (stamp, stamp))
        paths.append(path)
    return paths


def cache_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir())


def pair(path: Path) -> int:
    return path.stat().st_size + path.with_name(path.name + ".sha256").stat().st_size


def test_over_the_cap_the_least_recently_used_slice_goes_with_its_sidecar(tiny, tmp_path):
    paths = fill(tiny, tmp_path)
    cap = cache_bytes(tmp_path) - 1  # one byte over: exactly one slice must go, the oldest
    removed = slices.evict(tmp_path, cap, in_use=set())
    assert removed == [paths[0]]
    assert not paths[0].exists() and not paths[0].with_name(paths[0].name + ".sha256").exists()
    assert all(p.exists() for p in paths[1:])
    assert cache_bytes(tmp_path) <= cap


def test_a_slice_in_use_is_never_evicted_the_next_oldest_goes_instead(tiny, tmp_path):
    paths = fill(tiny, tmp_path)
    cap = cache_bytes(tmp_path) - pair(paths[0]) + pair(paths[1]) // 2  # too much to keep the two oldest
    with open(paths[0], "rb"):  # the oldest is being served: this process has it open
        removed = slices.evict(tmp_path, cap)
    assert removed == [paths[1]]
    assert paths[0].exists() and all(p.exists() for p in paths[2:])


def test_a_slice_mapped_by_a_loaded_model_is_kept(tiny, tmp_path):
    paths = fill(tiny, tmp_path)
    loaded = gguf.ModelFile(paths[0])  # the worker's loaded slice: np.memmap keeps it mapped
    assert loaded.path == paths[0]
    removed = slices.evict(tmp_path, 0)
    assert paths[0].exists(), "the mapped slice was removed"
    assert removed == paths[1:]  # everything else, oldest first


def test_use_refreshes_a_slice_so_the_next_oldest_goes(tiny, tmp_path):
    paths = fill(tiny, tmp_path)
    slices.touch(paths[0])  # used just now
    removed = slices.evict(tmp_path, cache_bytes(tmp_path) - 1, in_use=set())
    assert removed == [paths[1]] and paths[0].exists()


def test_a_part_being_written_is_never_removed_but_counts(tiny, tmp_path):
    paths = fill(tiny, tmp_path)
    part = tmp_path / (paths[3].name + "-next.gguf.part")
    part.write_bytes(secrets.token_bytes(pair(paths[0]) + 1))
    cap = cache_bytes(tmp_path) - part.stat().st_size  # the .part's bytes push out the oldest slice and one more
    removed = slices.evict(tmp_path, cap, in_use=set())
    assert part.exists()
    assert removed == paths[:2]


def test_a_root_keeps_its_slice_cache_under_the_cap_and_keeps_the_one_it_serves(tiny, tmp_path):
    """ShardServer with a cap smaller than any slice: each new slice pushes out every other, except one open
    for a transfer."""
    names = [shard_name(tiny.fingerprint, spec) for spec in SPECS[:3]]

    async def scenario() -> tuple[list[str], list[str]]:
        server = ShardServer(tiny, secrets.token_bytes(32), tmp_path, cache_bytes=1)
        first = await server.prepare(SPECS[0])
        with open(first.path, "rb"):  # a worker is downloading the first one
            await server.prepare(SPECS[1])
            during = sorted(p.name for p in tmp_path.iterdir())
        await server.prepare(SPECS[2])  # nothing open now
        return during, sorted(p.name for p in tmp_path.iterdir())

    during, after = asyncio.run(scenario())
    assert during == sorted([names[0], names[0] + ".sha256", names[1], names[1] + ".sha256"])
    assert after == [names[2], names[2] + ".sha256"]


def test_a_worker_fetch_trims_its_cache_and_keeps_the_slice_it_fetched(tiny, tmp_path):
    """fetch_shard from a real ShardServer on loopback, into a worker cache holding an older slice."""
    worker_cache = tmp_path / "worker"
    worker_cache.mkdir()
    old = fill(tiny, worker_cache)[:1]  # one older slice (and three more) in the worker's cache
    keep_open = open(old[0], "rb")  # noqa: SIM115 - the worker is still computing with it

    async def scenario() -> Path:
        ts, root = await start_root(tiny, tmp_path / "root", chunk=64 * 1024)
        try:
            spec = llama.ShardSpec((0, 2), (0, 128), (0, 300))
            return await fetch_shard(root.url, spec, KEY, worker_cache, cache_bytes=1)
        finally:
            await ts.close()

    try:
        fetched = asyncio.run(scenario())
    finally:
        keep_open.close()
    left = sorted(p.name for p in worker_cache.iterdir())
    assert left == sorted([old[0].name, old[0].name + ".sha256", fetched.name]), left
