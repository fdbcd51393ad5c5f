"""Shamir t-of-n sharing of a 32-byte secret over the prime field of p = 2**521 - 1."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping, Sequence

from fedsynth.secagg.errors import SecAggError

PRIME = 2**521 - 1
SHARE_BYTES = 66  # ceil(521 / 8)
SECRET_BYTES = 32


def _random_field_element(rng_bytes: Callable[[int], bytes]) -> int:
    while True:  # rejection sampling: only the value p itself is ever rejected
        value = int.from_bytes(rng_bytes(SHARE_BYTES), "big") & ((1 << 521) - 1)
        if value < PRIME:
            return value


def split(
    secret: bytes, *, threshold: int, holders: Sequence[int], rng_bytes: Callable[[int], bytes] = secrets.token_bytes
) -> dict[int, bytes]:
    """Each holder's share of `secret`: any `threshold` of them recover it, fewer reveal nothing. A holder's x
    coordinate is its id + 1, so that none is 0 (the point that holds the secret)."""
    if len(secret) != SECRET_BYTES:
        raise SecAggError(f"a secret to share must be {SECRET_BYTES} bytes, not {len(secret)}")
    if len(set(holders)) != len(holders) or any(h < 0 for h in holders):
        raise SecAggError(f"share holders must be distinct non-negative ids, not {sorted(holders)}")
    if not 1 <= threshold <= len(holders):
        raise SecAggError(f"threshold {threshold} is outside [1, {len(holders)}] for {len(holders)} holders")
    coefficients = [int.from_bytes(secret, "big")] + [_random_field_element(rng_bytes) for _ in range(threshold - 1)]
    shares = {}
    for holder in holders:
        x, y = holder + 1, 0
        for coefficient in reversed(coefficients):
            y = (y * x + coefficient) % PRIME
        shares[holder] = y.to_bytes(SHARE_BYTES, "big")
    return shares


def combine(shares: Mapping[int, bytes], *, threshold: int) -> bytes:
    """The secret, interpolated at 0 from the first `threshold` shares in holder order (a Mapping cannot repeat a
    holder). Shares that do not come from one polynomial give a value that usually does not fit 32 bytes: refused."""
    if len(shares) < threshold:
        raise SecAggError(f"{len(shares)} shares of a secret that needs {threshold}")
    if threshold < 1:
        raise SecAggError(f"threshold {threshold} must be at least 1")
    points = []
    for holder in sorted(shares)[:threshold]:
        share = shares[holder]
        if holder < 0:
            raise SecAggError(f"share holder id {holder} is negative")
        if len(share) != SHARE_BYTES:
            raise SecAggError(f"holder {holder}'s share is {len(share)} bytes, not {SHARE_BYTES}")
        y = int.from_bytes(share, "big")
        if y >= PRIME:
            raise SecAggError(f"holder {holder}'s share is not a field element (>= 2**521 - 1)")
        points.append((holder + 1, y))
    secret = 0
    for i, (x_i, y_i) in enumerate(points):
        numerator, denominator = 1, 1
        for j, (x_j, _) in enumerate(points):
            if j != i:
                numerator = numerator * x_j % PRIME
                denominator = denominator * (x_j - x_i) % PRIME
        secret = (secret + y_i * numerator * pow(denominator, -1, PRIME)) % PRIME
    if secret >= 1 << (8 * SECRET_BYTES):
        raise SecAggError(f"shares of holders {sorted(shares)[:threshold]} are inconsistent: the secret exceeds 32 bytes")
    return secret.to_bytes(SECRET_BYTES, "big")
