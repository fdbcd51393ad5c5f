"""Per-sample gradients of the whole WGAN-GP critic loss, gradient penalty included, via torch.func.

Opacus's hooks cannot differentiate through the penalty's inner gradient (DESIGN.md, Known traps), so the
per-sample gradients come from vmap(grad(loss of one sample)) with the penalty's input gradient nested
inside; Opacus then only clips, noises and accounts (see privacy.py).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call, grad, grad_and_value, vmap

Params = dict[str, torch.Tensor]
# vmap over 8 samples at a time, not the whole batch: the whole batch's double-backward buffers exceed glibc's mmap
# threshold, so every critic step mapped and faulted them in anew (half the wall-clock in the kernel, 1.6 GB peak).
# 8 at a time: about 1.5x faster and 25% less memory on a 32x32 critic (the SDA-FL note in docs/cifar10-cpu-results.md);
# the same gradients up to float rounding.
VMAP_CHUNK = 8


def critic_loss_one(
    params: Params,
    critic: nn.Module,
    real: torch.Tensor,
    fake: torch.Tensor,
    alpha: torch.Tensor,
    gp_lambda: float,
) -> torch.Tensor:
    """WGAN-GP critic loss of ONE real image paired with its own fake and interpolate (C x H x W each):
    D(fake) - D(real) + gp_lambda * (||d D(x_hat) / d x_hat||_2 - 1)^2, x_hat = alpha real + (1 - alpha) fake."""

    def score(x: torch.Tensor) -> torch.Tensor:
        return functional_call(critic, params, (x.unsqueeze(0),)).squeeze(0)

    x_hat = alpha * real + (1.0 - alpha) * fake
    input_grad = grad(score)(x_hat)
    penalty = (input_grad.flatten().norm(2) - 1.0) ** 2
    return score(fake) - score(real) + gp_lambda * penalty


def per_sample_critic_grads(
    critic: nn.Module,
    real: torch.Tensor,
    fake: torch.Tensor,
    alpha: torch.Tensor,
    gp_lambda: float,
) -> tuple[Params, torch.Tensor]:
    """Gradients of critic_loss_one for every row of the batch, and the per-sample losses.

    real and fake: B x C x H x W; alpha: B (one interpolation weight per sample). Returns
    {parameter name: B x *parameter shape} (detached) and the B losses. B may be 0.
    """
    params = {name: p.detach() for name, p in critic.named_parameters()}
    if len(real) == 0:
        zeros = {name: torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device) for name, p in params.items()}
        return zeros, torch.zeros(0, device=real.device)
    per_sample = vmap(grad_and_value(critic_loss_one), in_dims=(None, None, 0, 0, 0, None), chunk_size=VMAP_CHUNK)
    grads, losses = per_sample(params, critic, real, fake, alpha.reshape(-1), gp_lambda)
    return grads, losses.detach()
