"""Daemon settings: one frozen value built from defaults, a TOML file, the environment and flags.

Precedence, highest first: a flag (`argv_overrides`, None meaning "not given"), then
`EDGETP_<NAME>` in the environment, then the TOML file (`/etc/edgetp/edgetp.toml` by
default, read only if it exists; a path given explicitly must exist), then the defaults
below. Every layer is checked the same way; a wrong key or value raises `ConfigError`
with one line naming where it came from (file, variable or flag) and the key.

Environment values are strings: lists are comma-separated, booleans are
1/0/true/false/yes/no/on/off. TOML values must have the right TOML type.

Changes after loading go through `dataclasses.replace`, which re-runs the checks.
"""

from __future__ import annotations

import dataclasses
import re
import socket
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgetp.events import NODE_ID_RE
from edgetp.parallel.experts import MODES as EXPERT_MODES
from edgetp.parallel.pipeline import PARALLEL

DEFAULT_CONFIG_PATH = Path("/etc/edgetp/edgetp.toml")
ENV_PREFIX = "EDGETP_"
# EDGETP_ variables that are not settings (read elsewhere): not reported as unknown.
OTHER_ENV = frozenset({"EDGETP_CONFIG", "EDGETP_LINK_MODE", "EDGETP_URL", "EDGETP_API_KEY",  # clients
                       "EDGETP_SPIN_US",  # the all-reduce's receives (edgetp.net.link.spin_ns)
                       "EDGETP_INT8", "EDGETP_ISA",  # the kernels (edgetp.model.quant, edgetp.model.isa)
                       "EDGETP_TEST_CHILD_TIMEOUT"})  # the test suite's child processes (tools/arm64_testbed.sh)
SYNC_TYPES = ("f32", "q8_0")
KV_TYPES = ("f16", "f32", "q8_0")  # what the KV caches hold (edgetp/model/ops.py KV_TYPES)


class ConfigError(ValueError):
    """A setting is unknown or has a bad value; the message is one line naming its source."""


def default_node_id() -> str:
    """This host's name as a node id: its first label, with anything outside [A-Za-z0-9_-] made '-'."""
    label = socket.gethostname().split(".")[0] or "edgetp"
    label = re.sub(r"[^A-Za-z0-9_-]", "-", label)[:63]
    return label if NODE_ID_RE.fullmatch(label) else "edgetp"


NODE_ID_FILE = "node-id"


def state_dir(env: Mapping[str, str], cache_dir: Path) -> Path:
    """Where this node keeps what must survive a restart: systemd's $STATE_DIRECTORY, else the cache dir."""
    first = env.get("STATE_DIRECTORY", "").split(":")[0]
    return Path(first) if first else cache_dir


def persistent_node_id(directory: Path) -> str:
    """The node id kept in `directory`/node-id; on first use a new one (host name + 6 hex) is written there.

    Pis are all called "raspberrypi", hence the random tail; it is kept so a restart is the same node.
    A file that cannot be read or written is logged and a fresh id is used for this run.
    """
    import logging  # noqa: PLC0415 - only this function logs
    import os  # noqa: PLC0415
    import uuid  # noqa: PLC0415

    path = directory / NODE_ID_FILE
    try:
        text = path.read_text().strip()
        if NODE_ID_RE.fullmatch(text):
            return text
        logging.getLogger(__name__).warning("%s holds no valid node id (%r): writing a new one", path, text[:70])
    except FileNotFoundError:
        pass
    except OSError as exc:
        logging.getLogger(__name__).warning("cannot read %s: %s", path, exc)
    node_id = f"{default_node_id()[:56]}-{uuid.uuid4().hex[:6]}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        part = path.with_name(NODE_ID_FILE + ".part")
        with open(part, "w") as f:
            f.write(node_id + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, path)
    except OSError as exc:
        logging.getLogger(__name__).warning("cannot keep the node id in %s (%s): it will change at restart", path, exc)
    return node_id


def _default_cache_dir() -> Path:
    from edgetp.store import cache_dir  # deferred: nothing happens at import time

    return cache_dir()


@dataclass(frozen=True)
class Settings:
    model: str = "smollm2"                  # registry name, cache file name, or path to a .gguf
    key_file: Path | None = None            # cluster key file (`edgetp keygen`); None: no cluster
    host: str = "0.0.0.0"                   # address the data and HTTP ports listen on
    data_port: int = 7710                   # TCP data links (frames)
    http_port: int = 7711                   # HTTP: OpenAI API, cluster API, weight slices
    interfaces: tuple[str, ...] = ()        # IP addresses mDNS uses; () means every interface
    priority: int = 0                       # election: higher leads first
    no_root: bool = False                   # never become root
    threads: int | None = None              # compute threads; None means all cores
    cache_dir: Path | None = None           # models and slices; None: $EDGETP_CACHE_DIR or ~/.cache/edgetp
    node_id: str = ""                       # "" means this host's name
    peers: tuple[str, ...] = ()             # HOST:PORT (HTTP API) to introduce ourselves to, where multicast cannot pass
    sync: str = "f32"                       # all-reduce payload: "f32" or "q8_0"
    sync_pieces: int = 1                    # a decode step's partials in this many pieces, each sent while the next
                                            # computes (the same bits; pays on slow links, costs on loopback)
    ctx: int = 2048                         # context length (KV cache size) of each sequence
    slots: int = 4                          # sequences decoded at once, each with its own KV cache (fewer if memory is short)
    kv_type: str = "f16"                    # KV cache values: "f16" (llama.cpp's default, half of f32), "f32" or "q8_0"
    parallel: str = "auto"                  # plan kind: "auto" (the cost model picks over measured links), "tp"
                                            # (every node splits every layer) or "pp" (a pipeline of single-node stages)
    experts: str = "auto"                   # a mixture of experts: "auto" (the cost model picks), "columns" (every
                                            # node its columns of every expert), "place" (whole experts per node) or
                                            # "mixed" (groups of nodes splitting ranges of experts by columns)
    api_tokens: tuple[str, ...] = ()        # bearer tokens the OpenAI API accepts; () means none needed
    max_memory_mb: int | None = None        # use at most this much memory for edgetp (runtime included); None: no cap
    slice_cache_mb: int = 4096              # model slices kept on disk (cache_dir/shards), least recently used out first
    heartbeat_s: float = 1.0                # seconds between heartbeat proofs to each peer
    heartbeat_timeout_s: float = 3.0        # a peer silent this long is lost (raise it on Wi-Fi that drops out)
    settle_s: float = 1.0                   # joins and changed figures wait this quiet long before a re-plan
    # derived
    peer_addresses: tuple[tuple[str, int], ...] = field(init=False, repr=False, compare=False)
    node_id_given: bool = field(init=False, repr=False, compare=False)  # False: node_id is the host name default

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.init:
                value = _check(f.name, getattr(self, f.name), "Settings")
                object.__setattr__(self, f.name, value)
        object.__setattr__(self, "node_id_given", bool(self.node_id))
        if not self.node_id:
            object.__setattr__(self, "node_id", default_node_id())
        if self.cache_dir is None:
            object.__setattr__(self, "cache_dir", _default_cache_dir())
        object.__setattr__(self, "peer_addresses", tuple(_split_address(p) for p in self.peers))
        if self.heartbeat_s >= self.heartbeat_timeout_s:
            raise ConfigError(f"Settings: heartbeat_s ({self.heartbeat_s:g}) must be below heartbeat_timeout_s "
                              f"({self.heartbeat_timeout_s:g}), or every peer would count as lost")


# --------------------------------------------------------------------------- value checks


def _split_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host  # [v6]:port
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an integer, got {value!r}")
    return value


def _port(value: Any) -> int:
    if not 0 <= _int(value) < 65536:
        raise ValueError(f"expected a port 0..65535 (0: any free port), got {value!r}")
    return value


def _positive(value: Any) -> int:
    if _int(value) <= 0:
        raise ValueError(f"expected a positive integer, got {value!r}")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value


def _nonempty(value: Any) -> str:
    if not _str(value).strip():
        raise ValueError("must not be empty")
    return value


def _path_or_none(value: Any) -> Path | None:
    if value is None or isinstance(value, Path):
        return value
    return Path(_nonempty(value))


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


def _strings(value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ValueError(f"expected a list of strings, got {value!r}")
    return tuple(_nonempty(v) for v in value)


def _peers(value: Any) -> tuple[str, ...]:
    peers = _strings(value)
    for p in peers:
        _split_address(p)
    return peers


def _node_id(value: Any) -> str:
    if _str(value) and not NODE_ID_RE.fullmatch(value):
        raise ValueError(f"expected 1-63 of [A-Za-z0-9_-] starting with a letter or digit, got {value!r}")
    return value


def _sync(value: Any) -> str:
    if value not in SYNC_TYPES:
        raise ValueError(f"expected one of {', '.join(SYNC_TYPES)}, got {value!r}")
    return value


def _kv_type(value: Any) -> str:
    if value not in KV_TYPES:
        raise ValueError(f"expected one of {', '.join(KV_TYPES)}, got {value!r}")
    return value


def _parallel(value: Any) -> str:
    if value not in PARALLEL:
        raise ValueError(f"expected one of {', '.join(PARALLEL)}, got {value!r}")
    return value


def _experts(value: Any) -> str:
    if value not in EXPERT_MODES:
        raise ValueError(f"expected one of {', '.join(EXPERT_MODES)}, got {value!r}")
    return value


def _tokens(value: Any) -> tuple[str, ...]:
    tokens = _strings(value)
    for t in tokens:
        if len(t) < 16 or not t.isprintable() or any(c.isspace() for c in t):
            raise ValueError("each API token must be 16 or more printable characters without spaces")
    return tokens


def _seconds(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 3600:
        raise ValueError(f"expected seconds, more than 0 and at most 3600, got {value!r}")
    return float(value)


def _threads(value: Any) -> int | None:  # also max_memory_mb: a positive integer or None (unset)
    return None if value is None else _positive(value)


CHECKS: dict[str, Callable[[Any], Any]] = {
    "model": _nonempty, "key_file": _path_or_none, "host": _nonempty,
    "data_port": _port, "http_port": _port, "interfaces": _strings,
    "priority": _int, "no_root": _bool, "threads": _threads,
    "cache_dir": _path_or_none, "node_id": _node_id, "peers": _peers,
    "sync": _sync, "sync_pieces": _positive,
    "ctx": _positive, "slots": _positive, "kv_type": _kv_type, "parallel": _parallel, "experts": _experts,
    "api_tokens": _tokens,
    "max_memory_mb": _threads, "slice_cache_mb": _positive,
    "heartbeat_s": _seconds, "heartbeat_timeout_s": _seconds, "settle_s": _seconds,
}
KEYS = tuple(CHECKS)


def _check(key: str, value: Any, source: str) -> Any:
    try:
        return CHECKS[key](value)
    except ValueError as exc:
        raise ConfigError(f"{source}: {key}: {exc}") from None


# --------------------------------------------------------------------------- environment strings

_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


_FIELD_TYPES = {f.name: str(f.type) for f in dataclasses.fields(Settings)}
_ENV_KINDS = {"int": int, "float": float, "bool": bool, "tuple[str, ...]": list}


def _from_env(key: str, text: str) -> Any:
    """An environment string as the Python value the key's check expects."""
    kind = _ENV_KINDS.get(_FIELD_TYPES[key].replace(" | None", ""), str)  # what Settings declares
    if kind is int:
        try:
            return int(text.strip())
        except ValueError:
            raise ValueError(f"expected an integer, got {text!r}") from None
    if kind is float:
        try:
            return float(text.strip())
        except ValueError:
            raise ValueError(f"expected a number, got {text!r}") from None
    if kind is bool:
        word = text.strip().lower()
        if word not in _TRUE | _FALSE:
            raise ValueError(f"expected one of 1/0/true/false/yes/no/on/off, got {text!r}")
        return word in _TRUE
    if kind is list:
        return [t.strip() for t in text.split(",") if t.strip()]
    return text


# --------------------------------------------------------------------------- loading


def read_toml(path: Path) -> dict[str, Any]:
    """The settings table of a TOML file, checked key by key (not yet merged)."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file does not exist") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:  # TOML is UTF-8
        raise ConfigError(f"{path}: not valid TOML: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key not in CHECKS:
            raise ConfigError(f"{path}: unknown key {key!r} (known: {', '.join(KEYS)})")
        out[key] = _check(key, value, str(path))
    return out


def read_env(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, text in env.items():
        if not name.startswith(ENV_PREFIX) or name in OTHER_ENV:
            continue
        key = name[len(ENV_PREFIX):].lower()
        if key not in CHECKS:
            raise ConfigError(f"{name}: unknown setting {key!r} (known: {', '.join(KEYS)})")
        try:
            value = _from_env(key, text)
        except ValueError as exc:
            raise ConfigError(f"{name}: {key}: {exc}") from None
        out[key] = _check(key, value, name)
    return out


def read_flags(overrides: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        flag = "--" + key.replace("_", "-")
        if key not in CHECKS:
            raise ConfigError(f"{flag}: unknown setting {key!r} (known: {', '.join(KEYS)})")
        if value is None:
            continue  # not given on the command line
        if isinstance(value, str) and key not in ("model", "host", "node_id", "sync", "kv_type", "parallel", "experts", "key_file",
                                                                 "cache_dir"):
            try:
                value = _from_env(key, value)
            except ValueError as exc:
                raise ConfigError(f"{flag}: {key}: {exc}") from None
        out[key] = _check(key, value, flag)
    return out


def load_settings(argv_overrides: Mapping[str, Any], env: Mapping[str, str], path: Path | None = None,
                  *, default_path: Path = DEFAULT_CONFIG_PATH) -> Settings:
    """Settings from flags > EDGETP_* environment > TOML file > defaults.

    `path` None means `default_path` if that file exists (no file is fine);
    an explicit `path` must exist.
    """
    if path is None and default_path.exists():
        path = default_path
    merged: dict[str, Any] = read_toml(path) if path is not None else {}
    merged |= read_env(env)
    merged |= read_flags(argv_overrides)
    if merged.get("cache_dir") is None:
        from edgetp.store import cache_dir

        merged["cache_dir"] = cache_dir({k: v for k, v in env.items() if k != "EDGETP_CACHE_DIR"})
    try:
        return Settings(**merged)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:  # pragma: no cover - every key was checked above
        raise ConfigError(f"settings: {exc}") from None
