"""The cluster key and the HMAC proofs that a peer holds it.

The key is 32 random bytes in a 0600 file, shared out of band. It never
travels: peers see only `cluster_id(key)` (in mDNS TXT records) and
HMAC-SHA256 proofs bound to fresh nonces from both sides.

Link handshake (frames HELLO, CHALLENGE, AUTH, AUTH_OK; net/link.py runs it):

    initiator -> HELLO      {node_id, cluster_id, nonce Ni, epoch, ...}
    responder -> CHALLENGE  {node_id, nonce Nr, proof HMAC(key, "responder" T)}
    initiator -> AUTH       {proof HMAC(key, "initiator" T)}
    responder -> AUTH_OK    {}
    T = every HELLO field (sorted), the responder's id and Nr

Each proof covers the other side's fresh nonce, so a recorded transcript
replayed to a new peer fails, and the whole HELLO (the root's epoch too),
so none of it can be changed on the way. Both sides then derive one
ChaCha20-Poly1305 key per direction (`session_keys`: HKDF over the cluster
key, both nonces and T) and every frame after AUTH_OK is sealed with it
(net/frames.py `Cipher`). `Initiator`/`Responder` are transport-free.

HTTP requests prove the key with a challenge from the server instead
(net/httpauth.py): no clock in either proof.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path
from typing import Any

import msgpack
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from edgetp.net import LINK_KEY_BYTES

KEY_BYTES = 32
NONCE_BYTES = 32
MAX_NODE_ID = 128


class AuthError(Exception):
    """A peer or request failed authentication; the reason says how."""


class KeyFileError(AuthError):
    """The cluster key file is missing, unreadable, too open or malformed."""


# --------------------------------------------------------------------------- key file


def generate_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def write_key(path: str | os.PathLike[str], key: bytes | None = None, *, force: bool = False) -> bytes:
    """Write a key (a new one by default) as hex to a 0600 file, atomically; returns the key."""
    key = generate_key() if key is None else key
    if len(key) < KEY_BYTES:
        raise KeyFileError(f"a cluster key needs {KEY_BYTES} bytes, got {len(key)}")
    path = Path(path)
    if not path.name or path.is_dir():
        raise KeyFileError(f"cannot write a key to {str(path)!r}: give a file name, not a directory")
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    try:
        _write_key(path, tmp, key, force)
    except OSError as exc:
        raise KeyFileError(f"cannot write the key to {path}: {exc.strerror or exc}") from None
    return key


def _write_key(path: Path, tmp: Path, key: bytes, force: bool) -> None:
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, key.hex().encode() + b"\n")
        os.fsync(fd)
        os.close(fd)
        fd = -1
        if force:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)  # atomic, and fails if the file is there
            except FileExistsError:
                raise KeyFileError(f"{path} exists; refusing to overwrite a cluster key (use --force)") from None
    finally:
        if fd >= 0:
            os.close(fd)
        tmp.unlink(missing_ok=True)


def read_key(path: str | os.PathLike[str]) -> bytes:
    """The key in a key file, refusing files others can read."""
    path = Path(path)
    try:
        st = path.stat()
        if st.st_mode & 0o077:
            raise KeyFileError(f"{path} is readable by group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
                               f"run: chmod 600 {path}")
        text = path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        raise KeyFileError(f"cluster key file {path} does not exist; create one and copy it to every node") from None
    except (PermissionError, IsADirectoryError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"cannot read cluster key file {path}: {exc}") from None
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise KeyFileError(f"{path} does not hold a hex cluster key") from None
    if len(key) < KEY_BYTES:
        raise KeyFileError(f"{path} holds a {len(key)}-byte key; cluster keys are {KEY_BYTES} bytes")
    return key


def cluster_id(key: bytes) -> str:
    """A public name for the cluster derived from the key (never the key)."""
    return hmac.new(key, b"edgetp-cluster-id", hashlib.sha256).hexdigest()[:16]


# --------------------------------------------------------------------------- handshake


def _canonical(hello: dict[str, Any]) -> bytes:
    """The HELLO as both sides encode it for the proof: msgpack of its (key, value) pairs, sorted."""
    return msgpack.packb(sorted(hello.items()), use_bin_type=True)


def _transcript(hello: dict[str, Any], responder_id: str, responder_nonce: bytes) -> bytes:
    parts = [b"edgetp-link-v2", _canonical(hello), responder_id.encode(), responder_nonce]
    return b"".join(len(p).to_bytes(4, "big") + p for p in parts)  # unambiguous framing


def _proof(key: bytes, role: bytes, transcript: bytes) -> bytes:
    return hmac.new(key, role + transcript, hashlib.sha256).digest()


def session_keys(key: bytes, transcript: bytes, initiator_nonce: bytes, responder_nonce: bytes) -> tuple[bytes, bytes]:
    """(initiator->responder, responder->initiator) link keys: HKDF-SHA256 of the cluster key over both nonces."""
    okm = HKDF(algorithm=hashes.SHA256(), length=2 * LINK_KEY_BYTES, salt=initiator_nonce + responder_nonce,
               info=b"edgetp-link-keys-v2" + hashlib.sha256(transcript).digest()).derive(key)
    return okm[:LINK_KEY_BYTES], okm[LINK_KEY_BYTES:]


def _field(msg: Any, name: str, kind: type, size: int | None = None) -> Any:
    if not isinstance(msg, dict):
        raise AuthError(f"handshake message is a {type(msg).__name__}, not a dict")
    value = msg.get(name)
    if not isinstance(value, kind):
        raise AuthError(f"handshake field {name!r} missing or not {kind.__name__}")
    if size is not None and len(value) != size:
        raise AuthError(f"handshake field {name!r} is {len(value)} bytes, expected {size}")
    if kind is str and not 0 < len(value) <= MAX_NODE_ID:
        raise AuthError(f"handshake field {name!r} has a bad length")
    return value


class Initiator:
    """The connecting side: hello() -> on_challenge(msg) -> AUTH message; then .keys.

    Every HELLO field (`extra` too, e.g. the root's epoch) is inside both proofs.
    """

    def __init__(self, key: bytes, node_id: str, extra: dict[str, Any] | None = None,
                 nonce: bytes | None = None) -> None:
        self._key, self.node_id = key, node_id
        self._nonce = nonce or secrets.token_bytes(NONCE_BYTES)
        self._hello = {**(extra or {}), "node_id": node_id, "cluster_id": cluster_id(key), "nonce": self._nonce}
        self._state = "start"
        self.peer_id: str | None = None
        self.keys: tuple[bytes, bytes] | None = None  # (send, receive) once the peer has proven the key

    def hello(self) -> dict[str, Any]:
        self._step("start", "hello")
        return dict(self._hello)

    def on_challenge(self, msg: Any) -> dict[str, Any]:
        self._step("hello", "failed")
        peer_id = _field(msg, "node_id", str)
        peer_nonce = _field(msg, "nonce", bytes, NONCE_BYTES)
        transcript = _transcript(self._hello, peer_id, peer_nonce)
        if not hmac.compare_digest(_field(msg, "proof", bytes, 32), _proof(self._key, b"responder", transcript)):
            raise AuthError(f"peer {peer_id!r} failed to prove the cluster key")
        self._state, self.peer_id = "done", peer_id
        self.keys = session_keys(self._key, transcript, self._nonce, peer_nonce)
        return {"proof": _proof(self._key, b"initiator", transcript)}

    def _step(self, expect: str, then: str) -> None:
        if self._state != expect:
            raise AuthError(f"handshake out of order: at {self._state!r}, wanted {expect!r}")
        self._state = then


class Responder:
    """The accepting side: on_hello(msg) -> CHALLENGE; on_auth(msg) checks the proof; then .keys."""

    def __init__(self, key: bytes, node_id: str, nonce: bytes | None = None) -> None:
        self._key, self.node_id = key, node_id
        self._nonce = nonce or secrets.token_bytes(NONCE_BYTES)
        self._state = "start"
        self._transcript = b""
        self._peer_nonce = b""
        self.peer_id: str | None = None
        self.hello: dict[str, Any] = {}
        self.keys: tuple[bytes, bytes] | None = None  # (send, receive) once the peer has proven the key

    def on_hello(self, msg: Any) -> dict[str, Any]:
        if self._state != "start":
            raise AuthError(f"handshake out of order: hello at {self._state!r}")
        self._state = "challenged"
        peer_id = _field(msg, "node_id", str)
        if "cluster_id" not in msg:
            raise AuthError("this node requires the cluster key (--key) and the peer sent none")
        if _field(msg, "cluster_id", str) != cluster_id(self._key):
            raise AuthError(f"peer {peer_id!r} belongs to another cluster ({msg['cluster_id']})")
        self._peer_nonce = _field(msg, "nonce", bytes, NONCE_BYTES)
        if not all(isinstance(k, str) for k in msg):
            raise AuthError("HELLO keys must be strings")
        self.peer_id, self.hello = peer_id, dict(msg)
        self._transcript = _transcript(self.hello, self.node_id, self._nonce)
        return {"node_id": self.node_id, "nonce": self._nonce,
                "proof": _proof(self._key, b"responder", self._transcript)}

    def on_auth(self, msg: Any) -> None:
        if self._state != "challenged" or self.peer_id is None:
            raise AuthError(f"handshake out of order: auth at {self._state!r}")
        self._state = "failed"
        want = _proof(self._key, b"initiator", self._transcript)
        if not hmac.compare_digest(_field(msg, "proof", bytes, 32), want):
            raise AuthError(f"peer {self.peer_id!r} failed to prove the cluster key")
        self._state = "done"
        to_us, from_us = session_keys(self._key, self._transcript, self._peer_nonce, self._nonce)
        self.keys = (from_us, to_us)
