"""The federation: builds the run's parts and offers the operations the gRPC servicer calls.

Parts, each in its own module: `registry` (clients, sessions, dispatch outboxes), `run_state` (model, RNG, history,
checkpoint), `round_driver` (the round loop), `updates` (an update off the wire), `progress` (round summaries for
watchers). Plain Python over plain data; servicer.py only translates to and from messages.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch

from coordinator.dispatch import TaskDelivery
from coordinator.evolution_source import GeneratorSource
from coordinator.dp_secret import noise_secret
from coordinator.fedgen_server import FedGenServer
from coordinator.mean_pool import MeanDataPool
from coordinator.metrics import CoordinatorMetrics
from coordinator.progress import ProgressFeed
from coordinator.registry import ClientRegistry
from coordinator.rounds import RoundInProgress
from coordinator.round_driver import RoundDriver
from coordinator.run_state import RunState
from coordinator.schema_check import Schema, SchemaRefused, check_schema
from coordinator.secagg.secure_round import SecureRound
from fedsynth.secagg.model_vector import MASKED_KEY, vector_length
from coordinator.sdafl_server import SdaflServer
from coordinator.update_norms import update_norm
from coordinator.members.refusals import RefusalLedger
from coordinator.updates import ReceivedUpdate, check_integer_moves, check_reports, decode_update, local_state, update_layout
from fedsynth.wire import versions, wire_dtype
from fedsynth.algorithms.base import extra_layout
from fedsynth.algorithms.fedgen import FedGen, head_keys
from fedsynth.assembly import algorithm_for, model_for, user_dp_for
from fedsynth.config import RunConfig
from fedsynth.learning.data import load_dataset
from fedsynth.algorithms.ddpm import FedDdpm
from fedsynth.algorithms.evolution import PrivateEvolution
from fedsynth.learning.local_data import load_test_dir
from fedsynth.learning.label_schema import schema_of
from fedsynth.errors import ConfigError, StateError, WireError
from fedsynth.learning.evaluation import EvaluationCounts
from fedsynth.learning.training import TrainData, images_to_tensor
from fedsynth.wire.transfer import PreparedPayload

log = logging.getLogger(__name__)


def evolution_source(generator: str | None, credentials: grpc.ChannelCredentials | None, num_classes: int,
                     image_shape: tuple[int, int, int], cfg: RunConfig) -> GeneratorSource:
    """Private Evolution's public generator (`fedsynth coordinator --generator`, which the launcher passes)."""
    if generator is None:
        raise ConfigError("train.algorithm = \"pe\" needs the public generator's address: fedsynth coordinator --generator HOST:PORT")
    return GeneratorSource(generator, credentials, num_classes=num_classes, image_shape=image_shape,
                           timeout_s=cfg.runtime.round_timeout_s)


class Federation:
    def __init__(self, cfg: RunConfig, out_dir: Path, metrics: CoordinatorMetrics, *, generator: str | None = None,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        self.cfg = cfg
        self.out_dir = out_dir
        self.metrics = metrics
        self.run_id = cfg.fingerprint()
        algorithm = algorithm_for(cfg)
        if isinstance(algorithm, FedDdpm) and algorithm.settings.dp == "user":
            algorithm = dataclasses.replace(algorithm, noise_secret=noise_secret(out_dir))
        user_dp = user_dp_for(cfg, noise_secret(out_dir)) if cfg.train.dp == "user" else None  # the classifier's DP-FedAvg
        schema = schema_of(cfg.data)
        test_data: TrainData | None = None  # local mode without data.test_dir: the coordinator holds no data
        if cfg.data.source == "local" and schema is not None:
            num_classes, (channels, height, width) = len(schema.classes), (schema.channels, schema.image_size, schema.image_size)
            if cfg.data.test_dir is not None:
                test = load_test_dir(cfg.data.test_dir, schema, cache_dir=out_dir / "test-dir-cache",
                                     max_image_pixels=cfg.data.max_image_pixels, follow_symlinks=cfg.data.follow_symlinks)
                test_data = TrainData(images_to_tensor(test.x), torch.as_tensor(test.y))
                log.info("server evaluation on %d test images from data.test_dir %s", len(test.y), cfg.data.test_dir)
        else:
            test = load_dataset(cfg.data.dataset, "test", data_dir=cfg.data.data_dir, download=cfg.data.download)
            test_data = TrainData(images_to_tensor(test.x), torch.as_tensor(test.y))
            num_classes, (channels, height, width) = test.num_classes, test.image_shape
        self.schema = Schema(schema.digest() if schema is not None else "", channels, height)
        torch.manual_seed(cfg.seed)
        model = model_for(cfg, num_classes=num_classes, in_channels=channels, image_size=height)
        if cfg.train.algorithm == "ddpm" and cfg.federate.init is not None:  # a warm start: round 1 begins from it
            from fedsynth.learning.unet import load_initial_weights

            load_initial_weights(model, Path(cfg.federate.init))
        self.init_weights: dict[str, str] | None = None  # train.init_weights' {"path", "sha256"} (coordinator.json)
        if cfg.train.init_weights is not None:  # round 1's global model: the operator's file (clients need no copy)
            from fedsynth.learning.models import load_init_weights

            self.init_weights = load_init_weights(model, Path(cfg.train.init_weights))
        if isinstance(algorithm, PrivateEvolution):  # its population comes from the public generator; its noise has a secret
            algorithm = dataclasses.replace(algorithm, noise_secret=noise_secret(out_dir),
                                            source=evolution_source(generator, credentials, num_classes, (channels, height, width), cfg))
        self.state = RunState(model, algorithm, run_id=self.run_id, seed=cfg.seed)
        wire = cfg.runtime.wire_dtype
        self.update_layout = update_layout(wire_dtype.expected_layout(self.state.layout, wire),
                                           wire_dtype.expected_layout(extra_layout(algorithm, model), wire))
        self.secure = cfg.runtime.secure_aggregation
        if self.secure:  # an update is one masked vector: every floating-point element and the weight, as int32
            extras = {key: math.prod(shape) for key, (shape, _) in extra_layout(algorithm, model).items()}
            self.update_layout = update_layout({MASKED_KEY: ((vector_length(model.state_dict(), extras),), torch.int32)}, {})
        self.layout_digest = versions.layout_digest(model.state_dict())  # every node's model must have this layout
        self.num_classes = num_classes
        self.sdafl = SdaflServer(cfg, (channels, height, width), num_classes) if cfg.train.algorithm == "sdafl" else None
        self.mean_pool = None  # FedMix / NaiveMix: the clients' pooled mean data
        if cfg.train.algorithm in ("fedmix", "naivemix"):
            self.mean_pool = MeanDataPool(image_shape_hwc=(height, width, channels), num_classes=num_classes,
                                          mean_batch=getattr(algorithm, "mean_batch"), run_id=self.run_id)
        self.fedgen = FedGenServer(algorithm, seed=cfg.seed) if isinstance(algorithm, FedGen) else None
        self.lock = threading.Condition()
        self.registry = ClientRegistry(self.lock, metrics, run_id=self.run_id, num_clients=cfg.data.clients,
                                       num_classes=num_classes, max_samples=cfg.data.max_samples_per_client)
        self.progress = ProgressFeed(self.lock)
        self.refusals = RefusalLedger(cfg.runtime.max_refusals, metrics.refused_updates)
        self.driver = RoundDriver(cfg, out_dir=out_dir, lock=self.lock, registry=self.registry, state=self.state,
                                  algorithm=algorithm, sdafl=self.sdafl, metrics=metrics, progress=self.progress,
                                  test_data=test_data, mean_pool=self.mean_pool, fedgen=self.fedgen, refusals=self.refusals,
                                  user_dp=user_dp)
        self.started = time.time()
        self.data_port = 0  # the data plane's, once it listens (runtime.data_plane = "tcp")
        if self.mean_pool is not None:
            self.mean_pool.load(out_dir)
        self.state.resume(out_dir, self.sdafl)  # a fresh run's initial model is evaluated by the round loop

    @property
    def completed(self) -> int:
        return self.state.completed

    @property
    def history(self) -> list[dict[str, Any]]:
        return self.state.history

    @property
    def initial(self) -> dict[str, float]:
        return self.state.initial

    def privacy_report(self) -> dict[str, Any] | None:
        """epsilon so far: the classifier's (train.dp = "user") or the federated generator's; None for a run without DP."""
        if self.driver.user_dp is not None:
            return self.driver.user_dp.report(self.completed)
        if self.cfg.train.algorithm not in ("ddpm", "pe"):
            return None
        return self.driver.algorithm.privacy_report(self.completed, *self.driver.participation())  # type: ignore[attr-defined, no-any-return]

    def run(self) -> None:
        """Play every remaining round; raises QuorumError when the run cannot go on."""
        self.driver.run()

    # ---- registration and streams (called from gRPC threads) -----------------------------------

    def register(
        self, client_id: int, num_samples: int, fedeas_images: int, missing: Iterable[int], run_id: str, synthetic_digest: str = "",
        label_counts: Iterable[int] = (), schema: Schema | None = None, unknown_classes: tuple[str, ...] = (),
        node_token: str = "", node: versions.NodeVersion | None = None, test_samples: int = 0,
    ) -> str:
        if node is not None:  # first: a node of another release may mean anything by the fields below
            self.registry.check_claim(client_id, run_id)
            try:
                versions.check_node(client_id, node, expected_digest=self.layout_digest)
            except versions.VersionRefused as exc:
                log.warning("registration refused: %s", exc)
                self._refuse_registration(client_id, "version")
                raise
        with self.lock:
            excluded = self.refusals.excluded.get(client_id)
        if excluded is not None:
            raise StateError(f"client {client_id} was excluded from this run after round {excluded['round']}: {excluded['reason']}")
        if schema is not None:
            self.registry.check_claim(client_id, run_id)  # a refusal below names only this run's clients
            try:
                check_schema(client_id, self.schema, schema, unknown_classes)  # first: refused, never admitted
            except SchemaRefused:
                self._refuse_registration(client_id, "schema")
                raise
        shared = self.sdafl or self.mean_pool  # the set sent once to each client (SDA-FL's images, FedMix's means)
        return self.registry.register(
            client_id, num_samples, fedeas_images, missing, run_id,
            data_fixed=self.state.quota is not None,
            has_synthetic=lambda digest: shared is not None and bool(digest) and digest == shared.digest(),
            synthetic_digest=synthetic_digest,
            label_counts=label_counts, need_label_counts=self.fedgen is not None,
            node_token=node_token, live_within_s=self.cfg.runtime.heartbeat_timeout_s, test_samples=test_samples,
        )

    def _refuse_registration(self, client_id: int, reason: str) -> None:
        """A client refused for what it is (its release, its data's schema): the registration wait stops waiting for it."""
        self.metrics.rejected_registrations.labels(reason=reason).inc()
        with self.lock:
            self.registry.refused.add(client_id)
            self.lock.notify_all()

    def release(self, client_ids: Iterable[int], reason: str) -> list[int]:
        """The launcher: these clients' processes are gone. Not waited for at registration nor in the open round; not
        sampled again until one registers again. WireError for an id outside this run's 0..K-1."""
        ids = sorted(set(client_ids))
        outside = [c for c in ids if not 0 <= c < self.cfg.data.clients]
        if outside or not ids:
            raise WireError(f"ReleaseClients names client ids {outside or '(none)'}; this run has clients 0..{self.cfg.data.clients - 1}")
        reason = reason[:500]
        log.warning("clients %s released: %s", ids, reason)
        with self.lock:
            released = self.registry.release(ids, reason)
            rnd = self.driver.current
            if rnd is not None:
                rnd.gone |= {c for c in ids if rnd.awaits(c)}
                if isinstance(rnd.aggregator, SecureRound):
                    rnd.aggregator.forget(ids)
            self.lock.notify_all()
        return released

    def open_stream(self, client_id: int, session: str) -> queue.Queue[Any]:
        with self.lock:
            _record, outbox = self.registry.open_stream(client_id, session)
            rnd = self.driver.current
            if rnd is not None and rnd.awaits(client_id):
                outbox.put(self.driver.delivery(rnd, client_id))  # a client that rejoins mid-round gets its task again
            if self.driver.federated is not None:
                self.driver.federated.redeliver(client_id, outbox)
            return outbox

    def close_stream(self, client_id: int, outbox: queue.Queue[Any]) -> None:
        self.registry.close_stream(client_id, outbox)
        with self.lock:  # a secure round's stages stop waiting for it (its shares are one holder's of many)
            for rnd in (self.driver.current, self.driver.unmasking):
                if rnd is not None and isinstance(rnd.aggregator, SecureRound):
                    rnd.aggregator.forget([client_id])

    def heartbeat(self, client_id: int, session: str) -> bool:
        return self.registry.heartbeat(client_id, session)

    def check_liveness(self, stop: threading.Event) -> None:
        """Until stop is set: drop clients whose heartbeats stopped (runs in a thread of its own)."""
        runtime = self.cfg.runtime
        while not stop.wait(min(runtime.heartbeat_s, runtime.heartbeat_timeout_s) / 2):
            self.registry.drop_silent(runtime.heartbeat_timeout_s)

    def mark_delivered(self, client_id: int, task_id: str, num_bytes: int) -> None:
        self.metrics.bytes_sent.inc(num_bytes)
        with self.lock:
            rnd = self.driver.current
            if rnd is not None and rnd.task_id == task_id:
                rnd.delivered[client_id] = time.monotonic() - rnd.started
                rnd.bytes_sent += num_bytes
                if rnd.delivered.keys() >= set(rnd.sampled):  # as large as the model; a rejoiner's task is encoded again
                    rnd.payload = PreparedPayload(rnd.payload.meta, ())
                    rnd.dispatched.set()
                record = self.registry.clients.get(client_id)
                if record is not None and (self.sdafl is not None or self.mean_pool is not None):
                    record.has_synthetic = True

    def data_plane_client(self, ticket: bytes, *, task: bool) -> tuple[int, RoundInProgress, TaskDelivery | None]:
        """The client a data-plane ticket was issued to, its round, and (`task`) its task: the payload to send it."""
        with self.lock:
            rnd = self.driver.current
            client_id = None if rnd is None else rnd.tickets.get(ticket)
            if rnd is None or client_id is None:
                raise StateError("unknown data-plane ticket: its round is over, or it was never issued")
            if not rnd.awaits(client_id):
                raise StateError(f"client {client_id} already answered round {rnd.number}")
            return client_id, rnd, self.driver.delivery(rnd, client_id) if task else None

    def watch(self) -> queue.Queue[dict[str, Any]]:
        with self.lock:
            return self.progress.watch(self.state.history, self.registry.finished)

    def unwatch(self, q: queue.Queue[dict[str, Any]]) -> None:
        self.progress.unwatch(q)

    def accept_evaluation(self, client_id: int, session: str, round_number: int, task_id: str, counts: EvaluationCounts) -> None:
        """Federated evaluation: one client's counts on its local test set."""
        if self.driver.federated is None:
            raise StateError(f"this run's train.evaluation is {self.cfg.train.evaluation!r}: the clients do not evaluate")
        self.driver.federated.accept(client_id, session, round_number, task_id, counts)

    # ---- secure aggregation's stages (called from gRPC threads; they wait for their stage to close) --------------

    def secure_stage(self, client_id: int, session: str, round_number: int, task_id: str) -> tuple[RoundInProgress, SecureRound]:
        """The open secure round this sampled client's stage message belongs to; StateError otherwise."""
        with self.lock:
            self.registry.record(client_id, session)
            rnd = self.driver.current or self.driver.unmasking
            if rnd is None or rnd.number != round_number or rnd.task_id != task_id:
                raise StateError(f"secure aggregation message for round {round_number} (task {task_id[:8]}) but the open "
                                 f"round is {'none' if rnd is None else rnd.number}")
            if not isinstance(rnd.aggregator, SecureRound):
                raise StateError("this run does not aggregate securely (runtime.secure_aggregation = false)")
            if not rnd.awaits(client_id) and client_id not in rnd.answered:
                raise StateError(f"client {client_id} has no part in round {rnd.number} (not sampled, refused or gone)")
            return rnd, rnd.aggregator

    def secure_refusal(self, rnd: RoundInProgress, client_id: int, problem: str) -> None:
        """A client's stage message refused: its round is over (no stage waits for it), the run goes on."""
        with self.lock:
            if self.driver.current is rnd and rnd.awaits(client_id):
                rnd.refused[client_id] = problem
                self.refusals.refuse(rnd.number, client_id, problem)
            if isinstance(rnd.aggregator, SecureRound):
                rnd.aggregator.forget([client_id])
            self.lock.notify_all()

    # ---- updates -----------------------------------------------------------------------------

    def accept_synthetic(self, header: dict[str, Any], chunks: Iterable[tuple[int, bytes]]) -> int:
        """SDA-FL: store one client's unlabelled DP-GAN samples (once per client) in the shared set."""
        if self.sdafl is None:
            raise StateError(f"this run's algorithm is {self.cfg.train.algorithm!r}; synthetic uploads belong to 'sdafl'")
        with self.lock:
            self.registry.record(header["client_id"], header["session"])
        return self.sdafl.accept_upload(header["client_id"], header, chunks)

    def report_setup_failure(self, client_id: int, session: str, reason: str) -> None:
        """SDA-FL: a registered client's DP-GAN failed; it will upload nothing, so the upload wait stops counting on it."""
        if self.sdafl is None:
            raise StateError(f"this run's algorithm is {self.cfg.train.algorithm!r}; setup failures are SDA-FL's DP-GAN's")
        with self.lock:
            self.registry.record(client_id, session)
        self.sdafl.fail(client_id, reason)

    def accept_mean_data(self, header: dict[str, Any], chunks: Iterable[tuple[int, bytes]]) -> int:
        """FedMix / NaiveMix: validate and pool one client's mean data (once per client, before round 1)."""
        if self.mean_pool is None:
            raise StateError(f"this run's algorithm is {self.cfg.train.algorithm!r}; mean-data uploads belong to 'fedmix' and 'naivemix'")
        with self.lock:
            record = self.registry.record(header["client_id"], header["session"])
        return self.mean_pool.accept(header["client_id"], record.num_samples, header, chunks)

    def accept_update(self, header: dict[str, Any], receive: Callable[[int], torch.Tensor], *,
                      receiving: Callable[[], AbstractContextManager[object]] = nullcontext) -> None:
        """Validate and fold one client's update into the round's running sum; the global model is never touched.
        `receive(max_bytes)` returns the update's bytes, verified against their digest (the gRPC chunks or the data
        plane). They are received, and the update held, inside `receiving()` (a receive slot), entered only once the
        header fits the open round: a refused update never waits for a slot."""
        client_id = header["client_id"]
        with self.lock:
            record = self.registry.record(client_id, header["session"])
            rnd = self.driver.current
            self._admit_upload(rnd, client_id, header)
            assert rnd is not None
            rnd.receiving.add(client_id)  # one upload at a time per client and round
            # read under the lock: a round that closes meanwhile lets go of its payload and global state
            max_bytes, global_state = 2 * rnd.payload.meta.total_bytes + (1 << 20), rnd.global_state
        try:
            self._receive_update(rnd, record, header, receive, receiving, max_bytes, global_state)
        except WireError as exc:  # its bytes or its numbers: that client's round is over, the run goes on
            with self.lock:
                if self.driver.current is rnd and rnd.awaits(client_id):
                    rnd.refused[client_id] = str(exc)
                    self.refusals.refuse(rnd.number, client_id, str(exc))
                    self.lock.notify_all()  # the round may be complete now
            raise
        finally:
            with self.lock:
                rnd.receiving.discard(client_id)

    def upload_deadline_s(self) -> float:
        """How long an upload opened now may take: the open round's time left, and a heartbeat timeout's grace."""
        with self.lock:
            rnd = self.driver.current
            left = 0.0 if rnd is None else rnd.deadline_s - (time.monotonic() - rnd.started)
        return max(0.0, left) + self.cfg.runtime.heartbeat_timeout_s

    def _admit_upload(self, rnd: RoundInProgress | None, client_id: int, header: dict[str, Any]) -> None:
        """StateError unless the header answers this client's task of the open round, and no other upload of it is under
        way or done; a stale, replayed or duplicate upload is named in the round's refusals. Under the lock."""
        if rnd is None or rnd.number != header["round"] or rnd.task_id != header["task_id"]:
            current = "none" if rnd is None else rnd.number
            problem = f"update for round {header['round']} (task {header['task_id'][:8]}) but the open round is {current}"
            self.refusals.refuse(None if rnd is None else rnd.number, client_id, problem, reason="stale", counts=False)
            raise StateError(problem)
        if client_id in rnd.receiving:
            problem = f"client {client_id} is already uploading its update for round {rnd.number}: one upload at a time"
            self.refusals.refuse(rnd.number, client_id, problem, reason="duplicate", counts=False)
            raise StateError(problem)
        if not rnd.awaits(client_id):
            sampled = client_id in rnd.sampled
            problem = (f"client {client_id} already answered round {rnd.number}" if sampled
                       else f"client {client_id} was not sampled in round {rnd.number}")
            self.refusals.refuse(rnd.number, client_id, problem, reason="duplicate" if sampled else "stale", counts=False)
            raise StateError(problem)

    def _receive_update(self, rnd: RoundInProgress, record: Any, header: dict[str, Any],
                        receive: Callable[[int], torch.Tensor], receiving: Callable[[], AbstractContextManager[object]],
                        max_bytes: int, global_state: dict[str, torch.Tensor]) -> None:
        """Receive, check completely, then answer and fold (or hold) one admitted update."""
        client_id = record.client_id
        bound = self.driver.norm_bound
        check_reports(header, client_id=client_id)  # from the header alone: refused before it waits for a slot
        with receiving():
            log.info("round %d: receiving client %d's update (%d bytes)", rnd.number, client_id, header["total_bytes"])
            update = decode_update(receive(max_bytes), layout=self.update_layout, client_id=client_id, wire=self.cfg.runtime.wire_dtype)
            if not self.secure:  # a masked update has no integer tensors (and nothing the coordinator could check)
                check_integer_moves(update, global_state, max_steps=self._forward_passes(record.num_samples), client_id=client_id)
            norm = update_norm(update.state, update.extra, global_state, deltas=update.deltas) if bound.enabled else None
            labels = self._pseudo_labels(client_id, local_state(update, global_state)) if self.sdafl is not None else None
            fold = self._folder(rnd, client_id, update, float(record.num_samples), labels, global_state)
            later = norm is None  # no bound to judge: the sender hears back now, the fold thread folds it
            if later:
                self.driver.folds.reserve(f"client {client_id}'s update for round {rnd.number}")
            try:
                with self.lock:
                    if self.driver.current is not rnd or not rnd.awaits(client_id):
                        raise StateError(f"round {rnd.number} closed before client {client_id}'s update was complete")
                    if header["generation"] and record.generation is None:
                        record.generation = header["generation"]
                    if later:
                        self.driver.folds.submit(rnd, client_id, functools.partial(fold, 1.0))
                        later = False
                    else:
                        self._judge(rnd, client_id, norm, fold)
                    rnd.answered[client_id] = {
                        "train_seconds": header["train_seconds"],
                        "train_loss": header["train_loss"],
                        "generation_seconds": header["generation"].get("wall_seconds", 0.0) if header["generation"] else 0.0,
                    }
                    rnd.bytes_received += update.num_bytes
                    if rnd.complete:  # the round loop waits for nothing else from updates (it checks deadlines on its own)
                        self.lock.notify_all()
            finally:
                if later:  # refused before it reached the fold thread
                    self.driver.folds.cancel()
            num_bytes = update.num_bytes
            del update, labels, fold  # the received buffer goes before the slot does (unless the round or fold thread holds it)
        self.metrics.bytes_received.inc(num_bytes)
        log.info("round %d: update from client %d %s", rnd.number, client_id, "held" if client_id in rnd.held else "accepted")

    def _forward_passes(self, num_samples: int) -> int:
        """The most training forward passes one round can take a client of N_k real samples through (BatchNorm's
        num_batches_tracked moves by one each): E epochs over its real and synthetic data (FedEAS's Full-Balance
        at most C x N_k images more, SDA-FL's shared set), up to 4 passes a step (mixup's and MOON's extra ones)."""
        train = self.cfg.train
        data = (self.num_classes + 1) * num_samples + self.cfg.data.clients * self.cfg.sdafl.samples_per_client
        steps = train.max_steps if train.max_steps is not None else train.local_epochs * math.ceil(data / train.batch_size)
        return 4 * max(steps, self.cfg.federate.local_steps) + 4

    def _judge(self, rnd: RoundInProgress, client_id: int, norm: float, fold: Callable[[float], None]) -> None:
        """runtime.max_update_norm: fold the update at the scale its norm allows now (a number), or hold it until the
        round's median is known ("auto"); a refused update's sender hears of it (StateError). Under the lock."""
        started = time.monotonic()
        bound = self.driver.norm_bound
        rnd.norms[client_id] = norm
        if bound.auto:  # judged when the round closes, against the median of the round's norms
            rnd.held[client_id] = fold
        else:
            verdict = bound.verdict(norm, bound.bound())
            self.driver.record_verdict(rnd, client_id, verdict)
            if verdict.scale == 0:
                self.lock.notify_all()  # the round may be complete now
                raise StateError(verdict.describe(client_id, rnd.number))
            fold(verdict.scale)
        rnd.aggregation_s += time.monotonic() - started

    def _folder(self, rnd: RoundInProgress, client_id: int, update: ReceivedUpdate, weight: float, labels: np.ndarray | None,
                global_state: dict[str, torch.Tensor]) -> Callable[[float], None]:
        """Folds the update into the round's running sum at a scale (1: as sent; below 1: clipped). A clipped update's
        model is not the one its client trained: its FedGen head and its SDA-FL pseudo-labels are left out."""

        if isinstance(rnd.aggregator, SecureRound):  # stage 3 of secure aggregation: the masked update, as sent
            return lambda scale: rnd.aggregator.add_masked(client_id, update.state[MASKED_KEY])  # type: ignore[union-attr]

        def fold(scale: float) -> None:
            rnd.aggregator.add(update.state, update.extra, weight, layout_checked=True, deltas=update.deltas, scale=scale)
            if scale == 1 and self.fedgen is not None:
                self.fedgen.keep_head(rnd.number, client_id, local_state(update, global_state, head_keys(update.state)))
            if scale == 1 and labels is not None and self.sdafl is not None:
                self.sdafl.commit_labels(client_id, labels)

        return fold

    def _pseudo_labels(self, client_id: int, state: dict[str, torch.Tensor]) -> np.ndarray:
        """Label this client's synthetic samples with its NEW local model (the caller has validated `state`)."""
        assert self.sdafl is not None
        local = copy.deepcopy(self.state.model)
        local.load_state_dict(state)
        return self.sdafl.pseudo_labels(client_id, local)

    # ---- shutdown ------------------------------------------------------------------------------

    def generation_reports(self) -> dict[int, dict[str, Any]]:
        return self.registry.generation_reports()

    def close_streams(self) -> None:
        """End every open dispatch stream now (shutdown), so no RPC holds the server for its whole grace period."""
        self.registry.close_all()

    def drain(self, timeout_s: float) -> None:
        """Wait (bounded) until every client stream has closed after the final message."""
        self.registry.drain(timeout_s)
