"""Who is in the cluster and who leads it: discovery, heartbeats and the election, together.

- mDNS adverts (cluster/discovery.py) add peers to a PeerTable; peers of
  another cluster id (another key) or protocol are listed as foreign and
  never used. Where multicast cannot pass, `peers` (HOST:HTTP-PORT) are
  told we are here every second (cluster/peering.py), and they record us
  in turn.
- Every second each peer's HTTP API is asked for `/v1/cluster/node`; a peer
  that has not answered for `timeout` seconds is no longer usable. This
  catches a node that died without an mDNS goodbye.
- The election (cluster/election.py) runs over our own ballot and the usable
  peers'; a node holding no model never leads. A new leader starts a new epoch.
- `revision` counts changes to the plan's inputs (members, their speed or
  memory), so the root knows when to plan again.

Changes are published as ClusterEvents (join, leave, election, profile).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Callable, Sequence

import aiohttp

from edgetp.cluster import peering
from edgetp.cluster.discovery import Discovery, DiscoveryError, Joined, Left, Peer, PeerAdvert, PeerTable, \
    Updated, ballot_of
from edgetp.cluster.election import Elector
from edgetp.serve import events

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0


class Membership:
    def __init__(self, me: PeerAdvert, *, interfaces: list[str] | None = None, timeout: float = 3.0,
                 publish: Callable[[events.ClusterEvent], None] = lambda e: None,
                 peers: Sequence[tuple[str, int]] = (), key: bytes | None = None) -> None:
        self.me = me
        self.table = PeerTable(me.cluster_id, timeout=timeout)
        self.discovery = Discovery(me, interfaces=interfaces, addresses=interfaces)
        self.elector = Elector(self._ballots, interval=0.5)
        self.publish = publish
        self.static_peers, self.key = tuple(peers), key
        if self.static_peers and key is None:
            raise ValueError("--peer needs the cluster key")
        self.changed = asyncio.Event()  # set on every leader or membership change
        self.revision = 0  # bumped when a member joins, leaves or changes its figures

    @property
    def leader(self) -> str | None:
        return self.elector.state.leader

    @property
    def epoch(self) -> int:
        return self.elector.state.epoch

    def usable(self) -> list[Peer]:
        """Live peers of our cluster; one without the leader's model fetches its slice from it."""
        return self.table.usable()

    def peer(self, node_id: str) -> Peer | None:
        return next((p for p in self.table.peers() if p.node_id == node_id), None)

    def _ballots(self):
        return [ballot_of(self.me)] + [ballot_of(p.advert) for p in self.usable()]

    async def run(self) -> None:
        """Until cancelled; the mDNS record is withdrawn on the way out (a clean leave)."""
        await self.discovery.start()
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._discover())
                tg.create_task(self._heartbeats())
                tg.create_task(self._elect())
                if self.static_peers:
                    tg.create_task(self._introduce_loop())
        finally:
            await self.discovery.stop()

    async def _discover(self) -> None:
        async for ev in self.discovery.events():
            self._apply(ev)

    def _apply(self, ev: Joined | Updated | Left) -> None:
        before = None if isinstance(ev, Left) else self.peer(ev.advert.node_id)
        self.table.apply(ev)
        if isinstance(ev, Left):
            self.publish(events.ClusterEvent("leave", f"{ev.node_id} left", ev.node_id))
        elif before is None:
            peer = self.peer(ev.advert.node_id)
            why = f" (ignored: {peer.foreign})" if peer and peer.foreign else ""
            self.publish(events.ClusterEvent("join", f"{ev.advert.node_id} joined{why}", ev.advert.node_id,
                                             detail={"address": _addr(ev.advert), "speed": ev.advert.speed,
                                                     "mem_free": ev.advert.mem_free}))
        elif replace(before.advert, addresses=()) == replace(ev.advert, addresses=()):
            return  # the same figures again (a --peer hello every second)
        self.revision += 1
        self._poke()

    def introduced(self, advert: PeerAdvert) -> None:
        """A peer told us it is here (POST /v1/cluster/peers): a join, an update or just a heartbeat."""
        if advert.node_id == self.me.node_id:
            return
        self._apply(Joined(advert) if self.peer(advert.node_id) is None else Updated(advert))
        self.table.seen(advert.node_id)

    async def update_me(self, advert: PeerAdvert) -> None:
        """New figures for this node (a re-profile): re-announce them and re-plan."""
        self.me = advert
        await self.discovery.update(advert)
        self.revision += 1
        self.publish(events.ClusterEvent("profile", f"{advert.node_id} measured again: {advert.speed / 1e9:.2f} GB/s, "
                                                 f"{advert.mem_free / 1e9:.1f} GB free", advert.node_id,
                                         detail={"speed": advert.speed, "mem_free": advert.mem_free}))
        self._poke()

    async def _introduce_loop(self) -> None:
        """Every second, tell each --peer we are here; what it answers is its advert."""
        timeout = aiohttp.ClientTimeout(total=HEARTBEAT_S * 2)
        failing: dict[tuple[str, int], str] = {}
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                for address in self.static_peers:
                    try:
                        self.introduced(await peering.introduce(session, address, self.key, self.me))
                        if failing.pop(address, None):
                            log.info("peer %s:%d answers again", *address)
                    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, DiscoveryError) as exc:
                        why = str(exc) or type(exc).__name__
                        if failing.get(address) != why:
                            log.warning("peer %s:%d: %s", *address, why)
                        failing[address] = why
                await asyncio.sleep(HEARTBEAT_S)

    async def _heartbeats(self) -> None:
        timeout = aiohttp.ClientTimeout(total=HEARTBEAT_S)
        alive: set[str] = set()
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                peers = [p for p in self.table.peers() if p.foreign is None]
                answers = await asyncio.gather(*(self._ping(session, p) for p in peers))
                for peer, ok in zip(peers, answers):
                    if ok:
                        self.table.seen(peer.node_id)
                now = {p.node_id for p in self.usable()}
                for gone in alive - now:
                    self.publish(events.ClusterEvent("leave", f"{gone} stopped answering", gone))
                if now != alive:
                    alive = now
                    self.revision += 1
                    self._poke()
                await asyncio.sleep(HEARTBEAT_S)

    async def _ping(self, session: aiohttp.ClientSession, peer: Peer) -> bool:
        try:
            async with session.get(f"{http_url(peer.advert)}{peering.NODE_PATH}") as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def _elect(self) -> None:
        async for change in self.elector.changes():
            self.publish(events.ClusterEvent("election", f"leader {change.leader} (epoch {change.epoch})",
                                             change.leader, change.epoch))
            self._poke()

    def _poke(self) -> None:
        self.elector.poke()
        self.changed.set()


def _addr(advert: PeerAdvert) -> str:
    return advert.addresses[0] if advert.addresses else "?"


def http_url(advert: PeerAdvert) -> str:
    return f"http://{_addr(advert)}:{advert.http_port}"


def data_address(advert: PeerAdvert) -> str:
    return f"{_addr(advert)}:{advert.data_port}"
