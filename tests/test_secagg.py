"""SecAgg+ without the network: the secure sum is the plain quantised sum, exactly, with and without dropped clients,
and every hostile input is refused with a message that names it."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Collection

import numpy as np
import pytest

from fedsynth.secagg.errors import SecAggError
from fedsynth.secagg.graph import neighbours
from fedsynth.secagg.keys import agree, new_key_pair, open_sealed, seal
from fedsynth.secagg.keystream import expand
from fedsynth.secagg.protocol import (
    AdvertisedKeys,
    ServerRound,
    UnmaskReply,
    advertise,
    masked_input,
    share_keys,
    seed_commitment,
    unmask_shares,
)
from fedsynth.secagg.quantize import QuantRange, decode_mean, decode_sum, encode, with_weight
from fedsynth.secagg.shamir import PRIME, SHARE_BYTES, combine, split

CLIENTS = 10
THRESHOLD = 6
LENGTH = 10_000
CONTEXT = b"run 5e1f/round 3"


def deterministic_bytes(label: str) -> Callable[[int], bytes]:
    """A reproducible byte source (SHA-256 of a counter), so that no test depends on chance. Tests only."""
    counter = itertools.count()

    def draw(count: int) -> bytes:
        out = b""
        while len(out) < count:
            out += hashlib.sha256(f"{label}/{next(counter)}".encode()).digest()
        return out[:count]

    return draw


def client_updates(seed: int = 0) -> tuple[QuantRange, dict[int, int], dict[int, np.ndarray], dict[int, np.ndarray]]:
    """(range, weights, float updates, encoded updates with their weight appended) of CLIENTS clients."""
    rng = np.random.default_rng(seed)
    weights = {c: int(rng.integers(50, 5000)) for c in range(CLIENTS)}
    quant = QuantRange(clip=1.0, total_weight=sum(weights.values()))
    updates = {c: rng.normal(0.0, 0.6, LENGTH) for c in range(CLIENTS)}
    encoded = {c: with_weight(encode(updates[c], weights[c], quant), weights[c]) for c in range(CLIENTS)}
    return quant, weights, updates, encoded


def plain_sum(encoded: dict[int, np.ndarray], clients: Collection[int]) -> np.ndarray:
    total = np.zeros(LENGTH + 1, dtype=np.uint32)
    for c in clients:
        total += encoded[c]
    return total


def run_round(
    encoded: dict[int, np.ndarray],
    *,
    degree: int = 8,
    lost_before_share: Collection[int] = (),
    lost_before_mask: Collection[int] = (),
    lost_before_unmask: Collection[int] = (),
    lying: Collection[int] = (),
) -> tuple[np.ndarray, frozenset[int], dict[int, np.ndarray]]:
    """One full round through the four stages: (the server's sum, the survivors, what the server received)."""
    clients = sorted(encoded)
    server = ServerRound(clients, degree=degree, threshold=THRESHOLD, graph_seed=b"round 3 graph", context=CONTEXT, length=LENGTH + 1)
    draw = deterministic_bytes(f"round {degree} {sorted(lost_before_share)} {sorted(lost_before_mask)}")
    keys = {c: advertise(draw) for c in clients}
    for c in clients:
        server.add_public_keys(c, keys[c].public())
    states = {}
    for c in clients:
        if c not in lost_before_share:
            states[c], boxes = share_keys(c, keys[c], server.keys_for(c), threshold=THRESHOLD, context=CONTEXT, rng_bytes=draw)
            server.add_sealed(c, boxes, seed_commitment(states[c].self_mask_seed, CONTEXT))
    received = {c: server.sealed_for(c) for c in states}
    masked = {}
    for c in states:
        if c not in lost_before_mask:
            masked[c] = masked_input(states[c], encoded[c], received[c])
            server.add_masked_input(c, masked[c])
    survivors, dropped = server.unmask_request()
    replies = {
        c: unmask_shares(states[c], received[c], survivors=survivors, dropped=dropped)
        for c in sorted(survivors)
        if c not in lost_before_unmask
    }
    for c in lying:  # a holder that sends a wrong (well-formed) share of every secret it holds
        reply = replies[c]
        wrong = {owner: ((int.from_bytes(share, "big") + 1) % PRIME).to_bytes(SHARE_BYTES, "big")
                 for owner, share in {**reply.self_mask_shares, **reply.mask_key_shares}.items()}
        replies[c] = UnmaskReply(c, {o: wrong[o] for o in reply.self_mask_shares}, {o: wrong[o] for o in reply.mask_key_shares})
    return server.unmask(replies), survivors, masked


@pytest.mark.parametrize("degree", [8, CLIENTS])  # 10 >= K - 1: the complete graph
def test_the_secure_sum_is_the_plain_quantised_sum_and_decodes_to_the_weighted_mean(degree: int) -> None:
    quant, weights, updates, encoded = client_updates()
    graph = neighbours(range(CLIENTS), degree, b"round 3 graph")
    assert {len(adjacent) for adjacent in graph.values()} == {min(degree, CLIENTS - 1)}  # 8: sparse, not complete

    total, survivors, _ = run_round(encoded, degree=degree)

    assert survivors == set(range(CLIENTS))
    assert np.array_equal(total, plain_sum(encoded, range(CLIENTS)))
    mean, total_weight = decode_mean(total, quant)
    expected = sum(weights[c] * np.clip(updates[c], -1.0, 1.0) for c in range(CLIENTS)) / quant.total_weight
    assert total_weight == quant.total_weight
    # Each client's rounding moves its weighted element by at most 1/2 unit of 1/scale.
    assert np.max(np.abs(mean - expected)) <= CLIENTS * 0.5 / (quant.scale * quant.total_weight)
    assert np.max(np.abs(expected)) > 0.1


@pytest.mark.parametrize(
    ("stage", "lost"),
    [("mask", {3}), ("mask", {3, 7}), ("share", {2}), ("share", {2, 8}), ("unmask", {4, 9})],
)
def test_a_round_with_lost_clients_sums_exactly_the_survivors(stage: str, lost: set[int]) -> None:
    quant, weights, _, encoded = client_updates(seed=1)
    total, survivors, _ = run_round(encoded, **{f"lost_before_{stage}": lost})

    # A client lost in stage 4 sent its masked input: it counts, and its self-mask comes from the other holders.
    assert survivors == set(range(CLIENTS)) - (set() if stage == "unmask" else lost)
    assert np.array_equal(total, plain_sum(encoded, survivors))
    assert not np.array_equal(total, plain_sum(encoded, range(CLIENTS))) or stage == "unmask"
    assert decode_mean(total, quant)[1] == sum(weights[c] for c in survivors)


def test_holders_sending_wrong_shares_are_outvoted_and_the_sum_stays_exact() -> None:
    _, _, _, encoded = client_updates(seed=4)
    total, survivors, _ = run_round(encoded, degree=CLIENTS, lost_before_mask={3}, lying={0, 5})  # 9 holders, t = 6
    assert np.array_equal(total, plain_sum(encoded, survivors)) and 3 not in survivors
    with pytest.raises(SecAggError, match="sent wrong shares"):  # 4 liars of 8 answering holders: no 6 honest ones
        run_round(encoded, degree=CLIENTS, lost_before_mask={3}, lying={0, 1, 2, 5})


def test_the_server_refuses_to_unmask_with_fewer_shares_than_the_threshold() -> None:
    _, _, _, encoded = client_updates(seed=2)
    # Complete graph; only clients 0..4 answer stage 4, so client 0's seed has the shares of 1..4.
    with pytest.raises(SecAggError, match=r"^client 0's self-mask seed: 4 shares of 6 needed$"):
        run_round(encoded, degree=CLIENTS, lost_before_unmask=range(5, CLIENTS))
    # Five clients lost after sharing keys leave every secret with at most 5 surviving holders, before anyone is asked.
    with pytest.raises(SecAggError, match=r"^client 0 has 4 surviving neighbours holding its shares, 6 needed$"):
        run_round(encoded, degree=CLIENTS, lost_before_mask=range(5, CLIENTS))


def _interpolate_at_zero(shares: dict[int, bytes]) -> int:
    """Lagrange interpolation at 0 over every share given, written out here independently of shamir.combine."""
    points = [(holder + 1, int.from_bytes(share, "big")) for holder, share in shares.items()]
    value = 0
    for x_i, y_i in points:
        weight = 1
        for x_j, _ in points:
            if x_j != x_i:
                weight = weight * x_j * pow(x_j - x_i, -1, PRIME) % PRIME
        value = (value + y_i * weight) % PRIME
    return value


def test_fewer_than_threshold_shares_are_refused_and_say_nothing_of_the_secret() -> None:
    secret = deterministic_bytes("secret")(32)
    shares = split(secret, threshold=THRESHOLD, holders=range(CLIENTS), rng_bytes=deterministic_bytes("split"))

    assert combine(shares, threshold=THRESHOLD) == secret
    assert combine({h: shares[h] for h in (1, 3, 5, 7, 8, 9)}, threshold=THRESHOLD) == secret
    assert _interpolate_at_zero({h: shares[h] for h in range(6)}) == int.from_bytes(secret, "big")
    five = {h: shares[h] for h in range(5)}
    with pytest.raises(SecAggError, match=r"^5 shares of a secret that needs 6$"):
        combine(five, threshold=THRESHOLD)
    assert _interpolate_at_zero(five) != int.from_bytes(secret, "big")


# RFC 8439 section 2.3.2: key 00..1f, nonce 00 00 00 09 00 00 00 4a 00 00 00 00, block counter 1, serialized block.
RFC8439_KEY = bytes(range(32))
RFC8439_NONCE = bytes.fromhex("000000090000004a00000000")
RFC8439_BLOCK_1 = bytes.fromhex(
    "10 f1 e7 e4 d1 3b 59 15 50 0f dd 1f a3 20 71 c4"
    "c7 d1 f4 c7 33 c0 68 03 04 22 aa 9a c3 d4 6c 4e"
    "d2 82 64 46 07 9f aa 09 14 c2 d7 05 d9 8b 02 a2"
    "b5 12 9c d1 de 16 4e b9 cb d0 83 e8 a2 50 3c 4e"
)


def test_the_mask_expansion_is_the_published_chacha20_keystream() -> None:
    words = expand(RFC8439_KEY, 32, nonce=RFC8439_NONCE)

    assert words.dtype == np.uint32 and words.shape == (32,)
    assert words[16:].astype("<u4").tobytes() == RFC8439_BLOCK_1  # expand starts at counter 0: block 1 is words 16..31
    assert int(words[16]) == 0xE4E7F110  # the RFC's first state word after the block function
    assert np.array_equal(expand(RFC8439_KEY, 20, nonce=RFC8439_NONCE), words[:20])


def test_what_the_server_receives_differs_from_the_update_in_every_element() -> None:
    _, _, _, encoded = client_updates(seed=3)
    _, _, masked = run_round(encoded)

    for client, vector in masked.items():
        assert vector.dtype == np.uint32 and vector.shape == encoded[client].shape
        assert np.all(vector != encoded[client]), client


def test_key_agreement_refuses_malformed_and_low_order_public_keys() -> None:
    pair, peer = new_key_pair(deterministic_bytes("a")), new_key_pair(deterministic_bytes("b"))
    assert agree(pair.private, peer.public, context=CONTEXT) == agree(peer.private, pair.public, context=CONTEXT)
    assert agree(pair.private, peer.public, context=CONTEXT) != agree(pair.private, peer.public, context=b"other")

    with pytest.raises(SecAggError, match="must be 32 bytes, not 31"):
        agree(pair.private, peer.public[:31], context=CONTEXT)
    for low_order in (bytes(32), (1).to_bytes(32, "little")):
        with pytest.raises(SecAggError, match=f"{low_order.hex()} is a low-order point"):
            agree(pair.private, low_order, context=CONTEXT)
    server = ServerRound(range(CLIENTS), degree=8, threshold=THRESHOLD, graph_seed=b"g", context=CONTEXT, length=LENGTH)
    with pytest.raises(SecAggError, match="client 4's masking public key is 31 bytes, not 32"):
        server.add_public_keys(4, AdvertisedKeys(peer.public, peer.public[:31]))


def test_a_tampered_or_misrouted_box_is_refused() -> None:
    key = deterministic_bytes("box key")(32)
    box = seal(key, b"shares", associated=b"ids 1 2")
    assert open_sealed(key, box, associated=b"ids 1 2") == b"shares"
    tampered = box[:20] + bytes([box[20] ^ 1]) + box[21:]
    for bad_box, associated in ((tampered, b"ids 1 2"), (box, b"ids 1 3")):
        with pytest.raises(SecAggError, match="failed authentication"):
            open_sealed(key, bad_box, associated=associated)

    draw = deterministic_bytes("route")
    keys = {c: advertise(draw) for c in range(7)}
    public = {c: keys[c].public() for c in keys}
    states = {}
    boxes = {}
    for c in keys:
        states[c], boxes[c] = share_keys(c, keys[c], {v: public[v] for v in keys if v != c}, threshold=4, context=CONTEXT, rng_bytes=draw)
    received = {sender: boxes[sender][5] for sender in keys if sender != 5}
    encoded = np.zeros(LENGTH, dtype=np.uint32)
    flipped = {**received, 2: received[2][:-1] + bytes([received[2][-1] ^ 1])}
    with pytest.raises(SecAggError, match=r"^box from client 2 to client 5: sealed box failed authentication"):
        masked_input(states[5], encoded, flipped)
    misrouted = {**received, 2: boxes[2][4]}  # client 2's shares for holder 4 handed to holder 5
    with pytest.raises(SecAggError, match=r"^box from client 2 to client 5: sealed box failed authentication"):
        masked_input(states[5], encoded, misrouted)


def test_the_server_refuses_a_share_from_a_client_that_does_not_hold_it() -> None:
    draw = deterministic_bytes("holder")
    clients = range(CLIENTS)
    server = ServerRound(clients, degree=8, threshold=THRESHOLD, graph_seed=b"g", context=CONTEXT, length=LENGTH)
    keys = {c: advertise(draw) for c in clients}
    for c in clients:
        server.add_public_keys(c, keys[c].public())
    states = {}
    for c in clients:
        states[c], boxes = share_keys(c, keys[c], server.keys_for(c), threshold=THRESHOLD, context=CONTEXT, rng_bytes=draw)
        server.add_sealed(c, boxes)
    received = {c: server.sealed_for(c) for c in clients}
    for c in clients:
        server.add_masked_input(c, masked_input(states[c], np.zeros(LENGTH, dtype=np.uint32), received[c]))
    survivors, dropped = server.unmask_request()
    replies = {c: unmask_shares(states[c], received[c], survivors=survivors, dropped=dropped) for c in clients}
    stranger = next(c for c in clients if c != 0 and c not in server.neighbours[0])  # degree 8 of 9: one non-neighbour
    forged = replies[0].self_mask_shares | {stranger: bytes(SHARE_BYTES)}
    replies[0] = UnmaskReply(0, forged, {})
    with pytest.raises(SecAggError, match=f"^client 0 sent a share of client {stranger}'s self-mask seed, which it does not hold$"):
        server.unmask(replies)


def test_the_server_refuses_a_masked_input_of_the_wrong_length_or_dtype() -> None:
    draw = deterministic_bytes("shape")
    server = ServerRound(range(CLIENTS), degree=8, threshold=THRESHOLD, graph_seed=b"g", context=CONTEXT, length=LENGTH)
    keys = {c: advertise(draw) for c in range(CLIENTS)}
    for c in range(CLIENTS):
        server.add_public_keys(c, keys[c].public())
    _, boxes = share_keys(3, keys[3], server.keys_for(3), threshold=THRESHOLD, context=CONTEXT, rng_bytes=draw)
    server.add_sealed(3, boxes)
    with pytest.raises(SecAggError, match=r"client 3's masked input is uint32 of shape \(9999,\), not uint32 of shape \(10000,\)"):
        server.add_masked_input(3, np.zeros(LENGTH - 1, dtype=np.uint32))
    with pytest.raises(SecAggError, match=r"client 3's masked input is float64 of shape \(10000,\)"):
        server.add_masked_input(3, np.zeros(LENGTH))
    with pytest.raises(SecAggError, match="client 4 sent a masked input without having shared its keys"):
        server.add_masked_input(4, np.zeros(LENGTH, dtype=np.uint32))


def test_a_client_named_both_surviving_and_dropped_is_never_unmasked() -> None:
    draw = deterministic_bytes("both")
    keys = {c: advertise(draw) for c in range(7)}
    public = {c: keys[c].public() for c in keys}
    states, boxes = {}, {}
    for c in keys:
        states[c], boxes[c] = share_keys(c, keys[c], {v: public[v] for v in keys if v != c}, threshold=4, context=CONTEXT, rng_bytes=draw)
    received = {sender: boxes[sender][0] for sender in keys if sender != 0}

    with pytest.raises(SecAggError, match=r"^client\(s\) \[4\] named both surviving and dropped: client 0 refuses to unmask$"):
        unmask_shares(states[0], received, survivors=range(6), dropped=[4, 6])
    reply = unmask_shares(states[0], received, survivors=range(6), dropped=[6])
    assert sorted(reply.self_mask_shares) == [1, 2, 3, 4, 5] and sorted(reply.mask_key_shares) == [6]
    with pytest.raises(SecAggError, match="^client 0 already answered an unmask request this round$"):
        unmask_shares(states[0], received, survivors=range(5), dropped=[5, 6])


def test_malformed_shares_and_non_finite_values_are_refused_by_name() -> None:
    shares = split(bytes(range(32)), threshold=3, holders=[0, 1, 2], rng_bytes=deterministic_bytes("s"))
    with pytest.raises(SecAggError, match="holder 1's share is 65 bytes, not 66"):
        combine({**shares, 1: shares[1][1:]}, threshold=3)
    with pytest.raises(SecAggError, match="holder 2's share is not a field element"):
        combine({**shares, 2: PRIME.to_bytes(SHARE_BYTES, "big")}, threshold=3)
    with pytest.raises(SecAggError, match="threshold 4 is outside"):
        split(bytes(32), threshold=4, holders=[0, 1, 2])

    quant = QuantRange(clip=2.0, total_weight=100)
    values = np.zeros(50)
    values[17], values[30] = np.nan, np.inf
    with pytest.raises(SecAggError, match=r"^values\[17\] is nan, not finite$"):
        encode(values, 10, quant)
    with pytest.raises(SecAggError, match=r"weight 101 is outside \[1, total_weight=100\]"):
        encode(np.zeros(5), 101, quant)
    with pytest.raises(SecAggError, match="clip must be a finite number > 0, not inf"):
        QuantRange(clip=float("inf"), total_weight=100)


@pytest.mark.parametrize("weights", [[1] * CLIENTS, [7, 1, 300, 12, 5, 5, 99, 1, 2, 3]])
def test_the_sum_of_clients_at_the_clip_does_not_wrap(weights: list[int]) -> None:
    # With ten weights of 1, each client's exact bound 214748364.7 would round up: unheld, the sum would wrap.
    quant = QuantRange(clip=0.5, total_weight=sum(weights))
    for sign in (1.0, -1.0):
        vectors = [encode(np.full(4, sign * 3.0), weight, quant) for weight in weights]  # clipped to +-0.5
        total = np.sum(vectors, axis=0, dtype=np.uint32)
        signed = sum(v.view(np.int32).astype(np.int64) for v in vectors)

        assert np.all(np.abs(signed) <= 2**31 - 1)
        assert np.array_equal(total.view(np.int32).astype(np.int64), signed)
        assert np.allclose(decode_sum(total, quant), sign * 0.5 * quant.total_weight, rtol=1e-6)


def test_the_graph_is_a_seeded_symmetric_ring_of_the_given_degree() -> None:
    clients = [3, 11, 12, 40, 41, 57, 60, 77, 90, 99, 100, 123]
    graph = neighbours(clients, 4, b"round 3")

    assert all(len(adjacent) == 4 and c not in adjacent for c, adjacent in graph.items())
    assert all(c in graph[v] for c, adjacent in graph.items() for v in adjacent)
    assert graph == neighbours(list(reversed(clients)), 4, b"round 3")
    assert graph != neighbours(clients, 4, b"round 4")
    with pytest.raises(SecAggError, match="graph degree must be an even integer >= 2, not 3"):
        neighbours(clients, 3, b"round 3")
