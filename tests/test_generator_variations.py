"""Vary (Private Evolution's VARIATION_API) over real gRPC (port 0): SDEdit variations from a tiny digits UNet trained
here for a few seconds, image-to-image variations from a tiny random text2image pipeline; determinism, resumption by
first_index, independence of what shares a batch, strength, hostile requests, and the backends that refuse."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from fedsynth.errors import ConfigError
from fedsynth.generation import generator_client
from fedsynth.generation.generator_client import vary_images
from fedsynth.learning.data import load_dataset
from fedsynth.v1 import generator_pb2, generator_pb2_grpc
from fedsynth.wire import grpcutil
from generator_service.backends import GeneratorBackend, Unservable
from generator_service.backends.text2image import Text2ImageBackend, load_text2image
from generator_service.ddpm.sampling import ImageKey, VariationKey, noise_seed, steps_rerun
from generator_service.ddpm.training import TrainConfig, train_generator
from generator_service.quality_filter import JudgeScorer, QualityFilter
from generator_service.serve_cmd import GeneratorServer, ServeConfig
from generator_service.servicer import RequestError, plan_variations
from test_generator_text2image import save_tiny_pipeline

MAX_BATCH = 8
MAX_IMAGES = 64
Served = tuple[GeneratorServer, grpc.Channel, GeneratorBackend]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """60 steps of the tiny digits recipe (~8 s): untrained UNets predict noise too poorly for strength to matter."""
    threads = torch.get_num_threads()
    folder = train_generator(TrainConfig(dataset="digits", out=tmp_path_factory.mktemp("generator") / "model",
                                         size="tiny", device="cpu", steps=60, warmup_steps=20, ema_decay=0.9,
                                         ddim_steps=10, grid_per_class=0, checkpoint_every=60, threads=1,
                                         progress=False))
    yield folder
    torch.set_num_threads(threads)  # training and the servers below pin 1 thread


def _server(**settings: object) -> GeneratorServer:
    config: dict[str, object] = {"max_batch": MAX_BATCH, "max_wait_ms": 20.0, "metrics_port": -1, "threads": 1,
                                 "max_request_images": MAX_IMAGES, **settings}
    return GeneratorServer(ServeConfig(**config), registry=CollectorRegistry())  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Iterator[Served]:
    server = _server(model=model_dir)
    port = server.start()
    backend = server.load().backend
    channel = grpcutil.make_channel(f"127.0.0.1:{port}")
    yield server, channel, backend
    channel.close()
    server.stop(0)


@pytest.fixture(scope="module")
def digits() -> tuple[np.ndarray, np.ndarray]:
    test = load_dataset("digits", "test")
    return test.x[:16], test.y[:16]


def _vary_raw(channel: grpc.Channel, **fields: object) -> list[generator_pb2.ImageBatch]:
    return list(generator_pb2_grpc.GeneratorStub(channel).Vary(generator_pb2.VaryRequest(**fields), timeout=60))


def _request(sources: np.ndarray, classes: np.ndarray, /, **fields: object) -> dict[str, object]:
    """VaryRequest fields for `sources` (and as many of `classes`), at strength 0.5 and seed 0 unless `fields` say."""
    n, height, width, channels = sources.shape
    return {"images": sources.tobytes(), "labels": classes[:n].tolist(), "height": height, "width": width,
            "channels": channels, "strength": 0.5, "seed": 0, **fields}


def test_same_request_same_bytes_and_a_split_request_resumes_exactly(
        served: Served, digits: tuple[np.ndarray, np.ndarray],
        monkeypatch: pytest.MonkeyPatch) -> None:
    channel = served[1]
    src, labels = digits[0][:10], digits[1][:10]
    whole = vary_images(channel, src, labels, strength=0.5, seed=3, timeout_s=60)
    assert whole.shape == src.shape and whole.dtype == np.uint8
    assert vary_images(channel, src, labels, strength=0.5, seed=3, timeout_s=60).tobytes() == whole.tobytes()
    head = vary_images(channel, src[:4], labels[:4], strength=0.5, seed=3, timeout_s=60)
    tail = vary_images(channel, src[4:], labels[4:], strength=0.5, seed=3, first_index=4, timeout_s=60)
    assert np.concatenate([head, tail]).tobytes() == whole.tobytes()
    monkeypatch.setattr(generator_client, "VARY_REQUEST_BYTES", 3 * src[0].nbytes)  # 4 requests of <= 3 rows
    assert vary_images(channel, src, labels, strength=0.5, seed=3, timeout_s=60).tobytes() == whole.tobytes()
    assert vary_images(channel, src, labels, strength=0.5, seed=4, timeout_s=60).tobytes() != whole.tobytes()
    batches = _vary_raw(channel, **_request(src, labels, seed=3))  # the stream itself: a message per sampling batch
    assert [(b.first_index, len(b.labels)) for b in batches] == [(0, MAX_BATCH), (MAX_BATCH, 10 - MAX_BATCH)]
    assert [label for b in batches for label in b.labels] == labels.tolist()
    assert b"".join(b.images for b in batches) == whole.tobytes()


def test_a_variation_is_the_same_whatever_shares_its_batch(
        model_dir: Path, served: Served, digits: tuple[np.ndarray, np.ndarray]) -> None:
    server, channel, backend = served
    src, labels = digits
    keys = [VariationKey(5, int(labels[i]), i, src[i].tobytes(), strength) for i, strength in
            ((0, 0.3), (1, 0.3), (2, 0.9), (3, 1.0))]
    fresh = [ImageKey(5, 2, 0), ImageKey(5, 7, 1)]
    alone = np.concatenate([backend.sample([key]) for key in keys + fresh])
    mixed = [fresh[0], keys[2], keys[0], fresh[1], keys[3], keys[1]]  # fresh and three strengths in one call
    order = [4, 2, 0, 5, 3, 1]
    assert backend.sample(mixed).tobytes() == alone[order].tobytes()
    # Over gRPC: two Varies of other strengths and a Generate at once, on a server that waits up to 1 s for a batch
    # to fill, so that they share one; against each alone on the module's server.
    expected_a = vary_images(channel, src[:6], labels[:6], strength=0.4, seed=1, timeout_s=60)
    expected_b = vary_images(channel, src[6:9], labels[6:9], strength=0.8, seed=1, timeout_s=60)
    expected_generated = b"".join(b.images for b in generator_pb2_grpc.GeneratorStub(channel).Generate(
        generator_pb2.GenerateRequest(counts=[2, 3], seed=1), timeout=60))
    patient = _server(model=model_dir, max_wait_ms=1000.0)
    port = patient.start()
    patient.load()
    results: dict[str, object] = {}
    try:
        other = grpcutil.make_channel(f"127.0.0.1:{port}")
        stub = generator_pb2_grpc.GeneratorStub(other)
        jobs = [
            threading.Thread(target=lambda: results.update(a=vary_images(other, src[:6], labels[:6], strength=0.4,
                                                                         seed=1, timeout_s=60))),
            threading.Thread(target=lambda: results.update(b=vary_images(other, src[6:9], labels[6:9], strength=0.8,
                                                                         seed=1, timeout_s=60))),
            threading.Thread(target=lambda: results.update(g=b"".join(b.images for b in stub.Generate(
                generator_pb2.GenerateRequest(counts=[2, 3], seed=1), timeout=60)))),
        ]
        for job in jobs:
            job.start()
        for job in jobs:
            job.join()
        batches = patient.metrics.registry.get_sample_value("fedsynth_generator_batch_size_count")
    finally:
        patient.stop(0)
    assert batches == 2  # 14 keys in two shared batches (alone: three)
    assert results["a"].tobytes() == expected_a.tobytes()  # type: ignore[attr-defined]
    assert results["b"].tobytes() == expected_b.tobytes()  # type: ignore[attr-defined]
    assert results["g"] == expected_generated and len(expected_generated) == 5 * 64


def test_a_variations_noise_is_not_the_generated_images(digits: tuple[np.ndarray, np.ndarray]) -> None:
    """Same (seed, class, index): otherwise strength 1 would redraw the very image Generate serves for that key."""
    key = VariationKey(1, 2, 3, digits[0][0].tobytes(), 1.0)
    assert noise_seed(key) != noise_seed(ImageKey(1, 2, 3))
    assert noise_seed(key) == noise_seed(VariationKey(1, 2, 3, digits[0][1].tobytes(), 0.2))  # keyed by index only
    assert [steps_rerun(s, 10) for s in (0.01, 0.1, np.float32(0.7).item(), 1.0)] == [1, 1, 7, 10]


def test_strength_sets_how_far_a_variation_moves(served: Served,
                                                 digits: tuple[np.ndarray, np.ndarray]) -> None:
    src, labels = digits
    distance = {s: np.abs(vary_images(served[1], src, labels, strength=s, seed=2, timeout_s=60).astype(int)
                          - src.astype(int)).mean() for s in (0.1, 0.2, 0.6, 1.0)}
    assert distance[0.1] < distance[0.2] < distance[0.6] < distance[1.0], distance
    other_digit = np.abs(src.astype(int) - np.roll(src, 1, axis=0).astype(int)).mean()  # another real image
    assert distance[0.1] < 0.5 * other_digit and distance[0.1] < 0.4 * distance[1.0], (distance, other_digit)


BAD_REQUESTS = [
    ({"images": b"", "labels": []}, grpc.StatusCode.INVALID_ARGUMENT, "empty request: no labels and no images"),
    ({"labels": []}, grpc.StatusCode.INVALID_ARGUMENT, "empty request: no labels for 128 bytes of images"),
    ({"images": bytes(64)}, grpc.StatusCode.INVALID_ARGUMENT, "images carries 64 bytes, but 2 labels x 8x8x1 is 128"),
    ({"height": 16}, grpc.StatusCode.INVALID_ARGUMENT, "images of 16x8x1 (height x width x channels) sent, but this "
                                                       "server serves 8x8x1"),
    ({"channels": 3}, grpc.StatusCode.INVALID_ARGUMENT, "images of 8x8x3"),
    ({"labels": [3, 10]}, grpc.StatusCode.INVALID_ARGUMENT, "labels[1] = 10 is out of range 0..9"),
    ({"strength": 0.0}, grpc.StatusCode.INVALID_ARGUMENT, "strength 0.0 is outside (0, 1]"),
    ({"strength": 1.5}, grpc.StatusCode.INVALID_ARGUMENT, "strength 1.5 is outside (0, 1]"),
    ({"strength": -0.25}, grpc.StatusCode.INVALID_ARGUMENT, "strength -0.25 is outside (0, 1]"),
    ({"strength": float("nan")}, grpc.StatusCode.INVALID_ARGUMENT, "strength nan is outside (0, 1]"),
    ({"strength": float("inf")}, grpc.StatusCode.INVALID_ARGUMENT, "strength inf is outside (0, 1]"),
    ({"first_index": 2**64 - 1}, grpc.StatusCode.INVALID_ARGUMENT,
     "first_index 18446744073709551615 + 2 images exceeds the index range 2^63"),
    ({"first_index": 2**63 - 1}, grpc.StatusCode.INVALID_ARGUMENT, "first_index 9223372036854775807 + 2 images"),
    ({"images": bytes(65 * 64), "labels": [0] * 65}, grpc.StatusCode.INVALID_ARGUMENT,
     "65 images sent, above the per-request limit of 64"),
    ({"model_id": "ddpm-other"}, grpc.StatusCode.FAILED_PRECONDITION, "model_id 'ddpm-other' requested"),
]


@pytest.mark.parametrize(("fields", "code", "words"), BAD_REQUESTS)
def test_a_hostile_request_gets_its_code_naming_the_value_and_the_server_serves_on(
        served: Served, digits: tuple[np.ndarray, np.ndarray], fields: dict,
        code: grpc.StatusCode, words: str) -> None:
    server, channel, _ = served
    registry = server.metrics.registry
    refused = registry.get_sample_value("fedsynth_generator_requests_total", {"method": "Vary", "code": code.name}) or 0
    with pytest.raises(grpc.RpcError) as caught:
        _vary_raw(channel, **_request(digits[0][:2], digits[1], **fields))
    assert caught.value.code() == code and words in caught.value.details(), caught.value.details()
    assert registry.get_sample_value("fedsynth_generator_requests_total",
                                     {"method": "Vary", "code": code.name}) == refused + 1
    served_ok = registry.get_sample_value("fedsynth_generator_requests_total", {"method": "Vary", "code": "OK"}) or 0
    assert vary_images(channel, digits[0][:2], digits[1][:2], strength=0.3, seed=0, timeout_s=60).shape == (2, 8, 8, 1)
    assert registry.get_sample_value("fedsynth_generator_requests_total",
                                     {"method": "Vary", "code": "OK"}) == served_ok + 1


def test_malformed_bytes_and_client_side_checks(served: Served,
                                                digits: tuple[np.ndarray, np.ndarray]) -> None:
    channel = served[1]
    raw = channel.unary_stream("/fedsynth.v1.Generator/Vary")
    with pytest.raises(grpc.RpcError) as caught:
        list(raw(b"\x0a\xff\xff\xff", timeout=10))  # field 1 claims more bytes than there are
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed VaryRequest" in caught.value.details()
    src, labels = digits
    for call, words in [
        (lambda: vary_images(channel, src[:2].astype(np.int16), labels[:2], strength=0.5, seed=0, timeout_s=5), "uint8"),
        (lambda: vary_images(channel, src[:2], labels[:3], strength=0.5, seed=0, timeout_s=5), "one per image"),
        (lambda: vary_images(channel, src[:2], labels[:2], strength=0.0, seed=0, timeout_s=5), "strength"),
        (lambda: vary_images(channel, src[:2], labels[:2], strength=0.5, seed=0, first_index=2**63 - 1,
                             timeout_s=5), "first_index"),
    ]:
        with pytest.raises(ConfigError, match=words):
            call()
    assert vary_images(channel, src[:0], labels[:0], strength=0.5, seed=0, timeout_s=5).shape == (0, 8, 8, 1)
    registry = served[0].metrics.registry
    assert (registry.get_sample_value("fedsynth_generator_images_total", {"class_id": str(labels[0])}) or 0) > 0


def test_text2image_varies_with_its_image_to_image_pipeline(tmp_path_factory: pytest.TempPathFactory,
                                                           digits: tuple[np.ndarray, np.ndarray]) -> None:
    threads = torch.get_num_threads()
    pipeline = save_tiny_pipeline(tmp_path_factory.mktemp("text2image"))
    src, labels = digits[0][:5], digits[1][:5]
    backend = load_text2image(pipeline, dataset="digits", batch_size=4, steps=4)
    assert type(backend.img2img).__name__ == "StableDiffusionImg2ImgPipeline" and backend.native_size() == 16
    assert backend.img2img.unet is backend.pipeline.unet  # the same weights, not a copy
    keys = [VariationKey(2, int(labels[i]), i, src[i].tobytes(), s) for i, s in ((0, 0.5), (1, 0.5), (2, 1.0))]
    alone = np.concatenate([backend.sample([key]) for key in keys])
    mixed = backend.sample([keys[2], ImageKey(2, 4, 0), keys[0], keys[1]])
    assert mixed[[2, 3, 0]].tobytes() == alone.tobytes()
    assert mixed[1].tobytes() == backend.sample([ImageKey(2, 4, 0)]).tobytes()
    assert alone[0].tobytes() != backend.sample([VariationKey(2, int(labels[0]), 0, src[0].tobytes(), 1.0)]).tobytes()
    # 0.1 and 0.25 both re-run one of the 4 steps: the same image
    assert (backend.sample([VariationKey(2, 1, 0, src[0].tobytes(), 0.1)]).tobytes()
            == backend.sample([VariationKey(2, 1, 0, src[0].tobytes(), 0.25)]).tobytes())
    no_img2img = Text2ImageBackend(backend.pipeline, backend.prompts, image_shape=(1, 8, 8), steps=4, guidance=0.0,
                                   batch_size=4, device=backend.device, description=backend.description)
    with pytest.raises(Unservable, match="has no image-to-image counterpart"):
        no_img2img.check_variations()
    server = _server(backend="text2image", model=pipeline, dataset="digits", ddim_steps=4, max_batch=4)
    port = server.start()
    server.load()
    try:
        channel = grpcutil.make_channel(f"127.0.0.1:{port}")
        whole = vary_images(channel, src, labels, strength=0.5, seed=2, timeout_s=60)
        assert whole.shape == (5, 8, 8, 1) and whole[:2].tobytes() == alone[:2].tobytes()
        tail = vary_images(channel, src[3:], labels[3:], strength=0.5, seed=2, first_index=3, timeout_s=60)
        assert tail.tobytes() == whole[3:].tobytes()
    finally:
        server.stop(0)
        torch.set_num_threads(threads)


def test_holdout_and_the_quality_filter_refuse_vary(served: Served,
                                                    digits: tuple[np.ndarray, np.ndarray]) -> None:
    server = _server(backend="holdout", dataset="digits", holdout_fraction=0.2, seed=3)
    port = server.start()
    server.load()
    try:
        channel = grpcutil.make_channel(f"127.0.0.1:{port}")
        with pytest.raises(grpc.RpcError) as caught:
            vary_images(channel, digits[0][:2], digits[1][:2], strength=0.5, seed=0, timeout_s=10)
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert caught.value.details() == "the holdout backend serves real images and makes no variations"
    finally:
        server.stop(0)
    inner = served[2]
    filtered = QualityFilter(inner, JudgeScorer(torch.nn.Identity()), min_confidence=0.5, max_batch=MAX_BATCH,
                             judge_id="0" * 12)
    request = generator_pb2.VaryRequest(**_request(digits[0][:2], digits[1]))  # type: ignore[arg-type]
    with pytest.raises(RequestError, match="quality filter") as refused:
        plan_variations(request, backend=filtered, max_request_images=MAX_IMAGES)
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert len(plan_variations(request, backend=inner, max_request_images=MAX_IMAGES)) == 2
