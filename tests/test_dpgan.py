"""DP WGAN-GP: per-sample gradients with the penalty, Opacus clipping and noise, accounting, and seeded training."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from opacus.accountants import create_accountant

from client_node.sdafl_client import dpgan_fields
from fedsynth.config import load_config
from fedsynth.learning.data import load_dataset
from fedsynth.errors import ConfigError, DataError
from generator_service.dpgan import DPGANConfig, sample_images, train_dp_wgan
from generator_service.dpgan.networks import Critic, Generator, images_to_tensor, tensor_to_images
from generator_service.dpgan.per_sample import per_sample_critic_grads
from generator_service.dpgan.privacy import make_dp_optimizer, resolve_noise_multiplier, set_grad_samples
from generator_service.dpgan.train import dp_critic_step

SHAPE = (1, 8, 8)
TINY = dict(latent_dim=8, generator_width=4, critic_width=4)


@pytest.fixture(scope="module")
def digits() -> np.ndarray:
    return load_dataset("digits").x[:300]


def _batch(digits: np.ndarray, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    real = images_to_tensor(digits[:n])
    fake = torch.rand(n, *SHAPE, generator=g) * 2 - 1
    alpha = torch.rand(n, generator=g)
    return real, fake, alpha


def _critic(seed: int = 0, width: int = 4) -> Critic:
    torch.manual_seed(seed)
    return Critic(SHAPE, width=width)


def _flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(len(g), -1) for g in grads.values()], dim=1)


def test_vmap_per_sample_grads_with_penalty_match_an_explicit_loop(digits: np.ndarray) -> None:
    critic = _critic()
    real, fake, alpha = _batch(digits, 6)
    gp_lambda = 10.0
    grads, losses = per_sample_critic_grads(critic, real, fake, alpha, gp_lambda)

    params = list(critic.parameters())
    for i in range(len(real)):
        x_hat = (alpha[i] * real[i : i + 1] + (1 - alpha[i]) * fake[i : i + 1]).requires_grad_(True)
        (input_grad,) = torch.autograd.grad(critic(x_hat).sum(), x_hat, create_graph=True)
        penalty = (input_grad.flatten().norm(2) - 1) ** 2
        loss = critic(fake[i : i + 1]).sum() - critic(real[i : i + 1]).sum() + gp_lambda * penalty
        expected = torch.autograd.grad(loss, params)
        assert float(losses[i]) == pytest.approx(float(loss.detach()), abs=1e-5)
        for (name, _), want in zip(critic.named_parameters(), expected):
            torch.testing.assert_close(grads[name][i], want, atol=1e-5, rtol=1e-4, msg=f"{name}, sample {i}")
    # the penalty really contributes: without it the gradients differ
    no_penalty, _ = per_sample_critic_grads(critic, real, fake, alpha, 0.0)
    assert not torch.allclose(_flat(no_penalty), _flat(grads), atol=1e-4)


def test_opacus_clips_every_per_sample_gradient_to_max_grad_norm(digits: np.ndarray) -> None:
    clip = 0.05
    cfg = DPGANConfig(noise_multiplier=0.0, max_grad_norm=clip, batch_size=8, **TINY)
    critic = _critic()
    real, fake, alpha = _batch(digits, 8, seed=1)
    grads, _ = per_sample_critic_grads(critic, real, fake, alpha, cfg.gp_lambda)
    raw_norms = _flat(grads).norm(dim=1)
    assert (raw_norms > clip).sum() >= 4, "the test needs gradients above the clipping bound"

    singles = []
    for i in range(len(real)):  # one-sample batches: Opacus's clipped sum IS that sample's clipped gradient
        opt = make_dp_optimizer(critic, cfg, noise_multiplier=0.0, noise_seed=0)
        set_grad_samples(critic, {k: v[i : i + 1] for k, v in grads.items()})
        opt.pre_step()
        clipped = torch.cat([p.summed_grad.flatten() for p in critic.parameters()])
        assert float(clipped.norm()) <= clip * (1 + 1e-5)
        if raw_norms[i] > clip:
            assert float(clipped.norm()) == pytest.approx(clip, rel=1e-4)
        else:
            torch.testing.assert_close(clipped, _flat(grads)[i])
        singles.append(clipped)
        opt.zero_grad(set_to_none=True)

    opt = make_dp_optimizer(critic, cfg, noise_multiplier=0.0, noise_seed=0)
    set_grad_samples(critic, grads)
    opt.pre_step()
    summed = torch.cat([p.summed_grad.flatten() for p in critic.parameters()])
    averaged = torch.cat([p.grad.flatten() for p in critic.parameters()])
    torch.testing.assert_close(summed, torch.stack(singles).sum(0), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(averaged, summed / cfg.batch_size)


def test_noise_std_is_sigma_times_clip_over_expected_batch(digits: np.ndarray) -> None:
    sigma, clip, expected_batch = 1.3, 0.7, 16
    cfg = DPGANConfig(noise_multiplier=sigma, max_grad_norm=clip, batch_size=expected_batch, **TINY)
    critic = _critic(width=8)
    opt = make_dp_optimizer(critic, cfg, noise_multiplier=sigma, noise_seed=5)
    empty = torch.zeros(0, *SHAPE)
    draws = []
    for _ in range(4):  # an empty Poisson batch: p.grad is pure noise
        set_grad_samples(critic, per_sample_critic_grads(critic, empty, empty, torch.zeros(0), 10.0)[0])
        opt.pre_step()
        draws.append(torch.cat([p.grad.flatten() for p in critic.parameters()]))
        opt.zero_grad(set_to_none=True)
    noise = torch.cat(draws).double()
    n = len(noise)
    assert n > 5000
    expected_std = sigma * clip / expected_batch
    # sum(noise^2)/std^2 ~ chi-square(n): mean n, sd sqrt(2n); 6 sd is a false-alarm rate below 1e-8
    chi2 = float((noise**2).sum()) / expected_std**2
    assert abs(chi2 - n) < 6 * math.sqrt(2 * n)
    assert abs(float(noise.mean())) < 6 * expected_std / math.sqrt(n)


def test_empty_poisson_batch_still_takes_a_noised_step(digits: np.ndarray) -> None:
    cfg = DPGANConfig(noise_multiplier=1.0, batch_size=4, **TINY)
    critic, generator = _critic(), Generator(SHAPE, latent_dim=8, width=4)
    opt = make_dp_optimizer(critic, cfg, noise_multiplier=1.0, noise_seed=0)
    before = [p.detach().clone() for p in critic.parameters()]
    dp_critic_step(critic, generator, opt, torch.zeros(0, *SHAPE), torch.Generator().manual_seed(0), 10.0)
    assert all(not torch.equal(b, p) for b, p in zip(before, critic.parameters()))


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_reported_epsilon_is_the_accountants_value_for_the_recorded_steps(digits: np.ndarray, accountant: str) -> None:
    cfg = DPGANConfig(steps=3, n_critic=2, batch_size=30, noise_multiplier=0.9, accountant=accountant, **TINY)
    result = train_dp_wgan(digits, cfg)
    assert result.critic_steps == 6
    assert result.sample_rate == pytest.approx(30 / 300)
    assert result.delta == 1e-5  # min(1e-5, 300^-1.1 = 1.9e-3)
    fresh = create_accountant(accountant)
    for _ in range(result.critic_steps):
        fresh.step(noise_multiplier=0.9, sample_rate=result.sample_rate)
    assert result.epsilon == pytest.approx(fresh.get_epsilon(delta=result.delta), rel=1e-9)
    assert 0 < result.epsilon < math.inf
    assert "delta 1.0e-05" in result.privacy_statement()


@pytest.mark.parametrize(("accountant", "target"), [("rdp", 0.5), ("rdp", 2.0), ("rdp", 8.0), ("prv", 2.0)])
def test_target_epsilon_is_never_overshot(accountant: str, target: float) -> None:
    cfg = DPGANConfig(steps=40, n_critic=5, batch_size=32, target_epsilon=target, accountant=accountant)
    q, delta = 32 / 1000, cfg.delta_for(1000)
    sigma = resolve_noise_multiplier(cfg, sample_rate=q, delta=delta)
    fresh = create_accountant(accountant)
    for _ in range(cfg.critic_steps):
        fresh.step(noise_multiplier=sigma, sample_rate=q)
    reached = fresh.get_epsilon(delta=delta)
    assert reached <= target
    assert reached > 0.9 * target  # and sigma is not needlessly large


def test_target_epsilon_drives_training_and_an_unreachable_target_is_a_config_error(digits: np.ndarray) -> None:
    result = train_dp_wgan(digits, DPGANConfig(steps=2, n_critic=2, batch_size=30, target_epsilon=1.0, **TINY))
    assert result.epsilon <= 1.0
    with pytest.raises(ConfigError, match="1e-12"):
        train_dp_wgan(digits, DPGANConfig(steps=2, batch_size=300, target_epsilon=1e-12, **TINY))


def test_training_is_deterministic_by_seed_and_samples_uint8_images(digits: np.ndarray) -> None:
    cfg = DPGANConfig(steps=4, n_critic=2, batch_size=32, noise_multiplier=1.0, seed=3, **TINY)
    first, second = train_dp_wgan(digits, cfg), train_dp_wgan(digits, cfg)
    other = train_dp_wgan(digits, DPGANConfig(steps=4, n_critic=2, batch_size=32, noise_multiplier=1.0, seed=4, **TINY))
    images = sample_images(first.generator, 20, seed=7)
    assert images.shape == (20, 8, 8, 1) and images.dtype == np.uint8
    np.testing.assert_array_equal(images, sample_images(second.generator, 20, seed=7))
    assert not np.array_equal(images, sample_images(other.generator, 20, seed=7))
    assert not np.array_equal(images, sample_images(first.generator, 20, seed=8))
    assert first.epsilon == second.epsilon and not first.generator.training
    assert sample_images(first.generator, 0, seed=0).shape == (0, 8, 8, 1)


def test_rgb_32x32_round_trip_and_shapes() -> None:
    x = np.random.default_rng(0).integers(0, 256, size=(12, 32, 32, 3), dtype=np.uint8)
    np.testing.assert_array_equal(tensor_to_images(images_to_tensor(x)), x)
    result = train_dp_wgan(x, DPGANConfig(steps=1, n_critic=1, batch_size=4, noise_multiplier=1.0, **TINY))
    assert sample_images(result.generator, 3, seed=0).shape == (3, 32, 32, 3)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"steps": 0}, "steps"),
        ({"batch_size": -1}, "-1"),
        ({"lr": 0.0}, "lr"),
        ({"betas": (0.5, 1.0)}, "(0.5, 1.0)"),
        ({"gp_lambda": float("nan")}, "nan"),
        ({"noise_multiplier": -0.5}, "-0.5"),
        ({"noise_multiplier": 1.0, "target_epsilon": 3.0}, "not both"),
        ({"target_epsilon": 0.0}, "target_epsilon"),
        ({"delta": 1.5}, "1.5"),
        ({"accountant": "gdp"}, "'gdp'"),
        ({"device": "tpu"}, "'tpu'"),
    ],
)
def test_bad_config_values_raise_config_error_naming_them(kwargs: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=__import__("re").escape(named)):
        DPGANConfig(**kwargs)


def test_bad_training_inputs_are_named(digits: np.ndarray) -> None:
    with pytest.raises(ConfigError, match="batch_size 400"):
        train_dp_wgan(digits, DPGANConfig(batch_size=400, **TINY))
    with pytest.raises(DataError, match=r"\(1, 10, 10\)"):
        train_dp_wgan(np.zeros((5, 10, 10, 1), np.uint8), DPGANConfig(batch_size=2, **TINY))
    with pytest.raises(DataError, match="float32"):
        train_dp_wgan(np.zeros((5, 8, 8, 1), np.float32), DPGANConfig(batch_size=2, **TINY))


def test_a_client_smaller_than_the_gan_batch_trains_at_q_1_within_its_target(digits: np.ndarray) -> None:
    """SDA-FL on a Dirichlet split: a client can hold fewer images than sdafl.gan_batch_size (22 < 32 on reduced
    CIFAR-10, seed 1); its DP-GAN samples all of them each step instead of failing the run's registration."""
    cfg = load_config(None, ["train.algorithm=sdafl"])
    assert dpgan_fields(cfg, 1, 22)["batch_size"] == 22 and dpgan_fields(cfg, 1, 500)["batch_size"] == cfg.sdafl.gan_batch_size
    fields = {k: v for k, v in dpgan_fields(cfg, 1, 22).items() if k in ("batch_size", "target_epsilon", "seed")}
    result = train_dp_wgan(digits[:22], DPGANConfig(steps=2, n_critic=2, **fields, **TINY))
    assert result.sample_rate == 1.0 and 0 < result.epsilon <= cfg.sdafl.target_epsilon
