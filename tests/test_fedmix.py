"""FedMix and NaiveMix: the losses against their closed forms on a tiny model, the clients' mean data, local training."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from client_node.fedmix_client import mean_data, pool_from_group
from fedsynth.algorithms import get_algorithm
from fedsynth.algorithms.fedmix import fedmix_loss, naivemix_loss
from fedsynth.errors import ConfigError, WireError
from fedsynth.learning.training import LocalTrainConfig, TrainData

CLASSES = 3


def tiny_model() -> nn.Module:
    """A two-layer net with a smooth non-linearity, so the input gradient depends on the input and the weights."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, CLASSES)).double()


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.rand(6, 1, 2, 2, generator=g, dtype=torch.float64) * 2 - 1
    y = torch.randint(0, CLASSES, (6,), generator=g)
    mean_x = torch.rand(6, 1, 2, 2, generator=g, dtype=torch.float64) * 2 - 1
    mean_y = torch.softmax(torch.randn(6, CLASSES, generator=g, dtype=torch.float64), dim=1)
    return x, y, mean_x, mean_y


def test_fedmix_loss_equals_its_closed_form_sample_by_sample() -> None:
    model, (x, y, mean_x, mean_y), lam = tiny_model(), batch(), 0.1
    expected = []
    for i in range(len(y)):  # the paper's per-sample formula, each input gradient taken on its own
        z = ((1 - lam) * x[i : i + 1]).requires_grad_(True)
        logits = model(z)
        local = F.cross_entropy(logits, y[i : i + 1])
        (dz,) = torch.autograd.grad(local, z, create_graph=True)
        mean_term = -(mean_y[i] * F.log_softmax(logits[0], dim=0)).sum()
        expected.append((1 - lam) * local + lam * mean_term + lam * (dz * mean_x[i : i + 1]).sum())
    got = fedmix_loss(model, x, y, mean_x, mean_y, lam)
    assert torch.allclose(got, torch.stack(expected).mean(), atol=1e-12, rtol=0)
    # The Taylor term trains the weights too (through the input gradient, built with create_graph).
    taylor = fedmix_loss(model, x, y, mean_x, mean_y, lam) - fedmix_loss(model, x, y, torch.zeros_like(mean_x), mean_y, lam)
    assert any(float(g.abs().max()) > 1e-6 for g in torch.autograd.grad(taylor, list(model.parameters())))


def test_fedmix_is_mixups_first_order_expansion() -> None:
    """NaiveMix with the same pairs minus FedMix shrinks like lambda^2 (their difference is second order)."""
    model, (x, y, mean_x, mean_y) = tiny_model(), batch()
    gaps = []
    for lam in (0.02, 0.01, 0.005):
        gap = naivemix_loss(model, x, y, mean_x, mean_y, lam) - fedmix_loss(model, x, y, mean_x, mean_y, lam)
        gaps.append(float(gap.detach().abs()))
    assert gaps[0] > 0
    assert gaps[1] / gaps[0] == pytest.approx(0.25, abs=0.03)
    assert gaps[2] / gaps[1] == pytest.approx(0.25, abs=0.03)


def test_naivemix_loss_is_plain_mixup_with_soft_labels() -> None:
    model, (x, y, mean_x, mean_y), lam = tiny_model(), batch(), 0.2
    mixed_x = (1 - lam) * x + lam * mean_x
    mixed_y = (1 - lam) * F.one_hot(y, CLASSES).double() + lam * mean_y  # mixup's mixed label
    expected = -(mixed_y * F.log_softmax(model(mixed_x), dim=1)).sum(dim=1).mean()
    assert torch.allclose(naivemix_loss(model, x, y, mean_x, mean_y, lam), expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("name", ["fedmix", "naivemix"])
def test_lambda_zero_is_plain_cross_entropy(name: str) -> None:
    model, (x, y, mean_x, mean_y) = tiny_model(), batch()
    loss = fedmix_loss if name == "fedmix" else naivemix_loss
    assert torch.allclose(loss(model, x, y, mean_x, mean_y, 0.0), F.cross_entropy(model(x), y), atol=1e-12)


def test_mean_data_averages_disjoint_groups_of_m_images() -> None:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(23, 4, 4, 1), dtype=np.uint8)
    labels = rng.integers(0, 5, size=23)
    means_x, means_y = mean_data(images, labels, num_classes=5, mean_batch=5, seed=3)
    assert means_x.shape == (4, 4, 4, 1) and means_y.shape == (4, 5)  # floor(23 / 5); the 3 left over are unused
    assert means_x.dtype == means_y.dtype == np.float32
    assert np.allclose(means_y.sum(axis=1), 1.0) and np.all(means_y * 5 == np.round(means_y * 5))
    order = np.random.default_rng(3).permutation(23)[:20].reshape(4, 5)
    assert np.allclose(means_x, images[order].astype(np.float64).mean(axis=1), atol=1e-4)
    assert np.allclose(means_y, np.eye(5)[labels[order]].mean(axis=1))
    assert len(set(order.ravel())) == 20  # every image in at most one mean
    # On the wire means stay in pixel units; the client maps them as images_to_tensor maps images.
    x, y, digest = pool_from_group({"images": torch.from_numpy(means_x), "labels": torch.from_numpy(means_y),
                                    "digest": torch.tensor([1, 255], dtype=torch.uint8)})
    assert x.shape == (4, 1, 4, 4) and torch.allclose(x[0, 0], torch.from_numpy(means_x[0, :, :, 0]) / 127.5 - 1)
    assert digest == "01ff" and torch.equal(y, torch.from_numpy(means_y))


@pytest.mark.parametrize("name", ["fedmix", "naivemix"])
def test_local_training_uses_the_mean_data(name: str) -> None:
    g = torch.Generator().manual_seed(0)
    data = TrainData(torch.rand(40, 1, 8, 8, generator=g) * 2 - 1, torch.randint(0, 10, (40,), generator=g))
    pool = {"mean_x": torch.rand(8, 1, 8, 8, generator=g) * 2 - 1, "mean_y": torch.full((8, 10), 0.1)}
    cfg = LocalTrainConfig(lr=0.05, batch_size=10, local_epochs=1)

    def train(extra: dict[str, torch.Tensor], lam: float) -> dict[str, torch.Tensor]:
        from fedsynth.learning.models import build_model

        torch.manual_seed(0)
        model = build_model("cnn", num_classes=10, in_channels=1, image_size=8)
        update = get_algorithm(name, lam=lam).client_update(model=model, data=data, cfg=cfg, server_extra=extra, client_state={},
                                                             generator=torch.Generator().manual_seed(4))
        assert update.num_steps == 4
        return update.state

    plain, with_pool = train({}, 0.1), train(pool, 0.1)
    assert not torch.equal(plain["classifier.weight"], with_pool["classifier.weight"])
    with pytest.raises(WireError, match="does not fit"):
        train({"mean_x": torch.zeros(8, 3, 8, 8), "mean_y": pool["mean_y"]}, 0.1)


@pytest.mark.parametrize(("params", "fragment"), [({"lam": 1.5}, "lam"), ({"lam": -0.1}, "lam"), ({"mean_batch": 1}, "mean_batch"),
                                                  ({"mean_batch": 2.5}, "mean_batch"), ({"mu": 1}, "mu")])
def test_bad_parameters_are_named(params: dict[str, object], fragment: str) -> None:
    for name in ("fedmix", "naivemix"):
        with pytest.raises(ConfigError, match=fragment):
            get_algorithm(name, **params)
    assert get_algorithm("fedmix").lam == 0.05 and get_algorithm("naivemix").lam == 0.1
    assert get_algorithm("fedmix").mean_batch == get_algorithm("naivemix").mean_batch == 5
