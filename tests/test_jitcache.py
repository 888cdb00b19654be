"""numba's cache folder follows the kernels' source (edgetp/model/jitcache.py), in real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import gguf
from gguf import GGMLQuantizationType

from edgetp.model import jitcache
from tests.isas import child_timeout

REPO = Path(__file__).resolve().parent.parent
CHILD = """
import os
import numpy as np
from edgetp.model import ops
x = np.ones((1, 64), np.float32)
ops.rmsnorm(x, np.ones(64, np.float32), 1e-5, np.empty_like(x))
print(os.environ.get("NUMBA_CACHE_DIR", ""))
"""


def _child(env_extra: dict[str, str], drop: tuple[str, ...] = ("NUMBA_CACHE_DIR",)) -> str:
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(env_extra, PYTHONPATH=str(REPO))
    res = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout.strip().splitlines()[-1]


def test_a_process_caches_its_kernels_in_the_folder_of_this_source_version(tmp_path):
    used = Path(_child({"EDGETP_CACHE_DIR": str(tmp_path)}))
    assert used == tmp_path / "numba" / jitcache.digest()
    assert list(used.rglob("*.nbi")), "the kernel it compiled was not cached there"


def test_a_numba_cache_dir_set_by_the_user_wins(tmp_path):
    mine = tmp_path / "mine"
    assert _child({"EDGETP_CACHE_DIR": str(tmp_path / "c"), "NUMBA_CACHE_DIR": str(mine)}, drop=()) == str(mine)
    assert not (tmp_path / "c" / "numba").exists()


def test_older_folders_beyond_the_most_recent_few_are_removed(tmp_path):
    root = tmp_path / "numba"
    olds = [root / f"old{i}" for i in range(4)]
    for i, d in enumerate(olds):
        (d / "x").mkdir(parents=True)
        t = time.time() - 1000 * (i + 1)  # old0 the newest
        os.utime(d, (t, t))
    used = Path(_child({"EDGETP_CACHE_DIR": str(tmp_path)}))
    assert sorted(p.name for p in root.iterdir()) == sorted([used.name] + [d.name for d in olds[: jitcache.KEEP - 1]])


def test_the_digest_changes_with_any_file_of_the_model_package_or_using_numba_and_only_those(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "model").mkdir()
    kern, ir, other = tmp_path / "sub" / "k.py", tmp_path / "model" / "ir.py", tmp_path / "o.py"
    kern.write_text("from numba import njit\n")
    ir.write_text("from llvmlite import ir\n")  # what kernels are generated from, without numba
    other.write_text("x = 1\n")
    first = jitcache.digest(tmp_path)
    other.write_text("x = 2\n")
    assert jitcache.digest(tmp_path) == first
    kern.write_text("from numba import njit  # changed\n")
    second = jitcache.digest(tmp_path)
    assert second != first
    ir.write_text("from llvmlite import ir  # changed\n")
    assert jitcache.digest(tmp_path) != second


COMPILES = """
import gc, sys
from numba.core.registry import CPUDispatcher
from edgetp.cli import main
code = main(["ask", "--local", "--model", sys.argv[1], "--max-tokens", "4", "--temperature", "0", "Once upon a time"])
assert code == 0, code
mine = [d for d in gc.get_objects() if isinstance(d, CPUDispatcher) and d.py_func.__module__.startswith("edgetp")]
compiled = sorted({d.py_func.__qualname__ for d in mine  # a miss, or compiled where nothing is cached
                   if sum(d.stats.cache_misses.values()) or (d.overloads and type(d._cache).__name__ == "NullCache")})
kinds = set()  # the GGUF types whose kernels this process built: a type-specialised closure's KIND, deq's literal
for d in mine:
    code, cells = d.py_func.__code__, d.py_func.__closure__ or ()
    if d.overloads and "KIND" in code.co_freevars:
        kinds.add(cells[code.co_freevars.index("KIND")].cell_contents)
from edgetp.model import deq
for sig in deq.deq_row.signatures:
    kinds.add(getattr(sig[0], "literal_value", "any"))  # "any": compiled for every type at once
print("kinds:", " ".join(sorted(map(str, kinds))))
print("compiled:", " ".join(compiled) or "-")
"""


def test_a_second_process_loads_every_kernel_the_first_compiled_and_compiles_none(tmp_path, synth_model):
    # numba keys a closure's cache entry by its captured values, pickled; a captured dispatcher pickles
    # with a uuid of its process, so a kernel capturing another was compiled afresh at every start
    # (the kept panels' runner: 11 compiles and ~15 s for each `edgetp ask` of SmolLM2, an entry more
    # in its index each time)
    model = synth_model("tiny-k", "q4_0")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env.update(NUMBA_CACHE_DIR=str(tmp_path / "numba"), EDGETP_CACHE_DIR=str(tmp_path), PYTHONPATH=str(REPO))
    runs, kinds = [], []
    for _ in range(2):
        res = subprocess.run([sys.executable, "-c", COMPILES, str(model)], capture_output=True, text=True, env=env,
                             cwd=REPO, timeout=child_timeout(900))  # cold, the first compiles every kernel
        assert res.returncode == 0, res.stderr[-2000:]
        runs.append(res.stdout.rsplit("compiled:", 1)[-1].split())  # after the answer's text
        kinds.append(res.stdout.rsplit("kinds:", 1)[-1].split("\n", 1)[0].split())
    assert runs[0] != ["-"], "the first process compiled nothing: the check sees no kernel"
    assert "_kept.<locals>.run" in runs[0]
    assert runs[1] == ["-"], runs[1]
    # and it built kernels for the types its model holds, no others (the prefill probe once compiled
    # every type's tiles, and deq_row every type's rows, whatever the model: 85 of SmolLM2's 120 s cold)
    held = {int(t.tensor_type) for t in gguf.GGUFReader(model).tensors}
    assert int(GGMLQuantizationType.Q4_0) in {int(k) for k in kinds[0] if k.isdigit()}, kinds[0]
    assert set(kinds[0]) <= {str(t) for t in held}, (kinds[0], sorted(held))


KINDS = """
import functools
from numba import njit


@functools.cache
def make(kind):
    @njit(cache=True)
    def f(x):
        return x * 0 + kind
    return f
"""
COMPILE = """
import sys, time
import edgetp.model  # numba's cache saves locked between processes, as in every edgetp process
import kinds
start = float(sys.argv[1])
while time.time() < start:
    time.sleep(0.001)
for k in sys.argv[2].split(","):
    assert kinds.make(int(k))(1) == int(k)
"""
LOAD = """
import sys
import edgetp.model
import kinds
for k in range(int(sys.argv[1])):
    f = kinds.make(k)
    print(k, f(1), sum(f.stats.cache_misses.values()))
"""


def test_processes_compiling_one_kernels_closures_at_once_each_find_their_own_code_later(tmp_path):
    # closures of one function share numba's index (edgetp's kernels per GGUF type are such
    # closures); numba's unlocked save let two processes take one data file name, and a later
    # start then loaded another closure's code under a key (6 of 80 here on the tree before)
    (tmp_path / "kinds.py").write_text(KINDS)
    procs, kinds = 4, 120
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=os.pathsep.join((str(REPO), str(tmp_path))))
    start = str(time.time() + 5)  # every child imported by then: their compiles overlap
    children = [subprocess.Popen([sys.executable, "-c", COMPILE, start, ",".join(str(k) for k in range(p, kinds, procs))],
                                 cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True) for p in range(procs)]
    for c in children:
        assert c.wait(timeout=child_timeout(300)) == 0, c.stderr.read()[-2000:]
    res = subprocess.run([sys.executable, "-c", LOAD, str(kinds)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=child_timeout(300))
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [tuple(map(int, line.split())) for line in res.stdout.split("\n") if line]
    assert len(rows) == kinds
    assert [(k, got) for k, got, _ in rows if got != k] == []  # each closure's own captured value
    assert sum(m for _, _, m in rows) == 0  # and every one loaded from the cache, none lost
