"""build_model: shapes, the features/head split, ResNet-18's CIFAR stem and size, seeded initialization."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedsynth.errors import ConfigError
from fedsynth.learning.models import MODELS, build_model


@pytest.mark.parametrize(("in_channels", "image_size"), [(1, 8), (3, 32)])
def test_cnn_shapes_and_features_head_split(in_channels: int, image_size: int) -> None:
    torch.manual_seed(0)
    model = build_model("cnn", num_classes=10, in_channels=in_channels, image_size=image_size)
    x = torch.randn(5, in_channels, image_size, image_size)
    representation = model.features(x)
    assert representation.shape == (5, 128)
    logits = model(x)
    assert logits.shape == (5, 10)
    assert torch.equal(model.head(representation), logits)


def test_resnet18_has_cifar_stem_and_expected_size() -> None:
    torch.manual_seed(0)
    model = build_model("resnet18", num_classes=10, in_channels=3, image_size=32)
    assert sum(p.numel() for p in model.parameters()) == 11_173_962  # ~44.7 MB as float32
    stem = model.net.conv1
    assert (stem.kernel_size, stem.stride, stem.in_channels) == ((3, 3), (1, 1), 3)
    assert isinstance(model.net.maxpool, nn.Identity)
    model.eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        representation = model.features(x)
        logits = model(x)
    assert representation.shape == (2, 512)
    assert logits.shape == (2, 10)
    assert torch.equal(model.head(representation), logits)


def test_resnet18_output_size_follows_num_classes() -> None:
    model = build_model("resnet18", num_classes=100, in_channels=3, image_size=32)
    assert model.net.fc.out_features == 100


@pytest.mark.parametrize("name", MODELS)
def test_initialization_is_deterministic_given_the_seed(name: str) -> None:
    def state(seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(seed)
        return build_model(name, num_classes=10, in_channels=3, image_size=32).state_dict()

    first, again, other = state(7), state(7), state(8)
    assert first.keys() == again.keys()
    assert all(torch.equal(first[key], again[key]) for key in first)
    assert not all(torch.equal(first[key], other[key]) for key in first)


def test_unknown_model_is_named() -> None:
    with pytest.raises(ConfigError, match="'vgg11'"):
        build_model("vgg11", num_classes=10, in_channels=3, image_size=32)


@pytest.mark.parametrize(
    ("kwargs", "bad"),
    [
        ({"num_classes": 1, "in_channels": 3, "image_size": 32}, "num_classes"),
        ({"num_classes": 10, "in_channels": 0, "image_size": 32}, "in_channels"),
        ({"num_classes": 10, "in_channels": 3, "image_size": 2}, "image_size"),
    ],
)
def test_bad_dimensions_are_named(kwargs: dict[str, int], bad: str) -> None:
    with pytest.raises(ConfigError, match=bad):
        build_model("cnn", **kwargs)
