"""The cluster key on real processes: keygen, and a worker that serves only roots holding its key."""

from __future__ import annotations

import stat
import subprocess
import sys

from tests.test_cli_errors import assert_one_line_error, edgetp
from edgetp.serve.spawn import start_worker, stop

STORY = "Once upon a time"


def test_keygen_writes_a_private_key_and_refuses_to_overwrite_it(tmp_path):
    path = tmp_path / "cluster.key"
    first = edgetp("keygen", str(path))
    assert first.returncode == 0, first.stderr
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key = path.read_bytes()
    assert_one_line_error(edgetp("keygen", str(path)), "refusing to overwrite")
    assert path.read_bytes() == key


def test_a_keyed_worker_serves_only_a_root_with_the_same_key(tmp_path, stories_path):
    good, bad = tmp_path / "good.key", tmp_path / "bad.key"
    assert edgetp("keygen", str(good)).returncode == 0
    assert edgetp("keygen", str(bad)).returncode == 0
    proc, addr = start_worker("--key", str(good))
    try:
        base = ["ask", "--local", "--model", str(stories_path), "--raw", "--temperature", "0",
                "--max-tokens", "24", "--threads", "1", "--workers", addr, STORY]
        assert_one_line_error(edgetp(*base, "--key", str(bad)), addr, "authentication failed")
        assert_one_line_error(edgetp(*base), addr, "requires the cluster key")
        assert proc.poll() is None, "refusing a root must not cost the worker"
        ok = edgetp(*base, "--key", str(good))
        alone = subprocess.run([sys.executable, "-m", "edgetp", *base[:-3], STORY], capture_output=True, text=True,
                               timeout=120)
        assert ok.returncode == 0, ok.stderr
        assert ok.stdout == alone.stdout and len(ok.stdout) > 20
    finally:
        stop(proc)
