"""One secure round on the coordinator: the SecAgg+ stages as barriers with deadlines (each stage closes when every
client it waits for answered, or runtime.secagg_stage_timeout_s after it opened), the masked updates, the unmasking,
and the new global model from the exact sum. It stands in the round for the aggregator (count, finish)."""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

import numpy as np
import torch

from fedsynth.algorithms.user_dp import UserLevelDp
from fedsynth.errors import QuorumError
from fedsynth.secagg.errors import SecAggError
from fedsynth.secagg.model_vector import float_keys, vector_length
from fedsynth.secagg.protocol import AdvertisedKeys, ServerRound, UnmaskReply
from fedsynth.secagg.quantize import QuantRange, decode_sum

StateDict = dict[str, torch.Tensor]


def neighbour_count(sampled: int, configured: int) -> int:
    """Each client's neighbours: all the others (0), else the configured even degree (at most all the others)."""
    return sampled - 1 if configured == 0 else min(configured, sampled - 1)


class SecureRound:
    """The round's SecAgg+ server side. Stage calls come from gRPC threads, `add_masked` from the fold thread, `finish`
    from the round loop; all under `lock` (the federation's condition), whose waits release it."""

    def __init__(self, global_state: StateDict, *, sampled: Collection[int], weights: dict[int, int], lock: threading.Condition,
                 context: bytes, neighbours: int, threshold: int, clip: float, stage_timeout_s: float, round_timeout_s: float,
                 dp: UserLevelDp | None, missed: Callable[[int, str], None], algorithm: Any = None,
                 server_state: StateDict | None = None, extra_layout: dict[str, tuple[tuple[int, ...], Any]] | None = None) -> None:
        self._global = global_state
        self._algorithm = algorithm  # its own aggregator turns the unmasked sums into the new model and server state
        self._server_state = dict(server_state or {})
        self._extra_shapes = {key: tuple(shape) for key, (shape, _) in sorted((extra_layout or {}).items())}
        holders = neighbour_count(len(sampled), neighbours)
        degree = holders + holders % 2  # the ring's even degree; neighbours() caps it at all the others
        self.threshold = threshold or holders // 2 + 1
        self.server = ServerRound(sorted(sampled), degree=degree, threshold=self.threshold,
                                  graph_seed=hashlib.sha256(b"graph" + context).digest(), context=context,
                                  length=vector_length(global_state, {k: math.prod(v) for k, v in self._extra_shapes.items()}))
        self.weights = {client: 1 for client in sampled} if dp is not None else dict(weights)
        self.quant = QuantRange(clip, total_weight=sum(self.weights.values()))
        self.counted = QuantRange(clip, total_weight=len(self.weights))  # extras: each client's counts once
        self.dp = dp
        self._lock = lock
        self._timeout = stage_timeout_s
        self._missed = missed  # tells the round a client can no longer answer it (it stops waiting for that client)
        self._opened = time.monotonic()  # when the open stage began
        self._closes_by = self._opened + round_timeout_s  # the round's deadline: the survivors are known by then
        self._stage = 1
        self._gone: set[int] = set()
        self._short: dict[int, str] = {}  # clients left out after stage 1: too few neighbours to hold their shares
        self._survivors: tuple[frozenset[int], frozenset[int]] | None = None
        self._replies: dict[int, UnmaskReply] = {}
        self.count = 0  # masked updates taken
        self.unmask_s = 0.0  # the coordinator's stage-4 time: waiting for shares, rebuilding masks, removing them

    # ---- stages 1 and 2: called from gRPC threads -----------------------------------------------------------

    def advertise(self, client: int, keys: AdvertisedKeys) -> tuple[dict[int, AdvertisedKeys], int, int]:
        """Stage 1: (the neighbours' public keys, this client's weight, the total weight), once the stage closes."""
        with self._lock:
            self._require_stage(1, client, "public keys")
            self.server.add_public_keys(client, keys)
            self._lock.notify_all()
            self._await(1, lambda: set(self.weights) - self._gone - set(self.server.public_keys))
            if client in self._short:
                raise SecAggError(self._short[client])
            return self.server.keys_for(client), self.weights[client], self.quant.total_weight

    def share(self, client: int, boxes: dict[int, bytes], commitment: bytes) -> dict[int, bytes]:
        """Stage 2: the boxes sealed to this client, once every client that advertised shared (or the stage closed)."""
        with self._lock:
            self._require_stage(2, client, "sealed shares")
            if len(commitment) != 32:
                raise SecAggError(f"client {client}'s seed commitment is {len(commitment)} bytes, not 32")
            self.server.add_sealed(client, boxes, commitment)
            self._lock.notify_all()
            self._await(2, lambda: set(self.server.public_keys) - self._gone - set(self.server.sealed))
            if client in self._short:
                raise SecAggError(self._short[client])
            return self.server.sealed_for(client)

    def _require_stage(self, stage: int, client: int, what: str) -> None:
        if self._stage != stage:
            raise SecAggError(f"client {client}'s {what} arrived in stage {self._stage}; they belong to stage {stage}")

    def _await(self, stage: int, waiting_for: Callable[[], set[int]]) -> None:
        """Until the stage closes: every client it waits for answered, or its deadline passed. The first caller to
        see either closes it; the clients that missed it are told to the round, which stops waiting for them."""
        deadline = self._opened + self._timeout
        while self._stage == stage and waiting_for() and time.monotonic() < deadline:
            self._lock.wait(max(0.0, min(1.0, deadline - time.monotonic())))
        if self._stage == stage:
            late = sorted(waiting_for())
            self._stage, self._opened = stage + 1, time.monotonic()
            for missing in late:
                self._missed(missing, f"missed secure aggregation's stage {stage} (runtime.secagg_stage_timeout_s)")
            self._drop_short_of_neighbours(stage)
            self._lock.notify_all()

    def _drop_short_of_neighbours(self, stage: int) -> None:
        """After stage 1 (2): a client with fewer neighbours that advertised (sealed it shares) than the threshold
        cannot share its secrets (mask its input): it leaves the round now, and the round stops waiting for it,
        instead of at its deadline."""
        took_part = set(self.server.public_keys if stage == 1 else self.server.sealed)
        for client in sorted(took_part - set(self._short)):
            count = len(took_part & set(self.server.neighbours[client]))
            if count < self.threshold:
                self._short[client] = (f"client {client}: only {count} of its neighbours took part in secure aggregation's "
                                       f"stage {stage}, fewer than the threshold {self.threshold}")
                self._gone.add(client)
                self._missed(client, self._short[client])

    def forget(self, clients: Collection[int]) -> None:
        """Clients gone (released, refused): no stage waits for them. Under the lock."""
        self._gone |= set(clients)
        self._lock.notify_all()

    # ---- stage 3: the fold thread -------------------------------------------------------------------------

    def add_masked(self, client: int, masked: torch.Tensor) -> None:
        with self._lock:
            if self._stage != 3:
                raise SecAggError(f"client {client}'s masked update arrived in stage {self._stage}; it belongs to stage 3")
            self.server.add_masked_input(client, masked.numpy().view(np.uint32))
            self.count += 1

    # ---- stage 4 ---------------------------------------------------------------------------------------------

    def unmask_request(self, client: int) -> tuple[frozenset[int], frozenset[int]]:
        """Stage 4, a survivor asks: (survivors, dropped), once the round closed (`finish` set them)."""
        with self._lock:
            deadline = max(time.monotonic(), self._closes_by) + self._timeout
            while self._survivors is None and self._stage <= 4 and time.monotonic() < deadline:
                self._lock.wait(max(0.0, min(1.0, deadline - time.monotonic())))
            if self._survivors is None:
                raise SecAggError(f"client {client} asked who survived, and the round has not closed for unmasking")
            if client not in self._survivors[0]:
                raise SecAggError(f"client {client}'s masked update was not taken this round: it has nothing to unmask")
            return self._survivors

    def add_shares(self, client: int, self_mask: dict[int, bytes], mask_key: dict[int, bytes]) -> None:
        with self._lock:
            if self._survivors is None or self._stage != 4:
                raise SecAggError(f"client {client}'s unmask shares arrived in stage {self._stage}; they belong to stage 4")
            if client not in self._survivors[0] or client in self._replies:
                raise SecAggError(f"client {client} may not send unmask shares now (not a survivor, or sent already)")
            self._replies[client] = UnmaskReply(client, dict(self_mask), dict(mask_key))
            self._lock.notify_all()

    def finish(self) -> tuple[StateDict, StateDict]:
        """After the round closed: ask the survivors for their shares, remove the masks, and the new global state from
        the exact sum (QuorumError when too few shares or holders remain: no secret can be rebuilt)."""
        started = time.monotonic()
        with self._lock:
            self._stage, self._opened = 4, time.monotonic()
            try:
                self._survivors = self.server.unmask_request()
            except SecAggError as exc:
                self._stage = 5
                self._lock.notify_all()
                raise QuorumError(f"secure aggregation cannot unmask: {exc}") from None
            self._lock.notify_all()
            survivors = self._survivors[0]
            deadline = self._opened + self._timeout
            while set(survivors) - set(self._replies) - self._gone and time.monotonic() < deadline:
                self._lock.wait(max(0.0, min(1.0, deadline - time.monotonic())))
            self._stage = 5
            replies = dict(self._replies)
        try:
            total = self.server.unmask(replies)
        except SecAggError as exc:
            raise QuorumError(f"secure aggregation cannot unmask: {exc}") from None
        result = self._aggregate(total)
        self.unmask_s = time.monotonic() - started
        return result

    def _aggregate(self, total: np.ndarray) -> tuple[StateDict, StateDict]:
        """The new global state and server state from the exact sum: [weighted moves | summed extras | weight]."""
        moves = len(total) - 1 - sum(math.prod(shape) for shape in self._extra_shapes.values())
        if self.dp is not None:  # DP-FedAvg: the sum of the clipped, noised moves over m, fixed (a dropout does not shrink it)
            return self._moved(decode_sum(total[:moves], self.quant) / self.dp.clients_per_round), self._server_state
        weight = int(total[-1])  # the survivors' N_k, summed in the masked vector too: the exact divisor
        move = decode_sum(total[:moves], self.quant) / weight
        extras, start = {}, 0
        summed = decode_sum(total[moves:-1], self.counted)
        for key, shape in self._extra_shapes.items():
            extras[key] = torch.from_numpy(summed[start : start + math.prod(shape)]).view(shape)
            start += math.prod(shape)
        if self._algorithm is None:
            return self._moved(move), self._server_state
        # The algorithm's own aggregator, given the round's mean as one update of weight 1 and the summed extras:
        # FedAvg's mean as it is, SCAFFOLD's server step size and c += sum(delta c) / K
        aggregator = self._algorithm.new_aggregator(self._global, self._server_state)
        aggregator.add(self._moved(move), extras, 1.0)
        return aggregator.finish()  # type: ignore[no-any-return]

    def _moved(self, move: np.ndarray) -> StateDict:
        """The global state moved by `move` (its floating-point tensors by name); integer buffers keep their values."""
        new_global = {key: value.clone() for key, value in self._global.items() if not value.is_floating_point()}
        start = 0
        for key in float_keys(self._global):
            value = self._global[key]
            part = torch.from_numpy(move[start : start + value.numel()]).view(value.shape)
            new_global[key] = (value.to(torch.float64) + part).to(value.dtype)
            start += value.numel()
        return {key: new_global[key] for key in self._global}

    def summary(self) -> dict[str, Any]:
        survivors, dropped = self._survivors or (frozenset(), frozenset())
        return {"survivors": sorted(survivors), "dropped": sorted(dropped), "threshold": self.threshold,
                "unmask_s": self.unmask_s}
