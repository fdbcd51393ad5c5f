"""Opacus glue for the critic: sampling rate, noise multiplier, accountant, and the clipping/noising optimizer."""

from __future__ import annotations

import secrets

import torch
from opacus.accountants import IAccountant, create_accountant
from opacus.accountants.utils import get_noise_multiplier
from opacus.optimizers import DPOptimizer
from torch import nn

from fedsynth.errors import ConfigError
from generator_service.dpgan.config import DEFAULT_NOISE_MULTIPLIER, DPGANConfig


def sample_rate(cfg: DPGANConfig, num_examples: int) -> float:
    """Poisson sampling rate q = expected batch size / N."""
    if cfg.batch_size > num_examples:
        raise ConfigError(
            f"DPGANConfig.batch_size {cfg.batch_size} exceeds the {num_examples} training images "
            "(the Poisson sampling rate batch_size / N must be <= 1)"
        )
    return cfg.batch_size / num_examples


def resolve_noise_multiplier(cfg: DPGANConfig, *, sample_rate: float, delta: float) -> float:
    """sigma as given, or the smallest one (Opacus's binary search) whose epsilon after all critic steps
    does not exceed cfg.target_epsilon."""
    if cfg.target_epsilon is None:
        return cfg.noise_multiplier if cfg.noise_multiplier is not None else DEFAULT_NOISE_MULTIPLIER
    try:
        return float(
            get_noise_multiplier(
                target_epsilon=cfg.target_epsilon,
                target_delta=delta,
                sample_rate=sample_rate,
                steps=cfg.critic_steps,
                accountant=cfg.accountant,
            )
        )
    except ValueError as exc:  # Opacus: "The privacy budget is too low."
        raise ConfigError(
            f"DPGANConfig.target_epsilon {cfg.target_epsilon} is unreachable at delta {delta:.1e}, "
            f"q {sample_rate:.4g}, {cfg.critic_steps} critic steps ({exc})"
        ) from exc


def make_accountant(name: str) -> IAccountant:
    """A fresh Opacus accountant by mechanism name ("rdp" or "prv")."""
    return create_accountant(mechanism=name)


def make_dp_optimizer(
    critic: nn.Module,
    cfg: DPGANConfig,
    *,
    noise_multiplier: float,
    noise_seed: int,
) -> DPOptimizer:
    """Adam on the critic, wrapped by Opacus: clips each p.grad_sample row to cfg.max_grad_norm (jointly over
    all parameters), sums, adds N(0, (sigma C)^2) and divides by the EXPECTED batch size (Poisson batches vary)."""
    device = next(critic.parameters()).device
    noise_generator = torch.Generator(device=device)
    noise_generator.manual_seed(secrets.randbits(63) if cfg.secure_noise else noise_seed)
    return DPOptimizer(
        torch.optim.Adam(critic.parameters(), lr=cfg.lr, betas=cfg.betas),
        noise_multiplier=noise_multiplier,
        max_grad_norm=cfg.max_grad_norm,
        expected_batch_size=cfg.batch_size,
        loss_reduction="mean",
        generator=noise_generator,
        secure_mode=cfg.secure_noise,
    )


def set_grad_samples(critic: nn.Module, grads: dict[str, torch.Tensor]) -> None:
    """Hand per-sample gradients (name -> B x *shape) to DPOptimizer, which reads p.grad_sample."""
    for name, p in critic.named_parameters():
        p.grad_sample = grads[name]


def epsilon_spent(accountant: IAccountant, delta: float) -> float:
    """epsilon at delta for the steps recorded so far (0 before any step; inf when sigma is 0)."""
    if not accountant.history:
        return 0.0
    return float(accountant.get_epsilon(delta=delta))
