"""The root of a static cluster (`edgetp serve --workers A,B`): no discovery, no heartbeats.

It plans over the workers that answer and serves; one that does not (powered off at the
root's start, lost mid-answer) is left out with a backoff (serve/backoff.py). Between
requests, a worker left out whose wait is over is knocked on (a TCP connect to its port);
once it answered, the next request re-plans with it. So a Pi that reboots is back in the
plan a request or two after it is up, without restarting the root.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Sequence

from edgetp import events
from edgetp.model.gguf import ModelFile
from edgetp.parallel.profile import mem_available
from edgetp.parallel.runner import ROOT_ID, ClusterRunner, connect_around, reachable
from edgetp.serve.backoff import Backoff

log = logging.getLogger(__name__)


class StaticRoot:
    """Plans over `workers` (in the order given) as they answer; `between` runs before each request.

    `holder` holds the runner in use (the engine: a recovery mid-answer replaces it there);
    `publish` takes the ClusterEvents for the log, the event stream and the dashboard; `planned`
    hears of every runner `between` makes. Events name no node: a worker is known here by its
    address, which is not its node id when the cluster has a key.
    """

    def __init__(self, mf: ModelFile, workers: Sequence[str], weights: Sequence[float] | None,
                 publish: Callable[[events.ClusterEvent], None], **connect: Any) -> None:
        self.mf, self.workers, self.weights, self.connect_kw = mf, list(workers), weights, connect
        self.publish = publish
        self.planned: Callable[[ClusterRunner], None] = lambda runner: None
        self.backoff = Backoff()
        self.holder: Any = None  # the engine, once there is one
        self.epoch = 0  # the latest plan's
        self._knocks: dict[str, asyncio.Task[bool]] = {}  # workers left out, being knocked on

    async def connect(self, addresses: Sequence[str] | None = None, epoch: int = 1) -> ClusterRunner:
        """A runner over every worker of `addresses` (default: all) that works; each that fails is left out
        with a backoff (connect_around)."""
        def left_out(address: str, exc: Exception) -> None:
            now = time.monotonic()
            strike = self.backoff.failed(address, str(exc) or type(exc).__name__, now)
            self._say(f"planning without worker {address} for {strike.until - now:.0f} s: {strike.cause}")

        runner = await connect_around(self.mf, list(self.workers if addresses is None else addresses),
                                      weights=self._weights(addresses), epoch=epoch, left_out=left_out,
                                      **self.connect_kw)
        for address in runner.options["addresses"]:
            self.backoff.succeeded(address)
        self.epoch = max(self.epoch, runner.plan.epoch)
        return runner

    async def between(self) -> None:
        """Before a request, with nothing running: re-plan with the workers found answering again (or
        afresh, if the running plan lost a link that no recovery replaced, or the last re-plan failed).

        A worker left out whose backoff is over is knocked on in the background: on a LAN a
        powered-off host takes seconds to fail a connect, which no request should wait for. The
        request after the knock was answered re-plans."""
        runner: ClusterRunner | None = self.holder.runner
        have = set() if runner is None else set(runner.options["addresses"])
        if runner is None or any(link.closed for link in runner.links):
            await self._replace(runner, self._ordered(have | set(self._knock_list())))
            return
        back, now = [], time.monotonic()
        for address in self.workers:
            knock = self._knocks.get(address)
            if address in have or (knock is not None and not knock.done()):
                continue
            if knock is not None:
                del self._knocks[address]
                if knock.result():
                    back.append(address)
                else:
                    self.backoff.failed(address, "does not answer", now)
            elif address not in self.backoff.excluded(now):
                self._knocks[address] = asyncio.create_task(reachable(address))
        if back:
            self._say(f"worker {', '.join(back)} answers again: re-planning with it", "join")
            await self._replace(runner, self._ordered(have | set(back)))

    async def _replace(self, old: ClusterRunner | None, addresses: list[str]) -> None:
        if old is not None:
            self.epoch = max(self.epoch, old.plan.epoch)
            old.close()
        self.holder.runner = None  # a failure below leaves no closed runner in use: the next request plans
        self.holder.runner = await self.connect(addresses, self.epoch + 1)
        self.planned(self.holder.runner)

    def _knock_list(self, have: set[str] = frozenset()) -> list[str]:
        """The workers not in the plan whose backoff is over."""
        waiting = self.backoff.excluded(time.monotonic())
        return [a for a in self.workers if a not in have and a not in waiting]

    def _ordered(self, addresses: set[str]) -> list[str]:
        return [a for a in self.workers if a in addresses]

    def _weights(self, addresses: Sequence[str] | None) -> list[float] | None:
        """--weights (root first, then each worker as given) for `addresses`, in their order."""
        if self.weights is None or addresses is None:
            return None if self.weights is None else list(self.weights)
        return [self.weights[0]] + [self.weights[self.workers.index(a) + 1] for a in addresses]

    def unplanned(self, model: str) -> events.ClusterView:
        """The view while no plan runs (the last re-plan failed; the next request plans again): this
        node and every worker, none holding a share; a worker waiting out a failure shows as lost."""
        waiting = self.backoff.excluded(time.monotonic())
        root = events.NodeView(ROOT_ID, "local", "root", "joining", 0.0, mem_available())
        workers = [events.NodeView(a, a, "worker", "lost" if a in waiting else "joining", 0.0, 0) for a in self.workers]
        return events.ClusterView(self.epoch, ROOT_ID, model, (root, *workers))

    def _say(self, message: str, kind: str = "error") -> None:
        log.warning("%s", message)
        self.publish(events.ClusterEvent(kind, message))
