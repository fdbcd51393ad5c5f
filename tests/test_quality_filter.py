"""The quality filter (`generation.min_confidence`): exact counts, the same bytes however batched, the cost counted and
reported, a bounded clear failure for an impossible threshold, and bad values refused naming the key."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from deploy.generator_setup import check_backend, serve_arguments
from deploy.launcher import SERVING_POLL_S, Launcher
from deploy.processes import Child, ChildFailed, ProcessGroup
from fedsynth import cli
from fedsynth.wire import grpcutil
from fedsynth.config import load_config
from fedsynth.learning.data import load_dataset
from fedsynth.errors import ConfigError
from fedsynth.generation.generator_client import GeneratorInfo
from fedsynth.generation.generator_names import SERVICE_NAME
from fedsynth.v1 import generator_pb2, generator_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from generator_service import serve_cmd
from generator_service.backends import BackendDescription, PartlyUnservable, Unservable
from generator_service.ddpm.sampling import ImageKey
from generator_service.metrics import GeneratorMetrics
from generator_service.evaluation.judge import STALE_SCRATCH_S, load_or_train_judge, remove_stale_scratch
from generator_service.batcher import Batcher
from generator_service.quality_filter import BATCHES_PER_CALL, MAX_CANDIDATES, JudgeScorer, QualityFilter
from generator_service.serve_cmd import GeneratorServer, ServeConfig

HOLDOUT = {"backend": "holdout", "dataset": "digits", "holdout_fraction": 0.2, "seed": 0}
DESCRIPTION = BackendDescription(backend="noise", model_id="noise", dataset="digits", num_classes=3,
                                 image_shape=(1, 4, 4), device="cpu", dtype="uint8")


class NoiseBackend:
    """Pure noise: each image a pure function of its key, as every backend's is."""

    description = DESCRIPTION

    def __init__(self) -> None:
        self.drawn: list[ImageKey] = []

    def sample(self, keys: Sequence[ImageKey]) -> np.ndarray:
        self.drawn += keys
        return np.stack([np.random.default_rng([k.seed, k.class_id, k.index]).integers(0, 256, (4, 4, 1), dtype=np.uint8)
                         for k in keys])

    def check_counts(self, counts: Sequence[int]) -> None:
        return None


class PixelScorer:
    """A stand-in judge: the confidence is the image's first pixel / 255 (class 2: never above 0)."""

    def confidence(self, images: np.ndarray, classes: np.ndarray) -> np.ndarray:
        return np.where(classes == 2, 0.0, images[:, 0, 0, 0] / 255.0)


def _filter(min_confidence: float, max_batch: int = 8,
            metrics: GeneratorMetrics | None = None) -> tuple[QualityFilter, NoiseBackend]:
    inner = NoiseBackend()
    return QualityFilter(inner, PixelScorer(), min_confidence=min_confidence, max_batch=max_batch,  # type: ignore[arg-type]
                         judge_id="test", metrics=metrics), inner


def _first_accepted(key: ImageKey, min_confidence: float) -> bytes:
    """The contract, written out: the first candidate j + a * 2^32 the (stand-in) judge accepts."""
    backend = NoiseBackend()
    for a in range(1000):
        image = backend.sample([ImageKey(key.seed, key.class_id, key.index + a * 2**32)])
        if PixelScorer().confidence(image, np.array([key.class_id]))[0] >= min_confidence:
            return image.tobytes()
    raise AssertionError(key)


def _keys(counts: list[int], seed: int = 5, offset: int = 0) -> list[ImageKey]:
    return [ImageKey(seed, c, offset + j) for c, n in enumerate(counts) for j in range(n)]


def test_every_image_passes_and_is_the_first_accepted_candidate_of_its_own() -> None:
    filtered, inner = _filter(0.5)
    keys = _keys([6, 5])
    images = filtered.sample(keys)
    assert images.shape == (11, 4, 4, 1) and (images[:, 0, 0, 0] >= 128).all()
    unfiltered = inner.sample(keys)
    for key, image, plain in zip(keys, images, unfiltered):  # a candidate the judge accepts at once is served as is
        if plain[0, 0, 0] >= 128:
            assert image.tobytes() == plain.tobytes(), key
    assert filtered.description.model_id == "noise-q0.5-jtest"


def test_the_same_bytes_however_the_images_are_batched() -> None:
    keys = _keys([9, 7])
    whole = _filter(0.7, max_batch=64)[0].sample(keys)
    small = _filter(0.7, max_batch=3)[0]
    pieces = np.concatenate([small.sample(keys[i : i + 4]) for i in range(0, len(keys), 4)])
    shuffled = np.random.default_rng(0).permutation(len(keys))
    alone = small.sample([keys[i] for i in shuffled])
    assert whole.tobytes() == pieces.tobytes() == alone[np.argsort(shuffled)].tobytes()
    assert whole.tobytes() == b"".join(_first_accepted(key, 0.7) for key in keys)
    offsets = small.sample(_keys([0, 3], offset=4))  # offsets resume the same images
    assert offsets.tobytes() == whole[13:16].tobytes()


def test_rejected_images_retried_beside_fresh_keys_cost_fewer_backend_batches_for_the_same_bytes() -> None:
    """What --filter-batches buys: keys handed over 8 batches at a time fill the backend's padded batches with
    fresh images where one batch at a time fills them with more candidates of the few it rejected."""
    keys = _keys([200, 200], seed=1)  # classes 0 and 1: the stand-in judge accepts about 37% at 0.63
    drawn = {}
    for keys_per_call in (16, 16 * BATCHES_PER_CALL):
        filtered, inner = _filter(0.63, max_batch=16)
        calls: list[int] = []
        sample = inner.sample
        inner.sample = lambda batch: calls.append(len(batch)) or sample(batch)  # type: ignore[method-assign]
        images = np.concatenate([filtered.sample(keys[i : i + keys_per_call]) for i in range(0, len(keys), keys_per_call)])
        assert max(calls) <= 16
        drawn[keys_per_call] = (len(calls), images.tobytes())
    (one_calls, one_bytes), (eight_calls, eight_bytes) = drawn[16], drawn[16 * BATCHES_PER_CALL]
    assert one_bytes == eight_bytes
    assert eight_calls < 0.8 * one_calls, (one_calls, eight_calls)


def test_spare_rows_draw_the_next_candidates_and_every_candidate_is_counted() -> None:
    metrics = GeneratorMetrics(CollectorRegistry())
    filtered, inner = _filter(0.9, max_batch=16, metrics=metrics)
    filtered.sample(_keys([4]))  # one call of 16 rows: 4 first candidates, then 3 more of each image
    value = metrics.registry.get_sample_value
    candidates, accepted, rejected = (value(f"fedsynth_generator_filter_{name}_total", {"class_id": "0"})
                                      for name in ("candidates", "accepted", "rejected"))
    assert accepted == 4 and candidates == len(inner.drawn) and len(inner.drawn) % 16 == 0
    assert candidates > accepted + rejected  # the spare ones: drawn after their image's candidate was accepted
    assert 0 < (value("fedsynth_generator_filter_unserved_device_seconds_total") or 0.0)


def test_an_impossible_class_fails_alone_within_its_budget_naming_class_threshold_and_rate() -> None:
    filtered, inner = _filter(0.5)
    with pytest.raises(PartlyUnservable) as caught:
        filtered.sample(_keys([2, 0, 3]))
    message = str(caught.value)
    assert "min_confidence 0.5" in message and "class 2: 3 of 3 images had all their 220 candidates rejected" in message
    assert "acceptance rate 0.00%" in message and "class 0" not in message
    assert caught.value.failed_rows == frozenset({2, 3, 4})
    assert (caught.value.images[:2, 0, 0, 0] >= 128).all()  # class 0 was served
    assert sum(k.class_id == 2 for k in inner.drawn) == MAX_CANDIDATES * 3  # each image its own 220, no more


HARD = 0.99  # PixelScorer accepts a pixel >= 253: 3 of 256 candidates, so some images have none in their first 220


def _first_candidate(key: ImageKey) -> int | None:
    """The contract with its bound, written out: the first of the image's own MAX_CANDIDATES candidates the judge
    accepts, or None (unservable), whatever else is asked."""
    backend = NoiseBackend()
    for a in range(MAX_CANDIDATES):
        image = backend.sample([ImageKey(key.seed, key.class_id, key.index + a * 2**32)])
        if PixelScorer().confidence(image, np.array([key.class_id]))[0] >= HARD:
            return a
    return None


def _own_chain(key: ImageKey) -> bytes | None:
    a = _first_candidate(key)
    return None if a is None else NoiseBackend().sample([ImageKey(key.seed, key.class_id, key.index + a * 2**32)]).tobytes()


def _outcome(filtered: QualityFilter, keys: list[ImageKey], rows: list[int]) -> list[bytes | None]:
    try:
        images = filtered.sample(keys)
        failed: frozenset[int] = frozenset()
    except PartlyUnservable as exc:
        images, failed = exc.images, exc.failed_rows
    return [None if row in failed else images[row].tobytes() for row in rows]


def test_an_image_fails_or_is_served_alike_alone_and_batched_behind_a_large_request_of_its_class() -> None:
    keys = [ImageKey(7, 0, j) for j in range(40)]
    expected = [_own_chain(key) for key in keys]
    assert any(e is None for e in expected) and any(e is not None for e in expected)  # both kinds of image tested
    big = [ImageKey(3, 0, j) for j in range(64)]  # another client's 64 images of the same (hard) class
    late = max((row for row in range(40) if expected[row] is not None), key=lambda row: _first_candidate(keys[row]))
    for row in (expected.index(None), late, 0):
        alone = _outcome(_filter(HARD, max_batch=80)[0], [keys[row]], [0])
        behind = _outcome(_filter(HARD, max_batch=80)[0], big + [keys[row]], [64])
        assert alone == behind == [expected[row]], keys[row]
    batched = _outcome(_filter(HARD, max_batch=16)[0], big + keys, list(range(64, 104)))
    assert batched == expected


def test_a_request_fails_or_succeeds_alike_alone_and_sharing_a_batcher_batch() -> None:
    """A 1-image request of a hard class, alone and batched after a 64-image request of that class: the same status
    and bytes (before, the class's candidate budget was pooled per batch and the earlier rows used it up)."""
    keys = [ImageKey(7, 0, j) for j in range(40)]
    expected = [_own_chain(key) for key in keys]
    unservable = expected.index(None)
    served = max((row for row in range(40) if expected[row] is not None), key=lambda row: _first_candidate(keys[row]))
    assert _first_candidate(keys[served]) > 100  # more than its share of a pooled 20 x 65 + 200 candidates

    def request(key: ImageKey, behind: bool) -> bytes | None:
        batcher = Batcher(_filter(HARD, max_batch=80)[0].sample, max_batch=80, max_wait_s=0.5, queue_limit=1000)
        try:
            big = batcher.submit([ImageKey(3, 0, j) for j in range(64)]) if behind else None
            job = batcher.submit([key])
            try:
                result: bytes | None = b"".join(chunk.tobytes() for chunk in job.chunks())
            except Unservable as exc:
                assert "min_confidence 0.99: class 0: " in str(exc) and "all their 220 candidates rejected" in str(exc)
                assert "acceptance rate" in str(exc)
                result = None
            if big is not None:
                try:
                    list(big.chunks())
                except Unservable:
                    pass
            return result
        finally:
            batcher.close()

    for row in (served, unservable):
        assert request(keys[row], behind=False) == request(keys[row], behind=True) == expected[row]


# --- over gRPC: the holdout backend on digits, judged by `fedsynth generator evaluate`'s cached digits judge ---


@pytest.fixture(scope="module")
def judges(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("judges")


def _server(judges: Path, **overrides: object) -> GeneratorServer:
    settings: dict[str, object] = {**HOLDOUT, "max_batch": 16, "max_wait_ms": 5.0, "metrics_port": -1,
                                   "min_confidence": 0.9, "judge_cache": judges, "threads": 1, **overrides}
    return GeneratorServer(ServeConfig(**settings), registry=CollectorRegistry())  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def served(judges: Path) -> Iterator[tuple[GeneratorServer, grpc.Channel]]:
    server = _server(judges, metrics_port=0)
    port = server.start()
    server.load()  # trains the digits judge into `judges` (seconds), as a first `generator evaluate` would
    channel = grpcutil.make_channel(f"127.0.0.1:{port}")
    yield server, channel
    channel.close()
    server.stop(0)


def _generate(channel: grpc.Channel, counts: list[int], seed: int, offsets: list[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    stub = generator_pb2_grpc.GeneratorStub(channel)
    request = generator_pb2.GenerateRequest(counts=counts, seed=seed, offsets=offsets or [])
    labels, images = [], []
    for batch in stub.Generate(request, timeout=120):
        labels.append(np.asarray(batch.labels))
        images.append(np.frombuffer(batch.images, np.uint8).reshape(len(batch.labels), batch.height, batch.width,
                                                                    batch.channels))
    return np.concatenate(labels), np.concatenate(images)


def test_exact_counts_the_same_bytes_in_other_batches_and_the_cost_reported(
        served: tuple[GeneratorServer, grpc.Channel], judges: Path, tmp_path: Path) -> None:
    server, channel = served
    counts = [30] * 10
    labels, images = _generate(channel, counts, seed=4)
    assert np.bincount(labels, minlength=10).tolist() == counts
    info = GeneratorInfo.fetch(channel, timeout_s=10)
    assert info.model_id.startswith("holdout-digits-f0.2-s0-") and "-q0.9-j" in info.model_id
    assert (info.max_batch, server.batcher.max_batch) == (16, 16 * BATCHES_PER_CALL)  # the filter takes 8 batches at once

    other = _server(judges, max_batch=3)  # the judge now comes from the cache
    port = other.start()
    other.load()
    try:
        other_channel = grpcutil.make_channel(f"127.0.0.1:{port}")
        _, tail = _generate(other_channel, [0, 5, 0, 7], seed=4, offsets=[0, 25, 0, 23])
        other_channel.close()
    finally:
        other.stop(0)
    assert tail.tobytes() == np.concatenate([images[55:60], images[113:120]]).tobytes()

    metrics = server.metrics.registry
    per_class = [(metrics.get_sample_value(f"fedsynth_generator_filter_{name}_total", {"class_id": str(c)}) or 0.0)
                 for name in ("candidates", "accepted", "rejected") for c in range(10)]
    candidates, accepted, rejected = per_class[:10], per_class[10:20], per_class[20:]
    assert accepted == [30.0] * 10 and all(a + r <= c for a, r, c in zip(accepted, rejected, candidates))
    assert sum(rejected) > 0  # some real digits are judged below 0.9
    assert metrics.get_sample_value("fedsynth_generator_filter_min_confidence") == 0.9
    device = metrics.get_sample_value("fedsynth_generator_device_seconds_total") or 0.0
    assert 0 < (metrics.get_sample_value("fedsynth_generator_filter_unserved_device_seconds_total") or 0.0) < device

    (tmp_path / "generator.metrics-port").write_text(f"{server.metrics_port}\n")  # what the launcher reads
    cfg = load_config(None, ["generation.backend=holdout", "data.holdout_fraction=0.2", "generation.min_confidence=0.9"])
    launcher = Launcher(cfg, argparse.Namespace(config=None, set=[]), tmp_path)
    launcher.generator_metrics_file = tmp_path / "generator.metrics-port"
    counters = launcher.generator_counters()
    assert counters is not None
    report = counters["quality_filter"]
    assert report is not None and report["min_confidence"] == 0.9
    assert (report["candidates_total"], report["accepted_total"], report["rejected_total"], report["spare_total"]) == (
        sum(candidates), 300, sum(rejected), sum(candidates) - 300 - sum(rejected))
    assert report["rejected_per_class"] == {str(c): int(r) for c, r in enumerate(rejected)}
    assert report["acceptance_rate"] == pytest.approx(300 / (300 + sum(rejected)))
    assert 0 < report["unserved_device_seconds"] < counters["device_seconds"]  # type: ignore[index]


def test_the_judge_scores_an_image_alike_alone_and_among_others(
        served: tuple[GeneratorServer, grpc.Channel], judges: Path) -> None:
    judge = load_or_train_judge("digits", data_dir=None, seed=0, root=judges)  # cached by the served fixture
    assert judge.cached
    images = load_dataset("digits", "test").x[:150]
    classes = np.arange(150) % 10
    scorer = JudgeScorer(judge.model)
    together = scorer.confidence(images, classes)  # three padded calls of 64 rows
    alone = np.concatenate([scorer.confidence(images[i : i + 1], classes[i : i + 1]) for i in range(0, 150, 7)])
    assert together[::7].tobytes() == alone.tobytes()


def test_evaluate_scores_the_filtered_images(served: tuple[GeneratorServer, grpc.Channel], judges: Path,
                                             tmp_path: Path) -> None:
    out = tmp_path / "filtered.json"
    assert cli.main(["generator", "evaluate", "--backend", "holdout", "--dataset", "digits", "--holdout-fraction", "0.2",
                     "--min-confidence", "0.9", "--per-class", "20", "--threads", "1", "--judge-cache", str(judges),
                     "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert "-q0.9-j" in figures["model_id"] and figures["n_per_class"] == 20
    assert figures["recognizability"] == 1.0  # the judge only let through what it recognizes


def test_an_impossible_threshold_fails_the_request_in_one_clear_status(
        judges: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def never(inner, *, min_confidence, max_batch, metrics, **_):  # type: ignore[no-untyped-def]
        zero = type("Zero", (), {"confidence": lambda self, images, classes: np.zeros(len(images))})()
        return QualityFilter(inner, zero, min_confidence=min_confidence, max_batch=max_batch, judge_id="zero",
                             metrics=metrics)

    monkeypatch.setattr(serve_cmd, "load_quality_filter", never)
    server = _server(judges, min_confidence=0.99)
    port = server.start()
    server.load()
    channel = grpcutil.make_channel(f"127.0.0.1:{port}")
    try:
        with pytest.raises(grpc.RpcError) as caught:
            _generate(channel, [0, 0, 4], seed=1)
    finally:
        channel.close()
        server.stop(0)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = caught.value.details()
    assert "min_confidence 0.99" in details and "class 2" in details and "acceptance rate 0.00%" in details
    drawn = server.metrics.registry.get_sample_value("fedsynth_generator_filter_candidates_total", {"class_id": "2"})
    assert drawn == MAX_CANDIDATES * 4


def test_sigterm_while_training_the_judge_exits_at_once_with_143_and_caches_nothing(tmp_path: Path) -> None:
    """`fedsynth generator serve --min-confidence` with no cached judge trains one before serving (CIFAR-10: ~15 min
    on a CPU); a SIGTERM meanwhile ends it within seconds, as every role, and leaves no judge in the cache."""
    data = tmp_path / "data"  # 8x8 images like digits, but 40000 of them: training takes long enough to signal it
    data.mkdir()
    rng = np.random.default_rng(0)
    for split, n in (("train", 40_000), ("test", 200)):
        np.savez(data / f"{split}.npz", x=rng.integers(0, 256, (n, 8, 8, 1), dtype=np.uint8), y=np.arange(n) % 10)
    cache = tmp_path / "cache"
    log_path = tmp_path / "generator.log"
    port_file = tmp_path / "generator.port"
    env = {**os.environ, "FEDSYNTH_CACHE": str(cache)}
    env.pop("FEDSYNTH_PARENT_PID", None)
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fedsynth.cli", "generator", "serve", "--backend", "holdout", "--dataset", "npz",
             "--data-dir", str(data), "--holdout-fraction", "0.2", "--seed", "0", "--min-confidence", "0.9", "--threads", "1", "--port", "0",
             "--port-file", str(port_file), "--insecure"],
            stdout=log_file, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 120
        while not port_file.exists():  # bound: health answers while the backend and the judge load
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, f"no port file:\n{log_path.read_text()}"
            time.sleep(0.02)
        channel = grpcutil.make_channel(f"127.0.0.1:{int(port_file.read_text())}")
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=10)
        channel.close()
        health = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        while "training the judge" not in log_path.read_text():
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, f"the judge's training never began:\n{log_path.read_text()}"
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        code = proc.wait(timeout=15)
        took = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = log_path.read_text()
    assert health == "NOT_SERVING", output
    assert "judge trained in" not in output, "the judge finished before the signal: the test proved nothing"
    assert code == 143 and took < 5.0, (code, took, output)
    assert "stopped by signal while loading the backend" in output
    judges = cache / "judges"
    assert not judges.exists() or not [p for p in judges.rglob("*") if p.name == "judge.json"], list(judges.rglob("*"))
    assert not judges.exists() or not list(judges.iterdir()), list(judges.iterdir())


def test_stale_judge_scratch_folders_are_removed_and_fresh_ones_kept(tmp_path: Path) -> None:
    folder = tmp_path / "digits-cnn-seed0-abc"
    stale, fresh, other = (tmp_path / f".{folder.name}-1.tmp", tmp_path / f".{folder.name}-2.tmp",
                           tmp_path / ".cifar10-cnn-seed0-def-3.tmp")
    for scratch in (stale, fresh, other):
        (scratch / folder.name).mkdir(parents=True)
        (scratch / folder.name / "weights.safetensors").write_bytes(b"half")
    old = time.time() - STALE_SCRATCH_S - 60
    for scratch in (stale, other):
        os.utime(scratch, (old, old))
    remove_stale_scratch(folder)
    assert not stale.exists() and fresh.exists() and other.exists()  # another judge's scratch is its own writer's


# --- configuration ---


@pytest.mark.parametrize("value", ["1.0", "1", "-0.1", "nan", "inf", '"high"', "true"])
def test_bad_min_confidence_is_refused_naming_the_key(value: str) -> None:
    with pytest.raises(ConfigError, match=r"generation\.min_confidence"):
        load_config(None, [f"generation.min_confidence={value}"])


@pytest.mark.parametrize("value", [1.0, -0.5, 2.0])
def test_serve_refuses_a_bad_min_confidence(value: float) -> None:
    with pytest.raises(ConfigError, match="--min-confidence must be in"):
        ServeConfig(**HOLDOUT, min_confidence=value)  # type: ignore[arg-type]
    ServeConfig(model=Path("m"), data_dir=Path("d"), min_confidence=0.5)  # the judge's data: ddpm takes it, filtering
    with pytest.raises(ConfigError, match="--filter-batches must be >= 1, got 0"):
        ServeConfig(**HOLDOUT, min_confidence=0.5, filter_batches=0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="the quality filter reads it with --min-confidence > 0"):
        ServeConfig(model=Path("m"), data_dir=Path("d"))
    parser = argparse.ArgumentParser()
    serve_cmd.add_arguments(parser)
    args = parser.parse_args(["--backend", "holdout", "--min-confidence", str(value)])
    assert args.min_confidence == value


@pytest.mark.serial  # asserts a time bound
def test_the_launcher_reports_a_generator_that_exits_while_loading_at_once(tmp_path: Path) -> None:
    """With min_confidence the launcher waits up to an hour for SERVING (a judge may be training), but a generator
    that exits meanwhile (e.g. its dataset is missing) fails the start within SERVING_POLL_S, not after 120 s."""
    cfg = load_config(None, ["generation.backend=holdout", "data.holdout_fraction=0.2", "generation.min_confidence=0.5"])
    launcher = Launcher(cfg, argparse.Namespace(config=None, set=[]), tmp_path)
    process = subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(0.5); sys.exit(1)"])
    channel = grpcutil.make_channel("127.0.0.1:1")  # nothing answers health there
    started = time.monotonic()
    try:
        with pytest.raises(ChildFailed, match="exited before serving") as caught:
            launcher._wait_for_serving(channel, Child("generator", process, tmp_path / "generator.log"))
    finally:
        channel.close()
        if process.poll() is None:
            process.kill()
        process.wait()
    assert caught.value.exit_code == 1
    assert time.monotonic() - started < SERVING_POLL_S + 3.0


def test_the_launcher_passes_min_confidence_and_refuses_it_for_a_running_generator(tmp_path: Path) -> None:
    cfg = load_config(None, ["generation.backend=holdout", "data.holdout_fraction=0.2", "generation.min_confidence=0.5"])
    assert serve_arguments(cfg, ProcessGroup(tmp_path / "logs"))[-2:] == ["--min-confidence", "0.5"]
    assert "--min-confidence" not in serve_arguments(load_config(None, ["generation.backend=holdout",
                                                                         "data.holdout_fraction=0.2"]),
                                                      ProcessGroup(tmp_path / "logs"))
    running = load_config(None, ["generation.generator=127.0.0.1:9", "generation.min_confidence=0.5"])
    with pytest.raises(ConfigError, match="generation.min_confidence = 0.5 is a setting of the generator"):
        check_backend(running)
    assert load_config(None).fingerprint() == load_config(None, ["generation.min_confidence=0"]).fingerprint()
    assert load_config(None).fingerprint() != cfg.fingerprint()
