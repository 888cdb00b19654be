"""An asyncio loop on its own thread, for callers that are not coroutines (the CLI's root)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Coroutine


class LoopThread:
    """`with LoopThread() as lt: lt.run(coro)`; the loop stops and closes on exit."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="edgetp-control", daemon=True)

    def __enter__(self) -> "LoopThread":
        self._thread.start()
        return self

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()
