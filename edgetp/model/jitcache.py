"""Where numba keeps the compiled kernels: one folder per version of the kernels' source.

numba's on-disk cache is checked against the source file of each function, not of the
functions it calls: decode.py's compiled steps inline intdot.round_into and ops.gelu_mul_row,
so after a change to those files alone (a `git pull` in a working tree) numba would go on
loading the old steps, with the old arithmetic; and the integer kernels are generated from
intdot_ir.py and intdot_layouts.py, which numba never sees. Keying the whole cache by a
digest of every file of the model package (and any other that uses numba) makes any change
to them start a fresh folder.

The folder is <edgetp cache>/numba/<digest>; the few most recently used are kept. A
NUMBA_CACHE_DIR set by the user (or a test) wins. Must run before any @njit(cache=True)
decorator does, which is why the `edgetp.model` package runs it on import.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import sys
from pathlib import Path

KEEP = 3  # cache folders kept: the one in use and the most recently used others
_PACKAGE = Path(__file__).resolve().parent.parent  # edgetp/


def digest(package: Path = _PACKAGE) -> str:
    """sha256 (16 hex) over the path and bytes of every .py file of `package`/model (the kernels,
    and what they are generated from: intdot_ir's LLVM IR, intdot_layouts' rows) and of any other
    file under `package` that uses numba."""
    h = hashlib.sha256()
    for p in sorted(package.rglob("*.py")):
        data = p.read_bytes()
        if p.parent == package / "model" or b"numba" in data:
            h.update(str(p.relative_to(package)).encode() + b"\0" + data + b"\0")
    return h.hexdigest()[:16]


def configure() -> None:
    """Point numba's cache at this source version's folder, unless NUMBA_CACHE_DIR is set.
    Never raises: where the folder cannot be made, numba keeps its default (__pycache__)."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return
    from edgetp.store import cache_dir  # noqa: PLC0415

    try:
        root = cache_dir() / "numba"
        here = root / digest()
        here.mkdir(parents=True, exist_ok=True)
        os.utime(here)  # most recently used
        for old in sorted((p for p in root.iterdir() if p.is_dir() and p != here),
                          key=lambda p: p.stat().st_mtime, reverse=True)[KEEP - 1 :]:
            shutil.rmtree(old, ignore_errors=True)
    except OSError:
        return
    os.environ["NUMBA_CACHE_DIR"] = str(here)  # child processes read it too
    if "numba.core.config" in sys.modules:
        from numba.core import config  # noqa: PLC0415

        config.CACHE_DIR = str(here)


def lock_saves() -> None:
    """Make numba's cache saves safe between processes that share the folder.

    numba saves a compiled function by reading its index file, adding the key, taking the first
    data file name the index does not list, writing the index, then the data, with no lock
    between processes. Two processes compiling closures of one function at once (a root and a
    worker on one machine, each building kernels for its GGUF types: the closures share an
    index) lost each other's keys, and could take the same name: one key then named the other's
    code, and a later start loaded a kernel of another type under it (seen here: 6 closures of
    80 answered for another's captured value). Each save now holds an exclusive flock on
    <index>.lock; a read needs none (the index and data files are replaced whole). Run after
    numba's target is set: it imports numba."""
    try:
        import fcntl  # noqa: PLC0415 - POSIX
    except ImportError:  # pragma: no cover - not POSIX: numba's own behaviour
        return
    from numba.core import caching  # noqa: PLC0415

    cls = caching.IndexDataCacheFile
    if getattr(cls.save, "edgetp_locked", False):
        return

    @contextlib.contextmanager
    def held(index_path: str):
        with open(index_path + ".lock", "ab") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # released when f closes
            yield

    def locked(method):
        @functools.wraps(method)
        def run(self, *args):
            with held(self._index_path):
                return method(self, *args)
        run.edgetp_locked = True
        return run

    cls.save, cls.flush = locked(cls.save), locked(cls.flush)
