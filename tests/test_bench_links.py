"""tools/bench_links.py marks the planner's choice on the measured row of the same plan: the same stages
over the same nodes, whatever order a tensor-parallel group lists its members in.

Checked in a child process: the bench tools set NUMBA_NUM_THREADS=1 when imported (one thread a
process, as their peers), which must not reach this suite's process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.conftest import REPO

CHECK = textwrap.dedent("""
    from tools.bench_links import _same_nodes

    assert _same_nodes("tp: layers 0:16 on root+vm-a+vm-b", "tp: layers 0:16 on root+vm-b+vm-a")
    assert _same_nodes("pp: layers 0:7 on root; layers 7:16 on vm-a", "pp: layers 0:9 on root; layers 9:16 on vm-a")
    assert not _same_nodes("tp: layers 0:16 on root+vm-a", "tp: layers 0:16 on root+vm-b")
    assert not _same_nodes("pp: layers 0:7 on root; layers 7:16 on vm-a", "pp: layers 0:7 on vm-a; layers 7:16 on root")
    assert not _same_nodes("hybrid: layers 0:14 on root+vm-a; layers 14:16 on vm-b",
                           "tp: layers 0:16 on root+vm-a+vm-b")
    print("ok")
""")


def test_a_tensor_group_listed_in_another_order_is_the_same_plan_and_other_nodes_or_stages_are_not():
    done = subprocess.run([sys.executable, "-c", CHECK], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
