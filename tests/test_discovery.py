"""Discovery: TXT validation, the peer table, and real zeroconf on 127.0.0.1."""

from __future__ import annotations

import asyncio
import secrets

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edgetp.cluster.discovery import (
    Discovery, DiscoveryError, Joined, Left, PeerAdvert, PeerTable, Updated, ballot_of, parse_txt,
)
from edgetp.net.auth import cluster_id
from edgetp.net.frames import PROTOCOL_VERSION

KEY = bytes(range(32))
CID = cluster_id(KEY)


def advert(node_id="n1", **kw) -> PeerAdvert:
    base = dict(node_id=node_id, cluster_id=CID, data_port=7710, http_port=7711, speed=1.5e9,
                mem_free=2 << 30, model="sha256-ab12", priority=0, no_root=False)
    return PeerAdvert(**(base | kw))


def as_zeroconf(txt: dict[str, str]) -> dict[bytes, bytes]:
    return {k.encode(): v.encode() for k, v in txt.items()}


# --------------------------------------------------------------------------- parse_txt


def test_an_advert_survives_the_trip_through_txt_records():
    a = advert(priority=-2, no_root=True, speed=123.25)
    assert parse_txt(as_zeroconf(a.to_txt()), ["10.0.0.2"]) == PeerAdvert(**{**a.__dict__, "addresses": ("10.0.0.2",)})


def test_the_txt_records_carry_the_cluster_id_and_never_the_key():
    txt = advert().to_txt()
    assert txt["cid"] == CID
    assert KEY.hex() not in "".join(txt.values())


@pytest.mark.parametrize("key, value, why", [
    ("id", None, "'id' is missing"),
    ("id", "bad.id", "not a node id"),
    ("cid", "XYZ", "'cid' must be"),
    ("dp", "0", "'dp' must be an integer in 1..65535"),
    ("hp", "70000", "'hp' must be"),
    ("spd", "nan", "'spd' must be finite"),
    ("spd", "-1", "'spd' must be finite and >= 0"),
    ("spd", "fast", "'spd' is not a number"),
    ("mem", "1.5", "'mem' must be an integer"),
    ("nr", "yes", "'nr' must be 0 or 1"),
    ("pv", "", "'pv' must be an integer"),
    ("mdl", "a b", "'mdl' is not a model fingerprint"),
])
def test_a_malformed_field_is_refused_with_its_name(key, value, why):
    txt = as_zeroconf(advert().to_txt())
    if value is None:
        del txt[key.encode()]
    else:
        txt[key.encode()] = value.encode()
    with pytest.raises(DiscoveryError, match=why):
        parse_txt(txt)


def test_a_field_that_is_not_utf8_is_refused():
    txt = as_zeroconf(advert().to_txt())
    txt[b"mdl"] = b"\xff\xfe"
    with pytest.raises(DiscoveryError, match="not UTF-8"):
        parse_txt(txt)


def test_unknown_extra_records_are_ignored_for_forward_compatibility():
    txt = as_zeroconf(advert().to_txt()) | {b"future": b"1", b"flag": None}
    assert parse_txt(txt).node_id == "n1"


txt_values = st.one_of(st.none(), st.binary(max_size=20), st.text(max_size=20).map(str.encode))


@given(st.dictionaries(st.sampled_from(["id", "pv", "cid", "dp", "hp", "spd", "mem", "mdl", "pri", "nr", "x"]),
                       txt_values))
def test_arbitrary_txt_records_either_parse_to_a_valid_advert_or_raise_discovery_error(fields):
    props = {k.encode(): v for k, v in fields.items()}
    try:
        a = parse_txt(props)
    except DiscoveryError:
        return
    assert 1 <= a.data_port <= 65535 and 1 <= a.http_port <= 65535 and a.speed >= 0 and a.mem_free >= 0
    assert parse_txt(as_zeroconf(a.to_txt())) == a


@given(st.sampled_from(["id", "pv", "cid", "dp", "hp", "spd", "mem", "mdl", "pri", "nr"]), st.binary(max_size=12))
def test_corrupting_one_field_never_raises_anything_but_discovery_error(key, junk):
    txt = as_zeroconf(advert().to_txt())
    txt[key.encode()] = junk
    try:
        parse_txt(txt)
    except DiscoveryError:
        pass


# --------------------------------------------------------------------------- PeerTable


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_peer_is_usable_until_it_falls_silent_for_longer_than_the_timeout():
    clock = FakeClock()
    table = PeerTable(CID, timeout=5.0, clock=clock)
    table.apply(Joined(advert("a")))
    clock.now += 4.0
    table.apply(Joined(advert("b")))
    assert [p.node_id for p in table.usable()] == ["a", "b"]
    clock.now += 1.5  # a: 5.5 s silent, b: 1.5 s
    assert [p.node_id for p in table.usable()] == ["b"]
    assert table.seen("a") is True  # a heartbeat brings it back
    assert [p.node_id for p in table.usable()] == ["a", "b"]
    clock.now += 5.5
    assert table.expire() == ["a", "b"] and table.peers() == []
    assert table.seen("a") is False


def test_an_update_refreshes_the_advert_and_the_last_seen_time():
    clock = FakeClock()
    table = PeerTable(CID, timeout=5.0, clock=clock)
    table.apply(Joined(advert("a", speed=1.0)))
    clock.now += 4.0
    table.apply(Updated(advert("a", speed=2.0)))
    clock.now += 4.0
    (peer,) = table.usable()
    assert peer.advert.speed == 2.0 and peer.last_seen == 104.0


def test_a_left_peer_is_gone_at_once():
    table = PeerTable(CID, clock=FakeClock())
    table.apply(Joined(advert("a")))
    table.apply(Left("a"))
    assert table.peers() == []
    table.apply(Left("never-seen"))  # harmless


def test_peers_of_another_cluster_or_protocol_are_listed_as_foreign_and_never_usable():
    table = PeerTable(CID, clock=FakeClock())
    table.apply(Joined(advert("ours")))
    table.apply(Joined(advert("impostor", cluster_id=cluster_id(bytes(32)))))
    table.apply(Joined(advert("future", protocol=PROTOCOL_VERSION + 1)))
    assert [p.node_id for p in table.usable()] == ["ours"]
    foreign = {p.node_id: p.foreign for p in table.foreign()}
    assert set(foreign) == {"impostor", "future"}
    assert "cluster" in foreign["impostor"] and "protocol version" in foreign["future"]
    assert len(table.peers()) == 3


def test_a_no_root_advert_makes_a_ballot_that_cannot_lead():
    b = ballot_of(advert("x", no_root=True, priority=3, speed=9.0))
    assert (b.node_id, b.priority, b.speed, b.can_lead) == ("x", 3, 9.0, False)


# --------------------------------------------------------------------------- zeroconf on loopback


def unique(name: str) -> str:
    return f"{name}-{secrets.token_hex(3)}"  # tests running side by side never collide


async def next_event(disc: Discovery, want: type, node_id: str, timeout: float = 10.0):
    """The first `want` event about `node_id` (others are skipped), or a timeout failure."""
    async def find():
        async for ev in disc.events():
            nid = ev.node_id if isinstance(ev, Left) else ev.advert.node_id
            if isinstance(ev, want) and nid == node_id:
                return ev
    return await asyncio.wait_for(find(), timeout)


@pytest.mark.asyncio
@pytest.mark.slow
async def test_two_nodes_on_loopback_see_each_other_join_update_and_leave():
    a_ad, b_ad = advert(unique("a"), data_port=17710), advert(unique("b"), data_port=17720)
    a = Discovery(a_ad, interfaces=["127.0.0.1"])
    b = Discovery(b_ad, interfaces=["127.0.0.1"])
    await a.start()
    try:
        await b.start()
        try:
            seen_by_a = await next_event(a, Joined, b_ad.node_id)
            seen_by_b = await next_event(b, Joined, a_ad.node_id)
            assert seen_by_a.advert == PeerAdvert(**{**b_ad.__dict__, "addresses": ("127.0.0.1",)})
            assert seen_by_b.advert.data_port == 17710 and seen_by_b.advert.cluster_id == CID

            await b.update(PeerAdvert(**{**b_ad.__dict__, "speed": 7e9}))
            upd = await next_event(a, Updated, b_ad.node_id)
            assert upd.advert.speed == 7e9
        finally:
            await b.stop()
        left = await next_event(a, Left, b_ad.node_id, timeout=5.0)  # a goodbye, not a TTL expiry
        assert left.node_id == b_ad.node_id
    finally:
        await a.stop()


@pytest.mark.asyncio
@pytest.mark.slow
async def test_a_node_with_another_cluster_key_is_seen_but_listed_as_foreign():
    ours, theirs = advert(unique("ours")), advert(unique("impostor"), cluster_id=cluster_id(b"\x01" * 32))
    table = PeerTable(CID)
    a = Discovery(ours, interfaces=["127.0.0.1"])
    c = Discovery(theirs, interfaces=["127.0.0.1"])
    await a.start()
    try:
        await c.start()
        try:
            table.apply(await next_event(a, Joined, theirs.node_id))
        finally:
            await c.stop()
    finally:
        await a.stop()
    assert [p.node_id for p in table.foreign()] == [theirs.node_id] and table.usable() == []


# Not tested here: a second node with the same id fails to start (zeroconf's NonUniqueNameException
# becomes DiscoveryError). On one host the probe's unicast answer goes to whichever socket bound
# port 5353 last, so such a test would fail whenever another mDNS responder runs beside it.
