"""`edgetp ask`, `status` and `chat` against a running daemon, and the client's exit codes."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import openai
import pytest

from edgetp import client
from edgetp.net import auth
from edgetp.serve.spawn import start_daemon, stop
from tests.test_cli_errors import edgetp
from tests.test_daemon import view, wait_for

SOLO = f"solo-{os.getpid()}"  # mDNS names are per network: unique per test run


@pytest.fixture(scope="module")
def daemon(stories_path, tmp_path_factory):
    key = tmp_path_factory.mktemp("key") / "cluster.key"
    assert edgetp("keygen", str(key)).returncode == 0
    proc, url = start_daemon(stories_path, key, SOLO)
    try:
        wait_for(lambda: view(url)["root"] == SOLO, 20, "the daemon elects itself")
        yield url, key
    finally:
        stop(proc)


def test_ask_streams_what_the_openai_client_gets_and_stats_summarise_each_token(daemon):
    url, _ = daemon
    reply = openai.OpenAI(base_url=f"{url}/v1", api_key="x").chat.completions.create(
        model="stories260K", messages=[{"role": "user", "content": "Once upon a time"}], max_tokens=30,
        temperature=0)
    expected = reply.choices[0].message.content
    result = edgetp("ask", "--url", url, "--temperature", "0", "--max-tokens", "30", "--stats", "Once upon a time")
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected + "\n" and len(expected) > 20
    summary = result.stderr
    assert "tok/s decode" in summary and "p50" in summary and "p95" in summary and "sync" in summary
    assert summary.split(" tokens,")[0].rsplit(" ", 1)[-1] == "30"  # one record per generated token
    # the request's end record, awaited rather than slept for: its prompt as the API's usage counts it
    # (shorter than one prefill chunk, so none of it comes from the prefix cache), its end as the API's
    assert f"prompt {reply.usage.prompt_tokens} tokens, 0 of them from the prefix cache" in summary, summary
    assert f"finished: {reply.choices[0].finish_reason}" in summary and reply.choices[0].finish_reason == "length"


def test_ask_reads_the_prompt_from_stdin(daemon):
    url, _ = daemon
    piped = subprocess.run([sys.executable, "-m", "edgetp", "ask", "--url", url, "--temperature", "0",
                            "--max-tokens", "12"], input="Once upon a time", capture_output=True, text=True, timeout=60)
    direct = edgetp("ask", "--url", url, "--temperature", "0", "--max-tokens", "12", "Once upon a time")
    assert piped.returncode == 0 and piped.stdout == direct.stdout


def test_status_lists_the_node_as_root(daemon):
    url, _ = daemon
    result = edgetp("status", "--url", url)
    assert result.returncode == 0, result.stderr
    assert f"root {SOLO}" in result.stdout.splitlines()[0]
    assert any(line.startswith(f"{SOLO} ") and " root " in line for line in result.stdout.splitlines())


def _imported(argv: list[str], stdin: str | None = None) -> set[str]:
    """The modules `edgetp argv` imported, from CPython's own import log (-X importtime)."""
    run = subprocess.run([sys.executable, "-X", "importtime", "-m", "edgetp", *argv], input=stdin,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return {line.rsplit("|", 1)[-1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")}


def test_commands_that_ask_a_cluster_load_neither_numba_nor_llvm_nor_numpy(daemon, stories_path):
    # ask, chat and status only speak HTTP: numba, LLVM and numpy cost a Pi seconds and ~90 MB
    # before the first byte is sent (--help: 1.7 s and 140 MB here with them, 0.45 s and 50 MB without)
    url, _ = daemon
    heavy = lambda loaded: sorted(m for m in loaded if m.split(".")[0] in ("numba", "llvmlite", "numpy"))  # noqa: E731
    for argv, stdin in ((["ask", "--url", url, "--temperature", "0", "--max-tokens", "4", "Once upon a time"], None),
                        (["chat", "--url", url, "--max-tokens", "4"], "Once upon a time\n/exit\n"),
                        (["status", "--url", url], None), (["--help"], None)):
        loaded = _imported(argv, stdin)
        assert "edgetp.commands" in loaded and heavy(loaded) == [], (argv, heavy(loaded)[:5])
    # the log does show them where a model runs here
    assert {"numba", "numpy"} <= _imported(["ask", "--local", "--model", str(stories_path), "--max-tokens", "2", "Once"])


def test_chat_keeps_its_history_across_turns(daemon):
    url, _ = daemon
    session = subprocess.run([sys.executable, "-m", "edgetp", "chat", "--url", url, "--temperature", "0",
                              "--max-tokens", "10"], input="Once upon a time\nWhat happened next?\n/exit\n",
                             capture_output=True, text=True, timeout=120)
    assert session.returncode == 0, session.stderr
    first, second = [line for line in session.stdout.split("you> ") if line.strip()][:2]
    history = [{"role": "user", "content": "Once upon a time"}, {"role": "assistant", "content": first.strip("\n")},
               {"role": "user", "content": "What happened next?"}]
    expected = openai.OpenAI(base_url=f"{url}/v1", api_key="x").chat.completions.create(
        model="stories260K", messages=history, max_tokens=10, temperature=0).choices[0].message.content
    assert second.strip("\n") == expected


def test_chat_reports_a_failed_turn_in_one_line_and_goes_on_without_it(daemon):
    url, _ = daemon
    too_long = "once upon a time " * 400  # past stories260K's context: the API answers 400
    session = subprocess.run([sys.executable, "-m", "edgetp", "chat", "--url", url, "--temperature", "0",
                              "--max-tokens", "10"],
                             input=f"Once upon a time\n{too_long}\nThe little dog\n/reset\nThe little dog\n/exit\n",
                             capture_output=True, text=True, timeout=120)
    assert session.returncode == 1, session.stderr  # a turn failed: said in the exit code too
    errors = [line for line in session.stderr.splitlines() if line.startswith("edgetp: ")]
    assert len(errors) == 2 and "context" in errors[0] and "left out of the history" in errors[0], errors
    assert errors[1] == "edgetp: the history is forgotten" and "Traceback" not in session.stderr
    first, kept, alone = [line.strip("\n") for line in session.stdout.split("you> ") if line.strip()]
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="x")

    def answer(messages):
        return api.chat.completions.create(model="stories260K", messages=messages, max_tokens=10,
                                           temperature=0).choices[0].message.content

    dog = {"role": "user", "content": "The little dog"}
    assert kept == answer([{"role": "user", "content": "Once upon a time"},
                           {"role": "assistant", "content": first}, dog])  # the failed turn is not in it
    assert alone == answer([dog]) != kept  # after /reset the turn stands alone


def test_ask_takes_max_tokens_as_a_cap_where_the_prompt_leaves_less_room(daemon):
    """The API refuses max_tokens past the context (400, as OpenAI does); `ask --local` caps it instead,
    and so now does `ask --url` (and chat): it answers with what room there is, as the API does unasked."""
    url, _ = daemon
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="x")

    def prompt_tokens(text):
        return api.chat.completions.create(model="stories260K", messages=[{"role": "user", "content": text}],
                                           max_tokens=1, temperature=0).usage.prompt_tokens

    unit = "Lily and Tom went to the park and saw a big red ball. "
    per = (prompt_tokens(unit * 21) - prompt_tokens(unit)) / 20
    text = unit * int((2048 - 60 - prompt_tokens(unit)) / per + 1)
    room = 2048 - prompt_tokens(text)  # the test daemon's ctx: serve's default, 2048 (stories260K's own)
    assert 0 < room < 200, room
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.create(model="stories260K", messages=[{"role": "user", "content": text}],
                                    max_tokens=256, temperature=0)
    full = api.chat.completions.create(model="stories260K", messages=[{"role": "user", "content": text}],
                                       max_tokens=room, temperature=0).choices[0]
    result = edgetp("ask", "--url", url, "--temperature", "0", "--max-tokens", "256", text)
    assert result.returncode == 0, result.stderr
    assert result.stdout == full.message.content + "\n"
    assert ("context of" in result.stderr and "is full" in result.stderr) == (full.finish_reason == "length")


async def test_discovery_finds_the_daemon_and_tells_a_foreign_key_from_no_cluster(daemon):
    url, key = daemon
    assert await client.find_url(None, auth.read_key(key), interfaces=["127.0.0.1"]) == url
    with pytest.raises(client.KeyRefused, match="none in the cluster of this key"):
        await client.find_url(None, auth.generate_key(), interfaces=["127.0.0.1"])


async def test_a_browse_ends_soon_after_a_node_of_the_cluster_answers(daemon):
    # the window is a bound, not a wait (a shell's ask waited it out: 2 s before its request).
    # Once a node of the key's cluster is heard and no new one for BROWSE_QUIET_S, it ends.
    url, key = daemon
    async with asyncio.timeout(20):
        assert await client.find_url(None, auth.read_key(key), seconds=60, interfaces=["127.0.0.1"]) == url
    with pytest.raises(TimeoutError):  # no node of a foreign key's cluster answers: the window runs out
        async with asyncio.timeout(3):
            await client.find_url(None, auth.generate_key(), seconds=60, interfaces=["127.0.0.1"])


async def test_where_mdns_finds_nothing_the_node_of_this_machine_answers(daemon, monkeypatch):
    url, key = daemon

    async def silent(seconds, interfaces, **_):  # multicast filtered: the browse hears no advert
        return []

    monkeypatch.setattr(client, "browse", silent)
    assert await client.find_url(None, auth.read_key(key), local=url) == url
    closed = "http://127.0.0.1:9"  # discard: nothing listens
    with pytest.raises(client.NoCluster, match="nor a node at http://127.0.0.1:9"):
        await client.find_url(None, auth.read_key(key), local=closed)


def test_no_cluster_exits_3_with_one_line():
    result = edgetp("ask", "--url", "http://127.0.0.1:9", "hello")
    assert result.returncode == 3
    assert result.stderr.count("\n") == 1 and "cannot connect" in result.stderr and "Traceback" not in result.stderr
