"""Who is in the cluster and who leads it: discovery, heartbeats and the election, together.

- mDNS adverts (cluster/discovery.py) add peers to a PeerTable; peers of
  another cluster id (another key) or protocol are listed as foreign and
  never used, and so are peers serving another model file.
- Every second each peer's HTTP API is asked for `/v1/models`; a peer that
  has not answered for `timeout` seconds is no longer usable. This catches
  a node that died without an mDNS goodbye.
- The election (cluster/election.py) runs over our own ballot and the usable
  peers'; a new leader starts a new epoch.

Changes are published as ClusterEvents (join, leave, election).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import aiohttp

from edgetp.cluster.discovery import Discovery, Joined, Left, Peer, PeerAdvert, PeerTable, ballot_of
from edgetp.cluster.election import Elector
from edgetp.serve import events

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0


class Membership:
    def __init__(self, me: PeerAdvert, *, interfaces: list[str] | None = None, timeout: float = 3.0,
                 publish: Callable[[events.ClusterEvent], None] = lambda e: None) -> None:
        self.me = me
        self.table = PeerTable(me.cluster_id, timeout=timeout)
        self.discovery = Discovery(me, interfaces=interfaces, addresses=interfaces)
        self.elector = Elector(self._ballots, interval=0.5)
        self.publish = publish
        self.changed = asyncio.Event()  # set on every leader or membership change

    @property
    def leader(self) -> str | None:
        return self.elector.state.leader

    @property
    def epoch(self) -> int:
        return self.elector.state.epoch

    def usable(self) -> list[Peer]:
        """Live peers of our cluster serving the same model file."""
        return [p for p in self.table.usable() if p.advert.model == self.me.model]

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
        finally:
            await self.discovery.stop()

    async def _discover(self) -> None:
        async for ev in self.discovery.events():
            self.table.apply(ev)
            if isinstance(ev, Joined):
                peer = self.peer(ev.advert.node_id)
                why = f" (ignored: {peer.foreign})" if peer and peer.foreign else ""
                self.publish(events.ClusterEvent("join", f"{ev.advert.node_id} joined{why}", ev.advert.node_id,
                                                 detail={"address": _addr(ev.advert), "speed": ev.advert.speed,
                                                         "mem_free": ev.advert.mem_free}))
            elif isinstance(ev, Left):
                self.publish(events.ClusterEvent("leave", f"{ev.node_id} left", ev.node_id))
            self._poke()

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
                    self._poke()
                await asyncio.sleep(HEARTBEAT_S)

    async def _ping(self, session: aiohttp.ClientSession, peer: Peer) -> bool:
        try:
            async with session.get(f"{http_url(peer.advert)}/v1/models") as resp:
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
