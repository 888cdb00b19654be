"""ChaCha20-Poly1305 for compiled code: the system's OpenSSL (libcrypto), called from numba.

A sealed link's all-reduce frames were sealed and opened in Python (frames.Cipher, through
`cryptography`): about 3 µs of cipher and 8 more of Python around it a frame, four frames on
the path of each round (tools/bench_allreduce.py). net/wire.py now seals and opens them in the
same compiled call that builds and sends, or receives and adds, a frame, through OpenSSL's EVP
interface: the same RFC 8439 construction, so the bytes on the wire are those `cryptography`
makes and opens (checked at first use against it, `available`, and in tests/test_aead.py).

* `Context`: one direction's EVP_CIPHER_CTX, keyed once (ctypes); freed with its owner.
* `seal` / `open_`: numba intrinsics (LLVM IR calling libcrypto's EVP_* by name, resolved when
  numba links the code, so it is cached like the kernels): one frame, the nonce its number in
  its direction (12 bytes, little-endian, as frames.Cipher counts), the prefix as associated data,
  in place.

Without a libcrypto that has EVP_chacha20_poly1305 (or if the probe disagrees with
`cryptography`), `available()` is False and sealed frames keep the Python way.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import weakref

from llvmlite import binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from edgetp.model.vnni import _I32, _I64, _decl

KEY_BYTES, NONCE_BYTES, TAG_BYTES = 32, 12, 16
CTRL_GET_TAG, CTRL_SET_TAG = 0x10, 0x11  # EVP_CTRL_AEAD_GET_TAG, EVP_CTRL_AEAD_SET_TAG
_PTR = ir.IntType(8).as_pointer()
_NAMES = ("EVP_CIPHER_CTX_new", "EVP_CIPHER_CTX_free", "EVP_chacha20_poly1305", "EVP_CipherInit_ex",
          "EVP_CipherUpdate", "EVP_CipherFinal_ex", "EVP_CIPHER_CTX_ctrl")


@functools.cache
def _lib() -> ctypes.CDLL | None:
    """libcrypto, with its EVP_* names made visible to code numba links (None: not here)."""
    for name in ("crypto", "crypto-3", "crypto-1_1"):
        path = ctypes.util.find_library(name)
        if not path:
            continue
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if all(hasattr(lib, n) for n in _NAMES):
            break
    else:
        return None
    llvm.load_library_permanently(path)
    lib.EVP_CIPHER_CTX_new.restype = ctypes.c_void_p
    lib.EVP_CIPHER_CTX_new.argtypes = []
    lib.EVP_CIPHER_CTX_free.restype = None
    lib.EVP_CIPHER_CTX_free.argtypes = [ctypes.c_void_p]
    lib.EVP_chacha20_poly1305.restype = ctypes.c_void_p
    lib.EVP_chacha20_poly1305.argtypes = []
    lib.EVP_CipherInit_ex.restype = ctypes.c_int
    lib.EVP_CipherInit_ex.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p,
                                      ctypes.c_char_p, ctypes.c_int]
    return lib


class Context:
    """One direction's EVP_CIPHER_CTX for ChaCha20-Poly1305 under `key`: `addr` for seal (encrypt)
    or open_ (not encrypt). Each frame gives its own nonce; the context is freed (and its key
    cleansed, by OpenSSL) when this object goes."""

    def __init__(self, key: bytes, encrypt: bool) -> None:
        lib = _lib()
        if lib is None:
            raise RuntimeError("no libcrypto with ChaCha20-Poly1305 here")
        if len(key) != KEY_BYTES:
            raise ValueError(f"a link key is {KEY_BYTES} bytes, got {len(key)}")
        ctx = lib.EVP_CIPHER_CTX_new()
        if not ctx:
            raise MemoryError("EVP_CIPHER_CTX_new failed")
        self._free = weakref.finalize(self, lib.EVP_CIPHER_CTX_free, ctx)
        if lib.EVP_CipherInit_ex(ctx, lib.EVP_chacha20_poly1305(), None, key, None, int(encrypt)) != 1:
            raise RuntimeError("EVP_CipherInit_ex refused a ChaCha20-Poly1305 key")
        self.addr = int(ctx)
        self.encrypt = encrypt


def _call(builder, name, ret, args, values):
    return builder.call(_decl(builder.module, name, ret, args), values)


def _emit(builder, ctx, counter, aad, aad_n, data, n, tag, encrypt: bool):
    """One frame through ctx in place: data[:n] encrypted (or decrypted), aad authenticated, the tag
    written to (or checked against) tag. 1 if every call succeeded (opening: the tag matched)."""
    i32 = _I32
    ptr = lambda v: builder.inttoptr(v, _PTR)  # noqa: E731
    c = ptr(ctx)
    iv = cgutils.alloca_once(builder, ir.ArrayType(ir.IntType(8), NONCE_BYTES))  # in the entry block
    ivp = builder.bitcast(iv, _PTR)
    builder.store(counter, builder.bitcast(ivp, _I64.as_pointer()))  # bytes 0-7: the number, little-endian
    builder.store(ir.Constant(i32, 0), builder.bitcast(builder.gep(ivp, [ir.Constant(i32, 8)]), i32.as_pointer()))
    outl = cgutils.alloca_once(builder, i32)
    null = ir.Constant(_PTR, None)
    ok = _call(builder, "EVP_CipherInit_ex", i32, [_PTR] * 5 + [i32], [c, null, null, null, ivp, ir.Constant(i32, -1)])
    ok = builder.and_(ok, _call(builder, "EVP_CipherUpdate", i32, [_PTR, _PTR, i32.as_pointer(), _PTR, i32],
                                [c, null, outl, ptr(aad), builder.trunc(aad_n, i32)]))
    ok = builder.and_(ok, _call(builder, "EVP_CipherUpdate", i32, [_PTR, _PTR, i32.as_pointer(), _PTR, i32],
                                [c, ptr(data), outl, ptr(data), builder.trunc(n, i32)]))
    ctrl = [_PTR, i32, i32, _PTR]
    if not encrypt:
        ok = builder.and_(ok, _call(builder, "EVP_CIPHER_CTX_ctrl", i32, ctrl,
                                    [c, ir.Constant(i32, CTRL_SET_TAG), ir.Constant(i32, TAG_BYTES), ptr(tag)]))
    done = builder.gep(ptr(data), [n])  # nothing is left to write: a stream cipher
    ok = builder.and_(ok, _call(builder, "EVP_CipherFinal_ex", i32, [_PTR, _PTR, i32.as_pointer()], [c, done, outl]))
    if encrypt:
        ok = builder.and_(ok, _call(builder, "EVP_CIPHER_CTX_ctrl", i32, ctrl,
                                    [c, ir.Constant(i32, CTRL_GET_TAG), ir.Constant(i32, TAG_BYTES), ptr(tag)]))
    return builder.zext(builder.icmp_signed("==", ok, ir.Constant(i32, 1)), _I64)


def _intrinsic(encrypt: bool):
    @intrinsic
    def call(typingctx, ctx, counter, aad, aad_n, data, n, tag):
        def codegen(context, builder, signature, args):
            return _emit(builder, *args, encrypt)

        return types.int64(*([types.int64] * 7)), codegen

    return call


seal = _intrinsic(True)
seal.__doc__ = """seal(ctx, counter, aad, aad_n, data, n, tag) -> 1 or 0: data[:n] (addresses as int64)
encrypted in place under an encrypting Context's addr and nonce `counter`, aad[:aad_n] authenticated,
the 16-byte tag written at tag."""
open_ = _intrinsic(False)
open_.__doc__ = """open_(ctx, counter, aad, aad_n, data, n, tag) -> 1 if the tag at tag matches (data[:n]
then decrypted in place), else 0 (data is then not to be used)."""


@functools.cache
def available() -> bool:
    """Compiled sealing runs here: libcrypto found, and a probe's frames are the bytes `cryptography`
    seals, and open as it opens them (a tampered one refused)."""
    if _lib() is None:
        return False
    try:
        return _probe()
    except Exception:  # noqa: BLE001 - any failure means: keep the Python way
        return False


def _probe() -> bool:
    import numpy as np  # noqa: PLC0415
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305  # noqa: PLC0415

    from edgetp.net import wire  # noqa: PLC0415

    key, counter = bytes(range(7, 7 + KEY_BYTES)), 2**40 + 3
    aad, plain = bytes(range(16)), bytes((i * 37) & 0xFF for i in range(301))
    want = ChaCha20Poly1305(key).encrypt(counter.to_bytes(NONCE_BYTES, "little"), plain, aad)
    head = np.frombuffer(aad, np.uint8)
    body = np.frombuffer(plain + bytes(TAG_BYTES), np.uint8).copy()
    tx = Context(key, True)  # held: its context is freed with it
    if not wire.seal_body(tx.addr, counter, head, body) or body.tobytes() != want:
        return False
    rx = Context(key, False)
    if not wire.open_body(rx.addr, counter, head, body) or body[: len(plain)].tobytes() != plain:
        return False
    body = np.frombuffer(want, np.uint8).copy()
    body[5] ^= 1
    return not wire.open_body(rx.addr, counter, head, body)
