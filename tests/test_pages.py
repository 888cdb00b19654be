"""pages.release: a view of a model file's read-only map gives its pages back to the kernel (the
mapping's resident size, as /proc/self/smaps counts it, falls) and still reads the file's bytes
(compared with the file read by plain os reads); memory that is not such a map is never touched."""

from __future__ import annotations

import gc
import mmap
import os
import sys
import warnings

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


def _file_q4_0(tmp_path, rows: int, cols: int, seed: int):
    """A random Q4_0 weight written to a file and mapped read-only, as gguf._map_tensors maps a
    model's: (its blocks' map, the Weight); skips where Q4_0's panels are not kept and packed for
    prefill too."""
    from gguf import GGMLQuantizationType as QT  # noqa: PLC0415

    from edgetp.model import intgemm  # noqa: PLC0415
    from edgetp.model import quant as Q  # noqa: PLC0415
    from tests.test_quant import random_raw  # noqa: PLC0415

    path = tmp_path / "q4_0.bin"
    path.write_bytes(random_raw(QT.Q4_0, rows, cols, seed).tobytes())
    data = np.memmap(path, dtype=np.uint8, mode="r").reshape(rows, -1)
    w = Q.Weight(int(QT.Q4_0), rows, cols, data)
    if not (Q.kept(w) and intgemm.available(w.qtype)):
        pytest.skip("Q4_0's panels are not kept here (EDGETP_INT8=0, the generic ISA or a failed probe)")
    return data, w


def test_a_kept_weight_read_from_its_file_gives_its_pages_back_once_packed(tmp_path):
    """quant.panels releases the file pages it packed from, and the weight's products stay those of
    the same blocks held in memory of its own (bit for bit), near gguf-py's dequantized product."""
    import gguf.quants  # noqa: PLC0415
    from gguf import GGMLQuantizationType as QT  # noqa: PLC0415

    from edgetp.model import quant as Q  # noqa: PLC0415

    rows, cols = 2048, 1024  # 1.1 MB of Q4_0 blocks
    data, w = _file_q4_0(tmp_path, rows, cols, 5)
    own = Q.Weight(int(QT.Q4_0), rows, cols, np.array(data))
    assert int(data.astype(np.uint64).sum()) > 0 and _resident(data) >= data.nbytes - mmap.PAGESIZE  # all read
    Q.panels(w)
    assert _resident(data) < data.nbytes // 4
    x = np.random.default_rng(1).standard_normal(cols).astype(np.float32)
    out, want = np.empty(rows, np.float32), np.empty(rows, np.float32)
    Q.matvec(w, x, out)
    Q.matvec(own, x, want)
    np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))
    exact = gguf.quants.dequantize(np.array(data), QT.Q4_0).astype(np.float64) @ x.astype(np.float64)
    assert np.abs(out - exact).max() <= 0.02 * np.abs(exact).max()  # int8 activations' rounding


def test_a_kept_weight_is_packed_a_slice_at_a_time_its_slices_pages_given_back_as_it_goes(tmp_path, monkeypatch):
    """A weight of many rows (a vocabulary's output) never has all its file pages mapped beside its
    panels while it is packed: each release sees at most one slice's pages (intgemm.PACK_ROWS rows)
    mapped; and the panels are those packed from the same blocks in memory of their own."""
    from gguf import GGMLQuantizationType as QT  # noqa: PLC0415

    from edgetp.model import intgemm  # noqa: PLC0415
    from edgetp.model import quant as Q  # noqa: PLC0415

    rows, cols = 32 * intgemm.PACK_ROWS + 16, 1024  # 33 slices, the last of one panel (19 MB of Q4_0)
    data, w = _file_q4_0(tmp_path, rows, cols, 6)
    assert _resident(data) <= 4 * MB  # not read yet (as a model's weights before their first use)
    real, seen = pages.release, []

    def release(part):
        seen.append((part.shape[0], _resident(data)))
        return real(part)

    monkeypatch.setattr(Q.pages, "release", release)
    got = Q.panels(w)
    slice_bytes = intgemm.PACK_ROWS * data.shape[1]
    assert [r for r, _ in seen] == [intgemm.PACK_ROWS] * 32 + [16]
    # what is mapped at each release is the slice being released, and what shares a 2 MB page with
    # it or was read ahead (page cache folios may be mapped whole, by huge pages)
    assert max(res for _, res in seen) <= slice_bytes + 4 * MB + 256 * 1024, seen
    assert _resident(data) <= 4 * MB
    want = intgemm.pack(int(QT.Q4_0), np.array(data), Q._TAB16)
    for a, b in zip(got[:2], want[:2], strict=True):  # codes and scales (Q4_0 has no offsets)
        np.testing.assert_array_equal(a, b)


def test_rows_read_now_and_then_come_from_the_file_and_map_none_of_its_pages(synth_model):
    """A token's embedding row, and the head's rows that decode recomputes exactly, read through the
    map stayed mapped with the kernel's fault-around neighbours: a root's RSS grew toward the whole
    table a token at a time. They now come by pread: the map's resident size does not move, and the
    values are gguf-py's dequantization of those rows (the exact logits: its rows times x in f64)."""
    from gguf import GGUFReader  # noqa: PLC0415
    from gguf.quants import dequantize  # noqa: PLC0415

    from edgetp.model import llama  # noqa: PLC0415
    from edgetp.model import quant as Q  # noqa: PLC0415
    from edgetp.model.gguf import ModelFile  # noqa: PLC0415

    path = synth_model("tiny-odd", "q4_0", vocab=20000)  # 1 MB Q4_0 tables: 256 pages each
    mf = ModelFile(path)
    ref = {t.name: dequantize(t.data, t.tensor_type) for t in GGUFReader(path).tensors
           if t.name in ("token_embd.weight", "output.weight")}
    table, head = mf.weight("token_embd.weight"), mf.weight("output.weight")
    assert table.qtype == head.qtype == 2 and table.data.nbytes > MB
    rng = np.random.default_rng(5)
    ids = [int(t) for t in rng.integers(0, 20000, 40)]
    x = rng.standard_normal(head.cols).astype(np.float32)
    logits = rng.standard_normal(head.rows).astype(np.float32)  # stand-ins: they only pick the rows
    exact = logits.copy()
    before = _resident(table.data)

    rows = llama.embed(mf, ids)
    Q.refine_top(head, x, exact, 64)

    assert _resident(table.data) == before  # one map holds both tables
    np.testing.assert_array_equal(rows, ref["token_embd.weight"][ids])
    top = np.argsort(-logits)[:64]
    np.testing.assert_allclose(exact[top], ref["output.weight"][top].astype(np.float64) @ x.astype(np.float64), rtol=1e-6)
    rest = np.setdiff1d(np.arange(head.rows), top)
    np.testing.assert_array_equal(exact[rest], logits[rest])
    with pytest.raises(IndexError, match="row 20000 is outside 0..19999"):
        pages.read_rows(table.data, [3, 20000])


def test_rows_of_a_file_cut_short_since_it_was_mapped_are_an_error_not_zeros(tmp_path):
    """The map's pages past a file's new end would fault (SIGBUS); pread returns short instead,
    and that is one clear error naming the file, while rows still in the file read as written."""
    path, per_page = tmp_path / "rows.bin", mmap.PAGESIZE // 256
    data = np.random.default_rng(3).integers(0, 256, (3 * per_page, 256), dtype=np.uint8)  # 3 pages of rows
    path.write_bytes(data.tobytes())
    a = pages.map_file(path)[: data.nbytes].reshape(data.shape)
    picks = [3 * per_page - 1, 0, 5]
    np.testing.assert_array_equal(pages.read_rows(a, picks), data[picks])
    with open(path, "r+b") as f:
        f.truncate(mmap.PAGESIZE)
    np.testing.assert_array_equal(pages.read_rows(a, [1, per_page - 1]), data[[1, per_page - 1]])
    with pytest.raises(OSError, match=rf"rows\.bin: 256 bytes at byte {mmap.PAGESIZE} could not be read"):
        pages.read_rows(a, [3, per_page])


def test_the_file_a_map_reads_rows_from_is_closed_with_the_map(tmp_path):
    """Closed, not dropped: a file object left to the collector warns (ResourceWarning) as it goes."""
    path = tmp_path / "rows.bin"
    path.write_bytes(bytes(range(256)) * 64)
    fds = lambda: len(os.listdir("/proc/self/fd"))  # noqa: E731
    gc.collect()  # earlier tests' maps left in cycles would otherwise close in the count below
    before = fds()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        a = pages.map_file(path).reshape(64, 256)
        assert fds() > before and pages.read_rows(a, [9])[0, 255] == 255
        del a
        gc.collect()
    assert fds() == before
    assert not [w for w in seen if issubclass(w.category, ResourceWarning)]
