"""What the tests that run each ISA share: the ISAs this CPU runs, and a child process forced onto one
as a user forces it (EDGETP_ISA)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from edgetp.model import isa

REPO = Path(__file__).resolve().parent.parent
HOST = isa.host_features()
RUNNABLE = isa.usable(*HOST)


def child_timeout(default: float) -> float:
    """Seconds a child that compiles every kernel of its ISA may take; the arm64 test bed raises it
    (EDGETP_TEST_CHILD_TIMEOUT: qemu-user is slow)."""
    return float(os.environ.get("EDGETP_TEST_CHILD_TIMEOUT", default))


def child_env(name: str, **extra: str) -> dict[str, str]:
    """This process's environment for a child on ISA `name`, with `extra` set. A numba target set
    for this process's ISA is not the child's: its ISA sets its own."""
    env = dict(os.environ, EDGETP_ISA=name, PYTHONPATH=str(REPO), **extra)
    if name != isa.current():
        env.pop("NUMBA_CPU_NAME", None)
        env.pop("NUMBA_CPU_FEATURES", None)
    return env


def skip_unless_runnable(name: str) -> None:
    if name not in RUNNABLE:
        pytest.skip(f"{name} cannot run on this {HOST[0]} CPU: it needs {isa.WHERE[name]}")
