"""Generator replicas: a client shards its request across several in-process generator servers (holdout backend,
real gRPC) and gets the bytes one replica gives; a dead replica's share goes to the others; address validation."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from fedsynth.config import generator_addresses, load_config
from fedsynth.errors import ConfigError, WireError
from fedsynth.generation.generator_replicas import GeneratorReplicas
from generator_service.serve_cmd import GeneratorServer, ServeConfig

HOLDOUT = {"backend": "holdout", "dataset": "digits", "holdout_fraction": 0.2, "seed": 3}
COUNTS, OFFSETS, SEED = [40, 0, 3, 0, 0, 0, 0, 0, 0, 75], [0, 0, 5, 0, 0, 0, 0, 0, 0, 10], 11


def _start(**overrides: object) -> GeneratorServer:
    settings: dict[str, object] = {**HOLDOUT, "max_batch": 16, "max_wait_ms": 5.0, "metrics_port": -1, **overrides}
    server = GeneratorServer(ServeConfig(**settings), registry=CollectorRegistry())  # type: ignore[arg-type]
    server.start()
    server.load()
    return server


@pytest.fixture(scope="module")
def servers() -> Iterator[list[GeneratorServer]]:
    started = [_start(), _start()]
    yield started
    for server in started:
        server.stop(0)


def _collect(replicas: GeneratorReplicas, **kwargs: object) -> tuple[np.ndarray, bytes, list[int]]:
    labels, images, firsts = [], [], []

    def on_batch(batch_labels: np.ndarray, batch_images: np.ndarray, first: int) -> None:
        labels.append(batch_labels)
        images.append(batch_images.copy())
        firsts.append(first)

    settings: dict[str, object] = {"seed": SEED, "offsets": OFFSETS, "timeout_s": 60.0, **kwargs}
    total = replicas.fetch(COUNTS, on_batch=on_batch, **settings)  # type: ignore[arg-type]
    assert total == sum(COUNTS)
    return np.concatenate(labels), np.concatenate(images).tobytes(), firsts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_replicas_give_one_replicas_bytes_in_stream_order(servers: list[GeneratorServer]) -> None:
    one = GeneratorReplicas.connect(f"127.0.0.1:{servers[0].port}")
    two = GeneratorReplicas.connect(f"127.0.0.1:{servers[0].port},127.0.0.1:{servers[1].port}")
    try:
        info = two.info(timeout_s=10)
        labels, alone, _ = _collect(one)
        before = [s.metrics.registry.get_sample_value("fedsynth_generator_request_images_count") or 0 for s in servers]
        sharded_labels, sharded, firsts = _collect(two, piece_images=7, model_id=info.model_id)
        after = [s.metrics.registry.get_sample_value("fedsynth_generator_request_images_count") or 0 for s in servers]
    finally:
        one.close()
        two.close()
    assert sharded == alone and sharded_labels.tolist() == labels.tolist()
    assert labels.tolist() == [0] * 40 + [2] * 3 + [9] * 75
    assert firsts == sorted(firsts) and firsts[0] == 0  # delivered in stream order, positions counted across pieces
    assert all(a > b for a, b in zip(after, before))  # both replicas served pieces


def test_a_clients_cache_from_two_replicas_equals_one_replicas(servers: list[GeneratorServer], tmp_path: Path) -> None:
    from client_node.metrics import ClientMetrics
    from client_node.synthesis import synthesize

    cfg = load_config(None, ["generation.policy=full"])  # fill every class up to the largest: many images per class
    real_y = np.repeat(np.arange(10), [60, 1, 5, 0, 0, 0, 0, 0, 0, 30])
    made = {}
    for name, target in (("one", f"127.0.0.1:{servers[0].port}"),
                         ("two", f"127.0.0.1:{servers[0].port},127.0.0.1:{servers[1].port}")):
        options = SimpleNamespace(generator=target, credentials=None, cache_dir=tmp_path / name, revoked=None, tls_files=None)
        made[name] = synthesize(cfg, 2, real_y, 10, [], options, ClientMetrics(CollectorRegistry()))
    assert made["one"].count == 59 + 55 + 60 * 6 + 30 and not made["two"].cache_hit
    assert made["two"].x.tobytes() == made["one"].x.tobytes() and made["two"].y.tolist() == made["one"].y.tolist()


def test_a_dead_replica_leaves_its_share_to_the_live_one(servers: list[GeneratorServer]) -> None:
    dead = f"127.0.0.1:{_free_port()}"
    replicas = GeneratorReplicas.connect(f"{dead},127.0.0.1:{servers[1].port}")
    single = GeneratorReplicas.connect(f"127.0.0.1:{servers[1].port}")
    try:
        assert replicas.info(timeout_s=10).backend == "holdout"  # Info skips the dead one too
        _, sharded, _ = _collect(replicas, piece_images=16)
        _, alone, _ = _collect(single)
    finally:
        replicas.close()
        single.close()
    assert sharded == alone


def test_no_live_replica_is_an_error_naming_every_address() -> None:
    dead = [f"127.0.0.1:{_free_port()}", f"127.0.0.1:{_free_port()}"]
    replicas = GeneratorReplicas.connect(",".join(dead))
    try:
        with pytest.raises(WireError) as caught:
            _collect(replicas, timeout_s=2.0)
    finally:
        replicas.close()
    assert all(f"{address}: UNAVAILABLE" in str(caught.value) for address in dead)
    assert "delivered 0 of 118 images within 2s" in str(caught.value)


def test_a_replica_serving_another_model_fails_the_fetch_naming_it(servers: list[GeneratorServer]) -> None:
    other = _start(seed=4)  # another hold-out split: another model id
    replicas = GeneratorReplicas.connect(f"127.0.0.1:{servers[0].port},127.0.0.1:{other.port}")
    try:
        model_id = replicas.info(timeout_s=10).model_id
        with pytest.raises(WireError) as caught:
            _collect(replicas, piece_images=5, model_id=model_id)
    finally:
        replicas.close()
        other.stop(0)
    assert f"generator replica 127.0.0.1:{other.port}: FAILED_PRECONDITION" in str(caught.value)


def test_a_dns_name_spreads_over_its_addresses_with_round_robin(servers: list[GeneratorServer]) -> None:
    single = GeneratorReplicas.connect(f"127.0.0.1:{servers[0].port}")
    dns = GeneratorReplicas.connect(f"dns:///localhost:{servers[0].port}")
    try:
        assert dns.addresses == [f"dns:///localhost:{servers[0].port}"] and len(dns.workers) >= 1
        _, alone, _ = _collect(single)
        _, resolved, _ = _collect(dns, piece_images=9)
    finally:
        single.close()
        dns.close()
    assert resolved == alone


@pytest.mark.parametrize("value", ["a:1,b:2", "a:1, b:2", "dns:///gen.fedsynth.svc:50052", "[::1]:5"])
def test_generator_addresses_accepted(value: str) -> None:
    assert len(generator_addresses(value)) == value.count(",") + 1
    assert load_config(None, [f"generation.generator={value}"]).generation.generator == value


@pytest.mark.parametrize(("value", "words"), [
    ("a:1,a:1", "names a generator twice"),
    ("a:1,", "must be HOST:PORT, HOST:PORT,HOST:PORT,... or dns:///NAME:PORT"),
    ("dns:///a:1,b:2", "a dns:/// target stands alone"),
    ("a:0", "must be HOST:PORT"),
])
def test_generator_addresses_refused(value: str, words: str) -> None:
    with pytest.raises(ConfigError, match="generation.generator") as caught:
        load_config(None, [f"generation.generator={value}"])
    assert words in str(caught.value)


def test_a_generator_of_another_image_shape_is_refused_by_the_client_before_it_asks(servers: list[GeneratorServer],
                                                                                   tmp_path: Path) -> None:
    from client_node.metrics import ClientMetrics
    from client_node.synthesis import synthesize

    cfg = load_config(None, ["generation.policy=full"])
    options = SimpleNamespace(generator=f"127.0.0.1:{servers[0].port}", credentials=None, cache_dir=tmp_path, revoked=None,
                              tls_files=None)
    registry = CollectorRegistry()
    metrics = ClientMetrics(registry)
    with pytest.raises(ConfigError, match=r"makes 1x8x8 images; this client's are 1x16x16 \(data.channels x data.image_size\)"):
        synthesize(cfg, 2, np.repeat(np.arange(10), [9, 1, 1, 1, 1, 1, 1, 1, 1, 1]), 10, [], options, metrics,
                   real_shape=(1, 16, 16))
    assert registry.get_sample_value("fedsynth_client_images_requested_total") == 0.0
    assert not any(tmp_path.iterdir())  # no cache written
