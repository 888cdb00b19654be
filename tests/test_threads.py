"""--threads reaches the threads that run the kernels, and the profile is taken the way compute runs."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from numba import njit, prange

from edgetp.parallel import profile
from edgetp.model import quant as Q


@njit(parallel=True)
def _thread_ids(out):  # which numba threads a parallel loop actually ran on
    for i in prange(out.shape[0]):
        out[i] = numba.get_thread_id()


def _threads_used_by_a_kernel_call_on_a_fresh_thread() -> int:
    w = profile.random_weight(QT.Q8_0, 64, 64)
    x = np.ones(64, np.float32)

    def compute() -> int:
        Q.matvec(w, x, np.empty(64, np.float32))  # the product path applies the count
        ids = np.full(4096, -1, np.int64)
        _thread_ids(ids)
        return len(set(ids.tolist()))

    with ThreadPoolExecutor(1) as pool:  # as the event loop hands compute to a pool thread
        return pool.submit(compute).result()


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs two cores to tell 1 thread from 2")
def test_set_threads_on_one_thread_governs_kernels_run_on_another():
    try:
        Q.set_threads(1)
        assert _threads_used_by_a_kernel_call_on_a_fresh_thread() == 1
        Q.set_threads(2)
        assert _threads_used_by_a_kernel_call_on_a_fresh_thread() == 2
    finally:
        Q.set_threads(None)


def test_set_threads_refuses_counts_numba_cannot_run():
    with pytest.raises(Q.ThreadCountError, match="compute threads"):
        Q.set_threads(numba.config.NUMBA_NUM_THREADS + 1)


@pytest.mark.parametrize("qt", [QT.Q8_0, QT.Q4_K, QT.Q6_K, QT.F16, QT.Q5_0])
def test_profile_times_the_asked_type_at_the_asked_thread_count(qt):
    w = profile.random_weight(qt, 32, 256)
    assert (w.qtype, w.rows, w.cols) == (int(qt), 32, 256)
    try:
        p = profile.profile(threads=1, seconds=0.01, qtype=qt)
    finally:
        Q.set_threads(None)
    assert p.threads == 1 and p.speed > 0


def test_dominant_type_is_the_type_holding_most_layer_bytes(stories_path, smollm2_path):
    from edgetp.model.gguf import open_model  # noqa: PLC0415

    for path in (stories_path, smollm2_path):
        mf = open_model(path)
        by_type: dict[int, int] = {}
        for t in mf.reader().tensors:  # gguf-py's own parse, not our tensor table
            if t.name.startswith("blk.") and len(t.shape) == 2:
                by_type[int(t.tensor_type)] = by_type.get(int(t.tensor_type), 0) + int(t.n_bytes)
        assert mf.dominant_type == max(by_type, key=by_type.__getitem__)
    assert open_model(smollm2_path).dominant_type == QT.Q4_1  # FACTS.md: 210 Q4_1 tensors


def test_cli_says_in_one_line_that_a_thread_count_is_too_high(stories_path):
    too_many = str(numba.config.NUMBA_NUM_THREADS + 1)
    run = subprocess.run([sys.executable, "-m", "edgetp", "ask", "--local", "--model", str(stories_path),
                          "--threads", too_many, "--max-tokens", "2", "Once"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and run.stderr.strip().splitlines() == [
        f"edgetp: threads {too_many} (--threads, EDGETP_THREADS or the config file's threads): this machine runs 1 to "
        f"{numba.config.NUMBA_NUM_THREADS} compute threads"
        " (one per core; NUMBA_NUM_THREADS)"], run.stderr
