"""FedAvg: plain local SGD on cross-entropy; the server takes the N_k-weighted mean of the client models."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fedsynth.algorithms.base import ClientUpdate, StateDict, WeightedMeanServer, snapshot_state
from fedsynth.learning.training import LocalTrainConfig, TrainData, run_local_sgd, train_device


@dataclass(frozen=True)
class FedAvg(WeightedMeanServer):
    """McMahan et al. 2017. No parameters, no server state, nothing sent besides the model."""

    name = "fedavg"

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

        def loss_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(model(x), y)

        steps, train_loss = run_local_sgd(model, data, cfg, generator, loss_fn=loss_fn)
        return ClientUpdate(state=snapshot_state(model), num_steps=steps, train_loss=train_loss)
