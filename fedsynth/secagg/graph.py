"""The SecAgg+ communication graph: a ring of the sampled clients in a seeded order, each joined to its nearest."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from fedsynth.secagg.errors import SecAggError


def neighbours(clients: Sequence[int], degree: int, seed: bytes) -> dict[int, tuple[int, ...]]:
    """Each client's neighbours (sorted ids) in a `degree`-regular graph: the clients ordered by HMAC-SHA256(seed,
    id), each joined to the degree // 2 nearest on either side of that ring. `seed` is public, fixed per round.
    A degree of at least len(clients) - 1 gives the complete graph, i.e. plain SecAgg. Symmetric by construction."""
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 2 or degree % 2:
        raise SecAggError(f"graph degree must be an even integer >= 2, not {degree!r}")
    if len(set(clients)) != len(clients) or any(not 0 <= c < 2**64 for c in clients):
        raise SecAggError(f"clients must be distinct ids in [0, 2**64), not {list(clients)}")
    if degree >= len(clients) - 1:
        return {c: tuple(sorted(set(clients) - {c})) for c in clients}
    ring = sorted(clients, key=lambda c: (hmac.new(seed, c.to_bytes(8, "big"), hashlib.sha256).digest(), c))
    half, count = degree // 2, len(ring)
    return {
        c: tuple(sorted(ring[(i + step) % count] for step in range(-half, half + 1) if step))
        for i, c in enumerate(ring)
    }
