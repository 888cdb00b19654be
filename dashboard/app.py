"""The dashboard app: folds records from its source into one state and shows it.

`run(url)` is the entry point behind `edgetp dashboard [--url URL]`.
"""

from __future__ import annotations

import logging
from typing import Any

import aiohttp
from textual.app import App
from textual.binding import Binding

from .messages import PromptSubmitted, RecordArrived
from .screens import MainScreen
from edgetp.net.httpauth import Credentials

from .source import Asker, AskError, EventSource, HttpAsker, WebSocketSource
from .state import AskFinished, AskStarted, ClearLog, ConnectionStatus, DashboardState, Notice, apply

log = logging.getLogger(__name__)


class DashboardApp(App[None]):
    """The cluster, live. `source` feeds it records; `asker` answers the prompt box."""

    CSS_PATH = "dashboard.tcss"
    TITLE = "edgetp dashboard"
    AUTO_FOCUS = None  # keys are bindings until the user presses p
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("p", "focus_prompt", "Prompt"),
        Binding("c", "clear_log", "Clear log"),
        Binding("escape", "leave_prompt", "Leave prompt", show=False),
    ]

    def __init__(self, source: EventSource, asker: Asker | None = None,
                 state: DashboardState | None = None) -> None:
        super().__init__()
        self.source, self.asker = source, asker
        self.state = state or DashboardState()
        self.main = MainScreen()

    def on_mount(self) -> None:
        self.push_screen(self.main)
        self.run_worker(self._follow(), name="events", group="events", exclusive=True, exit_on_error=False)

    def fold(self, record: Any) -> None:
        """Fold one record into the state and show the result."""
        self.state = apply(self.state, record)
        if self.main.is_mounted:
            self.main.show(self.state)

    async def _follow(self) -> None:
        try:
            async for record in self.source:
                self.post_message(RecordArrived(record))
        except Exception as exc:  # noqa: BLE001 - a broken source is shown, not raised into the UI
            log.exception("event source failed")
            self.post_message(RecordArrived(Notice(f"event source failed: {exc}")))
        self.post_message(RecordArrived(ConnectionStatus("closed", "event source ended")))

    async def _ask(self, prompt: str) -> None:
        assert self.asker is not None
        try:
            async for chunk in self.asker.ask(prompt):
                self.post_message(RecordArrived(chunk))
        except (AskError, aiohttp.ClientError, OSError, TimeoutError) as exc:
            self.post_message(RecordArrived(AskFinished(str(exc) or type(exc).__name__)))
            return
        self.post_message(RecordArrived(AskFinished()))

    def on_record_arrived(self, message: RecordArrived) -> None:
        self.fold(message.record)

    def on_prompt_submitted(self, message: PromptSubmitted) -> None:
        if self.asker is None:
            self.fold(Notice("this dashboard has no API to ask", "warning"))
            return
        self.fold(AskStarted(message.prompt))
        self.run_worker(self._ask(message.prompt), name="ask", group="ask", exclusive=True, exit_on_error=False)

    def action_focus_prompt(self) -> None:
        self.main.query_one("#prompt").focus()

    def action_leave_prompt(self) -> None:
        self.main.set_focus(None)

    def action_clear_log(self) -> None:
        self.fold(ClearLog())


def run(url: str, creds: Credentials = Credentials()) -> None:
    """Watch the cluster whose API is at `url` (e.g. http://127.0.0.1:7711) until the user quits."""
    DashboardApp(WebSocketSource(url, creds=creds), HttpAsker(url, creds=creds)).run()
