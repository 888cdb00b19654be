"""The node id survives a restart: two real `edgetp serve --key` starts without --node-id.

The id is read back from the running daemon's own /v1/cluster and from the file in $STATE_DIRECTORY;
EDGETP_NODE_ID, when set, is the id and nothing is written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from edgetp.config import NODE_ID_RE
from edgetp.serve.spawn import _SERVING, _announced, stop
from tests.test_cli_errors import edgetp


@pytest.fixture
def key(tmp_path) -> Path:
    path = tmp_path / "cluster.key"
    assert edgetp("keygen", str(path)).returncode == 0
    return path


def node_id_of_a_start(stories_path: Path, key: Path, env: dict[str, str]) -> str:
    """Start a daemon (no --node-id, no --config), ask it who it is, stop it."""
    argv = [sys.executable, "-m", "edgetp", "serve", "--model", str(stories_path), "--key", str(key),
            "--listen", "127.0.0.1:0", "--data-port", "0", "--interface", "127.0.0.1", "--threads", "1"]
    clean = {k: v for k, v in os.environ.items() if k not in ("EDGETP_NODE_ID", "STATE_DIRECTORY", "EDGETP_CONFIG")}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=clean | {"PYTHONUNBUFFERED": "1"} | env)
    try:
        url = _announced(proc, _SERVING, 120, "daemon")
        with urllib.request.urlopen(f"{url}/v1/cluster", timeout=10) as resp:
            view = json.load(resp)
        local = [n["node_id"] for n in view["nodes"] if n["address"] == "local"]
        assert len(local) == 1, view
        return local[0]
    finally:
        stop(proc)


def test_a_node_keeps_its_id_in_the_state_directory_across_restarts(stories_path, key, tmp_path):
    state = tmp_path / "state"
    env = {"STATE_DIRECTORY": str(state), "EDGETP_CACHE_DIR": str(tmp_path / "cache")}
    first = node_id_of_a_start(stories_path, key, env)
    assert NODE_ID_RE.fullmatch(first)
    assert (state / "node-id").read_text().strip() == first
    assert node_id_of_a_start(stories_path, key, env) == first  # the second process is the same node


def test_edgetp_node_id_is_honoured_and_writes_nothing(stories_path, key, tmp_path):
    state = tmp_path / "state"
    env = {"STATE_DIRECTORY": str(state), "EDGETP_CACHE_DIR": str(tmp_path / "cache"),
           "EDGETP_NODE_ID": f"kitchen-pi-{os.getpid()}"}
    assert node_id_of_a_start(stories_path, key, env) == f"kitchen-pi-{os.getpid()}"
    assert not (state / "node-id").exists()
