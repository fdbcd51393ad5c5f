"""Thin gRPC servicer: validate the message shape, call the federation, map domain errors to status codes."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any

import grpc
import torch

from coordinator.dispatch import Finished, TaskDelivery
from coordinator.federation import Federation
from coordinator.update_folds import FOLD_BACKLOG
from coordinator.secagg.stage_messages import answer_stage
from coordinator.receive_slots import SLOTTED_UPLOAD_BYTES, UPLOAD_SLOTS, ReceiveSlots, UploadCancelled
from coordinator.updates import header_fields
from fedsynth.wire import codec, versions
from coordinator.schema_check import Schema
from fedsynth.errors import StateError, WireError
from fedsynth.learning.evaluation import EvaluationCounts
from fedsynth.wire.raw_messages import task_message
from fedsynth.wire.tensor_buffer import ReceiveBuffers
from fedsynth.wire.transfer import receive_inline, receive_into
from fedsynth.v1 import coordinator_pb2 as pb
from fedsynth.v1 import coordinator_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = "fedsynth.v1.Coordinator"
MAX_WATCHERS = 8  # WatchRounds streams at once (the launcher's progress bar needs one): each holds a worker thread


class _Deadline:
    """Cancels an RPC still running `seconds` from now: the server's own deadline on an upload, whatever the sender
    asked for (a stream that never sends its last chunk, or its header, holds a worker thread and a receive buffer)."""

    def __init__(self, context: grpc.ServicerContext, seconds: float) -> None:
        self._timer = threading.Timer(seconds, context.cancel)
        self._timer.daemon = True
        self._timer.start()

    def close(self) -> None:
        self._timer.cancel()


def _abort_for(context: grpc.ServicerContext, exc: Exception) -> None:
    code = grpc.StatusCode.INVALID_ARGUMENT if isinstance(exc, WireError) else grpc.StatusCode.FAILED_PRECONDITION
    context.abort(code, str(exc))


def _first_header(request_iterator: Iterator[Any], refusal: str) -> Any:
    """The header that must open an upload stream (its chunks follow); WireError(refusal) otherwise."""
    first = next(request_iterator, None)
    if first is None or first.WhichOneof("kind") != "header":
        raise WireError(refusal)
    return first.header


def _receive_update(meta: codec.PayloadMeta, inline: bytes, chunks: Iterator[tuple[int, bytes]], max_bytes: int,
                    buffers: ReceiveBuffers) -> torch.Tensor:
    """An update's bytes: the chunks after its header, or its inline payload, after which the stream must end."""
    if not inline:
        return receive_into(meta, chunks, max_bytes=max_bytes, buffers=buffers)
    if next(chunks, None) is not None:
        raise WireError("an update with its payload inline in the header is followed by chunks")
    return receive_inline(meta, inline, max_bytes=max_bytes)


def _payload_fields(header: Any) -> dict[str, Any]:
    return {"total_bytes": header.payload.total_bytes, "sha256": header.payload.sha256, "num_chunks": header.payload.num_chunks,
            "xxh3_128": header.payload.xxh3_128}


def _task_messages(item: TaskDelivery) -> Iterator[pb.ServerMessage | bytes]:
    meta = pb.Payload(total_bytes=item.meta.total_bytes, sha256=item.meta.sha256, num_chunks=item.meta.num_chunks,
                      xxh3_128=item.meta.xxh3_128)
    task = pb.Task(round=item.round, task_id=item.task_id, deadline_s=item.deadline_s, generation_quota=item.quota, payload=meta,
                   data_ticket=item.ticket, evaluate=item.evaluate)
    yield task_message(task.SerializeToString(), item.payload.inline)
    yield from item.payload.messages  # none for the data plane or inline; serialized once per round, passed as bytes


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    def __init__(self, federation: Federation, heartbeat_s: float) -> None:
        self.federation = federation
        self.heartbeat_s = heartbeat_s
        # Each update being received holds a model-sized buffer: two at a time; a stalled sender's slot is bypassed
        # after the heartbeat timeout, the time after which a silent client counts as gone.
        self.receive_slots = ReceiveSlots(UPLOAD_SLOTS, bypass_after_s=federation.cfg.runtime.heartbeat_timeout_s)
        # an update buffer per slot and per place in the fold backlog, reused once its update is folded (a held update
        # or one received without a slot takes fresh memory)
        self.receive_buffers = ReceiveBuffers(keep=UPLOAD_SLOTS + FOLD_BACKLOG)
        self._watchers = threading.BoundedSemaphore(MAX_WATCHERS)

    def GetRunSpec(self, request: pb.GetRunSpecRequest, context: grpc.ServicerContext) -> pb.RunSpec:
        from fedsynth.config import to_json

        fed = self.federation
        return pb.RunSpec(run_id=fed.run_id, config_json=to_json(fed.cfg), num_clients=fed.cfg.data.clients)

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.RegisterReply:
        try:
            session = self.federation.register(
                request.client_id,
                request.num_samples,
                request.fedeas_images,
                request.missing_classes,
                request.run_id,
                request.synthetic_digest,
                request.label_counts,
                schema=Schema(request.schema_digest, request.image_channels, request.image_size),
                unknown_classes=tuple(request.unknown_classes),
                node_token=request.node_token,
                node=versions.NodeVersion(request.fedsynth_version, request.protocol_version, request.model_layout_digest),
                test_samples=request.test_samples,
            )
        except (WireError, StateError) as exc:
            _abort_for(context, exc)
        sdafl, mean_pool = self.federation.sdafl, self.federation.mean_pool
        return pb.RegisterReply(
            session=session,
            completed_rounds=self.federation.completed,
            synthetic_uploaded=sdafl is not None and sdafl.uploaded(request.client_id),
            mean_data_wanted=mean_pool is not None and mean_pool.wanted(request.client_id),
            data_port=self.federation.data_port,
        )

    def Subscribe(self, request: pb.SubscribeRequest, context: grpc.ServicerContext) -> Iterator[pb.ServerMessage]:
        try:
            outbox = self.federation.open_stream(request.client_id, request.session)
        except StateError as exc:
            _abort_for(context, exc)
        context.add_callback(lambda: self.federation.close_stream(request.client_id, outbox))
        while context.is_active():
            try:
                item = outbox.get(timeout=self.heartbeat_s)
            except queue.Empty:
                yield pb.ServerMessage(heartbeat=pb.Heartbeat(unix_time=time.time()))
                continue
            if item is None:  # superseded by a newer stream of the same client
                return
            if isinstance(item, Finished):
                yield pb.ServerMessage(finished=pb.RunFinished(reason=item.reason, success=item.success, exit_code=item.exit_code))
                return
            yield from _task_messages(item)
            if not item.ticket:  # the data plane marks its own deliveries, once the client has fetched the payload
                self.federation.mark_delivered(request.client_id, item.task_id, item.meta.total_bytes)

    def Heartbeat(self, request: pb.ClientHeartbeat, context: grpc.ServicerContext) -> pb.HeartbeatReply:
        try:
            connected = self.federation.heartbeat(request.client_id, request.session)
        except StateError as exc:
            _abort_for(context, exc)
        return pb.HeartbeatReply(connected=connected)

    def SubmitUpdate(self, request_iterator: Iterator[pb.UpdateChunk], context: grpc.ServicerContext) -> pb.SubmitReply:
        deadline = _Deadline(context, self.federation.upload_deadline_s())
        try:
            h = _first_header(request_iterator, "an update stream must start with an UpdateHeader")
            header = header_fields(h)
            large = header["total_bytes"] >= SLOTTED_UPLOAD_BYTES
            meta = codec.PayloadMeta(header["total_bytes"], header["sha256"], header["num_chunks"], header["xxh3_128"])
            chunks = self._chunks(request_iterator)
            self.federation.accept_update(
                header, lambda max_bytes: _receive_update(meta, h.inline_payload, chunks, max_bytes, self.receive_buffers),
                receiving=lambda: self.receive_slots.hold(
                    context.is_active, what=f"client {h.client_id}'s update for round {h.round}") if large else nullcontext(True))
        except UploadCancelled as exc:  # its deadline passed or it was cancelled while waiting: nothing was received
            self.federation.metrics.rejected_updates.labels(code="CANCELLED").inc()
            log.warning("update abandoned: %s", exc)
            context.abort(grpc.StatusCode.CANCELLED, str(exc))
        except (WireError, StateError) as exc:
            code = "INVALID_ARGUMENT" if isinstance(exc, WireError) else "FAILED_PRECONDITION"
            self.federation.metrics.rejected_updates.labels(code=code).inc()
            log.warning("update rejected: %s", exc)
            _abort_for(context, exc)
        except ValueError as exc:  # e.g. the aggregator's layout checks
            self.federation.metrics.rejected_updates.labels(code="INVALID_ARGUMENT").inc()
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except grpc.RpcError:  # the sender vanished mid-stream, or its deadline passed (grpcio raises from the request iterator)
            self.federation.metrics.rejected_updates.labels(code="CANCELLED").inc()
            log.warning("an update stream broke off before its last chunk; nothing of it was aggregated")
            raise
        finally:
            deadline.close()
        return pb.SubmitReply(accepted=True)

    @staticmethod
    def _chunks(
        request_iterator: Iterator[pb.UpdateChunk] | Iterator[pb.SyntheticChunk] | Iterator[pb.MeanDataChunk],
    ) -> Iterator[tuple[int, bytes]]:
        for message in request_iterator:
            if message.WhichOneof("kind") != "chunk":
                raise WireError("a stream carries one header, then only chunks")
            yield message.chunk.seq, message.chunk.data

    def UploadSynthetic(self, request_iterator: Iterator[pb.SyntheticChunk], context: grpc.ServicerContext) -> pb.UploadReply:
        try:
            h = _first_header(request_iterator, "a synthetic upload must start with a SyntheticHeader")
            header = {
                "client_id": h.client_id,
                "session": h.session,
                "count": h.count,
                "height": h.height,
                "width": h.width,
                "channels": h.channels,
                "dtype": h.dtype,
                **_payload_fields(h),
                "epsilon": h.epsilon,
                "delta": h.delta,
                "noise_multiplier": h.noise_multiplier,
                "gan_seconds": h.gan_seconds,
            }
            stored = self.federation.accept_synthetic(header, self._chunks(request_iterator))
        except (WireError, StateError) as exc:
            log.warning("synthetic upload rejected: %s", exc)
            _abort_for(context, exc)
        return pb.UploadReply(stored=stored)

    def UploadMeanData(self, request_iterator: Iterator[pb.MeanDataChunk], context: grpc.ServicerContext) -> pb.UploadReply:
        try:
            h = _first_header(request_iterator, "a mean-data upload must start with a MeanDataHeader")
            header = {
                "client_id": h.client_id,
                "session": h.session,
                "count": h.count,
                "height": h.height,
                "width": h.width,
                "channels": h.channels,
                "num_classes": h.num_classes,
                "mean_batch": h.mean_batch,
                **_payload_fields(h),
            }
            stored = self.federation.accept_mean_data(header, self._chunks(request_iterator))
        except (WireError, StateError) as exc:
            log.warning("mean-data upload rejected: %s", exc)
            _abort_for(context, exc)
        return pb.UploadReply(stored=stored)

    def SubmitEvaluation(self, request: pb.EvaluationResult, context: grpc.ServicerContext) -> pb.SubmitReply:
        try:
            try:
                counts = EvaluationCounts(request.examples, request.correct, request.loss_sum, tuple(request.class_correct),
                                          tuple(request.class_total))
            except ValueError as exc:
                raise WireError(f"client {request.client_id}'s evaluation of round {request.round}: {exc}") from exc
            self.federation.accept_evaluation(request.client_id, request.session, request.round, request.task_id, counts)
        except (WireError, StateError) as exc:
            log.warning("evaluation rejected: %s", exc)
            _abort_for(context, exc)
        return pb.SubmitReply(accepted=True)

    def ReportSetupFailure(self, request: pb.SetupFailure, context: grpc.ServicerContext) -> pb.SetupFailureReply:
        try:
            self.federation.report_setup_failure(request.client_id, request.session, request.reason)
        except (WireError, StateError) as exc:
            _abort_for(context, exc)
        return pb.SetupFailureReply()

    def ReleaseClients(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseReply:
        try:
            released = self.federation.release(list(request.client_ids), request.reason)
        except (WireError, StateError) as exc:
            _abort_for(context, exc)
        return pb.ReleaseReply(released=released)

    def SecureAggregation(self, request: pb.SecAggRequest, context: grpc.ServicerContext) -> pb.SecAggReply:
        try:
            return answer_stage(self.federation, request)
        except (WireError, StateError) as exc:
            log.warning("secure aggregation message refused: %s", exc)
            _abort_for(context, exc)
            raise  # not reached: abort raises

    def WatchRounds(self, request: pb.WatchRequest, context: grpc.ServicerContext) -> Iterator[pb.RoundSummary]:
        if not self._watchers.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{MAX_WATCHERS} WatchRounds streams are open already")
        try:
            yield from self._watch(context)
        finally:
            self._watchers.release()

    def _watch(self, context: grpc.ServicerContext) -> Iterator[pb.RoundSummary]:
        q = self.federation.watch()
        context.add_callback(lambda: self.federation.unwatch(q))
        total = self.federation.cfg.train.rounds
        while context.is_active():
            try:
                item = q.get(timeout=1.0)
            except queue.Empty:
                continue
            if item.get("finished"):
                yield pb.RoundSummary(total_rounds=total, finished=True, success=item["success"], message=item["message"],
                                      exit_code=item["exit_code"])
                return
            yield pb.RoundSummary(
                round=item["round"],
                total_rounds=total,
                accuracy=float("nan") if item["accuracy"] is None else item["accuracy"],  # a round nobody tested
                loss=float("nan") if item["loss"] is None else item["loss"],
                duration_s=item["duration_s"],
                participants=len(item["participants"]),
            )
