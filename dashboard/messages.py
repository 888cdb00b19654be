"""The messages the dashboard's parts send each other, as dataclasses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from textual.message import Message


@dataclass
class RecordArrived(Message):
    """A record to fold into the state: from the event source, the asker, or a key binding."""

    record: Any


@dataclass
class PromptSubmitted(Message):
    """The user asked the cluster something from the prompt box."""

    prompt: str
