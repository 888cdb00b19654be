"""An mDNS goodbye is unsigned, so the member it names is asked before it is dropped: real sockets on
loopback play that member, as it answers while serving, while leaving, and while shutting down."""

from __future__ import annotations

import asyncio
import secrets
import socket
import time

import pytest
from aiohttp import web

from edgetp.cluster import peering
from edgetp.cluster.discovery import Joined, Left, PeerAdvert, sign
from edgetp.cluster.membership import GOODBYE_ASKS, Membership
from edgetp.net.auth import cluster_id

KEY = secrets.token_bytes(32)


def advert(node_id: str, http_port: int) -> PeerAdvert:
    return sign(KEY, PeerAdvert(node_id, cluster_id(KEY), 7710, http_port, 1e9, 1 << 30, "sha256-cafe", 0,
                                boot=secrets.token_hex(8), seq=1, addresses=("127.0.0.1",)))


def member_of(http_port: int) -> tuple[Membership, str]:
    """A membership (never started: no mDNS) whose table holds one proven peer at `http_port`."""
    m = Membership(advert("root", 1), key=KEY)
    peer = advert("pi-1", http_port)
    assert m.table.apply(Joined(peer)) and m.table.prove(peer)
    return m, peer.node_id


async def http_peer(handler) -> tuple[web.AppRunner, int]:
    app = web.Application()
    app.router.add_get(peering.NODE_PATH, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, runner.addresses[0][1]


@pytest.mark.parametrize("unclear", ["reset", "silent"])
async def test_a_member_that_leaves_is_gone_even_if_it_cannot_answer_clearly_at_first(unclear):
    """What a node that really leaves can look like to the question its goodbye prompts: for a while its
    connections are reset (its HTTP server shutting down) or get no answer in time (its event loop held
    by a compile at SIGTERM); then its port refuses. Answered "kept" at the first unclear answer, such a
    node stayed planned over until the loss timeout."""
    asked = 0
    closing = asyncio.get_running_loop().time() + (0.6 if unclear == "reset" else 2.5)

    async def shutting_down(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal asked
        asked += 1
        if unclear == "silent":
            await asyncio.sleep(closing - asyncio.get_running_loop().time())
        writer.transport.abort()

    server = await asyncio.start_server(shutting_down, "127.0.0.1", 0)
    try:
        m, node = member_of(server.sockets[0].getsockname()[1])
        goodbye = asyncio.create_task(m._goodbye(m.peer(node)))
        await asyncio.sleep(closing - asyncio.get_running_loop().time())
        server.close()  # the port refuses from now on
        await asyncio.wait_for(goodbye, 30)
        assert asked >= 1
        assert not m.table.alive(m.peer(node)), "unclear answers, then a refused port, is a node that left"
        assert node not in {p.node_id for p in m.usable()}
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("prompt", ["goodbye", "recheck"])
async def test_a_member_that_answers_its_heartbeat_stays_and_is_asked_once(prompt):
    """A goodbye for a member that still serves is forged or stale; a plan that could not use its data
    port (busy, a firewall) leaves it to the plan's backoff: either way it stays a member."""
    asked = 0

    async def serving(request: web.Request) -> web.Response:
        nonlocal asked
        asked += 1
        return web.json_response({"advert": {}, "proof": ""})

    runner, port = await http_peer(serving)
    try:
        m, node = member_of(port)
        if prompt == "goodbye":
            await m._goodbye(m.peer(node))
        else:
            await asyncio.wait_for(rechecked(m, node, "a plan could not use its data port (reset)"), 30)
        assert asked == 1
        assert m.table.alive(m.peer(node))
    finally:
        await runner.cleanup()


async def test_a_member_that_says_it_is_leaving_is_gone():
    async def leaving(request: web.Request) -> web.Response:
        raise web.HTTPServiceUnavailable(text=peering.LEAVING + "\n")

    runner, port = await http_peer(leaving)
    try:
        m, node = member_of(port)
        await m._goodbye(m.peer(node))
        assert not m.table.alive(m.peer(node))
    finally:
        await runner.cleanup()


async def test_a_member_whose_answers_stay_unclear_is_asked_for_a_bounded_time_and_kept():
    """Every question reset, the port never refusing: the goodbye decides nothing, the heartbeats do."""
    asks: list[float] = []

    async def resetting(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        asks.append(time.monotonic())
        writer.transport.abort()

    server = await asyncio.start_server(resetting, "127.0.0.1", 0)
    try:
        m, node = member_of(server.sockets[0].getsockname()[1])
        await asyncio.wait_for(m._goodbye(m.peer(node)), 60)
        assert asks[-1] - asks[0] >= 1.0, "asked again over a while, not only at once"
        assert len(asks) <= 4 * GOODBYE_ASKS, "asked a bounded number of times"
        assert m.table.alive(m.peer(node))
    finally:
        server.close()
        await server.wait_closed()


async def rechecked(m: Membership, node: str, why: str) -> None:
    """m.recheck(node, why), its question run to the end in a task group as run()'s would."""
    async with asyncio.TaskGroup() as tg:
        m._tasks = tg
        m.recheck(node, why)
    m._tasks = None


async def test_a_member_a_plan_cannot_reach_is_asked_and_gone_when_its_port_refuses(caplog):
    """Killed outright, a node sends no goodbye and never answers "leaving": its HTTP port refuses. The
    plan that finds its data port refusing asks, and it is gone then, not after the loss timeout."""
    with socket.socket() as closed:  # bound, never listening: the kernel refuses every connection
        closed.bind(("127.0.0.1", 0))
        m, node = member_of(closed.getsockname()[1])
        await asyncio.wait_for(rechecked(m, node, "a plan could not use its data port (refused)"), 30)
    assert not m.table.alive(m.peer(node))
    assert node not in {p.node_id for p in m.usable()}
    assert "pi-1 left: asked because a plan could not use its data port (refused)" in caplog.text


async def test_a_recheck_of_no_live_member_asks_nothing():
    m, node = member_of(1)
    await rechecked(m, "pi-2", "unknown")  # never a member
    m.table.apply(Left(node))
    await rechecked(m, node, "gone already")
    assert not m._goodbyes and m.peer("pi-2") is None
