"""The federation: registry, dispatch queues, the round loop, streaming aggregation, evaluation, checkpoints.

Plain Python over plain data; the gRPC servicer in servicer.py only translates to and from messages.
"""

from __future__ import annotations

import copy
import logging
import queue
import secrets
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from coordinator import checkpoint
from coordinator.metrics import CoordinatorMetrics
from coordinator.rounds import RoundInProgress, quorum_size, round_phases
from coordinator.sdafl_server import SdaflServer
from fedsynth import codec
from fedsynth.assembly import algorithm_for
from fedsynth.algorithms.base import snapshot_state
from fedsynth.config import RunConfig
from fedsynth.data import load_dataset
from fedsynth.errors import ConfigError, QuorumError, StateError, WireError
from fedsynth.models import build_model
from fedsynth.training import TrainData, evaluate, images_to_tensor

log = logging.getLogger(__name__)


@dataclass
class ClientRecord:
    client_id: int
    num_samples: int
    fedeas_images: int
    missing_classes: tuple[int, ...]
    session: str
    outbox: queue.Queue[Any] | None = None
    generation: dict[str, Any] | None = None
    has_synthetic: bool = False  # SDA-FL: holds the current shared synthetic images


@dataclass(frozen=True)
class TaskDelivery:
    task_id: str
    round: int
    deadline_s: float
    quota: list[int]
    payload: bytes
    meta: codec.PayloadMeta


@dataclass(frozen=True)
class Finished:
    reason: str
    success: bool


def _finite_mean(values: list[float]) -> float | None:
    finite = [v for v in values if np.isfinite(v)]
    return float(np.mean(finite)) if finite else None


class Federation:
    def __init__(self, cfg: RunConfig, out_dir: Path, metrics: CoordinatorMetrics) -> None:
        self.cfg = cfg
        self.out_dir = out_dir
        self.metrics = metrics
        self.run_id = cfg.fingerprint()
        self.algorithm = algorithm_for(cfg)
        test = load_dataset(cfg.data.dataset, "test", data_dir=cfg.data.data_dir, download=cfg.data.download)
        self.num_classes = test.num_classes
        self.test_data = TrainData(images_to_tensor(test.x), torch.as_tensor(test.y))
        channels, height, _ = test.image_shape
        torch.manual_seed(cfg.seed)
        self.model = build_model(cfg.train.model, num_classes=test.num_classes, in_channels=channels, image_size=height)
        # What every update's model group must match (keys, shapes, dtypes); meta tensors hold no memory.
        self.template = {k: torch.empty_like(v, device="meta") for k, v in self.model.state_dict().items()}
        self.server_state = self.algorithm.initial_server_state(snapshot_state(self.model))
        self.sdafl = SdaflServer(cfg, test.image_shape, test.num_classes) if cfg.train.algorithm == "sdafl" else None
        self.rng = np.random.default_rng([cfg.seed, 1])
        self.completed = 0
        self.history: list[dict[str, Any]] = []
        self.initial: dict[str, float] = {}
        self.quota: np.ndarray | None = None
        self._lock = threading.Condition()
        self._clients: dict[int, ClientRecord] = {}
        self._current: RoundInProgress | None = None
        self._watchers: list[queue.Queue[dict[str, Any]]] = []
        self._finished: Finished | None = None
        self.started = time.time()
        self._resume()

    # ---- checkpoints -------------------------------------------------------------------------

    def _resume(self) -> None:
        ckpt = checkpoint.load(self.out_dir)
        if ckpt is None:
            loss, acc = evaluate(self.model, self.test_data, self.cfg.train.eval_batch_size)
            self.initial = {"accuracy": acc, "loss": loss}
            return
        if ckpt.record.get("fingerprint") != self.run_id:
            raise ConfigError(
                f"{self.out_dir / checkpoint.FILE_NAME} belongs to run {ckpt.record.get('fingerprint')!r}, "
                f"not this config's {self.run_id!r}; use another out_dir or delete the checkpoint"
            )
        codec.check_like(ckpt.global_state, snapshot_state(self.model), what="checkpoint")
        self.model.load_state_dict(ckpt.global_state)
        self.server_state = ckpt.server_state
        self.rng.bit_generator.state = ckpt.record["rng"]
        self.completed = ckpt.completed_rounds
        self.history = ckpt.record["history"]
        self.initial = ckpt.record["initial"]
        if ckpt.record.get("quota") is not None:
            self.quota = np.asarray(ckpt.record["quota"], dtype=np.int64)
        if self.sdafl is not None:
            self.sdafl.restore(ckpt.synthetic, ckpt.record.get("sdafl", {}))
        log.info("resumed from checkpoint after round %d", self.completed)

    def _save_checkpoint(self) -> None:
        record = {
            "fingerprint": self.run_id,
            "rng": self.rng.bit_generator.state,
            "history": self.history,
            "initial": self.initial,
            "quota": None if self.quota is None else self.quota.tolist(),
        }
        synthetic: dict[str, torch.Tensor] = {}
        if self.sdafl is not None:
            synthetic, record["sdafl"] = self.sdafl.state()
        ckpt = checkpoint.Checkpoint(self.completed, snapshot_state(self.model), self.server_state, record, synthetic)
        checkpoint.save(self.out_dir, ckpt)

    # ---- registration and streams (called from gRPC threads) -----------------------------------

    def register(
        self, client_id: int, num_samples: int, fedeas_images: int, missing: Iterable[int], run_id: str, synthetic_digest: str = ""
    ) -> str:
        if run_id != self.run_id:
            raise StateError(f"client {client_id} was configured for run {run_id!r}, this coordinator runs {self.run_id!r}")
        if not 0 <= client_id < self.cfg.data.clients:
            raise WireError(f"client_id {client_id} is out of range 0..{self.cfg.data.clients - 1}")
        if num_samples < 1:
            raise WireError(f"client {client_id} reported num_samples={num_samples}; must be >= 1")
        missing = tuple(sorted(set(missing)))
        if any(c >= self.num_classes for c in missing):
            raise WireError(f"client {client_id} reported missing class ids {missing} outside 0..{self.num_classes - 1}")
        with self._lock:
            old = self._clients.get(client_id)
            if old and self.quota is not None and (old.num_samples, old.fedeas_images, old.missing_classes) != (num_samples, fedeas_images, missing):
                raise StateError(f"client {client_id} re-registered with different data than before")
            session = secrets.token_hex(16)
            record = ClientRecord(client_id, num_samples, fedeas_images, missing, session)
            record.has_synthetic = self.sdafl is not None and bool(synthetic_digest) and synthetic_digest == self.sdafl.digest()
            if old is not None:
                record.generation = old.generation
                self._close_outbox(old)
            self._clients[client_id] = record
            self.metrics.clients_registered.set(len(self._clients))
            self._lock.notify_all()
        log.info("client %d registered (N_k=%d, FedEAS images %d)", client_id, num_samples, fedeas_images)
        return session

    def _record(self, client_id: int, session: str) -> ClientRecord:
        record = self._clients.get(client_id)
        if record is None:
            raise StateError(f"client {client_id} is not registered")
        if record.session != session:
            raise StateError(f"client {client_id}: session is stale (the client registered again or the coordinator restarted)")
        return record

    def open_stream(self, client_id: int, session: str) -> queue.Queue[Any]:
        with self._lock:
            record = self._record(client_id, session)
            self._close_outbox(record)
            record.outbox = queue.Queue()
            if self._finished is not None:
                record.outbox.put(self._finished)
            rnd = self._current
            if rnd is not None and client_id in rnd.pending:
                record.outbox.put(self._delivery(rnd, client_id))  # a client that rejoins mid-round gets its task again
            self.metrics.clients_connected.set(sum(1 for c in self._clients.values() if c.outbox is not None))
            self._lock.notify_all()
            return record.outbox

    def close_stream(self, client_id: int, outbox: queue.Queue[Any]) -> None:
        with self._lock:
            record = self._clients.get(client_id)
            if record is not None and record.outbox is outbox:
                record.outbox = None
                log.info("client %d disconnected", client_id)
            self.metrics.clients_connected.set(sum(1 for c in self._clients.values() if c.outbox is not None))
            self._lock.notify_all()

    def _close_outbox(self, record: ClientRecord) -> None:
        if record.outbox is not None:
            record.outbox.put(None)  # ends the superseded stream
            record.outbox = None

    def mark_delivered(self, client_id: int, task_id: str, num_bytes: int) -> None:
        with self._lock:
            rnd = self._current
            if rnd is not None and rnd.task_id == task_id:
                rnd.delivered[client_id] = time.monotonic() - rnd.started
                rnd.bytes_sent += num_bytes
                record = self._clients.get(client_id)
                if record is not None and self.sdafl is not None:
                    record.has_synthetic = True

    def watch(self) -> queue.Queue[dict[str, Any]]:
        q: queue.Queue[dict[str, Any]] = queue.Queue()
        with self._lock:
            for summary in self.history:
                q.put(summary)
            if self._finished is not None:
                q.put({"finished": True, "success": self._finished.success, "message": self._finished.reason})
            self._watchers.append(q)
        return q

    def unwatch(self, q: queue.Queue[dict[str, Any]]) -> None:
        with self._lock:
            if q in self._watchers:
                self._watchers.remove(q)

    # ---- updates -----------------------------------------------------------------------------

    def accept_synthetic(self, header: dict[str, Any], chunks: Iterable[tuple[int, bytes]]) -> int:
        """SDA-FL: store one client's unlabelled DP-GAN samples (once per client) in the shared set."""
        if self.sdafl is None:
            raise StateError(f"this run's algorithm is {self.cfg.train.algorithm!r}; synthetic uploads belong to 'sdafl'")
        with self._lock:
            self._record(header["client_id"], header["session"])
        return self.sdafl.accept_upload(header["client_id"], header, chunks)

    def accept_update(self, header: dict[str, Any], chunks: Iterable[tuple[int, bytes]]) -> None:
        """Validate and fold one client's update into the round's running sum; the global model is never touched."""
        client_id = header["client_id"]
        with self._lock:
            record = self._record(client_id, header["session"])
            rnd = self._current
            if rnd is None or rnd.number != header["round"] or rnd.task_id != header["task_id"]:
                current = "none" if rnd is None else rnd.number
                raise StateError(f"update for round {header['round']} (task {header['task_id'][:8]}) but the open round is {current}")
            if client_id not in rnd.pending:
                raise StateError(f"client {client_id} was not sampled in round {rnd.number} or already answered")
        meta = codec.PayloadMeta(header["total_bytes"], header["sha256"], header["num_chunks"])
        log.info("round %d: receiving client %d's update (%d bytes)", rnd.number, client_id, meta.total_bytes)
        data = codec.assemble(meta, chunks, max_bytes=2 * len(rnd.payload) + (1 << 20))
        groups = codec.split_prefixed(codec.decode(data))
        unknown = sorted(set(groups) - {"model", "extra"})
        if unknown:
            raise WireError(f"update carries unknown tensor groups {unknown}")
        state, extra = groups.get("model", {}), groups.get("extra", {})
        codec.check_like(state, self.template, what=f"update from client {client_id}")
        for name, tensor in extra.items():
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise WireError(f"update: extra tensor {name!r} contains NaN or Inf")
        labels = self._pseudo_labels(client_id, state) if self.sdafl is not None else None
        with self._lock:
            if self._current is not rnd or client_id not in rnd.pending:
                raise StateError(f"round {rnd.number} closed before client {client_id}'s update was complete")
            started = time.monotonic()
            rnd.aggregator.add(state, extra, float(record.num_samples))
            rnd.aggregation_s += time.monotonic() - started
            rnd.answered[client_id] = {
                "train_seconds": header["train_seconds"],
                "train_loss": header["train_loss"],
                "generation_seconds": header["generation"].get("wall_seconds", 0.0) if header["generation"] else 0.0,
            }
            rnd.bytes_received += len(data)
            if labels is not None and self.sdafl is not None:
                self.sdafl.commit_labels(client_id, labels)
            if header["generation"] and record.generation is None:
                record.generation = header["generation"]
            self._lock.notify_all()
        self.metrics.bytes_received.inc(len(data))
        log.info("round %d: update from client %d accepted", rnd.number, client_id)

    def _pseudo_labels(self, client_id: int, state: dict[str, torch.Tensor]) -> np.ndarray:
        """Label this client's synthetic samples with its NEW local model (the caller has validated `state`)."""
        assert self.sdafl is not None
        local = copy.deepcopy(self.model)
        local.load_state_dict(state)
        return self.sdafl.pseudo_labels(client_id, local)

    # ---- the round loop ----------------------------------------------------------------------

    def run(self) -> None:
        """Play every remaining round; raises QuorumError when the run cannot go on."""
        try:
            self._await_registrations()
            if self.sdafl is not None:
                with self._lock:
                    registered = sorted(self._clients)
                self.sdafl.await_uploads(
                    registered,
                    timeout_s=self.cfg.runtime.registration_timeout_s + self.cfg.runtime.round_timeout_s,
                    need=quorum_size(self.cfg.data.clients, self.cfg.runtime.quorum),
                )
            for number in range(self.completed + 1, self.cfg.train.rounds + 1):
                self._play_round(number)
            self._finish(Finished(f"completed {self.cfg.train.rounds} rounds", True))
        except QuorumError as exc:
            self._finish(Finished(str(exc), False))
            raise

    def _await_registrations(self) -> None:
        """A fresh run waits for all K clients (up to registration_timeout_s). A resumed run goes on once a quorum
        is back and no client has registered for rejoin_grace_s: a client that died with the old coordinator
        must not hold the run for the whole registration timeout."""
        k = self.cfg.data.clients
        need = quorum_size(k, self.cfg.runtime.quorum)
        stop_at = time.monotonic() + self.cfg.runtime.registration_timeout_s
        resuming = self.completed > 0
        with self._lock:
            seen, last_change = 0, time.monotonic()
            while len(self._clients) < k:
                now = time.monotonic()
                if len(self._clients) != seen:
                    seen, last_change = len(self._clients), now
                if now >= stop_at or (resuming and seen >= need and now - last_change >= self.cfg.runtime.rejoin_grace_s):
                    break
                self._lock.wait(timeout=min(stop_at - now, 0.5))
            if len(self._clients) < need:
                raise QuorumError(
                    f"only {len(self._clients)} of {k} clients registered within "
                    f"{self.cfg.runtime.registration_timeout_s:.0f}s (quorum {need})"
                )
            if self.quota is None:  # a resumed run keeps the budget it started with
                self.quota = self._matched_quota()

    def _matched_quota(self) -> np.ndarray | None:
        """Uniform / Missing-only quotas matched to B = the FedEAS total the clients report (or generation.budget)."""
        policy = self.cfg.generation.policy
        if policy not in ("uniform", "missing"):
            return None
        from fedsynth.allocation import matched_quota

        k, c = self.cfg.data.clients, self.num_classes
        present = np.ones((k, c), dtype=np.int64)  # only absence matters to these rules, so 1 stands for "present"
        for record in self._clients.values():
            present[record.client_id, list(record.missing_classes)] = 0
        total = self.cfg.generation.budget
        if total is None:
            total = sum(r.fedeas_images for r in self._clients.values())
        return matched_quota(policy, present, int(total))

    def _delivery(self, rnd: RoundInProgress, client_id: int) -> TaskDelivery:
        quota = [] if self.quota is None else [int(v) for v in self.quota[client_id]]
        record = self._clients.get(client_id)
        if self.sdafl is not None and record is not None and not record.has_synthetic:
            if rnd.payload_with_images is None:
                rnd.payload_with_images = self._task_payload(rnd.global_state, with_images=True)
            payload = rnd.payload_with_images
            return TaskDelivery(rnd.task_id, rnd.number, rnd.deadline_s, quota, payload, codec.describe(payload))
        return TaskDelivery(rnd.task_id, rnd.number, rnd.deadline_s, quota, rnd.payload, rnd.meta)

    def _task_payload(self, global_state: dict[str, torch.Tensor], *, with_images: bool) -> bytes:
        groups = {"model": global_state, "extra": self.algorithm.server_extra(self.server_state)}
        if self.sdafl is not None:
            groups["synthetic"] = self.sdafl.task_groups(with_images=with_images)
        return codec.encode(codec.join_prefixed(**groups))

    def _play_round(self, number: int) -> None:
        k = self.cfg.data.clients
        m = max(1, round(self.cfg.train.fraction * k))
        sampled = sorted(int(c) for c in self.rng.choice(k, size=m, replace=False))
        global_state = snapshot_state(self.model)
        payload = self._task_payload(global_state, with_images=False)
        rnd = RoundInProgress(
            number=number,
            task_id=secrets.token_hex(8),
            sampled=sampled,
            payload=payload,
            meta=codec.describe(payload),
            aggregator=self.algorithm.new_aggregator(global_state, self.server_state),
            deadline_s=self.cfg.runtime.round_timeout_s,
            need=quorum_size(m, self.cfg.runtime.quorum),
            global_state=global_state,
        )
        with self._lock:
            self._current = rnd
            for client_id in sampled:
                record = self._clients.get(client_id)
                if record is not None and record.outbox is not None:
                    record.outbox.put(self._delivery(rnd, client_id))
        log.info("round %d: sampled %s", number, sampled)
        self._wait_for_answers(rnd)
        closed_at = time.monotonic()
        with self._lock:
            self._current = None
        started = time.monotonic()
        new_global, self.server_state = rnd.aggregator.finish()
        self.model.load_state_dict(new_global)
        rnd.aggregation_s += time.monotonic() - started
        sdafl_summary = self.sdafl.after_aggregation(self.model, number) if self.sdafl is not None else {}
        started = time.monotonic()
        loss, acc = evaluate(self.model, self.test_data, self.cfg.train.eval_batch_size)
        phases = round_phases(rnd, closed_at, time.monotonic() - started)
        summary = {
            "round": number,
            "accuracy": acc,
            "loss": loss,
            "duration_s": time.monotonic() - rnd.started,
            "participants": sorted(rnd.answered),
            "sampled": sampled,
            "phases_s": phases,
            "bytes_sent": rnd.bytes_sent,
            "bytes_received": rnd.bytes_received,
            "train_loss": _finite_mean([a["train_loss"] for a in rnd.answered.values()]),
            **sdafl_summary,
        }
        self.completed = number
        self.history.append(summary)
        self._save_checkpoint()
        self.metrics.observe_round(summary)
        log.info("round %d: accuracy %.4f loss %.4f (%d/%d answered)", number, acc, loss, len(rnd.answered), m)
        self._publish(summary)

    def _wait_for_answers(self, rnd: RoundInProgress) -> None:
        grace = self.cfg.runtime.rejoin_grace_s
        unreachable_since: float | None = None
        with self._lock:
            while rnd.pending:
                now = time.monotonic()
                if rnd.expired:
                    if len(rnd.answered) >= rnd.need:
                        log.warning("round %d: deadline reached; closing with %d/%d answers", rnd.number, len(rnd.answered), len(rnd.sampled))
                        return
                    raise QuorumError(
                        f"round {rnd.number}: {len(rnd.answered)} of {len(rnd.sampled)} sampled clients answered "
                        f"within {rnd.deadline_s:.0f}s; quorum is {rnd.need}"
                    )
                connected = {c for c in rnd.pending if self._clients.get(c) and self._clients[c].outbox is not None}
                if connected:
                    unreachable_since = None
                else:
                    unreachable_since = unreachable_since or now
                    if now - unreachable_since >= grace:
                        if len(rnd.answered) >= rnd.need:
                            log.warning("round %d: clients %s gone; closing with the quorum", rnd.number, sorted(rnd.pending))
                            return
                        raise QuorumError(
                            f"round {rnd.number}: only {len(rnd.answered)} answered and clients {sorted(rnd.pending)} "
                            f"have been unreachable for {grace:.0f}s; quorum is {rnd.need} of {len(rnd.sampled)}"
                        )
                self._lock.wait(timeout=0.25)

    def _publish(self, summary: dict[str, Any]) -> None:
        with self._lock:
            for q in self._watchers:
                q.put(summary)

    def _finish(self, finished: Finished) -> None:
        with self._lock:
            self._finished = finished
            for record in self._clients.values():
                if record.outbox is not None:
                    record.outbox.put(finished)
            for q in self._watchers:
                q.put({"finished": True, "success": finished.success, "message": finished.reason})
        log.info("run finished: %s", finished.reason)

    def generation_reports(self) -> dict[int, dict[str, Any]]:
        with self._lock:
            return {c: dict(r.generation) for c, r in self._clients.items() if r.generation}

    def close_streams(self) -> None:
        """End every open dispatch stream now (shutdown), so no RPC holds the server for its whole grace period."""
        with self._lock:
            for record in self._clients.values():
                self._close_outbox(record)
            self._lock.notify_all()

    def drain(self, timeout_s: float) -> None:
        """Wait (bounded) until every client stream has closed after the final message."""
        stop_at = time.monotonic() + timeout_s
        with self._lock:
            while any(r.outbox is not None for r in self._clients.values()) and time.monotonic() < stop_at:
                self._lock.wait(timeout=0.1)
