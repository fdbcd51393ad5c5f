"""A stop during generation: a client's fetch ends at once (one replica or several), and a generator process stopped
by SIGTERM while a long batch samples exits within its grace instead of waiting for the batch."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from fedsynth.wire import grpcutil
from fedsynth.errors import StopRequested
from fedsynth.generation.generator_client import fetch_images
from fedsynth.generation.generator_replicas import GeneratorReplicas
from generator_service.ddpm.model import GeneratorMetadata, build_unet, make_train_scheduler, save_generator
from generator_service.serve_cmd import SERVICE_NAME, GeneratorServer, ServeConfig

GRACE_S = 1.0
# 64 images of 400 DDIM steps with guidance: tens of seconds on one CPU thread, far longer than any bound below.
SLOW = ("--ddim-steps", "400", "--guidance", "1", "--max-batch", "64", "--threads", "1", "--grace", str(GRACE_S))


def _fetch_until_stopped(fetch, stop: threading.Event) -> tuple[float, BaseException | None]:
    """Run fetch(stop) on a thread, set stop once sampling is under way; (seconds from stop to the end, what it raised)."""
    raised: list[BaseException] = []
    thread = threading.Thread(target=lambda: _capture(lambda: fetch(stop), raised), daemon=True)
    thread.start()
    time.sleep(1.0)
    assert thread.is_alive(), f"the fetch ended before the stop: {raised}"
    stopped_at = time.monotonic()
    stop.set()
    thread.join(timeout=30)
    return time.monotonic() - stopped_at, (raised[0] if raised else None)


def _capture(work, raised: list[BaseException]) -> None:
    try:
        work()
    except BaseException as exc:  # noqa: BLE001 - the test inspects it
        raised.append(exc)


def test_a_stop_ends_a_waiting_fetch_and_sigterm_ends_a_sampling_generator(tmp_path: Path) -> None:
    model = tmp_path / "model"
    save_generator(model, build_unet("tiny", num_classes=10, image_shape=(1, 8, 8), seed=1), make_train_scheduler(),
                   GeneratorMetadata("digits", 10, (1, 8, 8), "tiny", training_steps=0, guidance=1.0, ddim_steps=2))
    port_file = tmp_path / "generator.port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedsynth.cli", "generator", "serve", "--model", str(model), "--port", "0",
         "--port-file", str(port_file), "--metrics-port", "-1", "--insecure", *SLOW],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not port_file.exists():
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "no port file after 120 s"
            time.sleep(0.05)
        address = f"127.0.0.1:{int(port_file.read_text())}"
        channel = grpcutil.make_channel(address)
        grpcutil.wait_for_serving(channel, SERVICE_NAME, timeout_s=60)
        received: list[int] = []

        one = lambda stop: fetch_images(channel, [64], seed=1, timeout_s=600, stop=stop,  # noqa: E731
                                        on_batch=lambda labels, *_: received.append(len(labels)))
        waited, raised = _fetch_until_stopped(one, threading.Event())
        assert isinstance(raised, StopRequested), raised
        assert "0 of 64 arrived" in str(raised) and not received
        assert waited < 5.0, f"the fetch took {waited:.1f}s to notice its stop"

        replicas = GeneratorReplicas.connect(f"{address},{address.replace('127.0.0.1', 'localhost')}", key="--generator")
        try:
            two = lambda stop: replicas.fetch([0, 64], seed=1, timeout_s=600, stop=stop, piece_images=32,  # noqa: E731
                                              on_batch=lambda labels, *_: received.append(len(labels)))
            waited, raised = _fetch_until_stopped(two, threading.Event())
        finally:
            replicas.close()
        assert isinstance(raised, StopRequested), raised
        assert waited < 5.0, f"the sharded fetch took {waited:.1f}s to notice its stop"
        channel.close()

        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr
    assert "the sampling batch in flight was abandoned" in stderr, stderr[-2000:]
    # The grace, a 1 s wait for the batch, and the process's own exit: not the tens of seconds the batch needs.
    assert took < GRACE_S + 8.0, f"SIGTERM took {took:.1f}s"


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_stop_that_is_never_set_changes_no_byte(replicas: int) -> None:
    server = GeneratorServer(ServeConfig(backend="holdout", dataset="digits", holdout_fraction=0.2, seed=3, max_batch=16,
                                         metrics_port=-1), registry=CollectorRegistry())  # type: ignore[arg-type]
    server.start()
    server.load()
    client = GeneratorReplicas.connect(",".join([f"127.0.0.1:{server.port}", f"localhost:{server.port}"][:replicas]),
                                       key="--generator")
    fetched: dict[str, list[bytes]] = {"without": [], "with": []}
    try:
        for name, stop in (("without", None), ("with", threading.Event())):
            total = client.fetch([5, 7], seed=2, timeout_s=60, stop=stop, piece_images=4,
                                 on_batch=lambda labels, images, first, name=name: fetched[name].append(images.tobytes()))
            assert total == 12
    finally:
        client.close()
        server.stop(0)
    assert b"".join(fetched["with"]) == b"".join(fetched["without"]) and len(b"".join(fetched["with"])) == 12 * 64


def test_a_stop_between_two_batches_raises_stop_not_a_short_stream() -> None:
    server = GeneratorServer(ServeConfig(backend="holdout", dataset="digits", holdout_fraction=0.2, seed=3, max_batch=4,
                                         metrics_port=-1), registry=CollectorRegistry())  # type: ignore[arg-type]
    server.start()
    server.load()
    channel = grpcutil.make_channel(f"127.0.0.1:{server.port}")
    stop, received = threading.Event(), []

    def on_batch(labels, images, first) -> None:
        received.append(len(labels))
        stop.set()  # the next batch may already be here: the fetch must still stop, not report a broken stream

    try:
        with pytest.raises(StopRequested, match=r"of 12 arrived"):
            fetch_images(channel, [12], seed=2, timeout_s=60, stop=stop, on_batch=on_batch)
    finally:
        channel.close()
        server.stop(0)
    assert 0 < sum(received) < 12
