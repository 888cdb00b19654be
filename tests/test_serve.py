"""`edgetp serve` as a user runs it: a real server process in front of real workers."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request

import openai

from edgetp.serve.spawn import start_worker, stop

PROMPT = "Once upon a time"


def start_server(*args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "edgetp", "serve", "--listen", "127.0.0.1:0", "--threads", "1",
                             *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    m = re.search(r"serving on (http://\S+)", line)
    if not m:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
        raise RuntimeError(f"server did not start: {line}{err}")
    return proc, m.group(1)


def stream_text(url: str, kill_after: int | None = None, victim: subprocess.Popen | None = None,
                suspend: subprocess.Popen | None = None) -> str:
    """The streamed answer; after `kill_after` chunks `victim` is killed and `suspend` stopped (SIGSTOP:
    a laptop closed or a Pi hung, whose socket stays open and silent)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120)
    text, chunks = "", 0
    for chunk in client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=60, temperature=0,
                                           stream=True):
        text += chunk.choices[0].text
        chunks += 1
        if kill_after is not None and chunks == kill_after:
            victim.kill()
            victim.wait()
            if suspend is not None:
                suspend.send_signal(signal.SIGSTOP)
    return text


def single_node_text(stories_path) -> str:
    alone, url = start_server("--model", str(stories_path))
    try:
        return stream_text(url)
    finally:
        stop(alone)


def test_a_served_cluster_streams_the_single_node_text_even_when_a_worker_dies_mid_answer(stories_path):
    expected = single_node_text(stories_path)
    assert len(expected) > 100
    (keep, a), (victim, b) = start_worker(), start_worker()
    server = None
    try:
        server, url = start_server("--model", str(stories_path), "--workers", f"{a},{b}", "--weights", "1,1,1")
        cluster = openai.OpenAI(base_url=f"{url}/v1", api_key="unused").models.list()
        assert [m.id for m in cluster.data] == ["stories260K"]
        assert stream_text(url, kill_after=15, victim=victim) == expected
        view = json.load(urllib.request.urlopen(f"{url}/v1/cluster", timeout=10))
        assert view["epoch"] == 2 and len(view["nodes"]) == 2 and b not in {n["address"] for n in view["nodes"]}
    finally:
        if server:
            stop(server)
        stop(keep)
        stop(victim)
    assert server.returncode is not None


def test_a_static_cluster_streams_on_when_two_workers_drop_at_once_one_killed_one_suspended(stories_path):
    """The re-plan after the first loss must not wait on, and then fail over, the second: it plans
    without each worker that fails on the way and the answer continues with the single-node text."""
    expected = single_node_text(stories_path)
    (keep, a), (killed, b), (hung, c) = start_worker(), start_worker(), start_worker()
    server = None
    try:
        server, url = start_server("--model", str(stories_path), "--workers", f"{a},{b},{c}", "--weights", "1,1,1,1")
        assert stream_text(url, kill_after=15, victim=killed, suspend=hung) == expected
        view = json.load(urllib.request.urlopen(f"{url}/v1/cluster", timeout=10))
        assert view["epoch"] == 2 and sorted(n["address"] for n in view["nodes"]) == sorted([a, "local"])
        server.terminate()
        _, err = server.communicate(timeout=30)
        assert f"re-planning without {c} too" in err
        assert "Traceback" not in err  # nor a token record with the new links' counters taken from the old ones'
    finally:
        hung.send_signal(signal.SIGCONT)
        for proc in (server, keep, killed, hung):
            if proc:
                stop(proc)


def test_a_static_root_serves_without_a_worker_that_is_down_and_takes_it_in_once_it_is_up(stories_path):
    """A Pi of the --workers list that is off when the root starts (or lost later) is planned around;
    once it is up again, a request or two later the plan holds it, without restarting the root."""
    import socket  # noqa: PLC0415

    expected = single_node_text(stories_path)
    with socket.socket() as s:  # a port for the late worker: free now, nobody listening
        s.bind(("127.0.0.1", 0))
        late = f"127.0.0.1:{s.getsockname()[1]}"
    (early, a), server, up = start_worker(), None, None
    try:
        server, url = start_server("--model", str(stories_path), "--workers", f"{a},{late}")
        assert stream_text(url) == expected

        def addresses() -> set[str]:
            return {n["address"] for n in json.load(urllib.request.urlopen(f"{url}/v1/cluster", timeout=10))["nodes"]}

        assert addresses() == {"local", a}
        up, _ = start_worker("--listen", late)
        for _ in range(10):  # its backoff (2 s after the first failure), a knock, then the next request re-plans
            time.sleep(1.0)
            assert stream_text(url) == expected
            if late in addresses():
                break
        assert addresses() == {"local", a, late}
        server.terminate()
        _, err = server.communicate(timeout=30)
        assert f"planning without worker {late}" in err and f"worker {late} answers again" in err
        assert "Traceback" not in err
    finally:
        for proc in (server, early, up):
            if proc:
                stop(proc)


def test_a_served_pipeline_streams_the_single_node_text_and_shows_its_stages(stories_path):
    expected = single_node_text(stories_path)
    (w1, a), (w2, b) = start_worker(), start_worker()
    server = None
    try:
        server, url = start_server("--model", str(stories_path), "--workers", f"{a},{b}", "--parallel", "pp")
        assert stream_text(url) == expected
        view = json.load(urllib.request.urlopen(f"{url}/v1/cluster", timeout=10))
        assert view["plan"].startswith("pp: layers 0:")
        assert [n["stage"] for n in view["nodes"]] == [0, 1, 2]
        layers = [tuple(n["layers"]) for n in view["nodes"]]
        assert layers[0][0] == 0 and layers[-1][1] == 5 and all(x[1] == y[0] for x, y in zip(layers, layers[1:]))
        status = subprocess.run([sys.executable, "-m", "edgetp", "status", "--url", url], capture_output=True,
                                text=True, timeout=60)
        assert status.returncode == 0 and status.stdout.splitlines()[1] == f"plan {view['plan']}", status.stdout
    finally:
        if server:
            stop(server)
        stop(w1)
        stop(w2)
