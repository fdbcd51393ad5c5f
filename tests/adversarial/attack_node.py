"""TEST ONLY: a real `fedsynth client` process some of whose logical clients send hostile updates.

`python tests/adversarial/attack_node.py --attacks 3=extra-tensor,4=nan <fedsynth client args>` runs the unchanged
client node, except that the update of each listed client is changed on its way to the wire (fedsynth.wire.wire_dtype
.outgoing, wrapped in this process only; each logical client trains on a thread named client-<id>), or its secure
aggregation misbehaves (SECURE_ATTACKS: client_node.node's masked_update and unmask, wrapped likewise). It is no part of
the fedsynth package and nothing there can turn it on: what a buggy plug-in, another release or an attacker would send.
"""

from __future__ import annotations

import os
import sys
import threading

import torch

from fedsynth import cli
from fedsynth.wire import wire_dtype

StateDict = dict[str, torch.Tensor]


def _first_float(state: StateDict) -> str:
    return next(key for key, value in state.items() if value.is_floating_point())


def _move(state: StateDict, global_state: StateDict, factor: float) -> StateDict:
    """The update moved `factor` times as far from the global model (1000: scaled; -1: sign-flipped)."""
    return {key: global_state[key] + factor * (value - global_state[key]) if value.is_floating_point() else value
            for key, value in state.items()}


def _gaussian(state: StateDict, global_state: StateDict) -> StateDict:
    """Random noise of the honest update's norm in place of the update."""
    deltas = {k: v - global_state[k] for k, v in state.items() if v.is_floating_point()}
    norm = torch.sqrt(sum((d.double() ** 2).sum() for d in deltas.values()))
    noise = {k: torch.randn_like(d) for k, d in deltas.items()}
    scale = norm / torch.sqrt(sum((n.double() ** 2).sum() for n in noise.values()))
    return {k: global_state[k] + float(scale) * noise[k] if k in noise else v for k, v in state.items()}


def attacked(attack: str, state: StateDict, extra: StateDict, global_state: StateDict) -> tuple[StateDict, StateDict]:
    """(state, extra) as the attack sends them, before the wire dtype."""
    state, extra = dict(state), dict(extra)
    key = _first_float(state)
    if attack == "extra-tensor":  # one extra finite all-zero float tensor: a node of another release
        extra["junk"] = torch.zeros(1)
    elif attack == "extra-int64":
        extra["junk"] = torch.zeros(1, dtype=torch.int64)
    elif attack == "missing-tensor":
        del state[key]
    elif attack == "wrong-dtype":
        state[key] = state[key].double()
    elif attack == "nan":
        state[key] = state[key].clone()
        state[key].view(-1)[0] = float("nan")
    elif attack == "giant-delta-c":  # SCAFFOLD: every delta c_i an int64 of 2^62
        extra = {name: torch.full(value.shape, 2**62, dtype=torch.int64) for name, value in extra.items()}
    elif attack == "scaled":
        state = _move(state, global_state, 1000.0)
    elif attack == "signflip":
        state = _move(state, global_state, -1.0)
    elif attack == "gaussian":
        state = _gaussian(state, global_state)
    else:
        raise SystemExit(f"unknown attack {attack!r}")
    return state, extra


SECURE_ATTACKS = ("vanish-before-upload", "vanish-before-mask", "vanish-before-unmask", "wrong-shares")


def _attack_of(attacks: dict[int, str]) -> str | None:
    client = threading.current_thread().name.removeprefix("client-")
    return attacks.get(int(client)) if client.isdigit() else None


def _secure_attacks(attacks: dict[int, str]) -> None:
    """Secure aggregation's faults (runtime.secure_aggregation): the process dies after training, before its masked
    update is sent or before it unmasks (a kill between masking and unmasking), or a holder sends wrong shares. The
    process must host only the attacked client: os._exit ends all of it, as a kill would."""
    from client_node import node
    from fedsynth.secagg.protocol import unmask_shares
    from fedsynth.secagg.shamir import PRIME, SHARE_BYTES
    from fedsynth.v1 import coordinator_pb2 as pb

    honest_mask, honest_unmask = node.masked_update, node.unmask

    def masked_update(*args: object, **kwargs: object) -> object:
        if _attack_of(attacks) == "vanish-before-mask":
            os._exit(9)
        return honest_mask(*args, **kwargs)  # type: ignore[arg-type]

    def unmask(secure: object, timeout_s: float) -> None:
        attack = _attack_of(attacks)
        if attack == "vanish-before-unmask":
            os._exit(9)
        if attack != "wrong-shares":
            return honest_unmask(secure, timeout_s)  # type: ignore[arg-type]
        reply = secure.call(timeout_s, unmask_wait=pb.SecAggUnmaskWait())  # type: ignore[attr-defined]
        shares = unmask_shares(secure.state, secure.received, survivors=reply.survivors, dropped=reply.dropped)  # type: ignore[attr-defined]
        wrong = {owner: ((int.from_bytes(share, "big") + 1) % PRIME).to_bytes(SHARE_BYTES, "big")
                 for owner, share in {**shares.self_mask_shares, **shares.mask_key_shares}.items()}
        secure.call(timeout_s, shares=pb.SecAggShares(  # type: ignore[attr-defined]
            self_mask={o: wrong[o] for o in shares.self_mask_shares}, mask_key={o: wrong[o] for o in shares.mask_key_shares}))

    node.masked_update, node.unmask = masked_update, unmask


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "--attacks":
        raise SystemExit("usage: attack_node.py --attacks ID=ATTACK[,ID=ATTACK...] <fedsynth client arguments>")
    attacks = {int(k): v for k, v in (item.split("=", 1) for item in argv[1].split(","))}
    honest = wire_dtype.outgoing

    def outgoing(state: StateDict, extra: StateDict, global_state: StateDict, name: str) -> tuple[StateDict, StateDict]:
        attack = _attack_of(attacks)
        if attack == "vanish-before-upload":
            os._exit(9)
        if attack is not None and attack not in SECURE_ATTACKS:
            state, extra = attacked(attack, state, extra, global_state)
            if attack in ("wrong-dtype", "extra-int64", "giant-delta-c"):  # sent as they are: the wire dtype would fix them
                return state, extra
        return honest(state, extra, global_state, name)

    wire_dtype.outgoing = outgoing
    _secure_attacks(attacks)
    return cli.main(["client", *argv[2:]])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
