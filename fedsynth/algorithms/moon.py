"""MOON (Li et al. 2021): cross-entropy plus a model-contrastive loss on the representation; FedAvg aggregation."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fedsynth.algorithms.base import ClientUpdate, StateDict, WeightedMeanServer, check_parameters, snapshot_state
from fedsynth.learning.training import LocalTrainConfig, TrainData, run_local_sgd, train_device


def contrastive_loss(z: torch.Tensor, z_global: torch.Tensor, z_previous: torch.Tensor, temperature: float) -> torch.Tensor:
    """Mean over the batch of -log(e^{sim(z,z_glob)/T} / (e^{sim(z,z_glob)/T} + e^{sim(z,z_prev)/T})), sim = cosine."""
    positive = F.cosine_similarity(z, z_global, dim=1) / temperature
    negative = F.cosine_similarity(z, z_previous, dim=1) / temperature
    logits = torch.stack([positive, negative], dim=1)
    return F.cross_entropy(logits, torch.zeros(len(z), dtype=torch.int64, device=z.device))


def _frozen_copy(model: nn.Module, state: StateDict | None = None) -> nn.Module:
    frozen = copy.deepcopy(model)
    if state is not None:
        frozen.load_state_dict(state)
    frozen.requires_grad_(False)
    return frozen.eval()


@dataclass(frozen=True)
class Moon(WeightedMeanServer):
    """loss = CE(head(z), y) + mu * contrastive(z, z_global, z_previous) with z = model.features(x).

    With `projection_dim` > 0 the run's model is a ProjectedModel (fedsynth.learning.models): z is the output of the
    authors' projection MLP on the base representation and the classifier reads z, as in their code.

    The global model (the weights the round started from) and the client's previous local model
    are frozen copies in eval mode. The previous local model's full state is the client state.
    First round (empty client state): the global model also serves as the previous model, as in the
    authors' code; the contrastive term then equals log 2 with zero gradient, so the first round
    trains like FedAvg but reports train_loss shifted by mu * log 2.

    The client state lives in the client process's memory (client_node keeps it between rounds; it is
    not written to disk). A restarted client process therefore has none, and its first round after the
    restart is a first round in this sense: previous = global, no contrastive gradient. Its next round
    has a previous model again (docs/algorithms.md).
    """

    mu: float = 1.0
    temperature: float = 0.5
    projection_dim: int = 256  # the authors' out_dim; the run's model gets the head (fedsynth.assembly.model_for)
    name = "moon"

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
        train_device(model, cfg)  # the frozen copies below live where the model trains
        global_model = _frozen_copy(model)
        if client_state:
            previous_model = _frozen_copy(model, client_state)
        else:  # round 1, or the first round after a client restart: the round-1 rule (previous = global)
            previous_model = global_model

        def loss_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            z = model.features(x)
            with torch.no_grad():
                z_global = global_model.features(x)
                z_previous = previous_model.features(x)
            contrastive = contrastive_loss(z, z_global, z_previous, self.temperature)
            return F.cross_entropy(model.head(z), y) + self.mu * contrastive

        steps, train_loss = run_local_sgd(model, data, cfg, generator, loss_fn=loss_fn)
        state = snapshot_state(model)
        return ClientUpdate(state=state, client_state=state, num_steps=steps, train_loss=train_loss)
