"""The `holdout` generator backend over real gRPC: real held-out images only (never a client's), exact counts,
determinism by seed, offsets, without-then-with replacement, the ddpm backend's validation; the launcher's side."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from deploy.generator_setup import check_backend, serve_arguments
from deploy.launcher import Launcher
from deploy.processes import ProcessGroup
from fedsynth.wire import grpcutil
from fedsynth.config import GENERATOR_BACKENDS, load_config
from fedsynth.learning.data import load_dataset
from fedsynth.errors import ConfigError
from fedsynth.generation.generator_client import GeneratorInfo, fetch_images
from fedsynth.learning.partition import holdout_split, partition
from fedsynth.v1 import generator_pb2, generator_pb2_grpc
from generator_service.backends import BACKENDS
from generator_service.backends.holdout import HoldoutBackend, load_holdout
from generator_service.ddpm.sampling import ImageKey
from generator_service.serve_cmd import SERVICE_NAME, GeneratorServer, ServeConfig

FRACTION, SEED, CLIENTS = 0.2, 3, 8
HOLDOUT = {"backend": "holdout", "dataset": "digits", "holdout_fraction": FRACTION, "seed": SEED}


def _server(**overrides: object) -> GeneratorServer:
    settings: dict[str, object] = {**HOLDOUT, "max_batch": 16, "max_wait_ms": 5.0, "metrics_port": -1,
                                   "max_request_images": 5000, **overrides}
    return GeneratorServer(ServeConfig(**settings), registry=CollectorRegistry())  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[HoldoutBackend, grpc.Channel]]:
    server = _server()
    port = server.start()
    backend = server.load().backend
    assert isinstance(backend, HoldoutBackend)
    channel = grpcutil.make_channel(f"127.0.0.1:{port}")
    yield backend, channel
    channel.close()
    server.stop(0)


def _generate(channel: grpc.Channel, counts: list[int], seed: int, offsets: list[int] | None = None,
              model_id: str = "") -> tuple[np.ndarray, np.ndarray]:
    stub = generator_pb2_grpc.GeneratorStub(channel)
    request = generator_pb2.GenerateRequest(counts=counts, seed=seed, offsets=offsets or [], model_id=model_id)
    labels, images = [], []
    for batch in stub.Generate(request, timeout=60):
        labels.append(np.asarray(batch.labels))
        images.append(np.frombuffer(batch.images, np.uint8).reshape(len(batch.labels), batch.height, batch.width,
                                                                    batch.channels))
    return np.concatenate(labels), np.concatenate(images)


def _sources(backend: HoldoutBackend, counts: list[int], seed: int, offsets: list[int] | None = None) -> np.ndarray:
    """The training-split index of every image the server streams for this request, in stream order."""
    offsets = offsets or [0] * len(counts)
    return np.array([backend.source_index(ImageKey(seed, c, offsets[c] + j))
                     for c, n in enumerate(counts) for j in range(n)], dtype=np.int64)


def test_info_names_the_holdout_backend(served: tuple[HoldoutBackend, grpc.Channel]) -> None:
    info = GeneratorInfo.fetch(served[1], timeout_s=10)
    assert (info.backend, info.dataset, info.num_classes, info.image_shape) == ("holdout", "digits", 10, (1, 8, 8))
    assert info.model_id.startswith(f"holdout-digits-f{FRACTION}-s{SEED}-") and info.max_batch == 16
    assert load_holdout("digits", fraction=FRACTION, seed=SEED + 1).description.model_id != info.model_id


def test_serves_exact_counts_of_held_out_images_never_a_clients(served: tuple[HoldoutBackend, grpc.Channel]) -> None:
    backend, channel = served
    train = load_dataset("digits", "train")
    parts = partition(train.y, CLIENTS, alpha=0.3, seed=SEED, holdout_fraction=FRACTION)  # what the run's clients hold
    held = holdout_split(train.y, FRACTION, SEED)[1]
    assert len(np.intersect1d(np.concatenate(parts), held)) == 0
    counts = [40, 0, 3, 0, 0, 0, 0, 0, 0, 75]  # past every class's ~29 held-out images: with replacement too
    labels, images = _generate(channel, counts, seed=11)
    assert labels.tolist() == [0] * 40 + [2] * 3 + [9] * 75
    sources = _sources(backend, counts, seed=11)
    assert np.isin(sources, held).all() and not np.isin(sources, np.concatenate(parts)).any()
    assert (train.y[sources] == labels).all()
    assert images.tobytes() == train.x[sources].tobytes()  # the bytes are those of the held-out image it names


def test_without_replacement_until_a_class_runs_out_then_with(served: tuple[HoldoutBackend, grpc.Channel]) -> None:
    backend, _ = served
    members = backend.held_out(4)
    extra = 200
    sources = _sources(backend, [0, 0, 0, 0, len(members) + extra], seed=2)
    first, beyond = sources[: len(members)], sources[len(members):]
    assert sorted(first.tolist()) == members.tolist()  # each held-out image exactly once, in a seeded order
    assert first.tolist() != members.tolist()
    assert np.isin(beyond, members).all() and len(np.unique(beyond)) < extra  # 200 draws of ~29: repeats
    assert len(np.unique(beyond)) > len(members) // 2  # ...spread over the class, not one image


def test_deterministic_by_seed(served: tuple[HoldoutBackend, grpc.Channel]) -> None:
    backend, channel = served
    counts = [5, 5, 5, 5, 5, 5, 5, 5, 5, 40]
    _, once = _generate(channel, counts, seed=7)
    _, again = _generate(channel, counts, seed=7)
    assert once.tobytes() == again.tobytes()
    assert load_holdout("digits", fraction=FRACTION, seed=SEED).sample(
        [ImageKey(7, c, j) for c, n in enumerate(counts) for j in range(n)]).tobytes() == once.tobytes()  # a fresh load
    assert (_sources(backend, counts, seed=7) != _sources(backend, counts, seed=8)).mean() > 0.5


def test_offsets_continue_a_stream_exactly(served: tuple[HoldoutBackend, grpc.Channel]) -> None:
    channel = served[1]
    _, whole = _generate(channel, [50, 4], seed=5)  # class 0 crosses from its permutation into with-replacement draws
    _, head = _generate(channel, [20, 4], seed=5)
    _, tail = _generate(channel, [30], seed=5, offsets=[20])
    assert np.concatenate([head[:20], tail, head[20:]]).tobytes() == whole.tobytes()


@pytest.mark.parametrize(
    ("fields", "code", "words"),
    [
        ({"counts": [1] * 11}, grpc.StatusCode.INVALID_ARGUMENT, "class id 10 is out of range 0..9"),
        ({"counts": [1], "offsets": [0] * 12}, grpc.StatusCode.INVALID_ARGUMENT, "offsets has 12 entries"),
        ({"counts": [0, 0, 0]}, grpc.StatusCode.INVALID_ARGUMENT, "empty request"),
        ({"counts": []}, grpc.StatusCode.INVALID_ARGUMENT, "empty request"),
        ({"counts": [4000, 1001]}, grpc.StatusCode.INVALID_ARGUMENT, "5001 images requested, above the per-request limit of 5000"),
        ({"counts": [0, 2], "offsets": [0, 2**32 - 1]}, grpc.StatusCode.INVALID_ARGUMENT, "class 1: offset 4294967295 + count 2"),
        ({"counts": [1], "model_id": "ddpm-tiny-digits-0"}, grpc.StatusCode.FAILED_PRECONDITION, "'ddpm-tiny-digits-0'"),
    ],
)
def test_bad_requests_get_the_ddpm_backends_codes(served: tuple[HoldoutBackend, grpc.Channel], fields: dict,
                                                  code: grpc.StatusCode, words: str) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        _generate(served[1], seed=0, **fields)
    assert caught.value.code() == code and words in caught.value.details()


def test_a_class_without_held_out_images_is_failed_precondition(tmp_path: Path) -> None:
    y = np.array([0] * 20 + [1] * 20 + [2] * 1)  # round(1 x 0.25) = 0: class 2 keeps its one image for the clients
    x = np.random.default_rng(0).integers(0, 256, (len(y), 4, 4, 1), dtype=np.uint8)
    np.savez(tmp_path / "train.npz", x=x, y=y)
    server = _server(dataset="npz", data_dir=tmp_path, holdout_fraction=0.25)
    port = server.start()
    try:
        health = health_pb2_grpc.HealthStub(grpcutil.make_channel(f"127.0.0.1:{port}"))
        status = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING  # until the data is loaded
        server.load()
        channel = grpcutil.make_channel(f"127.0.0.1:{port}")
        with pytest.raises(grpc.RpcError) as caught:
            _generate(channel, [1, 1, 1], seed=0)
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "class 2 has no held-out image" in caught.value.details()
        labels, _ = _generate(channel, [2, 3], seed=0)  # the other classes are still served
        assert labels.tolist() == [0, 0, 1, 1, 1]
    finally:
        server.stop(0)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({**HOLDOUT, "seed": None}, "--backend holdout needs --seed"),
        ({**HOLDOUT, "holdout_fraction": 0.0}, "--holdout-fraction must be in (0, 1) for --backend holdout, got 0.0"),
        ({**HOLDOUT, "model": Path("m")}, "--model is a flag of --backend ddpm, not of --backend holdout"),
        ({"model": Path("m"), "seed": 1}, "--seed is a flag of --backend holdout, not of --backend ddpm"),
        ({**HOLDOUT, "dataset": "mnist"}, "--dataset must be one of digits, cifar10, cifar100, npz, got 'mnist'"),
        ({"backend": "gan"}, "--backend must be one of ddpm, holdout, text2image, got 'gan'"),
    ],
)
def test_serve_config_names_the_bad_flag(fields: dict, words: str) -> None:
    with pytest.raises(ConfigError) as caught:
        ServeConfig(**fields)
    assert str(caught.value) == words


def test_run_config_refuses_holdout_without_a_holdout_split() -> None:
    assert GENERATOR_BACKENDS == tuple(BACKENDS)
    with pytest.raises(ConfigError, match="generation.backend must be one of"):
        load_config(None, ["generation.backend=gan"])
    cfg = load_config(None, ["generation.backend=holdout"])
    with pytest.raises(ConfigError) as caught:
        check_backend(cfg)
    assert "generation.backend = 'holdout'" in str(caught.value) and "data.holdout_fraction = 0" in str(caught.value)


def test_launcher_flags_start_a_holdout_generator_on_the_runs_split(tmp_path: Path) -> None:
    cfg = load_config(None, ["generation.backend=holdout", f"data.holdout_fraction={FRACTION}", f"seed={SEED}"])
    group = ProcessGroup(tmp_path / "logs")
    flags = serve_arguments(cfg, group)
    assert flags == ["--backend", "holdout", "--dataset", "digits", "--holdout-fraction", "0.2", "--seed", "3"]
    port_file, metrics_file = tmp_path / "generator.port", tmp_path / "generator.metrics-port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedsynth.cli", "generator", "serve", *flags, "--port", "0", "--port-file", str(port_file),
         "--metrics-port", "0", "--metrics-port-file", str(metrics_file), "--insecure"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (port_file.exists() and metrics_file.exists()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1]
            time.sleep(0.05)
        channel = grpcutil.make_channel(f"127.0.0.1:{int(port_file.read_text())}")
        grpcutil.wait_for_serving(channel, SERVICE_NAME, timeout_s=60)
        info = GeneratorInfo.fetch(channel, timeout_s=10)
        batches: list[np.ndarray] = []
        fetch_images(channel, [3, 4], seed=9, timeout_s=60, on_batch=lambda _l, images, _f: batches.append(images.copy()))
        launcher = Launcher(cfg, argparse.Namespace(config=None, set=[]), tmp_path)
        launcher.generator_metrics_file = metrics_file
        counters = launcher.generator_counters()
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr
    local = load_holdout("digits", fraction=FRACTION, seed=SEED)  # another process, the same split and bytes
    assert info.model_id == local.description.model_id and info.backend == "holdout"
    expected = local.sample([ImageKey(9, 0, j) for j in range(3)] + [ImageKey(9, 1, j) for j in range(4)])
    assert np.concatenate(batches).tobytes() == expected.tobytes()
    assert counters is not None and (counters["backend"], counters["model_id"]) == ("holdout", info.model_id)
    assert counters["images_total"] == 7 and 0 < float(counters["device_seconds"]) < 1.0
