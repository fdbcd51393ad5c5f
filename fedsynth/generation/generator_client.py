"""Client side of the generator service: Info, and Generate and Vary that resume after UNAVAILABLE without gaps."""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from fedsynth.wire import grpcutil
from fedsynth.errors import ConfigError, StopRequested, WireError
from fedsynth.generation.generator_names import SERVICE_NAME
from fedsynth.v1 import generator_pb2, generator_pb2_grpc

log = logging.getLogger(__name__)
INDEX_LIMIT = 1 << 32
VARIATION_INDEX_LIMIT = 1 << 63  # Vary's first_index + N
# Pixels per VaryRequest: the request carries its sources, and a gRPC server refuses messages over 4 MiB.
VARY_REQUEST_BYTES = 1 << 20

# on_batch(labels int64 (n,), images uint8 (n, H, W, C), first_index): first_index is the position of
# images[0] in the whole requested stream (class order, then index order), counted across retries.
BatchCallback = Callable[[np.ndarray, np.ndarray, int], None]
STOP_POLL_S = 0.25  # how often a fetch looks at its stop event: a SIGTERM waits at most this long, not for the stream


@contextlib.contextmanager
def on_stop(stop: threading.Event | None, action: Callable[[], None]) -> Iterator[None]:
    """Run action() (once, on a watcher thread) if `stop` is set before the block ends."""
    if stop is None:
        yield
        return
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            if stop.wait(STOP_POLL_S):
                if not done.is_set():
                    action()
                return

    watcher = threading.Thread(target=watch, name="fetch-stop", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()


@dataclass(frozen=True)
class GeneratorInfo:
    num_classes: int
    image_shape: tuple[int, int, int]  # (channels, height, width)
    model_id: str
    size: str
    parameters: int
    backend: str
    device: str
    dtype: str
    dataset: str
    ddim_steps: int
    guidance: float
    max_request_images: int
    max_batch: int

    @classmethod
    def fetch(cls, channel: grpc.Channel, *, timeout_s: float) -> GeneratorInfo:
        """Ask the server what it serves; UNAVAILABLE (e.g. still loading) is retried until timeout_s."""
        stub = generator_pb2_grpc.GeneratorStub(channel)
        stop_at = time.monotonic() + timeout_s
        reply = grpcutil.call_with_retry(
            lambda: stub.Info(generator_pb2.InfoRequest(), timeout=max(0.01, stop_at - time.monotonic())),
            deadline_s=timeout_s, what="generator Info",
        )
        return cls(
            num_classes=reply.num_classes, image_shape=(reply.channels, reply.height, reply.width),
            model_id=reply.model_id, size=reply.size, parameters=reply.parameters, backend=reply.backend,
            device=reply.device, dtype=reply.dtype, dataset=reply.dataset, ddim_steps=reply.ddim_steps,
            guidance=reply.guidance, max_request_images=reply.max_request_images, max_batch=reply.max_batch,
        )


def _check_counts(name: str, values: Sequence[int]) -> np.ndarray:
    array = np.asarray(list(values), dtype=np.int64)
    if array.ndim != 1 or (array < 0).any() or (array >= INDEX_LIMIT).any():
        raise ConfigError(f"{name} must be a list of integers in 0..2^32-1, got {list(values)}")
    return array


class _Progress:
    """What has arrived so far, checked against the class order the server promises."""

    def __init__(self, counts: np.ndarray) -> None:
        self.counts = counts
        self.received = np.zeros_like(counts)
        self.total = 0

    def accept(self, batch: generator_pb2.ImageBatch, attempt_start: int) -> tuple[np.ndarray, np.ndarray]:
        labels = np.asarray(batch.labels, dtype=np.int64)
        shape = (len(labels), batch.height, batch.width, batch.channels)
        if len(batch.images) != int(np.prod(shape)):
            raise WireError(f"ImageBatch carries {len(batch.images)} bytes, expected {shape} = {int(np.prod(shape))}")
        if batch.first_index != self.total - attempt_start:
            raise WireError(f"ImageBatch first_index {batch.first_index}, expected {self.total - attempt_start}")
        for label in labels:
            missing = np.flatnonzero(self.received < self.counts)
            if len(missing) == 0 or label != missing[0]:
                expected = "nothing more" if len(missing) == 0 else f"class {missing[0]}"
                raise WireError(f"image {self.total} has class {label}, expected {expected}")
            self.received[label] += 1
            self.total += 1
        return labels, np.frombuffer(batch.images, dtype=np.uint8).reshape(shape)


def fetch_images(
    channel: grpc.Channel,
    counts: Sequence[int],
    *,
    seed: int,
    offsets: Sequence[int] | None = None,
    model_id: str = "",
    timeout_s: float,
    on_batch: BatchCallback,
    stop: threading.Event | None = None,
) -> int:
    """Stream counts[c] images of each class c (indices offsets[c] ...) into on_batch; return how many arrived.

    UNAVAILABLE (a generator restart, a dropped connection) is retried with backoff until timeout_s, asking
    only for what is still missing, so the images and their order are exactly those of an unbroken stream.
    Setting `stop` cancels the stream and raises StopRequested; what on_batch received stays received."""
    want = _check_counts("counts", counts)
    start = _check_counts("offsets", offsets if offsets is not None else [0] * len(want))
    if len(start) != len(want):
        raise ConfigError(f"offsets has {len(start)} entries but counts has {len(want)}")
    if ((start + want) > INDEX_LIMIT).any():
        raise ConfigError(f"offsets + counts exceed the index range 2^32: offsets={list(start)}, counts={list(want)}")
    stub = generator_pb2_grpc.GeneratorStub(channel)
    progress = _Progress(want)
    stop_at = time.monotonic() + timeout_s
    delays = grpcutil.backoff_delays()
    while progress.total < int(want.sum()):
        if stop is not None and stop.is_set():
            raise StopRequested(f"stopped while fetching images: {progress.total} of {int(want.sum())} arrived")
        attempt_start = progress.total
        request = generator_pb2.GenerateRequest(
            counts=(want - progress.received).tolist(), offsets=(start + progress.received).tolist(),
            seed=seed, model_id=model_id,
        )
        try:
            call = stub.Generate(request, timeout=max(0.01, stop_at - time.monotonic()))
            with on_stop(stop, call.cancel):
                for batch in call:
                    if stop is not None and stop.is_set():
                        call.cancel()
                        raise StopRequested(f"stopped while fetching images: {progress.total} of {int(want.sum())} arrived")
                    labels, images = progress.accept(batch, attempt_start)
                    on_batch(labels, images, progress.total - len(labels))
        except grpc.RpcError as exc:
            if stop is not None and stop.is_set():
                continue  # the loop's head raises StopRequested
            code = exc.code() if isinstance(exc, grpc.Call) else None
            if progress.total > attempt_start:
                delays = grpcutil.backoff_delays()  # progress was made: start the backoff over
            delay = next(delays)
            if code not in grpcutil.RETRYABLE or time.monotonic() + delay > stop_at:
                raise
            log.info("generator stream broke (%s) after %d/%d images; resuming in %.2fs",
                     code, progress.total, int(want.sum()), delay)
            if stop is not None:
                stop.wait(delay)
            else:
                time.sleep(delay)
            continue
        if progress.total < int(want.sum()):
            raise WireError(f"the generator ended the stream after {progress.total} of {int(want.sum())} images")
    return progress.total


def vary_images(
    channel: grpc.Channel,
    images: np.ndarray,
    labels: Sequence[int],
    *,
    strength: float,
    seed: int,
    first_index: int = 0,
    model_id: str = "",
    timeout_s: float,
    stop: threading.Event | None = None,
) -> np.ndarray:
    """Variations of `images` (uint8 N x H x W x C, the served shape) of classes `labels`, as uint8 N x H x W x C in
    request order. Row i is a pure function of (model, seed, labels[i], first_index + i, images[i], strength), so the
    rows travel in requests of at most VARY_REQUEST_BYTES of pixels (gRPC refuses a request over 4 MiB), and
    UNAVAILABLE is retried with backoff until timeout_s asking only for the rows still missing (first_index advanced),
    with the bytes of an unbroken stream. Setting `stop` cancels the stream and raises StopRequested."""
    sources = np.asarray(images)
    if sources.dtype != np.uint8 or sources.ndim != 4:
        raise ConfigError(f"images must be uint8 N x H x W x C, got {sources.dtype} of shape {sources.shape}")
    classes = np.asarray(list(labels), dtype=np.int64)
    if classes.shape != (len(sources),) or (classes < 0).any() or (classes >= INDEX_LIMIT).any():
        raise ConfigError(f"labels must be {len(sources)} class ids in 0..2^32-1 (one per image), got {list(labels)}")
    if not (math.isfinite(strength) and 0.0 < strength <= 1.0):
        raise ConfigError(f"strength must be in (0, 1], got {strength}")
    total = len(sources)
    if first_index < 0 or first_index + total > VARIATION_INDEX_LIMIT:
        raise ConfigError(f"first_index {first_index} + {total} images must lie in 0..2^63")
    _, height, width, channels = sources.shape
    out = np.empty_like(sources)
    per_request = max(1, VARY_REQUEST_BYTES // max(1, height * width * channels))
    stub = generator_pb2_grpc.GeneratorStub(channel)
    stop_at = time.monotonic() + timeout_s
    delays = grpcutil.backoff_delays()
    done = 0  # rows of `out` filled so far
    while done < total:
        if stop is not None and stop.is_set():
            raise StopRequested(f"stopped while varying images: {done} of {total} arrived")
        attempt_start, end = done, min(total, done + per_request)
        request = generator_pb2.VaryRequest(
            images=np.ascontiguousarray(sources[done:end]).tobytes(), labels=classes[done:end].tolist(),
            strength=strength, seed=seed, first_index=first_index + done, model_id=model_id,
            height=height, width=width, channels=channels,
        )
        try:
            call = stub.Vary(request, timeout=max(0.01, stop_at - time.monotonic()))
            with on_stop(stop, call.cancel):
                for batch in call:
                    if stop is not None and stop.is_set():
                        call.cancel()
                        raise StopRequested(f"stopped while varying images: {done} of {total} arrived")
                    rows = _accept_variations(batch, classes[attempt_start:end], (height, width, channels),
                                              expected_first=done - attempt_start)
                    out[done : done + len(rows)] = rows
                    done += len(rows)
        except grpc.RpcError as exc:
            if stop is not None and stop.is_set():
                continue  # the loop's head raises StopRequested
            code = exc.code() if isinstance(exc, grpc.Call) else None
            if done > attempt_start:
                delays = grpcutil.backoff_delays()  # progress was made: start the backoff over
            delay = next(delays)
            if code not in grpcutil.RETRYABLE or time.monotonic() + delay > stop_at:
                raise
            log.info("generator Vary stream broke (%s) after %d/%d images; resuming in %.2fs", code, done, total, delay)
            if stop is not None:
                stop.wait(delay)
            else:
                time.sleep(delay)
            continue
        if done < end:
            raise WireError(f"the generator ended the Vary stream after {done} of {total} images")
    return out


def _accept_variations(batch: generator_pb2.ImageBatch, wanted: np.ndarray, shape: tuple[int, int, int], *,
                       expected_first: int) -> np.ndarray:
    """One ImageBatch of a Vary stream, checked: its shape, byte count, first_index and labels (the request's, in
    order, from `expected_first` on), as uint8 n x H x W x C."""
    labels = np.asarray(batch.labels, dtype=np.int64)
    if (batch.height, batch.width, batch.channels) != shape:
        raise WireError(f"ImageBatch of {batch.height}x{batch.width}x{batch.channels} images, the request's are "
                        f"{'x'.join(map(str, shape))}")
    expected_bytes = len(labels) * int(np.prod(shape))
    if len(batch.images) != expected_bytes:
        raise WireError(f"ImageBatch carries {len(batch.images)} bytes, expected {len(labels)} x "
                        f"{'x'.join(map(str, shape))} = {expected_bytes}")
    if batch.first_index != expected_first:
        raise WireError(f"ImageBatch first_index {batch.first_index}, expected {expected_first}")
    expected = wanted[expected_first : expected_first + len(labels)]
    if len(expected) != len(labels) or (expected != labels).any():
        raise WireError(f"ImageBatch at {expected_first} has labels {labels.tolist()}, expected {expected.tolist()} "
                        "(the request's)")
    return np.frombuffer(batch.images, dtype=np.uint8).reshape(len(labels), *shape)
