"""Start and stop local `edgetp worker` processes (the demo, tests and benchmarks use it)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from typing import Mapping, Sequence

_LISTENING = re.compile(r"listening on (\S+:\d+)")


def start_worker(*extra: str, threads: int = 1, host: str = "127.0.0.1", timeout: float = 60,
                 prefix: Sequence[str] = ()) -> tuple[subprocess.Popen, str]:
    """An `edgetp worker` on a free port of `host`; returns the process and its HOST:PORT.

    `prefix` runs it under another command (e.g. `taskset -c 1`, `ip netns exec h1`).
    """
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-m", "edgetp", "worker", "--listen", f"{host}:0", "--threads", str(threads), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ | {"PYTHONUNBUFFERED": "1"})
    return proc, _announced(proc, _LISTENING, timeout, "worker")


def stop(proc: subprocess.Popen, timeout: float = 10) -> None:
    """SIGTERM, then SIGKILL after `timeout`; always reaps the process and closes its pipes."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for stream in (proc.stdout, proc.stderr):
        if stream and not stream.closed:
            stream.close()


_SERVING = re.compile(r"serving on (http://\S+)")


def start_daemon(model: str, key: str, node_id: str, *, priority: int = 0, listen: str = "127.0.0.1:0",
                 data_port: int = 0, interface: str | None = "127.0.0.1", threads: int = 1,
                 prefix: Sequence[str] = (), timeout: float = 120, extra: Sequence[str] = (),
                 env: Mapping[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """An `edgetp serve --key` cluster daemon; returns the process and its API URL.

    `extra` goes on the command line (e.g. `--peer`), `env` over this process's environment.
    """
    argv = [*prefix, sys.executable, "-m", "edgetp", "serve", "--model", str(model), "--key", str(key),
            "--listen", listen, "--data-port", str(data_port), "--node-id", node_id, "--priority", str(priority),
            "--threads", str(threads), *(["--interface", interface] if interface else []), *extra]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=os.environ | {"PYTHONUNBUFFERED": "1"} | dict(env or {}))
    return proc, _announced(proc, _SERVING, timeout, f"daemon {node_id}")


def _announced(proc: subprocess.Popen, pattern: re.Pattern, timeout: float, what: str) -> str:
    """The address a starting process prints on stdout; it is stopped if it never does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if m := pattern.search(line):
            return m.group(1)
        if proc.poll() is not None:
            break
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    why = proc.stderr.read() if proc.stderr else ""  # before stop() closes the pipe
    stop(proc)
    raise RuntimeError(f"{what} did not start: {why}".strip())
