"""User-level differential privacy, DP-FedAvg (McMahan et al. 2018), one implementation for the classifier (train.dp)
and the federated generator (federate.dp = "user"): each update's move clipped to S, the clipped moves summed with
equal weights, Gaussian noise of standard deviation sigma*S added to the sum, divided by the clients sampled (m)."""

from __future__ import annotations

import secrets
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedsynth.algorithms.base import Aggregator, StateDict, check_same_layout
from fedsynth.algorithms.privacy import clip_update, epsilon_spent


@dataclass(frozen=True)
class UserLevelDp:
    """A run's DP-FedAvg: the clip S, sigma, K and m (q = m / K), the delta and accountant epsilon is reported at, the
    budget (a target epsilon the run stops at, or None) and what seeds the noise."""

    clip: float
    noise_multiplier: float
    clients: int
    clients_per_round: int
    delta: float
    accountant: str
    budget: float | None = None
    seed: int = 0
    # The coordinator's secret (coordinator/dp_secret.py) in the noise's seed: the clients know the run seed, not it
    noise_secret: bytes = b""
    secure_noise: bool = False  # a fresh CSPRNG seed for every draw: unpredictable even to the operator, not reproducible

    @property
    def sample_rate(self) -> float:
        """q: the share of the clients sampled each round (a fixed number, m of K)."""
        return self.clients_per_round / self.clients

    def epsilon(self, rounds: int) -> float:
        return epsilon_spent(noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate, steps=rounds,
                             delta=self.delta, accountant=self.accountant)

    def affords(self, rounds: int) -> bool:
        """Whether `rounds` completed rounds stay within the budget (a 1e-9 relative slack for Opacus's float search)."""
        return self.budget is None or self.epsilon(rounds) <= self.budget * (1 + 1e-9)

    def report(self, completed_rounds: int) -> dict[str, Any]:
        return {"dp": "user", "epsilon": self.epsilon(completed_rounds), "delta": self.delta, "clip": self.clip,
                "noise_multiplier": self.noise_multiplier, "sample_rate": self.sample_rate, "steps": completed_rounds,
                "accountant": self.accountant, "target_epsilon": self.budget,
                "budget_spent": self.budget is not None and not self.affords(completed_rounds + 1)}

    def noise_generator(self, round_number: int, key: str) -> torch.Generator:
        """Seeded by (run seed, round, key, the coordinator's secret): a resumed run adds the same noise and no client,
        which knows the seed but not the secret, can recompute it; secure_noise draws a fresh secret seed each time."""
        if self.secure_noise:
            return torch.Generator().manual_seed(secrets.randbits(63))
        secret = [int(word) for word in np.frombuffer(self.noise_secret, dtype=np.uint32)]
        entropy = [self.seed, round_number, zlib.crc32(key.encode()), *secret]
        state = np.random.SeedSequence(entropy).generate_state(2, np.uint32)
        return torch.Generator().manual_seed((int(state[0]) << 31) ^ int(state[1]))


def clip_to_move(state: StateDict, reference: StateDict, bound: float) -> StateDict:
    """A client's new state whose move from `reference` is clipped to an L2 norm of `bound` (integer tensors unchanged):
    what an honest client of a user-level DP run sends, so its update arrives as it will count. A move that is not
    finite (local training diverged: under heavy DP noise the global model can make SGD blow up) becomes no move at
    all, which the clip bounds too: the client still takes part instead of being refused round after round."""
    move = {key: value - reference[key] if value.is_floating_point() else value for key, value in state.items()}
    if not all(bool(torch.isfinite(value).all()) for value in move.values() if value.is_floating_point()):
        return {key: reference[key].clone() if value.is_floating_point() else value for key, value in state.items()}
    clipped, _ = clip_update(move, bound)
    return {key: reference[key] + value if value.is_floating_point() else value for key, value in clipped.items()}


class UserDpAggregator(Aggregator):
    """dp None: the base N_k-weighted mean. Else each update's move from the global model is clipped to S (whatever the
    client did), the moves summed with equal weights, and the mean is global + (sum + N(0, (sigma*S)^2)) / m, m fixed: a
    client that drops out does not shrink the denominator. Integer tensors (BatchNorm's num_batches_tracked) keep the
    global model's values: a mean of the clients' counts would publish their step counts outside the guarantee."""

    def __init__(self, global_state: StateDict, server_state: StateDict | None = None, *, dp: UserLevelDp | None,
                 round_number: int) -> None:
        super().__init__(global_state, server_state)
        self.dp = dp
        self.round_number = round_number
        self.norms: list[float] = []  # each update's norm before the server's clipping

    def add(self, state: StateDict, extra: StateDict, weight: float, *, layout_checked: bool = False, deltas: bool = False,
            scale: float = 1.0) -> None:
        if self.dp is None:
            super().add(state, extra, weight, layout_checked=layout_checked, deltas=deltas, scale=scale)
            return
        if not layout_checked:
            check_same_layout(state, self._template, what="client state")
        # scale < 1: runtime.max_update_norm clipped it first; the DP clip to S then bounds it as any other update
        move = {key: ((value if deltas else value - self._global[key]).to(torch.float64) * scale if value.is_floating_point()
                      else self._global[key]) for key, value in state.items()}
        clipped, norm = clip_update(move, self.dp.clip)
        self.norms.append(norm)
        super().add(clipped, extra, 1.0, layout_checked=True, deltas=True)

    def mean64(self, key: str) -> torch.Tensor:
        if self.dp is None or not self._template[key][0].is_floating_point:
            return super().mean64(key)
        noise = torch.randn(self._sums[key].shape, generator=self.dp.noise_generator(self.round_number, key), dtype=torch.float64)
        noisy_sum = self._sums[key] + noise * (self.dp.noise_multiplier * self.dp.clip)
        return self._global[key].to("cpu", torch.float64) + noisy_sum / self.dp.clients_per_round

