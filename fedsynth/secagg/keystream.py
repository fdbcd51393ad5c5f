"""A mask vector: the ChaCha20 keystream (RFC 8439) of a 32-byte seed, read as little-endian uint32 words."""

from __future__ import annotations

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from fedsynth.secagg.errors import SecAggError

CHUNK_WORDS = 1 << 20  # 4 MiB of keystream per call, so a large model never holds two full-size buffers of zeros


def expand(seed: bytes, count: int, *, nonce: bytes = bytes(12)) -> np.ndarray:
    """`count` uint32 words of ChaCha20 keystream, key `seed`, `nonce`, block counter starting at 0."""
    if len(seed) != 32:
        raise SecAggError(f"a mask seed must be 32 bytes, not {len(seed)}")
    if len(nonce) != 12:
        raise SecAggError(f"a ChaCha20 nonce must be 12 bytes, not {len(nonce)}")
    if count < 0:
        raise SecAggError(f"mask length {count} is negative")
    # cryptography's 16-byte nonce is RFC 8439's 4-byte little-endian block counter followed by its 12-byte nonce.
    encryptor = Cipher(algorithms.ChaCha20(seed, bytes(4) + nonce), mode=None).encryptor()
    words = np.empty(count, dtype=np.uint32)
    zeros = memoryview(bytes(4 * min(count, CHUNK_WORDS)))
    for start in range(0, count, CHUNK_WORDS):
        stop = min(start + CHUNK_WORDS, count)
        words[start:stop] = np.frombuffer(encryptor.update(zeros[: 4 * (stop - start)]), dtype="<u4")
    return words
