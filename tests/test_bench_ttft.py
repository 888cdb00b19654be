"""tools/bench_ttft.py end to end on SmolLM2 (its token ids span more than stories260K's 512): real daemons, and
the prefix cache's figures in its table."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO

CHAT = 200  # turn 2 is CHAT + 48 ids; whole 64-token chunks before its last token: 192


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "tools/bench_ttft.py", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=600)


def test_the_table_says_turn_2_took_its_whole_chunks_from_the_cache_warm_and_nothing_cold(smollm2_path):
    """... and that of two clients sending one system prompt at once, one copied the other's whole chunks."""
    res = _run("--models", str(smollm2_path), "--long", "300", "--shorts", "2", "--chat", str(CHAT),
               "--shared", "300")
    assert res.returncode == 0, res.stderr[-2000:]
    row = next(line for line in res.stdout.splitlines() if line.startswith("| SmolLM2"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert "FAILED" not in cells[-1], cells[-1]
    want = (CHAT + 48 - 1) // 64 * 64  # the last token is always computed
    assert cells[7] == f"{want} / 0", row
    assert cells[8].endswith("x") and float(cells[8][:-1]) > 0, row
    assert all(float(cells[i]) > 0 for i in (2, 4, 5, 6, 9, 10)), row  # every first-token time measured
    assert cells[11] == str(300 // 64 * 64), row  # each shared whole chunk read by one, copied by the other
    assert cells[12].endswith("x"), row


def test_bad_options_get_one_line_and_exit_2():
    res = _run("--long", "0", "--chat", "0", "--shared", "0")
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 2 and "error:" in last and "one of them above 0" in last, res.stderr
    assert "Traceback" not in res.stderr
    res = _run("--long", "100")
    assert res.returncode == 2 and "--long must exceed 264" in res.stderr
