"""How fast and how roomy this device is: the inputs of the planner.

Speed is measured with the real decode kernel on a matrix the size of one
FFN projection, so it reflects what this device will actually do per token:
weight bytes streamed through `quant.matvec` per second. Free memory comes
from the kernel's own estimate (MemAvailable).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as QT

from edgetp.model import quant

DEFAULT_ROWS, DEFAULT_COLS = 8192, 2048  # a Llama-3.2-1B FFN projection: 17.8 MB in Q8_0


@dataclass(frozen=True)
class Profile:
    speed: float      # weight bytes per second through the matvec kernel
    mem_free: int     # bytes the system could give us without swapping
    threads: int


def random_q8_0(rows: int, cols: int, seed: int = 0) -> quant.Weight:
    """A random Q8_0 matrix with finite scales (values are irrelevant to speed)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(-127, 128, size=(rows, cols // 32, 34), dtype=np.int8).view(np.uint8)
    scale = np.full((rows, cols // 32), 0.01, np.float16).view(np.uint8).reshape(rows, cols // 32, 2)
    blocks[:, :, :2] = scale
    return quant.Weight(int(QT.Q8_0), rows, cols, np.ascontiguousarray(blocks.reshape(rows, -1)))


def measure_speed(w: quant.Weight | None = None, seconds: float = 0.5, max_runs: int = 5000) -> float:
    """Weight bytes/s of matvec on w (a layer-sized Q8_0 matrix by default).

    Throughput over the whole window, not the best burst: a CPU quota
    (cgroup cpu.max, 100 ms periods) or a busy neighbour on the core must
    show up in the figure, as it will in every token.
    """
    w = w or random_q8_0(DEFAULT_ROWS, DEFAULT_COLS)
    x = np.random.default_rng(1).standard_normal(w.cols).astype(np.float32)
    out = np.empty(w.rows, np.float32)
    quant.matvec(w, x, out)  # compile / warm up
    runs = 0
    t0 = time.perf_counter()
    while runs < max_runs:
        quant.matvec(w, x, out)
        runs += 1
        if time.perf_counter() - t0 >= seconds:
            break
    return w.nbytes * runs / (time.perf_counter() - t0)


def mem_available(meminfo: str = "/proc/meminfo") -> int:
    with open(meminfo) as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError(f"{meminfo} has no MemAvailable line")


def profile(threads: int | None = None, seconds: float = 0.5) -> Profile:
    import numba  # noqa: PLC0415

    if threads:
        quant.set_threads(threads)
    return Profile(measure_speed(seconds=seconds), mem_available(), numba.get_num_threads())
