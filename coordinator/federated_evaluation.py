"""Federated evaluation on the coordinator: sample the clients that test a closed round's model, push it to them, collect
their counts and summarize them (fedsynth.learning.evaluation.summarize_round)."""

from __future__ import annotations

import logging
import math
import queue
import secrets
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from coordinator.dispatch import TaskDelivery
from coordinator.registry import ClientRegistry
from fedsynth.config import RunConfig
from fedsynth.errors import StateError, WireError
from fedsynth.learning.evaluation import EvaluationCounts, summarize_round
from fedsynth.wire import codec
from fedsynth.wire.tensor_buffer import encode_to_buffer
from fedsynth.wire.transfer import PreparedPayload, prepare

log = logging.getLogger(__name__)
SAMPLING_STREAM = zlib.crc32(b"federated-evaluation")  # the evaluators' draw never touches the training sampler's RNG


@dataclass
class EvaluationRound:
    number: int
    task_id: str
    sampled: list[int]
    asked: set[int]  # the sampled clients that had a dispatch stream (or rejoined while it was open)
    payload: PreparedPayload
    deadline: float
    counts: dict[int, EvaluationCounts] = field(default_factory=dict)
    bytes_sent: int = 0  # the model, once per evaluation task queued (a rejoining evaluator's again)
    refused: set[int] = field(default_factory=set)  # evaluators whose counts broke a bound: left out, not waited for

    @property
    def pending(self) -> set[int]:
        return self.asked - self.counts.keys() - self.refused


class FederatedEvaluator:
    """Every method takes the federation's lock itself (the registry's reentrant Condition)."""

    def __init__(self, cfg: RunConfig, lock: threading.Condition, registry: ClientRegistry) -> None:
        self.cfg = cfg
        self.lock = lock
        self.registry = registry
        self._open: dict[int, EvaluationRound] = {}

    def due(self, number: int) -> bool:
        """The clients test round `number`'s model: every train.eval_every-th round and the last one."""
        train = self.cfg.train
        return train.evaluation != "server" and (number % train.eval_every == 0 or number == train.rounds)

    def sample(self, number: int) -> list[int]:
        """round(fraction_evaluate * K) clients (at least one), drawn from the run seed and the round alone."""
        k = self.cfg.data.clients
        m = max(1, round(self.cfg.train.fraction_evaluate * k))
        rng = np.random.default_rng([self.cfg.seed, number, SAMPLING_STREAM])
        return sorted(int(c) for c in rng.choice(k, size=m, replace=False))

    def start(self, number: int, global_state: dict[str, torch.Tensor]) -> EvaluationRound:
        """Push round `number`'s model to its evaluators (only the model: nothing the algorithm keeps on the side)."""
        payload = prepare(encode_to_buffer(codec.join_prefixed(model=global_state)))
        sampled = self.sample(number)
        with self.lock:
            asked = {c for c in sampled if self.registry.is_connected(c)}
            evaluation = EvaluationRound(number, secrets.token_hex(8), sampled, asked, payload,
                                         time.monotonic() + self.cfg.runtime.round_timeout_s)
            self._open[number] = evaluation
            for client_id in sorted(asked):
                self.registry.send(client_id, self._delivery(evaluation))
        log.info("round %d: federated evaluation by %s", number, sorted(asked))
        return evaluation

    def _delivery(self, evaluation: EvaluationRound) -> TaskDelivery:
        evaluation.bytes_sent += evaluation.payload.meta.total_bytes
        remaining = max(1.0, evaluation.deadline - time.monotonic())
        return TaskDelivery(evaluation.task_id, evaluation.number, remaining, [], evaluation.payload, evaluate=True)

    def redeliver(self, client_id: int, outbox: queue.Queue[Any]) -> None:
        """A sampled evaluator that opens a new dispatch stream gets its evaluation task again (the caller holds the lock)."""
        for evaluation in self._open.values():
            if client_id in evaluation.sampled and client_id not in evaluation.counts:
                evaluation.asked.add(client_id)
                outbox.put(self._delivery(evaluation))

    def accept(self, client_id: int, session: str, number: int, task_id: str, counts: EvaluationCounts) -> None:
        """One evaluator's counts for an open evaluation task."""
        if len(counts.class_total) != self.registry.num_classes:
            raise WireError(f"client {client_id} sent {len(counts.class_total)} per-class counts; this run has "
                            f"{self.registry.num_classes} classes")
        with self.lock:
            self.registry.record(client_id, session)
            evaluation = self._open.get(number)
            if evaluation is None or evaluation.task_id != task_id:
                raise StateError(f"evaluation of round {number} (task {task_id[:8]}) is not open")
            if client_id not in evaluation.sampled or client_id in evaluation.counts or client_id in evaluation.refused:
                raise StateError(f"client {client_id} was not sampled to evaluate round {number} or already answered")
            test_samples = self.registry.clients[client_id].test_samples
            if counts.examples > test_samples or not math.isfinite(counts.loss_sum):
                evaluation.refused.add(client_id)
                self.lock.notify_all()
                raise WireError(f"client {client_id}'s evaluation of round {number} counts {counts.examples} examples "
                                f"(loss sum {counts.loss_sum!r}); it registered a test set of {test_samples}: refused")
            evaluation.counts[client_id] = counts
            self.lock.notify_all()
        log.info("round %d: client %d evaluated %d examples, %d correct", number, client_id, counts.examples, counts.correct)

    def collect(self, evaluation: EvaluationRound) -> dict[str, Any]:
        """Wait until every asked evaluator answered, none of those left is reachable, or runtime.round_timeout_s
        passed; then the round's figures from the counts that came."""
        heartbeat_timeout_s = self.cfg.runtime.heartbeat_timeout_s
        with self.lock:
            while evaluation.pending and time.monotonic() < evaluation.deadline:
                if not any(self.registry.is_reachable(c, heartbeat_timeout_s) for c in evaluation.pending):
                    break
                self.lock.wait(timeout=0.25)
            self._open.pop(evaluation.number, None)
            counts = dict(evaluation.counts)
            missing = sorted(evaluation.pending)
        if missing:
            log.warning("round %d: federated evaluation without clients %s (no answer)", evaluation.number, missing)
        return {**summarize_round(evaluation.number, counts, sampled=evaluation.sampled), "bytes_sent": evaluation.bytes_sent}
