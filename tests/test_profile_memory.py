"""What a node offers the planner: its runtime is measured, and `max_memory_mb` caps the free memory offered.

References: the kernel's own /proc figures, and memory this test allocates and touches itself.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from edgetp.parallel import profile

MiB = 1 << 20


@pytest.fixture
def no_cap():
    yield
    profile.limit_memory(None)


# Measured in a child of its own: in the whole suite, threads and collectable garbage left by earlier
# tests move this process's anonymous memory while it is read (a CI run saw a 64 MiB allocation
# grow it by 0.0 MiB). A fresh interpreter does nothing else between the reads.
_MEASURE = """
import json, sys
import numpy as np
from edgetp.parallel import profile
MiB = 1 << 20
before = profile.runtime_bytes()
block = np.ones(64 * MiB, np.uint8)  # 64 MiB, every page touched
allocated = profile.runtime_bytes() - before
del block
before = profile.runtime_bytes()
mapped = np.memmap(sys.argv[1], np.uint8, "r")
total = int(mapped.sum(dtype=np.uint64))  # every page read: resident, but file-backed
print(json.dumps({"allocated": allocated, "mapped": profile.runtime_bytes() - before, "total": total}))
"""


def test_the_runtime_figure_grows_by_what_the_process_allocates_and_not_by_mapped_files(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\x01" * (32 * MiB))
    done = subprocess.run([sys.executable, "-c", _MEASURE, str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["total"] == 32 * MiB
    assert 62 * MiB <= got["allocated"] <= 70 * MiB, got
    assert got["mapped"] < 8 * MiB, got


def test_without_smaps_rollup_the_status_counters_are_read(tmp_path):
    status = tmp_path / "status"
    status.write_text("VmRSS:\t  9000 kB\nRssAnon:\t  3000 kB\nRssFile:\t  5000 kB\nRssShmem:\t  1000 kB\n")
    assert profile.runtime_bytes(rollup=str(tmp_path / "absent"), status=str(status)) == 4000 * 1024
    status.write_text("VmRSS:\t  9000 kB\n")
    with pytest.raises(OSError, match="has no RssAnon line"):
        profile.runtime_bytes(rollup=str(tmp_path / "absent"), status=str(status))


def test_a_cap_below_the_runtime_offers_nothing(no_cap):
    profile.limit_memory(profile.runtime_bytes() // 2)
    assert profile.memory_free() == 0
    assert profile.profile(1, 0.05).mem_free == 0


def test_a_cap_offers_what_is_left_of_it_once_the_runtime_is_counted(no_cap):
    runtime = profile.runtime_bytes()
    profile.limit_memory(runtime + 300 * MiB)
    offered = profile.memory_free(runtime=runtime)
    uncapped = profile.mem_available()
    assert offered == min(300 * MiB, uncapped, profile.cgroup_room() or uncapped)


def test_without_a_cap_the_kernel_figure_is_offered(no_cap, tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  8000000 kB\nMemFree:  300000 kB\nMemAvailable:  2048 kB\nCached:  900000 kB\n")
    assert profile.memory_free(str(meminfo)) == 2048 * 1024  # MemAvailable, not MemFree or MemTotal
    meminfo.write_text("MemTotal:  8000000 kB\nMemFree:  300000 kB\n")
    with pytest.raises(OSError, match="has no MemAvailable line"):
        profile.memory_free(str(meminfo))


def _kernel_offer() -> int:
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    room = profile.cgroup_room()
    return available if room is None else min(available, room)


def test_the_live_figure_lies_between_the_kernel_figures_read_around_it(no_cap):
    # Other processes move MemAvailable from one read to the next (a CI host moved it 66 MiB):
    # the offer must lie between what the kernel said just before and just after, within a margin.
    before = _kernel_offer()
    got = profile.memory_free()
    after = _kernel_offer()
    assert min(before, after) - 256 * MiB <= got <= max(before, after) + 256 * MiB


def test_a_negative_cap_is_refused(no_cap):
    with pytest.raises(ValueError, match="memory cap"):
        profile.limit_memory(-1)
