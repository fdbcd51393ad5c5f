"""The federated class-conditional DDPM: clients train the UNet on their shards (DDPM's loss, label dropout), the
server takes the N_k-weighted mean and keeps an EMA of it; dp = "user" is DP-FedAvg (McMahan et al. 2018), dp =
"sample" DP-SGD on each client (fedsynth.algorithms.dp_sgd)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fedsynth.algorithms.base import Aggregator, ClientUpdate, StateDict, snapshot_state
from fedsynth.algorithms.privacy import epsilon_spent, noise_multiplier_for
from fedsynth.algorithms.user_dp import UserDpAggregator, UserLevelDp, clip_to_move
from fedsynth.config import FederateConfig
from fedsynth.config_schema import GENERATOR_TRAIN_LR
from fedsynth.errors import StopRequested
from fedsynth.learning.training import LocalTrainConfig, TrainData

FROM_CONFIG = {"from_config": True}  # fields the run config fills in (fedsynth.assembly), not train.algorithm_params
EMA_PREFIX = "ema."
ROUNDS_KEY = "rounds"
EVAL_IMAGES = 256  # test images in the held-out denoising loss that stands for a round's "loss"
GRAD_CLIP = 1.0  # per-step gradient clipping, as `generator train`


@dataclass(frozen=True)
class FedDdpm:
    """What one run needs: the [federate] settings, the generator size, K, clients per round, rounds and the seed."""

    name = "ddpm"
    settings: FederateConfig = field(default_factory=FederateConfig, metadata=FROM_CONFIG)
    size: str = field(default="tiny", metadata=FROM_CONFIG)
    clients: int = field(default=1, metadata=FROM_CONFIG)
    clients_per_round: int = field(default=1, metadata=FROM_CONFIG)
    rounds: int = field(default=1, metadata=FROM_CONFIG)
    seed: int = field(default=0, metadata=FROM_CONFIG)
    flip: bool = field(default=False, metadata=FROM_CONFIG)  # horizontal flips (natural images, not digits)
    # dp user: the coordinator's secret (coordinator/dp_secret.py) in the noise's seed; the clients know the run seed
    noise_secret: bytes = field(default=b"", metadata=FROM_CONFIG)

    @property
    def lr(self) -> float:
        return self.settings.lr if self.settings.lr is not None else GENERATOR_TRAIN_LR[self.size]

    # ---- the client ---------------------------------------------------------------------------

    def client_update(self, *, model: nn.Module, data: TrainData, cfg: LocalTrainConfig, server_extra: StateDict,
                      client_state: StateDict, generator: torch.Generator) -> ClientUpdate:
        s = self.settings
        if s.dp == "sample":
            from fedsynth.algorithms.dp_sgd import train_dp_sgd  # Opacus's engine: only sample-level runs load it

            return train_dp_sgd(self, model=model, data=data, should_stop=cfg.should_stop, generator=generator, client_state=client_state)
        start = snapshot_state(model)
        num_classes = int(model.config.num_class_embeds) - 1  # type: ignore[union-attr, operator]
        device = self.device()
        model.to(device)
        try:
            loss_sum = self._local_steps(model, data, cfg, generator, num_classes, device)
        finally:
            model.to("cpu")  # the node keeps (and checks) its model on the CPU between rounds
        state = snapshot_state(model)
        if s.dp == "user":  # clipped here AND on the coordinator: an honest client's update arrives as it will count
            state = clip_to_move(state, start, s.clip)
        return ClientUpdate(state=state, num_steps=s.local_steps, train_loss=loss_sum / s.local_steps)

    def _local_steps(self, model: nn.Module, data: TrainData, cfg: LocalTrainConfig, generator: torch.Generator,
                     num_classes: int, device: torch.device) -> float:
        from fedsynth.learning.unet import denoising_loss, make_train_scheduler, noised_batch

        s = self.settings
        scheduler = make_train_scheduler()
        optimizer = torch.optim.AdamW(model.parameters(), lr=self.lr, weight_decay=0.0)
        model.train()
        loss_sum = 0.0
        for step in range(s.local_steps):
            if cfg.should_stop is not None and cfg.should_stop():
                raise StopRequested(f"local training stopped after {step} optimizer steps")
            index = torch.randint(len(data), (s.batch_size,), generator=generator)
            x0 = self.augment(data.x[index].to(device), generator)
            noisy, t, labels, noise = noised_batch(scheduler, x0, data.y[index], num_classes=num_classes,
                                                   label_dropout=s.label_dropout, generator=generator)
            loss = denoising_loss(model, noisy, t, labels, noise)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
            optimizer.step()
            loss_sum += loss.item()
        return loss_sum

    def augment(self, x0: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        if not self.flip:
            return x0
        flip = (torch.rand(len(x0), 1, 1, 1, generator=generator) < 0.5).to(x0.device)
        return torch.where(flip, x0.flip(3), x0)

    def device(self) -> torch.device:
        """Where this client trains (federate.device): auto is cuda when the node has a GPU."""
        wanted = self.settings.device
        if wanted == "auto":
            wanted = "cuda" if torch.cuda.is_available() else "cpu"
        return torch.device(wanted)

    # ---- the server ---------------------------------------------------------------------------

    def initial_server_state(self, global_state: StateDict) -> StateDict:
        ema = {EMA_PREFIX + key: value.clone() for key, value in global_state.items()}
        return {ROUNDS_KEY: torch.zeros((), dtype=torch.int64), **ema}

    def server_extra(self, server_state: StateDict) -> StateDict:
        return {}

    def new_aggregator(self, global_state: StateDict, server_state: StateDict) -> Aggregator:
        return DdpmAggregator(global_state, server_state, algorithm=self)

    @property
    def sample_rate(self) -> float:
        """q of user-level DP: the share of the clients sampled each round (a fixed number, m of K)."""
        return self.clients_per_round / self.clients

    def user_dp(self) -> UserLevelDp | None:
        """dp user's DP-FedAvg (None otherwise); its noise needs noise_secret, set by the coordinator."""
        s = self.settings
        if s.dp != "user":
            return None
        return UserLevelDp(clip=s.clip, noise_multiplier=self.user_noise_multiplier(), clients=self.clients,
                           clients_per_round=self.clients_per_round, delta=s.delta, accountant=s.accountant, seed=self.seed,
                           noise_secret=self.noise_secret, secure_noise=s.secure_noise)

    def user_noise_multiplier(self) -> float:
        s = self.settings
        if s.target_epsilon is None:
            return s.noise_multiplier
        return noise_multiplier_for(target_epsilon=s.target_epsilon, delta=s.delta, sample_rate=self.sample_rate,
                                    steps=self.rounds, accountant=s.accountant)

    def sample_noise_multiplier(self, num_samples: int) -> float:
        """sigma of one client's DP-SGD, for a client of num_samples images that takes part in every round."""
        s = self.settings
        if s.target_epsilon is None:
            return s.noise_multiplier
        return noise_multiplier_for(target_epsilon=s.target_epsilon, delta=s.delta, sample_rate=self.client_sample_rate(num_samples),
                                    steps=self.rounds * s.local_steps, accountant=s.accountant)

    def client_sample_rate(self, num_samples: int) -> float:
        """q_k of dp sample: Opacus's DPDataLoader samples each image at 1 / (batches in an epoch)."""
        return 1.0 / math.ceil(num_samples / self.settings.batch_size)

    def check_privacy(self, shard_sizes: list[int]) -> None:
        """Raise ConfigError (naming federate.target_epsilon) when the target cannot be reached: before any process."""
        if self.settings.dp == "user":
            self.user_noise_multiplier()
        elif self.settings.dp == "sample":
            for size in sorted(set(shard_sizes)):
                self.sample_noise_multiplier(size)

    def privacy_report(self, completed_rounds: int, participation: dict[int, int] | None = None,
                       shard_sizes: dict[int, int] | None = None) -> dict[str, Any]:
        """epsilon, delta, sigma, S and q after `completed_rounds`; dp = "sample": each client's, from the rounds it took
        part in (`participation`) and its shard size."""
        s = self.settings
        report: dict[str, Any] = {"dp": s.dp, "delta": s.delta if s.dp != "none" else None, "clip": s.clip if s.dp != "none" else None,
                                  "accountant": s.accountant if s.dp != "none" else None, "epsilon": None,
                                  "noise_multiplier": None, "sample_rate": None, "target_epsilon": s.target_epsilon}
        user = self.user_dp()
        if user is not None:
            report.update({key: value for key, value in user.report(completed_rounds).items() if key != "target_epsilon"})
        elif s.dp == "sample":
            per_client = {}
            for client, size in sorted((shard_sizes or {}).items()):
                sigma, rate = self.sample_noise_multiplier(size), self.client_sample_rate(size)
                steps = (participation or {}).get(client, 0) * s.local_steps
                per_client[str(client)] = {
                    "epsilon": epsilon_spent(noise_multiplier=sigma, sample_rate=rate, steps=steps, delta=s.delta, accountant=s.accountant),
                    "noise_multiplier": sigma, "sample_rate": rate, "steps": steps, "num_samples": size,
                }
            report["per_client"] = per_client
            if per_client:  # each client's guarantee is its own; the run's is the weakest of them
                worst = max(per_client.values(), key=lambda c: c["epsilon"])
                report.update(epsilon=worst["epsilon"], noise_multiplier=worst["noise_multiplier"], sample_rate=worst["sample_rate"])
        return report

    def evaluate(self, model: nn.Module, data: TrainData, batch_size: int = 512) -> tuple[float, float]:
        """(the held-out denoising loss on the first EVAL_IMAGES test images with fixed noise, timesteps and labels;
        NaN: a generator has no accuracy)."""
        from fedsynth.learning.unet import denoising_loss, make_train_scheduler, noised_batch

        n = min(EVAL_IMAGES, len(data))
        generator = torch.Generator().manual_seed(0)
        num_classes = int(model.config.num_class_embeds) - 1  # type: ignore[union-attr, operator]
        noisy, t, labels, noise = noised_batch(make_train_scheduler(), data.x[:n], data.y[:n], num_classes=num_classes,
                                               label_dropout=0.0, generator=generator)
        was_training = model.training
        model.eval()
        total = 0.0
        with torch.inference_mode():
            for start in range(0, n, batch_size):
                part = slice(start, start + batch_size)
                total += float(denoising_loss(model, noisy[part], t[part], labels[part], noise[part], reduction="none").sum())
        model.train(was_training)
        return total / n, math.nan


class DdpmAggregator(UserDpAggregator):
    """dp none/sample: the N_k-weighted mean; dp user: DP-FedAvg's noisy mean (fedsynth.algorithms.user_dp). Then the
    EMA: ema <- d*ema + (1 - d)*new global, d = min(ema_decay, (1 + r) / (10 + r)) at round r."""

    def __init__(self, global_state: StateDict, server_state: StateDict, *, algorithm: FedDdpm) -> None:
        round_number = int(server_state[ROUNDS_KEY]) + 1
        super().__init__(global_state, server_state, dp=algorithm.user_dp(), round_number=round_number)
        self._algorithm = algorithm
        self._round = round_number

    def finish(self) -> tuple[StateDict, StateDict]:
        new_global, server_state = super().finish()
        decay = min(self._algorithm.settings.ema_decay, (1 + self._round) / (10 + self._round))
        updated = {ROUNDS_KEY: torch.tensor(self._round, dtype=torch.int64)}
        for key, value in new_global.items():
            ema = server_state[EMA_PREFIX + key]
            updated[EMA_PREFIX + key] = ema * decay + value * (1 - decay) if value.is_floating_point() else value.clone()
        return new_global, updated
