"""What the dashboard knows: one frozen value, folded from records by `apply`.

Records are the API's event records (`edgetp.events`) plus a few the
dashboard makes itself: the connection status of its source, the prompt it
asked and the answer streaming back, notices, and a cleared log. `apply` is
pure, so the whole screen is a function of the records seen so far.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Union

from edgetp.events import (NODE_STATES, ROLES, ClusterEvent, ClusterView, NodeView, RequestRecord, SlotsView,
                           StepRecord, TokenRecord)

HISTORY = 120  # tokens kept for the charts
LOG_SIZE = 200  # event log entries kept
FINISHED_KEPT = 4  # finished requests still listed under the running ones
REQUESTS_KEPT = 64  # requests listed at most (a lost "finished" record must not grow the list forever)


# --- records the dashboard makes itself ------------------------------------------------------

@dataclass(frozen=True)
class ConnectionStatus:
    """Where the event source stands: "connecting", "connected", "disconnected" or "closed"."""

    state: str
    message: str = ""
    retry_in: float | None = None  # seconds until the next attempt, when disconnected


@dataclass(frozen=True)
class AskStarted:
    prompt: str


@dataclass(frozen=True)
class AskChunk:
    text: str
    request_id: str | None = None  # the API's id for the answer (its stream chunks' "id"): its events' request_id


@dataclass(frozen=True)
class AskFinished:
    error: str | None = None


@dataclass(frozen=True)
class Notice:
    """A line for the log that did not come from the cluster (a bad record, a failed ask)."""

    message: str
    level: str = "error"


@dataclass(frozen=True)
class ClearLog:
    pass


Record = Union[TokenRecord, RequestRecord, StepRecord, ClusterEvent, ClusterView,
               ConnectionStatus, AskStarted, AskChunk, AskFinished, Notice, ClearLog]


# --- the state -------------------------------------------------------------------------------

@dataclass(frozen=True)
class TokenSample:
    """One token's cost, as the charts need it."""

    index: int
    total_ms: float
    compute_ms: float
    sync_ms: float
    links: tuple[tuple[str, int, int], ...]  # (peer, bytes sent, bytes received), sorted by peer


@dataclass(frozen=True)
class Generation:
    """The answer being written: the cluster's latest request, or the one asked from here."""

    request_id: str | None
    prompt: str
    text: str = ""
    tokens: int = 0
    finished: bool = False
    finish_reason: str | None = None
    origin: str = "cluster"  # "cluster" | "dashboard"


@dataclass(frozen=True)
class RequestLine:
    """One request the root's engine runs (or just finished): its tokens so far and their rate."""

    request_id: str
    prompt: str = ""
    text: str = ""               # the answer so far
    prompt_tokens: int = 0
    cached_tokens: int = 0       # prompt tokens the prefix cache saved
    slot: int | None = None
    tokens: int = 0              # answer tokens so far
    decode_ms: float = 0.0       # summed wall time of its tokens after the first (the first carries the prefill)
    first_ms: float | None = None  # the first token's wall time
    finished: bool = False
    finish_reason: str | None = None

    @property
    def tokens_per_s(self) -> float:
        """Its decode rate: tokens after the first over their summed step time (0 before the second)."""
        return (self.tokens - 1) * 1000.0 / self.decode_ms if self.tokens > 1 and self.decode_ms > 0 else 0.0


@dataclass(frozen=True)
class LogEntry:
    kind: str  # a cluster event name, "request", "connection", "ask" or a notice level
    message: str
    node_id: str | None = None


@dataclass(frozen=True)
class DashboardState:
    connection: ConnectionStatus = ConnectionStatus("connecting")
    epoch: int | None = None
    root: str | None = None
    model: str = ""
    nodes: tuple[NodeView, ...] = ()
    tokens: tuple[TokenSample, ...] = ()  # the last `history` tokens, oldest first
    token_count: int = 0  # every token seen since the dashboard started
    generation: Generation | None = None
    requests: tuple[RequestLine, ...] = ()  # running ones in the order they started, then the last finished
    slots: SlotsView | None = None  # the root engine's slots (total 0: not told yet)
    plan: str | None = None  # the plan's kind and stages (ClusterView.plan), None: not told
    batches: tuple[int, ...] = ()  # sequences per decode step, the last `history` steps, oldest first
    step_ms: tuple[float, ...] = ()  # the wall time of those steps
    log: tuple[LogEntry, ...] = ()  # the last `log_size` entries, oldest first
    received: int = 0  # records folded in so far
    history: int = HISTORY
    log_size: int = LOG_SIZE

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second over the tokens in the window (0 when there are none)."""
        total = sum(t.total_ms for t in self.tokens)
        return len(self.tokens) * 1000.0 / total if total > 0 else 0.0

    @property
    def batch_tokens_per_s(self) -> float:
        """Tokens per second over every stream: the decode steps' tokens over their summed wall time."""
        total = sum(self.step_ms)
        return sum(self.batches) * 1000.0 / total if total > 0 else 0.0

    @property
    def rate(self) -> float:
        """The cluster's answer rate: over every stream when decode steps are reported, else per token."""
        return self.batch_tokens_per_s if self.batches else self.tokens_per_s

    @property
    def links(self) -> tuple[str, ...]:
        """Every peer a token in the window moved bytes over, sorted."""
        return tuple(sorted({peer for t in self.tokens for peer, _, _ in t.links}))

    @property
    def lost(self) -> int:
        return sum(1 for n in self.nodes if n.state == "lost")


# --- the fold --------------------------------------------------------------------------------

def apply(state: DashboardState, record: Any) -> DashboardState:
    """The state after `record`; unknown records only count as received."""
    state = replace(state, received=state.received + 1)
    if isinstance(record, TokenRecord):
        return _token(state, record)
    if isinstance(record, RequestRecord):
        return _request(state, record)
    if isinstance(record, ClusterEvent):
        return _cluster(state, record)
    if isinstance(record, StepRecord):
        return _step(state, record)
    if isinstance(record, ClusterView):
        slots = record.slots if record.slots is not None else state.slots
        return replace(state, epoch=record.epoch, root=record.root, model=record.model, nodes=record.nodes,
                       slots=slots, plan=record.plan if record.plan is not None else state.plan)
    if isinstance(record, ConnectionStatus):
        return _connection(state, record)
    if isinstance(record, AskStarted):
        gen = Generation(None, record.prompt, origin="dashboard")
        return _log(replace(state, generation=gen), LogEntry("ask", f"asked: {_clip(record.prompt)}"))
    if isinstance(record, AskChunk):
        gen = state.generation
        if gen is None or gen.origin != "dashboard" or gen.finished:
            return state
        return replace(state, generation=replace(gen, text=gen.text + record.text, tokens=gen.tokens + 1,
                                                 request_id=gen.request_id or record.request_id))
    if isinstance(record, AskFinished):
        gen = state.generation
        if gen is not None and gen.origin == "dashboard" and not gen.finished:
            state = replace(state, generation=replace(gen, finished=True, finish_reason=record.error and "error"))
        if record.error:
            state = _log(state, LogEntry("error", f"ask failed: {record.error}"))
        return state
    if isinstance(record, Notice):
        return _log(state, LogEntry(record.level, record.message))
    if isinstance(record, ClearLog):
        return replace(state, log=())
    return state


def _token(state: DashboardState, rec: TokenRecord) -> DashboardState:
    links = tuple(sorted((peer, b.sent, b.received) for peer, b in rec.links.items()))
    sample = TokenSample(rec.index, rec.total_ms, rec.compute_ms, rec.sync_ms, links)
    tokens = (state.tokens + (sample,))[-state.history:] if state.history > 0 else ()
    state = replace(state, tokens=tokens, token_count=state.token_count + 1,
                    requests=_on_token(state.requests, rec))
    gen = state.generation
    if gen is not None and gen.request_id == rec.request_id:
        if gen.origin == "cluster":  # the dashboard's own answer streams in through AskChunk
            gen = replace(gen, text=gen.text + rec.text, tokens=gen.tokens + 1)
    elif _free(state, gen):  # follow this request, with what was seen of it (no prompt: joined mid-answer)
        line = next(r for r in state.requests if r.request_id == rec.request_id)
        gen = Generation(rec.request_id, line.prompt, line.text, line.tokens)
    return replace(state, generation=gen)


def _free(state: DashboardState, gen: Generation | None) -> bool:
    """True when the generation view may follow another request: the one it shows is over or gone."""
    if gen is None or gen.finished:
        return True
    if gen.origin == "dashboard":
        return False
    return not any(r.request_id == gen.request_id and not r.finished for r in state.requests)


def _request(state: DashboardState, rec: RequestRecord) -> DashboardState:
    state = _request_line(state, rec)
    gen = state.generation
    if rec.state == "started":
        # a request this dashboard asked is known by the id its answer streams with (AskChunk), never
        # by being the next to start: under load the next to start may be someone else's
        if _free(state, gen) or (gen is not None and gen.request_id == rec.request_id):
            gen = Generation(rec.request_id, rec.prompt)
        entry = LogEntry("request", f"request {rec.request_id} started ({rec.prompt_tokens} prompt tokens)")
        return _log(replace(state, generation=gen), entry)
    if gen is not None and gen.request_id == rec.request_id and gen.origin == "cluster":
        gen = replace(gen, finished=True, finish_reason=rec.finish_reason)
    entry = LogEntry("request", f"request {rec.request_id} finished: {rec.completion_tokens} tokens"
                     f" ({rec.finish_reason or 'no reason'})")
    return _log(replace(state, generation=gen), entry)


def _on_token(lines: tuple[RequestLine, ...], rec: TokenRecord) -> tuple[RequestLine, ...]:
    i = next((i for i, r in enumerate(lines) if r.request_id == rec.request_id), None)
    if i is None:  # joined mid-answer: the request's start was not seen
        return _keep(lines + (RequestLine(rec.request_id, text=rec.text, tokens=1),))
    line = lines[i]
    if line.finished:
        return lines
    if line.tokens == 0:
        line = replace(line, text=rec.text, tokens=1, first_ms=rec.total_ms)
    else:
        line = replace(line, text=line.text + rec.text, tokens=line.tokens + 1,
                       decode_ms=line.decode_ms + rec.total_ms)
    return lines[:i] + (line,) + lines[i + 1:]


def _request_line(state: DashboardState, rec: RequestRecord) -> DashboardState:
    """The request's line started or finished; a prefix hit counted once, on the first record that says it."""
    lines = state.requests
    i = next((i for i, r in enumerate(lines) if r.request_id == rec.request_id), None)
    old = lines[i] if i is not None else RequestLine(rec.request_id)
    slots = state.slots
    if rec.cached_tokens > 0 and old.cached_tokens == 0 and slots is not None:
        slots = replace(slots, prefix_hits=slots.prefix_hits + 1,
                        cached_tokens=slots.cached_tokens + rec.cached_tokens)
    line = replace(old, prompt=rec.prompt or old.prompt, prompt_tokens=rec.prompt_tokens or old.prompt_tokens,
                   cached_tokens=rec.cached_tokens or old.cached_tokens,
                   slot=rec.slot if rec.slot is not None else old.slot)
    if rec.state == "finished":
        line = replace(line, finished=True, finish_reason=rec.finish_reason)
    rest = tuple(r for r in lines if r.request_id != rec.request_id) + (line,)  # finished ones in finishing order
    running = tuple(r for r in rest if not r.finished)
    done = tuple(r for r in rest if r.finished)[-FINISHED_KEPT:] if FINISHED_KEPT > 0 else ()
    return replace(state, requests=_keep(running + done), slots=slots)


def _keep(lines: tuple[RequestLine, ...]) -> tuple[RequestLine, ...]:
    return lines[-REQUESTS_KEPT:]


def _step(state: DashboardState, rec: StepRecord) -> DashboardState:
    slots = state.slots or SlotsView(0, 0, 0)
    slots = replace(slots, active=rec.active, queued=rec.queued)
    if rec.kind != "decode":
        return replace(state, slots=slots)
    keep = state.history
    batches = (state.batches + (rec.batch,))[-keep:] if keep > 0 else ()
    step_ms = (state.step_ms + (rec.ms,))[-keep:] if keep > 0 else ()
    return replace(state, slots=replace(slots, batch=rec.batch), batches=batches, step_ms=step_ms)


def _cluster(state: DashboardState, ev: ClusterEvent) -> DashboardState:
    if ev.epoch is not None:
        state = replace(state, epoch=ev.epoch)
    entry = LogEntry(ev.event, ev.message, ev.node_id)
    if ev.event in ("join", "profile") and ev.node_id is not None:  # a profile brings new figures
        state = replace(state, nodes=_joined(state.nodes, ev.node_id, ev.detail))
    elif ev.event == "leave" and ev.node_id is not None:
        state = replace(state, nodes=_update(state.nodes, ev.node_id, state="lost", rtt_ms=None, transfer=None))
    elif ev.event == "election":
        root = ev.node_id
        nodes = tuple(replace(n, role="root" if n.node_id == root else "worker") for n in state.nodes)
        state = replace(state, root=root, nodes=nodes)
    elif ev.event == "replan":
        shares = ev.detail.get("nodes") or {}
        nodes = state.nodes
        for node_id, share in shares.items() if isinstance(shares, dict) else ():
            fields = _fields(share, ("kv_groups", "ffn_cols", "vocab_rows", "layers", "experts"))
            nodes = _update(nodes, str(node_id), **({"experts": None} | fields))  # no experts named: columns of all
        plan = ev.detail.get("plan")
        state = replace(state, nodes=nodes, plan=str(plan) if plan is not None else state.plan)
    elif ev.event == "transfer" and ev.node_id is not None:
        done, total = int(ev.detail.get("done", 0)), int(ev.detail.get("total", 0))
        loading = total > 0 and done < total
        node = next((n for n in state.nodes if n.node_id == ev.node_id), None)
        node_state = "loading" if loading else ("ready" if node is not None and node.state == "loading" else None)
        changes: dict[str, Any] = {"transfer": (done, total) if loading else None}
        if node_state is not None:
            changes["state"] = node_state
        state = replace(state, nodes=_update(state.nodes, ev.node_id, **changes))
        # the log keeps one line per node's weight transfer: its latest progress
        log = tuple(e for e in state.log if not (e.kind == "transfer" and e.node_id == ev.node_id))
        state = replace(state, log=log)
    return _log(state, entry)


def _connection(state: DashboardState, status: ConnectionStatus) -> DashboardState:
    previous = state.connection
    state = replace(state, connection=status)
    if status.state == previous.state and status.message == previous.message:
        return state
    text = status.message or status.state
    if status.state == "disconnected" and status.retry_in is not None:
        text = f"disconnected ({status.message or 'connection lost'}), retrying in {status.retry_in:g} s"
    return _log(state, LogEntry("connection", text))


def _joined(nodes: tuple[NodeView, ...], node_id: str, detail: dict[str, Any]) -> tuple[NodeView, ...]:
    fields = _fields(detail, ("address", "role", "state", "speed", "mem_free", "kv_groups", "ffn_cols",
                              "vocab_rows", "rtt_ms"))
    if any(n.node_id == node_id for n in nodes):
        return _update(nodes, node_id, **{"state": "ready", **fields})
    base = {"address": "", "role": "worker", "state": "ready", "speed": 0.0, "mem_free": 0}
    try:
        return nodes + (NodeView(node_id, **{**base, **fields}),)
    except TypeError:
        return nodes + (NodeView(node_id, **base),)


def _update(nodes: tuple[NodeView, ...], node_id: str, **changes: Any) -> tuple[NodeView, ...]:
    return tuple(replace(n, **changes) if n.node_id == node_id else n for n in nodes)


def _fields(detail: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """The NodeView fields a detail dict carries, coerced to their types; malformed ones dropped."""
    if not isinstance(detail, dict):
        return {}
    out: dict[str, Any] = {}
    for name in names:
        if name not in detail:
            continue
        value = detail[name]
        try:
            if name in ("kv_groups", "ffn_cols", "vocab_rows", "layers", "experts"):
                a, b = value
                out[name] = (int(a), int(b))
            elif name in ("speed",):
                out[name] = float(value)
            elif name == "rtt_ms":
                out[name] = None if value is None else float(value)
            elif name == "mem_free":
                out[name] = int(value)
            elif name in ("role", "state") and value not in (ROLES if name == "role" else NODE_STATES):
                continue
            else:
                out[name] = str(value)
        except (TypeError, ValueError):
            continue
    return out


def _log(state: DashboardState, entry: LogEntry) -> DashboardState:
    log = (state.log + (entry,))[-state.log_size:] if state.log_size > 0 else ()
    return replace(state, log=log)


def _clip(text: str, width: int = 60) -> str:
    line = " ".join(text.split())
    return line if len(line) <= width else line[: width - 1] + "…"
