"""Signed adverts and heartbeat proofs, checked against HMACs computed here with the hmac module."""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets

import pytest

from edgetp.cluster.discovery import DiscoveryError, PeerAdvert, PeerTable, Joined, parse_txt, sign, signature_error
from edgetp.cluster.peering import check_heartbeat, heartbeat_proof
from edgetp.net.auth import cluster_id

KEY = secrets.token_bytes(32)


def reference_sig(key: bytes, txt: dict[str, str]) -> str:
    """The documented rule, written out: HMAC-SHA256 keyed by HMAC(key, "edgetp-advert-v1") over the
    canonical JSON (sorted keys, no spaces) of every TXT field but `sig`."""
    sub = hmac.new(key, b"edgetp-advert-v1", hashlib.sha256).digest()
    body = json.dumps({k: v for k, v in txt.items() if k != "sig"}, sort_keys=True, separators=(",", ":"))
    return hmac.new(sub, body.encode(), hashlib.sha256).hexdigest()


def member(**kw) -> PeerAdvert:
    base = dict(node_id="pi-1", cluster_id=cluster_id(KEY), data_port=7710, http_port=7711, speed=2.5e9,
                mem_free=1 << 30, model="sha256-cafe", priority=1, epoch=3, leader="pi-2",
                boot="00112233aabbccdd", seq=4)
    return sign(KEY, PeerAdvert(**(base | kw)))


def test_the_signature_is_the_documented_hmac_over_every_txt_field():
    a = member()
    txt = a.to_txt()
    assert set(txt) == {"id", "pv", "cid", "dp", "hp", "spd", "mem", "mdl", "pri", "nr", "ep", "ldr", "bt", "sq",
                        "sig"}
    assert txt["sig"] == reference_sig(KEY, txt)
    assert signature_error(KEY, parse_txt({k.encode(): v.encode() for k, v in txt.items()})) is None


@pytest.mark.parametrize("field", ["id", "pv", "cid", "dp", "hp", "spd", "mem", "mdl", "pri", "nr", "ep", "ldr",
                                   "bt", "sq"])
def test_changing_any_one_field_breaks_the_signature(field):
    txt = member().to_txt()
    txt[field] = {"id": "pi-9", "cid": cluster_id(KEY)[:-1] + "0", "mdl": "sha256-beef", "ldr": "pi-9",
                  "bt": "ffffffffffffffff", "spd": "9.0", "nr": "1"}.get(field, "9")
    if field == "cid" and txt["cid"] == member().cluster_id:
        txt["cid"] = "0" * 16
    tampered = parse_txt(txt)
    assert reference_sig(KEY, txt) != txt["sig"]
    assert signature_error(KEY, tampered) == "advert not signed with this cluster's key"


def test_an_advert_signed_with_another_key_or_not_at_all_fails():
    other = secrets.token_bytes(32)
    assert signature_error(KEY, sign(other, PeerAdvert(**{**member().__dict__, "sig": ""}))) is not None
    assert signature_error(KEY, PeerAdvert(**{**member().__dict__, "sig": ""})) == "advert not signed"


def test_a_replay_of_a_lower_sequence_is_ignored_and_the_held_advert_stands():
    table = PeerTable(KEY)
    table.apply(Joined(member(seq=7, epoch=5)))
    assert table.apply(Joined(member(seq=6, epoch=2))) is False
    assert table.get("pi-1").advert.epoch == 5


def test_the_heartbeat_proof_is_the_documented_hmac_over_the_nonce_and_the_advert_signature():
    a = member()
    nonce = secrets.token_hex(16)
    hb_key = hmac.new(KEY, b"edgetp-heartbeat-v1", hashlib.sha256).digest()
    want = hmac.new(hb_key, f"{nonce}\n{a.sig}".encode(), hashlib.sha256).hexdigest()
    assert heartbeat_proof(KEY, nonce, a.sig) == want
    got = check_heartbeat(KEY, nonce, {"advert": a.to_txt(), "proof": want}, ("10.0.0.5", "172.17.0.1"))
    assert got.node_id == "pi-1" and got.addresses == ("10.0.0.5", "172.17.0.1")


def test_a_heartbeat_answer_for_another_nonce_another_key_or_without_a_proof_is_refused():
    a = member()
    old, fresh = secrets.token_hex(16), secrets.token_hex(16)
    answer = {"advert": a.to_txt(), "proof": heartbeat_proof(KEY, old, a.sig)}
    with pytest.raises(DiscoveryError, match="does not prove"):
        check_heartbeat(KEY, fresh, answer, ())  # a recorded answer replayed to a new challenge
    with pytest.raises(DiscoveryError, match="does not prove"):
        check_heartbeat(KEY, fresh, {"advert": a.to_txt(), "proof": heartbeat_proof(bytes(32), fresh, a.sig)}, ())
    with pytest.raises(DiscoveryError):
        check_heartbeat(KEY, fresh, {"advert": a.to_txt()}, ())  # any 200 is not a proof
    with pytest.raises(DiscoveryError):
        check_heartbeat(KEY, fresh, "ok", ())


@pytest.mark.parametrize("proof", ["é" * 64, "\ud800" * 64, "0" * 10_000], ids=["non-ascii", "surrogate", "long"])
def test_a_heartbeat_proof_beyond_ascii_or_of_any_length_is_refused_not_raised(proof):
    a = member()
    with pytest.raises(DiscoveryError, match="does not prove"):
        check_heartbeat(KEY, secrets.token_hex(16), {"advert": a.to_txt(), "proof": proof}, ())


# --------------------------------------------------------------------------- a hostile peer over real HTTP

HOSTILE = {
    "nested": b"[" * 100_000 + b"]" * 100_000,  # past the recursion limit of json.loads
    "huge": b'"' + b"x" * (3 << 20) + b'"',     # 3 MiB: read no further than 1 MiB
    "not json": b"<html>hello</html>",
}


@pytest.fixture(params=sorted(HOSTILE))
async def hostile(request):
    """An HTTP server on loopback that answers every request, challenges included, with one bad body."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    async def answer(_request):
        return web.Response(body=HOSTILE[request.param], content_type="application/json")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield request.param, server.port
    finally:
        await server.close()


@pytest.mark.asyncio
async def test_a_peer_answering_json_too_deep_too_long_or_not_json_is_a_failed_peer_not_a_dead_daemon(hostile):
    import aiohttp

    from edgetp.cluster.discovery import Peer
    from edgetp.cluster.membership import Membership
    from edgetp.cluster.peering import introduce
    from edgetp.net import httpauth

    kind, port = hostile
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        # --peer: the introduction fails as a peer that cannot be reached would (the loop logs it, retries)
        with pytest.raises((aiohttp.ClientError, ValueError)):
            await introduce(session, ("127.0.0.1", port), KEY, member(node_id="me"))
        # a heartbeat: no proof, so no member
        membership = Membership(member(node_id="me"), key=KEY, interfaces=["127.0.0.1"])
        peer = Peer(member(addresses=("127.0.0.1",), http_port=port), 0.0, None, True)
        assert await membership._ping(session, peer) is None
        # the client side of a key proof: a peer that gives no challenge
        with pytest.raises(httpauth.ProofError, match="gave no key challenge"):
            await httpauth.proven_headers(session, f"http://127.0.0.1:{port}", KEY, "POST", "/v1/cluster/peers")
