"""The static cluster across three hosts (network namespaces on a 100 Mbit bridge)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from edgetp.serve.spawn import start_worker, stop
from tools.netns import Testbed, require_root_and_netns

STORY = "Once upon a time, there was a little girl named Lily."


@pytest.fixture(scope="module")
def testbed():
    reason = require_root_and_netns()
    if reason:
        pytest.skip(reason)
    with Testbed(hosts=3, rate="100mbit") as tb:
        yield tb


def test_three_hosts_on_a_100_mbit_lan_answer_as_one_process_does(testbed, stories_path):
    root, h2, h3 = testbed
    ask = [sys.executable, "-m", "edgetp", "ask", "--local", "--model", str(stories_path), "--raw",
           "--temperature", "0", "--max-tokens", "40", "--threads", "1", STORY]
    alone = subprocess.run(ask, capture_output=True, text=True, timeout=120)
    assert alone.returncode == 0, alone.stderr
    workers = []
    try:
        for host in (h2, h3):
            workers.append(start_worker(host=host.address, prefix=host.argv([])))
        addresses = [addr for _, addr in workers]
        assert all(not a.startswith("127.") for a in addresses)
        spread = root.run(ask + ["--workers", ",".join(addresses), "--weights", "1,2,3", "--stats"],
                          timeout=180, check=False)
        assert spread.returncode == 0, spread.stderr
        assert spread.stdout == alone.stdout and len(alone.stdout) > 40
        assert all(a in spread.stderr for a in addresses), "the stats name both remote workers"
    finally:
        for proc, _ in workers:
            stop(proc)
