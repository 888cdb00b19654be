"""The dashboard's widgets: each draws one slice of a `DashboardState`, nothing else.

A widget gets the whole state through `show(state)` and repaints only when
the fields it draws from changed (the fold keeps unchanged fields the same
objects, so an identity check is enough).
"""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import RenderableType
from rich.style import Style
from rich.table import Table
from rich.text import Text
from textual.widget import Widget

from edgetp.events import NodeView

from .charts import columns, fmt_bytes, fmt_ms, nice_top, sparkline, with_axis
from .state import DashboardState

AXIS = 7  # cells of y-axis labels left of a chart


class StateView(Widget):
    """A widget drawn from the dashboard state alone."""

    SIZED_BY_STATE = False  # True when the state decides the widget's height (a relayout on change)

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.state = DashboardState()

    def depends(self, state: DashboardState) -> tuple[Any, ...]:
        """The parts of the state this widget draws; it repaints when one of them changes."""
        return (state,)

    def show(self, state: DashboardState) -> None:
        old, self.state = self.state, state
        if any(a is not b for a, b in zip(self.depends(old), self.depends(state))):
            self.decorate(state)
            self.refresh(layout=self.SIZED_BY_STATE)

    def decorate(self, state: DashboardState) -> None:
        """Set border titles and the like from the state (called before a repaint)."""

    def on_mount(self) -> None:
        self.decorate(self.state)

    def style_of(self, component: str) -> Style:
        return self.get_component_rich_style(component, partial=True)


class StatusBar(StateView):
    """One line: model, epoch, root, node count, speed, and whether the event stream is up."""

    COMPONENT_CLASSES = {"status--ok", "status--bad", "status--wait"}

    def depends(self, state: DashboardState) -> tuple[Any, ...]:
        return (state.connection, state.model, state.epoch, state.root, state.nodes, state.tokens, state.step_ms)

    def render(self) -> RenderableType:
        s = self.state
        left = Text.assemble(("edgetp", "bold"), f"  {s.model or 'no model yet'}",
                             f"  epoch {s.epoch if s.epoch is not None else '-'}",
                             "  root ", (s.root or "none yet", "bold" if s.root else "italic"),
                             f"  {len(s.nodes)} nodes", (f" ({s.lost} lost)", "bold red") if s.lost else "",
                             f"  {s.rate:.1f} tok/s")
        conn = s.connection
        if conn.state == "connected":
            right = Text("● " + (conn.message or "connected"), self.style_of("status--ok"))
        elif conn.state == "disconnected":
            retry = f", retrying in {conn.retry_in:g} s" if conn.retry_in is not None else ""
            why = f" ({conn.message})" if conn.message else ""
            right = Text(f"● disconnected{retry}{why}", self.style_of("status--bad"))
        elif conn.state == "closed":
            right = Text("● " + (conn.message or "event stream closed"), self.style_of("status--bad"))
        else:
            right = Text("● " + (conn.message or "connecting"), self.style_of("status--wait"))
        grid = Table.grid(expand=True)
        grid.add_column(no_wrap=True, overflow="ellipsis")
        grid.add_column(justify="right", no_wrap=True, overflow="ellipsis")
        grid.add_row(left, right)
        return grid


class NodesTable(StateView):
    """Every node: who it is, what it measured, what share of the model it carries, how it is."""

    SIZED_BY_STATE = True
    STATE_STYLES = {"ready": "green", "joining": "cyan", "loading": "yellow", "lost": "bold red", "foreign": "dim",
                    "idle": "dim"}

    def depends(self, state: DashboardState) -> tuple[Any, ...]:
        return (state.nodes, state.root, state.plan)

    def decorate(self, state: DashboardState) -> None:
        ready = sum(1 for n in state.nodes if n.state == "ready")
        self.border_title = f"Nodes · {ready}/{len(state.nodes)} ready"
        if state.plan:
            self.border_title += f" · {state.plan.split(':')[0]}"  # the plan's kind: single, tp, pp or hybrid

    def render(self) -> RenderableType:
        nodes = self.state.nodes
        if not nodes:
            return Text("No nodes yet: waiting for the cluster to form.", style="dim italic")
        totals = [max((getattr(n, f)[1] for n in nodes), default=0) for f in ("kv_groups", "ffn_cols", "vocab_rows")]
        table = Table(box=box.SIMPLE_HEAD, expand=True, pad_edge=False, show_edge=False)
        staged = len({n.layers for n in nodes if n.layers is not None}) > 1  # a pipeline: show each stage's layers
        mixture = any(n.experts is not None for n in nodes)  # a mixture of experts: who computes which, how often hit
        for name, justify in (("node", "left"), ("address", "left"), ("role", "left"), ("speed", "right"),
                              *((("stage", "right"),) if staged else ()),
                              ("attn", "right"), ("FFN cols", "right"), *((("experts", "right"),) if mixture else ()),
                              ("vocab", "right"),
                              ("free", "right"), ("RTT/p90", "right"), ("Mbit/s", "right"), ("state", "left")):
            table.add_column(name, justify=justify, no_wrap=True, overflow="ellipsis")  # type: ignore[arg-type]
        for n in nodes:
            lost = n.state == "lost"
            role = Text("★ root", "bold") if n.role == "root" else Text("worker")
            table.add_row(Text(n.node_id, "bold" if n.role == "root" else ""), n.address, role,
                          f"{fmt_bytes(n.speed)}/s" if n.speed else "-",
                          *((_stage(n),) if staged else ()),
                          _share(n.kv_groups, totals[0]), _share(n.ffn_cols, totals[1]),
                          *((_experts(n),) if mixture else ()), _share(n.vocab_rows, totals[2]), fmt_bytes(n.mem_free) if n.mem_free else "-",
                          _rtt(n), "-" if not n.mbps else f"{n.mbps:.0f}", _node_state(n),
                          style="dim" if lost else None)
        return table


def _experts(n: NodeView) -> str:
    """The experts a node computes and the tokens routed to them so far, e.g. "4–9 · 312 hits"."""
    if n.experts is None or n.experts[1] <= n.experts[0]:
        return "-"
    return f"{n.experts[0]}–{n.experts[1]} · {sum(n.expert_hits)} hits"


def _stage(n: NodeView) -> str:
    """A pipeline stage's number and its layers, e.g. "1 · 8-16"."""
    if n.layers is None or n.stage is None:
        return "-"
    a, b = n.layers
    return f"{n.stage} · {a}-{b}" if b > a else f"{n.stage} · embeds"


def _rtt(n: NodeView) -> str:
    """The root's link to n: median round trip, and its p90 where measured."""
    if n.rtt_ms is None:
        return "-"
    return fmt_ms(n.rtt_ms) if n.rtt_p90_ms is None else f"{n.rtt_ms:.2f}/{fmt_ms(n.rtt_p90_ms)}"


def _share(span: tuple[int, int], total: int) -> str:
    a, b = span
    if b <= a:
        return "-"
    pct = f" {100 * (b - a) / total:3.0f}%" if total > 0 else ""
    return f"{a}–{b}{pct}"


def _node_state(n: NodeView) -> Text:
    text = Text(n.state, NodesTable.STATE_STYLES.get(n.state, ""))
    if n.transfer is not None and n.transfer[0] < n.transfer[1]:  # a finished download is in the log
        done, total = n.transfer
        frac = done / total if total > 0 else 0.0
        filled = round(frac * 8)
        text.append(f" {'█' * filled}{'░' * (8 - filled)} {100 * frac:.0f}%", "yellow")
    return text


class LatencyChart(StateView):
    """Per token: wall time split into compute (bottom) and waiting on links (top)."""

    COMPONENT_CLASSES = {"chart--compute", "chart--sync"}

    def depends(self, state: DashboardState) -> tuple[Any, ...]:
        return (state.tokens,)

    def render(self) -> RenderableType:
        w, h = self.size
        toks = self.state.tokens
        compute, sync = self.style_of("chart--compute"), self.style_of("chart--sync")
        head = Text.assemble(("■", compute), " compute  ", ("■", sync), " sync")
        if toks:
            last = toks[-1]
            mean = sum(t.total_ms for t in toks) / len(toks)
            head.append(f"   last {fmt_ms(last.total_ms)} = {last.compute_ms:.1f} + {last.sync_ms:.1f}"
                        f" · mean {fmt_ms(mean)}")
        visible = toks[-max(w - AXIS, 0):]
        top = nice_top(max((t.compute_ms + t.sync_ms for t in visible), default=0.0))
        chart = columns([[t.compute_ms for t in toks], [t.sync_ms for t in toks]], [compute, sync],
                        w - AXIS, h - 1, top)
        return Text("\n").join([head, *with_axis(chart, f"{top:g}", "ms", AXIS)])


class RateChart(StateView):
    """Per token: its rate (1000 / wall ms), with the rate over the whole window above (and over every
    stream, when the engine reports its decode steps)."""

    COMPONENT_CLASSES = {"chart--rate"}

    def depends(self, state: DashboardState) -> tuple[Any, ...]:
        return (state.tokens, state.step_ms)

    def render(self) -> RenderableType:
        w, h = self.size
        toks = self.state.tokens
        style = self.style_of("chart--rate")
        if self.state.batches:  # tokens of several streams: each token's rate is its stream's
            head = Text.assemble((f"{self.state.batch_tokens_per_s:.1f} tok/s", style + Style(bold=True)),
                                 f" over all streams · {self.state.tokens_per_s:.1f} per stream"
                                 f" · {self.state.token_count} tokens seen")
        else:
            head = Text.assemble((f"{self.state.tokens_per_s:.1f} tok/s", style + Style(bold=True)),
                                 f" over the last {len(toks)} tokens · {self.state.token_count} tokens seen")
        rates = [1000.0 / t.total_ms if t.total_ms > 0 else 0.0 for t in toks]
        top = nice_top(max(rates[-max(w - AXIS, 0):], default=0.0))
        chart = columns([rates], [style], w - AXIS, h - 1, top)
        return Text("\n").join([head, *with_axis(chart, f"{top:g}", "tok/s", AXIS)])


class LinkChart(StateView):
    """Per link, per token: bytes sent (↑) and received (↓), on one scale for all links."""

    COMPONENT_CLASSES = {"chart--sent", "chart--received"}
    SIZED_BY_STATE = True

    def depends(self, state: DashboardState) -> tuple[Any, ...]:
        return (state.tokens,)

    def get_content_height(self, container: Any, viewport: Any, width: int) -> int:
        return max(len(self.state.links), 1)

    def render(self) -> RenderableType:
        w, h = self.size
        links = self.state.links
        if not links:
            return Text("No link traffic yet.", style="dim italic")
        sent_style, recv_style = self.style_of("chart--sent"), self.style_of("chart--received")
        name_w = min(max(len(p) for p in links), 21)
        bar_w = max((w - name_w - 2 * 12) // 2, 4)
        toks = self.state.tokens[-bar_w:]
        series = {p: ([0.0] * len(toks), [0.0] * len(toks)) for p in links}
        for i, t in enumerate(toks):
            for peer, sent, received in t.links:
                series[peer][0][i], series[peer][1][i] = sent, received
        top = max((v for s, r in series.values() for v in (*s, *r)), default=0.0) or 1.0
        rows = []
        for peer in links[: max(h, 1)]:
            sent, received = series[peer]
            rows.append(Text.assemble(peer[:name_w].ljust(name_w), (" ↑", sent_style),
                                      sparkline(sent, bar_w, top, sent_style),
                                      f" {fmt_bytes(sent[-1] if sent else 0):>8}", (" ↓", recv_style),
                                      sparkline(received, bar_w, top, recv_style),
                                      f" {fmt_bytes(received[-1] if received else 0):>8}"))
        return Text("\n").join(rows)


class GenerationView(StateView):
    """The prompt and the answer as it streams; the newest lines stay in view."""

    COMPONENT_CLASSES = {"generation--prompt"}

    def depends(self, state: DashboardState) -> tuple[Any, ...]:
        return (state.generation,)

    def decorate(self, state: DashboardState) -> None:
        gen = state.generation
        if gen is None:
            self.border_subtitle = ""
            return
        who = "asked here" if gen.origin == "dashboard" else f"request {gen.request_id}"
        status = f"finished ({gen.finish_reason or 'done'})" if gen.finished else "streaming…"
        self.border_subtitle = f"{who} · {gen.tokens} tokens · {status}"

    def render(self) -> RenderableType:
        gen = self.state.generation
        if gen is None:
            return Text("No generation yet. Press p to ask the cluster.", style="dim italic")
        text = Text()
        text.append("› ", self.style_of("generation--prompt"))
        text.append(gen.prompt or "(prompt not seen: joined mid-answer)", self.style_of("generation--prompt"))
        text.append("\n\n")
        text.append(gen.text)
        if not gen.finished:
            text.append("▍", "dim")
        w, h = self.size
        if w <= 0 or h <= 0:
            return text
        lines = text.wrap(self.app.console, w)
        return Text("\n").join(lines[-h:])


class EventLog(StateView):
    """The last events, newest at the bottom, as many as fit."""

    KIND_STYLES = {"join": "green", "profile": "green", "leave": "bold red", "election": "bold magenta", "replan": "cyan",
                   "transfer": "yellow", "error": "bold red", "request": "blue", "connection": "bright_black",
                   "ask": "blue", "warning": "yellow", "rebalance": "bold cyan"}

    def depends(self, state: DashboardState) -> tuple[Any, ...]:
        return (state.log,)

    def decorate(self, state: DashboardState) -> None:
        self.border_subtitle = f"{len(state.log)} entries" if state.log else ""

    def render(self) -> RenderableType:
        entries = self.state.log[-max(self.size.height, 1):]
        if not entries:
            return Text("No events yet.", style="dim italic")
        lines = [Text.assemble((f"{e.kind:<11}", self.KIND_STYLES.get(e.kind, "")), e.message) for e in entries]
        out = Text("\n").join(lines)
        out.no_wrap, out.overflow = True, "ellipsis"
        return out


class RequestsView(StateView):
    """Every request the root runs: its slot, prompt (and how much of it the prefix cache saved), tokens, rate."""

    SIZED_BY_STATE = True

    def depends(self, state: DashboardState) -> tuple[Any, ...]:
        return (state.requests, state.slots)

    def decorate(self, state: DashboardState) -> None:
        running = sum(1 for r in state.requests if not r.finished)
        self.border_title = f"Requests · {running} running"
        s = state.slots
        if s is None:
            self.border_subtitle = ""
            return
        total = str(s.total) if s.total > 0 else "?"
        hits = f" · prefix hits {s.prefix_hits} ({s.cached_tokens} tokens)" if s.prefix_hits else ""
        self.border_subtitle = f"slots {s.active}/{total} in use · {s.queued} queued{hits}"

    def get_content_height(self, container: Any, viewport: Any, width: int) -> int:
        return len(self.state.requests) + 1 if self.state.requests else 1

    def render(self) -> RenderableType:
        lines = self.state.requests
        if not lines:
            return Text("No requests yet.", style="dim italic")
        table = Table(box=None, expand=True, pad_edge=False, show_edge=False, padding=(0, 1))
        for name, justify in (("request", "left"), ("slot", "right"), ("prompt", "right"), ("cached", "right"),
                              ("tokens", "right"), ("tok/s", "right"), ("state", "left")):
            table.add_column(name, justify=justify, no_wrap=True, overflow="ellipsis",  # type: ignore[arg-type]
                             header_style="bold")
        for r in lines:
            state = Text(r.finish_reason or "done", "dim") if r.finished else Text("running", "green")
            table.add_row(short_id(r.request_id), "-" if r.slot is None else str(r.slot), str(r.prompt_tokens or "-"),
                          str(r.cached_tokens) if r.cached_tokens else "-", str(r.tokens),
                          f"{r.tokens_per_s:.1f}" if r.tokens > 1 else "-", state,
                          style="dim" if r.finished else None)
        return table


def short_id(request_id: str) -> str:
    """An API request id cut like a git hash: 'cmpl-' and 8 of its 24 hex digits (short ids stay whole)."""
    head, _, tail = request_id.rpartition("-")
    return f"{head}-{tail[:8]}" if head and len(tail) > 12 else request_id


class BatchChart(StateView):
    """Per decode step: how many sequences it carried, on a scale of the engine's slots.
    Hidden until the engine reports a decode step (an engine that runs one request at a time reports none)."""

    COMPONENT_CLASSES = {"chart--batch"}

    def depends(self, state: DashboardState) -> tuple[Any, ...]:
        return (state.batches, state.slots)

    def decorate(self, state: DashboardState) -> None:
        self.display = bool(state.batches)

    def render(self) -> RenderableType:
        w, h = self.size
        batches, slots = self.state.batches, self.state.slots
        style = self.style_of("chart--batch")
        if not batches:
            return Text("No decode steps reported yet.", style="dim italic")
        mean = sum(batches) / len(batches)
        head = Text.assemble((f"batch {batches[-1]}", style + Style(bold=True)),
                             f" · mean {mean:.1f} over {len(batches)} steps · {self.state.batch_tokens_per_s:.1f} tok/s")
        if slots is not None and slots.total > 0:
            head.append(f" · {slots.active}/{slots.total} slots in use")
        total = slots.total if slots is not None else 0
        top = max(total, max(batches[-max(w - AXIS, 0):], default=0), 1)
        chart = columns([[float(b) for b in batches]], [style], w - AXIS, h - 1, float(top))
        return Text("\n").join([head, *with_axis(chart, f"{top}", "seqs", AXIS)])
