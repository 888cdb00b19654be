"""The speed profile times weights streamed from RAM, not one matrix that the last-level cache holds.

A token reads every weight once. An 8192 x 2048 Q4_0 matrix (9.4 MB) read again and again stays
in a 32 MiB L3 and ran 2.5x (one core) to 3.1x (two) faster there than from RAM: a node with a
large cache was planned a share its memory could not feed. The cache size comes from sysfs; the
references below are the sysfs files written here, and the arithmetic of the bound.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from edgetp.parallel import profile, runner


def _sysfs(root, entries):
    for i, (level, kind, size) in enumerate(entries):
        d = root / f"index{i}"
        d.mkdir(parents=True)
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    return str(root)


def test_the_last_level_cache_is_the_largest_data_or_unified_one(tmp_path):
    zen4 = _sysfs(tmp_path / "zen4", [(1, "Data", "32K"), (1, "Instruction", "32K"), (2, "Unified", "1024K"),
                                      (3, "Unified", "32768K")])
    assert profile.cache_bytes(zen4) == 32 * 2**20
    pi5 = _sysfs(tmp_path / "pi5", [(1, "Data", "64K"), (1, "Instruction", "64K"), (2, "Unified", "512K"),
                                    (3, "Unified", "2M")])
    assert profile.cache_bytes(pi5) == 2 * 2**20
    # an instruction cache holds no weights, however large
    odd = _sysfs(tmp_path / "odd", [(1, "Instruction", "8M"), (1, "Data", "48K")])
    assert profile.cache_bytes(odd) == 48 * 2**10


def test_no_cache_listed_or_unreadable_sizes_say_none(tmp_path):
    assert profile.cache_bytes(str(tmp_path / "absent")) is None
    garbled = _sysfs(tmp_path / "garbled", [(3, "Unified", "lots")])
    assert profile.cache_bytes(garbled) is None


@pytest.mark.parametrize("nbytes, cache, room, footprint, copies", [
    (17_825_792, 32 * 2**20, 4 * 2**30, None, 4),          # Q8_0 8192 x 2048, 32 MiB L3: 4 x 17.8 MB >= 64 MiB
    (9_437_184, 32 * 2**20, 4 * 2**30, 18_874_368, 8),     # Q4_0: 8 x 9.4 MB >= 64 MiB, 7 would be 63 MiB
    (17_825_792, 2 * 2**20, 1 * 2**30, None, 1),           # a Pi 5's 2 MiB L3: one matrix is already 8x it
    (9_437_184, 32 * 2**20, 50 * 2**20, 18_874_368, 2),    # 50 MiB of room holds two copies with their panels
    (9_437_184, 32 * 2**20, 50 * 2**20, None, 5),          # ... and five without
    (9_437_184, 32 * 2**20, 10 * 2**20, 18_874_368, 1),    # too little room: the one matrix, never none
])
def test_the_timing_cycles_through_twice_the_cache_within_its_room(nbytes, cache, room, footprint, copies):
    assert profile.copies_for(nbytes, cache, room, footprint) == copies


def test_the_timing_matrices_are_separate_memory_with_the_same_values():
    w = profile.random_weight(QT.Q4_0, 256, 2048)
    passes = profile.timing_set([[w]], cache=4 * w.nbytes)
    assert len(passes) == 8 and all(len(p) == 1 and len(p[0]) == 1 for p in passes)
    ws = [p[0][0] for p in passes]
    assert ws[0] is w
    starts = sorted(c.data.ctypes.data for c in ws)
    assert all(b - a >= w.nbytes for a, b in zip(starts, starts[1:]))  # no two share a cache line
    assert all(np.array_equal(c.data, w.data) and (c.qtype, c.rows, c.cols) == (w.qtype, w.rows, w.cols)
               for c in ws)


def test_the_row_cost_is_a_step_of_eight_tokens_against_one_through_the_same_matrices():
    w = profile.random_weight(8, 1024, 2048)  # Q8_0
    ws = profile.timing_set([[w]], cache=0)
    one, eight = profile.step_seconds(ws, 1, 0.05), profile.step_seconds(ws, 8, 0.05)
    assert eight > one  # eight tokens do more arithmetic than one over the same bytes
    p = profile.profile(1, 0.05, 8)
    assert 0 < p.row_cost <= 4.0
    assert runner._row_cost_of({"row_cost": 0.3}) == 0.3
    for bad in ({}, {"row_cost": -1}, {"row_cost": 9.0}, {"row_cost": "0.3"}, {"row_cost": True}):
        assert runner._row_cost_of(bad) == 0.0
