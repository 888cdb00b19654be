"""Who is in the cluster and who leads it: discovery, heartbeats and the election, together.

- mDNS adverts (cluster/discovery.py) add peers to a PeerTable. Our own
  advert is signed with the cluster key and carries our term (epoch, leader),
  a boot id and a sequence number; adverts of another cluster id, protocol or
  key, or without a valid signature, are listed as foreign and never used.
  Where multicast cannot pass, `peers` (HOST:HTTP-PORT) are told we are here
  every `heartbeat` seconds (cluster/peering.py), and they record us in turn.
- Every `heartbeat` seconds each listed peer is challenged (a fresh nonce to
  `/v1/cluster/node`); only an answer proving the key over that nonce counts
  (any HTTP 200 does not). Each advertised address is tried, the last one that
  answered first. A peer that has not proven itself for `timeout` seconds is
  no longer usable: this catches a node that died without an mDNS goodbye.
  A goodbye is unsigned, so one for a live member only prompts a question at
  once: the member is gone if it says it is leaving (a node that leaves
  answers 503 to heartbeats first, `leaving`) or its port refuses; kept if it
  answers otherwise. An unclear answer (the connection reset or timed out: a
  node shutting its HTTP server down between its goodbye and its exit, or
  its loop held by a compile) is
  asked again, a few times; still unclear, its heartbeats decide, as for any
  member. A plan that cannot reach a member's data port asks it the same
  question (`recheck`): a node killed outright sends no goodbye.
- Joins and changed figures reach the plan once the usable set has been quiet
  for `settle` seconds (debounced: a burst of changes is one re-plan); a loss
  counts at once, the loss timeout being its debounce.
- The election (cluster/election.py) runs over our own ballot and the members',
  with the terms they sign: a new root takes max(seen) + 1, so epochs mean the
  same on every node, and a rebooted preferred root leads again at once.
- `revision` counts changes to the plan's inputs (members, their speed or
  memory), so the root knows when to plan again.

Changes are published as ClusterEvents (join, leave, election, profile).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from dataclasses import replace
from typing import Callable, Sequence

import aiohttp

from edgetp.cluster import peering
from edgetp.cluster.discovery import Discovery, DiscoveryError, Joined, Left, Peer, PeerAdvert, PeerTable, \
    Updated, ballot_of, sign
from edgetp.cluster.election import Elector, Term
from edgetp.net import httpauth
from edgetp import events

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0   # default seconds between heartbeats (and --peer hellos)
TIMEOUT_S = 3.0     # default seconds without a proof before a peer is lost
SETTLE_S = 1.0      # default seconds the member set must be quiet before a join re-plans
MAX_ADDRESSES = 8   # addresses of one advert tried per heartbeat
GOODBYE_ASKS = 10   # times a goodbye's peer is asked while its answers are unclear
GOODBYE_GAP_S = 0.5  # seconds between those asks


class Membership:
    def __init__(self, me: PeerAdvert, *, key: bytes | None, interfaces: list[str] | None = None,
                 heartbeat: float = HEARTBEAT_S, timeout: float = TIMEOUT_S, settle: float = SETTLE_S,
                 publish: Callable[[events.ClusterEvent], None] = lambda e: None,
                 peers: Sequence[tuple[str, int]] = ()) -> None:
        if key is None:
            raise ValueError("cluster membership needs the cluster key: adverts and heartbeats are signed with it")
        if not (0 < heartbeat < timeout):
            raise ValueError(f"the heartbeat interval ({heartbeat} s) must be above 0 and below the loss "
                             f"timeout ({timeout} s)")
        if settle < 0:
            raise ValueError(f"the settle time must be >= 0, got {settle}")
        self.key = key
        self.heartbeat, self.timeout, self.settle = heartbeat, timeout, settle
        self.boot = secrets.token_hex(8)  # this process's advert lineage; peers refuse its replays
        self._seq = 0
        self.elector = Elector(me.node_id, self._ballots, self._claims, interval=min(0.5, heartbeat))
        self.me = self._signed(me)
        self.clock = RunningClock(most=heartbeat)
        self.table = PeerTable(key, timeout=timeout, forget=max(60.0, 10 * timeout), clock=self.clock)
        self.discovery = Discovery(self.me, interfaces=interfaces, addresses=interfaces)
        self.publish = publish
        self.static_peers = tuple(peers)
        self.changed = asyncio.Event()  # set on every leader or membership change
        self.revision = 0  # bumped when a member joins, leaves or changes its figures
        self._members: frozenset[str] = frozenset()  # the settled set: what plans and elections use
        self._figures: dict[str, tuple] = {}         # their plan inputs when settled
        self._stirred = asyncio.Event()              # the raw usable set changed
        self.leaving = False                         # set before our goodbye: heartbeats get a 503 "leaving"
        self._goodbyes: set[str] = set()             # live peers being asked whether they left
        self._tasks: asyncio.TaskGroup | None = None  # run()'s, for those questions

    @property
    def leader(self) -> str | None:
        return self.elector.term.leader

    @property
    def epoch(self) -> int:
        return self.elector.term.epoch

    def usable(self) -> list[Peer]:
        """Settled members that still prove themselves; one without the leader's model fetches its slice."""
        return [p for p in self.table.usable() if p.node_id in self._members]

    def peer(self, node_id: str) -> Peer | None:
        return self.table.get(node_id)

    def _ballots(self):
        self.clock()  # read every tick, peers or none: a gap is then only a time this node did not run
        return [ballot_of(self.me)] + [ballot_of(p.advert) for p in self.usable()]

    def _claims(self) -> dict[str, Term]:
        """The terms the live members sign into their adverts."""
        return {p.node_id: Term(p.advert.leader or None, p.advert.epoch) for p in self.usable()}

    def _signed(self, advert: PeerAdvert) -> PeerAdvert:
        self._seq += 1
        term = self.elector.term
        return sign(self.key, replace(advert, epoch=term.epoch, leader=term.leader or "", boot=self.boot,
                                      seq=self._seq, sig="", addresses=()))

    async def run(self) -> None:
        """Until cancelled; the mDNS record is withdrawn on the way out (a clean leave)."""
        await self.discovery.start()
        self.clock.restart()  # from here on it is read every tick: starting up was not a freeze
        try:
            async with asyncio.TaskGroup() as tg:
                self._tasks = tg
                tg.create_task(self._discover())
                tg.create_task(self._heartbeats())
                tg.create_task(self._settle())
                tg.create_task(self._elect())
                if self.static_peers:
                    tg.create_task(self._introduce_loop())
        finally:
            self._tasks = None
            self.leaving = True  # peers that hear our goodbye ask us: they find us leaving
            await self.discovery.stop()

    async def _discover(self) -> None:
        async for ev in self.discovery.events():
            self._apply(ev)

    def _apply(self, ev: Joined | Updated | Left) -> None:
        node_id = ev.node_id if isinstance(ev, Left) else ev.advert.node_id
        peer = self.peer(node_id)
        if isinstance(ev, Left) and peer is not None and self.table.alive(peer):
            self._question(peer, "goodbye")  # unsigned: anyone can send one
            return
        known = self.peer(node_id) is not None
        if not self.table.apply(ev):
            return
        if isinstance(ev, Left):
            self.publish(events.ClusterEvent("leave", f"{ev.node_id} left", ev.node_id))
        elif not known:
            peer = self.peer(node_id)
            why = f" (ignored: {peer.foreign})" if peer and peer.foreign else ""
            self.publish(events.ClusterEvent("join", f"{node_id} joined{why}", node_id,
                                             detail={"address": _addr(ev.advert), "speed": ev.advert.speed,
                                                     "mem_free": ev.advert.mem_free}))
        self._stir()

    def recheck(self, node_id: str, why: str) -> None:
        """A plan could not reach a live member (`why`): ask it now, as its goodbye would, rather than plan
        around it until the loss timeout. A member that left and whose goodbye was lost (multicast drops
        packets; a node may exit before its last one is sent) is then gone at the next plan; one that
        answers stays, and the plan's backoff decides when its data port is tried again. Call it on the
        membership's event loop; it returns at once (the question runs in run()'s task group)."""
        peer = self.peer(node_id)
        if peer is not None and self.table.alive(peer):
            self._question(peer, why)

    def _question(self, peer: Peer, prompt: str) -> None:
        """Ask `peer` whether it left (_goodbye), once at a time; `prompt` is "goodbye" for an mDNS goodbye,
        else why it is asked."""
        if peer.node_id not in self._goodbyes and self._tasks is not None:
            self._goodbyes.add(peer.node_id)
            self._tasks.create_task(self._goodbye(peer, prompt), name=f"goodbye-{peer.node_id}")

    async def _goodbye(self, peer: Peer, prompt: str = "goodbye") -> None:
        """Whether a live peer left, asked at once when an mDNS goodbye names it (it carries no signature)
        or a plan could not reach it: gone if it says it is leaving or its port refuses, kept if it answers
        otherwise (a goodbye forged or stale; a data port that failed for another reason). An unclear
        answer is asked again, GOODBYE_ASKS times in all: a node that really leaves sends its goodbye
        while its HTTP server still runs, then shuts it, and a question arriving in that moment gets its
        connection reset, or no answer in time while a compile holds its loop. (Taken as "kept", the
        node stayed planned over until the loss timeout, when every other goodbye packet had already
        been heard.)"""
        try:
            gone = None
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.heartbeat)) as session:
                for ask in range(GOODBYE_ASKS):
                    if ask:
                        await asyncio.sleep(GOODBYE_GAP_S)
                    if (gone := await self._says_gone(session, peer)) is not None:
                        break
            if gone and self.table.apply(Left(peer.node_id)):
                if prompt != "goodbye":
                    log.warning("%s left: asked because %s, it says it is leaving or its port refuses",
                                peer.node_id, prompt)
                self.publish(events.ClusterEvent("leave", f"{peer.node_id} left", peer.node_id))
                self._stir()
            elif not gone:
                verdict = "forged or stale" if gone is False else "no clear answer; its heartbeats decide"
                if prompt == "goodbye":
                    log.warning("an mDNS goodbye for %s, which does not say it is leaving: ignored (%s)",
                                peer.node_id, verdict)
                else:
                    log.info("%s kept: asked because %s, %s", peer.node_id, prompt,
                             "it answers" if gone is False else verdict)
        except Exception:  # noqa: BLE001 - a question must not end the membership's task group
            log.exception("asking %s whether it left failed", peer.node_id)
        finally:
            self._goodbyes.discard(peer.node_id)

    async def _says_gone(self, session: aiohttp.ClientSession, peer: Peer) -> bool | None:
        """True if the peer confirms it left: its heartbeat endpoint answers 503 (`leaving`), or the port
        at the address that last answered refuses connections. False if it answers otherwise (or has
        no address to ask), None if the answer is unclear (reset, timed out, unreachable)."""
        if not peer.advert.addresses:
            return False
        url = f"{_url_host(peer.advert.addresses[0])}:{peer.advert.http_port}{peering.NODE_PATH}" \
              f"?nonce={secrets.token_hex(16)}"
        try:
            async with session.get(url) as resp:
                return resp.status == 503 and peering.LEAVING in await resp.text()
        except aiohttp.ClientConnectorError as exc:
            return True if isinstance(exc.os_error, ConnectionRefusedError) else None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return None

    def introduced(self, advert: PeerAdvert) -> None:
        """A peer told us it is here (POST /v1/cluster/peers); the heartbeats prove it, as any other."""
        if advert.node_id == self.me.node_id:
            return
        self._apply(Joined(advert) if self.peer(advert.node_id) is None else Updated(advert))

    async def update_me(self, advert: PeerAdvert) -> None:
        """New figures for this node (a re-profile): re-announce them and re-plan."""
        await self._announce(advert)
        self.revision += 1
        self.publish(events.ClusterEvent("profile", f"{advert.node_id} measured again: {advert.speed / 1e9:.2f} GB/s, "
                                                 f"{advert.mem_free / 1e9:.1f} GB free", advert.node_id,
                                         detail={"speed": advert.speed, "mem_free": advert.mem_free}))
        self._poke()

    async def _announce(self, advert: PeerAdvert) -> None:
        """Sign `advert` with our current term and the next sequence number, and announce it."""
        self.me = self._signed(advert)
        await self.discovery.update(self.me)

    async def _introduce_loop(self) -> None:
        """Every heartbeat, tell each --peer we are here; what it answers is its advert."""
        timeout = aiohttp.ClientTimeout(total=self.heartbeat * 2)
        failing: dict[tuple[str, int], str] = {}
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                for address in self.static_peers:
                    try:
                        self.introduced(await peering.introduce(session, address, self.key, self.me))
                        if failing.pop(address, None):
                            log.info("peer %s:%d answers again", *address)
                    except Exception as exc:  # noqa: BLE001 - whatever a peer answers, this node carries on
                        why = str(exc) or type(exc).__name__
                        if failing.get(address) != why:
                            log.warning("peer %s:%d: %s", *address, why)
                        failing[address] = why
                await asyncio.sleep(self.heartbeat)

    async def _heartbeats(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.heartbeat)
        alive: set[str] = set()
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                peers = [p for p in self.table.peers() if p.foreign is None]
                answers = await asyncio.gather(*(self._ping(session, p) for p in peers))
                for advert in answers:
                    if advert is not None:
                        self.table.prove(advert)
                self.table.expire()
                now = {p.node_id for p in self.table.usable()}
                for gone in alive - now:
                    self.publish(events.ClusterEvent("leave", f"{gone} stopped answering", gone))
                if now != alive:
                    alive = now
                    self._stir()
                elif self._figures != {p.node_id: _figures(p.advert) for p in self.usable()}:
                    self._stir()  # a member announced new figures
                await asyncio.sleep(self.heartbeat)

    async def _ping(self, session: aiohttp.ClientSession, peer: Peer) -> PeerAdvert | None:
        """The peer's current advert if it proves the key over a fresh nonce at one of its addresses."""
        addresses = peer.advert.addresses[:MAX_ADDRESSES]
        for n, address in enumerate(addresses):
            nonce = secrets.token_hex(16)
            url = f"{_url_host(address)}:{peer.advert.http_port}{peering.NODE_PATH}?nonce={nonce}"
            try:
                async with session.get(url) as resp:
                    body = await httpauth.read_json(resp) if resp.status == 200 else None
                order = (address, *addresses[:n], *addresses[n + 1:], *peer.advert.addresses[MAX_ADDRESSES:])
                advert = peering.check_heartbeat(self.key, nonce, body, order)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, DiscoveryError) as exc:
                log.debug("heartbeat to %s at %s failed: %s", peer.node_id, address, exc)
                continue
            except Exception as exc:  # noqa: BLE001 - whatever a peer answers, this node carries on
                log.warning("heartbeat to %s at %s: unexpected %s: %s", peer.node_id, address,
                            type(exc).__name__, exc)
                continue
            if advert.node_id != peer.node_id:
                log.warning("%s answered a heartbeat for %s as %s", address, peer.node_id, advert.node_id)
                continue
            return advert
        return None

    async def _settle(self) -> None:
        """Adopt the usable set once it has been quiet for `settle` s (at most 5x that after the first change);
        a loss is adopted at once."""
        loop = asyncio.get_running_loop()
        while True:
            await self._stirred.wait()
            first = loop.time()
            while self.settle > 0 and self._members <= {p.node_id for p in self.table.usable()}:
                self._stirred.clear()
                remaining = first + 5 * self.settle - loop.time()
                if remaining <= 0:
                    break
                try:
                    async with asyncio.timeout(min(self.settle, remaining)):  # not wait_for: see election.py
                        await self._stirred.wait()
                except TimeoutError:
                    break
            self._stirred.clear()
            live = self.table.usable()
            figures = {p.node_id: _figures(p.advert) for p in live}
            if figures != self._figures:
                self._members, self._figures = frozenset(figures), figures
                self.revision += 1
                self._poke()

    async def _elect(self) -> None:
        async for change in self.elector.changes():
            self.publish(events.ClusterEvent("election", f"leader {change.leader} (epoch {change.epoch})",
                                             change.leader, change.epoch))
            await self._announce(self.me)  # peers learn our new term from the signed advert
            self._poke()

    def _stir(self) -> None:
        self._stirred.set()

    def _poke(self) -> None:
        self.elector.poke()
        self.changed.set()


class RunningClock:
    """Seconds this node was running: time.monotonic(), less every gap between two readings beyond `most`.

    Peers are lost after `timeout` s of this clock without a proof. A node that was not running
    (SIGSTOP, a VM paused, an event loop held for seconds) heard no heartbeat answers in that time
    through no fault of its peers: read on the usual clock it would find every peer lost at once when
    it ran again, elect itself with a new epoch, and take the real root's workers (a split brain seen
    by a probe on a 3-node cluster: 5 of 6 resumes after an 8 s SIGSTOP). On this clock its peers have
    what was left of their timeout, and the next heartbeat proves them or not. The membership reads
    it at least every `most` s while it runs (the election's tick is half a heartbeat or less)."""

    def __init__(self, most: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.most, self._clock = most, clock
        self._lock = threading.Lock()
        self._last = clock()
        self.paused = 0.0  # seconds not counted

    def restart(self) -> None:
        """The time since the last reading counts in full (the membership starting, not a freeze)."""
        with self._lock:
            self._last = max(self._last, self._clock())

    def __call__(self) -> float:
        with self._lock:
            now = self._clock()
            gap = now - self._last
            if gap > self.most:
                self.paused += gap - self.most
                log.log(logging.WARNING if gap > 2 * self.most else logging.DEBUG, "this node did not run for "
                        "%.1f s: its peers' heartbeats are not counted as missed for that time", gap)
            self._last = max(self._last, now)
            return now - self.paused


def _figures(advert: PeerAdvert) -> tuple:
    """What a plan depends on in an advert (not its term, sequence or signature)."""
    return (advert.data_port, advert.http_port, advert.speed, advert.mem_free, advert.model, advert.priority,
            advert.no_root, advert.addresses[:1])


def _addr(advert: PeerAdvert) -> str:
    return advert.addresses[0] if advert.addresses else "?"


def _url_host(address: str) -> str:
    return f"http://[{address}]" if ":" in address else f"http://{address}"


def http_url(advert: PeerAdvert) -> str:
    """The peer's API at the address that last answered its heartbeat (IPv6 bracketed)."""
    return f"{_url_host(_addr(advert))}:{advert.http_port}"


def http_urls(advert: PeerAdvert) -> set[str]:
    """The peer's API at every address it advertises (the one `http_url` names may move among them)."""
    return {f"{_url_host(a)}:{advert.http_port}" for a in advert.addresses}


def data_address(advert: PeerAdvert) -> str:
    """HOST:PORT of its data port (IPv6 unbracketed: the runner splits at the last colon)."""
    return f"{_addr(advert)}:{advert.data_port}"
