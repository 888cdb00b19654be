"""Clusters across hosts: network namespaces on a bridge shaped to 100 Mbit (tools/netns.py).

The test process sits outside the hosts, so every client call runs inside one.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from edgetp.model import gguf, sampling
from edgetp.model.generate import LocalRunner, generate
from edgetp.model.tokenizer import Tokenizer
from edgetp.serve.spawn import start_daemon, start_worker, stop
from tests.test_cli_errors import edgetp
from tools.netns import Testbed, require_root_and_netns

STORY = "Once upon a time, there was a little girl named Lily."


@pytest.fixture(scope="module")
def testbed():
    reason = require_root_and_netns()
    if reason:
        pytest.skip(reason)
    with Testbed(hosts=4, rate="100mbit") as tb:
        yield tb


def test_three_hosts_on_a_100_mbit_lan_answer_as_one_process_does(testbed, stories_path):
    root, h2, h3 = testbed[0], testbed[1], testbed[2]
    ask = [sys.executable, "-m", "edgetp", "ask", "--local", "--model", str(stories_path), "--raw",
           "--temperature", "0", "--max-tokens", "40", "--threads", "1", STORY]
    alone = subprocess.run(ask, capture_output=True, text=True, timeout=120)
    assert alone.returncode == 0, alone.stderr
    workers = []
    try:
        for host in (h2, h3):
            workers.append(start_worker(host=host.address, prefix=host.argv([])))
        addresses = [addr for _, addr in workers]
        assert all(not a.startswith("127.") for a in addresses)
        spread = root.run(ask + ["--workers", ",".join(addresses), "--weights", "1,2,3", "--stats"],
                          timeout=180, check=False)
        assert spread.returncode == 0, spread.stderr
        assert spread.stdout == alone.stdout and len(alone.stdout) > 40
        assert all(a in spread.stderr for a in addresses), "the stats name both remote workers"
    finally:
        for proc, _ in workers:
            stop(proc)


def _ask(host, url: str, *extra: str) -> subprocess.CompletedProcess:
    return host.run([sys.executable, "-m", "edgetp", "ask", "--url", url, "--temperature", "0", "--max-tokens", "40",
                     *extra, "Once upon a time"], timeout=120, check=False)


def _view(host, url: str) -> dict:
    code = f"import json, urllib.request; print(json.dumps(json.load(urllib.request.urlopen('{url}/v1/cluster', timeout=5))))"
    out = host.run([sys.executable, "-c", code], timeout=30, check=False)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def _states(host, url: str) -> dict[str, str]:
    return {n["node_id"]: n["state"] for n in _view(host, url).get("nodes", [])}


def _until(check, seconds: float, what: str) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        if check():
            return time.monotonic() - t0
        time.sleep(0.2)
    raise AssertionError(f"not within {seconds} s: {what}")


def test_daemons_on_three_hosts_elect_serve_survive_a_worker_and_the_root_and_ignore_an_impostor(
        testbed, stories_path, tmp_path):
    hosts = {name: testbed[i] for i, name in enumerate("abcd")}
    key, other = tmp_path / "cluster.key", tmp_path / "impostor.key"
    assert edgetp("keygen", str(key)).returncode == 0 and edgetp("keygen", str(other)).returncode == 0
    mf = gguf.open_model(stories_path)
    tok = Tokenizer.from_metadata(mf.metadata)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Once upon a time"}]), parse_special=True)
    greedy = sampling.SamplingParams(temperature=0)
    expected = "".join(ev.text for ev in generate(LocalRunner(mf, 256), tok, ids, greedy, 40)) + "\n"
    procs, url = {}, {}
    try:
        for name, h in hosts.items():
            procs[name], url[name] = start_daemon(
                stories_path, other if name == "d" else key, f"node-{name}", priority=5 if name == "a" else 0,
                listen=f"{h.address}:7711", data_port=7710, interface=h.address, prefix=h.argv([]))
        # 1. discovery across hosts, then election: node-a leads, node-d (wrong key) is foreign
        _until(lambda: _view(hosts["b"], url["b"]).get("root") == "node-a", 20, "node-b follows node-a")
        _until(lambda: _states(hosts["b"], url["b"]).get("node-d") == "foreign", 20, "node-d listed as foreign")
        # the root plans at the first request over the members it has settled: wait until it counts b and c in
        _until(lambda: {_states(hosts["a"], url["a"]).get(n) for n in ("node-b", "node-c")} == {"ready"}, 60,
               "node-a settles node-b and node-c")
        # 2. a generation asked at node-b runs on a, b and c
        answer = _ask(hosts["b"], url["b"])
        assert answer.returncode == 0 and answer.stdout == expected, answer.stderr
        plan = _view(hosts["a"], url["a"])
        assert sorted(n["node_id"] for n in plan["nodes"] if n["stage"] is not None) == ["node-a", "node-b", "node-c"]
        # 3. node-c killed mid-answer: the stream continues with the same text
        asking = hosts["a"].popen([sys.executable, "-m", "edgetp", "ask", "--url", url["a"], "--temperature", "0",
                                   "--max-tokens", "40", "Once upon a time"], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        head = asking.stdout.read(12)
        procs["c"].kill()
        procs["c"].wait()
        rest = asking.stdout.read()  # the same reader as `head`: communicate() would skip what it buffered
        err = asking.stderr.read()
        assert asking.wait(120) == 0 and head + rest == expected, err
        # 4. the root killed: a new root within 5 s, and it serves the next request
        procs["a"].kill()
        procs["a"].wait()
        took = _until(lambda: _view(hosts["b"], url["b"]).get("root") == "node-b", 5, "node-b elected")
        answer = _ask(hosts["b"], url["b"])
        assert answer.returncode == 0 and answer.stdout == expected, f"elected in {took:.1f} s: {answer.stderr}"
        # 5. the impostor was never planned, and was never sent weights or activations
        assert "node-d" not in {n["node_id"] for n in _view(hosts["b"], url["b"])["nodes"] if n["state"] != "foreign"}
    finally:
        for proc in procs.values():
            stop(proc)


def test_without_multicast_peer_lets_a_node_holding_no_model_join_fetch_its_slice_and_serve(
        testbed, stories_path, tmp_path):
    """mDNS stays on each host's own loopback, so no advert crosses the LAN: only `--peer` joins them.

    node-y lists node-x as its one peer and holds no model; node-x learns of
    node-y from the introduction, plans over both, and node-y fetches its slice.
    """
    x, y, z = testbed[0], testbed[1], testbed[2]
    key = tmp_path / "cluster.key"
    assert edgetp("keygen", str(key)).returncode == 0
    mf = gguf.open_model(stories_path)
    tok = Tokenizer.from_metadata(mf.metadata)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Once upon a time"}]), parse_special=True)
    expected = "".join(ev.text for ev in generate(LocalRunner(mf, 256), tok, ids,
                                                  sampling.SamplingParams(temperature=0), 40)) + "\n"
    procs = {}
    try:
        procs["x"], url_x = start_daemon(stories_path, key, "peer-x", priority=5, listen=f"{x.address}:7711",
                                         data_port=7710, interface="127.0.0.1", prefix=x.argv([]),
                                         env={"EDGETP_CACHE_DIR": str(tmp_path / "x")})
        procs["y"], url_y = start_daemon("none", key, "peer-y", listen=f"{y.address}:7711", data_port=7710,
                                         interface="127.0.0.1", prefix=y.argv([]), extra=["--peer", f"{x.address}:7711"],
                                         env={"EDGETP_CACHE_DIR": str(tmp_path / "y")})
        # the control: same key, same LAN, no --peer; with no multicast between hosts nobody ever hears of it
        procs["z"], _ = start_daemon(stories_path, key, "peer-z", listen=f"{z.address}:7711", data_port=7710,
                                     interface="127.0.0.1", prefix=z.argv([]), env={"EDGETP_CACHE_DIR": str(tmp_path / "z")})
        _until(lambda: _view(y, url_y).get("root") == "peer-x", 20, "peer-y follows peer-x")
        # a member, not only heard of: until it settles ("joining") the root plans without it, and a
        # request then would be served without peer-y (a CI run on a loaded VM asked that early)
        _until(lambda: _states(x, url_x).get("peer-y") == "ready", 30,
               "peer-x learned of peer-y from its introduction and took it in")
        answer = _ask(y, url_y)
        assert answer.returncode == 0 and answer.stdout == expected, answer.stderr
        nodes = {n["node_id"]: n for n in _view(x, url_x)["nodes"]}
        assert nodes["peer-y"]["address"].startswith(y.address), nodes
        fetched = list((tmp_path / "y" / "shards").glob("*.gguf"))
        assert len(fetched) == 1 and nodes["peer-y"]["transfer"] == [fetched[0].stat().st_size] * 2
        assert "peer-z" not in nodes and "peer-z" not in {n["node_id"] for n in _view(y, url_y)["nodes"]}
    finally:
        for proc in procs.values():
            stop(proc)
