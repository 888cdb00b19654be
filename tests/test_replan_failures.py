"""A failed re-plan never stops serving: real `edgetp serve --key` daemons on loopback.

- a peer whose data port refuses (the process killed, its advert not yet timed out) is planned
  around, the root answers alone with the single-process text;
- a peer too small to hold any share (its `max_memory_mb` below its own runtime) is left out with
  the planner's reason, and planned in again once it restarts with room;
- a root that cannot plan even alone (its cap lowered, applied by SIGHUP) answers 503 saying why,
  withholds its systemd watchdog pings (a real notify socket) meanwhile, and serves the next
  request once the cap is raised again;
- the same for a static root (`--workers`) whose worker is lost, which also shows no plan meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from edgetp.cluster import peering
from edgetp.model import gguf, sampling
from edgetp.model.generate import LocalRunner, generate
from edgetp.model.tokenizer import Tokenizer
from edgetp.net import auth
from edgetp.serve.spawn import start_daemon, stop
from tests.test_cli_errors import edgetp
from tests.test_daemon import view, wait_for

PROMPT = "Once upon a time"
TOKENS = 24


@pytest.fixture(scope="module")
def expected(stories_path) -> str:
    mf = gguf.open_model(stories_path)
    tok = Tokenizer.from_metadata(mf.metadata)
    greedy = sampling.SamplingParams(temperature=0)
    return "".join(ev.text for ev in generate(LocalRunner(mf, 256), tok, tok.encode(PROMPT),
                                              greedy, TOKENS))


@pytest.fixture
def key(tmp_path) -> Path:
    path = tmp_path / "cluster.key"
    assert edgetp("keygen", str(path)).returncode == 0
    return path


def complete(url: str) -> tuple[int, dict]:
    body = json.dumps({"model": "stories260K", "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def planned(url: str) -> list[str]:
    """The nodes of the root's plan (its view lists the members outside it too, with no stage)."""
    return sorted(n["node_id"] for n in view(url)["nodes"] if n["stage"] is not None)


def ready_members(url: str) -> set[str]:
    return {n["node_id"] for n in view(url)["nodes"] if n["state"] == "ready"}


def reprofile(url: str, key: Path) -> None:
    """POST /v1/cluster/profile, signed: the node measures again and announces it (the root re-plans)."""
    async def go() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            await peering.signed_post(session, url, peering.PROFILE_PATH, auth.read_key(key))
    asyncio.run(go())


def text_of(answer: dict) -> str:
    return answer["choices"][0]["text"]


def write_config(path: Path, max_memory_mb: int | None) -> None:
    path.write_text("" if max_memory_mb is None else f"max_memory_mb = {max_memory_mb}\n")


def log_of(proc) -> str:
    """Everything a daemon logged, once it is stopped (SIGTERM; waits for it)."""
    proc.send_signal(signal.SIGTERM)
    proc.wait(20)
    return proc.stderr.read()


# --------------------------------------------------------------------------- tests


def test_a_peer_whose_data_port_refuses_is_planned_around_and_the_root_answers_alone(
        stories_path, key, expected):
    procs = {}
    try:
        procs["a"] = start_daemon(stories_path, key, "node-a", priority=5)
        procs["b"] = start_daemon(stories_path, key, "node-b")
        url = procs["a"][1]
        wait_for(lambda: view(procs["b"][1])["root"] == "node-a" and "node-b" in ready_members(url),
                 30, "node-a leads and sees node-b")
        status, answer = complete(url)
        assert status == 200 and text_of(answer) == expected
        assert planned(url) == ["node-a", "node-b"]

        # node-b dies: its data port refuses, while its advert lives until the heartbeats time out.
        # A re-profile of the root makes the next request plan again, over node-b too.
        procs["b"][0].kill()
        procs["b"][0].wait()
        reprofile(url, key)
        status, answer = complete(url)
        assert status == 200, answer
        assert text_of(answer) == expected
        assert planned(url) == ["node-a"]
        status, answer = complete(url)  # and the next one too
        assert status == 200 and text_of(answer) == expected
    finally:
        for proc, _ in procs.values():
            stop(proc)


def test_a_peer_too_small_for_any_share_is_left_out_and_planned_in_once_it_has_room(
        stories_path, key, expected):
    procs = {}
    try:
        procs["a"] = start_daemon(stories_path, key, "node-a", priority=5)
        # 1 MiB for the whole of edgetp: less than its own runtime, so no room for any share
        procs["b"] = start_daemon(stories_path, key, "node-b", env={"EDGETP_MAX_MEMORY_MB": "1"})
        url = procs["a"][1]
        wait_for(lambda: view(procs["b"][1])["root"] == "node-a" and "node-b" in ready_members(url),
                 30, "node-a leads and sees node-b")
        assert [n["mem_free"] for n in view(procs["b"][1])["nodes"] if n["node_id"] == "node-b"] == [0]

        status, answer = complete(url)
        assert status == 200, answer
        assert text_of(answer) == expected
        assert planned(url) == ["node-a"], "node-b was left out"
        # shown as idle, neither lost nor in the plan (issue 15: a node too slow or too small to help)
        assert {n["node_id"]: n["state"] for n in view(url)["nodes"]}["node-b"] == "idle"
        status, answer = complete(url)  # and the next one, while node-b waits out its backoff
        assert status == 200 and text_of(answer) == expected

        stop(procs["b"][0])  # the cause goes away: node-b restarts without the cap
        procs["b"] = start_daemon(stories_path, key, "node-b")

        def planned_with_b() -> bool:
            status, answer = complete(url)
            assert status == 200 and text_of(answer) == expected, answer
            return planned(url) == ["node-a", "node-b"]
        wait_for(planned_with_b, 60, "node-b planned in again")
        logged = log_of(procs["a"][0])
        assert "planning without node-b" in logged and "node node-b: needs" in logged, logged[-3000:]
    finally:
        for proc, _ in procs.values():
            stop(proc)


def _recv_all(sock: socket.socket) -> list[str]:
    got = []
    while True:
        try:
            got.append(sock.recv(4096).decode())
        except BlockingIOError:
            return got


def test_a_root_that_cannot_plan_even_alone_says_why_withholds_the_watchdog_and_recovers(
        stories_path, key, expected, tmp_path):
    path = str(tmp_path / "notify.sock")
    config = tmp_path / "edgetp.toml"
    write_config(config, None)
    node = f"solo-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        proc, url = start_daemon(stories_path, key, node, extra=["--config", str(config)],
                                 env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000"})  # a ping every 0.2 s
        try:
            wait_for(lambda: view(url)["root"] == node, 20, "the node leads itself")
            status, answer = complete(url)
            assert status == 200 and text_of(answer) == expected

            sock.setblocking(False)
            time.sleep(1.0)
            assert "WATCHDOG=1" in _recv_all(sock), "healthy while serving"

            write_config(config, 1)  # 1 MiB for edgetp: not even this node's runtime fits
            proc.send_signal(signal.SIGHUP)
            status, answer = wait_for(lambda: (r := complete(url))[0] == 503 and r, 30, "a 503 under the cap")
            message = answer["error"]["message"]
            assert "cannot serve" in message and f"node {node}: needs" in message and "0 B free" in message, answer
            time.sleep(1.0)
            _recv_all(sock)  # the ping that may have left before the failure
            time.sleep(1.0)
            quiet = _recv_all(sock)
            assert "WATCHDOG=1" not in quiet, f"no pings while it cannot serve: {quiet}"

            write_config(config, None)  # the cap is lifted
            proc.send_signal(signal.SIGHUP)
            status, answer = wait_for(lambda: (r := complete(url))[0] == 200 and r, 30, "serving again")
            assert text_of(answer) == expected, answer
            time.sleep(1.0)
            again = _recv_all(sock)
            assert "WATCHDOG=1" in again and any("serving again" in m for m in again), again
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(20) == 0
        finally:
            stop(proc)


def test_a_static_root_that_cannot_plan_shows_no_plan_rather_than_one_node_holding_everything(
        stories_path, expected, tmp_path):
    """`edgetp serve --workers`: its worker gone and its own cap too small to serve alone, it answers
    503 saying why (the request that finds the worker gone too), /v1/cluster shows the root and the worker in no plan (no shares), and once the cap
    is lifted the next request re-plans and is answered (it used to fail every request with a 500
    while no runner held the context length, so nothing ever re-planned)."""
    from edgetp.serve.spawn import start_worker  # noqa: PLC0415
    from tests.test_serve import start_server  # noqa: PLC0415

    config = tmp_path / "edgetp.toml"
    write_config(config, None)
    (worker, address), root = start_worker(), None
    try:
        root, url = start_server("--model", str(stories_path), "--workers", address, "--config", str(config),
                                 "--parallel", "tp")  # the worker in the plan, so losing it re-plans
        status, answer = complete(url)
        assert status == 200 and text_of(answer) == expected
        assert {n["address"] for n in view(url)["nodes"]} == {"local", address}

        write_config(config, 1)  # 1 MiB: this node cannot even hold its own runtime
        root.send_signal(signal.SIGHUP)
        stop(worker)
        status, answer = complete(url)  # the worker is found gone mid-request: a 503 to retry, not a 500
        assert status == 503 and "no plan" in answer["error"]["message"], answer
        nodes = {n["address"]: n for n in view(url)["nodes"]}
        assert set(nodes) == {"local", address}
        assert nodes["local"]["state"] == "joining" and nodes[address]["state"] in ("joining", "lost")
        assert all(tuple(n["ffn_cols"]) == (0, 0) and tuple(n["vocab_rows"]) == (0, 0) for n in nodes.values())
        assert view(url)["plan"] is None

        write_config(config, None)
        root.send_signal(signal.SIGHUP)
        status, answer = wait_for(lambda: (r := complete(url))[0] == 200 and r, 60, "serving alone")
        assert text_of(answer) == expected
        mine = {n["address"]: n for n in view(url)["nodes"]}["local"]
        assert mine["state"] == "ready" and tuple(mine["vocab_rows"]) != (0, 0)
        assert "Traceback" not in log_of(root)
    finally:
        for proc in (root, worker):
            if proc:
                stop(proc)
