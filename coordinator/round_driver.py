"""The round loop: wait for registrations, then per round sample, dispatch, wait for answers, aggregate, evaluate,
checkpoint and publish."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import logging
import secrets
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from coordinator import checkpoint
from coordinator.dispatch import Finished, TaskDelivery
from coordinator.federated_evaluation import FederatedEvaluator
from coordinator.fedgen_server import FedGenServer
from coordinator.mean_pool import MeanDataPool
from coordinator.members.refusals import RefusalLedger
from coordinator.metrics import CoordinatorMetrics
from coordinator.progress import ProgressFeed
from coordinator.registry import ClientRegistry
from coordinator.rounds import RoundInProgress, quorum_size, round_phases
from coordinator.run_state import RunState
from coordinator.sdafl_server import SdaflServer
from coordinator.update_folds import UpdateFolds
from coordinator.update_norms import NormBound, Verdict
from fedsynth.wire import codec, data_plane
from fedsynth.algorithms.base import Algorithm, extra_layout, snapshot_state
from fedsynth.algorithms.robust import aggregator_for
from fedsynth.algorithms.user_dp import UserLevelDp
from coordinator.secagg.secure_round import SecureRound
from fedsynth.secagg.model_vector import round_context
from fedsynth.allocation import assigned_quota
from fedsynth.assembly import clients_per_round
from fedsynth.config import RunConfig
from fedsynth.errors import QuorumError, WireError
from fedsynth.process.runtime import EXIT_BELOW_QUORUM, EXIT_ERROR, EXIT_INTERNAL, EXIT_OK, lower_thread_priority
from fedsynth.wire.tensor_buffer import encode_parts, encode_to_buffer
from fedsynth.learning.hardware import resolve_hardware
from fedsynth.learning.training import DeviceEvaluator, TrainData
from fedsynth.wire.transfer import PreparedPayload, prepare

log = logging.getLogger(__name__)
EVALUATION_WAITS_S = 1.0  # the most a closed round's test pass waits for the next round's tasks to be out


def _finite_mean(values: list[float]) -> float | None:
    finite = [v for v in values if np.isfinite(v)]
    return float(np.mean(finite)) if finite else None


def _skeleton(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` whose parameters hold no memory (meta tensors) until real ones are assigned to it
    (`load_state_dict(..., assign=True)`); buffers (BatchNorm's statistics: small) are copied."""
    memo: dict[int, Any] = {id(p): torch.nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad) for p in model.parameters()}
    return copy.deepcopy(model, memo)


@dataclass(frozen=True)
class ClosedRound:
    """An aggregated round waiting for its evaluation: its bookkeeping (released: nothing model-sized) and the
    checkpoint to write after the test, whose global state is the model to test."""

    rnd: RoundInProgress
    closed_at: float
    saved: checkpoint.Checkpoint
    sdafl_summary: dict[str, Any]
    members: dict[str, Any]  # the round's refused updates and the clients excluded after it (coordinator.members)


class RoundDriver:
    def __init__(self, cfg: RunConfig, *, out_dir: Path, lock: threading.Condition, registry: ClientRegistry,
                 state: RunState, algorithm: Algorithm, sdafl: SdaflServer | None, metrics: CoordinatorMetrics,
                 progress: ProgressFeed, test_data: TrainData | None, mean_pool: MeanDataPool | None = None,
                 fedgen: FedGenServer | None = None, refusals: RefusalLedger | None = None,
                 user_dp: UserLevelDp | None = None) -> None:
        self.cfg = cfg
        self.out_dir = out_dir
        self.lock = lock
        self.registry = registry
        self.state = state
        self.algorithm = algorithm
        self.sdafl = sdafl
        self.metrics = metrics
        self.progress = progress
        self.test_data = test_data
        self.mean_pool = mean_pool
        self.fedgen = fedgen
        self.user_dp = user_dp  # train.dp = "user": the classifier's DP-FedAvg (its noise, epsilon and budget)
        self.current: RoundInProgress | None = None
        self.unmasking: RoundInProgress | None = None  # a secure round closed to updates, its survivors' shares awaited
        # train.evaluation "federated" / "both": the clients test closed rounds on their local test sets (counts only)
        self.federated = FederatedEvaluator(cfg, lock, registry) if cfg.train.evaluation != "server" else None
        # No test set on the coordinator (local mode without one): no server evaluation, whatever train.evaluation says
        self.server_evaluates = cfg.train.evaluation != "federated" and test_data is not None
        self.norm_bound = NormBound(cfg.runtime)
        self.refusals = refusals or RefusalLedger(cfg.runtime.max_refusals, metrics.refused_updates)
        self.folds = UpdateFolds(lock, refuse=self._refuse_folded)
        # With overlap_evaluation, round r is tested (then checkpointed and published) on this thread while
        # round r+1 already trains: the clients never wait for the coordinator's test pass. The thread runs at a lower
        # CPU priority: it must not slow the next round's transfers (on 2 cores, a ResNet-18 checkpoint written during
        # an upload made it 1.5x slower: docs/runtime.md).
        self._evaluator = (ThreadPoolExecutor(1, thread_name_prefix="evaluation", initializer=lower_thread_priority)
                           if cfg.runtime.overlap_evaluation else None)
        self._evaluating: Future[None] | None = None  # the last round submitted for evaluation (kept once done)
        # The next round's RoundInProgress.dispatched: the test pass waits (at most EVALUATION_WAITS_S) until the next
        # round's tasks are out, so it does not compete with the dispatch (K = 100: 10 ms of it)
        self._next_dispatched = threading.Event()
        self._next_dispatched.set()
        # The model a closed round is tested with: its parameters are assigned the round's checkpoint tensors (no copy);
        # one round is tested at a time.
        self._eval_model = _skeleton(state.model)
        # The global state as of the last closed round (its checkpoint's tensors, never written to): the next round
        # encodes, aggregates against and sends it without copying the model again.
        self._closed_state: dict[str, torch.Tensor] | None = None
        self._encoded_history: list[str] = []  # each concluded round's summary as JSON, for the checkpoint's record

    def run(self) -> None:
        """Play every remaining round; raises QuorumError when the run cannot go on."""
        self.norm_bound.restore(self.state.history)  # a resumed run's "auto" bound sees the rounds before it
        with self.lock:
            self.refusals.restore(self.state.history)  # and its exclusions are the run's before it
        try:
            if self.state.completed == 0 and not self.state.initial and self.server_evaluates:
                # here, not before the server binds: ResNet-18 on CIFAR's 10,000 test images takes minutes on a CPU,
                # while the clients load their data and register
                loss, acc = self._evaluate(self.state.model)
                self.state.initial = {"accuracy": acc, "loss": loss}
            self._await_registrations()
            runtime = self.cfg.runtime
            if self.sdafl is not None:
                self._await_uploads(self.sdafl, timeout_s=runtime.registration_timeout_s + runtime.round_timeout_s)
            if self.mean_pool is not None and not self.mean_pool.closed:
                self._await_uploads(self.mean_pool, timeout_s=runtime.registration_timeout_s)
                self.mean_pool.save(self.out_dir)
            for number in range(self.state.completed + 1, self.cfg.train.rounds + 1):
                if self.user_dp is not None and not self.user_dp.affords(number):
                    self._await_evaluation()
                    self.finish(Finished(self._budget_spent(number - 1), True, EXIT_OK))
                    return
                self._play_round(number)
            self._await_evaluation()
            self.finish(Finished(f"completed {self.cfg.train.rounds} rounds", True, EXIT_OK))
        except QuorumError as exc:
            self.wait_for_evaluation(timeout_s=None)  # the rounds before the failed one are kept in the checkpoint
            self.finish(Finished(str(exc), False, EXIT_BELOW_QUORUM))
            raise
        except Exception as exc:  # a bug or an unexpected failure: the clients must hear of it, not wait for a task
            self.finish(Finished(f"coordinator internal error: {type(exc).__name__}: {exc}", False, EXIT_INTERNAL))
            raise
        finally:
            self.folds.shutdown()
            if self._evaluator is not None:
                self._evaluator.shutdown(wait=False, cancel_futures=True)

    def _budget_spent(self, completed: int) -> str:
        assert self.user_dp is not None and self.user_dp.budget is not None
        return (f"privacy budget spent: {completed} of {self.cfg.train.rounds} rounds completed at epsilon "
                f"{self.user_dp.epsilon(completed):.3g}; round {completed + 1} would reach {self.user_dp.epsilon(completed + 1):.3g}, "
                f"past train.target_epsilon = {self.user_dp.budget:g}")

    def finish(self, finished: Finished) -> None:
        with self.lock:
            self.registry.finish(finished)
            self.progress.finish(finished)
        log.info("run finished: %s", finished.reason)

    # ---- before round 1 ------------------------------------------------------------------------

    def _await_uploads(self, pool: SdaflServer | MeanDataPool, *, timeout_s: float) -> None:
        """Every registered client's one-off upload (a quorum at least), before round 1."""
        with self.lock:
            registered = sorted(self.registry.clients)
        pool.await_uploads(registered, timeout_s=timeout_s, need=quorum_size(self.cfg.data.clients, self.cfg.runtime.quorum))

    def _await_registrations(self) -> None:
        """A fresh run waits for all K clients (up to registration_timeout_s). A resumed run goes on once a quorum
        is back and no client has registered for rejoin_grace_s: a client that died with the old coordinator
        must not hold the run for the whole registration timeout."""
        k = self.cfg.data.clients
        need = quorum_size(k, self.cfg.runtime.quorum)
        stop_at = time.monotonic() + self.cfg.runtime.registration_timeout_s
        resuming = self.state.completed > 0
        clients = self.registry.clients
        with self.lock:
            seen, last_change = 0, time.monotonic()
            # a refused client never comes (only this run's ids count: a refusal names any id a caller claims)
            while len(clients) + len((self.registry.refused & set(range(k))) - clients.keys()) < k:
                now = time.monotonic()
                if len(clients) != seen:
                    seen, last_change = len(clients), now
                if now >= stop_at or (resuming and seen >= need and now - last_change >= self.cfg.runtime.rejoin_grace_s):
                    break
                self.lock.wait(timeout=min(stop_at - now, 0.5))
            if len(clients) < need:
                raise QuorumError(
                    f"only {len(clients)} of {k} clients registered within "
                    f"{self.cfg.runtime.registration_timeout_s:.0f}s (quorum {need})"
                )
            if self.state.quota is None:  # a resumed run keeps the budget it started with
                self.state.quota = self._matched_quota()

    def _matched_quota(self) -> np.ndarray | None:
        """Uniform / Missing-only quotas matched to B = the FedEAS total the clients report (or generation.budget)."""
        clients = self.registry.clients.values()
        return assigned_quota(self.cfg.generation.policy, (self.cfg.data.clients, self.registry.num_classes),
                              missing={r.client_id: r.missing_classes for r in clients},
                              fedeas_totals=[r.fedeas_images for r in clients], budget=self.cfg.generation.budget)

    # ---- one round -----------------------------------------------------------------------------

    def delivery(self, rnd: RoundInProgress, client_id: int) -> TaskDelivery:
        quota = [] if self.state.quota is None else [int(v) for v in self.state.quota[client_id]]
        record = self.registry.clients.get(client_id)
        if (self.sdafl is not None or self.mean_pool is not None) and record is not None and not record.has_synthetic:
            if rnd.payload_with_images is None:
                rnd.payload_with_images = self._task_payload(rnd.global_state, with_images=True)
            payload = rnd.payload_with_images
        else:
            if not rnd.payload.ready:  # dropped once every sampled client had it: this one rejoined since
                rnd.payload = self._task_payload(rnd.global_state, with_images=False)
            payload = rnd.payload
        ticket = rnd.ticket_for(client_id) if payload.by_data_plane else b""
        return TaskDelivery(rnd.task_id, rnd.number, rnd.deadline_s, quota, payload, ticket)

    def _task_payload(self, global_state: dict[str, torch.Tensor], *, with_images: bool) -> PreparedPayload:
        """Encoded, hashed and cut into chunk messages once per round (and kind of task), whoever receives it."""
        groups = {"model": global_state, "extra": self.algorithm.server_extra(self.state.server_state)}
        if self.sdafl is not None:
            groups["synthetic"] = self.sdafl.task_groups(with_images=with_images)
        if self.mean_pool is not None:
            groups["mean"] = self.mean_pool.task_group(with_data=with_images)
        tensors = codec.join_prefixed(**groups)
        parts = encode_parts(tensors)  # the tensors' own memory: framed straight into chunk messages, no encoded copy
        runtime = self.cfg.runtime
        if runtime.data_plane == "tcp" and sum(part.nbytes for part in parts) >= runtime.data_plane_min_bytes:
            return data_plane.prepare(encode_to_buffer(tensors))  # kept for the round: a copy the model may not change
        return prepare(parts)

    def _play_round(self, number: int) -> None:
        state = self.state
        k = self.cfg.data.clients
        m = clients_per_round(self.cfg)
        drawn = sorted(int(c) for c in state.rng.choice(k, size=m, replace=False))
        with self.lock:  # an excluded or released client is drawn as before (the others' draws stay the same), sent nothing
            sampled = [c for c in drawn if c not in self.refusals.excluded and c not in self.registry.released]
        global_state = self._closed_state if self._closed_state is not None else snapshot_state(state.model)
        self._closed_state = None
        payload = self._task_payload(global_state, with_images=False)
        task_id = secrets.token_hex(8)
        rnd = RoundInProgress(
            number=number,
            task_id=task_id,
            sampled=sampled,
            payload=payload,
            aggregator=(self._secure_round(number, task_id, sampled, global_state) if self.cfg.runtime.secure_aggregation
                        else aggregator_for(self.cfg.train, self.algorithm, global_state, state.server_state, user_dp=self.user_dp,
                                            round_number=number)),
            deadline_s=self.cfg.runtime.round_timeout_s,
            need=quorum_size(m, self.cfg.runtime.quorum),
            global_state=global_state,
            dispatched=self._next_dispatched,
        )
        with self.lock:
            self.current = rnd
            for client_id in sampled:
                if self.registry.is_connected(client_id):
                    self.registry.send(client_id, self.delivery(rnd, client_id))
        log.info("round %d: sampled %s", number, sampled)
        self._wait_for_answers(rnd)
        self.folds.wait_for(rnd)
        closed_at = time.monotonic()
        with self.lock:
            self.current = None
            self.unmasking = rnd if isinstance(rnd.aggregator, SecureRound) else None  # its survivors still send shares
        started = time.monotonic()
        self._settle_held(rnd)
        if self.norm_bound.enabled:
            self.norm_bound.remember(rnd.norms, [*rnd.refused, *rnd.clipped])
        with self.lock:
            members = self.refusals.close_round(number, rnd.sampled, rnd.answered)
            for excluded in members["excluded"]:  # its stream ends with its own line; the run goes on without it
                self.registry.send(excluded["client"], Finished(f"excluded from the run: {excluded['reason']}", False, EXIT_ERROR))
        if rnd.aggregator.count < rnd.need:  # refused updates do not count towards the quorum
            raise QuorumError(f"round {number}: {rnd.aggregator.count} of {len(rnd.sampled)} sampled clients' updates were "
                              f"aggregated, {len(rnd.refused)} refused; quorum is {rnd.need}")
        try:
            new_global, state.server_state = rnd.aggregator.finish()
        finally:
            self.unmasking = None
        if isinstance(rnd.aggregator, SecureRound):  # who survived, and what unmasking them cost
            members = {**members, "secure_aggregation": rnd.aggregator.summary()}
        if getattr(rnd.aggregator, "evolution_figures", None):  # Private Evolution: the draw and the variations' strength
            members = {**members, "evolution": rnd.aggregator.evolution_figures}  # type: ignore[attr-defined]
        state.model.load_state_dict(new_global)
        del new_global, global_state, payload
        rnd.release()  # the running sum, the payload and the old global state go now, not after the evaluation
        rnd.aggregation_s += time.monotonic() - started
        sdafl_summary = self.sdafl.after_aggregation(state.model, number) if self.sdafl is not None else {}
        if self.fedgen is not None:  # FedGen: train the feature generator on this round's heads (goes out next round)
            with self.lock:
                counts = {c: r.label_counts for c, r in self.registry.clients.items()}
            state.server_state, fedgen_summary = self.fedgen.after_aggregation(state.server_state, counts, number, device=self.device)
            sdafl_summary = {**sdafl_summary, **fedgen_summary}
        state.completed = number
        closed = ClosedRound(rnd, closed_at, state.snapshot(self.sdafl), sdafl_summary, members)
        self._closed_state = closed.saved.global_state
        self._await_evaluation()  # round r-1's (long done, normally): its errors surface here, in order
        if self._evaluator is None:
            self._conclude(closed)
        else:
            self._next_dispatched = threading.Event()
            self._evaluating = self._evaluator.submit(self._conclude_once_dispatched, closed, self._next_dispatched)

    def _secure_round(self, number: int, task_id: str, sampled: list[int], global_state: dict[str, torch.Tensor]) -> SecureRound:
        """Round `number`'s secure aggregation: weights N_k as registered (1 each under train.dp = "user")."""
        runtime = self.cfg.runtime
        with self.lock:
            weights = {c: self.registry.clients[c].num_samples for c in sampled}
        return SecureRound(global_state, sampled=sampled, weights=weights, lock=self.lock,
                           context=round_context(self.state.run_id, number, task_id), neighbours=runtime.secagg_neighbours,
                           threshold=runtime.secagg_threshold, clip=runtime.secagg_clip,
                           stage_timeout_s=runtime.secagg_stage_timeout_s, round_timeout_s=runtime.round_timeout_s,
                           dp=self.user_dp, missed=self._missed_stage, algorithm=self.algorithm,
                           server_state=self.state.server_state, extra_layout=extra_layout(self.algorithm, self.state.model))

    def _missed_stage(self, client_id: int, why: str) -> None:
        """A sampled client that missed a key-exchange stage cannot send a masked update: the round stops waiting."""
        rnd = self.current
        if rnd is not None and rnd.awaits(client_id):
            rnd.refused[client_id] = why
            log.warning("round %d: client %d %s", rnd.number, client_id, why)

    def record_verdict(self, rnd: RoundInProgress, client_id: int, verdict: Verdict) -> None:
        """Log, count and note in the round an update past the bound (the caller folds it or refuses it)."""
        rnd.norm_bound = verdict.bound
        self.metrics.update_norm_bound.set(verdict.bound)
        if verdict.action == "accepted":
            return
        self.metrics.update_norm_exceeded.labels(action=verdict.action).inc()
        log.warning("%s", verdict.describe(client_id, rnd.number))
        if verdict.action == "refused":
            rnd.refused[client_id] = verdict.describe(client_id, rnd.number)
            self.refusals.refuse(rnd.number, client_id, rnd.refused[client_id], reason="norm")
        else:
            rnd.clipped.append(client_id)

    def _settle_held(self, rnd: RoundInProgress) -> None:
        """runtime.max_update_norm = "auto": judge the round's held updates against factor x the median of their norms,
        then fold them (in client order: the same sum whatever order they arrived in). The round is no longer current:
        nothing else touches it."""
        if not rnd.held:
            return
        bound = self.norm_bound.bound([rnd.norms[c] for c in rnd.held])
        for client_id, fold in sorted(rnd.held.items()):
            verdict = self.norm_bound.verdict(rnd.norms[client_id], bound)
            self.record_verdict(rnd, client_id, verdict)
            if verdict.scale == 0:
                del rnd.answered[client_id]  # its client was told its update was taken: only the log and metrics say otherwise
                continue
            try:
                fold(verdict.scale)
            except (WireError, ValueError) as exc:  # checked only now that it is folded: left out, as a refused update
                with self.lock:
                    self._refuse_folded(rnd, client_id, f"round {rnd.number}: client {client_id}'s update could not be folded: {exc}")
        rnd.held = {}

    def _refuse_folded(self, rnd: RoundInProgress, client_id: int, message: str) -> None:
        """An update taken (its client was told so) that the fold refused: left out of the round, and named. Under the
        lock; the aggregator raised before it changed its sums."""
        log.warning("%s: left out of the round", message)
        rnd.answered.pop(client_id, None)
        rnd.refused[client_id] = message
        self.refusals.refuse(rnd.number, client_id, message, reason="fold")

    def wait_for_evaluation(self, timeout_s: float | None) -> None:
        """When the run is ending anyway: let the round under test reach its checkpoint; its errors are only logged."""
        self._next_dispatched.set()  # no next round to wait for
        evaluating = self._evaluating
        if evaluating is not None:
            try:
                evaluating.result(timeout=timeout_s)
            except Exception:  # the run ends with its own error; this one must not hide it
                log.exception("the evaluation of the last aggregated round did not finish")

    @property
    def checkpointed(self) -> int:
        """Rounds recorded in the checkpoint (aggregated rounds may still be under test)."""
        with self.lock:
            return len(self.state.history)

    def _await_evaluation(self) -> None:
        """Wait for the last submitted round's evaluation; its error is raised here, in the round loop."""
        self._next_dispatched.set()  # the round it waited for is over (or there is none)
        if self._evaluating is not None:
            self._evaluating.result()

    def _conclude_once_dispatched(self, closed: ClosedRound, dispatched: threading.Event) -> None:
        dispatched.wait(timeout=EVALUATION_WAITS_S)
        self._conclude(closed)

    def _conclude(self, closed: ClosedRound) -> None:
        """Test the round's model, then record, checkpoint and publish the round (rounds conclude in order)."""
        rnd = closed.rnd
        started = time.monotonic()
        federated = None
        if self.federated is not None and self.federated.due(rnd.number):  # out first: the clients test while we do
            federated = self.federated.start(rnd.number, closed.saved.global_state)
        loss: float | None = None
        acc: float | None = None
        if self.server_evaluates:
            self._eval_model.load_state_dict(closed.saved.global_state, assign=True)  # shares the checkpoint's tensors
            loss, acc = self._evaluate(self._eval_model)
        figures = self.federated.collect(federated) if self.federated is not None and federated is not None else None
        if not self.server_evaluates and figures is not None:  # "federated": the round's accuracy is the clients'
            loss, acc = figures["loss"], figures["weighted_accuracy"]
        phases = round_phases(rnd, closed.closed_at, time.monotonic() - started)
        summary = {
            "round": rnd.number,
            "accuracy": acc,
            "loss": loss,
            "duration_s": time.monotonic() - rnd.started,
            "participants": sorted(rnd.answered),
            "sampled": rnd.sampled,
            "phases_s": phases,
            "bytes_sent": rnd.bytes_sent,
            "bytes_received": rnd.bytes_received,
            "train_loss": _finite_mean([a["train_loss"] for a in rnd.answered.values()]),
            **closed.sdafl_summary,
            **({"federated_evaluation": figures} if figures is not None else {}),
            **{key: value for key, value in closed.members.items() if value},
        }
        if self.user_dp is not None:  # the classifier's epsilon so far
            summary["privacy"] = self.user_dp.report(rnd.number)
        elif self.cfg.train.algorithm in ("ddpm", "pe"):  # a generator's run: epsilon so far (and ddpm's updates' norms)
            summary["privacy"] = self.algorithm.privacy_report(rnd.number, *self.participation(history=[*self.state.history, summary]))  # type: ignore[attr-defined]
        if self.norm_bound.enabled:
            summary["update_norms"] = {
                "bound": rnd.norm_bound,
                "median": float(np.median(list(rnd.norms.values()))) if rnd.norms else None,
                "norms": {str(c): n for c, n in sorted(rnd.norms.items())},
                "clipped": sorted(rnd.clipped),
                "refused": sorted(rnd.refused),
            }
        # Only this thread appends to the history, so it may read it unlocked; the round enters the history (and
        # watchers hear of it) only once its checkpoint is on disk, both under the lock so no watcher sees it twice.
        history = [*self.state.history, summary]
        if len(self._encoded_history) != len(self.state.history):  # a resumed run: its history so far, encoded once
            self._encoded_history = [json.dumps(entry) for entry in self.state.history]
        self._encoded_history.append(json.dumps(summary))
        checkpoint.save(self.out_dir, dataclasses.replace(closed.saved, record={**closed.saved.record, "history": history},
                                                          encoded_history=tuple(self._encoded_history)))
        with self.lock:
            self.state.history.append(summary)
            self.progress.publish(summary)
        self.metrics.observe_round(summary)
        log.info("round %d: accuracy %s loss %s (%d/%d answered)", rnd.number, _fmt(acc), _fmt(loss), len(rnd.answered), len(rnd.sampled))
        if figures is not None:
            log.info("round %d: federated accuracy %s (weighted), mean %s, worst %s (client %s), p10 %s", rnd.number,
                     figures["weighted_accuracy"], figures["mean_accuracy"], figures["worst_accuracy"], figures["worst_client"],
                     figures["p10_accuracy"])

    def _evaluate(self, model: torch.nn.Module) -> tuple[float, float]:
        """(loss, accuracy) on the test set, on train.device at train.precision (a replica of the CPU model there); an
        algorithm with an `evaluate` of its own (the generator's: federate.device) decides."""
        own = getattr(self.algorithm, "evaluate", None)
        if own is not None:
            return own(model, self.test_data, self.cfg.train.eval_batch_size)  # type: ignore[no-any-return]
        return self._device_evaluate(model, self.test_data, self.cfg.train.eval_batch_size)

    @functools.cached_property
    def device(self) -> torch.device:
        """train.device on this coordinator (coordinator.main has checked it before the server bound)."""
        return resolve_hardware(self.cfg.train.device, self.cfg.train.precision)

    @functools.cached_property
    def _device_evaluate(self) -> DeviceEvaluator:
        return DeviceEvaluator(self.device, self.cfg.train.precision)

    def participation(self, history: list[dict[str, Any]] | None = None) -> tuple[dict[int, int], dict[int, int]]:
        """(rounds each client was sampled in, each registered client's N_k): what per-client privacy accounting needs.
        A sampled client may have trained (and spent privacy) even where its update was refused, late or lost, so every
        round it was handed a task counts: an upper bound, never an undercount."""
        answered: dict[int, int] = {}
        for summary in self.state.history if history is None else history:
            for client in summary["sampled"]:
                answered[client] = answered.get(client, 0) + 1
        with self.lock:
            sizes = {client: record.num_samples for client, record in self.registry.clients.items()}
        return answered, sizes

    def _wait_for_answers(self, rnd: RoundInProgress) -> None:
        grace = self.cfg.runtime.rejoin_grace_s
        unreachable_since: float | None = None
        with self.lock:
            while not rnd.complete:
                now = time.monotonic()
                if rnd.expired:
                    if len(rnd.answered) >= rnd.need:
                        log.warning("round %d: deadline reached; closing with %d/%d answers", rnd.number, len(rnd.answered), len(rnd.sampled))
                        return
                    raise QuorumError(
                        f"round {rnd.number}: {len(rnd.answered)} of {len(rnd.sampled)} sampled clients answered "
                        f"within {rnd.deadline_s:.0f}s; quorum is {rnd.need}"
                    )
                heartbeat_timeout_s = self.cfg.runtime.heartbeat_timeout_s
                if any(self.registry.is_reachable(c, heartbeat_timeout_s) for c in rnd.pending):
                    unreachable_since = None
                else:
                    unreachable_since = unreachable_since or now
                    # The grace runs from when the last of them was lost, which may be rounds ago: a client gone for
                    # good costs one grace, not one per round that samples it.
                    lost = [self.registry.unreachable_since(c, heartbeat_timeout_s) for c in rnd.pending]
                    if all(t is not None for t in lost):
                        unreachable_since = min(unreachable_since, max(t for t in lost if t is not None))
                    if now - unreachable_since >= grace:
                        if len(rnd.answered) >= rnd.need:
                            log.warning("round %d: clients %s gone; closing with the quorum", rnd.number, sorted(rnd.pending))
                            return
                        raise QuorumError(
                            f"round {rnd.number}: only {len(rnd.answered)} answered and clients {sorted(rnd.pending)} "
                            f"have been unreachable for {grace:.0f}s; quorum is {rnd.need} of {len(rnd.sampled)}"
                        )
                self.lock.wait(timeout=0.25)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"
