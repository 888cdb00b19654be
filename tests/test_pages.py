"""pages.release: a view of a model file's read-only map gives its pages back to the kernel (the
mapping's resident size, as /proc/self/smaps counts it, falls) and still reads the file's bytes
(compared with the file read by plain os reads); memory that is not such a map is never touched."""

from __future__ import annotations

import mmap
import sys

import numpy as np
import pytest

from edgetp.model import pages

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/smaps is Linux's")

MB = 1 << 20


def _resident(a: np.ndarray) -> int:
    """Bytes of the mapping that holds a's first byte now resident (smaps' Rss)."""
    at = a.ctypes.data
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= at < hi
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError("no mapping holds the array")


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "weights.bin"
    data = np.random.default_rng(3).integers(0, 256, 8 * MB + 123, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    return path, data


def test_a_view_of_a_read_only_map_is_unmapped_and_still_reads_the_file(model_file):
    path, data = model_file
    mm = np.memmap(path, dtype=np.uint8, mode="r")  # as gguf._map_tensors maps a model
    view = mm[1000 : 1000 + 6 * MB].reshape(6 * 64, -1)  # a weight's rows, not page-aligned
    assert int(view.astype(np.uint64).sum()) == int(data[1000 : 1000 + 6 * MB].astype(np.uint64).sum())  # all read
    before = _resident(view)
    assert before >= 6 * MB
    released = pages.release(view)
    assert released == 6 * MB - mmap.PAGESIZE  # the whole pages inside it, not the two it shares
    assert _resident(view) <= before - released + 64 * 1024  # (readahead may map a few pages back)
    np.testing.assert_array_equal(view.reshape(-1), np.frombuffer(path.read_bytes(), np.uint8)[1000 : 1000 + 6 * MB])


@pytest.mark.parametrize("mode", ["r+", "c"])
def test_a_writable_map_and_memory_of_its_own_are_left_alone(model_file, mode):
    path, data = model_file
    mm = np.memmap(path, dtype=np.uint8, mode=mode)
    mm[:4096] = 7  # a change of its own: DONTNEED on a private map would drop it
    own = np.array(data[: 4 * MB])
    assert pages.release(mm) == 0 and pages.release(own) == 0
    assert (mm[:4096] == 7).all() and np.array_equal(own, data[: 4 * MB])
    assert pages.release(np.memmap(path, dtype=np.uint8, mode="r")[:100]) == 0  # no whole page in it
