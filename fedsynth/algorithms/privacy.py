"""Differential-privacy accounting by Opacus (sigma for a target epsilon, epsilon spent), and the L2 clipping of a
model update (DP-FedAvg's user-level bound)."""

from __future__ import annotations

import functools
import math
import threading

import torch

from fedsynth.errors import ConfigError

StateDict = dict[str, torch.Tensor]


_SEARCHING = threading.Lock()  # one search at a time: the 50 logical clients of a node ask at once, and the cache
# below does not stop concurrent misses (50 GIL-bound Opacus searches held a K = 100 run's start for 3.5 minutes)


def noise_multiplier_for(*, target_epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str,
                         section: str = "federate") -> float:
    """The smallest sigma (within Opacus's tolerance) whose `steps` sampled Gaussian steps at `sample_rate` spend at
    most target_epsilon at delta; ConfigError naming {section}.target_epsilon when no sigma reaches it."""
    with _SEARCHING:
        return _noise_multiplier_for(target_epsilon=target_epsilon, delta=delta, sample_rate=sample_rate, steps=steps,
                                     accountant=accountant, section=section)


@functools.lru_cache(maxsize=64)
def _noise_multiplier_for(*, target_epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str,
                          section: str) -> float:
    from opacus.accountants.utils import get_noise_multiplier  # Opacus loads only where a run is private

    try:
        return float(get_noise_multiplier(target_epsilon=target_epsilon, target_delta=delta, sample_rate=sample_rate,
                                          steps=steps, accountant=accountant))
    except ValueError as exc:
        raise ConfigError(
            f"{section}.target_epsilon={target_epsilon!r} cannot be reached in {steps} steps at sampling rate {sample_rate:.4g} "
            f"and delta {delta:g} with the {accountant} accountant ({exc}); raise it or the delta"
        ) from None


def epsilon_spent(*, noise_multiplier: float, sample_rate: float, steps: int, delta: float, accountant: str) -> float:
    """Opacus's epsilon after `steps` sampled Gaussian steps (0 before the first)."""
    if steps <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    from opacus.accountants import create_accountant

    counter = create_accountant(mechanism=accountant)
    counter.history = [(noise_multiplier, sample_rate, steps)]
    return float(counter.get_epsilon(delta=delta))


def update_norm(delta: StateDict) -> float:
    """The L2 norm of a whole update (every floating-point tensor of it), in float64."""
    total = torch.zeros((), dtype=torch.float64)
    for value in delta.values():
        if value.is_floating_point():
            total += value.to(torch.float64).pow(2).sum()
    return float(total.sqrt())


def clip_update(delta: StateDict, bound: float) -> tuple[StateDict, float]:
    """(delta scaled to an L2 norm of at most `bound`, its norm before); integer tensors pass unchanged."""
    norm = update_norm(delta)
    factor = min(1.0, bound / norm) if norm > 0 else 1.0
    if factor == 1.0:
        return delta, norm
    return {key: value * factor if value.is_floating_point() else value for key, value in delta.items()}, norm
