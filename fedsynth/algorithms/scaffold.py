"""SCAFFOLD (Karimireddy et al. 2020, option II): control variates correct client drift under label skew."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fedsynth.algorithms.base import (
    Aggregator,
    ClientUpdate,
    StateDict,
    check_parameters,
    check_same_layout,
    snapshot_state,
)
from fedsynth.errors import ConfigError, WireError
from fedsynth.learning.training import LocalTrainConfig, TrainData, run_local_sgd, train_device


def effective_steps(steps: int, momentum: float) -> float:
    """K_eff = sum_{j=1..K} (1 - m^(K-j+1)) / (1 - m): the total weight heavy-ball SGD (buf = m buf + g, w -= lr buf)
    gives the K gradients of a round; K for plain SGD (m = 0)."""
    if momentum == 0.0:
        return float(steps)
    return (steps - momentum * (1.0 - momentum**steps) / (1.0 - momentum)) / (1.0 - momentum)


@dataclass(frozen=True)
class Scaffold:
    """Client: gradient g + c - c_i each step; afterwards c_i+ = c_i - c + (x - y_i) / (K_eff * lr).

    The server keeps c, one tensor per floating-point entry of the global state (zeros at first;
    entries of buffers stay zero, since clients send delta c_i for trainable parameters only) and
    sends it as the server extra under the state's own key names. The client keeps c_i (parameter
    keys) as its client state and uploads delta c_i = c_i+ - c_i as its extra.
    Server: x += global_lr * (N_k-weighted mean of y_i - x), which with global_lr = 1 is exactly
    FedAvg's weighted mean; c += sum(delta c_i) / num_clients, i.e. (|S| / N) * mean(delta c_i).
    K_eff is the K of the paper's plain SGD; under heavy-ball momentum m (PyTorch's SGD, fresh each round) the
    gradient of step j moves the weights by lr * (1 - m^(K-j+1)) / (1 - m) over the round, so K_eff = the sum of
    those weights (effective_steps) and c_i+ is their weighted mean of the local gradients, as option II means it
    (1/(K lr) would overstate c_i by up to 1/(1-m): 10x at m = 0.9). Weight decay counts as part of the gradient.
    Zero local steps (train.max_steps = 0): y_i = x, nothing was learnt about the gradient, so c_i stays as it was
    and delta c_i = 0 (no division by K).
    """

    num_clients: int
    global_lr: float = 1.0
    name = "scaffold"

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
        if cfg.optimizer != "sgd":
            raise ConfigError(f"scaffold needs train.optimizer = \"sgd\" (its control variates divide the round's move by "
                              f"the steps SGD took), got train.optimizer = {cfg.optimizer!r}")
        train_device(model, cfg)
        params = {name: p for name, p in model.named_parameters() if p.requires_grad}
        layout = {name: (p.dtype, tuple(p.shape)) for name, p in params.items()}
        missing = [name for name in params if name not in server_extra]
        if missing:
            raise WireError(f"scaffold server extra lacks control variates for {missing[:5]}")
        server_c = {name: server_extra[name] for name in params}
        check_same_layout(server_c, layout, what="scaffold server control variate")
        client_c = client_state or {name: torch.zeros_like(p, device="cpu") for name, p in params.items()}
        check_same_layout(client_c, layout, what="scaffold client control variate")
        global_params = {name: p.detach().to("cpu", copy=True) for name, p in params.items()}
        correction = {name: (server_c[name] - client_c[name]).to(p.device) for name, p in params.items()}

        def loss_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(model(x), y)

        def correct_gradients() -> None:
            for name, p in params.items():
                if p.grad is None:
                    p.grad = correction[name].clone()
                else:
                    p.grad.add_(correction[name])

        steps, train_loss = run_local_sgd(model, data, cfg, generator, loss_fn=loss_fn, adjust_gradients=correct_gradients)
        if steps == 0:  # no step: keep c_i, send delta c_i = 0 (every client of a round sends the same keys)
            return ClientUpdate(state=snapshot_state(model), extra={name: torch.zeros_like(c) for name, c in client_c.items()},
                                client_state=dict(client_c), num_steps=0, train_loss=train_loss)
        scale = 1.0 / (effective_steps(steps, cfg.momentum) * cfg.round_lr)  # the lr this round's steps took
        new_client_c, delta_c = {}, {}
        for name, p in params.items():
            drift = (global_params[name] - p.detach().cpu()) * scale
            new_client_c[name] = client_c[name] - server_c[name] + drift
            delta_c[name] = new_client_c[name] - client_c[name]
        return ClientUpdate(
            state=snapshot_state(model), extra=delta_c, client_state=new_client_c, num_steps=steps, train_loss=train_loss
        )

    def client_extra_layout(self, model: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Each client's delta c_i: one tensor per trainable parameter, under its name."""
        return {name: (tuple(p.shape), p.dtype) for name, p in model.named_parameters() if p.requires_grad}

    def new_aggregator(self, global_state: StateDict, server_state: StateDict) -> Aggregator:
        return ScaffoldAggregator(global_state, server_state, num_clients=self.num_clients, global_lr=self.global_lr)

    def initial_server_state(self, global_state: StateDict) -> StateDict:
        return {key: torch.zeros_like(value, device="cpu") for key, value in global_state.items() if value.is_floating_point()}

    def server_extra(self, server_state: StateDict) -> StateDict:
        return server_state


class ScaffoldAggregator(Aggregator):
    """The weighted model mean of the base class, a server step size, and the unweighted sum of delta c_i."""

    def __init__(self, global_state: StateDict, server_state: StateDict, *, num_clients: int, global_lr: float) -> None:
        super().__init__(global_state, server_state)
        self._global_state = global_state
        self._num_clients = num_clients
        self._global_lr = global_lr
        self._delta_c_layout = {key: (value.dtype, tuple(value.shape)) for key, value in server_state.items()}
        self._delta_c_keys: set[str] | None = None
        self._delta_c_sums: dict[str, torch.Tensor] = {}

    def add_extra(self, extra: StateDict) -> None:
        if self.count >= self._num_clients:
            raise ConfigError(f"scaffold num_clients={self._num_clients} but more updates arrived in one round")
        unknown = extra.keys() - self._delta_c_layout.keys()
        if unknown:
            raise WireError(f"scaffold delta c has keys the server has no control variate for: {sorted(unknown)[:5]}")
        if self._delta_c_keys is not None and extra.keys() != self._delta_c_keys:
            raise WireError("scaffold delta c keys differ between clients of one round")
        check_same_layout(extra, {key: self._delta_c_layout[key] for key in extra}, what="scaffold delta c")
        self._delta_c_keys = set(extra)
        for key, value in extra.items():
            total = self._delta_c_sums.setdefault(key, torch.zeros(value.shape, dtype=torch.float64))
            total.add_(value.detach().to("cpu", torch.float64))

    def weighted_mean(self) -> StateDict:
        mean = super().weighted_mean()
        if self._global_lr == 1.0:
            return mean
        for key, value in mean.items():
            if value.is_floating_point():  # step from x towards the float64 mean, not the rounded-to-float32 one
                start = self._global_state[key].to("cpu", torch.float64)
                target = self.mean64(key)
                mean[key] = (start + self._global_lr * (target - start)).to(value.dtype)
        return mean

    def finish_server_state(self) -> StateDict:
        new_c = dict(self._server_state)
        for key, total in self._delta_c_sums.items():
            old = new_c[key]
            new_c[key] = (old.to(torch.float64) + total / self._num_clients).to(old.dtype)
        return new_c
