"""No split brain: a daemon's worker admits roots by EpochState.require: an older epoch is refused, and so
is the epoch it follows when another root claims it."""

from __future__ import annotations

import asyncio

import pytest

from edgetp.model import gguf, quant
from edgetp.net import auth
from edgetp.net.link import LinkClosed
from edgetp.parallel.runner import ClusterRunner
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
