"""What the cluster tells its watchers: one record per token, cluster events, snapshots.

These are the records of `GET /v1/events` (one JSON object per message) and
the view the dashboard renders. Frozen values with plain-dict round trips;
`from_dict` validates, because the records cross a network.

The schema sits below every layer that speaks it (membership, serving, the
dashboard, settings), so none of them imports another to share it; the
node id rule lives here for the same reason.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

# A node id is one DNS label (it names the mDNS service instance): no dots.
NODE_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}")

CLUSTER_EVENTS = ("join", "leave", "election", "replan", "transfer", "profile", "error", "rebalance")
# joining: proven, not yet settled (no plan has it); idle: reachable, left out of the plan (its link would slow it)
NODE_STATES = ("ready", "joining", "loading", "lost", "foreign", "idle")
ROLES = ("root", "worker")


class EventError(ValueError):
    """A record that does not have the expected shape."""


@dataclass(frozen=True)
class LinkBytes:
    sent: int
    received: int


@dataclass(frozen=True)
class TokenRecord:
    request_id: str
    index: int                   # 0-based position in the answer
    text: str
    total_ms: float              # wall time of this step
    compute_ms: float            # total minus the time spent waiting on links
    sync_ms: float
    links: dict[str, LinkBytes]  # per link (peer address): bytes this token moved
    type: str = "token"


@dataclass(frozen=True)
class RequestRecord:
    request_id: str
    state: str                   # "started" | "finished"
    prompt: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0       # prompt tokens taken from the prefix cache, not computed again
    slot: int | None = None      # the KV slot the request runs in
    type: str = "request"


@dataclass(frozen=True)
class StepRecord:
    """One step of the root's engine: a decode step (one token for each of `batch` sequences)
    or one prefill chunk (`batch` prompt tokens of one sequence). A step that carries both in one
    pass is one record of each, both with the pass's wall time and `mixed` set: add its ms once."""

    kind: str                    # "decode" | "prefill"
    batch: int
    ms: float                    # wall time of the step
    active: int                  # sequences holding a slot after it
    queued: int                  # requests waiting for a slot
    mixed: bool = False          # one pass with the other kind's record: the same ms, not more
    type: str = "step"


@dataclass(frozen=True)
class SlotsView:
    """The root engine's slots: how many sequences run at once, and what the prefix cache saved."""

    total: int
    active: int
    queued: int
    batch: int = 0               # sequences in the last decode step
    prefix_hits: int = 0         # requests that reused a cached prefix
    cached_tokens: int = 0       # prompt tokens those requests did not compute again


@dataclass(frozen=True)
class ClusterEvent:
    event: str                   # one of CLUSTER_EVENTS
    message: str                 # one line for people
    node_id: str | None = None
    epoch: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)  # e.g. transfer {"done": b, "total": b}
    type: str = "cluster"


@dataclass(frozen=True)
class NodeView:
    node_id: str
    address: str
    role: str                    # one of ROLES
    state: str                   # one of NODE_STATES
    speed: float                 # measured weight bytes/s
    mem_free: int
    kv_groups: tuple[int, int] = (0, 0)
    ffn_cols: tuple[int, int] = (0, 0)
    vocab_rows: tuple[int, int] = (0, 0)
    rtt_ms: float | None = None              # the root's link to it: median round trip
    transfer: tuple[int, int] | None = None  # (bytes done, bytes total) of a weight download
    rtt_p90_ms: float | None = None          # the root's link to it: 90th percentile round trip
    mbps: float | None = None                # the root's link to it: measured throughput, Mbit/s
    stage: int | None = None                 # its pipeline stage (0: the root's), None: in no plan
    layers: tuple[int, int] | None = None    # the layers its stage runs
    experts: tuple[int, int] | None = None   # a mixture's experts it computes (whole, or its columns of them)
    expert_hits: tuple[int, ...] = ()        # tokens routed to each of those experts so far, all layers summed
    machine: str | None = None               # where several nodes share a machine: a tag for it (its boot id's start)
    host_speed: float | None = None          # and the bytes/s those nodes read together


@dataclass(frozen=True)
class ClusterView:
    """GET /v1/cluster, and the `snapshot` record of the event stream."""

    epoch: int
    root: str | None
    model: str
    nodes: tuple[NodeView, ...]
    root_url: str | None = None  # the root's API, where per-token records are published
    slots: SlotsView | None = None  # the root's engine (None where no engine runs here)
    plan: str | None = None  # the plan's kind and stages, one line (parallel/pipeline.describe)
    type: str = "snapshot"


def to_dict(record: Any) -> dict[str, Any]:
    return asdict(record)


def from_dict(d: Any) -> TokenRecord | RequestRecord | StepRecord | ClusterEvent | ClusterView:
    """The record a dict describes; EventError for anything malformed."""
    if not isinstance(d, dict):
        raise EventError(f"a record must be an object, got {type(d).__name__}")
    kind = d.get("type")
    try:
        if kind == "token":
            links = {str(k): LinkBytes(int(v["sent"]), int(v["received"])) for k, v in d["links"].items()}
            return TokenRecord(str(d["request_id"]), int(d["index"]), str(d["text"]), float(d["total_ms"]),
                               float(d["compute_ms"]), float(d["sync_ms"]), links)
        if kind == "request":
            return RequestRecord(str(d["request_id"]), _one_of(d["state"], ("started", "finished")),
                                 str(d.get("prompt", "")), d.get("finish_reason"),
                                 int(d.get("prompt_tokens", 0)), int(d.get("completion_tokens", 0)),
                                 int(d.get("cached_tokens", 0)), None if d.get("slot") is None else int(d["slot"]))
        if kind == "step":
            return StepRecord(_one_of(d["kind"], ("decode", "prefill")), int(d["batch"]), float(d["ms"]),
                              int(d["active"]), int(d["queued"]), bool(d.get("mixed", False)))
        if kind == "cluster":
            return ClusterEvent(_one_of(d["event"], CLUSTER_EVENTS), str(d["message"]), d.get("node_id"),
                                d.get("epoch"), dict(d.get("detail") or {}))
        if kind == "snapshot":
            return ClusterView(int(d["epoch"]), d.get("root"), str(d["model"]),
                               tuple(_node(n) for n in d["nodes"]), d.get("root_url"),
                               None if d.get("slots") is None else _slots(d["slots"]),
                               None if d.get("plan") is None else str(d["plan"]))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise EventError(f"malformed {kind} record: {exc}") from None
    raise EventError(f"unknown record type {kind!r}")


def _one_of(value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{value!r} is not one of {', '.join(allowed)}")
    return value


def _pair(v: Any) -> tuple[int, int]:
    a, b = v
    return int(a), int(b)


def _slots(d: dict[str, Any]) -> SlotsView:
    return SlotsView(int(d["total"]), int(d["active"]), int(d["queued"]), int(d.get("batch", 0)),
                     int(d.get("prefix_hits", 0)), int(d.get("cached_tokens", 0)))


def _node(d: dict[str, Any]) -> NodeView:
    return NodeView(str(d["node_id"]), str(d["address"]), _one_of(d["role"], ROLES),
                    _one_of(d["state"], NODE_STATES), float(d["speed"]), int(d["mem_free"]),
                    _pair(d.get("kv_groups", (0, 0))), _pair(d.get("ffn_cols", (0, 0))),
                    _pair(d.get("vocab_rows", (0, 0))),
                    _opt_float(d.get("rtt_ms")),
                    None if d.get("transfer") is None else _pair(d["transfer"]),
                    _opt_float(d.get("rtt_p90_ms")), _opt_float(d.get("mbps")),
                    None if d.get("stage") is None else int(d["stage"]),
                    None if d.get("layers") is None else _pair(d["layers"]),
                    None if d.get("experts") is None else _pair(d["experts"]),
                    tuple(int(h) for h in d.get("expert_hits", ())), None if d.get("machine") is None else str(d["machine"]),
                    _opt_float(d.get("host_speed")))


def _opt_float(v: Any) -> float | None:
    return None if v is None else float(v)
