"""tools/bench_relay.py runs end to end with a real relay process, prints one row per setting, and
its figures obey the setting (a round trip through the relay is never shorter than what it adds);
bad arguments get one line and exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "tools/bench_relay.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_a_short_run_prints_a_row_per_setting_each_at_least_its_setting():
    out = run("--rtt-ms", "0,2", "--rounds", "40")
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r.split("|")[1].strip() for r in rows] == ["0", "2"]
    for r in rows:
        adds_ms, ref, median = (float(x) for x in r.split("|")[1:4])
        assert median >= adds_ms * 1000 - 10  # the relay holds each direction for half of it
        assert ref >= adds_ms * 1000


def test_bad_arguments_get_one_line_and_exit_2():
    for args in (["--rtt-ms", "x"], ["--rounds", "0"], ["--rtt-ms", "-1"]):
        out = run(*args)
        assert out.returncode == 2 and out.stdout == "" and len(out.stderr.strip().splitlines()) == 1, (args, out)
