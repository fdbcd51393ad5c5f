"""One logical client: register, wait for pushed tasks, generate once, train, upload (or test the global model on its
local test set and send counts); reconnect when the link drops."""

from __future__ import annotations

import logging
import secrets
import ssl
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc
import numpy as np
import torch

from client_node.fedmix_client import mean_data, pool_from_group, upload_mean_data
from client_node.heartbeats import send_heartbeats
from client_node.metrics import ClientMetrics
from client_node.sdafl_client import ensure_samples, report_failure, upload
from client_node.synthesis import SyntheticSet, fedeas_total, synthesize
from client_node.uploads import payload_message, stream_upload
from client_node.secure_update import join_secure_round, masked_update, unmask
from fedsynth.algorithms.user_dp import UserLevelDp, clip_to_move
from fedsynth.secagg.errors import SecAggError
from fedsynth.wire import codec, data_plane, grpcutil, versions, wire_dtype
from fedsynth.assembly import (
    algorithm_for,
    client_seed,
    client_shard,
    local_test_split,
    local_train_config,
    model_for,
    round_generator,
    user_dp_for,
)
from fedsynth.config import RunConfig, from_json
from fedsynth.errors import ID_CLAIMED, ConfigError, DataError, FedsynthError, StopRequested, WireError
from fedsynth.learning.data import ArrayDataset
from fedsynth.learning.label_schema import schema_of
from fedsynth.learning.local_data import load_client_data
from fedsynth.wire.raw_messages import submit_update_call, subscribe_call, upload_call
from fedsynth.wire.server_check import ServerUnreachable, check_servers, refused
from fedsynth.wire.tls import PeerIdentity, RevocationList, TLSFiles
from fedsynth.process.runtime import EXIT_BELOW_QUORUM, EXIT_ERROR, EXIT_OK
from fedsynth.wire.tensor_buffer import ReceiveBuffers, decode_views, encode_parts
from fedsynth.learning.evaluation import count_predictions
from fedsynth.learning.training import TrainData, images_to_tensor
from fedsynth.wire.transfer import receive_inline, receive_into
from fedsynth.v1 import coordinator_pb2 as pb
from fedsynth.v1 import coordinator_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
RPC_TIMEOUT_S = 30.0
NODE_TOKEN = secrets.token_hex(8)  # this process's: the coordinator tells a reconnect from a second node claiming an id
CLAIM_MARGIN_S = 10.0  # past runtime.heartbeat_timeout_s: how long a restarted node waits for its old session to go
SUBSCRIBE_TIMEOUT_S = 3600.0  # the dispatch stream is renewed after an hour; keepalive notices a dead peer much sooner


@dataclass(frozen=True)
class NodeOptions:
    coordinator: str
    generator: str | None
    cache_dir: Path
    reconnect_timeout_s: float = 300.0
    credentials: grpc.ChannelCredentials | None = None
    data_plane_tls: ssl.SSLContext | None = None  # the same identity as `credentials`, for the coordinator's data plane
    tls_files: TLSFiles | None = None  # the pair behind `credentials`: checking the servers' certificates
    revoked: RevocationList | None = None  # refuse a coordinator or generator whose certificate it lists
    data_path: Path | None = None  # local mode (data.source = "local"): this client's own data (`--data`)
    # The process's global-model receive buffers, shared by its logical clients: reused once the last round's views
    # are gone (fresh memory otherwise).
    receive_buffers: ReceiveBuffers | None = None


@dataclass
class ClientState:
    """What a client keeps across rounds and reconnections."""

    cfg: RunConfig
    real_x: np.ndarray
    real_y: np.ndarray
    # Local mode: the client's own test split (its folder's test/), kept for federated evaluation; None without one.
    local_test: ArrayDataset | None = None
    # What registration reports about the label schema: the digest the data was written for, its image channels and
    # side, and class names the data holds that the schema lacks.
    schema_digest: str = ""
    image_channels: int = 0
    image_size: int = 0
    unknown_classes: tuple[str, ...] = ()
    data: TrainData | None = None
    synthetic: SyntheticSet | None = None
    algorithm_state: dict[str, torch.Tensor] = field(default_factory=dict)
    shared_images: np.ndarray | None = None  # SDA-FL: the coordinator's synthetic set, received once
    shared_digest: str = ""
    mean_pool: tuple[torch.Tensor, torch.Tensor] | None = None  # FedMix / NaiveMix: the pooled means, received once
    run_id: str = ""  # the coordinator's (its config's fingerprint): secure aggregation binds its keys and masks to it
    user_dp: UserLevelDp | None = None  # train.dp = "user" with secure aggregation: this client adds its share of the noise
    test: TrainData | None = None  # federated evaluation: the local test set (never trained on, never sent)


class RunEnded(Exception):
    def __init__(self, success: bool, reason: str, exit_code: int) -> None:
        super().__init__(reason)
        self.success = success
        # The coordinator's exit code; a coordinator that predates the field sends 0 on failure too.
        self.exit_code = exit_code if exit_code or success else EXIT_BELOW_QUORUM


class LogicalClient:
    def __init__(self, client_id: int, options: NodeOptions, metrics: ClientMetrics, stop: threading.Event) -> None:
        self.client_id = client_id
        self.options = options
        self.metrics = metrics
        self.stop = stop
        self.state: ClientState | None = None
        self._call: grpc.Future | None = None  # the blocking call in flight (run-spec wait or dispatch stream)
        self._data_plane: data_plane.Endpoint | None = None  # announced at registration (runtime.data_plane = "tcp")
        # the certificates of every address behind --coordinator (each of a dns:/// name), when a revocation list is checked
        self._coordinator_identities: list[PeerIdentity] = []

    def cancel(self) -> None:
        """Break out of the blocking call in flight: the wait for a ready coordinator or the dispatch stream (on SIGTERM)."""
        call = self._call
        if call is not None:
            call.cancel()

    def run(self) -> int:
        channel = grpcutil.make_channel(self.options.coordinator, self.options.credentials)
        stub = pb_grpc.CoordinatorStub(channel)
        self._submit_update = submit_update_call(channel)  # sends chunk messages serialized by hand, as they are
        self._subscribe = subscribe_call(channel)  # chunk messages parsed by hand: views of the received bytes
        self._upload_synthetic = upload_call(channel, "UploadSynthetic")
        self._upload_mean_data = upload_call(channel, "UploadMeanData")
        lost_since: float | None = None
        try:
            while not self.stop.is_set():
                try:
                    self._session(stub)
                except RunEnded as ended:
                    log.log(logging.INFO if ended.success else logging.ERROR, "client %d: run over (%s)", self.client_id, ended)
                    return ended.exit_code
                except StopRequested as stopped:  # nothing was uploaded; the synthetic cache is written atomically
                    log.info("client %d: %s", self.client_id, stopped)
                    break
                except (grpc.RpcError, ServerUnreachable) as exc:
                    if self.stop.is_set():
                        break
                    code = exc.code() if isinstance(exc, grpc.Call) else None
                    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
                        log.error("client %d: refused by the coordinator: %s", self.client_id, exc.details())
                        return EXIT_ERROR
                    lost_since = lost_since or time.monotonic()
                    if time.monotonic() - lost_since > self.options.reconnect_timeout_s:
                        log.error("client %d: coordinator unreachable for %.0fs; giving up", self.client_id, self.options.reconnect_timeout_s)
                        return EXIT_ERROR
                    log.info("client %d: link lost (%s: %s); reconnecting", self.client_id, code, exc.details() if isinstance(exc, grpc.Call) else exc)
                    self.metrics.reconnects.inc()
                    self.stop.wait(np.random.default_rng().uniform(0.1, 1.0))
                else:
                    lost_since = None
            return EXIT_OK
        finally:
            channel.close()

    # ---- one registration session -------------------------------------------------------------

    def _session(self, stub: pb_grpc.CoordinatorStub) -> None:
        spec = self._run_spec(stub)
        self._check_coordinator()
        if self.state is None:
            self.state = self._prepare(from_json(spec.config_json))
            self.state.run_id = spec.run_id
            if self.state.cfg.runtime.secure_aggregation:
                self.state.user_dp = user_dp_for(self.state.cfg)
        cfg = self.state.cfg
        counts = np.bincount(self.state.real_y, minlength=self.num_classes)
        request = pb.RegisterRequest(
            client_id=self.client_id,
            num_samples=len(self.state.real_y),
            fedeas_images=fedeas_total(cfg, counts),
            missing_classes=[int(c) for c in np.flatnonzero(counts == 0)] if cfg.generation.policy == "missing" else [],
            run_id=spec.run_id,
            synthetic_digest=self.state.shared_digest,
            label_counts=[int(c) for c in counts] if cfg.train.algorithm == "fedgen" else [],
            schema_digest=self.state.schema_digest,
            image_channels=self.state.image_channels,
            image_size=self.state.image_size,
            unknown_classes=list(self.state.unknown_classes),
            node_token=NODE_TOKEN,
            **versions.registration_fields(self.model.state_dict()),
            test_samples=0 if self.state.test is None else len(self.state.test),
        )
        reply = self._register(stub, request, cfg)
        if cfg.train.algorithm == "sdafl" and not reply.synthetic_uploaded:
            try:
                images, privacy = ensure_samples(
                    cfg, self.client_id, self.state.real_x, self.options.cache_dir,
                    timeout_s=cfg.runtime.registration_timeout_s, torch_threads=torch.get_num_threads(), should_stop=self.stop.is_set,
                )
            except StopRequested:
                raise
            except FedsynthError as failure:
                report_failure(stub, self.client_id, reply.session, failure, timeout_s=RPC_TIMEOUT_S)
                raise
            upload(self._upload_synthetic, self.client_id, reply.session, images, privacy, timeout_s=RPC_TIMEOUT_S * 4)
        if reply.mean_data_wanted:
            mean_batch = int(getattr(self.algorithm, "mean_batch"))
            means_x, means_y = mean_data(self.state.real_x, self.state.real_y, num_classes=self.num_classes, mean_batch=mean_batch,
                                         seed=client_seed(cfg, self.client_id, "fedmix-means") % (2**32))
            upload_mean_data(self._upload_mean_data, self.client_id, reply.session, means_x, means_y, mean_batch=mean_batch,
                             timeout_s=RPC_TIMEOUT_S * 4)
        self._data_plane = None if not reply.data_port else data_plane.Endpoint(
            data_plane.host_of(self.options.coordinator), reply.data_port, self.options.data_plane_tls)
        log.info("client %d: registered (N_k=%d, %d rounds done)", self.client_id, len(self.state.real_y), reply.completed_rounds)
        stream = self._subscribe(pb.SubscribeRequest(client_id=self.client_id, session=reply.session), timeout=SUBSCRIBE_TIMEOUT_S)
        self._call = stream
        beating = threading.Event()
        heartbeats = threading.Thread(target=send_heartbeats, name=f"heartbeat-{self.client_id}", daemon=True,
                                      args=(stub, self.client_id, reply.session, cfg.runtime.heartbeat_s, beating))
        heartbeats.start()
        try:
            for message in stream:
                kind = message.WhichOneof("kind")
                if kind == "heartbeat":
                    continue
                if kind == "finished":
                    raise RunEnded(message.finished.success, message.finished.reason, message.finished.exit_code)
                if kind != "task":
                    raise WireError(f"expected a task header, got {kind}")
                self._recheck_coordinator()
                if message.task.evaluate:
                    self._do_evaluation(stub, reply.session, message.task, stream)
                else:
                    self._do_task(stub, reply.session, message.task, stream)
        except grpc.RpcError as exc:
            if isinstance(exc, grpc.Call) and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return  # renew the dispatch stream
            raise
        finally:
            beating.set()
            # Joined (its call has half a period to answer): a thread left inside a gRPC call when the interpreter
            # exits makes gRPC's core abort the process ("terminate called without an active exception").
            heartbeats.join(timeout=cfg.runtime.heartbeat_s)
            self._call = None
            stream.cancel()

    def _run_spec(self, stub: pb_grpc.CoordinatorStub) -> pb.RunSpec:
        """The run's spec, waiting for the coordinator to be ready; a SIGTERM during that wait ends it at once."""
        call = stub.GetRunSpec.future(pb.GetRunSpecRequest(), timeout=RPC_TIMEOUT_S, wait_for_ready=True)
        self._call = call
        try:
            if self.stop.is_set():  # a cancel() that came before the call was published
                call.cancel()
            return call.result()
        except grpc.FutureCancelledError:
            raise StopRequested("stopped while waiting for the coordinator") from None
        finally:
            self._call = None

    def _register(self, stub: pb_grpc.CoordinatorStub, request: pb.RegisterRequest, cfg: RunConfig) -> pb.RegisterReply:
        """Register; a refusal (FAILED_PRECONDITION: e.g. data.max_samples_per_client) is final, except that another
        node holds this client id: that may be this node's previous process, killed, whose session the coordinator
        drops after runtime.heartbeat_timeout_s of silence, so it is retried with backoff until that long (and a
        margin) has passed, and final only if the other node is still heard from then."""
        give_up_at: float | None = None
        for delay in grpcutil.backoff_delays(initial_s=0.5, maximum_s=2.0):
            try:
                return stub.Register(request, timeout=RPC_TIMEOUT_S)
            except grpc.RpcError as exc:
                if not (isinstance(exc, grpc.Call) and exc.code() == grpc.StatusCode.FAILED_PRECONDITION):
                    raise
                refusal = exc.details() or ""
            if ID_CLAIMED in refusal and give_up_at is None:
                wait_s = cfg.runtime.heartbeat_timeout_s + CLAIM_MARGIN_S
                give_up_at = time.monotonic() + wait_s
                log.warning("client %d: another node holds client id %d (%s); waiting up to %.0fs in case it is this "
                            "node's previous process, killed, whose session then times out", self.client_id, self.client_id,
                            refusal, wait_s)
            if give_up_at is None or time.monotonic() + delay > give_up_at:
                raise RunEnded(False, f"registration refused: {refusal}", EXIT_ERROR)
            if self.stop.wait(delay):
                raise StopRequested(f"stopped while waiting for client id {self.client_id} to be free")
        raise AssertionError("unreachable")

    def _check_coordinator(self) -> None:
        """With a revocation list: the coordinator's certificate, read in a handshake of our own on every (re)connection
        (gRPC does not show a client its server's certificate), must not be revoked (RevokedServer ends the client)."""
        if self.options.revoked is None or self.options.tls_files is None:
            return
        self._coordinator_identities = check_servers(self.options.coordinator, self.options.tls_files, self.options.revoked,
                                                     what="coordinator", timeout_s=RPC_TIMEOUT_S)

    def _recheck_coordinator(self) -> None:
        """Before each task: the revocation list (re-read if it changed) against every coordinator certificate seen."""
        if self.options.revoked is None:
            return
        for identity in self._coordinator_identities:
            refused(identity, self.options.revoked, what=f"coordinator at {self.options.coordinator}")

    def _prepare(self, cfg: RunConfig) -> ClientState:
        """Load this client's data: its shard of the run's dataset (split mode) or its own folder (local mode), and
        choose its local test examples for federated evaluation."""
        schema = schema_of(cfg.data)
        if cfg.data.source == "local":
            if self.options.data_path is None or schema is None:
                raise ConfigError(f"client {self.client_id}: the run's data.source is \"local\" but this node got no --data "
                                  f"for client {self.client_id}")
            local = load_client_data(self.options.data_path, schema, client_id=self.client_id, min_size=cfg.data.min_size,
                                     cache_dir=self.options.cache_dir / "data", max_image_pixels=cfg.data.max_image_pixels,
                                     follow_symlinks=cfg.data.follow_symlinks)
            full, own_test, channels, size = local.train, local.test, schema.channels, schema.image_size
            described = (local.schema_digest, full.x.shape[3], full.x.shape[1], local.unknown_classes)
            log.info("client %d: loaded %d training and %d test images (%s) from %s", self.client_id, len(full.y),
                     0 if own_test is None else len(own_test.y), local.format, self.options.data_path)
        else:
            if self.options.data_path is not None:
                raise DataError(f"client {self.client_id}: --data was given but the run's data.source is \"split\" "
                                "(set data.source = \"local\" in the run config)")
            full, own_test = client_shard(cfg, self.client_id), None
            channels, size = full.image_shape[0], full.image_shape[1]
            described = (schema.digest() if schema is not None else "", channels, size, ())
        shard, test = local_test_split(cfg, self.client_id, full, own_test=own_test)
        self.model = model_for(cfg, num_classes=shard.num_classes, in_channels=channels, image_size=size)
        self.layout = codec.layout_of(self.model.state_dict())
        self.algorithm = algorithm_for(cfg)
        self.num_classes = shard.num_classes
        test_data = None if test is None else TrainData(images_to_tensor(test.x), torch.as_tensor(test.y, dtype=torch.int64))
        return ClientState(cfg, shard.x, shard.y, own_test, *described, test=test_data)

    # ---- one task ------------------------------------------------------------------------------

    def _receive_payload(self, task: pb.Task, stream: Iterator[pb.ServerMessage]) -> dict[str, dict[str, torch.Tensor]]:
        def chunks() -> Iterator[tuple[int, bytes | memoryview]]:
            received = 0
            while received < task.payload.num_chunks:
                message = next(stream)
                if message.WhichOneof("kind") == "heartbeat":
                    continue
                if message.WhichOneof("kind") != "chunk":
                    raise WireError(f"expected payload chunk {received}, got {message.WhichOneof('kind')}")
                received += 1
                yield message.chunk.seq, message.chunk.data

        meta = codec.meta_of(task.payload)
        if task.data_ticket:
            buffer = data_plane.fetch(self._endpoint(), task.data_ticket, timeout_s=max(RPC_TIMEOUT_S, task.deadline_s),
                                      buffers=self.options.receive_buffers)
        elif task.inline_payload:
            buffer = receive_inline(meta, task.inline_payload)
        else:
            buffer = receive_into(meta, chunks(), buffers=self.options.receive_buffers)
        self.metrics.bytes_received.inc(buffer.numel())
        return codec.split_prefixed(decode_views(buffer))

    def _do_task(self, stub: pb_grpc.CoordinatorStub, session: str, task: pb.Task, stream: Iterator[pb.ServerMessage]) -> None:
        assert self.state is not None
        cfg = self.state.cfg
        groups = self._receive_payload(task, stream)
        global_state = groups.get("model", {})
        codec.check_like(global_state, self.layout, what="global model from the coordinator")
        self.model.load_state_dict(global_state)

        secure = None
        if cfg.runtime.secure_aggregation:  # SecAgg+'s key stages first: a client that misses them need not train
            try:
                secure = join_secure_round(stub, client_id=self.client_id, session=session, task=task, run_id=self.state.run_id,
                                           clip=cfg.runtime.secagg_clip, timeout_s=cfg.runtime.secagg_stage_timeout_s + RPC_TIMEOUT_S)
            except (grpc.RpcError, SecAggError) as exc:
                if isinstance(exc, grpc.RpcError) and not _refused(exc):
                    raise
                log.warning("client %d: round %d: left out of secure aggregation: %s", self.client_id, task.round, _details(exc))
                return

        generation_report = None
        if self.state.data is None:
            started = time.monotonic()
            self.state.synthetic = synthesize(
                cfg, self.client_id, self.state.real_y, self.num_classes, list(task.generation_quota), self.options, self.metrics,
                stop=self.stop, real_shape=(self.state.real_x.shape[3], *self.state.real_x.shape[1:3]),
            )
            x, y = self.state.real_x, self.state.real_y
            if self.state.synthetic.count:
                x = np.concatenate([x, self.state.synthetic.x])
                y = np.concatenate([y, self.state.synthetic.y])
            self.state.data = TrainData(images_to_tensor(x), torch.as_tensor(y, dtype=torch.int64))
            self.metrics.images_held.inc(self.state.synthetic.count)
            wall = time.monotonic() - started
            generation_report = pb.GenerationReport(
                images=self.state.synthetic.count,
                wall_seconds=wall,
                cache_hit=self.state.synthetic.cache_hit,
            )

        log.info("client %d: round %d: training on %d samples", self.client_id, task.round, len(self.state.data))
        started = time.monotonic()
        update = self.algorithm.client_update(
            model=self.model,
            data=self.state.data,
            cfg=replace(local_train_config(cfg, task.round), should_stop=self.stop.is_set),
            server_extra={**groups.get("extra", {}), **self._shared_synthetic(groups.get("synthetic")), **self._mean_pool(groups.get("mean"))},
            client_state=self.state.algorithm_state,
            generator=round_generator(cfg, self.client_id, task.round),
        )
        train_seconds = time.monotonic() - started
        if cfg.train.dp == "user":  # clipped here AND on the coordinator: an honest client's update arrives as it will count
            update = replace(update, state=clip_to_move(update.state, global_state, cfg.train.dp_clip))
        self.state.algorithm_state = update.client_state
        self.metrics.train_seconds.observe(train_seconds)
        batch_size = cfg.federate.batch_size if cfg.train.algorithm == "ddpm" else cfg.train.batch_size
        self.metrics.samples_per_second.set(update.num_steps * batch_size / max(train_seconds, 1e-9))

        if secure is not None:  # the round's coordinator sees this vector only masked, and only in the survivors' sum
            try:
                masked = masked_update(secure, update.state, global_state, self.state.user_dp, update.extra)
            except SecAggError as exc:  # e.g. fewer sealed shares reached it than the threshold: it cannot mask
                log.warning("client %d: round %d: cannot mask its update: %s", self.client_id, task.round, exc)
                return
            outgoing = codec.join_prefixed(model=masked, extra={})
        else:
            model_group, extra_group = wire_dtype.outgoing(update.state, update.extra, global_state, cfg.runtime.wire_dtype)
            outgoing = codec.join_prefixed(model=model_group, extra=extra_group)
            del model_group, extra_group
        parts = encode_parts(outgoing)  # sent from the tensors' own memory: no encoded copy
        del outgoing  # the parts hold what they need
        total = sum(part.nbytes for part in parts)

        def header(meta: codec.PayloadMeta, inline: bytes) -> pb.UpdateChunk:
            return pb.UpdateChunk(header=pb.UpdateHeader(
                client_id=self.client_id, session=session, round=task.round, task_id=task.task_id, payload=payload_message(meta),
                train_seconds=train_seconds, train_loss=update.train_loss, num_steps=update.num_steps,
                train_samples=len(self.state.data), generation=generation_report,
                inline_payload=inline,
            ))

        timeout_s = max(RPC_TIMEOUT_S, task.deadline_s)
        log.info("client %d: uploading round %d (%d bytes)", self.client_id, task.round, total)
        try:
            if task.data_ticket:  # checksummed as it goes, over the data plane
                opening = header(codec.PayloadMeta(total, "", 0), b"").header.SerializeToString()
                grpcutil.call_with_retry(lambda: data_plane.submit(self._endpoint(), task.data_ticket, opening, parts, timeout_s=timeout_s),
                                         deadline_s=timeout_s, what=f"client {self.client_id} submit")
            else:
                stream_upload(self._submit_update, header, parts, timeout_s=timeout_s, what=f"client {self.client_id} submit", inline=True)
        except grpc.RpcError as exc:
            # Refused (its round closed, its norm past runtime.max_update_norm, its bytes malformed): the refusal costs
            # this round only; the dispatch stream is still good, and the next task (or the run's end, or this client's
            # exclusion after runtime.max_refusals refusals in a row) comes on it
            refusals = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT)
            if not (isinstance(exc, grpc.Call) and exc.code() in refusals):
                raise
            log.warning("client %d: round %d: the coordinator refused the update: %s", self.client_id, task.round, exc.details())
            return
        if secure is not None:
            try:
                unmask(secure, timeout_s=task.deadline_s + cfg.runtime.secagg_stage_timeout_s + RPC_TIMEOUT_S)
            except (grpc.RpcError, SecAggError) as exc:
                if isinstance(exc, grpc.RpcError) and not _refused(exc):
                    raise
                log.warning("client %d: round %d: unmasking refused: %s", self.client_id, task.round, _details(exc))
                return
        self.metrics.bytes_sent.inc(total)
        self.metrics.rounds.inc()
        log.info("client %d: round %d done (%.1fs training, loss %.4f)", self.client_id, task.round, train_seconds, update.train_loss)

    def _do_evaluation(self, stub: pb_grpc.CoordinatorStub, session: str, task: pb.Task, stream: Iterator[pb.ServerMessage]) -> None:
        """Test the task's global model on the local test set; only the counts leave (docs/evaluation.md)."""
        assert self.state is not None
        global_state = self._receive_payload(task, stream).get("model", {})
        codec.check_like(global_state, self.layout, what="global model to evaluate from the coordinator")
        self.model.load_state_dict(global_state)  # the next training task loads its own global model
        started = time.monotonic()
        test = self.state.test  # None: a shard too small to hold any out; it reports 0 examples
        if test is None:
            test = TrainData(images_to_tensor(self.state.real_x[:0]), torch.zeros(0, dtype=torch.int64))
        counts = count_predictions(self.model, test, self.num_classes, self.state.cfg.train.eval_batch_size)
        result = pb.EvaluationResult(
            client_id=self.client_id, session=session, round=task.round, task_id=task.task_id, examples=counts.examples,
            correct=counts.correct, loss_sum=counts.loss_sum, class_correct=list(counts.class_correct),
            class_total=list(counts.class_total), evaluate_seconds=time.monotonic() - started,
        )
        try:
            grpcutil.call_with_retry(lambda: stub.SubmitEvaluation(result, timeout=RPC_TIMEOUT_S),
                                     deadline_s=max(RPC_TIMEOUT_S, task.deadline_s), what=f"client {self.client_id} evaluation")
        except grpc.RpcError as exc:
            if not isinstance(exc, grpc.Call) or exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            log.warning("client %d: evaluation of round %d not taken: %s", self.client_id, task.round, exc.details())
            return
        log.info("client %d: round %d evaluated (%d of %d correct)", self.client_id, task.round, counts.correct, counts.examples)

    def _endpoint(self) -> data_plane.Endpoint:
        if self._data_plane is None:
            raise WireError("the task names a data-plane ticket but the coordinator announced no data-plane port")
        return self._data_plane

    def _shared_synthetic(self, group: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """SDA-FL: keep the shared images (sent once), apply this round's labels; labelled samples only."""
        if group is None:
            return {}
        assert self.state is not None
        if "images" in group:
            self.state.shared_images = group["images"].numpy().copy()  # kept all run: not a view of this task's buffer
            self.state.shared_digest = bytes(group["digest"].tolist()).hex()
        if self.state.shared_images is None:
            raise WireError("the task carries synthetic labels but this client never received the synthetic images")
        labels = group["labels"].numpy()
        if len(labels) != len(self.state.shared_images):
            raise WireError(f"{len(labels)} synthetic labels for {len(self.state.shared_images)} images")
        keep = labels >= 0
        return {
            "synthetic_x": images_to_tensor(self.state.shared_images[keep]),
            "synthetic_y": torch.as_tensor(labels[keep], dtype=torch.int64),
        }

    def _mean_pool(self, group: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """FedMix / NaiveMix: keep the pooled mean data (sent once) and hand it to the algorithm every round."""
        if group is None:
            return {}
        assert self.state is not None
        if "images" in group:
            x, y, digest = pool_from_group(group)
            self.state.mean_pool, self.state.shared_digest = (x, y), digest
        if self.state.mean_pool is None:
            raise WireError("the task names a mean-data pool but this client never received it")
        return {"mean_x": self.state.mean_pool[0], "mean_y": self.state.mean_pool[1]}


def _refused(exc: grpc.RpcError) -> bool:
    """The coordinator refused this client's message for this round (not a broken connection)."""
    return isinstance(exc, grpc.Call) and exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT)


def _details(exc: Exception) -> str:
    return exc.details() if isinstance(exc, grpc.Call) else str(exc)  # type: ignore[no-any-return]


def run_clients(
    client_ids: list[int], options: NodeOptions | Mapping[int, NodeOptions], metrics: ClientMetrics, stop: threading.Event
) -> int:
    """Run several logical clients in one process, each in its own thread (and, given a mapping, with its own options:
    its own TLS identity); the worst exit code wins."""
    codes: dict[int, int] = {}

    clients = [LogicalClient(cid, options[cid] if isinstance(options, Mapping) else options, metrics, stop) for cid in client_ids]

    def _one(client: LogicalClient) -> None:
        cid = client.client_id
        try:
            codes[cid] = client.run()
        except FedsynthError as exc:
            log.error("client %d: %s", cid, exc)
            codes[cid] = EXIT_ERROR
        except Exception:
            log.exception("client %d crashed", cid)
            codes[cid] = EXIT_ERROR

    threads = [threading.Thread(target=_one, args=(c,), name=f"client-{c.client_id}") for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(timeout=0.5)
            if stop.is_set():
                for client in clients:
                    client.cancel()
    return max(codes.values(), default=EXIT_OK)
