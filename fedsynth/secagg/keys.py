"""X25519 key agreement into HKDF-SHA256 keys, and ChaCha20Poly1305 sealing of the shares sent between clients."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedsynth.secagg.errors import SecAggError

KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16


@dataclass(frozen=True)
class KeyPair:
    private: X25519PrivateKey
    public: bytes  # raw 32 bytes


def new_key_pair(rng_bytes: Callable[[int], bytes] | None = None) -> KeyPair:
    """A fresh X25519 key pair; `rng_bytes` (tests only) supplies the 32 private bytes."""
    private = X25519PrivateKey.generate() if rng_bytes is None else X25519PrivateKey.from_private_bytes(rng_bytes(32))
    return KeyPair(private, private.public_key().public_bytes_raw())


def agree(private: X25519PrivateKey, peer_public: bytes, *, context: bytes) -> bytes:
    """A 32-byte key both ends derive: HKDF-SHA256 (no salt, info `context`) of the X25519 shared secret."""
    if len(peer_public) != KEY_BYTES:
        raise SecAggError(f"a peer public key must be {KEY_BYTES} bytes, not {len(peer_public)}")
    try:
        shared = private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError:  # OpenSSL refuses the all-zero result that a low-order point gives
        shared = bytes(KEY_BYTES)
    if shared == bytes(KEY_BYTES):
        raise SecAggError(f"peer public key {peer_public.hex()} is a low-order point (all-zero shared secret)")
    return HKDF(algorithm=SHA256(), length=KEY_BYTES, salt=None, info=context).derive(shared)


def seal(key: bytes, plaintext: bytes, *, associated: bytes, rng_bytes: Callable[[int], bytes] = secrets.token_bytes) -> bytes:
    """ChaCha20Poly1305 of `plaintext` under a random 12-byte nonce, which leads the returned box."""
    nonce = rng_bytes(NONCE_BYTES)
    return nonce + ChaCha20Poly1305(key).encrypt(nonce, plaintext, associated)


def open_sealed(key: bytes, box: bytes, *, associated: bytes) -> bytes:
    """The plaintext of a box from `seal`; any change to the box or to `associated` is refused."""
    if len(box) < NONCE_BYTES + TAG_BYTES:
        raise SecAggError(f"a sealed box of {len(box)} bytes is shorter than nonce and tag ({NONCE_BYTES + TAG_BYTES})")
    try:
        return ChaCha20Poly1305(key).decrypt(box[:NONCE_BYTES], box[NONCE_BYTES:], associated)
    except InvalidTag:
        raise SecAggError("sealed box failed authentication (tampered, misrouted or under the wrong key)") from None
