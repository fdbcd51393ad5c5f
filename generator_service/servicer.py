"""The Generator gRPC servicer: validate the request, queue its images on the batcher, stream them back."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import numpy as np

from fedsynth.v1 import generator_pb2, generator_pb2_grpc
from generator_service.backends import BackendDescription, GeneratorBackend, Unservable, check_variations
from generator_service.batcher import Batcher, BatcherClosed, Job, QueueFull, SamplingFailed
from generator_service.ddpm.sampling import ImageKey, VariationKey
from generator_service.metrics import GeneratorMetrics

MAX_MESSAGE_BYTES = 1 << 20  # images per ImageBatch are capped so a message stays far below gRPC's 4 MiB
INDEX_LIMIT = 1 << 32
VARIATION_INDEX_LIMIT = 1 << 63  # Vary's first_index + N (uint64 on the wire, signed 64-bit anywhere it is stored)


class RequestError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ServedModel:
    """What the servicer needs once the backend is loaded: the backend, and the batcher that samples from it."""

    backend: GeneratorBackend
    batcher: Batcher
    max_batch: int  # the backend's sampling batch (the batcher's may be larger: the quality filter's keys per call)

    @property
    def description(self) -> BackendDescription:
        return self.backend.description


def plan_request(request: generator_pb2.GenerateRequest, *, backend: GeneratorBackend,
                 max_request_images: int) -> list[ImageKey]:
    """The keys of the requested images in stream order (class, then index), or a RequestError naming the value."""
    served = backend.description
    classes = served.num_classes
    counts, offsets = list(request.counts), list(request.offsets)
    if request.model_id and request.model_id != served.model_id:
        raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"model_id {request.model_id!r} requested, but this server serves {served.model_id!r}")
    if len(counts) > classes:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"counts has {len(counts)} entries: class id {len(counts) - 1} is out of range 0..{classes - 1}")
    if len(offsets) > classes:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"offsets has {len(offsets)} entries: class id {len(offsets) - 1} is out of range 0..{classes - 1}")
    total = sum(counts)
    if total == 0:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"empty request: every count is 0 (counts={counts})")
    if total > max_request_images:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"{total} images requested, above the per-request limit of {max_request_images}; split the request")
    offsets += [0] * (classes - len(offsets))
    keys = []
    for class_id, count in enumerate(counts):
        if offsets[class_id] + count > INDEX_LIMIT:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"class {class_id}: offset {offsets[class_id]} + count {count} exceeds the index range 2^32")
        keys += [ImageKey(request.seed, class_id, offsets[class_id] + j) for j in range(count)]
    try:
        backend.check_counts(counts)
    except Unservable as exc:
        raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from exc
    return keys


def plan_variations(request: generator_pb2.VaryRequest, *, backend: GeneratorBackend,
                    max_request_images: int) -> list[VariationKey]:
    """The keys of the requested variations in request order, or a RequestError naming the value. The quality filter
    is not applied to variations: a server running it refuses Vary (backends.check_variations says why)."""
    served = backend.description
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    if request.model_id and request.model_id != served.model_id:
        raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"model_id {request.model_id!r} requested, but this server serves {served.model_id!r}")
    try:
        check_variations(backend)
    except Unservable as exc:
        raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from exc
    labels, count = list(request.labels), len(request.labels)
    if count == 0:
        raise RequestError(invalid, "empty request: no labels" + (
            f" for {len(request.images)} bytes of images" if request.images else " and no images"))
    channels, height, width = served.image_shape
    shape = (request.height, request.width, request.channels)
    if shape != (height, width, channels):
        raise RequestError(invalid, f"images of {'x'.join(map(str, shape))} (height x width x channels) sent, but this "
                                    f"server serves {height}x{width}x{channels}")
    if count > max_request_images:
        raise RequestError(invalid, f"{count} images sent, above the per-request limit of {max_request_images}; "
                                    "split the request")
    row = height * width * channels
    if len(request.images) != count * row:
        raise RequestError(invalid, f"images carries {len(request.images)} bytes, but {count} labels x {height}x{width}x"
                                    f"{channels} is {count * row}")
    for i, label in enumerate(labels):
        if label >= served.num_classes:
            raise RequestError(invalid, f"labels[{i}] = {label} is out of range 0..{served.num_classes - 1}")
    strength = request.strength
    if not (math.isfinite(strength) and 0.0 < strength <= 1.0):
        raise RequestError(invalid, f"strength {strength} is outside (0, 1]")
    if request.first_index + count > VARIATION_INDEX_LIMIT:
        raise RequestError(invalid, f"first_index {request.first_index} + {count} images exceeds the index range 2^63")
    data = request.images
    return [VariationKey(request.seed, label, request.first_index + i, data[i * row : (i + 1) * row], strength)
            for i, label in enumerate(labels)]


class GeneratorServicer(generator_pb2_grpc.GeneratorServicer):
    """Answers UNAVAILABLE until attach() hands it a loaded backend."""

    def __init__(self, *, metrics: GeneratorMetrics, max_request_images: int) -> None:
        self._metrics = metrics
        self._max_request_images = max_request_images
        self._model: ServedModel | None = None
        self._lock = threading.Lock()

    def attach(self, model: ServedModel) -> None:
        with self._lock:
            self._model = model

    def _loaded(self, context: grpc.ServicerContext, method: str) -> ServedModel:
        with self._lock:
            model = self._model
        if model is None:
            self._abort(context, method, grpc.StatusCode.UNAVAILABLE, "the generator model is still loading; retry")
        assert model is not None
        return model

    def _abort(self, context: grpc.ServicerContext, method: str, code: grpc.StatusCode, message: str) -> None:
        self._metrics.requests.labels(method, code.name).inc()
        context.abort(code, message)

    def Info(self, request: generator_pb2.InfoRequest, context: grpc.ServicerContext) -> generator_pb2.InfoReply:
        model = self._loaded(context, "Info")
        meta = model.description
        channels, height, width = meta.image_shape
        self._metrics.requests.labels("Info", "OK").inc()
        return generator_pb2.InfoReply(
            num_classes=meta.num_classes, channels=channels, height=height, width=width, model_id=meta.model_id,
            size=meta.size, parameters=meta.parameters, backend=meta.backend, device=meta.device,
            dtype=meta.dtype, dataset=meta.dataset, ddim_steps=meta.ddim_steps, guidance=meta.guidance,
            max_request_images=self._max_request_images, max_batch=model.max_batch,
        )

    def Generate(self, request: generator_pb2.GenerateRequest,
                 context: grpc.ServicerContext) -> Iterator[generator_pb2.ImageBatch]:
        started = time.monotonic()
        model = self._loaded(context, "Generate")
        try:
            keys = plan_request(request, backend=model.backend, max_request_images=self._max_request_images)
            job = model.batcher.submit(keys)
        except RequestError as exc:
            self._abort(context, "Generate", exc.code, str(exc))
        except QueueFull as exc:
            self._abort(context, "Generate", grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except BatcherClosed as exc:
            self._abort(context, "Generate", grpc.StatusCode.UNAVAILABLE, str(exc))
        self._metrics.request_images.observe(len(keys))
        yield from self._stream(context, "Generate", model, job, [key.class_id for key in keys], started)

    def Vary(self, request: generator_pb2.VaryRequest,
             context: grpc.ServicerContext) -> Iterator[generator_pb2.ImageBatch]:
        model = self._loaded(context, "Vary")
        try:
            keys = plan_variations(request, backend=model.backend, max_request_images=self._max_request_images)
            job = model.batcher.submit(list(keys))  # as list[ImageKey]: a VariationKey is one
        except RequestError as exc:
            self._abort(context, "Vary", exc.code, str(exc))
        except QueueFull as exc:
            self._abort(context, "Vary", grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except BatcherClosed as exc:
            self._abort(context, "Vary", grpc.StatusCode.UNAVAILABLE, str(exc))
        # request_images and request_duration stay Generate's (docs/metrics.md); requests_total{method="Vary"}
        # and images_total count variations too
        yield from self._stream(context, "Vary", model, job, list(request.labels), None)

    def _stream(self, context: grpc.ServicerContext, method: str, model: ServedModel, job: Job, classes: list[int],
                started: float | None) -> Iterator[generator_pb2.ImageBatch]:
        """Stream a submitted job's images as ImageBatch messages of at most MAX_MESSAGE_BYTES of pixels, first_index
        counting from 0; count the outcome under `method`."""
        if not context.add_callback(lambda: model.batcher.cancel(job)):  # runs when the RPC ends, however it ends
            model.batcher.cancel(job)  # it has already ended
        labels = np.array(classes, dtype=np.uint32)
        channels, height, width = model.description.image_shape
        per_message = max(1, MAX_MESSAGE_BYTES // (channels * height * width))
        sent, code = 0, grpc.StatusCode.CANCELLED  # unless the loop finishes: the client or its deadline ended it
        try:
            for chunk in job.chunks():
                for start in range(0, len(chunk), per_message):
                    part = chunk[start : start + per_message]
                    part_labels = labels[sent : sent + len(part)]
                    yield generator_pb2.ImageBatch(images=part.tobytes(), labels=part_labels.tolist(), height=height,
                                                   width=width, channels=channels, first_index=sent)
                    for class_id, n in zip(*np.unique(part_labels, return_counts=True)):
                        self._metrics.images.labels(str(class_id)).inc(int(n))
                    sent += len(part)
            if sent == len(labels):
                code = grpc.StatusCode.OK
        except BatcherClosed as exc:
            code = grpc.StatusCode.UNAVAILABLE
            context.abort(code, str(exc))
        except Unservable as exc:  # e.g. the quality filter could not fill a class within its budget
            code = grpc.StatusCode.FAILED_PRECONDITION
            context.abort(code, str(exc))
        except SamplingFailed as exc:  # logged by the batcher; other requests carry on
            code = grpc.StatusCode.INTERNAL
            context.abort(code, f"sampling failed: {exc}")
        finally:
            model.batcher.cancel(job)
            if started is not None:
                self._metrics.request_duration.observe(time.monotonic() - started)
            self._metrics.requests.labels(method, code.name).inc()
