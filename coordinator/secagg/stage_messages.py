"""SecureAggregation's messages to and from the plain stage calls of the open round's SecureRound: a refused stage
message costs its client the round (the round stops waiting for it), never the run."""

from __future__ import annotations

from coordinator.federation import Federation
from fedsynth.secagg.errors import SecAggError
from fedsynth.secagg.protocol import AdvertisedKeys
from fedsynth.v1 import coordinator_pb2 as pb


def answer_stage(federation: Federation, request: pb.SecAggRequest) -> pb.SecAggReply:
    """Run one stage message; the reply once its stage closes. StateError (FAILED_PRECONDITION) for a message with no
    open secure round to belong to, SecAggError (INVALID_ARGUMENT) for one the round refuses."""
    client = request.client_id
    rnd, secure = federation.secure_stage(client, request.session, request.round, request.task_id)
    stage = request.WhichOneof("stage")
    try:
        if stage == "keys":
            keys, weight, total = secure.advertise(client, AdvertisedKeys(request.keys.encryption, request.keys.masking))
            return pb.SecAggReply(
                neighbour_keys={v: pb.SecAggKeys(encryption=k.encryption, masking=k.masking) for v, k in keys.items()},
                threshold=secure.threshold, weight=weight, total_weight=total, clients=len(secure.weights))
        if stage == "boxes":
            boxes = secure.share(client, dict(request.boxes.boxes), request.boxes.seed_commitment)
            return pb.SecAggReply(boxes=pb.SecAggBoxes(boxes=boxes))
        if stage == "unmask_wait":
            survivors, dropped = secure.unmask_request(client)
            return pb.SecAggReply(survivors=sorted(survivors), dropped=sorted(dropped))
        if stage == "shares":
            secure.add_shares(client, dict(request.shares.self_mask), dict(request.shares.mask_key))
            return pb.SecAggReply()
        raise SecAggError(f"client {client}'s secure aggregation message names no stage")
    except SecAggError as exc:
        federation.secure_refusal(rnd, client, str(exc))
        raise
