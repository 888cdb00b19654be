"""The dashboard's one screen: nodes on top, charts left, the generation and the log right."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer, Input

from .messages import PromptSubmitted
from .state import DashboardState
from .widgets import (BatchChart, EventLog, GenerationView, LatencyChart, LinkChart, NodesTable, RateChart,
                      RequestsView, StateView, StatusBar)


class MainScreen(Screen[None]):
    """Everything at a glance; `show(state)` hands the state to every widget."""

    def compose(self) -> ComposeResult:
        yield StatusBar(id="status")
        yield NodesTable(id="nodes")
        with Horizontal(id="body"):
            with Vertical(id="charts"):
                yield LatencyChart(id="latency")
                yield LinkChart(id="links")
                yield RateChart(id="rate")
                yield BatchChart(id="batch")
            with Vertical(id="talk"):
                yield RequestsView(id="requests")
                yield GenerationView(id="generation")
                yield Input(placeholder="Ask the cluster… (Enter sends, Esc leaves)", id="prompt")
                yield EventLog(id="log")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#latency").border_title = "Latency per token"
        self.query_one("#links").border_title = "Bytes per token, per link"
        self.query_one("#rate").border_title = "Tokens per second"
        self.query_one("#batch").border_title = "Sequences per decode step"
        self.query_one("#generation").border_title = "Generation"
        self.query_one("#log").border_title = "Events"
        self.show(self.app.state)  # type: ignore[attr-defined]

    def show(self, state: DashboardState) -> None:
        for view in self.query(StateView):
            view.show(state)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        prompt = event.value.strip()
        event.input.clear()
        if prompt:
            self.post_message(PromptSubmitted(prompt))
