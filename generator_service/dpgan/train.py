"""The DP WGAN-GP training loop (noise on the critic only) and seeded sampling from the trained generator."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from opacus.accountants import IAccountant
from opacus.optimizers import DPOptimizer
from torch import nn

from fedsynth.errors import ConfigError, DataError
from generator_service.dpgan.config import DPGANConfig
from generator_service.dpgan.networks import Critic, Generator, check_image_shape, images_to_tensor, tensor_to_images
from generator_service.dpgan.per_sample import per_sample_critic_grads
from generator_service.dpgan.privacy import (
    epsilon_spent,
    make_accountant,
    make_dp_optimizer,
    resolve_noise_multiplier,
    sample_rate,
    set_grad_samples,
)

SAMPLE_CHUNK = 512


@dataclass(frozen=True)
class TrainProgress:
    """Reported after each generator step. Only DP-safe values: the generator loss depends on private data
    through the (noised) critic alone; the critic's loss on real images would not be covered by the guarantee."""

    step: int
    steps: int
    generator_loss: float


@dataclass(frozen=True)
class DPGANResult:
    """A trained generator (eval mode, on cfg.device) and the (epsilon, delta) guarantee of the run."""

    generator: nn.Module
    epsilon: float
    delta: float
    noise_multiplier: float
    sample_rate: float
    critic_steps: int
    accountant: str
    train_seconds: float

    def privacy_statement(self) -> str:
        """One line for logs and reports, e.g. "(epsilon 7.12, delta 1.0e-05)-DP: sigma 1.0, q 0.107, 1000 critic steps, rdp"."""
        return (
            f"(epsilon {self.epsilon:.2f}, delta {self.delta:.1e})-DP: sigma {self.noise_multiplier:.4g}, "
            f"q {self.sample_rate:.4g}, {self.critic_steps} critic steps, {self.accountant}"
        )


def dp_critic_step(
    critic: Critic,
    generator: Generator,
    dp_optimizer: DPOptimizer,
    real: torch.Tensor,
    rng: torch.Generator,
    gp_lambda: float,
) -> None:
    """One private critic update on a Poisson batch `real` (possibly empty): each real image is paired with
    its own fresh fake and interpolate, per-sample gradients are clipped and noised by Opacus."""
    b = len(real)
    z = torch.randn(b, generator.latent_dim, generator=rng).to(real.device)
    alpha = torch.rand(b, generator=rng).to(real.device)
    with torch.no_grad():
        fake = generator(z)
    grads, _ = per_sample_critic_grads(critic, real, fake, alpha, gp_lambda)
    set_grad_samples(critic, grads)
    dp_optimizer.step()
    dp_optimizer.zero_grad(set_to_none=True)


def generator_step(
    critic: Critic, generator: Generator, optimizer: torch.optim.Optimizer, batch_size: int, rng: torch.Generator
) -> float:
    """One generator update against the current critic; returns -mean D(G(z))."""
    device = next(generator.parameters()).device
    z = torch.randn(batch_size, generator.latent_dim, generator=rng).to(device)
    critic.requires_grad_(False)
    loss = -critic(generator(z)).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    critic.requires_grad_(True)
    return float(loss.detach())


def train_dp_wgan(
    x_uint8: np.ndarray,
    cfg: DPGANConfig,
    *,
    progress: Callable[[TrainProgress], None] | None = None,
) -> DPGANResult:
    """Train an unconditional WGAN-GP on uint8 N x H x W x C images with (epsilon, delta)-DP on the critic.

    Real batches are Poisson samples at q = batch_size / N; every critic step is recorded by the
    accountant at (sigma, q). The generator only ever sees the critic, so it inherits the guarantee.
    """
    started = time.perf_counter()
    data = images_to_tensor(x_uint8)
    num_examples = len(data)
    if num_examples == 0:
        raise DataError("DP-GAN training got 0 images")
    image_shape = tuple(data.shape[1:])
    check_image_shape(image_shape)  # type: ignore[arg-type]
    device = _device(cfg.device)
    data = data.to(device)

    q = sample_rate(cfg, num_examples)
    delta = cfg.delta_for(num_examples)
    sigma = resolve_noise_multiplier(cfg, sample_rate=q, delta=delta)

    with torch.random.fork_rng(devices=[]):  # seeded weights without touching the caller's global RNG
        torch.manual_seed(cfg.seed)
        generator = Generator(image_shape, latent_dim=cfg.latent_dim, width=cfg.generator_width)  # type: ignore[arg-type]
        critic = Critic(image_shape, width=cfg.critic_width)  # type: ignore[arg-type]
    generator.to(device).train()
    critic.to(device).train()
    rng = torch.Generator().manual_seed(cfg.seed + 1)
    dp_optimizer = make_dp_optimizer(critic, cfg, noise_multiplier=sigma, noise_seed=cfg.seed + 2)
    generator_optimizer = torch.optim.Adam(generator.parameters(), lr=cfg.lr, betas=cfg.betas)
    accountant: IAccountant = make_accountant(cfg.accountant)

    for step in range(1, cfg.steps + 1):
        for _ in range(cfg.n_critic):
            chosen = torch.nonzero(torch.rand(num_examples, generator=rng) < q).squeeze(1)
            dp_critic_step(critic, generator, dp_optimizer, data[chosen.to(device)], rng, cfg.gp_lambda)
            accountant.step(noise_multiplier=sigma, sample_rate=q)
        generator_loss = generator_step(critic, generator, generator_optimizer, cfg.batch_size, rng)
        if progress is not None:
            progress(TrainProgress(step=step, steps=cfg.steps, generator_loss=generator_loss))

    generator.eval()
    return DPGANResult(
        generator=generator,
        epsilon=epsilon_spent(accountant, delta),
        delta=delta,
        noise_multiplier=sigma,
        sample_rate=q,
        critic_steps=cfg.critic_steps,
        accountant=cfg.accountant,
        train_seconds=time.perf_counter() - started,
    )


def sample_images(generator: nn.Module, count: int, *, seed: int) -> np.ndarray:
    """`count` images as uint8 N x H x W x C; the same generator and seed give the same images."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ConfigError(f"sample count must be an integer >= 0, got {count!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"sample seed must be an integer >= 0, got {seed!r}")
    latent_dim = int(generator.latent_dim)  # type: ignore[arg-type]
    device = next(generator.parameters()).device
    z = torch.randn(count, latent_dim, generator=torch.Generator().manual_seed(seed))
    was_training = generator.training
    generator.eval()
    with torch.no_grad():
        chunks = [generator(z[i : i + SAMPLE_CHUNK].to(device)) for i in range(0, count, SAMPLE_CHUNK)]
    generator.train(was_training)
    if not chunks:
        c, h, w = generator.image_shape  # type: ignore[misc]
        return np.zeros((0, h, w, c), dtype=np.uint8)
    return tensor_to_images(torch.cat(chunks))


def _device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"DPGANConfig.device is {name!r} but CUDA is not available")
    return device
