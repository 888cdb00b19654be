"""Workers without the root's model: each fetches just its slice from the root, and the answer is unchanged.

Three `edgetp serve --key` daemons on loopback, each with its own cache:
node-a holds stories260K and leads; node-b holds no model (`--model none`);
node-c holds a different model (a synthetic one). References: the text of
the single-node engine on stories260K, the bytes and sha256 the root wrote
for each slice, and the transfer events a real WebSocket client receives.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import urllib.error
import urllib.request

import aiohttp
import pytest

from edgetp.serve.spawn import start_daemon, stop
from tests.test_cli_errors import edgetp
from tests.test_daemon import expected, stream, view, wait_for  # noqa: F401 - `expected` is a fixture

RUN = f"{threading.get_native_id()}"  # mDNS refuses a name already on the network: unique per run


class EventLog:
    """Every record of GET /v1/events, collected by a real WebSocket client on its own thread."""

    def __init__(self, url: str) -> None:
        self.url, self.records = url, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()

    async def _run(self) -> None:
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(f"{self.url}/v1/events", timeout=aiohttp.ClientWSTimeout(ws_close=2)) as ws:
                while not self._stop.is_set():
                    try:
                        msg = await ws.receive(timeout=0.2)
                    except asyncio.TimeoutError:
                        continue
                    if msg.type != aiohttp.WSMsgType.TEXT:
                        return
                    self.records.append(json.loads(msg.data))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


def models_of(url: str) -> list[str]:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as resp:
        return [m["id"] for m in json.load(resp)["data"]]


def test_workers_without_the_model_fetch_their_slice_and_answer_as_one_process(
        stories_path, synth_model, tmp_path, expected):  # noqa: F811
    key = tmp_path / "cluster.key"
    assert edgetp("keygen", str(key)).returncode == 0
    other_model = synth_model("tiny-odd", "q8_0")
    cache = {n: tmp_path / f"cache-{n}" for n in "abc"}
    procs, url = {}, {}
    log = None
    try:
        for name, model in (("a", stories_path), ("b", "none"), ("c", other_model)):
            procs[name], url[name] = start_daemon(model, key, f"slices-{name}-{RUN}", priority=5 if name == "a" else 0,
                                                  env={"EDGETP_CACHE_DIR": str(cache[name])})
        a, b, c = (f"slices-{n}-{RUN}" for n in "abc")
        name_of = {b: "b", c: "c"}
        for name in "bc":
            wait_for(lambda n=name: view(url[n])["root"] == a, 30, f"node {name} follows {a}")
        wait_for(lambda: {n["node_id"] for n in view(url["a"])["nodes"] if n["state"] == "ready"} >= {a, b, c}, 60,
                 "node-a sees all three settled")
        assert models_of(url["b"]) == ["stories260K"], "a node without a model names the root's"
        log = EventLog(url["a"])
        wait_for(lambda: log.records, 10, "the event stream's snapshot")

        # asked at the node that holds no model: the root plans over all three, b and c fetch their slices
        assert stream(url["b"]) == expected

        nodes = {n["node_id"]: n for n in view(url["a"])["nodes"]}
        assert set(nodes) == {a, b, c} and all(n["state"] == "ready" for n in nodes.values())
        for node in (b, c):
            fetched = list((cache[name_of[node]] / "shards").glob("*.gguf"))
            assert len(fetched) == 1, f"{node} caches exactly its one slice"
            written = cache["a"] / "shards" / fetched[0].name
            assert fetched[0].read_bytes() == written.read_bytes()
            digest = hashlib.sha256(fetched[0].read_bytes()).hexdigest()
            assert (cache["a"] / "shards" / f"{fetched[0].name}.sha256").read_text().strip() == digest
            size = fetched[0].stat().st_size
            assert nodes[node]["transfer"] == [size, size], "the cluster API shows the finished transfer"
            assert 0 < size < stories_path.stat().st_size
            assert nodes[node]["vocab_rows"][1] > nodes[node]["vocab_rows"][0], "it computes a real share"
        transfers = [r for r in log.records if r.get("type") == "cluster" and r["event"] == "transfer"]
        finished = {r["node_id"]: r["detail"] for r in transfers if r["detail"]["done"] == r["detail"]["total"]}
        assert set(finished) == {b, c}, transfers
        assert not list((cache["a"] / "shards").glob("*.part")) and not list((cache["b"] / "shards").glob("*.part"))

        # the node without a model never leads: with the root gone, node-c (its own model) takes over
        stop(procs.pop("a"))
        wait_for(lambda: view(url["b"])["root"] == c, 15, f"{c} elected, never {b}")
        assert models_of(url["b"]) == [other_model.stem], "the cluster now serves the new root's model"
    finally:
        if log is not None:
            log.close()
        for proc in procs.values():
            stop(proc)


def test_profile_on_request_needs_the_key_and_re_announces(stories_path, tmp_path):
    key, other = tmp_path / "cluster.key", tmp_path / "other.key"
    assert edgetp("keygen", str(key)).returncode == 0 and edgetp("keygen", str(other)).returncode == 0
    proc, url = start_daemon(stories_path, key, f"profile-{RUN}", env={"EDGETP_CACHE_DIR": str(tmp_path / "c")})
    try:
        wait_for(lambda: view(url)["root"] == f"profile-{RUN}", 20, "the lone node leads")
        refused = edgetp("profile", "--url", url, "--key", str(other))
        assert refused.returncode == 4 and "403" in refused.stderr and "Traceback" not in refused.stderr
        done = edgetp("profile", "--url", url, "--key", str(key))
        assert done.returncode == 0 and done.stdout.startswith(f"profile-{RUN}: "), done.stderr
        with pytest.raises(urllib.error.HTTPError) as unsigned:
            urllib.request.urlopen(urllib.request.Request(f"{url}/v1/cluster/profile", data=b"{}"), timeout=10)
        assert unsigned.value.code == 403
    finally:
        stop(proc)
