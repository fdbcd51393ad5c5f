"""FedProx: local cross-entropy plus the proximal term mu/2 * ||w - w_global||^2; FedAvg aggregation."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fedsynth.algorithms.base import ClientUpdate, StateDict, WeightedMeanServer, check_parameters, snapshot_state
from fedsynth.learning.training import LocalTrainConfig, TrainData, run_local_sgd, train_device


@dataclass(frozen=True)
class FedProx(WeightedMeanServer):
    """Li et al. 2020. `mu` >= 0 weighs the proximal term over the trainable parameters (not buffers).

    The reported train_loss includes the proximal term. With mu = 0 the updates equal FedAvg's exactly.
    """

    mu: float = 0.01
    name = "fedprox"

    def __post_init__(self) -> None:
        check_parameters(self)

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
        train_device(model, cfg)  # the global weights below are copied where the model trains
        params = [p for p in model.parameters() if p.requires_grad]
        global_params = [p.detach().clone() for p in params]

        def loss_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            proximal = sum(((p - g) ** 2).sum() for p, g in zip(params, global_params))
            return F.cross_entropy(model(x), y) + (self.mu / 2) * proximal

        steps, train_loss = run_local_sgd(model, data, cfg, generator, loss_fn=loss_fn)
        return ClientUpdate(state=snapshot_state(model), num_steps=steps, train_loss=train_loss)
