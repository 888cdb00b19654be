"""What the tests that run each ISA share: the ISAs this CPU runs, and a child process forced onto one
as a user forces it (EDGETP_ISA), run beside the others (`run_each`)."""

from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from edgetp.model import isa

REPO = Path(__file__).resolve().parent.parent
HOST = isa.host_features()
RUNNABLE = isa.usable(*HOST)


def child_timeout(default: float) -> float:
    """Seconds a child that compiles every kernel of its ISA may take. EDGETP_TEST_CHILD_TIMEOUT
    raises it: the arm64 test bed's (qemu-user is slow), and make test's lane of numbers (at nice
    19 beside the rest of the suite: tools/run_suite.py)."""
    return float(os.environ.get("EDGETP_TEST_CHILD_TIMEOUT", default))


def child_env(name: str, **extra: str) -> dict[str, str]:
    """This process's environment for a child on ISA `name`, with `extra` set. A numba target set
    for this process's ISA is not the child's: its ISA sets its own, and its compiled kernels go to
    a folder of its own inside this process's numba cache. numba's own cache was not safe for two
    processes that compile one function for two targets at once: each added its entry to the
    function's one index and picked the next free data file, the same one, so the last writer won
    and an index could name the other target's code. edgetp now locks those saves
    (jitcache.lock_saves); a folder per ISA still keeps each ISA's index small, and later children
    of the same ISA find their kernels there."""
    env = dict(os.environ, EDGETP_ISA=name, PYTHONPATH=str(REPO), **extra)
    if name != isa.current():
        env.pop("NUMBA_CPU_NAME", None)
        env.pop("NUMBA_CPU_FEATURES", None)
        if env.get("NUMBA_CACHE_DIR"):
            env["NUMBA_CACHE_DIR"] = str(Path(env["NUMBA_CACHE_DIR"]) / f"isa-{name}")
    return env


def run_each(children: list[tuple[list[str], dict[str, str]]], timeout: float) -> None:
    """Run each (argv, env) child to its end, in REPO, each within `timeout` seconds (killed past it),
    as many at once as this machine has CPUs: a child's time is mostly numba compiling its ISA's
    kernels, on one core. Raises the first child's failure once every child has ended. The children
    must be of different ISAs (child_env: a numba cache folder each)."""
    with ThreadPoolExecutor(max_workers=max(1, min(len(children), os.cpu_count() or 1))) as pool:
        runs = [pool.submit(subprocess.run, argv, check=True, env=env, cwd=REPO, timeout=timeout)
                for argv, env in children]
    for r in runs:
        r.result()


def skip_unless_runnable(name: str) -> None:
    if name not in RUNNABLE:
        pytest.skip(f"{name} cannot run on this {HOST[0]} CPU: it needs {isa.WHERE[name]}")
