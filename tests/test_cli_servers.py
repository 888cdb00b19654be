"""The CLI against addresses that are not edgetp's API, and paths it cannot write: one line, never a traceback.

Each case runs the real `edgetp` in a subprocess against a real HTTP server on loopback that is not
edgetp (a file server's HTML, JSON of another shape, a 200 that is no event stream), or a bad --url,
or a file it cannot create.
"""

from __future__ import annotations

import http.server
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from edgetp.model import gguf
from edgetp.net.loopthread import LoopThread
from edgetp.parallel.runner import ClusterRunner
from tests.test_cli_errors import assert_one_line_error, edgetp

ANSWERS = {  # path -> status, content type, body
    "html": {"*": (404, "text/html", b"<!DOCTYPE HTML>\n<html>\n<head><title>Error</title></head>\n"
                                      b"<body>\n<h1>Error response</h1>\n<p>Error code: 404</p>\n</body>\n</html>\n")},
    "json": {"/v1/cluster": (200, "application/json", b'{"hello": "world"}'),
             "*": (200, "application/json", b"[1, 2]")},
    "text": {"*": (200, "text/plain", b"this is a plain page\n")},
    "nested": {"*": (200, "application/json", b"[" * 100_000 + b"]" * 100_000)},
    "long line": {"*": (200, "text/event-stream", b"data: " + b"x" * 200_000 + b"\n\n")},  # past aiohttp's 128 KiB
}


@pytest.fixture(params=sorted(ANSWERS))
def stranger(request):
    answers = ANSWERS[request.param]

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(length)
            status, kind, body = answers.get(self.path.split("?")[0], answers["*"])
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield request.param, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_status_ask_and_chat_against_a_server_that_is_not_edgetp_say_so_in_one_line(stranger):
    kind, url = stranger
    for args, stdin in ((("status", "--url", url), None), (("ask", "--url", url, "hi"), None),
                        (("ask", "--stats", "--url", url, "hi"), None), (("chat", "--url", url), "hi\n")):
        result = edgetp(*args, timeout=60) if stdin is None else _with_stdin(args, stdin)
        assert_one_line_error(result, url, progress=True)  # (chat first says whom it chats with)
        assert result.returncode in (1, 5), (args, result.returncode)
        assert "edgetp API" in result.stderr or "not an edgetp" in result.stderr, (kind, args, result.stderr)


def _with_stdin(args, text):
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "edgetp", *args], input=text, capture_output=True, text=True,
                          timeout=60, env=os.environ)


@pytest.mark.parametrize("url", ["garbage", "127.0.0.1:7711", "ftp://127.0.0.1:7711", "http://", "http://[::1"])
def test_a_url_that_is_not_an_http_address_is_refused_in_one_line(url):
    for command in (("status",), ("ask", "hi"), ("profile",)):
        result = edgetp(command[0], "--url", url, *command[1:], timeout=60)
        if command[0] == "profile":  # it wants the key first
            assert result.returncode != 0 and "Traceback" not in result.stderr
            continue
        assert_one_line_error(result, "is not an address like http://HOST:PORT")


def test_keygen_where_no_file_can_be_made_leaves_nothing_and_says_why(tmp_path):
    (tmp_path / "adir").mkdir()
    for target, says in ((tmp_path / "nodir" / "k.key", "No such file or directory"),
                         (tmp_path / "adir", "not a directory"), ("", "give a file name")):
        result = edgetp("keygen", str(target), "--force")
        assert_one_line_error(result, says)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["adir"]


def test_a_model_cache_that_cannot_be_made_and_a_url_that_does_not_parse_are_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    env = {"EDGETP_CACHE_DIR": str(blocker / "cache")}
    assert_one_line_error(edgetp("model", "pull", "smollm2", env=env), "cannot make the model cache")
    assert_one_line_error(edgetp("model", "pull", "nosuch", env=env), "neither a known name")
    assert_one_line_error(edgetp("model", "pull", "http://[::1/x.gguf"), "is not a URL that parses")


def test_weights_that_do_not_match_the_workers_are_a_usage_error():
    for args in (("serve", "--weights", "2"), ("serve", "--workers", "127.0.0.1:1,127.0.0.1:2", "--weights", "1,2"),
                 ("ask", "--local", "--workers", "127.0.0.1:1", "--weights", "1,2,3", "x")):
        result = edgetp(*args, timeout=60)
        assert result.returncode == 2 and "--weights needs" in result.stderr and "Traceback" not in result.stderr
    result = edgetp("ask", "--local", "--workers", "127.0.0.1:1", "--weights", "inf,1", "x", timeout=60)
    assert result.returncode == 2 and "positive and finite" in result.stderr


def test_a_worker_given_a_missing_model_stops_at_once_in_one_line(tmp_path):
    result = edgetp("worker", "--model", str(tmp_path / "missing.gguf"), "--listen", "127.0.0.1:0", timeout=60)
    lines = [line for line in result.stderr.splitlines() if "no cluster key" not in line]
    assert result.returncode == 1 and len(lines) == 1 and "missing.gguf" in lines[0] and "not found" in lines[0]


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT])
def test_a_server_told_to_stop_while_its_kernels_compile_stops_at_once(stories_path, tmp_path, how):
    """A cold start compiles every kernel for a minute or more (an empty numba cache here). systemd's
    stop, or Ctrl-C, then ended the process only once the compiles were done: asyncio.run waited for
    the executor thread they ran on."""
    # the server gets SIGINT as a terminal's foreground job has it: a suite started in the background
    # of a script inherits it ignored (sh does that to `cmd &`), and so would the server. A handled
    # signal is default again after exec; an ignored one stays ignored.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "edgetp", "-v", "serve", "--model", str(stories_path),
                                 "--listen", "127.0.0.1:0", "--threads", "1"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True,
                                env=os.environ | {"NUMBA_CACHE_DIR": str(tmp_path / "numba"), "PYTHONUNBUFFERED": "1"})
    finally:
        signal.signal(signal.SIGINT, inherited)
    try:
        deadline = time.monotonic() + 60
        seen = ""
        while time.monotonic() < deadline and "compiling" not in seen:  # the warm-up's first line
            line = proc.stderr.readline()
            assert line, f"the server ended before its warm-up:\n{seen}"
            seen += line
        assert "compiling" in seen, seen
        time.sleep(2)  # well inside the compiles (a minute and more from empty)
        assert proc.poll() is None, "the warm-up was over already: nothing to show"
        t0 = time.monotonic()
        proc.send_signal(how)
        rest = proc.communicate(timeout=60)[1]
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert took < 10, f"stopped {took:.1f} s after the signal"
    assert proc.returncode in (0, 130) and "Traceback" not in rest and "Fatal" not in rest, rest


def test_a_worker_told_to_stop_while_its_shard_compiles_stops_at_once(stories_path, tmp_path):
    """The same for `edgetp worker` (and the daemon's worker role): a LOAD packs the weights and warms
    every kernel, a minute and more on an empty numba cache, on threads asyncio.run waited for."""
    proc = subprocess.Popen([sys.executable, "-m", "edgetp", "-v", "worker", "--listen", "127.0.0.1:0",
                             "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=os.environ | {"NUMBA_CACHE_DIR": str(tmp_path / "numba"), "PYTHONUNBUFFERED": "1"})
    root = {}

    def connect(address: str) -> None:  # a root in this process; its numba cache is the suite's
        try:
            with LoopThread() as lt:
                root["runner"] = lt.run(ClusterRunner.connect(gguf.open_model(stories_path), [address], ctx=64,
                                                              weights=[1, 1]), timeout=120)
                root["runner"].close()
        except Exception as exc:  # noqa: BLE001 - the worker is stopped under it
            root["error"] = exc

    connecting = None
    try:
        address = proc.stdout.readline().split(" listening on ")[-1].strip()
        assert address.startswith("127.0.0.1:"), address
        connecting = threading.Thread(target=connect, args=(address,), daemon=True)
        connecting.start()
        deadline = time.monotonic() + 120
        seen = ""
        while time.monotonic() < deadline and "loading shard" not in seen:
            line = proc.stderr.readline()
            assert line, f"the worker ended before its LOAD:\n{seen}"
            seen += line
        assert "loading shard" in seen, seen
        time.sleep(2)  # inside the packing and compiles (a minute and more from empty)
        assert proc.poll() is None and "runner" not in root, "the shard was ready already: nothing to show"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=60)[1]
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if connecting is not None:
            connecting.join(60)
    assert took < 10, f"stopped {took:.1f} s after the signal"
    assert proc.returncode == 0 and "Traceback" not in rest and "Fatal" not in rest, rest
    assert "stopped" in rest and "error" in root  # the root heard its worker go
