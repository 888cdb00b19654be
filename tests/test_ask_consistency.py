"""One answer, whichever way you ask: `ask --local`, `ask --url` (a real daemon) and the `openai`
client give the same greedy text for the same prompt and model, chat template or not, and --raw
works against a cluster through /v1/completions.

stories260K has no chat template (the server renders ChatML, and so must --local); SmolLM2 has one.
"""

from __future__ import annotations

import os

import openai
import pytest

from edgetp.serve.spawn import start_daemon, stop
from tests.test_cli_errors import edgetp
from tests.test_daemon import view, wait_for

PROMPT = "Once upon a time"
GREEDY = ("--temperature", "0", "--max-tokens", "16")


@pytest.fixture(scope="module", params=["stories260K", pytest.param("smollm2", marks=pytest.mark.slow)])
def model(request, stories_path, smollm2_path, tmp_path_factory):
    """(model path, model name, the daemon's URL) for a one-node cluster serving that model."""
    path = stories_path if request.param == "stories260K" else smollm2_path
    key = tmp_path_factory.mktemp("key") / "cluster.key"
    assert edgetp("keygen", str(key)).returncode == 0
    node = f"ask-{request.param.lower()}-{os.getpid()}"
    proc, url = start_daemon(path, key, node)
    try:
        wait_for(lambda: view(url)["root"] == node, 60, "the daemon elects itself")
        yield path, view(url)["model"], url
    finally:
        stop(proc)


def answer(*args: str) -> str:
    result = edgetp("ask", *GREEDY, *args, PROMPT, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout.removesuffix("\n")


def test_chat_text_is_the_same_locally_through_the_cli_and_through_the_openai_client(model):
    path, name, url = model
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0).chat.completions.create(
        model=name, messages=[{"role": "user", "content": PROMPT}], max_tokens=16, temperature=0)
    via_api = api.choices[0].message.content
    assert via_api
    assert answer("--local", "--model", str(path)) == via_api
    assert answer("--url", url) == via_api


def test_raw_text_is_the_same_locally_through_the_cli_and_through_completions(model):
    path, name, url = model
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0).completions.create(
        model=name, prompt=PROMPT, max_tokens=16, temperature=0)
    via_api = api.choices[0].text
    assert via_api
    assert answer("--local", "--raw", "--model", str(path)) == via_api
    assert answer("--url", url, "--raw") == via_api
