"""tools/bench_allreduce.py runs from a clone: its two real processes per case, its table, and the
bytes a frame it reports equal the protocol's own count (16-byte prefix, a one-byte empty header,
the payload, a 16-byte tag when sealed)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_bench_allreduce_prints_each_case_with_the_frames_true_size():
    p = subprocess.run([sys.executable, str(REPO / "tools" / "bench_allreduce.py"), "--dims", "64", "--rounds", "60",
                        "--blocks", "2"], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = re.findall(r"^\| 64 \| (\w+) \| (yes|no) \| ([\d,]+) \| (\d+) / \d+ \| (\d+) / \d+ \| (\d+) / \d+ \|",
                      p.stdout, re.M)
    assert {(sync, sealed) for sync, sealed, *_ in rows} == {("f32", "no"), ("f32", "yes"), ("q8_0", "no"),
                                                             ("q8_0", "yes")}
    for sync, sealed, size, raw_us, polled_us, ours_us in rows:
        payload = 64 * 4 if sync == "f32" else 64 // 32 * 34
        assert int(size.replace(",", "")) == 16 + 1 + payload + (16 if sealed == "yes" else 0)
        assert int(raw_us) > 0 and int(polled_us) > 0 and int(ours_us) > 0
    assert "worst beyond ÷ polled raw" in p.stdout


def test_bench_allreduce_refuses_a_width_that_is_not_whole_blocks():
    p = subprocess.run([sys.executable, str(REPO / "tools" / "bench_allreduce.py"), "--dims", "100"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "multiples of 32" in p.stderr and "Traceback" not in p.stderr
