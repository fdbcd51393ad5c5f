"""dp = "sample": one client's round of DP-SGD on the UNet with Opacus (Poisson sampling, per-image clipping, Gaussian
noise, BatchMemoryManager for logical batches larger than memory allows), with DPDM's noise multiplicity: each image's
K diffusion-noise draws are averaged inside ONE per-image gradient before clipping, so Opacus clips and accounts
images, not draws."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedsynth.algorithms.base import ClientUpdate, StateDict, snapshot_state
from fedsynth.algorithms.privacy import epsilon_spent
from fedsynth.config import FederateConfig
from fedsynth.errors import StopRequested
from fedsynth.learning.training import TrainData

log = logging.getLogger(__name__)
# Opacus's "hooks" mode accepts the UNet but silently returns zero per-image gradients for the weights of seven of
# tiny's convolutions (the mid block's and the first up block's; measured with Opacus 1.6 against a per-image loop);
# "functorch" (torch.func.vmap of the per-image gradient) matches the loop for every parameter
# (tests/test_federated_generator.py).
GRAD_SAMPLE_MODE = "functorch"
STEPS_KEY = "dp_steps"  # the client's own count of DP-SGD steps so far (its client_state), for its epsilon


class FedDdpmLike(Protocol):
    """What DP-SGD needs of the federated generator algorithm (fedsynth.algorithms.ddpm.FedDdpm)."""

    settings: FederateConfig

    @property
    def lr(self) -> float: ...

    def device(self) -> torch.device: ...

    def augment(self, x0: torch.Tensor, generator: torch.Generator) -> torch.Tensor: ...

    def sample_noise_multiplier(self, num_samples: int) -> float: ...

    def client_sample_rate(self, num_samples: int) -> float: ...


def group_draws(module: nn.Module, draws: int) -> None:
    """Replace each parameter's per-row gradients (images x draws rows, image-major) by their mean over the draws of
    one image: the gradient of that image's loss averaged over its draws, which is what gets clipped."""
    for parameter in module.parameters():
        rows = getattr(parameter, "grad_sample", None)
        if rows is not None:
            parameter.grad_sample = rows.view(-1, draws, *rows.shape[1:]).mean(1)


def train_dp_sgd(algorithm: FedDdpmLike, *, model: nn.Module, data: TrainData, should_stop: Callable[[], bool] | None,
                 generator: torch.Generator, client_state: StateDict | None = None) -> ClientUpdate:
    """local_steps logical DP-SGD steps of expected batch_size images each; sigma from the run's target epsilon over
    rounds x local_steps steps (the budget of a client that takes part in every round: Opacus's get_noise_multiplier,
    as make_private_with_epsilon would call it for one session of that many steps)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus's notes on secure RNG and on full backward hooks over the UNet's inputs
        return _train(algorithm, model=model, data=data, should_stop=should_stop, generator=generator, client_state=client_state)


def _train(algorithm: FedDdpmLike, *, model: nn.Module, data: TrainData, should_stop: Callable[[], bool] | None,
           generator: torch.Generator, client_state: StateDict | None) -> ClientUpdate:
    from opacus import PrivacyEngine
    from opacus.utils.batch_memory_manager import BatchMemoryManager

    from fedsynth.learning.unet import denoising_loss, make_train_scheduler, noised_batch

    s = algorithm.settings
    draws = s.noise_multiplicity
    num_classes = int(model.config.num_class_embeds) - 1  # type: ignore[union-attr, operator]
    sigma = algorithm.sample_noise_multiplier(len(data))
    rate = algorithm.client_sample_rate(len(data))
    loader = DataLoader(TensorDataset(data.x, data.y), batch_size=s.batch_size,  # Poisson at 1 / len(loader) = rate
                        generator=torch.Generator().manual_seed(int(torch.randint(2**62, (1,), generator=generator))))
    device = algorithm.device()
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=algorithm.lr, weight_decay=0.0)
    engine = PrivacyEngine(secure_mode=s.secure_noise)
    noise = None if s.secure_noise else torch.Generator(device=device).manual_seed(int(torch.randint(2**62, (1,), generator=generator)))
    private, dp_optimizer, dp_loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=sigma, max_grad_norm=s.clip,
        poisson_sampling=True, grad_sample_mode=GRAD_SAMPLE_MODE, noise_generator=noise)
    scheduler = make_train_scheduler()
    physical = max(1, s.max_physical_batch // draws)  # images per physical batch: images x draws rows fit in memory
    private.train()
    steps, loss_sum = 0, 0.0
    try:
        with BatchMemoryManager(data_loader=dp_loader, max_physical_batch_size=physical, optimizer=dp_optimizer) as batches:
            while steps < s.local_steps:
                for x, y in batches:
                    if should_stop is not None and should_stop():
                        raise StopRequested(f"local training stopped after {steps} optimizer steps")
                    dp_optimizer.zero_grad(set_to_none=True)
                    if len(x):
                        x0 = algorithm.augment(x.to(device), generator).repeat_interleave(draws, 0)
                        noisy, t, labels, target = noised_batch(scheduler, x0, y.repeat_interleave(draws, 0), num_classes=num_classes,
                                                                label_dropout=s.label_dropout, generator=generator)
                        loss = denoising_loss(private, noisy, t, labels, target)
                        loss.backward()
                        group_draws(model, draws)
                        loss_sum += loss.item()
                    else:  # Poisson sampling drew no image: the step still adds its noise
                        for parameter in model.parameters():
                            parameter.grad_sample = torch.zeros((0, *parameter.shape), device=device)
                    dp_optimizer.step()
                    if not dp_optimizer._is_last_step_skipped:
                        steps += 1
                        if steps == s.local_steps:
                            break
    finally:
        private._close()  # the hooks go: the client's model trains on plainly next round (or is reloaded)
        model.to("cpu")
    total = int((client_state or {}).get(STEPS_KEY, torch.zeros((), dtype=torch.int64))) + steps
    epsilon = epsilon_spent(noise_multiplier=sigma, sample_rate=rate, steps=total, delta=s.delta, accountant=s.accountant)
    log.info("DP-SGD: %d steps this round, %d in all: epsilon %.3f at delta %g (sigma %.3f, q %.4f, K %d draws)",
             steps, total, epsilon, s.delta, sigma, rate, draws)
    return ClientUpdate(state=snapshot_state(model), num_steps=steps, train_loss=loss_sum / max(1, steps),
                        client_state={STEPS_KEY: torch.tensor(total, dtype=torch.int64)})
