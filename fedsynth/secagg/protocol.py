"""The four SecAgg+ stages of one round (advertise, share keys, masked input, unmask), client side and server side."""

from __future__ import annotations

import hashlib
import itertools
import secrets
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from fedsynth.secagg.errors import SecAggError
from fedsynth.secagg.graph import neighbours
from fedsynth.secagg.keys import KEY_BYTES, NONCE_BYTES, TAG_BYTES, KeyPair, agree, new_key_pair, open_sealed, seal
from fedsynth.secagg.keystream import expand
from fedsynth.secagg.shamir import SHARE_BYTES, combine, split

ID_BYTES = 8
MAX_SHARE_SETS = 256  # sets of `threshold` shares tried per secret before it is declared lost
BOX_BYTES = NONCE_BYTES + 2 * ID_BYTES + 2 * SHARE_BYTES + TAG_BYTES


@dataclass(frozen=True)
class AdvertisedKeys:
    """A client's public keys: `encryption` (the paper's c) seals the shares sent to it, `masking` (s) agrees its
    pairwise masks."""

    encryption: bytes
    masking: bytes


@dataclass(frozen=True)
class ClientKeys:
    encryption: KeyPair
    masking: KeyPair

    def public(self) -> AdvertisedKeys:
        return AdvertisedKeys(self.encryption.public, self.masking.public)


@dataclass
class ClientState:
    """What a client keeps from stage 2 on, never sent anywhere. The two flags enforce that a client masks one input
    and answers one unmask request per round: a second answer could reveal both secrets of one neighbour."""

    own_id: int
    keys: ClientKeys
    neighbour_keys: dict[int, AdvertisedKeys]
    threshold: int
    context: bytes
    self_mask_seed: bytes
    masked: bool = False
    unmasked: bool = False


@dataclass(frozen=True)
class UnmaskReply:
    """A surviving client's stage-4 answer: its shares of survivors' self-mask seeds and of dropped clients' masking
    private keys, by the id of the client each secret belongs to."""

    holder: int
    self_mask_shares: dict[int, bytes]
    mask_key_shares: dict[int, bytes]


def _ids(first: int, second: int) -> bytes:
    return first.to_bytes(ID_BYTES, "big") + second.to_bytes(ID_BYTES, "big")


def _pair_key(private: X25519PrivateKey, peer_public: bytes, label: bytes, context: bytes, a: int, b: int) -> bytes:
    # The 4-byte label and the 16 bytes of ids lead, so that no two (label, pair, context) give the same info.
    return agree(private, peer_public, context=label + _ids(min(a, b), max(a, b)) + context)


def _check_threshold(threshold: int, holders: int, whose: str) -> None:
    # Shares go to `holders` neighbours; a threshold above half of them means no two disjoint groups can each
    # rebuild one of a client's two secrets, whatever survivor lists a dishonest server shows them.
    if not holders / 2 < threshold <= holders:
        raise SecAggError(f"{whose}: threshold {threshold} must exceed half of its {holders} share holders and not exceed them")


def seed_commitment(seed: bytes, context: bytes) -> bytes:
    """SHA-256 of a self-mask seed, sent at stage 2: the server can tell a seed rebuilt from honest shares from one
    rebuilt with a lying holder's share, and try another set of shares (a hostile holder costs itself, not the round)."""
    return hashlib.sha256(b"fedsynth-secagg-seed" + context + seed).digest()


def advertise(rng_bytes: Callable[[int], bytes] | None = None) -> ClientKeys:
    """Stage 1: a client's two fresh key pairs; their public halves (`.public()`) go to the server."""
    return ClientKeys(new_key_pair(rng_bytes), new_key_pair(rng_bytes))


def share_keys(
    own_id: int,
    keys: ClientKeys,
    neighbour_keys: Mapping[int, AdvertisedKeys],
    *,
    threshold: int,
    context: bytes,
    rng_bytes: Callable[[int], bytes] = secrets.token_bytes,
) -> tuple[ClientState, dict[int, bytes]]:
    """Stage 2: draw the self-mask seed, Shamir-split it and the masking private key among the neighbours whose keys
    the server forwarded, and seal each neighbour's two shares to it. Returns the state to keep and the sealed boxes
    by recipient; `context` binds the run and round and must be the same for every client."""
    if own_id in neighbour_keys:
        raise SecAggError(f"client {own_id} is listed among its own neighbours")
    _check_threshold(threshold, len(neighbour_keys), f"client {own_id}")
    seed = rng_bytes(KEY_BYTES)
    holders = sorted(neighbour_keys)
    seed_shares = split(seed, threshold=threshold, holders=holders, rng_bytes=rng_bytes)
    key_shares = split(keys.masking.private.private_bytes_raw(), threshold=threshold, holders=holders, rng_bytes=rng_bytes)
    boxes = {}
    for v in holders:
        key = _pair_key(keys.encryption.private, neighbour_keys[v].encryption, b"seal", context, own_id, v)
        plaintext = _ids(own_id, v) + seed_shares[v] + key_shares[v]
        boxes[v] = seal(key, plaintext, associated=context + _ids(own_id, v), rng_bytes=rng_bytes)
    state = ClientState(own_id, keys, dict(neighbour_keys), threshold, context, seed)
    return state, boxes


def _open_received(state: ClientState, received: Mapping[int, bytes]) -> dict[int, tuple[bytes, bytes]]:
    """Each sender's (share of its self-mask seed, share of its masking key) held by this client."""
    own, opened = state.own_id, {}
    for sender, box in received.items():
        if sender not in state.neighbour_keys:
            raise SecAggError(f"client {own} got a sealed box from client {sender}, which is not its neighbour")
        key = _pair_key(state.keys.encryption.private, state.neighbour_keys[sender].encryption, b"seal", state.context, sender, own)
        try:
            plaintext = open_sealed(key, box, associated=state.context + _ids(sender, own))
        except SecAggError as error:
            raise SecAggError(f"box from client {sender} to client {own}: {error}") from None
        if len(plaintext) != 2 * ID_BYTES + 2 * SHARE_BYTES or plaintext[: 2 * ID_BYTES] != _ids(sender, own):
            named = int.from_bytes(plaintext[ID_BYTES : 2 * ID_BYTES], "big") if len(plaintext) >= 2 * ID_BYTES else None
            raise SecAggError(f"box from client {sender} to client {own} holds shares for holder {named}, not {own}")
        opened[sender] = (plaintext[2 * ID_BYTES : 2 * ID_BYTES + SHARE_BYTES], plaintext[2 * ID_BYTES + SHARE_BYTES :])
    return opened


def masked_input(state: ClientState, encoded: np.ndarray, received: Mapping[int, bytes]) -> np.ndarray:
    """Stage 3: y = encoded + expand(b_u) + sum over the neighbours v that sent this client a sealed box of
    (+expand(s_uv) if u < v else -expand(s_uv)), modulo 2**32. Every box is opened first: only a neighbour that really
    shared its keys is masked with, and the server can only cancel such a mask."""
    own = state.own_id
    if state.masked:
        raise SecAggError(f"client {own} already masked an input this round (two would reveal their difference)")
    if not isinstance(encoded, np.ndarray) or encoded.dtype != np.uint32 or encoded.ndim != 1:
        raise SecAggError(f"client {own}'s encoded input must be a 1-D uint32 array, not {getattr(encoded, 'dtype', type(encoded))}")
    if len(received) < state.threshold:
        raise SecAggError(f"client {own} received shares from {len(received)} neighbours, {state.threshold} needed")
    _open_received(state, received)
    count = len(encoded)
    masked = encoded + expand(state.self_mask_seed, count)
    for v in sorted(received):
        seed = _pair_key(state.keys.masking.private, state.neighbour_keys[v].masking, b"mask", state.context, own, v)
        if own < v:
            masked += expand(seed, count)
        else:
            masked -= expand(seed, count)
    state.masked = True
    return masked


def unmask_shares(
    state: ClientState, received: Mapping[int, bytes], *, survivors: Collection[int], dropped: Collection[int]
) -> UnmaskReply:
    """Stage 4: for each neighbour that survived, this client's share of its self-mask seed; for each that dropped,
    its share of the masking private key. A client named in both lists is refused: both would reveal its input."""
    own, survivors, dropped = state.own_id, set(survivors), set(dropped)
    if both := sorted(survivors & dropped):
        raise SecAggError(f"client(s) {both} named both surviving and dropped: client {own} refuses to unmask")
    if own in dropped:
        raise SecAggError(f"client {own} is itself named dropped")
    if len(survivors) < state.threshold:
        raise SecAggError(f"{len(survivors)} survivors, {state.threshold} needed")
    if state.unmasked:
        raise SecAggError(f"client {own} already answered an unmask request this round")
    opened = _open_received(state, received)
    state.unmasked = True
    return UnmaskReply(
        own,
        {v: opened[v][0] for v in sorted(survivors & opened.keys())},
        {v: opened[v][1] for v in sorted(dropped & opened.keys())},
    )


class ServerRound:
    """The coordinator's side of one round. Stages run in order; the first call that hands something to clients
    (keys_for, sealed_for, unmask_request) closes the stage before it, so that every client masks with exactly the
    neighbours the server later accounts for."""

    def __init__(self, clients: Sequence[int], *, degree: int, threshold: int, graph_seed: bytes, context: bytes, length: int) -> None:
        self.neighbours = neighbours(clients, degree, graph_seed)
        for client, adjacent in self.neighbours.items():
            _check_threshold(threshold, len(adjacent), f"client {client}")
        self.threshold, self.context, self.length = threshold, context, length
        self.public_keys: dict[int, AdvertisedKeys] = {}
        self.sealed: dict[int, dict[int, bytes]] = {}  # sender -> recipient -> box
        self.masked: dict[int, np.ndarray] = {}
        self.commitments: dict[int, bytes] = {}
        self.stage = 1

    def _open_stage(self, stage: int, client: int, what: str) -> None:
        if client not in self.neighbours:
            raise SecAggError(f"client {client} is not sampled in this round")
        if self.stage > stage:
            raise SecAggError(f"client {client}'s {what} arrived after that stage closed")

    def add_public_keys(self, client: int, keys: AdvertisedKeys) -> None:
        self._open_stage(1, client, "public keys")
        for field in ("encryption", "masking"):
            if len(getattr(keys, field)) != KEY_BYTES:
                raise SecAggError(f"client {client}'s {field} public key is {len(getattr(keys, field))} bytes, not {KEY_BYTES}")
        if keys.encryption == keys.masking:
            raise SecAggError(f"client {client} advertised the same key for encryption and masking")
        self.public_keys[client] = keys

    def keys_for(self, client: int) -> dict[int, AdvertisedKeys]:
        """The public keys of `client`'s neighbours that advertised."""
        self.stage = max(self.stage, 2)
        return {v: self.public_keys[v] for v in self.neighbours[client] if v in self.public_keys}

    def add_sealed(self, sender: int, boxes: Mapping[int, bytes], commitment: bytes = b"") -> None:
        """A client's sealed shares by recipient, and its `seed_commitment` (empty: its seed is taken unchecked)."""
        self._open_stage(2, sender, "sealed shares")
        if commitment and len(commitment) != 32:
            raise SecAggError(f"client {sender}'s seed commitment is {len(commitment)} bytes, not 32")
        if sender not in self.public_keys:
            raise SecAggError(f"client {sender} sent sealed shares without having advertised keys")
        expected = {v for v in self.neighbours[sender] if v in self.public_keys}
        if set(boxes) != expected:
            raise SecAggError(f"client {sender} sealed shares for {sorted(boxes)}, not for its neighbours {sorted(expected)}")
        if wrong := sorted(v for v, box in boxes.items() if len(box) != BOX_BYTES):
            raise SecAggError(f"client {sender}'s sealed boxes for {wrong} are not {BOX_BYTES} bytes")
        self.sealed[sender] = dict(boxes)
        self.commitments[sender] = bytes(commitment)

    def sealed_for(self, recipient: int) -> dict[int, bytes]:
        """The boxes addressed to `recipient`, by sender."""
        self.stage = max(self.stage, 3)
        return {sender: boxes[recipient] for sender, boxes in self.sealed.items() if recipient in boxes}

    def add_masked_input(self, client: int, masked: np.ndarray) -> None:
        self._open_stage(3, client, "masked input")
        if client not in self.sealed:
            raise SecAggError(f"client {client} sent a masked input without having shared its keys")
        if not isinstance(masked, np.ndarray) or masked.dtype != np.uint32 or masked.shape != (self.length,):
            got = f"{getattr(masked, 'dtype', type(masked))} of shape {getattr(masked, 'shape', None)}"
            raise SecAggError(f"client {client}'s masked input is {got}, not uint32 of shape ({self.length},)")
        self.masked[client] = masked.copy()

    def unmask_request(self) -> tuple[frozenset[int], frozenset[int]]:
        """(survivors, dropped) to send to the survivors: those whose masked input arrived, and those that shared keys
        but whose masked input did not. Refused when some needed secret has fewer than threshold surviving holders."""
        self.stage = 4
        survivors = frozenset(self.masked)
        dropped = frozenset(self.sealed) - survivors
        for client in sorted(survivors | dropped):
            holders = len(survivors & self.sealed[client].keys())
            if holders < self.threshold:
                raise SecAggError(f"client {client} has {holders} surviving neighbours holding its shares, {self.threshold} needed")
        return survivors, dropped

    def unmask(self, replies: Mapping[int, UnmaskReply]) -> np.ndarray:
        """The exact uint32 sum of the survivors' encoded inputs, from the survivors' stage-4 replies by holder."""
        survivors, dropped = self.unmask_request()
        seed_shares: dict[int, dict[int, bytes]] = {c: {} for c in survivors}
        key_shares: dict[int, dict[int, bytes]] = {c: {} for c in dropped}
        for holder, reply in replies.items():
            if reply.holder != holder or holder not in survivors:
                raise SecAggError(f"unmask reply from client {holder} (claiming holder {reply.holder}) is not from a survivor")
            for owners, shares, sent, what in (
                (survivors, seed_shares, reply.self_mask_shares, "self-mask seed"),
                (dropped, key_shares, reply.mask_key_shares, "mask key"),
            ):
                for owner, share in sent.items():
                    if owner not in owners or holder not in self.sealed[owner]:
                        raise SecAggError(f"client {holder} sent a share of client {owner}'s {what}, which it does not hold")
                    shares[owner][holder] = share
        total = np.zeros(self.length, dtype=np.uint32)
        for client in sorted(survivors):
            total += self.masked[client]
        for client in sorted(survivors):
            commitment = self.commitments.get(client, b"")
            seed = self._recover(seed_shares[client], client, "self-mask seed",
                                 lambda secret, c=commitment: not c or seed_commitment(secret, self.context) == c)
            total -= expand(seed, self.length)
        for gone in sorted(dropped):
            public = self.public_keys[gone].masking
            private = X25519PrivateKey.from_private_bytes(self._recover(
                key_shares[gone], gone, "mask key",
                lambda secret, p=public: X25519PrivateKey.from_private_bytes(secret).public_key().public_bytes_raw() == p))
            for survivor in sorted(survivors & self.sealed[gone].keys()):
                seed = _pair_key(private, self.public_keys[survivor].masking, b"mask", self.context, gone, survivor)
                # The survivor added +mask when its id is the smaller one, -mask otherwise: undo that.
                if survivor < gone:
                    total -= expand(seed, self.length)
                else:
                    total += expand(seed, self.length)
        return total

    def _recover(self, shares: dict[int, bytes], owner: int, what: str, check: Callable[[bytes], bool]) -> bytes:
        """The secret from `threshold` of the shares that `check` accepts: the first set in holder order, else the next
        ones (at most MAX_SHARE_SETS), so that a holder who sent a wrong share is outvoted by the honest majority."""
        if len(shares) < self.threshold:
            raise SecAggError(f"client {owner}'s {what}: {len(shares)} shares of {self.threshold} needed")
        for holders in itertools.islice(itertools.combinations(sorted(shares), self.threshold), MAX_SHARE_SETS):
            try:
                secret = combine({h: shares[h] for h in holders}, threshold=self.threshold)
            except SecAggError:
                continue
            if check(secret):
                return secret
        raise SecAggError(f"client {owner}'s {what}: no {self.threshold} of the {len(shares)} shares from holders "
                          f"{sorted(shares)} rebuild it (some holders sent wrong shares)")
