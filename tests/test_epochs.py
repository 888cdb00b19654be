"""No split brain: a daemon's worker admits roots by EpochState.require: an older epoch is refused, and so
is the epoch it follows when another root claims it."""

from __future__ import annotations

import asyncio
import sys
import threading
import time

import pytest

from edgetp.model import gguf, quant
from edgetp.net import auth
from edgetp.net.link import LinkClosed
from edgetp.parallel.runner import ClusterRunner
from edgetp.serve import worker as worker_mod
from edgetp.serve.worker import Worker


def refusals(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused root")]


async def test_a_root_of_an_older_epoch_is_refused_and_a_newer_one_takes_over(stories_path, caplog):
    quant.set_threads(1)
    key = auth.generate_key()
    worker = Worker("w1", key=key, threads=1, follow_epochs=True)
    bound: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    serving = asyncio.create_task(worker.serve("127.0.0.1", 0, bound.set_result))
    try:
        addr = f"127.0.0.1:{await bound}"
        mf = gguf.open_model(stories_path)

        async def root(epoch: int, node: str) -> ClusterRunner:
            return await ClusterRunner.connect(mf, [addr], ctx=64, weights=[1, 1], key=key, epoch=epoch, node_id=node)

        current = await root(5, "root-5")
        with pytest.raises(LinkClosed):  # the worker's ERROR says "stale epoch 3" when it arrives before EPIPE
            await root(3, "root-3")
        assert refusals(caplog) == ["refused root root-3: epoch 3 from 'root-3' is older than current epoch 5"]
        assert worker._link_epoch == 5, "the refused root must not disturb the session of epoch 5"
        newer = await root(6, "root-6")  # takes the worker over from epoch 5
        assert worker.epoch == 6
        current.close()
        newer.close()
        same = await root(6, "root-6")  # the same term again (a re-plan by that root) is fine
        same.close()
        with pytest.raises(LinkClosed):
            await root(6, "root-6b")  # another root claiming the same epoch is not
        assert refusals(caplog)[1:] == ["refused root root-6b: epoch 6 already belongs to 'root-6', not 'root-6b'"]
        assert worker.epochs.leader == "root-6"
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)


def _in_hot_loop() -> bool:
    """Whether another thread of this process is inside the worker's compute loop now (the loop's own
    thread closes its link when a receive fails: that close is safe)."""
    for ident, frame in sys._current_frames().items():
        while frame is not None and ident != threading.get_ident():
            if frame.f_code is worker_mod._hot_loop.__code__:
                return True
            frame = frame.f_back
    return False


async def _wait_until(check, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"not within {seconds} s: {what}"
        await asyncio.sleep(0.01)


async def test_a_session_ended_mid_generation_closes_its_link_only_after_its_compute_thread_left_it(
        stories_path, monkeypatch):
    """A newer root takes the worker over, then the worker stops, each while a root's generation holds
    the compute thread in a receive on the old link. The link must close only once that thread is out
    of it: a descriptor closed under a compiled receive is free for the next socket, which the receive
    would then read (another root's frames). The thread is found in the interpreter's stacks. Blocking
    links only: on an asyncio link the thread waits on the event loop, which owns the socket."""
    monkeypatch.setenv("EDGETP_LINK_MODE", "blocking")
    quant.set_threads(1)
    key = auth.generate_key()
    worker = Worker("w1", key=key, threads=1, follow_epochs=True)
    bound: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    serving = asyncio.create_task(worker.serve("127.0.0.1", 0, bound.set_result))
    closed_inside: list[bool] = []  # at each close of a watched link: was another thread still in the loop?

    def watch(link) -> None:
        close = link.close
        link.close = lambda: (closed_inside.append(_in_hot_loop()), close())[1]

    runners = []
    try:
        addr = f"127.0.0.1:{await bound}"
        mf = gguf.open_model(stories_path)
        for epoch in (5, 6):
            runner = await ClusterRunner.connect(mf, [addr], ctx=64, weights=[1, 1], key=key, epoch=epoch,
                                                 node_id=f"root-{epoch}")
            runners.append(runner)
            await asyncio.to_thread(runner.begin)  # RESET: the worker's compute thread waits for a STEP
            await _wait_until(_in_hot_loop, 10, f"root-{epoch}'s generation holds the worker's compute thread")
            watch(worker._link)
        assert worker.epoch == 6 and closed_inside and not any(closed_inside), closed_inside
        closed_inside.clear()
        serving.cancel()  # the worker stops under root-6's generation
        await asyncio.gather(serving, return_exceptions=True)
        assert closed_inside and not any(closed_inside), closed_inside
        assert not _in_hot_loop()
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        for runner in runners:
            runner.close()
