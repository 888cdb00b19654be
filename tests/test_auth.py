"""Cluster key files, the mutual HMAC handshake and its session keys, and HTTP key proofs.

The handshake over real sockets (and the sealed frames after it) is in test_link_security.py.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat

import pytest

from edgetp.net.auth import (
    KEY_BYTES,
    AuthError,
    Initiator,
    KeyFileError,
    Responder,
    cluster_id,
    generate_key,
    read_key,
    write_key,
)
import msgpack

from edgetp.net.httpauth import Challenges, ProofError, bearer, check, token_ok

KEY = bytes(range(32))
OTHER = bytes(range(1, 33))


# --------------------------------------------------------------------------- key file


def test_written_key_file_is_0600_and_reads_back(tmp_path):
    path = tmp_path / "cluster.key"
    key = write_key(path)
    assert len(key) == KEY_BYTES
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_key(path) == key
    assert [p.name for p in tmp_path.iterdir()] == ["cluster.key"]  # no temp file left behind


def test_write_key_refuses_to_overwrite_unless_forced(tmp_path):
    path = tmp_path / "cluster.key"
    first = write_key(path)
    with pytest.raises(KeyFileError, match="refusing to overwrite"):
        write_key(path)
    assert read_key(path) == first
    second = write_key(path, force=True)
    assert read_key(path) == second != first


def test_write_key_is_0600_even_with_a_permissive_umask(tmp_path):
    old = os.umask(0)
    try:
        write_key(tmp_path / "k")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "k").stat().st_mode) == 0o600


def test_read_key_refuses_a_0644_file(tmp_path):
    path = tmp_path / "k"
    write_key(path)
    path.chmod(0o644)
    with pytest.raises(KeyFileError, match="readable by group or others .*chmod 600"):
        read_key(path)


def test_read_key_explains_a_missing_file(tmp_path):
    with pytest.raises(KeyFileError, match="does not exist"):
        read_key(tmp_path / "nope")


def test_read_key_refuses_short_and_non_hex_keys(tmp_path):
    path = tmp_path / "k"
    path.write_text("ab" * 16)
    path.chmod(0o600)
    with pytest.raises(KeyFileError, match="16-byte key"):
        read_key(path)
    path.write_text("not hex at all")
    with pytest.raises(KeyFileError, match="hex"):
        read_key(path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_read_key_explains_an_unreadable_file(tmp_path):
    path = tmp_path / "k"
    write_key(path)
    path.chmod(0o200)
    with pytest.raises(KeyFileError, match="cannot read"):
        read_key(path)


def test_generated_keys_are_32_random_bytes():
    assert len(generate_key()) == 32 and generate_key() != generate_key()


def test_cluster_id_is_the_documented_hmac_and_does_not_contain_the_key():
    expected = hmac.new(KEY, b"edgetp-cluster-id", hashlib.sha256).hexdigest()[:16]
    assert cluster_id(KEY) == expected
    assert KEY.hex()[:16] not in cluster_id(KEY) and cluster_id(KEY) != cluster_id(OTHER)


# --------------------------------------------------------------------------- handshake, pure


def handshake(init: Initiator, resp: Responder) -> None:
    resp.on_auth(init.on_challenge(resp.on_hello(init.hello())))


def test_right_key_authenticates_both_sides_and_names_the_peers():
    init, resp = Initiator(KEY, "pi-1"), Responder(KEY, "pi-2")
    handshake(init, resp)
    assert init.keys is not None and resp.keys is not None
    assert init.peer_id == "pi-2" and resp.peer_id == "pi-1"


def _hkdf(ikm: bytes, salt: bytes, info: bytes, n: int) -> bytes:
    """RFC 5869 HKDF-SHA256, written out from the RFC as the reference."""
    prk = hmac.new(salt, ikm, hashlib.sha256).digest()
    out, t, i = b"", b"", 1
    while len(out) < n:
        t = hmac.new(prk, t + info + bytes([i]), hashlib.sha256).digest()
        out, i = out + t, i + 1
    return out[:n]


def test_session_keys_are_the_documented_hkdf_one_per_direction_and_new_each_session():
    ni, nr = bytes([1]) * 32, bytes([2]) * 32
    init, resp = Initiator(KEY, "pi-1", {"epoch": 7}, nonce=ni), Responder(KEY, "pi-2", nonce=nr)
    handshake(init, resp)
    hello = {"epoch": 7, "node_id": "pi-1", "cluster_id": cluster_id(KEY), "nonce": ni}
    parts = [b"edgetp-link-v2", msgpack.packb(sorted(hello.items()), use_bin_type=True), b"pi-2", nr]
    transcript = b"".join(len(p).to_bytes(4, "big") + p for p in parts)
    okm = _hkdf(KEY, ni + nr, b"edgetp-link-keys-v2" + hashlib.sha256(transcript).digest(), 64)
    assert init.keys == (okm[:32], okm[32:])  # initiator sends with the first, receives with the second
    assert resp.keys == (okm[32:], okm[:32])
    again_i, again_r = Initiator(KEY, "pi-1", {"epoch": 7}), Responder(KEY, "pi-2")
    handshake(again_i, again_r)
    assert set(again_i.keys).isdisjoint(init.keys)


@pytest.mark.parametrize(("field", "value"), [("epoch", 99), ("extra", "added on the way")])
def test_every_hello_field_the_epoch_too_is_inside_the_proof(field, value):
    init, resp = Initiator(KEY, "root", {"epoch": 3}), Responder(KEY, "worker")
    hello = {**init.hello(), field: value}  # changed between the two nodes
    with pytest.raises(AuthError, match="failed to prove"):
        init.on_challenge(resp.on_hello(hello))
    assert init.keys is None


def test_initiator_with_wrong_key_is_refused_by_responder():
    init, resp = Initiator(OTHER, "pi-1"), Responder(KEY, "pi-2")
    hello = init.hello()
    hello["cluster_id"] = cluster_id(KEY)  # lie about the cluster to get past the first check
    challenge = resp.on_hello(hello)
    with pytest.raises(AuthError, match="failed to prove"):
        init.on_challenge(challenge)  # the initiator already sees the responder's proof is wrong for it
    forged = {"proof": hmac.new(OTHER, b"guess", hashlib.sha256).digest()}
    with pytest.raises(AuthError, match="failed to prove"):
        resp.on_auth(forged)
    assert resp.keys is None


def test_responder_with_wrong_key_is_refused_by_initiator():
    init, resp = Initiator(KEY, "pi-1"), Responder(OTHER, "evil")
    hello = init.hello()
    hello["cluster_id"] = cluster_id(OTHER)
    with pytest.raises(AuthError, match="'evil' failed to prove"):
        init.on_challenge(resp.on_hello(hello))
    assert init.keys is None


def test_hello_from_another_cluster_is_refused_by_id_before_any_proof():
    with pytest.raises(AuthError, match="another cluster"):
        Responder(KEY, "pi-2").on_hello(Initiator(OTHER, "pi-1").hello())


def test_recorded_initiator_transcript_replayed_to_a_fresh_responder_fails():
    init, resp = Initiator(KEY, "pi-1"), Responder(KEY, "pi-2")
    hello = init.hello()
    auth = init.on_challenge(resp.on_hello(hello))
    resp.on_auth(auth)  # the genuine run succeeds
    fresh = Responder(KEY, "pi-2")
    fresh.on_hello(hello)  # same hello, but fresh picks a new nonce
    with pytest.raises(AuthError, match="failed to prove"):
        fresh.on_auth(auth)


def test_recorded_responder_challenge_replayed_to_a_fresh_initiator_fails():
    init, resp = Initiator(KEY, "pi-1"), Responder(KEY, "pi-2")
    challenge = resp.on_hello(init.hello())
    fresh = Initiator(KEY, "pi-1")
    fresh.hello()
    with pytest.raises(AuthError, match="failed to prove"):
        fresh.on_challenge(challenge)


@pytest.mark.parametrize("field", ["node_id", "nonce", "proof"])
def test_tampered_challenge_fields_fail(field):
    init, resp = Initiator(KEY, "pi-1"), Responder(KEY, "pi-2")
    challenge = resp.on_hello(init.hello())
    challenge[field] = "pi-9" if field == "node_id" else bytes(32)
    with pytest.raises(AuthError):
        init.on_challenge(challenge)


@pytest.mark.parametrize(("field", "value"), [("node_id", "mallory"), ("nonce", bytes(32))])
def test_tampered_hello_makes_the_initiator_refuse_the_challenge(field, value):
    init, resp = Initiator(KEY, "pi-1"), Responder(KEY, "pi-2")
    hello = {**init.hello(), field: value}
    with pytest.raises(AuthError, match="failed to prove"):
        init.on_challenge(resp.on_hello(hello))


@pytest.mark.parametrize("tamper", ["flip_proof", "short_proof", "not_a_dict"])
def test_malformed_auth_message_fails(tamper):
    init, resp = Initiator(KEY, "pi-1"), Responder(KEY, "pi-2")
    auth = init.on_challenge(resp.on_hello(init.hello()))
    msg = {
        "flip_proof": {"proof": bytes([auth["proof"][0] ^ 1]) + auth["proof"][1:]},
        "short_proof": {"proof": auth["proof"][:16]},
        "not_a_dict": [auth["proof"]],
    }[tamper]
    with pytest.raises(AuthError):
        resp.on_auth(msg)


def test_handshake_steps_out_of_order_fail():
    init, resp = Initiator(KEY, "pi-1"), Responder(KEY, "pi-2")
    with pytest.raises(AuthError, match="out of order"):
        init.on_challenge({})
    with pytest.raises(AuthError, match="out of order"):
        resp.on_auth({"proof": bytes(32)})


# --------------------------------------------------------------------------- HTTP key proofs (net/httpauth.py)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def written_proof(key, method, path_qs, body, nonce):
    """The documented proof, written out here rather than taken from the code under test."""
    parts = [b"edgetp-http-2", method.encode(), path_qs.encode(), hashlib.sha256(body).digest(), nonce.encode()]
    return hmac.new(key, b"".join(len(p).to_bytes(4, "big") + p for p in parts), hashlib.sha256).hexdigest()


def test_a_proof_is_good_once_for_its_nonce_and_request_and_never_with_another_key():
    ch = Challenges()
    n = ch.issue()
    headers = {"X-Edgetp-Nonce": n, "X-Edgetp-Proof": written_proof(KEY, "POST", "/v1/cluster/peers?x=1", b"{}", n)}
    for key, method, path, body in ((OTHER, "POST", "/v1/cluster/peers?x=1", b"{}"),
                                    (KEY, "GET", "/v1/cluster/peers?x=1", b"{}"),
                                    (KEY, "POST", "/v1/cluster/peers?x=2", b"{}"),
                                    (KEY, "POST", "/v1/cluster/peers?x=1", b"{ }")):
        with pytest.raises(ProofError, match="wrong key proof"):
            check(key, ch, method, path, body, headers)
    check(KEY, ch, "POST", "/v1/cluster/peers?x=1", b"{}", headers)  # refusals above did not burn the nonce
    with pytest.raises(ProofError, match="used"):
        check(KEY, ch, "POST", "/v1/cluster/peers?x=1", b"{}", headers)


def test_nonces_expire_by_the_servers_own_clock_and_the_store_stays_bounded():
    clock = Clock()
    ch = Challenges(ttl=60, max_size=3, clock=clock)
    old = ch.issue()
    clock.t += 61
    with pytest.raises(ProofError, match="expired"):
        ch.take(old)
    first, *rest = [ch.issue() for _ in range(4)]
    assert len(ch) == 3
    with pytest.raises(ProofError):  # the oldest outstanding one made room
        ch.take(first)
    for n in rest:
        ch.take(n)
    with pytest.raises(ProofError):
        ch.take("never-issued")


@pytest.mark.parametrize("headers", [{}, {"X-Edgetp-Nonce": "abc"}, {"X-Edgetp-Proof": "00"}])
def test_missing_proof_headers_are_refused(headers):
    with pytest.raises(ProofError, match="no key proof"):
        check(KEY, Challenges(), "GET", "/v1/events", b"", headers)


def test_bearer_tokens_match_exactly():
    assert bearer({"Authorization": "Bearer abc"}) == "abc" and bearer({"Authorization": "bearer abc"}) == "abc"
    assert bearer({"Authorization": "Basic abc"}) is None and bearer({}) is None
    assert token_ok(("t1-aaaaaaaaaaaaaaaa", "t2-bbbbbbbbbbbbbbbb"), "t2-bbbbbbbbbbbbbbbb")
    assert not token_ok(("t1-aaaaaaaaaaaaaaaa",), "t1-aaaaaaaaaaaaaaa") and not token_ok(("x" * 16,), None)


def test_a_flood_of_challenges_pushes_out_only_its_own_and_ordinary_traffic_loses_none():
    ch = Challenges(ttl=60, max_size=100)
    forwarded = [ch.issue("10.0.0.3") for _ in range(40)]  # a node relaying 40 requests at once: all kept
    member = ch.issue("10.0.0.2")
    flood = [ch.issue("10.0.0.66") for _ in range(1000)]  # the table is full: the flood gives up its own
    assert len(ch) == 100
    ch.take(member)
    for n in forwarded:
        ch.take(n)
    with pytest.raises(ProofError):
        ch.take(flood[0])
    for n in flood[-59:]:
        ch.take(n)
    assert len(ch) == 0
    assert len([ch.issue("10.0.0.4") for _ in range(100)]) == len(ch) == 100  # one address may fill it
    # then many addresses of one nonce each: the full one gives way, then (a tie) the oldest goes first
    issued = [ch.issue(f"10.0.1.{i}") for i in range(150)]
    assert len(ch) == 100
    with pytest.raises(ProofError):
        ch.take(issued[49])
    ch.take(issued[50])
