"""FedMix and NaiveMix (Yoon, Shin, Hwang, Yang, ICLR 2021): local training against the clients' pooled mean data.

Every client averages its local images in random groups of `mean_batch` (M) images, and their one-hot labels the
same way, once, and uploads the means (client_node.fedmix_client); the coordinator pools them and sends the pool
with the task (server_extra "mean_x": float N x C x H x W on the model's input scale, "mean_y": float N x classes,
rows summing to 1). Each local sample x_i, y_i is paired with a mean sample x̄_j, ȳ_j drawn at random from the pool:

- NaiveMix, plain mixup with the mean data:
  ℓ = (1-λ) CE(f((1-λ)x_i + λx̄_j), y_i) + λ CE(f((1-λ)x_i + λx̄_j), ȳ_j)
- FedMix, the paper's first-order Taylor expansion of that mixup loss around (1-λ)x_i (so a client never needs
  another client's raw image, only the means):
  ℓ = (1-λ) CE(f((1-λ)x_i), y_i) + λ CE(f((1-λ)x_i), ȳ_j) + λ <∂CE(f(z), y_i)/∂z |_{z=(1-λ)x_i}, x̄_j>
  The input gradient is taken with create_graph, so the last term trains the weights through second derivatives.

Aggregation is FedAvg. With an empty pool (every client holds fewer than M images), or none given (a unit test calling
client_update directly), both reduce to cross-entropy.
Defaults: M = 5 (the paper's CIFAR setting); λ = 0.05 for FedMix and 0.1 for NaiveMix (the paper tunes λ per
method; small λ keeps the Taylor expansion accurate).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fedsynth.algorithms.base import ClientUpdate, StateDict, WeightedMeanServer, check_parameters, snapshot_state
from fedsynth.errors import WireError
from fedsynth.learning.training import LocalTrainConfig, TrainData, run_local_sgd, train_device


def soft_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean over the batch of -sum_c targets_c log softmax(logits)_c (targets: rows of a probability simplex)."""
    return -(targets * F.log_softmax(logits, dim=1)).sum(dim=1).mean()


def naivemix_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mean_x: torch.Tensor, mean_y: torch.Tensor,
                  lam: float) -> torch.Tensor:
    """Mixup of each local sample with its paired mean sample (mean_x, mean_y already paired row by row)."""
    logits = model((1 - lam) * x + lam * mean_x)
    return (1 - lam) * F.cross_entropy(logits, y) + lam * soft_cross_entropy(logits, mean_y)


def fedmix_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mean_x: torch.Tensor, mean_y: torch.Tensor,
                lam: float) -> torch.Tensor:
    """FedMix's approximate mixup loss (module docstring), averaged over the batch."""
    scaled = ((1 - lam) * x).detach().requires_grad_(True)
    logits = model(scaled)
    local = F.cross_entropy(logits, y)
    # d(mean_i CE_i)/dz_i is (1/B) dCE_i/dz_i, so summing grad * x̄ over the batch gives mean_i <dCE_i/dz_i, x̄_i>.
    (input_grad,) = torch.autograd.grad(local, scaled, create_graph=True)
    return (1 - lam) * local + lam * soft_cross_entropy(logits, mean_y) + lam * (input_grad * mean_x).sum()


@dataclass(frozen=True)
class _MeanDataMix(WeightedMeanServer):
    mean_batch: int = 5
    lam: float = 0.05

    name = ""

    def __post_init__(self) -> None:
        check_parameters(self)

    @staticmethod
    def mix_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mean_x: torch.Tensor, mean_y: torch.Tensor,
                 lam: float) -> torch.Tensor:
        raise NotImplementedError

    def client_update(
        self,
        *,
        model: nn.Module,
        data: TrainData,
        cfg: LocalTrainConfig,
        server_extra: StateDict,
        client_state: StateDict,
        generator: torch.Generator,
    ) -> ClientUpdate:
        train_device(model, cfg)
        mean_x = server_extra.get("mean_x", torch.zeros(0, *data.x.shape[1:]))
        mean_y = server_extra.get("mean_y", torch.zeros(0, 0))
        if mean_x.ndim != 4 or mean_y.ndim != 2 or len(mean_x) != len(mean_y) or mean_x.shape[1:] != data.x.shape[1:]:
            raise WireError(f"{self.name}: mean data of shapes {tuple(mean_x.shape)} and {tuple(mean_y.shape)} does not "
                            f"fit local images of shape {tuple(data.x.shape[1:])}")
        mix = type(self).mix_loss

        def loss_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            if len(mean_y) == 0:
                return F.cross_entropy(model(x), y)
            pick = torch.randint(len(mean_y), (len(y),), generator=generator)
            return mix(model, x, y, mean_x[pick].to(x.device), mean_y[pick].to(x.device), self.lam)

        steps, train_loss = run_local_sgd(model, data, cfg, generator, loss_fn=loss_fn)
        return ClientUpdate(state=snapshot_state(model), num_steps=steps, train_loss=train_loss)


@dataclass(frozen=True)
class FedMix(_MeanDataMix):
    """FedMix: `mean_batch` M images per mean (an integer >= 2), `lam` λ in [0, 1] (default 0.05)."""

    mean_batch: int = 5
    lam: float = 0.05

    name = "fedmix"
    mix_loss = staticmethod(fedmix_loss)


@dataclass(frozen=True)
class NaiveMix(_MeanDataMix):
    """NaiveMix: `mean_batch` M images per mean (an integer >= 2), `lam` λ in [0, 1] (default 0.1)."""

    mean_batch: int = 5
    lam: float = 0.1

    name = "naivemix"
    mix_loss = staticmethod(naivemix_loss)
