"""SDA-FL's client update: mixup of a real and a pseudo-labelled synthetic batch, plus lambda2 x CE on the real batch.

The shared synthetic set and its labels arrive with the task (server_extra "synthetic_x" float NCHW,
"synthetic_y" int64, labelled samples only); aggregation is FedAvg. Before any sample has a label
(round 1) the update is plain cross-entropy on the real data.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedsynth.algorithms.base import ClientUpdate, StateDict, WeightedMeanServer, check_parameters, snapshot_state
from fedsynth.errors import WireError
from fedsynth.learning.training import LocalTrainConfig, TrainData, run_local_sgd, train_device


@dataclass(frozen=True)
class Sdafl(WeightedMeanServer):
    lambda2: float = 1.0
    mixup_alpha: float = 1.0

    name = "sdafl"

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
        train_device(model, cfg)
        synthetic_x = server_extra.get("synthetic_x")
        synthetic_y = server_extra.get("synthetic_y")
        if (synthetic_x is None) != (synthetic_y is None) or (synthetic_x is not None and len(synthetic_x) != len(synthetic_y)):
            raise WireError("sdafl: synthetic_x and synthetic_y must come together with one label per image")
        labelled = synthetic_x is not None and len(synthetic_y) > 0
        mix_rng = np.random.default_rng(int(torch.randint(0, 2**62, (1,), generator=generator)))

        def loss_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            real_loss = F.cross_entropy(model(x), y)
            if not labelled:
                return real_loss
            pick = torch.randint(len(synthetic_y), (len(y),), generator=generator)
            xs, ys = synthetic_x[pick].to(x.device), synthetic_y[pick].to(x.device)
            lam = float(mix_rng.beta(self.mixup_alpha, self.mixup_alpha))
            logits = model(lam * x + (1 - lam) * xs)
            mixed = lam * F.cross_entropy(logits, y) + (1 - lam) * F.cross_entropy(logits, ys)
            return mixed + self.lambda2 * real_loss

        steps, train_loss = run_local_sgd(model, data, cfg, generator, loss_fn=loss_fn)
        return ClientUpdate(state=snapshot_state(model), num_steps=steps, train_loss=train_loss)
