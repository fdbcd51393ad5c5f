"""A client's side of a secure round (runtime.secure_aggregation): SecAgg+'s two key stages before it trains, its
update masked after, and its unmasking shares once the round closed (fedsynth.secagg holds the cryptography)."""

from __future__ import annotations

import logging
import math
import secrets
from dataclasses import dataclass

import numpy as np
import torch

from fedsynth.algorithms.user_dp import UserLevelDp
from fedsynth.secagg.model_vector import MASKED_KEY, flat_extra, flat_move, round_context
from fedsynth.secagg.protocol import (AdvertisedKeys, ClientState, advertise, masked_input, seed_commitment, share_keys,
                                      unmask_shares)
from fedsynth.secagg.quantize import QuantRange, encode, with_weight
from fedsynth.v1 import coordinator_pb2 as pb
from fedsynth.v1 import coordinator_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


@dataclass
class SecureRoundClient:
    """What a client keeps through one secure round: its SecAgg+ state, the boxes sealed to it, its weight and range."""

    stub: pb_grpc.CoordinatorStub
    ids: dict[str, object]  # client_id, session, round, task_id: every stage message carries them
    state: ClientState
    received: dict[int, bytes]
    weight: int
    quant: QuantRange
    clients: int  # the round's sampled clients: the range of a sum of values each client adds once

    def call(self, timeout_s: float, **stage: object) -> pb.SecAggReply:
        return self.stub.SecureAggregation(pb.SecAggRequest(**self.ids, **stage), timeout=timeout_s)  # type: ignore[arg-type]


def join_secure_round(stub: pb_grpc.CoordinatorStub, *, client_id: int, session: str, task: pb.Task, run_id: str,
                      clip: float, timeout_s: float) -> SecureRoundClient:
    """Stages 1 and 2: advertise fresh keys, seal Shamir shares of the self-mask seed and the masking key to the
    neighbours the coordinator names; each call returns once its stage closed (at most `timeout_s`)."""
    ids: dict[str, object] = {"client_id": client_id, "session": session, "round": task.round, "task_id": task.task_id}
    keys = advertise()
    public = keys.public()
    first = stub.SecureAggregation(pb.SecAggRequest(**ids, keys=pb.SecAggKeys(encryption=public.encryption, masking=public.masking)),  # type: ignore[arg-type]
                                   timeout=timeout_s)
    neighbours = {v: AdvertisedKeys(k.encryption, k.masking) for v, k in first.neighbour_keys.items()}
    context = round_context(run_id, task.round, task.task_id)
    state, boxes = share_keys(client_id, keys, neighbours, threshold=first.threshold, context=context)
    commitment = seed_commitment(state.self_mask_seed, context)
    second = stub.SecureAggregation(pb.SecAggRequest(**ids, boxes=pb.SecAggBoxes(boxes=boxes, seed_commitment=commitment)),  # type: ignore[arg-type]
                                    timeout=timeout_s)
    return SecureRoundClient(stub, ids, state, dict(second.boxes.boxes), int(first.weight),
                             QuantRange(clip, total_weight=int(first.total_weight)), int(first.clients))


def masked_update(secure: SecureRoundClient, new_state: dict[str, torch.Tensor], global_state: dict[str, torch.Tensor],
                  dp: UserLevelDp | None, extra: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Stage 3: the move (clipped to S under DP, with this client's share of the noise, N(0, (sigma*S)^2 / m) per
    element, from a CSPRNG seed the coordinator never sees), quantised, weighted, then the extra tensors (SCAFFOLD's
    delta c, weight 1: the server sums them), then the weight, masked: the update's one tensor."""
    move = flat_move(new_state, global_state)
    if not np.isfinite(move).all():  # local training diverged: no move, rather than no masked update (a dropout)
        log.warning("client %s: its update is not finite; it sends no move this round", secure.ids["client_id"])
        move = np.zeros_like(move)
    if dp is not None:
        generator = torch.Generator().manual_seed(secrets.randbits(63))
        std = dp.noise_multiplier * dp.clip / math.sqrt(dp.clients_per_round)
        move = move + torch.randn(len(move), generator=generator, dtype=torch.float64).numpy() * std
    extras = flat_extra(extra or {})
    if not np.isfinite(extras).all():
        extras = np.zeros_like(extras)
    counted = QuantRange(secure.quant.clip, total_weight=secure.clients)  # each client's extras count once
    vector = with_weight(np.concatenate([encode(move, secure.weight, secure.quant), encode(extras, 1, counted)]), secure.weight)
    masked = masked_input(secure.state, vector, secure.received)
    return {MASKED_KEY: torch.from_numpy(masked.view(np.int32))}


def unmask(secure: SecureRoundClient, timeout_s: float) -> None:
    """Stage 4: once the round closed, this client's shares of the survivors' self-mask seeds and of the dropped
    clients' masking keys (never both of one client)."""
    reply = secure.call(timeout_s, unmask_wait=pb.SecAggUnmaskWait())
    shares = unmask_shares(secure.state, secure.received, survivors=reply.survivors, dropped=reply.dropped)
    secure.call(timeout_s, shares=pb.SecAggShares(self_mask=shares.self_mask_shares, mask_key=shares.mask_key_shares))
