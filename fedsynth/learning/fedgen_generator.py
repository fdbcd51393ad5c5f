"""FedGen's server-side generator (Zhu, Hong, Zhou, ICML 2021; the authors' code: zhuangdizhu/FedGen).

A small conditional generator G(eps, y) -> a vector in the classifier's feature space (the input of `model.head`),
trained against the ensemble of the clients' heads, each weighted per class by its share of that class's samples
(label counts). This module is the maths only: the generator, the authors' diversity loss, the label weights and
the server's training step (fedsynth.algorithms.fedgen and coordinator.fedgen_server use them).

Defaults as in the authors' code (FLAlgorithms/trainmodel/generator.py, utils/model_config.py RUNCONFIGS):
noise_dim 32, hidden_dim 256, uniform noise eps ~ U[0, 1), one-hot labels concatenated to the noise, one hidden
layer Linear + BatchNorm1d + ReLU, a linear output layer; Adam lr 3e-4, batch 128, 5 teacher iterations per
epoch, ensemble_alpha 1 (teacher loss), ensemble_eta 1 (diversity loss), ensemble_beta 0 (no student term).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

MIN_SAMPLES_PER_LABEL = 1  # the authors' constant: a label is "qualified" when the clients hold at least this many


class FeatureGenerator(nn.Module):
    def __init__(self, *, num_classes: int, feature_dim: int, noise_dim: int = 32, hidden_dim: int = 256) -> None:
        super().__init__()
        self.num_classes, self.noise_dim = num_classes, noise_dim
        self.hidden = nn.Sequential(nn.Linear(noise_dim + num_classes, hidden_dim), nn.BatchNorm1d(hidden_dim), nn.ReLU())
        self.output = nn.Linear(hidden_dim, feature_dim)

    def forward(self, labels: torch.Tensor, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(features N x feature_dim, the noise eps N x noise_dim) for integer `labels`, on their device; eps is drawn
        where `generator` lives (the CPU's: the same draws whichever device trains) and moved there."""
        draw_on = None if generator is None else generator.device
        eps = torch.rand((len(labels), self.noise_dim), generator=generator, device=draw_on).to(labels.device)
        z = torch.cat([eps, F.one_hot(labels, self.num_classes).float()], dim=1)
        return self.output(self.hidden(z)), eps


def diversity_loss(eps: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """The authors' DiversityLoss("l1"): exp(-mean_ij ||eps_i - eps_j||^2_mean * |f_i - f_j|_mean), small when
    distinct noise gives distinct features."""
    feature_dist = (features[:, None, :] - features[None, :, :]).abs().mean(dim=2)
    noise_dist = (eps[:, None, :] - eps[None, :, :]).pow(2).mean(dim=2)
    return torch.exp(torch.mean(-noise_dist * feature_dist))


def label_weights(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(weights C x K: client k's share of class c's samples among the clients whose heads are used, the labels
    the clients hold at least MIN_SAMPLES_PER_LABEL of) from label counts K x C."""
    counts = np.asarray(counts, dtype=np.float64)
    totals = counts.sum(axis=0)
    qualified = np.flatnonzero(totals >= MIN_SAMPLES_PER_LABEL)
    weights = counts.T / np.maximum(totals, 1)[:, None]
    return weights, qualified


def teacher_loss(generator: FeatureGenerator, heads: Sequence[nn.Module], weights: torch.Tensor, labels: torch.Tensor,
                 rng: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the teacher loss sum_k mean_i w_k(y_i) CE(head_k(G(y_i)), y_i), the diversity loss) for one batch of labels;
    `weights` is C x K."""
    features, eps = generator(labels, rng)
    teacher = torch.zeros((), device=features.device)
    for k, head in enumerate(heads):
        teacher = teacher + (F.cross_entropy(head(features), labels, reduction="none") * weights[labels, k]).mean()
    return teacher, diversity_loss(eps, features)


def train_generator(generator: FeatureGenerator, heads: Sequence[nn.Module], counts: np.ndarray, *, steps: int = 5,
                    batch_size: int = 128, lr: float = 3e-4, ensemble_alpha: float = 1.0, ensemble_eta: float = 1.0,
                    seed: int = 0, optimizer: torch.optim.Optimizer | None = None) -> list[float]:
    """`steps` Adam steps of the generator against the fixed heads (their weights are not trained); labels are drawn
    uniformly from the qualified labels, as the authors draw them. Runs on the generator's device (the heads must be
    there too); the random draws are the CPU's wherever it runs. Returns each step's teacher loss."""
    device = next(generator.parameters()).device
    weights_np, qualified = label_weights(counts)
    weights = torch.as_tensor(weights_np, dtype=torch.float32, device=device)
    rng = torch.Generator().manual_seed(seed)
    choice = np.random.default_rng(seed)
    optimizer = optimizer or torch.optim.Adam(generator.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8)
    for head in heads:
        head.eval()
        for p in head.parameters():
            p.requires_grad_(False)
    generator.train()
    losses = []
    for _ in range(steps):
        labels = torch.as_tensor(choice.choice(qualified, batch_size), dtype=torch.int64, device=device)
        teacher, diversity = teacher_loss(generator, heads, weights, labels, rng)
        optimizer.zero_grad(set_to_none=True)
        (ensemble_alpha * teacher + ensemble_eta * diversity).backward()
        optimizer.step()
        losses.append(float(teacher.detach()))
    generator.eval()
    return losses
