"""`edgetp serve` under systemd's notify protocol: READY, STATUS, then STOPPING on SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

from edgetp.serve.spawn import stop
from tests.test_cli_errors import edgetp


def _messages(sock: socket.socket, until: str, limit: int = 50) -> list[str]:
    got = []
    for _ in range(limit):
        got.append(sock.recv(4096).decode())
        if until in got[-1]:
            return got
    raise AssertionError(f"no {until} in {got}")


def test_serve_tells_systemd_it_is_ready_and_stopping_and_leaves_cleanly_on_sigterm(stories_path, tmp_path):
    key = tmp_path / "cluster.key"
    assert edgetp("keygen", str(key)).returncode == 0
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        sock.settimeout(60)
        proc = subprocess.Popen(
            [sys.executable, "-m", "edgetp", "serve", "--model", str(stories_path), "--key", str(key),
             "--listen", "127.0.0.1:0", "--data-port", "0", "--interface", "127.0.0.1", "--node-id", f"solo-{os.getpid()}",
             "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=os.environ | {"NOTIFY_SOCKET": path})
        try:
            ready = _messages(sock, "READY=1")
            assert any("STATUS=serving on http://127.0.0.1:" in m for m in ready)
            leader = f"leader solo-{os.getpid()}"
            assert any(leader in m for m in _messages(sock, leader)), "elections reach STATUS"
            proc.send_signal(signal.SIGTERM)
            assert any("STOPPING=1" in m for m in _messages(sock, "STOPPING=1"))
            assert proc.wait(20) == 0
        finally:
            stop(proc)
