"""An asyncio loop on its own thread, for callers that are not coroutines (the CLI's root)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable, Coroutine


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


def in_daemon_thread(fn: Callable[..., Any], *args: Any, name: str = "edgetp-blocking") -> asyncio.Future:
    """fn(*args) on a daemon thread of its own, awaited like asyncio.to_thread.

    For calls that may run for minutes and cannot be interrupted (numba compiling every kernel at a
    cold start, input() waiting for a line): asyncio.run waits for the default executor's threads
    before it returns, so a stop signal or Ctrl-C would wait for them too. Nothing waits for this
    thread; a cancelled await leaves it to finish or to die with the process."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result: Any, exc: BaseException | None) -> None:
        if future.done():  # cancelled: nobody waits for it
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            result, exc = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            result, exc = None, e
        try:
            loop.call_soon_threadsafe(settle, result, exc)
        except RuntimeError:  # the loop is closed: nobody awaits any more
            pass

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
