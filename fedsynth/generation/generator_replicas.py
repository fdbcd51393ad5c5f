"""Several generator processes behind one client: requests sharded across replicas, images as one replica's.

`generation.generator` (or a client's `--generator`) names the replicas as `HOST:PORT,HOST:PORT,...` (a channel
each) or as one `dns:///NAME:PORT` target (a Kubernetes headless Service): one channel with gRPC's `round_robin`
policy over every address NAME resolves to, and as many concurrent streams as it resolves to. Because image j of
class c is a pure function of (model, seed, c, j), any replica may draw any image: each class's index range
[offset, offset + n) is cut into pieces, the replicas' workers take the next piece as they finish one, and the
pieces are handed to `on_batch` in stream order (class, then index), exactly as `fetch_images` would.

A replica that answers UNAVAILABLE (dead, restarting, unreachable) gives its piece back, from the first image it did
not deliver, to the others, and is tried again after a jittered backoff; the call fails only when no replica
delivers before `timeout_s`, with a WireError naming every address and its last status. Any other status (e.g. a
replica serving another model: FAILED_PRECONDITION) fails the call at once, naming the replica.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from fedsynth.wire import grpcutil
from fedsynth.config import generator_addresses
from fedsynth.errors import ConfigError, StopRequested, WireError
from fedsynth.generation.generator_client import INDEX_LIMIT, BatchCallback, GeneratorInfo, _check_counts, fetch_images, on_stop
from fedsynth.v1 import generator_pb2, generator_pb2_grpc

log = logging.getLogger(__name__)
PIECE_IMAGES = 256  # images per piece: small enough to spread a client's request, large enough to fill a batch
ROUND_ROBIN = [("grpc.lb_policy_name", "round_robin")]  # spread RPCs over every address a dns:/// name resolves to


@dataclass(frozen=True)
class _Piece:
    position: int  # where its first image sits in the whole requested stream
    class_id: int
    first: int  # its first index within the class
    count: int


def _resolved(target: str) -> int:
    """How many distinct addresses a dns:///NAME:PORT target resolves to now (at least 1)."""
    host, _, port = target.removeprefix("dns:///").rpartition(":")
    try:
        infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except OSError:
        return 1
    return max(1, len({info[4][0] for info in infos}))


class GeneratorReplicas:
    """The channels to one or more generator replicas (`connect`), and the calls that use them all."""

    def __init__(self, workers: Sequence[tuple[str, grpc.Channel]], channels: Sequence[grpc.Channel]) -> None:
        self.workers = list(workers)  # (address, channel) per concurrent stream; a dns target repeats its channel
        self._channels = list(channels)

    @classmethod
    def connect(cls, target: str, credentials: grpc.ChannelCredentials | None = None, *,
                key: str = "generation.generator") -> GeneratorReplicas:
        addresses = generator_addresses(target, key=key)
        if len(addresses) == 1 and addresses[0].startswith("dns:///"):
            options = grpcutil.CHANNEL_OPTIONS + ROUND_ROBIN
            channel = (grpc.secure_channel(addresses[0], credentials, options=options) if credentials is not None
                       else grpc.insecure_channel(addresses[0], options=options))
            return cls([(addresses[0], channel)] * _resolved(addresses[0]), [channel])
        channels = [grpcutil.make_channel(address, credentials) for address in addresses]
        return cls(list(zip(addresses, channels)), channels)

    @property
    def addresses(self) -> list[str]:
        return list(dict.fromkeys(address for address, _ in self.workers))

    def close(self) -> None:
        for channel in self._channels:
            channel.close()

    def info(self, *, timeout_s: float) -> GeneratorInfo:
        """Info from the first replica that answers; UNAVAILABLE ones are skipped and retried until timeout_s."""
        stop_at = time.monotonic() + timeout_s
        delays = grpcutil.backoff_delays()
        while True:
            errors = []
            for address, channel in dict(self.workers).items():
                try:
                    return GeneratorInfo.fetch(channel, timeout_s=min(5.0, max(0.01, stop_at - time.monotonic())))
                except grpc.RpcError as exc:
                    code = exc.code() if isinstance(exc, grpc.Call) else None
                    if code not in grpcutil.RETRYABLE and code != grpc.StatusCode.DEADLINE_EXCEEDED:
                        raise
                    errors.append(f"{address}: {getattr(code, 'name', code)}")
            delay = next(delays)
            if time.monotonic() + delay > stop_at:
                raise WireError(f"no generator replica answered Info within {timeout_s:g}s ({'; '.join(errors)})")
            time.sleep(delay)

    def fetch(self, counts: Sequence[int], *, seed: int, offsets: Sequence[int] | None = None, model_id: str = "",
              timeout_s: float, on_batch: BatchCallback, piece_images: int = PIECE_IMAGES,
              stop: threading.Event | None = None) -> int:
        """fetch_images over every replica: the same images, the same on_batch calls' order; returns how many.
        Setting `stop` cancels every stream and raises StopRequested."""
        if len(self.workers) == 1:  # one stream: fetch_images, with its resume-after-UNAVAILABLE on that channel
            return fetch_images(self.workers[0][1], counts, seed=seed, offsets=offsets, model_id=model_id,
                                timeout_s=timeout_s, on_batch=on_batch, stop=stop)
        if piece_images < 1:
            raise ConfigError(f"piece_images must be >= 1, got {piece_images}")
        want = _check_counts("counts", counts)
        start = _check_counts("offsets", offsets if offsets is not None else [0] * len(want))
        if len(start) != len(want):
            raise ConfigError(f"offsets has {len(start)} entries but counts has {len(want)}")
        if ((start + want) > INDEX_LIMIT).any():
            raise ConfigError(f"offsets + counts exceed the index range 2^32: offsets={list(start)}, counts={list(want)}")
        pieces, position = [], 0
        for class_id, (n, first) in enumerate(zip(want.tolist(), start.tolist())):
            for k in range(0, n, piece_images):
                pieces.append(_Piece(position + k, class_id, first + k, min(piece_images, n - k)))
            position += n
        sharded = _Sharded(self.workers, pieces, seed=seed, model_id=model_id, timeout_s=timeout_s)
        with on_stop(stop, lambda: sharded._fail(StopRequested("stopped while fetching images from the replicas"))):
            return sharded.run(on_batch)


class _Sharded:
    """One sharded fetch: a worker thread per stream takes pieces; the caller's thread delivers them in order."""

    def __init__(self, workers: Sequence[tuple[str, grpc.Channel]], pieces: list[_Piece], *, seed: int,
                 model_id: str, timeout_s: float) -> None:
        self.workers = workers
        self.pending = deque(pieces)
        self.total = sum(piece.count for piece in pieces)
        self.seed, self.model_id, self.timeout_s = seed, model_id, timeout_s
        self.stop_at = time.monotonic() + timeout_s
        self.arrived: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # stream position -> (labels, images)
        self.busy = 0  # pieces a worker holds
        self.failures: dict[str, str] = {}  # address -> its last retryable failure
        self.fatal: BaseException | None = None
        self.closed = False  # the caller is done (all delivered, or it raised): workers stop
        self.calls: set[grpc.Call] = set()
        self.cond = threading.Condition()

    def run(self, on_batch: BatchCallback) -> int:
        threads = [threading.Thread(target=self._work, args=(address, channel), daemon=True,
                                    name=f"generator-replica-{i}") for i, (address, channel) in enumerate(self.workers)]
        for thread in threads:
            thread.start()
        delivered = 0
        try:
            while delivered < self.total:
                with self.cond:
                    while delivered not in self.arrived and self.fatal is None:
                        left = self.stop_at - time.monotonic()
                        if left <= 0:
                            failed = "; ".join(f"{a}: {e}" for a, e in self.failures.items()) or "no failure reported"
                            raise WireError(f"the generator replicas delivered {delivered} of {self.total} images "
                                            f"within {self.timeout_s:g}s ({failed})")
                        self.cond.wait(left)
                    if self.fatal is not None:
                        raise self.fatal
                    labels, images = self.arrived.pop(delivered)
                on_batch(labels, images, delivered)
                delivered += len(labels)
        finally:
            with self.cond:
                self.closed = True
                self.pending.clear()
                calls = list(self.calls)
                self.cond.notify_all()
            for call in calls:
                call.cancel()
        return delivered

    def _take(self) -> _Piece | None:
        with self.cond:
            while not self.pending and self.busy and not self._stopped() and time.monotonic() < self.stop_at:
                self.cond.wait(max(0.0, self.stop_at - time.monotonic()))  # a busy piece may come back
            if not self.pending or self._stopped():
                return None
            self.busy += 1
            return self.pending.popleft()

    def _work(self, address: str, channel: grpc.Channel) -> None:
        stub = generator_pb2_grpc.GeneratorStub(channel)
        delays = grpcutil.backoff_delays()
        while (piece := self._take()) is not None:
            got, retry_in, call = 0, 0.0, None
            request = generator_pb2.GenerateRequest(
                counts=[0] * piece.class_id + [piece.count], offsets=[0] * piece.class_id + [piece.first],
                seed=self.seed, model_id=self.model_id)
            try:
                call = stub.Generate(request, timeout=max(0.01, self.stop_at - time.monotonic()))
                with self.cond:
                    self.calls.add(call)
                for batch in call:
                    labels = np.asarray(batch.labels, dtype=np.int64)
                    shape = (len(labels), batch.height, batch.width, batch.channels)
                    if len(batch.images) != int(np.prod(shape)) or (labels != piece.class_id).any() \
                            or batch.first_index != got or got + len(labels) > piece.count:
                        raise WireError(f"generator replica {address} sent an ImageBatch that does not continue "
                                        f"class {piece.class_id} at index {piece.first + got}")
                    images = np.frombuffer(batch.images, dtype=np.uint8).reshape(shape)
                    with self.cond:
                        self.arrived[piece.position + got] = (labels, images)
                        self.cond.notify_all()
                    got += len(labels)
                if got < piece.count:
                    raise WireError(f"generator replica {address} ended the stream after {got} of {piece.count} images")
                delays = grpcutil.backoff_delays()  # it delivered: start its backoff over
            except grpc.RpcError as exc:
                code = exc.code() if isinstance(exc, grpc.Call) else None
                if code not in grpcutil.RETRYABLE:
                    details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
                    self._fail(WireError(f"generator replica {address}: {getattr(code, 'name', code)}: {details}"))
                    return
                retry_in = next(delays)
                log.info("generator replica %s: %s after %d/%d images of a piece; its rest goes to any replica",
                         address, code, got, piece.count)
                with self.cond:
                    self.failures[address] = f"{code.name}: {exc.details()}" if isinstance(exc, grpc.Call) else str(exc)
            except WireError as exc:
                self._fail(exc)
                return
            finally:
                with self.cond:
                    if call is not None:
                        self.calls.discard(call)
                    self.busy -= 1
                    if got < piece.count and not self._stopped():  # the rest goes back, first in line
                        self.pending.appendleft(_Piece(piece.position + got, piece.class_id, piece.first + got,
                                                       piece.count - got))
                    self.cond.notify_all()
            if retry_in:
                time.sleep(min(retry_in, max(0.0, self.stop_at - time.monotonic())))

    def _stopped(self) -> bool:
        return self.closed or self.fatal is not None

    def _fail(self, exc: BaseException) -> None:
        with self.cond:
            if self.fatal is None:
                self.fatal = exc
            self.cond.notify_all()
