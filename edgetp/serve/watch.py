"""Awaiting work that a watch can call off: a forwarded answer whose root the cluster lost, a plan
whose peer the cluster lost. The work's sockets stay open when the peer hangs or is suspended (its
kernel still accepts), so only the membership's heartbeats tell; the watch asks them."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable


async def unless(aw: Awaitable[Any], lost: Callable[[], BaseException | None], every: float) -> Any:
    """`aw`'s result, unless `lost()` (asked every `every` s while it runs) gives an exception first: then
    `aw` is cancelled, waited for (whatever it holds is let go), and that exception raised. If our caller
    is cancelled, `aw` is too."""
    work = asyncio.ensure_future(aw)
    try:
        while not work.done():  # ends with the work, which is bounded by its own timeouts
            await asyncio.wait([work], timeout=every)
            why = None if work.done() else lost()
            if why is not None:
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
                raise why
        return work.result()
    finally:
        work.cancel()  # a no-op once it is done
