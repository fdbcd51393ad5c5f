"""Models shared by coordinator and clients: a small CNN and a CIFAR-style ResNet-18 (classifiers), and the
class-conditional DDPM UNet of each generator size (what `fedsynth generator federate` trains)."""

from __future__ import annotations

import numbers
from collections.abc import Callable

import torch
from torch import nn

from fedsynth.config_schema import MODELS, require_names
from fedsynth.errors import ConfigError


class SmallCNN(nn.Module):
    """Two conv blocks and a 128-unit representation; fits 8x8 digits and 32x32 CIFAR, quick on CPU.

    No BatchNorm and no dropout, so training uses no randomness beyond the batch order and the
    model state is parameters only. The adaptive pool makes the representation size independent of
    the image size (2x2 after the pool for every input of at least 4x4 pixels).
    """

    representation_dim = 128

    def __init__(self, *, num_classes: int, in_channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, 32, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.AdaptiveAvgPool2d(2),
            nn.Flatten(),
            nn.Linear(64 * 2 * 2, self.representation_dim),
            nn.ReLU(inplace=True),
        )
        self.classifier = nn.Linear(self.representation_dim, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Representation N x 128 (what MOON contrasts)."""
        return self.body(x)

    def head(self, representation: torch.Tensor) -> torch.Tensor:
        """Logits N x num_classes from a representation."""
        return self.classifier(representation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class CifarResNet18(nn.Module):
    """torchvision's ResNet-18 with the CIFAR stem: 3x3 stride-1 first conv and no max-pool.

    The torchvision module lives under `net`, so state_dict keys read `net.conv1.weight`, ...;
    the representation is the 512-d output of the global average pool, the head is `net.fc`.
    """

    representation_dim = 512

    def __init__(self, *, num_classes: int, in_channels: int) -> None:
        super().__init__()
        import torchvision  # 2 s of start-up that only ResNet users should pay

        net = torchvision.models.resnet18(num_classes=num_classes)
        net.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        # torchvision's ResNet init gives every conv kaiming-normal weights; keep the new stem consistent.
        nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")
        net.maxpool = nn.Identity()
        self.net = net

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Representation N x 512 after the global average pool."""
        net = self.net
        x = net.relu(net.bn1(net.conv1(x)))
        x = net.layer4(net.layer3(net.layer2(net.layer1(x))))
        return torch.flatten(net.avgpool(x), 1)

    def head(self, representation: torch.Tensor) -> torch.Tensor:
        """Logits N x num_classes from a representation."""
        return self.net.fc(representation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class ProjectedModel(nn.Module):
    """MOON's model (Li et al. 2021, their code's ModelFedCon): the base model's representation h, a projection MLP
    z = l2(ReLU(l1(h))) to `projection_dim`, and a new classifier on z. `features` returns z (what MOON contrasts),
    `head` the classifier. The base's own classifier is kept, unused, so its weights travel unchanged."""

    def __init__(self, base: nn.Module, *, num_classes: int, projection_dim: int) -> None:
        super().__init__()
        width = int(getattr(base, "representation_dim"))
        self.base = base
        self.projection = nn.Sequential(nn.Linear(width, width), nn.ReLU(inplace=True), nn.Linear(width, projection_dim))
        self.classifier = nn.Linear(projection_dim, num_classes)
        self.representation_dim = projection_dim

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.projection(self.base.features(x))  # type: ignore[operator]

    def head(self, representation: torch.Tensor) -> torch.Tensor:
        return self.classifier(representation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def _check_positive_int(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _cnn(*, num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    return SmallCNN(num_classes=num_classes, in_channels=in_channels)  # any side >= 4 (the adaptive pool)


def _resnet18(*, num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    if image_size < 8:
        raise ConfigError(f"model 'resnet18' needs images of at least 8x8 pixels, got image_size={image_size}")
    return CifarResNet18(num_classes=num_classes, in_channels=in_channels)


def _unet(size: str) -> Callable[..., nn.Module]:
    def build(*, num_classes: int, in_channels: int, image_size: int) -> nn.Module:
        from fedsynth.learning.unet import build_unet  # diffusers: only generator runs pay for it

        return build_unet(size, num_classes=num_classes, image_shape=(in_channels, image_size, image_size), seed=None)

    return build


# One builder per name in MODELS (fedsynth.config_schema, where the config check reads them without torch).
_BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "cnn": _cnn,
    "resnet18": _resnet18,
    **{name: _unet(name.removeprefix("unet-")) for name in MODELS if name.startswith("unet-")},
}
require_names("fedsynth.learning.models' builders", _BUILDERS, MODELS)


def build_model(name: str, *, num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    """Build model `name` (one of MODELS) for square images of `image_size` pixels.

    Every classifier has `features(x) -> N x D`, `head(rep) -> logits` and `forward = head(features(x))`.
    Weights come from torch's global RNG, so `torch.manual_seed(s)` right before this call makes the
    initialization reproducible (the coordinator seeds it and ships the weights to clients).
    """
    _check_positive_int("num_classes", num_classes, 2)
    _check_positive_int("in_channels", in_channels, 1)
    _check_positive_int("image_size", image_size, 4)
    if name not in MODELS:
        raise ConfigError(f"unknown model {name!r}; expected one of {', '.join(MODELS)}")
    return _BUILDERS[name](num_classes=num_classes, in_channels=in_channels, image_size=image_size)
