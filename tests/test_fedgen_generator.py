"""FedGen's maths: label weights, diversity loss, the generator trained on fixed heads, the client's regularizer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fedsynth.algorithms import get_algorithm
from fedsynth.errors import WireError
from fedsynth.learning.fedgen_generator import FeatureGenerator, diversity_loss, label_weights, teacher_loss, train_generator
from fedsynth.learning.models import build_model
from fedsynth.learning.training import LocalTrainConfig, TrainData


def test_label_weights_are_each_clients_share_of_a_class() -> None:
    counts = np.array([[3, 0, 1], [1, 0, 1]])
    weights, qualified = label_weights(counts)
    assert np.allclose(weights, [[0.75, 0.25], [0.0, 0.0], [0.5, 0.5]])
    assert qualified.tolist() == [0, 2]  # no client holds class 1: the generator is never asked for it


def test_diversity_loss_is_smaller_when_distinct_noise_gives_distinct_features() -> None:
    eps = torch.rand(16, 4, generator=torch.Generator().manual_seed(0))
    spread, collapsed = diversity_loss(eps, eps @ torch.randn(4, 8)), diversity_loss(eps, torch.zeros(16, 8))
    assert float(collapsed) == 1.0 and float(spread) < 1.0


def test_generator_loss_decreases_against_a_fixed_ensemble() -> None:
    torch.manual_seed(0)
    heads = [nn.Linear(16, 5) for _ in range(3)]
    before = [h.weight.detach().clone() for h in heads]
    counts = np.array([[10, 0, 5, 5, 1], [0, 10, 5, 0, 1], [1, 1, 1, 10, 0]])
    generator = FeatureGenerator(num_classes=5, feature_dim=16, noise_dim=8, hidden_dim=32)
    weights = torch.as_tensor(label_weights(counts)[0], dtype=torch.float32)
    labels = torch.arange(5).repeat(40)

    def loss() -> float:
        generator.eval()
        with torch.no_grad():
            return float(teacher_loss(generator, heads, weights, labels, torch.Generator().manual_seed(9))[0])

    start = loss()
    steps = train_generator(generator, heads, counts, steps=60, batch_size=32, lr=1e-2, seed=1)
    assert loss() < 0.5 * start, (start, loss())
    assert np.mean(steps[-10:]) < np.mean(steps[:10])
    assert all(torch.equal(h.weight, b) for h, b in zip(heads, before))  # the heads are the teachers: left as they were
    # The generated features of class c are what the weighted ensemble calls c.
    with torch.no_grad():
        features, _ = generator(labels, torch.Generator().manual_seed(2))
        votes = sum(h(features).softmax(1) * weights[labels, k : k + 1] for k, h in enumerate(heads))
    assert float((votes.argmax(1) == labels).float().mean()) > 0.9


def _digits_like() -> tuple[TrainData, LocalTrainConfig]:
    g = torch.Generator().manual_seed(0)
    data = TrainData(torch.rand(40, 1, 8, 8, generator=g) * 2 - 1, torch.randint(0, 10, (40,), generator=g))
    return data, LocalTrainConfig(lr=0.05, batch_size=10, local_epochs=1)


def _client_round(name: str, server_state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    algorithm = get_algorithm(name)
    torch.manual_seed(0)
    model = build_model("cnn", num_classes=10, in_channels=1, image_size=8)
    state = algorithm.initial_server_state(model.state_dict()) if server_state is None else server_state
    data, cfg = _digits_like()
    update = algorithm.client_update(model=model, data=data, cfg=cfg, server_extra=algorithm.server_extra(state), client_state={},
                                     generator=torch.Generator().manual_seed(3))
    return update.state


def test_fedgen_round_one_is_fedavg_and_later_rounds_add_the_regularizer() -> None:
    first = _client_round("fedgen")  # reg_scale 0: the generator has not been trained yet
    plain = _client_round("fedavg")
    assert all(torch.equal(first[k], plain[k]) for k in plain)
    torch.manual_seed(0)
    model = build_model("cnn", num_classes=10, in_channels=1, image_size=8)
    state = get_algorithm("fedgen").initial_server_state(model.state_dict())
    state["reg_scale"] = torch.tensor(0.98)
    later = _client_round("fedgen", state)
    assert not torch.equal(later["classifier.weight"], plain["classifier.weight"])
    state["label_distribution"] = torch.full((10,), -0.1)
    with pytest.raises(WireError, match="label distribution"):
        _client_round("fedgen", state)
