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


def test_the_start_timeout_is_extended_while_a_first_model_pull_is_still_running(stories_path, tmp_path):
    """The model comes from a loopback HTTP server that holds its answer back until the test has seen
    EXTEND_TIMEOUT_USEC: an extension that began only after the pull would never be seen."""
    import http.server  # noqa: PLC0415
    import threading  # noqa: PLC0415

    extended = threading.Event()
    body = stories_path.read_bytes()

    class Model(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server name
            extended.wait(60)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Model)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    key = tmp_path / "cluster.key"
    assert edgetp("keygen", str(key)).returncode == 0
    path = str(tmp_path / "notify.sock")
    url = f"http://127.0.0.1:{server.server_address[1]}/stories260K.gguf"
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.bind(path)
            sock.settimeout(60)
            proc = subprocess.Popen(
                [sys.executable, "-m", "edgetp", "serve", "--model", url, "--key", str(key),
                 "--listen", "127.0.0.1:0", "--data-port", "0", "--interface", "127.0.0.1",
                 "--node-id", f"pull-{os.getpid()}", "--threads", "1"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                env=os.environ | {"NOTIFY_SOCKET": path, "EDGETP_CACHE_DIR": str(tmp_path / "cache")})
            try:
                first = _messages(sock, "EXTEND_TIMEOUT_USEC=")
                assert not any("READY=1" in m for m in first)
                assert any(f"STATUS=getting model {url}" in m for m in first), first
                extended.set()  # now the pull may finish
                ready = _messages(sock, "READY=1")
                assert any("STATUS=serving on http://127.0.0.1:" in m for m in ready)
                assert (tmp_path / "cache" / "models" / "stories260K.gguf").read_bytes() == body
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(20) == 0
            finally:
                stop(proc)
    finally:
        extended.set()
        server.shutdown()
        server.server_close()
        thread.join(10)
