"""Discovery: TXT validation, the peer table, and real zeroconf on 127.0.0.1."""

from __future__ import annotations

import asyncio
import secrets

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edgetp.cluster.discovery import (
    Discovery, DiscoveryError, Joined, Left, PeerAdvert, PeerTable, Updated, ballot_of, parse_txt, sign,
)
from edgetp.net.auth import cluster_id
from edgetp.net.frames import PROTOCOL_VERSION

KEY = bytes(range(32))
CID = cluster_id(KEY)


def advert(node_id="n1", **kw) -> PeerAdvert:
    base = dict(node_id=node_id, cluster_id=CID, data_port=7710, http_port=7711, speed=1.5e9,
                mem_free=2 << 30, model="sha256-ab12", priority=0, no_root=False)
    return PeerAdvert(**(base | kw))


BOOT = "0123456789abcdef"


def signed(node_id="n1", key=KEY, **kw) -> PeerAdvert:
    """An advert as a member of the cluster of `key` announces it."""
    return sign(key, advert(node_id, **({"boot": BOOT, "seq": 1} | kw)))


def as_zeroconf(txt: dict[str, str]) -> dict[bytes, bytes]:
    return {k.encode(): v.encode() for k, v in txt.items()}


# --------------------------------------------------------------------------- parse_txt


def test_an_advert_survives_the_trip_through_txt_records():
    a = signed(priority=-2, no_root=True, speed=123.25, epoch=7, leader="n2", seq=3)
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
    ("ep", "-1", "'ep' must be an integer"),
    ("ldr", "a.b", "'ldr' is not a node id"),
    ("bt", "xyz", "'bt' must be 16 lowercase hex digits"),
    ("sq", "1e3", "'sq' must be an integer"),
    ("sig", "00", "'sig' must be 64 lowercase hex digits"),
])
def test_a_malformed_field_is_refused_with_its_name(key, value, why):
    txt = as_zeroconf(signed().to_txt())
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


def test_unknown_extra_records_are_covered_by_the_signature():
    later = signed(extra=(("future", "1"),))
    table = PeerTable(KEY)
    table.apply(Joined(parse_txt(as_zeroconf(later.to_txt()))))
    changed = as_zeroconf(later.to_txt()) | {b"future": b"2"}
    other = PeerTable(KEY)
    other.apply(Joined(parse_txt(changed)))
    assert table.foreign() == [] and [p.node_id for p in other.foreign()] == ["n1"]


txt_values = st.one_of(st.none(), st.binary(max_size=20), st.text(max_size=20).map(str.encode))


@given(st.dictionaries(st.sampled_from(["id", "pv", "cid", "dp", "hp", "spd", "mem", "mdl", "pri", "nr", "ep", "ldr",
                                        "bt", "sq", "sig", "x"]),
                       txt_values))
def test_arbitrary_txt_records_either_parse_to_a_valid_advert_or_raise_discovery_error(fields):
    props = {k.encode(): v for k, v in fields.items()}
    try:
        a = parse_txt(props)
    except DiscoveryError:
        return
    assert 1 <= a.data_port <= 65535 and 1 <= a.http_port <= 65535 and a.speed >= 0 and a.mem_free >= 0
    assert parse_txt(as_zeroconf(a.to_txt())) == a


@given(st.sampled_from(["id", "pv", "cid", "dp", "hp", "spd", "mem", "mdl", "pri", "nr", "ep", "ldr", "bt", "sq",
                        "sig"]), st.binary(max_size=12))
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


def test_a_signed_peer_is_usable_only_once_proven_and_until_silent_for_longer_than_the_timeout():
    clock = FakeClock()
    table = PeerTable(KEY, timeout=5.0, forget=20.0, clock=clock)
    table.apply(Joined(signed("a")))
    table.apply(Joined(signed("b")))
    assert table.usable() == [], "an advert alone proves nothing: it may be a replay"
    assert table.prove(signed("a"))
    clock.now += 4.0
    assert table.prove(signed("b"))
    assert [p.node_id for p in table.usable()] == ["a", "b"]
    clock.now += 1.5  # a: 5.5 s without a proof, b: 1.5 s
    assert [p.node_id for p in table.usable()] == ["b"]
    assert table.prove(signed("a"))  # a heartbeat brings it back
    assert [p.node_id for p in table.usable()] == ["a", "b"]
    clock.now += 20.5
    assert table.expire() == ["a", "b"] and table.peers() == []
    assert table.prove(signed("a")) is False, "a proof for a peer the table does not list adds nothing"


def test_time_this_node_did_not_run_is_not_counted_against_its_peers():
    # membership reads its clock every election tick (half a heartbeat); a gap past one heartbeat
    # is time the node was frozen: its peers keep what was left of their timeout
    from edgetp.cluster.membership import RunningClock  # noqa: PLC0415

    wall = FakeClock()
    clock = RunningClock(most=1.0, clock=wall)
    table = PeerTable(KEY, timeout=3.0, clock=clock)
    table.apply(Joined(signed("a")))
    table.apply(Joined(signed("b")))
    assert table.prove(signed("a")) and table.prove(signed("b"))
    for _ in range(3):  # running: ticks of 0.5 s count in full
        wall.now += 0.5
        clock()
    assert clock() == wall.now and clock.paused == 0.0
    table.prove(signed("b"))  # b proven 1.5 s after a
    wall.now += 8.0  # SIGSTOP ... SIGCONT: 8 s of which 1 counts (a heartbeat's worth)
    assert [p.node_id for p in table.usable()] == ["a", "b"], "peers lost for the time this node was frozen"
    assert clock.paused == 7.0
    wall.now += 0.5  # a: 1.5 + 1 + 0.5 = 3 s of running without a proof: still within the timeout
    assert [p.node_id for p in table.usable()] == ["a", "b"]
    wall.now += 0.5  # 3.5 s: a's next heartbeat never came while this node ran
    assert [p.node_id for p in table.usable()] == ["b"]
    wall.now += 1.0  # b: 1 + 0.5 + 0.5 + 1 = 3 s
    assert [p.node_id for p in table.usable()] == ["b"]
    wall.now += 0.5
    assert table.usable() == []
    wall.now += 30.0  # the membership starting up (discovery) before its first tick: not a freeze
    clock.restart()
    assert clock() == wall.now - 7.0


def test_a_later_sequence_refreshes_the_advert_and_keeps_the_proof():
    clock = FakeClock()
    table = PeerTable(KEY, timeout=5.0, clock=clock)
    table.apply(Joined(signed("a", speed=1.0)))
    table.prove(signed("a", speed=1.0))
    assert table.apply(Updated(signed("a", speed=2.0, seq=2)))
    (peer,) = table.usable()
    assert peer.advert.speed == 2.0 and peer.advert.seq == 2


def test_a_replayed_advert_of_the_same_boot_is_ignored():
    table = PeerTable(KEY, clock=FakeClock())
    table.apply(Joined(signed("a", seq=5, speed=5.0)))
    assert table.apply(Updated(signed("a", seq=4, speed=4.0))) is False
    assert table.apply(Updated(signed("a", seq=5, speed=5.0))) is False  # the same record again: nothing new
    assert table.get("a").advert.speed == 5.0


def test_after_a_reboot_adverts_of_the_replaced_boot_are_replays():
    table = PeerTable(KEY, clock=FakeClock())
    old = signed("a", boot="1" * 16, seq=9, epoch=4)
    table.apply(Joined(old))
    assert table.apply(Updated(signed("a", boot="2" * 16, seq=1)))  # rebooted: sequence restarts
    assert table.apply(Updated(old)) is False
    assert table.get("a").advert.boot == "2" * 16


def test_a_heartbeat_proof_overrides_a_replayed_boot_that_mdns_brought():
    table = PeerTable(KEY, clock=FakeClock())
    current = signed("a", boot="2" * 16, seq=3)
    table.apply(Joined(signed("a", boot="1" * 16, seq=9)))  # an old boot this table never saw replaced
    assert table.prove(current)
    assert table.get("a").advert == current and [p.node_id for p in table.usable()] == ["a"]
    assert table.apply(Updated(signed("a", boot="1" * 16, seq=10))) is False


def test_an_unsigned_or_forged_advert_cannot_displace_a_signed_one():
    table = PeerTable(KEY, clock=FakeClock())
    table.apply(Joined(signed("a")))
    table.prove(signed("a"))
    forged = advert("a", priority=99, boot=BOOT, seq=50)
    assert table.apply(Updated(forged)) is False
    assert table.apply(Updated(signed("a", key=bytes(32), seq=50))) is False
    assert table.get("a").advert == signed("a") and table.foreign() == []


def test_a_goodbye_makes_a_peer_unusable_at_once_and_a_proof_brings_it_back():
    table = PeerTable(KEY, clock=FakeClock())
    table.apply(Joined(signed("a")))
    table.prove(signed("a"))
    assert table.apply(Left("a"))
    assert table.usable() == [] and [p.node_id for p in table.peers()] == ["a"]
    assert table.prove(signed("a")), "a goodbye is unsigned: a peer still answering its challenge stays"
    assert [p.node_id for p in table.usable()] == ["a"]
    assert table.apply(Left("never-seen")) is False  # harmless


def test_peers_of_another_cluster_protocol_or_key_are_listed_as_foreign_and_never_usable():
    table = PeerTable(KEY, clock=FakeClock())
    adverts = [signed("ours"), signed("impostor", cluster_id=cluster_id(bytes(32))),
               signed("future", protocol=PROTOCOL_VERSION + 1), advert("unsigned", boot=BOOT, seq=1),
               signed("otherkey", key=bytes(32)),
               PeerAdvert(**{**signed("tampered").__dict__, "priority": 9})]
    for a in adverts:
        table.apply(Joined(a))
        table.prove(a)
    assert [p.node_id for p in table.usable()] == ["ours"]
    foreign = {p.node_id: p.foreign for p in table.foreign()}
    assert set(foreign) == {"impostor", "future", "unsigned", "otherkey", "tampered"}
    assert "cluster" in foreign["impostor"] and "protocol version" in foreign["future"]
    assert foreign["unsigned"] == "advert not signed"
    assert "key" in foreign["otherkey"] and "key" in foreign["tampered"]
    assert len(table.peers()) == 6


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
    a_ad, b_ad = signed(unique("a"), data_port=17710), signed(unique("b"), data_port=17720)
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

            await b.update(sign(KEY, PeerAdvert(**{**b_ad.__dict__, "speed": 7e9, "seq": 2})))
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
    ours, theirs = signed(unique("ours")), signed(unique("impostor"), key=b"\x01" * 32,
                                                 cluster_id=cluster_id(b"\x01" * 32))
    table = PeerTable(KEY)
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


def test_a_legacy_unicast_query_gets_a_real_responders_record_every_time_and_nothing_for_a_free_name():
    # the second way Discovery._twin asks: a record held by a real zeroconf responder (its own instance
    # here) comes back straight to our port, with its port and boot id, on every ask, including asks
    # less than a second apart (a multicast answer to those may be held back, RFC 6762 6)
    from zeroconf import ServiceInfo, Zeroconf  # noqa: PLC0415

    from edgetp.cluster.discovery import SERVICE_TYPE, _legacy_answers  # noqa: PLC0415

    name = f"legacy-{secrets.token_hex(4)}.{SERVICE_TYPE}"
    zc = Zeroconf(interfaces=["127.0.0.1"])
    try:
        zc.register_service(ServiceInfo(SERVICE_TYPE, name, port=45678, properties={"bt": "0123456789abcdef"},
                                        server="legacy-host.local.", parsed_addresses=["127.0.0.1"]))
        for _ in range(5):
            assert _legacy_answers(name, ["127.0.0.1"], 2.0) == [(45678, "0123456789abcdef")]
        free = f"nobody-{secrets.token_hex(4)}.{SERVICE_TYPE}"
        assert _legacy_answers(free, ["127.0.0.1"], 0.3) == []
    finally:
        zc.close()
