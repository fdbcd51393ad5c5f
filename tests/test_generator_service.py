"""The Generate/Info service over real gRPC (port 0) with a seeded, untrained tiny UNet: counts, order,
determinism under concurrency and offsets, validation codes, metrics, health, cancellation, resume."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from fedsynth.wire import grpcutil
from fedsynth.generation.generator_client import GeneratorInfo, fetch_images
from fedsynth.v1 import generator_pb2, generator_pb2_grpc
from generator_service.ddpm.model import GeneratorMetadata, build_unet, make_train_scheduler, save_generator
from generator_service.serve_cmd import SERVICE_NAME, GeneratorServer, ServeConfig

CLASSES = 10


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    threads = torch.get_num_threads()
    folder = tmp_path_factory.mktemp("generator")
    unet = build_unet("tiny", num_classes=CLASSES, image_shape=(1, 8, 8), seed=0)
    save_generator(folder, unet, make_train_scheduler(),
                   GeneratorMetadata("digits", CLASSES, (1, 8, 8), "tiny", training_steps=0, guidance=1.0, ddim_steps=3))
    yield folder
    torch.set_num_threads(threads)  # the servers below pin 1 thread (fastest on a crowded 2-core CPU)


def _server(model_dir: Path, **overrides: object) -> GeneratorServer:
    settings: dict[str, object] = {"max_batch": 16, "max_wait_ms": 20.0, "metrics_port": -1, "threads": 1, **overrides}
    return GeneratorServer(ServeConfig(model=model_dir, **settings), registry=CollectorRegistry())  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Iterator[tuple[GeneratorServer, grpc.Channel]]:
    server = _server(model_dir, metrics_port=0, max_request_images=5000)
    port = server.start()
    server.load()
    channel = grpcutil.make_channel(f"127.0.0.1:{port}")
    yield server, channel
    channel.close()
    server.stop(0)


def _generate(channel: grpc.Channel, counts: list[int], seed: int, offsets: list[int] | None = None,
              model_id: str = "") -> tuple[np.ndarray, np.ndarray]:
    stub = generator_pb2_grpc.GeneratorStub(channel)
    request = generator_pb2.GenerateRequest(counts=counts, seed=seed, offsets=offsets or [], model_id=model_id)
    labels: list[np.ndarray] = []
    images: list[np.ndarray] = []
    for batch in stub.Generate(request, timeout=60):
        assert batch.ByteSize() < 4 * 1024 * 1024 and batch.first_index == sum(len(x) for x in labels)
        labels.append(np.asarray(batch.labels))
        images.append(np.frombuffer(batch.images, np.uint8).reshape(len(batch.labels), batch.height, batch.width,
                                                                    batch.channels))
    return np.concatenate(labels), np.concatenate(images)


def test_info_describes_the_served_model(served: tuple[GeneratorServer, grpc.Channel]) -> None:
    info = GeneratorInfo.fetch(served[1], timeout_s=10)
    assert (info.num_classes, info.image_shape, info.size, info.backend) == (CLASSES, (1, 8, 8), "tiny", "ddpm")
    assert info.model_id.startswith("ddpm-tiny-digits-") and info.parameters > 100_000
    assert (info.device, info.dtype, info.ddim_steps, info.max_batch) == ("cpu", "float32", 3, 16)


def test_the_served_model_id_names_the_sampling_settings(model_dir: Path) -> None:
    """Other DDIM steps or guidance draw other images: a client's cache keyed by the id must not be reused."""
    ids = set()
    for steps, guidance in ((3, 1.0), (4, 1.0), (3, 2.0), (3, 1.0)):
        server = _server(model_dir, ddim_steps=steps, guidance=guidance)
        try:
            server.start()
            ids.add(server.load().backend.description.model_id)
        finally:
            server.stop(0)
    assert len(ids) == 3 and all(i.startswith("ddpm-tiny-digits-") for i in ids)


def test_exact_counts_in_class_order(served: tuple[GeneratorServer, grpc.Channel]) -> None:
    labels, images = _generate(served[1], [3, 0, 5, 0, 0, 0, 0, 0, 0, 2], seed=1)
    assert labels.tolist() == [0] * 3 + [2] * 5 + [9] * 2
    assert images.shape == (10, 8, 8, 1) and images.dtype == np.uint8
    assert len({img.tobytes() for img in images}) == 10  # every image its own noise


def test_same_bytes_with_and_without_concurrency(served: tuple[GeneratorServer, grpc.Channel]) -> None:
    server, channel = served
    requests = [([2, 5, 0, 1], seed % 3) for seed in range(10)]  # repeated seeds: same request twice at once
    alone = [_generate(channel, counts, seed) for counts, seed in requests]
    batches_before = server.metrics.registry.get_sample_value("fedsynth_generator_batch_size_count") or 0.0
    together: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(requests)

    def fetch(i: int) -> None:
        together[i] = _generate(channel, *requests[i])

    threads = [threading.Thread(target=fetch, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (labels, images), result in zip(alone, together):
        assert result is not None
        assert np.array_equal(labels, result[0]) and images.tobytes() == result[1].tobytes()
    assert alone[0][1].tobytes() != alone[1][1].tobytes()  # another seed, other images
    batches = (server.metrics.registry.get_sample_value("fedsynth_generator_batch_size_count") or 0.0) - batches_before
    assert batches < len(requests)  # alone, each 8-image request took a batch of its own; together they shared


def test_offsets_continue_a_stream_exactly(served: tuple[GeneratorServer, grpc.Channel]) -> None:
    channel = served[1]
    _, whole = _generate(channel, [7, 4], seed=5)
    _, head = _generate(channel, [3, 4], seed=5)
    _, tail = _generate(channel, [4], seed=5, offsets=[3])
    # whole = class 0 [0..7) then class 1 [0..4); head has class 0 [0..3) + class 1; tail class 0 [3..7)
    assert np.concatenate([head[:3], tail, head[3:]]).tobytes() == whole.tobytes()


@pytest.mark.parametrize(
    ("fields", "code", "words"),
    [
        ({"counts": [1] * 11}, grpc.StatusCode.INVALID_ARGUMENT, "class id 10 is out of range 0..9"),
        ({"counts": [1], "offsets": [0] * 12}, grpc.StatusCode.INVALID_ARGUMENT, "offsets has 12 entries"),
        ({"counts": [0, 0, 0]}, grpc.StatusCode.INVALID_ARGUMENT, "empty request"),
        ({"counts": []}, grpc.StatusCode.INVALID_ARGUMENT, "empty request"),
        ({"counts": [4000, 1001]}, grpc.StatusCode.INVALID_ARGUMENT, "5001 images requested, above the per-request limit of 5000"),
        ({"counts": [0, 2], "offsets": [0, 2**32 - 1]}, grpc.StatusCode.INVALID_ARGUMENT, "class 1: offset 4294967295 + count 2"),
        ({"counts": [1], "model_id": "ddpm-half-cifar10-0"}, grpc.StatusCode.FAILED_PRECONDITION, "'ddpm-half-cifar10-0'"),
    ],
)
def test_bad_requests_get_their_code_and_message(served: tuple[GeneratorServer, grpc.Channel], fields: dict,
                                                 code: grpc.StatusCode, words: str) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        _generate(served[1], seed=0, **fields)
    assert caught.value.code() == code and words in caught.value.details()


def test_metrics_endpoint_counts_what_was_served(model_dir: Path) -> None:
    server = _server(model_dir, metrics_port=0)
    port = server.start()
    server.load()
    try:
        channel = grpcutil.make_channel(f"127.0.0.1:{port}")
        _generate(channel, [2, 0, 3], seed=0)
        _generate(channel, [0, 4], seed=1)
        with pytest.raises(grpc.RpcError):
            _generate(channel, [0], seed=0)
        text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    finally:
        server.stop(0)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("fedsynth_generator_images_total", (("class_id", "0"),))] == 2
    assert samples[("fedsynth_generator_images_total", (("class_id", "1"),))] == 4
    assert samples[("fedsynth_generator_images_total", (("class_id", "2"),))] == 3
    assert samples[("fedsynth_generator_requests_total", (("code", "OK"), ("method", "Generate")))] == 2
    assert samples[("fedsynth_generator_requests_total", (("code", "INVALID_ARGUMENT"), ("method", "Generate")))] == 1
    assert samples[("fedsynth_generator_request_images_sum", ())] == 9
    assert samples[("fedsynth_generator_batch_size_sum", ())] == 9
    assert samples[("fedsynth_generator_device_seconds_total", ())] > 0
    assert samples[("fedsynth_generator_model_load_seconds", ())] > 0
    info = [dict(labels) for name, labels in samples if name == "fedsynth_generator_info"]
    assert len(info) == 1 and (info[0]["backend"], info[0]["size"], info[0]["device"]) == ("ddpm", "tiny", "cpu")


def test_health_is_not_serving_until_the_model_is_loaded(model_dir: Path) -> None:
    server = _server(model_dir)
    port = server.start()
    try:
        channel = grpcutil.make_channel(f"127.0.0.1:{port}")
        health = health_pb2_grpc.HealthStub(channel)
        status = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as caught:
            _generate(channel, [1], seed=0)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE and "loading" in caught.value.details()
        server.load()
        status = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(0)


def test_cancelled_stream_frees_the_batcher(served: tuple[GeneratorServer, grpc.Channel]) -> None:
    server, channel = served
    registry = server.metrics.registry
    cancelled_before = registry.get_sample_value(
        "fedsynth_generator_requests_total", {"method": "Generate", "code": "CANCELLED"}) or 0
    stream = generator_pb2_grpc.GeneratorStub(channel).Generate(
        generator_pb2.GenerateRequest(counts=[2000], seed=3), timeout=60)
    next(stream)
    assert server.batcher is not None and server.batcher.queued_images > 1000
    stream.cancel()
    deadline = time.monotonic() + 10
    while server.batcher.queued_images and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.batcher.queued_images == 0
    labels, _ = _generate(channel, [0, 1], seed=0)  # the queue serves the next request at once
    assert labels.tolist() == [1]
    while time.monotonic() < deadline and registry.get_sample_value(
            "fedsynth_generator_requests_total", {"method": "Generate", "code": "CANCELLED"}) == cancelled_before:
        time.sleep(0.01)
    assert registry.get_sample_value(
        "fedsynth_generator_requests_total", {"method": "Generate", "code": "CANCELLED"}) == cancelled_before + 1


def test_full_queue_is_resource_exhausted(model_dir: Path) -> None:
    server = _server(model_dir, queue_limit=100, max_request_images=100)
    port = server.start()
    server.load()
    try:
        channel = grpcutil.make_channel(f"127.0.0.1:{port}")
        first = generator_pb2_grpc.GeneratorStub(channel).Generate(
            generator_pb2.GenerateRequest(counts=[100], seed=0), timeout=60)
        next(first)  # one batch of 16 is out; the rest of the 100 is still queued
        with pytest.raises(grpc.RpcError) as caught:
            _generate(channel, [100], seed=1)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue limit 100" in caught.value.details()
        assert sum(len(b.labels) for b in first) == 100 - 16
    finally:
        server.stop(0)


def test_client_resumes_after_a_generator_restart_without_gaps(model_dir: Path) -> None:
    first = _server(model_dir)
    port = first.start()
    first.load()
    channel = grpcutil.make_channel(f"127.0.0.1:{port}")
    counts, offsets = [20, 0, 30], [5, 0, 0]
    expected_labels, expected = _generate(channel, counts, seed=9, offsets=offsets)
    received: list[tuple[np.ndarray, np.ndarray, int]] = []
    servers = [first]

    def on_batch(labels: np.ndarray, images: np.ndarray, first_index: int) -> None:
        received.append((labels, images.copy(), first_index))
        if len(received) == 1:  # kill the generator mid-stream and bring up a fresh one on the same port
            servers[-1].stop(0)
            restarted = _server(model_dir, port=port)
            restarted.start()
            restarted.load()
            servers.append(restarted)

    try:
        total = fetch_images(channel, counts, seed=9, offsets=offsets, timeout_s=60, on_batch=on_batch)
    finally:
        servers[-1].stop(0)
    assert len(servers) == 2 and total == 50
    assert [r[2] for r in received] == list(np.cumsum([0] + [len(r[0]) for r in received[:-1]]))
    assert np.concatenate([r[0] for r in received]).tolist() == expected_labels.tolist()
    assert np.concatenate([r[1] for r in received]).tobytes() == expected.tobytes()
