"""Every knob of the DP WGAN-GP, as one frozen, validated dataclass."""

from __future__ import annotations

import math
from dataclasses import dataclass

from fedsynth.config_schema import ACCOUNTANTS
from fedsynth.errors import ConfigError

# Used when neither noise_multiplier nor target_epsilon is given.
DEFAULT_NOISE_MULTIPLIER = 1.0
# delta defaults to min(1e-5, N^-1.1): well below 1/N for any client-sized N (SDA-FL clients hold
# hundreds to a few thousand images), and still below 1/N for very large N.
DEFAULT_DELTA_CAP = 1e-5
DEFAULT_DELTA_EXPONENT = 1.1


@dataclass(frozen=True)
class DPGANConfig:
    """A DP WGAN-GP run. The image shape is not a knob: it is read from the training array.

    Privacy: give `noise_multiplier` (sigma) directly, or `target_epsilon` and sigma is the smallest
    one Opacus finds that stays within it at `delta` after every critic step; neither means sigma 1.0.
    `delta=None` means min(1e-5, N^-1.1) for N training images.
    """

    latent_dim: int = 64
    generator_width: int = 64
    critic_width: int = 64
    steps: int = 2000
    n_critic: int = 5
    batch_size: int = 64
    lr: float = 1e-4
    betas: tuple[float, float] = (0.5, 0.9)
    gp_lambda: float = 10.0
    max_grad_norm: float = 1.0
    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    delta: float | None = None
    accountant: str = "rdp"
    seed: int = 0
    device: str = "cpu"
    # True draws the DP noise from an unpredictable seed with Opacus's secure_mode sampling; the run is
    # then not reproducible. False (reproducible by `seed`) is only private while the seed stays secret.
    secure_noise: bool = False

    def __post_init__(self) -> None:
        for name in ("latent_dim", "generator_width", "critic_width", "steps", "n_critic", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"DPGANConfig.{name} must be an integer >= 1, got {value!r}")
        for name in ("lr", "max_grad_norm"):
            _require_positive(name, getattr(self, name))
        _require_finite_at_least_zero("gp_lambda", self.gp_lambda)
        if (
            not isinstance(self.betas, tuple)
            or len(self.betas) != 2
            or not all(_is_real(b) and 0.0 <= b < 1.0 for b in self.betas)
        ):
            raise ConfigError(f"DPGANConfig.betas must be a pair of numbers in [0, 1), got {self.betas!r}")
        if self.noise_multiplier is not None and self.target_epsilon is not None:
            raise ConfigError(
                f"DPGANConfig: give noise_multiplier ({self.noise_multiplier!r}) or target_epsilon "
                f"({self.target_epsilon!r}), not both"
            )
        if self.noise_multiplier is not None:
            _require_finite_at_least_zero("noise_multiplier", self.noise_multiplier)
        if self.target_epsilon is not None:
            _require_positive("target_epsilon", self.target_epsilon)
        if self.delta is not None and not (_is_real(self.delta) and 0.0 < self.delta < 1.0):
            raise ConfigError(f"DPGANConfig.delta must be in (0, 1), got {self.delta!r}")
        if self.accountant not in ACCOUNTANTS:
            raise ConfigError(
                f"DPGANConfig.accountant must be one of {', '.join(ACCOUNTANTS)}, got {self.accountant!r}"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"DPGANConfig.seed must be an integer >= 0, got {self.seed!r}")
        if not isinstance(self.device, str) or self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ConfigError(f"DPGANConfig.device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")

    @property
    def critic_steps(self) -> int:
        """Critic updates in the whole run: each one is a noised step the accountant counts."""
        return self.steps * self.n_critic

    def delta_for(self, num_examples: int) -> float:
        """The delta this run reports for a training set of `num_examples` images."""
        if self.delta is not None:
            return self.delta
        return min(DEFAULT_DELTA_CAP, float(num_examples) ** -DEFAULT_DELTA_EXPONENT)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _require_positive(name: str, value: object) -> None:
    if not (_is_real(value) and value > 0):  # type: ignore[operator]
        raise ConfigError(f"DPGANConfig.{name} must be a finite number > 0, got {value!r}")


def _require_finite_at_least_zero(name: str, value: object) -> None:
    if not (_is_real(value) and value >= 0):  # type: ignore[operator]
        raise ConfigError(f"DPGANConfig.{name} must be a finite number >= 0, got {value!r}")
