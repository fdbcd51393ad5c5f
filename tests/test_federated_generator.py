"""The federated generator's parts, in process: DP-FedAvg's clipping bounds any update (a 1000x one included), the
server's noise has standard deviation sigma*S/m, epsilon is Opacus's accountant's, the EMA follows the global model,
and a wrong DP setting is one line naming its key, before any process starts."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from opacus.accountants import RDPAccountant
from opacus.accountants.utils import get_noise_multiplier

from fedsynth import cli
from fedsynth.algorithms.base import snapshot_state
from fedsynth.algorithms.ddpm import EMA_PREFIX, FedDdpm
from fedsynth.algorithms.privacy import update_norm
from fedsynth.assembly import algorithm_for, client_shard, local_train_config, model_for, round_generator
from fedsynth.config import RunConfig, load_config
from fedsynth.errors import ConfigError, StopRequested
from fedsynth.learning.training import TrainData, images_to_tensor

BASE = ['train.algorithm="ddpm"', 'train.model="unet-tiny"', 'generation.policy="none"', "data.clients=4",
        "federate.local_steps=2", "federate.batch_size=8"]


def _config(*sets: str) -> RunConfig:
    return load_config(None, [*BASE, *sets])


def _setup(*sets: str) -> tuple[RunConfig, FedDdpm, dict[str, torch.Tensor]]:
    cfg = _config(*sets)
    algorithm = algorithm_for(cfg)
    assert isinstance(algorithm, FedDdpm)
    torch.manual_seed(cfg.seed)
    model = model_for(cfg, num_classes=10, in_channels=1, image_size=8)
    return cfg, algorithm, snapshot_state(model)


def _difference(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: state[key].double() - reference[key].double() for key in reference}


def _client_round(cfg: RunConfig, algorithm: FedDdpm, start: dict[str, torch.Tensor], client: int, model: torch.nn.Module) -> Any:
    """One round of local training of `client` on its shard, from `start`."""
    model.load_state_dict(start)
    shard = client_shard(cfg, client)
    data = TrainData(images_to_tensor(shard.x), torch.as_tensor(shard.y, dtype=torch.int64))
    return algorithm.client_update(model=model, data=data, cfg=local_train_config(cfg), server_extra={}, client_state={},
                                   generator=round_generator(cfg, client, 1))


def test_a_client_clips_its_own_update_to_s_under_user_dp() -> None:
    cfg, algorithm, start = _setup('federate.dp="user"', "federate.clip=0.05", "federate.noise_multiplier=1.0")
    update = _client_round(cfg, algorithm, start, 0, model_for(cfg, num_classes=10, in_channels=1, image_size=8))
    assert update_norm(_difference(update.state, start)) <= 0.05 * (1 + 1e-5)


def test_a_stop_request_ends_local_training_between_steps() -> None:
    cfg, algorithm, start = _setup("federate.local_steps=50")
    model = model_for(cfg, num_classes=10, in_channels=1, image_size=8)
    data = TrainData(torch.rand(20, 1, 8, 8) * 2 - 1, torch.randint(0, 10, (20,)))
    asked: list[int] = []
    stop = replace(local_train_config(cfg), should_stop=lambda: asked.append(1) or len(asked) > 3)
    with pytest.raises(StopRequested, match="after 3 optimizer steps"):
        algorithm.client_update(model=model, data=data, cfg=stop, server_extra={}, client_state={}, generator=torch.Generator())
    assert len(asked) == 4


def test_the_coordinator_bounds_a_1000x_update_that_skipped_its_clipping() -> None:
    clip = 0.5
    _, algorithm, start = _setup('federate.dp="user"', f"federate.clip={clip}", "federate.noise_multiplier=1e-9")
    aggregator = algorithm.new_aggregator(start, algorithm.initial_server_state(start))
    generator = torch.Generator().manual_seed(1)
    honest = {key: value + 1e-4 * torch.randn(value.shape, generator=generator) for key, value in start.items()}
    malicious = {key: value + 1000 * (honest[key] - value) for key, value in start.items()}
    aggregator.add(honest, {}, 100.0)
    aggregator.add(malicious, {}, 100.0)
    new_global, _ = aggregator.finish()
    moved = update_norm(_difference(new_global, start))
    m = algorithm.clients_per_round
    # each update counts with norm <= S and the sum is divided by m: the malicious client moves the model <= S/m
    assert moved <= 2 * clip / m + 1e-4
    malicious_alone = update_norm(_difference(malicious, start))
    assert malicious_alone > 100 * clip  # it really was oversized
    assert max(aggregator.norms) == pytest.approx(malicious_alone, rel=1e-5)


def test_the_servers_noise_has_standard_deviation_sigma_s_over_m() -> None:
    sigma, clip = 2.0, 0.5
    _, algorithm, start = _setup('federate.dp="user"', f"federate.clip={clip}", f"federate.noise_multiplier={sigma}")
    aggregator = algorithm.new_aggregator(start, algorithm.initial_server_state(start))
    for _ in range(algorithm.clients_per_round):
        aggregator.add(start, {}, 1.0)  # zero updates: what moves the model is the noise alone
    new_global, _ = aggregator.finish()
    noise = torch.cat([value.flatten() for value in _difference(new_global, start).values()])
    expected = sigma * clip / algorithm.clients_per_round
    n = noise.numel()
    # the sample standard deviation of n Gaussians has a relative standard error of 1 / sqrt(2n); allow 5 of them
    assert noise.std().item() == pytest.approx(expected, rel=5 / math.sqrt(2 * n))
    assert abs(noise.mean().item()) < 5 * expected / math.sqrt(n)


def test_the_noise_is_the_same_for_the_same_seed_and_round() -> None:
    _, algorithm, start = _setup('federate.dp="user"', "federate.noise_multiplier=1.0")
    results = []
    for _ in range(2):
        aggregator = algorithm.new_aggregator(start, algorithm.initial_server_state(start))
        aggregator.add(start, {}, 1.0)
        results.append(aggregator.finish()[0])
    assert all(torch.equal(results[0][key], results[1][key]) for key in start)


def test_the_noise_changes_with_the_coordinators_secret_which_the_seed_alone_does_not_fix() -> None:
    _, algorithm, start = _setup('federate.dp="user"', "federate.noise_multiplier=1.0")
    results = []
    for secret in (b"", bytes(32), bytes(range(32))):
        keyed = replace(algorithm, noise_secret=secret)
        aggregator = keyed.new_aggregator(start, keyed.initial_server_state(start))
        aggregator.add(start, {}, 1.0)
        results.append(aggregator.finish()[0])
    floating = [key for key in start if start[key].is_floating_point()]
    for a, b in ((0, 1), (0, 2), (1, 2)):
        assert not all(torch.equal(results[a][key], results[b][key]) for key in floating)


@pytest.mark.parametrize("fraction, rounds", [(1.0, 5), (0.5, 20)])
def test_epsilon_is_opacus_rdp_accountants_for_the_same_q_sigma_steps_and_delta(fraction: float, rounds: int) -> None:
    delta = 1e-4
    _, algorithm, _ = _setup('federate.dp="user"', "federate.target_epsilon=8.0", f"federate.delta={delta}",
                             f"train.fraction={fraction}", f"train.rounds={rounds}")
    q = max(1, round(fraction * 4)) / 4
    sigma = get_noise_multiplier(target_epsilon=8.0, target_delta=delta, sample_rate=q, steps=rounds, accountant="rdp")
    accountant = RDPAccountant()
    for _ in range(rounds):
        accountant.step(noise_multiplier=sigma, sample_rate=q)
    report = algorithm.privacy_report(rounds)
    assert report["noise_multiplier"] == sigma and report["sample_rate"] == q
    assert report["epsilon"] == pytest.approx(accountant.get_epsilon(delta), rel=1e-9)
    assert report["epsilon"] <= 8.0


def test_the_server_keeps_an_ema_of_the_global_model_warmed_up_per_round() -> None:
    _, algorithm, start = _setup("federate.ema_decay=0.9")
    server = algorithm.initial_server_state(start)
    aggregator = algorithm.new_aggregator(start, server)
    moved = {key: value + 1.0 for key, value in start.items()}
    aggregator.add(moved, {}, 3.0)
    aggregator.add(moved, {}, 1.0)
    new_global, server = aggregator.finish()
    decay = min(0.9, 2 / 11)  # round 1
    key = next(iter(start))
    assert torch.allclose(new_global[key], moved[key])
    assert torch.allclose(server[EMA_PREFIX + key], decay * start[key] + (1 - decay) * moved[key])
    assert int(server["rounds"]) == 1


def test_a_setting_that_changes_no_result_keeps_old_fingerprints() -> None:
    assert load_config(None, ['federate.dp="user"']).fingerprint() == load_config(None, []).fingerprint()


@pytest.mark.parametrize(
    "flags, key",
    [
        (["--dp", "user", "--target-epsilon", "0"], "federate.target_epsilon"),
        (["--dp", "user", "--target-epsilon", "-1"], "federate.target_epsilon"),
        (["--dp", "user", "--delta", "1"], "federate.delta"),
        (["--dp", "user", "--delta", "1.5"], "federate.delta"),
        (["--dp", "user", "--set", "federate.clip=0"], "federate.clip"),
        (["--dp", "user", "--set", "federate.clip=-1"], "federate.clip"),
        (["--dp", "user", "--target-epsilon", "0.01", "--rounds", "3"], "federate.target_epsilon"),  # below RDP's floor
        (["--dp", "sample", "--target-epsilon", "0.001"], "federate.target_epsilon"),
        (["--init", "/nonexistent/generator"], "federate.init"),
        (["--set", 'train.model="cnn"'], "train.model"),
    ],
)
def test_a_wrong_dp_setting_is_one_line_naming_the_key_before_any_process(
    flags: list[str], key: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "gen"
    assert cli.main(["generator", "federate", "--set", "data.clients=2", *flags, "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fedsynth generator federate: error: ") and key in err[0], err
    assert not out.exists()  # nothing was started, nothing written


def test_from_a_fresh_process_a_wrong_setting_exits_1_without_a_traceback(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "fedsynth.cli", "generator", "federate", "--dp", "user", "--delta", "1",
                             "--out", str(tmp_path / "gen")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0 and "federate.delta" in result.stderr, result.stderr


def test_noise_multiplicity_clips_the_mean_gradient_of_an_images_draws_not_each_draw() -> None:
    """Every parameter's per-image gradient, as the DP-SGD client computes it, against plain autograd (Opacus's hooks
    mode fails this: seven convolution weights get zeros)."""
    from opacus import GradSampleModule

    from fedsynth.algorithms.dp_sgd import GRAD_SAMPLE_MODE, group_draws
    from fedsynth.learning.unet import build_unet, denoising_loss, make_train_scheduler, noised_batch

    draws, images = 3, 2
    unet = build_unet("tiny", num_classes=10, image_shape=(1, 8, 8), seed=0)
    x0 = torch.rand(images, 1, 8, 8).repeat_interleave(draws, 0) * 2 - 1
    noisy, t, labels, noise = noised_batch(make_train_scheduler(), x0, torch.tensor([3, 7]).repeat_interleave(draws, 0),
                                           num_classes=10, label_dropout=0.0, generator=torch.Generator().manual_seed(0))
    wrapped = GradSampleModule(unet, force_functorch=GRAD_SAMPLE_MODE == "functorch")  # as make_private wraps it
    denoising_loss(wrapped, noisy, t, labels, noise).backward()
    group_draws(unet, draws)
    grouped = [p.grad_sample.clone() for p in unet.parameters()]  # type: ignore[attr-defined]
    wrapped._close()  # no hooks in the reference passes
    for image in range(images):  # the gradient of this image's loss averaged over its own draws, by plain autograd
        rows = slice(image * draws, (image + 1) * draws)
        unet.zero_grad()
        reference = torch.autograd.grad(denoising_loss(unet, noisy[rows], t[rows], labels[rows], noise[rows]), list(unet.parameters()))
        for rows_of_parameter, expected in zip(grouped, reference):
            assert rows_of_parameter.shape[0] == images
            assert torch.allclose(rows_of_parameter[image], expected, atol=1e-5, rtol=1e-4)


def test_sample_dp_each_clients_epsilon_is_opacus_for_its_own_q_sigma_and_steps() -> None:
    cfg, algorithm, start = _setup('federate.dp="sample"', "federate.target_epsilon=10", "train.rounds=3",
                                   "federate.noise_multiplicity=2", "federate.max_physical_batch=8")
    model = model_for(cfg, num_classes=10, in_channels=1, image_size=8)
    update = _client_round(cfg, algorithm, start, 1, model)
    assert update.num_steps == 2 and int(update.client_state["dp_steps"]) == 2
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())  # Opacus's hooks are gone after the round
    shard_size = len(client_shard(cfg, 1).y)
    report = algorithm.privacy_report(1, {1: 1}, {1: shard_size})
    q = 1 / math.ceil(shard_size / 8)  # what Opacus's Poisson data loader samples at: 1 / batches per epoch
    sigma = get_noise_multiplier(target_epsilon=10.0, target_delta=1e-5, sample_rate=q, steps=3 * 2, accountant="rdp")
    accountant = RDPAccountant()
    for _ in range(2):
        accountant.step(noise_multiplier=sigma, sample_rate=q)
    client = report["per_client"]["1"]
    assert client["noise_multiplier"] == sigma and client["sample_rate"] == q and client["steps"] == 2
    assert client["epsilon"] == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-9)
    assert report["epsilon"] == client["epsilon"]


def test_init_loads_a_generator_folder_of_the_same_layout_and_names_the_key_otherwise(tmp_path: Path) -> None:
    from fedsynth.errors import ConfigError
    from fedsynth.learning.unet import load_initial_weights
    from generator_service.ddpm.model import GeneratorMetadata, build_unet, make_train_scheduler, save_generator

    for size in ("tiny", "small"):
        save_generator(tmp_path / size, build_unet(size, num_classes=10, image_shape=(1, 8, 8), seed=7), make_train_scheduler(),
                       GeneratorMetadata("digits", 10, (1, 8, 8), size, training_steps=0, guidance=1.0, ddim_steps=2))
    cfg = _config(f'federate.init="{tmp_path / "tiny"}"')
    model = model_for(cfg, num_classes=10, in_channels=1, image_size=8)
    load_initial_weights(model, tmp_path / "tiny")
    saved = build_unet("tiny", num_classes=10, image_shape=(1, 8, 8), seed=7).state_dict()
    assert all(torch.equal(model.state_dict()[key], value) for key, value in saved.items())
    with pytest.raises(ConfigError, match=r"^federate\.init=.*different UNet"):
        load_initial_weights(model, tmp_path / "small")
    with pytest.raises(ConfigError, match=r"^federate\.init=.*not a generator folder"):
        load_initial_weights(model, tmp_path / "absent")


def test_the_coordinator_exports_epsilon_delta_sigma_s_and_q_to_prometheus() -> None:
    from prometheus_client import CollectorRegistry

    from coordinator.metrics import CoordinatorMetrics

    registry = CollectorRegistry()
    metrics = CoordinatorMetrics(registry)
    _, algorithm, _ = _setup('federate.dp="user"', "federate.target_epsilon=5.0", "train.rounds=4", "federate.clip=0.7")
    privacy = algorithm.privacy_report(2)
    metrics.observe_round({"round": 2, "duration_s": 1.0, "phases_s": {}, "participants": [0, 1, 2, 3], "accuracy": math.nan,
                           "loss": 0.5, "privacy": privacy})
    value = registry.get_sample_value
    assert value("fedsynth_coordinator_dp_epsilon") == privacy["epsilon"] > 0
    assert value("fedsynth_coordinator_dp_delta") == 1e-5 and value("fedsynth_coordinator_dp_clip_norm") == 0.7
    assert value("fedsynth_coordinator_dp_noise_multiplier") == privacy["noise_multiplier"]
    assert value("fedsynth_coordinator_dp_sample_rate") == 1.0


def test_user_dp_noise_needs_the_coordinators_secret_that_no_client_is_sent(tmp_path: Path) -> None:
    """The clients get the run config, seed included: noise from the seed alone could be subtracted by any of them.
    With the coordinator's secret (made once in its run folder, mode 0600, read again on resume) it cannot."""
    from coordinator.dp_secret import SECRET_FILE, noise_secret

    secret = noise_secret(tmp_path)
    assert len(secret) == 32 and noise_secret(tmp_path) == secret
    assert (tmp_path / SECRET_FILE).stat().st_mode & 0o777 == 0o600
    assert noise_secret(tmp_path / "other") != secret
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / SECRET_FILE).write_bytes(b"short")
    with pytest.raises(ConfigError, match="must be 32 bytes, found 5"):
        noise_secret(tmp_path / "bad")
