"""The self-forming cluster: `edgetp serve --key` daemons on loopback, as a user runs them.

One sequence, as the daemon issue lists it: discovery and election, a
generation through any node, a worker suspended mid-answer, the root suspended,
an impostor with another key ignored throughout, and a clean leave.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
import urllib.request

import openai
import pytest

from edgetp.model import gguf, sampling
from edgetp.model.generate import LocalRunner, generate
from edgetp.model.tokenizer import Tokenizer
from edgetp.serve.spawn import start_daemon, stop
from tests.test_cli_errors import edgetp

PROMPT = "Once upon a time"
LONG = 400  # tokens: still being generated when a test's signals land


def view(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/v1/cluster", timeout=5) as resp:
        return json.load(resp)


def wait_for(check, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if result := check():
                return result
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"not within {seconds} s: {what}")


def stream(url: str, kill_after: int | None = None, victim: subprocess.Popen | None = None,
           retries: int = 2, max_tokens: int = 48, how: signal.Signals = signal.SIGKILL, timeout: float = 120,
           also: subprocess.Popen | None = None) -> str:
    """The greedy text of PROMPT streamed through `url`; `retries` as the openai client's (0: one attempt).

    After chunk `kill_after`, `victim` gets signal `how`: SIGKILL (waited for) or SIGSTOP (suspended);
    `also` (when given) is then suspended at once."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=timeout, max_retries=retries)
    text = ""
    for n, chunk in enumerate(client.completions.create(prompt=PROMPT, model="stories260K", max_tokens=max_tokens,
                                                        temperature=0, stream=True), start=1):
        text += chunk.choices[0].text
        if n == kill_after:
            victim.send_signal(how)
            if also is not None:
                also.send_signal(signal.SIGSTOP)
            if how == signal.SIGKILL:
                victim.wait()
    return text


@pytest.fixture(scope="module")
def expected(stories_path) -> str:
    mf = gguf.open_model(stories_path)
    tok = Tokenizer.from_metadata(mf.metadata)
    greedy = sampling.SamplingParams(temperature=0)
    return "".join(ev.text for ev in generate(LocalRunner(mf, 256), tok, tok.encode(PROMPT), greedy, 48))


@pytest.fixture(scope="module")
def long(stories_path) -> str:
    """The greedy text of LONG tokens: an answer still being generated when a test's signals land."""
    mf = gguf.open_model(stories_path)
    tok = Tokenizer.from_metadata(mf.metadata)
    greedy = sampling.SamplingParams(temperature=0)
    return "".join(ev.text for ev in generate(LocalRunner(mf, 512), tok, tok.encode(PROMPT), greedy, LONG))


def test_daemons_form_a_cluster_serve_through_any_node_and_survive_losing_a_worker_and_the_root(
        stories_path, tmp_path, expected, long):
    key, other = tmp_path / "cluster.key", tmp_path / "impostor.key"
    assert edgetp("keygen", str(key)).returncode == 0 and edgetp("keygen", str(other)).returncode == 0
    procs = {}
    try:
        procs["a"] = start_daemon(stories_path, key, "node-a", priority=5)
        procs["b"] = start_daemon(stories_path, key, "node-b")
        procs["c"] = start_daemon(stories_path, key, "node-c")
        procs["d"] = start_daemon(stories_path, other, "node-d")  # same network, wrong key
        url = {name: u for name, (_, u) in procs.items()}

        # 1. discovery, then election: everyone of the cluster agrees node-a leads; node-d is foreign
        for name in "bc":
            wait_for(lambda n=name: view(url[n])["root"] == "node-a", 20, f"node-{name} follows node-a")
        for name in "ab":
            wait_for(lambda n=name: {v["node_id"]: v["state"] for v in view(url[n])["nodes"]}.get("node-d") == "foreign",
                     20, f"node-d listed as foreign by node-{name}")
        wait_for(lambda: {n["node_id"] for n in view(url["a"])["nodes"] if n["state"] == "ready"} >= {"node-b", "node-c"},
                 60, "node-a has node-b and node-c settled (past the join debounce)")

        # 2. a generation through a node that is not the root: forwarded, planned over a, b, c
        assert stream(url["b"]) == expected
        plan = view(url["a"])
        assert plan["root"] == "node-a"
        planned = [n for n in plan["nodes"] if n["stage"] is not None]
        assert sorted(n["node_id"] for n in planned) == ["node-a", "node-b", "node-c"]
        assert all(n["ffn_cols"][1] > n["ffn_cols"][0] and n["state"] == "ready" for n in planned)
        # the root lists the members its plan does not hold as well: node-d, of another cluster
        assert [(n["node_id"], n["state"]) for n in plan["nodes"] if n["stage"] is None] == [("node-d", "foreign")]

        # 3. a worker suspended mid-answer (SIGSTOP: its kernel keeps the link up and silent, so TCP alone would
        # wait for ever): once the cluster loses it, its link is cut and the stream goes on with the same text
        # (a worker killed outright: tests/test_serve.py, tests/test_parallel.py); re-planned mid-answer, not
        # before the next request (a short answer could be done before the worker stops)
        t0 = time.monotonic()
        assert stream(url["a"], kill_after=12, victim=procs["c"][0], how=signal.SIGSTOP, max_tokens=LONG,
                      timeout=30) == long, f"answered in {time.monotonic() - t0:.1f} s"
        nodes = view(url["a"])["nodes"]
        assert sorted(n["node_id"] for n in nodes if n["stage"] is not None) == ["node-a", "node-b"]
        assert {n["node_id"]: n["state"] for n in nodes if n["stage"] is None} == {"node-c": "lost",
                                                                                   "node-d": "foreign"}
        procs["c"][0].kill()
        procs["c"][0].wait()

        # 4. the root suspended (SIGSTOP, as a laptop put to sleep: its sockets stay open, and its kernel still
        # accepts connections that nothing answers) mid-answer of a stream forwarded by node-b: once the
        # cluster loses it (3 s without a heartbeat), the stream ends with an error event that says so
        # instead of waiting for ever; a request at once, while node-b still names the silent root, is moved
        # to the new root instead of failing (one attempt: the client's own retries would hide it)
        with pytest.raises(openai.APIError, match="the root at .* was lost mid-answer; ask again"):
            stream(url["b"], kill_after=2, victim=procs["a"][0], retries=0, max_tokens=400, how=signal.SIGSTOP,
                   timeout=30)  # far from done
        t0 = time.monotonic()
        assert stream(url["b"], retries=0, timeout=30) == expected, \
            f"answered {time.monotonic() - t0:.1f} s after the suspension"
        wait_for(lambda: view(url["b"])["root"] == "node-b", 5, "node-b took over as root")
        procs["a"][0].kill()  # (a root killed outright, refusing connections: tests/test_forward.py)
        procs["a"][0].wait()
        assert "node-d" not in {n["node_id"] for n in view(url["b"])["nodes"] if n["state"] != "foreign"}

        # 5. SIGTERM is a clean leave
        procs["b"][0].send_signal(signal.SIGTERM)
        assert procs["b"][0].wait(15) == 0
    finally:
        for proc, _ in procs.values():
            stop(proc)


def test_two_workers_lost_at_once_mid_answer_are_planned_around_and_the_answer_keeps_its_text(
        stories_path, tmp_path, long):
    """One worker killed (its port refuses) and the other suspended (its kernel accepts a connection nothing
    answers) at the same token: the root re-plans over the members that still answer heartbeats, not over
    the old plan's other worker, whose handshake would hold the recovery for its whole timeout and then
    fail the answer."""
    key = tmp_path / "cluster.key"
    assert edgetp("keygen", str(key)).returncode == 0
    procs = {}
    try:
        procs["a"] = start_daemon(stories_path, key, "node-a", priority=5)
        procs["b"] = start_daemon(stories_path, key, "node-b")
        procs["c"] = start_daemon(stories_path, key, "node-c")
        url = procs["a"][1]
        wait_for(lambda: {n["node_id"] for n in view(url)["nodes"] if n["state"] == "ready"} >= {"node-b", "node-c"},
                 60, "node-a has node-b and node-c settled")
        first = stream(url, max_tokens=8)
        assert first and long.startswith(first)
        assert sorted(n["node_id"] for n in view(url)["nodes"] if n["stage"] is not None) == ["node-a", "node-b", "node-c"]

        t0 = time.monotonic()
        assert stream(url, kill_after=4, victim=procs["b"][0], also=procs["c"][0], max_tokens=LONG,
                      timeout=60) == long, f"answered in {time.monotonic() - t0:.1f} s"
        # re-planned mid-answer (a plan made before the next request would not have come yet)
        nodes = view(url)["nodes"]
        assert [n["node_id"] for n in nodes if n["stage"] is not None] == ["node-a"]
        assert {n["node_id"]: n["state"] for n in nodes if n["stage"] is None} == {"node-b": "lost", "node-c": "lost"}
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)  # a suspended daemon hears SIGTERM at once
            stop(proc)


def test_a_node_that_joins_under_unbroken_load_is_planned_in_at_once_and_every_answer_keeps_its_text(
        stories_path, tmp_path):
    """Re-plans between requests never come while streams overlap without a pause; a join must not wait for one.

    Four clients ask back to back with different lengths, so their answers never end together and
    the root is never idle. node-b joins: the running plan's next decode step re-plans over it
    (the `rebalance` event says so) and every answer, before, across and after, is the single node's.
    """
    from tests.test_daemon_slices import EventLog

    mf = gguf.open_model(stories_path)
    tok = Tokenizer.from_metadata(mf.metadata)
    lengths = (150, 113, 137, 91)
    want = {n: "".join(ev.text for ev in generate(LocalRunner(mf, 256), tok, tok.encode(PROMPT),
                                                 sampling.SamplingParams(temperature=0), n)) for n in lengths}
    key = tmp_path / "cluster.key"
    assert edgetp("keygen", str(key)).returncode == 0
    procs, answers, done, clients = {}, [], threading.Event(), []
    log = None

    def client(n: int) -> None:
        ask = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120)
        for _ in range(200):  # bounded; `done` ends it long before
            if done.is_set():
                return
            chunks = ask.completions.create(prompt=PROMPT, model="stories260K", max_tokens=n, temperature=0,
                                            stream=True)
            answers.append((n, "".join(c.choices[0].text for c in chunks), time.monotonic()))

    try:
        procs["a"], url = start_daemon(stories_path, key, "node-a", priority=5)
        log = EventLog(url)
        clients += [threading.Thread(target=client, args=(n,)) for n in lengths]
        for t in clients:
            t.start()
        wait_for(lambda: len(answers) >= 4, 120, "node-a answers alone")
        procs["b"], _ = start_daemon(stories_path, key, "node-b")
        wait_for(lambda: "node-b" in {n["node_id"] for n in view(url)["nodes"] if n["stage"] is not None}, 120,
                 "node-b planned in")
        joined = time.monotonic()
        wait_for(lambda: sum(t > joined for *_, t in answers) >= 8, 120, "answers after the re-plan")
    finally:
        done.set()
        for t in clients:
            t.join(120)
        if log is not None:
            log.close()
        for proc in procs.values():
            stop(proc)
    wrong = [(n, text) for n, text, _ in answers if text != want[n]]
    assert not wrong and len(answers) >= 12, wrong[:2]
    rebalances = [r for r in log.records if r.get("type") == "cluster" and r.get("event") == "rebalance"]
    assert any("node-b joined" in r["message"] for r in rebalances), rebalances
