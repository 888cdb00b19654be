#!/usr/bin/env python3
"""`make test`: the suite in two pytest processes at once, so that a fresh clone's cold run fits
CI's 90 minutes on 2 cores.

Most of a cold run is numba compiling kernels, in one process at a time, on one core; the other
core sat idle. The tests of the numbers (the kernels against their definitions, every ISA this
CPU runs, the engine against exact math and llama.cpp; NUMBERS) use neither the network nor the
clock, so they run in a second pytest beside the rest:
  - at the lowest CPU priority (nice 19), so the tests of daemons, elections and timeouts keep
    their core whenever they want it;
  - with a numba cache folder of its own, inside this source version's (from before numba's saves
    were locked between processes, jitcache.lock_saves; it keeps each lane's compiles apart).
Each lane prints its own output whole, the rest's as it runs and the numbers' once it has ended.
The exit status is pytest's first non-zero one (a lane the arguments leave no test in does not
count). Extra arguments go to both pytest runs, and PYTEST_ADDOPTS reaches both. Stopped (Ctrl-C,
or CI's SIGTERM), it stops both lanes and everything they started (a process group each).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NUMBERS = ["test_batch_rows", "test_decode_fast", "test_engine_reference", "test_intdot", "test_intgemm_isa",
           "test_isa_float", "test_llamacpp_types", "test_quant"]


def numba_folder() -> str:
    """The numba cache folder of this source version (edgetp.model's jitcache), or the user's; asked
    of a child, so that this process's environment stays the user's."""
    code = "import os, edgetp.model; print(os.environ['NUMBA_CACHE_DIR'])"
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True, text=True,
                          timeout=120).stdout.strip()


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def main(args: list[str]) -> int:
    numbers = [f"tests/{m}.py" for m in NUMBERS]
    pytest = [sys.executable, "-m", "pytest", "-q", "-rs", *args]
    # a child that compiles an ISA's kernels at nice 19 takes as long as the rest leaves it the core
    lane_env = dict(os.environ, NUMBA_CACHE_DIR=str(Path(numba_folder()) / "lane-numbers"),
                    EDGETP_TEST_CHILD_TIMEOUT=os.environ.get("EDGETP_TEST_CHILD_TIMEOUT", "3600"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.monotonic()
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryFile("w+") as log:
        try:
            procs.append(subprocess.Popen(["nice", "-n", "19", *pytest, "-o", "cache_dir=.pytest_cache/numbers",
                                           *numbers], cwd=REPO, env=lane_env, stdout=log, stderr=subprocess.STDOUT,
                                          process_group=0))
            procs.append(subprocess.Popen([*pytest, *(f"--ignore={m}" for m in numbers)], cwd=REPO, process_group=0))
            rest = procs[1].wait()
            print(f"\n[run_suite] the rest ended in {time.monotonic() - t0:.0f} s (exit {rest}); "
                  f"the numbers lane ({', '.join(NUMBERS)}) follows", flush=True)
            lane = procs[0].wait()
        finally:
            _stop(procs)
        log.seek(0)
        sys.stdout.write(log.read())
    print(f"[run_suite] both lanes ended in {time.monotonic() - t0:.0f} s: the rest exit {rest}, "
          f"the numbers exit {lane}", flush=True)
    ran = [code for code in (rest, lane) if code != 5]  # 5: a lane the arguments left no test in
    return next((code for code in ran if code), 0) if ran else 5


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
