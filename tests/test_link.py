"""Links: both modes carry the all-reduce, bytes are counted exactly, waiting costs no CPU."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import msgpack
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import quants

from edgetp.net.frames import FrameType
from edgetp.net.link import ASYNC, BLOCKING, Link, LinkClosed, choose_mode
from edgetp.parallel.collective import Hot, RootReduce, WorkerReduce
from edgetp.serve.spawn import start_worker, stop
from tests.test_parallel import cluster


def test_blocking_mode_is_chosen_while_a_round_trip_costs_few_event_loop_hops():
    assert choose_mode(rtt=50e-6, hop=30e-6) == BLOCKING      # loopback / LAN
    assert choose_mode(rtt=20e-3, hop=30e-6) == ASYNC         # a slow, far link
    assert choose_mode(rtt=20e-3, hop=30e-6, forced=BLOCKING) == BLOCKING


async def _pair() -> tuple[Link, Link]:
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    loop = asyncio.get_running_loop()
    connecting = asyncio.ensure_future(Link.connect("127.0.0.1", server.getsockname()[1]))
    conn, addr = await loop.sock_accept(server)
    server.close()
    return await connecting, Link(conn, f"{addr[0]}:{addr[1]}")


def _frame_bytes(header: dict, payload_bytes: int) -> int:
    """Independent count of one frame on the wire: 16-byte prefix, msgpack header, payload."""
    return 16 + len(msgpack.packb(header, use_bin_type=True)) + payload_bytes


@pytest.mark.parametrize("mode", [BLOCKING, ASYNC])
@pytest.mark.parametrize("sync", ["f32", "q8_0"])
async def test_the_star_all_reduce_sums_partials_in_either_link_mode(mode, sync):
    root_side, worker_side = await _pair()
    loop = asyncio.get_running_loop()
    rng = np.random.default_rng(0)
    mine, theirs = (rng.standard_normal((3, 64)).astype(np.float32) for _ in range(2))
    expected = mine + theirs
    if mode == BLOCKING:
        root_side.enter_blocking()
        worker_side.enter_blocking()
    root_part, worker_part = mine.copy(), theirs.copy()
    reduce_root = RootReduce([Hot(root_side, loop)], sync)
    reduce_worker = WorkerReduce(Hot(worker_side, loop), sync)
    await asyncio.gather(asyncio.to_thread(reduce_root, root_part), asyncio.to_thread(reduce_worker, worker_part))
    np.testing.assert_array_equal(root_part, worker_part)  # every node holds the same bits
    if sync == "f32":
        np.testing.assert_allclose(root_part, expected, rtol=1e-6)
        payload = 3 * 64 * 4
    else:  # the worker's partial and the total each through ggml's Q8_0 (gguf-py), added in f32
        def q8(x):
            return quants.dequantize(quants.quantize(x, QT.Q8_0), QT.Q8_0).reshape(x.shape)

        np.testing.assert_array_equal(root_part, q8(mine + q8(theirs)))
        payload = 3 * 64 // 32 * 34
    header = {}  # sync frames carry no dtype/shape: the plan fixes both
    assert worker_side.counters.sent == root_side.counters.received == _frame_bytes(header, payload)
    assert root_side.counters.sent == worker_side.counters.received == _frame_bytes(header, payload)
    root_side.close()
    worker_side.close()


async def test_a_link_waiting_in_blocking_mode_burns_no_cpu():
    a, b = await _pair()
    a.enter_blocking()
    await b.send(FrameType.PING, {})  # one frame first: the receive's compiled code loads (or compiles) then
    await asyncio.to_thread(a.recv_blocking, FrameType.PING)
    used: list[float] = []

    def wait() -> None:
        t0 = time.thread_time()
        try:
            a.recv_blocking(FrameType.PING)
        finally:
            used.append(time.thread_time() - t0)

    waiter = threading.Thread(target=wait)
    waiter.start()
    await asyncio.sleep(0.5)
    await b.send(FrameType.PING, {})
    await asyncio.to_thread(waiter.join, 10)
    assert used and used[0] < 0.05, f"a blocked receive used {used[0]:.3f} s of CPU in 0.5 s"
    a.close()
    b.close()


async def test_a_garbage_frame_closes_that_link_with_a_reason():
    a, b = await _pair()
    await asyncio.get_running_loop().sock_sendall(b.sock, b"NOPE" + bytes(40))
    with pytest.raises(LinkClosed, match="bad frame.*magic"):
        await a.recv(5)
    assert a.closed
    b.close()


def test_a_worker_survives_garbage_and_serves_the_next_root(stories_path, caplog):
    from edgetp.model import quant  # noqa: PLC0415
    from edgetp.net.loopthread import LoopThread  # noqa: PLC0415

    proc, addr = start_worker()
    try:
        host, port = addr.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"\x00" * 64)  # not a frame
            s.settimeout(10)
            try:
                answer = s.recv(1 << 16)
            except ConnectionResetError:
                answer = b""
            assert answer == b"", "the worker hangs up on a peer that does not speak the protocol"
        quant.set_threads(1)
        with LoopThread() as lt, caplog.at_level(logging.INFO, logger="edgetp.parallel.runner"):
            runner = cluster(lt, stories_path, [addr], [1, 1])
            runner.close()
        assert proc.poll() is None, "the worker must keep running"
        assert any("mode during generations" in r.getMessage() for r in caplog.records), "the mode choice is logged"
    finally:
        stop(proc)
