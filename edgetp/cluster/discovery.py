"""Finding the other nodes: signed zeroconf adverts of `_edgetp._tcp.local.` and a peer table.

Each node registers one service instance named after its node id, with TXT records:

    id   node id                  pv   protocol version (edgetp.net.PROTOCOL_VERSION)
    cid  cluster id (auth.cluster_id(key): a public digest, never the key)
    dp   data port (TCP links)    hp   HTTP port
    spd  measured speed, weight bytes/s       mem  free memory, bytes
    mdl  model fingerprint ("" when no model)  pri  election priority    nr  no-root, 0 or 1
    ep   the epoch this node is in            ldr  the leader it follows in it ("" for none)
    bt   boot id: random per process start    sq   sequence number, +1 at every re-announcement
    sig  HMAC-SHA256 over every other field (`advert_mac`), keyed from the cluster key

Only a key holder can sign, so an advert whose `sig` does not check is listed as
foreign: never usable, never elected, never followed, never forwarded to. The
freshness rule needs no clock (Pis have no RTC): for one boot id a lower `sq`
than the one held is a replay and is ignored; a boot id that a newer one has
replaced is never taken back from mDNS. A node proves it is alive, and which
advert is current, by answering heartbeats (challenge-response, cluster/peering.py);
until it has, its advert is listed but not usable.

`parse_txt` checks every field and raises `DiscoveryError`; `Discovery` logs and skips
such adverts, so a bad record on the network never crashes the daemon. `Discovery`
turns the browser's changes into `Joined`, `Updated` and `Left` events (an async
iterator). `PeerTable` is the pure bookkeeping, with times from an injected clock.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import math
import re
import secrets
import select
import socket
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from zeroconf import (DNSIncoming, DNSOutgoing, DNSQuestion, DNSQuestionType, DNSService, DNSText, InterfaceChoice,
                      NonUniqueNameException, ServiceStateChange)
from zeroconf import get_all_addresses
from zeroconf.const import _CLASS_IN, _FLAGS_QR_QUERY, _MDNS_ADDR, _MDNS_PORT, _TYPE_SRV, _TYPE_TXT
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from edgetp.cluster.election import Ballot
from edgetp.events import NODE_ID_RE
from edgetp.net.auth import cluster_id as cluster_id_of
from edgetp.net import PROTOCOL_VERSION

log = logging.getLogger(__name__)

SERVICE_TYPE = "_edgetp._tcp.local."
CLUSTER_ID_RE = re.compile(r"[0-9a-f]{8,64}")
MODEL_RE = re.compile(r"[A-Za-z0-9:._-]{0,80}")
BOOT_RE = re.compile(r"[0-9a-f]{16}")
SIG_RE = re.compile(r"[0-9a-f]{64}")
KNOWN = frozenset({"id", "pv", "cid", "dp", "hp", "spd", "mem", "mdl", "pri", "nr", "ep", "ldr", "bt", "sq", "sig"})
RESOLVE_MS = 3000
# A client's browse ends this long after the last new node it heard: every node answers a query
# within 20-120 ms (RFC 6762 6), a Wi-Fi station's multicast can wait for a beacon or three
# (~100-300 ms). Any node serves (it forwards to the root): one heard late costs at most a hop.
BROWSE_QUIET_S = 0.5
# How long `start` asks, by multicast, whether another node already holds our name. It runs beside
# zeroconf's own probe, which takes ~1.2 s on loopback (FACTS.md), so a start costs nothing more.
TWIN_MS = 1000
RETIRED_BOOTS = 8  # boot ids remembered per node as replaced (their adverts are replays)


class DiscoveryError(Exception):
    """An advert is malformed or registration failed; the message says which field or why."""


@dataclass(frozen=True)
class PeerAdvert:
    node_id: str
    cluster_id: str
    data_port: int
    http_port: int
    speed: float              # weight bytes/s through the matvec kernel
    mem_free: int             # bytes
    model: str = ""           # model fingerprint (digest)
    priority: int = 0
    no_root: bool = False
    protocol: int = PROTOCOL_VERSION
    epoch: int = 0                    # the epoch this node is in ...
    leader: str = ""                  # ... under this leader ("" for none yet)
    boot: str = ""                    # random per process start ("" until signed)
    seq: int = 0                      # +1 at every re-announcement within one boot
    sig: str = ""                     # advert_mac over every other TXT field ("" unsigned)
    extra: tuple[tuple[str, str], ...] = ()  # TXT fields of a later version: signed, otherwise ignored
    addresses: tuple[str, ...] = ()   # from the A/AAAA records, not the TXT

    def to_txt(self) -> dict[str, str]:
        txt = {"id": self.node_id, "pv": str(self.protocol), "cid": self.cluster_id,
               "dp": str(self.data_port), "hp": str(self.http_port), "spd": repr(float(self.speed)),
               "mem": str(self.mem_free), "mdl": self.model, "pri": str(self.priority),
               "nr": "1" if self.no_root else "0", "ep": str(self.epoch), "ldr": self.leader,
               "bt": self.boot, "sq": str(self.seq)} | dict(self.extra)
        if self.sig:
            txt["sig"] = self.sig
        return txt


# --------------------------------------------------------------------------- signatures


def _advert_key(key: bytes) -> bytes:
    """The cluster key is used for adverts only through this derived key (domain separation)."""
    return hmac.new(key, b"edgetp-advert-v1", hashlib.sha256).digest()


def advert_mac(key: bytes, txt: Mapping[str, str]) -> str:
    """HMAC-SHA256 (hex) over every TXT field but `sig`: canonical JSON, keys sorted, no spaces."""
    fields = {k: v for k, v in txt.items() if k != "sig"}
    message = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    return hmac.new(_advert_key(key), message, hashlib.sha256).hexdigest()


def sign(key: bytes, advert: PeerAdvert) -> PeerAdvert:
    """`advert` with its `sig` over all its fields; it must carry a boot id and sequence number."""
    if not BOOT_RE.fullmatch(advert.boot) or advert.seq < 1:
        raise ValueError("a signed advert needs a boot id (16 hex digits) and a sequence number >= 1")
    return replace(advert, sig=advert_mac(key, replace(advert, sig="").to_txt()))


def signature_error(key: bytes, advert: PeerAdvert) -> str | None:
    """Why `advert` is not signed with `key`, or None if it is."""
    if not advert.sig:
        return "advert not signed"
    if not hmac.compare_digest(advert.sig, advert_mac(key, advert.to_txt())):
        return "advert not signed with this cluster's key"
    if not advert.boot or advert.seq < 1:
        return "signed advert without a boot id and sequence number"
    return None


def ballot_of(advert: PeerAdvert) -> Ballot:
    """A node leads only when it may (no --no-root) and holds a model to plan from."""
    return Ballot(advert.priority, advert.speed, advert.node_id, can_lead=not advert.no_root and bool(advert.model))


# --------------------------------------------------------------------------- TXT parsing


def _text(props: Mapping[str, bytes | str | None], key: str) -> str:
    raw = props.get(key)
    if raw is None:
        raise DiscoveryError(f"TXT record {key!r} is missing")
    try:
        return raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
    except UnicodeDecodeError:
        raise DiscoveryError(f"TXT record {key!r} is not UTF-8") from None


def _optional(props: Mapping[str, bytes | str | None], key: str) -> str:
    """A field that may be absent (an unsigned advert, a later version's field): "" then."""
    return "" if props.get(key) is None else _text(props, key)


def _integer(props, key: str, lo: int, hi: int) -> int:
    text = _text(props, key)
    if not re.fullmatch(r"-?[0-9]{1,19}", text) or not lo <= int(text) <= hi:
        raise DiscoveryError(f"TXT record {key!r} must be an integer in {lo}..{hi}, got {text!r}")
    return int(text)


def parse_txt(properties: Mapping[bytes | str, bytes | str | None], addresses: Sequence[str] = ()) -> PeerAdvert:
    """A validated advert from TXT properties (zeroconf gives bytes keys and values)."""
    props = {(k.decode("utf-8", "replace") if isinstance(k, bytes) else k): v for k, v in properties.items()}
    node_id = _text(props, "id")
    if not NODE_ID_RE.fullmatch(node_id):
        raise DiscoveryError(f"TXT record 'id' is not a node id: {node_id!r}")
    cluster_id = _text(props, "cid")
    if not CLUSTER_ID_RE.fullmatch(cluster_id):
        raise DiscoveryError(f"TXT record 'cid' must be 8-64 lowercase hex digits, got {cluster_id!r}")
    speed_text = _text(props, "spd")
    try:
        speed = float(speed_text)
    except ValueError:
        raise DiscoveryError(f"TXT record 'spd' is not a number: {speed_text!r}") from None
    if not (math.isfinite(speed) and speed >= 0):
        raise DiscoveryError(f"TXT record 'spd' must be finite and >= 0, got {speed_text!r}")
    model = _text(props, "mdl")
    if not MODEL_RE.fullmatch(model):
        raise DiscoveryError(f"TXT record 'mdl' is not a model fingerprint: {model!r}")
    no_root = _text(props, "nr")
    if no_root not in ("0", "1"):
        raise DiscoveryError(f"TXT record 'nr' must be 0 or 1, got {no_root!r}")
    leader = _optional(props, "ldr")
    if leader and not NODE_ID_RE.fullmatch(leader):
        raise DiscoveryError(f"TXT record 'ldr' is not a node id: {leader!r}")
    boot, sig = _optional(props, "bt"), _optional(props, "sig")
    if boot and not BOOT_RE.fullmatch(boot):
        raise DiscoveryError(f"TXT record 'bt' must be 16 lowercase hex digits, got {boot!r}")
    if sig and not SIG_RE.fullmatch(sig):
        raise DiscoveryError(f"TXT record 'sig' must be 64 lowercase hex digits, got {sig[:80]!r}")
    extra = tuple(sorted((k, _optional(props, k)) for k in props if k not in KNOWN))
    return PeerAdvert(
        node_id=node_id, cluster_id=cluster_id,
        data_port=_integer(props, "dp", 1, 65535), http_port=_integer(props, "hp", 1, 65535),
        speed=speed, mem_free=_integer(props, "mem", 0, 2**63 - 1), model=model,
        priority=_integer(props, "pri", -(2**31), 2**31 - 1), no_root=no_root == "1",
        protocol=_integer(props, "pv", 0, 2**31 - 1),
        epoch=_integer(props, "ep", 0, 2**63 - 1) if "ep" in props else 0, leader=leader,
        boot=boot, seq=_integer(props, "sq", 0, 2**63 - 1) if "sq" in props else 0, sig=sig,
        extra=extra, addresses=tuple(addresses),
    )


# --------------------------------------------------------------------------- events


@dataclass(frozen=True)
class Joined:
    advert: PeerAdvert


@dataclass(frozen=True)
class Updated:
    advert: PeerAdvert


@dataclass(frozen=True)
class Left:
    node_id: str


Event = Joined | Updated | Left


# --------------------------------------------------------------------------- zeroconf


class Discovery:
    """Registers our advert and browses for others; `events()` yields Joined/Updated/Left.

    `interfaces`: IP addresses to use (None: every interface). `addresses`: the
    addresses to advertise (default: `interfaces`, else every non-loopback IPv4).
    `ttl`: seconds the records live in caches when a node vanishes without a goodbye.
    """

    def __init__(self, advert: PeerAdvert, *, interfaces: Sequence[str] | None = None,
                 addresses: Sequence[str] | None = None, ttl: int = 60) -> None:
        self.advert = advert
        self.interfaces = list(interfaces) if interfaces else None
        self.addresses = list(addresses or self.interfaces or _default_addresses())
        self.ttl = ttl
        self._aiozc: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None
        self._info: AsyncServiceInfo | None = None
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._known: dict[str, str] = {}                   # service name -> node id
        self._resolving: dict[str, asyncio.Task[None]] = {}  # service name -> its lookup

    @property
    def service_name(self) -> str:
        return f"{self.advert.node_id}.{SERVICE_TYPE}"

    def _service_info(self, advert: PeerAdvert) -> AsyncServiceInfo:
        return AsyncServiceInfo(
            SERVICE_TYPE, f"{advert.node_id}.{SERVICE_TYPE}", port=advert.data_port,
            properties=advert.to_txt(), server=f"{advert.node_id}.local.",
            parsed_addresses=self.addresses, host_ttl=self.ttl, other_ttl=self.ttl)

    async def start(self) -> None:
        """Register our advert; DiscoveryError when another node already holds our node id.

        zeroconf's probe alone misses a holder on the same host as a second mDNS user: the
        holder answers a probe by unicast (RFC 6762 8.1) to port 5353, and Linux hands a
        unicast datagram to one socket of the SO_REUSEPORT group bound there, not always
        ours. So we also ask for our own name with a multicast question (`_twin`), whose
        answer every listener gets. A holder answers within milliseconds, while the probe
        still runs: the probe is then cancelled, and our record is never announced."""
        self._aiozc = AsyncZeroconf(interfaces=self.interfaces or InterfaceChoice.All)
        self._info = self._service_info(self.advert)
        loop = asyncio.get_running_loop()
        register, twin = loop.create_task(self._register()), loop.create_task(self._twin())
        try:
            done, _ = await asyncio.wait({register, twin}, return_when=asyncio.FIRST_COMPLETED)
            taken = twin in done and twin.result()
            if not taken:
                await register
                taken = await twin
        except NonUniqueNameException:
            taken = True
        finally:
            register.cancel()
            twin.cancel()
        if taken:
            await self._aiozc.async_close()
            self._aiozc = None
            raise DiscoveryError(f"node id {self.advert.node_id!r} is already on the network")
        self._browser = AsyncServiceBrowser(self._aiozc.zeroconf, SERVICE_TYPE, handlers=[self._on_change],
                                            question_type=DNSQuestionType.QM)

    async def _register(self) -> None:
        assert self._aiozc is not None
        await (await self._aiozc.async_register_service(self._info))

    async def _twin(self) -> bool:
        """Whether a node other than this one answers for our service name within TWIN_MS.

        Asked two ways at once, before our own probe ends, so only another node can answer at
        first: a multicast (QM) question, and a legacy unicast one (`_legacy_answers`), which the
        holder answers straight to our own port, at once and every time (with the QM question
        alone a second daemon was let in 2 runs in 8 here; likely, not proven: a responder may hold
        back a multicast answer for a record it multicast within the last second, RFC 6762 6). An answer
        that is our own record (its port, addresses and boot id are ours) does not count."""
        legacy = asyncio.ensure_future(asyncio.to_thread(_legacy_answers, self.service_name,
                                                         [a for a in self.addresses if ":" not in a], TWIN_MS / 1000))
        multicast = asyncio.ensure_future(self._twin_multicast())
        try:
            for first in asyncio.as_completed([legacy, multicast]):
                got = await first
                if got is True or (isinstance(got, list) and any(self._not_ours(*a) for a in got)):
                    return True
            return False
        finally:
            multicast.cancel()

    def _not_ours(self, port: int, boot: str) -> bool:
        return port != self.advert.data_port or boot != self.advert.boot

    async def _twin_multicast(self) -> bool:
        assert self._aiozc is not None
        info = AsyncServiceInfo(SERVICE_TYPE, self.service_name)
        if not await info.async_request(self._aiozc.zeroconf, TWIN_MS, question_type=DNSQuestionType.QM):
            return False
        boot = (info.properties or {}).get(b"bt") or b""
        return (self._not_ours(info.port, boot.decode(errors="replace"))
                or sorted(info.parsed_addresses()) != sorted(self.addresses))

    async def update(self, advert: PeerAdvert) -> None:
        """Re-announce with new figures (speed, memory, model); the node id cannot change."""
        if advert.node_id != self.advert.node_id:
            raise ValueError(f"cannot rename node {self.advert.node_id!r} to {advert.node_id!r}")
        self.advert = advert
        if self._aiozc is not None:
            self._info = self._service_info(advert)
            await (await self._aiozc.async_update_service(self._info))

    async def stop(self) -> None:
        """A clean leave: goodbye packets go out, so peers see `Left` at once."""
        for task in list(self._resolving.values()):
            task.cancel()
        if self._resolving:
            await asyncio.gather(*self._resolving.values(), return_exceptions=True)
        if self._browser is not None:
            await self._browser.async_cancel()
            self._browser = None
        if self._aiozc is not None:
            if self._info is not None:
                await (await self._aiozc.async_unregister_service(self._info))
            await self._aiozc.async_close()
            self._aiozc = None

    async def __aenter__(self) -> Discovery:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def events(self) -> AsyncIterator[Event]:
        while True:
            yield await self._queue.get()

    def _on_change(self, zeroconf: object, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        if name == self.service_name:
            return
        old = self._resolving.pop(name, None)
        if old is not None:
            old.cancel()
        if state_change is ServiceStateChange.Removed:
            node_id = self._known.pop(name, None)
            if node_id is not None:
                self._queue.put_nowait(Left(node_id))
            return
        task = asyncio.get_running_loop().create_task(self._resolve(name))
        self._resolving[name] = task
        task.add_done_callback(lambda t, n=name: self._resolving.pop(n, None) if self._resolving.get(n) is t else None)

    async def _resolve(self, name: str) -> None:
        assert self._aiozc is not None
        info = AsyncServiceInfo(SERVICE_TYPE, name)
        if not await info.async_request(self._aiozc.zeroconf, RESOLVE_MS, question_type=DNSQuestionType.QM):
            log.warning("ignoring %s: no answer to our lookup within %d ms", name, RESOLVE_MS)
            return
        try:
            advert = parse_txt(info.properties, info.parsed_addresses())
        except DiscoveryError as exc:
            log.warning("ignoring %s: %s", name, exc)
            return
        if name != f"{advert.node_id}.{SERVICE_TYPE}":
            log.warning("ignoring %s: its TXT names node %r", name, advert.node_id)
            return
        event: Event = Updated(advert) if name in self._known else Joined(advert)
        self._known[name] = advert.node_id
        self._queue.put_nowait(event)


def _legacy_answers(name: str, addresses: Sequence[str], timeout: float) -> list[tuple[int, str]]:
    """(port, boot id) of every SRV answer for `name` to a legacy unicast mDNS query (RFC 6762 6.7:
    sent from a port of our own, not 5353, so responders answer straight to it) from each IPv4
    address in `addresses`, within `timeout` seconds; the first reply with an answer ends it."""
    socks = []
    try:
        for addr in addresses:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            socks.append(s)
            s.bind((addr, 0))
            s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(addr))
            s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1)
            out = DNSOutgoing(_FLAGS_QR_QUERY, multicast=False, id_=secrets.randbelow(65535) + 1)
            out.add_question(DNSQuestion(name, _TYPE_SRV, _CLASS_IN))
            out.add_question(DNSQuestion(name, _TYPE_TXT, _CLASS_IN))
            for packet in out.packets():
                s.sendto(packet, (_MDNS_ADDR, _MDNS_PORT))
        deadline = time.monotonic() + timeout
        while socks and (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select(socks, [], [], left)
            found = []
            for s in ready:
                data, src = s.recvfrom(9000)
                ports, boots = {}, {}
                for r in DNSIncoming(data, src).answers():
                    if r.name.lower() != name.lower():
                        continue
                    if isinstance(r, DNSService):
                        ports[r.name.lower()] = r.port
                    elif isinstance(r, DNSText):
                        boots[r.name.lower()] = _txt_field(r.text, b"bt")
                found += [(port, boots.get(key, "")) for key, port in ports.items()]
            if found:
                return found
    except OSError as exc:  # no such address here, no multicast route: the multicast question still asks
        log.debug("legacy unicast query for %s: %s", name, exc)
    finally:
        for s in socks:
            s.close()
    return []


def _txt_field(text: bytes, key: bytes) -> str:
    """One key's value in a TXT record's wire form (length-prefixed key=value strings), "" if absent."""
    at = 0
    while at < len(text):
        n = text[at]
        item = text[at + 1:at + 1 + n]
        at += 1 + n
        k, sep, v = item.partition(b"=")
        if sep and k == key:
            return v.decode(errors="replace")
    return ""


def _default_addresses() -> list[str]:
    addrs = [a for a in get_all_addresses() if not a.startswith("127.")]
    return addrs or ["127.0.0.1"]


# --------------------------------------------------------------------------- peer table


@dataclass(frozen=True)
class Peer:
    advert: PeerAdvert
    last_seen: float             # the last advert or proof from it
    foreign: str | None = None   # why this peer can never be used, or None
    proven: bool = False         # answered a heartbeat challenge for its current advert

    @property
    def node_id(self) -> str:
        return self.advert.node_id


class PeerTable:
    """Peers by node id, with times from `clock`; foreign peers are listed, never usable.

    A peer is usable when its advert is ours (protocol, cluster id, signature),
    it has proven itself by a heartbeat (`prove`) and did so within `timeout`.
    Peers with no news for `forget` seconds are dropped by `expire`.
    """

    def __init__(self, key: bytes, *, protocol: int = PROTOCOL_VERSION, timeout: float = 10.0,
                 forget: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.key = key
        self.cluster_id = cluster_id_of(key)
        self.protocol = protocol
        self.timeout = timeout
        self.forget = max(forget, timeout)
        self.clock = clock
        self._peers: dict[str, Peer] = {}
        self._retired: dict[str, list[str]] = {}  # node id -> boot ids replaced by a newer one

    def _foreign(self, advert: PeerAdvert) -> str | None:
        if advert.protocol != self.protocol:
            return f"protocol version {advert.protocol} (this node speaks {self.protocol})"
        if advert.cluster_id != self.cluster_id:
            return f"cluster {advert.cluster_id} (this node is in {self.cluster_id})"
        return signature_error(self.key, advert)

    def apply(self, event: Event) -> bool:
        """An mDNS change; False when it was refused (a replay, or a forgery of a signed peer) or changed nothing.

        `Left` makes a peer unusable at once but keeps it listed: a goodbye is
        unsigned, so a peer that still answers its heartbeats is back within one.
        """
        if isinstance(event, Left):
            peer = self._peers.get(event.node_id)
            if peer is None or not peer.proven:
                return False
            self._peers[event.node_id] = replace(peer, proven=False)
            return True
        advert = event.advert
        old = self._peers.get(advert.node_id)
        foreign = self._foreign(advert)
        if old is not None and old.foreign is None:
            if foreign is not None:
                log.warning("ignoring an advert for %s: %s (its signed advert stands)", advert.node_id, foreign)
                return False
            if not self._fresher(old.advert, advert):
                return False
        proven = old is not None and old.proven and old.advert.boot == advert.boot and foreign is None
        self._peers[advert.node_id] = Peer(_keep_order(advert, old), self.clock(), foreign, proven)
        return True

    def _fresher(self, old: PeerAdvert, new: PeerAdvert) -> bool:
        """Whether `new` replaces `old` (both signed): a later sequence of one boot, or a new boot."""
        if new.boot == old.boot:
            if new.seq < old.seq:
                log.warning("ignoring a replayed advert of %s (sequence %d < %d)", new.node_id, new.seq, old.seq)
            return new.seq > old.seq
        if new.boot in self._retired.get(new.node_id, ()):
            log.warning("ignoring a replayed advert of %s from a replaced boot %s", new.node_id, new.boot)
            return False
        self._retire(old)
        return True

    def _retire(self, advert: PeerAdvert) -> None:
        boots = self._retired.setdefault(advert.node_id, [])
        if advert.boot not in boots:
            boots.append(advert.boot)
            del boots[:-RETIRED_BOOTS]

    def prove(self, advert: PeerAdvert) -> bool:
        """A heartbeat answer: `advert` (with a fresh proof over our nonce) is this peer's current one.

        It is authoritative over anything mDNS brought, replayed boots included.
        False if it is not a signed advert of ours or the table does not know the peer.
        """
        old = self._peers.get(advert.node_id)
        if old is None or self._foreign(advert) is not None:
            return False
        if old.advert.boot == advert.boot and advert.seq < old.advert.seq:
            advert = old.advert  # the proof raced a newer announcement: keep the newer figures
        elif old.advert.boot != advert.boot and old.foreign is None:
            self._retire(old.advert)
        self._peers[advert.node_id] = Peer(advert, self.clock(), None, True)
        return True

    def get(self, node_id: str) -> Peer | None:
        return self._peers.get(node_id)

    def alive(self, peer: Peer) -> bool:
        return peer.proven and self.clock() - peer.last_seen <= self.timeout

    def peers(self) -> list[Peer]:
        """Every peer known, foreign and silent ones included, by node id."""
        return sorted(self._peers.values(), key=lambda p: p.node_id)

    def usable(self) -> list[Peer]:
        """Peers of our cluster and key that proved themselves within `timeout`."""
        return [p for p in self.peers() if p.foreign is None and self.alive(p)]

    def foreign(self) -> list[Peer]:
        return [p for p in self.peers() if p.foreign is not None]

    def expire(self) -> list[str]:
        """Drop peers with no advert or proof for `forget` seconds; their node ids."""
        now = self.clock()
        gone = [p.node_id for p in self.peers() if now - p.last_seen > self.forget]
        for node_id in gone:
            del self._peers[node_id]
        return gone


def _keep_order(advert: PeerAdvert, old: Peer | None) -> PeerAdvert:
    """`advert` with the address that last answered us first, if mDNS still lists it."""
    if old is None or not old.advert.addresses:
        return advert
    if not advert.addresses:
        return replace(advert, addresses=old.advert.addresses)
    first = old.advert.addresses[0]
    if first not in advert.addresses:
        return advert
    return replace(advert, addresses=(first, *(a for a in advert.addresses if a != first)))


async def browse(seconds: float = 2.0, interfaces: Sequence[str] | None = None, quiet: float = BROWSE_QUIET_S,
                 wanted: Callable[[PeerAdvert], bool] = lambda advert: True) -> list[PeerAdvert]:
    """The nodes answering on the network (a client's look: nothing is registered): once one
    is `wanted`, those heard until `quiet` seconds pass without a new one; else all heard in
    `seconds`."""
    aiozc = AsyncZeroconf(interfaces=list(interfaces) if interfaces else InterfaceChoice.All)
    names: list[str] = []  # in the order heard
    last = [0.0]  # when the latest new name was heard

    def seen(zeroconf: object, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        if state_change is not ServiceStateChange.Removed and name not in names:
            names.append(name)
            last[0] = time.monotonic()

    browser = AsyncServiceBrowser(aiozc.zeroconf, SERVICE_TYPE, handlers=[seen], question_type=DNSQuestionType.QM)
    found: dict[str, PeerAdvert | None] = {}  # None: heard but not an advert we read
    try:
        end = time.monotonic() + seconds
        while (now := time.monotonic()) < end:  # at most seconds / 0.05 turns
            if not (names and now - last[0] >= quiet and len(found) < len(names)):
                await asyncio.sleep(0.05)
                continue
            for name in names[len(found):]:
                found[name] = await _resolve(aiozc, name)
            if any(a is not None and wanted(a) for a in found.values()):
                break
        for name in names[len(found):]:
            found[name] = await _resolve(aiozc, name)
        return [found[name] for name in sorted(found) if found[name] is not None]
    finally:
        await browser.async_cancel()
        await aiozc.async_close()


async def _resolve(aiozc: AsyncZeroconf, name: str) -> PeerAdvert | None:
    """The advert a browsed name carries (None: unanswered, or not one we read)."""
    info = AsyncServiceInfo(SERVICE_TYPE, name)
    if not await info.async_request(aiozc.zeroconf, RESOLVE_MS, question_type=DNSQuestionType.QM):
        return None
    try:
        return parse_txt(info.properties, info.parsed_addresses())
    except DiscoveryError as exc:
        log.warning("ignoring %s: %s", name, exc)
        return None
