"""Compiled sealing (net/aead.py through net/wire.py's seal_body and open_body) against
`cryptography`'s ChaCha20-Poly1305, which frames.Cipher uses: the same ciphertext and tag for the
same key, nonce (the frame's number, little-endian) and associated data, byte for byte, and a
frame altered anywhere, or opened under another number or key, refused."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from hypothesis import example, given, settings
from hypothesis import strategies as st

from edgetp.net import aead, wire

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the compiled path is Linux's")

KEY = bytes(range(100, 132))


def _want(key: bytes, number: int, aad: bytes, plain: bytes) -> bytes:
    return ChaCha20Poly1305(key).encrypt(number.to_bytes(12, "little"), plain, aad)


def test_libcrypto_is_found_and_agrees_with_cryptography_here():
    # every machine the suite runs on has the system's libcrypto (Python's ssl module needs it)
    assert aead.available()


# A link counts its frames in a signed 64-bit integer when compiled code seals them (2**63 - 1 frames:
# 292,000 years at a million a second), so that is the range of numbers; 2**64 - 1 here failed with
# "int too big to convert" whenever hypothesis drew a number past it, not because sealing was wrong.
FRAME_NUMBERS = st.integers(0, 2**63 - 1)


@settings(max_examples=40, deadline=None)
@given(size=st.integers(0, 9000), number=FRAME_NUMBERS, aad_size=st.sampled_from([0, 16, 17]))
@example(size=0, number=2**63 - 1, aad_size=0)  # the largest number, whose nonce's eighth byte is 0x7f
@example(size=577, number=2**32, aad_size=16)  # a number past 32 bits, an all-reduce frame's size
def test_a_sealed_body_is_cryptographys_ciphertext_and_tag_and_opens_back(size, number, aad_size):
    rng = np.random.default_rng(size)
    plain = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
    aad = rng.integers(0, 256, aad_size, dtype=np.uint8)
    body = np.frombuffer(plain + bytes(aead.TAG_BYTES), np.uint8).copy()
    tx, rx = aead.Context(KEY, True), aead.Context(KEY, False)
    assert wire.seal_body(tx.addr, number, aad, body) == 1
    assert body.tobytes() == _want(KEY, number, aad.tobytes(), plain)
    assert wire.open_body(rx.addr, number, aad, body) == 1
    assert body[:size].tobytes() == plain


@pytest.mark.parametrize("change", ["ciphertext", "tag", "aad", "number", "key"])
def test_a_body_altered_anywhere_or_opened_under_another_number_or_key_is_refused(change):
    aad = np.arange(16, dtype=np.uint8)
    plain = bytes(range(200))
    sealed = np.frombuffer(_want(KEY, 7, aad.tobytes(), plain), np.uint8).copy()
    key, number = KEY, 7
    if change == "ciphertext":
        sealed[123] ^= 0x40
    elif change == "tag":
        sealed[-1] ^= 1
    elif change == "aad":
        aad[3] ^= 1
    elif change == "number":
        number = 8
    else:
        key = bytes(reversed(KEY))
    rx = aead.Context(key, False)
    assert wire.open_body(rx.addr, number, aad, sealed) == 0
    good = np.frombuffer(_want(KEY, 9, b"", plain), np.uint8).copy()  # the context still opens the next
    assert wire.open_body(aead.Context(KEY, False).addr, 9, np.zeros(0, np.uint8), good) == 1


def test_frames_sealed_one_after_another_on_one_context_each_take_their_own_number():
    # the context is keyed once; each frame only resets the nonce, so no state leaks between frames
    tx, rx = aead.Context(KEY, True), aead.Context(KEY, False)
    aad = np.arange(16, dtype=np.uint8)
    for number, size in enumerate([0, 1, 64, 577, 2305, 64]):
        plain = bytes((number * 31 + i) & 0xFF for i in range(size))
        body = np.frombuffer(plain + bytes(16), np.uint8).copy()
        assert wire.seal_body(tx.addr, number, aad, body) == 1
        assert body.tobytes() == _want(KEY, number, aad.tobytes(), plain)
        assert wire.open_body(rx.addr, number, aad, body) == 1 and body[:size].tobytes() == plain


def test_a_key_of_the_wrong_size_is_refused():
    with pytest.raises(ValueError, match="32 bytes"):
        aead.Context(bytes(16), True)
