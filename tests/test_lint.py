"""Names that do not exist and imports that nothing uses, found before anything runs.

A name missing from a module's imports fails only when its line runs: d0bc984 called
`isa.int8()` in quant.py without importing isa, every unit test that touched the flag
passed, and `edgetp serve` died at its first warm-up. ruff's pyflakes rules find that
at once (F821); F401 and F841 keep dead imports and locals from hiding the next one.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_name_is_defined_and_every_import_used():
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--select", "F401,F821,F822,F823,F841",
                          "--output-format", "concise", "edgetp", "dashboard", "tools", "tests"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
