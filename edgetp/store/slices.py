"""The slice cache on disk: durable renames and a size cap, least recently used out first.

Slices (parallel/shardfile.py) are written by a root for its workers and fetched by
workers from their root, into one directory per node, usually on an SD card:

- `durable_replace(part, final)` fsyncs the finished file, renames it, and fsyncs the
  directory, so after a power cut a file under its final name is whole (or absent).
- `touch(path)` stamps a slice as used now (its mtime: SD cards are mounted
  noatime/relatime, so access times say nothing).
- `evict(directory, cap)` removes whole slices (the .gguf and its .sha256), least
  recently used first, until the slices left take at most `cap` bytes. It never
  removes a slice in use: one this process has open or mapped (being served,
  loaded by the worker), one named in `keep` (just written or fetched, being
  built), or a `.part` being written; those count against the cap all the same.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)

SUFFIX = ".gguf"
SIDECAR = ".sha256"
PART = ".part"


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make a rename or unlink in `directory` survive a power cut."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike[str]) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def durable_replace(part: str | os.PathLike[str], final: str | os.PathLike[str]) -> None:
    """Rename the finished `part` to `final` with its bytes and the new name on disk."""
    fsync_file(part)
    os.replace(part, final)
    fsync_dir(Path(final).parent)


def write_text_durably(path: Path, text: str) -> None:
    """`path` holds `text` after a power cut, or still holds what it held before."""
    part = path.with_name(path.name + PART)
    with open(part, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)
    fsync_dir(path.parent)


def touch(path: Path) -> None:
    """Stamp a slice as used now; a file gone meanwhile is no error."""
    try:
        os.utime(path)
    except OSError:
        pass


def open_paths(proc: str = "/proc/self") -> set[Path]:
    """Files this process has open or mapped (Linux /proc); empty where /proc is missing."""
    found: set[Path] = set()
    try:
        for fd in os.listdir(f"{proc}/fd"):
            try:
                found.add(Path(os.readlink(f"{proc}/fd/{fd}")))
            except OSError:
                pass  # closed meanwhile
    except OSError:
        pass
    try:
        with open(f"{proc}/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].startswith("/"):
                    found.add(Path(parts[5].rstrip("\n")))
    except OSError:
        pass
    return found


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def evict(directory: str | os.PathLike[str], cap: int, keep: Iterable[str | os.PathLike[str]] = (),
          in_use: set[Path] | None = None) -> list[Path]:
    """Remove least recently used slices until the directory's slices take at most `cap` bytes.

    Returns the slices removed. `keep` names slices (paths or file names) never to remove;
    `in_use` defaults to the files this process has open or mapped. A slice that cannot be
    removed is logged and skipped; if only slices in use are left, the cache stays over the cap.
    """
    directory = Path(directory)
    try:
        entries = list(directory.iterdir())
    except FileNotFoundError:
        return []
    in_use = open_paths() if in_use is None else in_use
    here = {directory, directory.resolve()}
    protected = {Path(k).name for k in keep} | {p.name for p in in_use if p.parent in here}
    total = sum(_size(p) for p in entries if p.is_file())
    slices = []
    for p in entries:
        if p.name.endswith(SUFFIX) and p.is_file():
            try:
                slices.append((p.stat().st_mtime_ns, p))
            except OSError:
                pass
    removed: list[Path] = []
    for _, path in sorted(slices):
        if total <= cap:
            break
        if path.name in protected:
            continue
        sidecar = path.with_name(path.name + SIDECAR)
        freed = _size(path) + _size(sidecar)
        try:
            path.unlink()
            sidecar.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("cannot evict slice %s: %s", path, exc)
            continue
        total -= freed
        removed.append(path)
        log.info("evicted slice %s (%.1f MB, least recently used) to keep %s under %.0f MB",
                 path.name, freed / 1e6, directory, cap / 1e6)
    if removed:
        fsync_dir(directory)
    if total > cap:
        log.warning("slice cache %s holds %.1f MB, over its %.0f MB cap: what is left is in use",
                    directory, total / 1e6, cap / 1e6)
    return removed
