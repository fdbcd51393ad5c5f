"""Models shared by coordinator and clients: a small CNN and a CIFAR-style ResNet-18 (classifiers), any
classification builder of torchvision.models (`torchvision:<builder>`), a user's factory (`package.module:factory`),
and the class-conditional DDPM UNet of each generator size (what `fedsynth generator federate` trains).
docs/guides/bring-your-own-model.md is the user's side of this module."""

from __future__ import annotations

import hashlib
import importlib
import inspect
import numbers
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedsynth.config_schema import CLASSIFIER_MODELS, MODELS, TORCHVISION_PREFIX, model_form, require_names
from fedsynth.errors import ConfigError

# Below this image side a torchvision ResNet (resnet*, resnext*, wide_resnet*) gets the CIFAR stem (a 3x3 stride-1
# first conv, no max-pool), as the built-in "resnet18" has; at or above it the ImageNet stem stays (so ImageNet
# weights fit). Every other builder keeps its stem; only its first conv's input channels follow data.channels.
CIFAR_STEM_BELOW = 64
# Builders with auxiliary classifiers: built without them (their training-mode output is a tuple, not logits).
_NO_AUX_LOGITS = ("googlenet", "inception_v3")


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


def has_features_head(model: nn.Module) -> bool:
    """Whether the model's class defines the features(x) / head(rep) methods MOON and FedGen call (a submodule named
    `features`, as torchvision's VGG or MobileNet have, is not one)."""
    return all(inspect.isfunction(inspect.getattr_static(type(model), name, None)) for name in ("features", "head"))


class TorchvisionClassifier(nn.Module):
    """A torchvision.models classifier under `net` (state_dict keys `net....`), with no features/head split: its
    logits do not come out of one final Linear layer (SqueezeNet's conv head, say). MOON and FedGen refuse it."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]


class TorchvisionSplitClassifier(nn.Module):
    """A torchvision.models classifier whose logits are its final Linear layer's output: that layer moves out of `net`
    to `classifier` (keys `classifier.weight`, `classifier.bias`; `net` holds an Identity in its place), so
    features(x) = net(x), the layer's input, and head = classifier, as SmallCNN's. forward is unchanged."""

    def __init__(self, net: nn.Module, classifier: nn.Linear) -> None:
        super().__init__()
        self.net = net
        self.classifier = classifier
        self.representation_dim = classifier.in_features

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]

    def head(self, representation: torch.Tensor) -> torch.Tensor:
        return self.classifier(representation)  # type: ignore[no-any-return]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _new_input_conv(conv: nn.Conv2d, in_channels: int, **changes: Any) -> nn.Conv2d:
    """A conv like `conv` but for `in_channels` input channels (and `changes`), kaiming-normal as torchvision's CNNs."""
    settings = dict(out_channels=conv.out_channels, kernel_size=conv.kernel_size, stride=conv.stride, padding=conv.padding,
                    dilation=conv.dilation, bias=conv.bias is not None, padding_mode=conv.padding_mode)
    settings.update(changes)
    new = nn.Conv2d(in_channels, **settings)  # type: ignore[arg-type]
    nn.init.kaiming_normal_(new.weight, mode="fan_out", nonlinearity="relu")
    if new.bias is not None:
        nn.init.zeros_(new.bias)
    return new


def _set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, module)


def _adapt_stem(net: nn.Module, *, in_channels: int, image_size: int) -> None:
    """ResNets below CIFAR_STEM_BELOW pixels: the CIFAR stem; otherwise the first 3-channel conv takes in_channels."""
    from torchvision.models import ResNet

    if isinstance(net, ResNet) and image_size < CIFAR_STEM_BELOW:
        net.conv1 = _new_input_conv(net.conv1, in_channels, kernel_size=3, stride=1, padding=1)
        net.maxpool = nn.Identity()
        return
    if in_channels == 3:
        return
    for path, module in net.named_modules():
        if isinstance(module, nn.Conv2d):
            if module.in_channels == 3 and module.groups == 1:
                _set_submodule(net, path, _new_input_conv(module, in_channels))
            return


def _probe(model: nn.Module, name: str, *, num_classes: int, in_channels: int, image_size: int,
           watch: nn.Module | None = None) -> bool:
    """Run two zero images through `model` in eval mode (no RNG drawn, no statistics updated): ConfigError naming
    train.model unless the output is N x num_classes logits. Returns whether the output IS `watch`'s output."""
    seen: list[torch.Tensor] = []
    hook = watch.register_forward_hook(lambda _m, _i, out: seen.append(out)) if watch is not None else None
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            out = model(torch.zeros(2, in_channels, image_size, image_size))
    except Exception as exc:
        raise ConfigError(f"train.model={name!r} cannot take {in_channels}x{image_size}x{image_size} images "
                          f"(data.channels x data.image_size^2): {_first_line(exc)}") from exc
    finally:
        model.train(was_training)
        if hook is not None:
            hook.remove()
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, num_classes):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(f"train.model={name!r} must output N x {num_classes} logits (num_classes from the schema), "
                          f"got {got} for a batch of 2")
    return bool(seen) and seen[-1] is out


def torchvision_builders() -> list[str]:
    """The classification builders of torchvision.models (not its detection, segmentation, video or optical-flow ones)."""
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


def _torchvision(name: str, *, num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    import torchvision

    builder = name.removeprefix(TORCHVISION_PREFIX)
    builders = torchvision_builders()
    if builder not in builders:
        raise ConfigError(f"train.model={name!r}: torchvision {torchvision.__version__} has no classification builder "
                          f"{builder!r} (torchvision.models.list_models(module=torchvision.models): "
                          f"{', '.join(builders[:6])}, ...)")
    kwargs: dict[str, Any] = {"weights": None, "num_classes": num_classes}
    if builder in _NO_AUX_LOGITS:
        kwargs.update(aux_logits=False, init_weights=True)
    if builder.startswith("vit_"):
        kwargs["image_size"] = image_size  # VisionTransformer's own argument: the position embedding's grid
    try:
        net = torchvision.models.get_model(builder, **kwargs)
    except Exception as exc:
        raise ConfigError(f"train.model={name!r}: torchvision's builder raised {_first_line(exc)}") from exc
    _adapt_stem(net, in_channels=in_channels, image_size=image_size)
    final = [(path, m) for path, m in net.named_modules() if isinstance(m, nn.Linear) and m.out_features == num_classes]
    last = final[-1] if final else None
    plain = TorchvisionClassifier(net)
    if not _probe(plain, name, num_classes=num_classes, in_channels=in_channels, image_size=image_size,
                  watch=last[1] if last else None) or last is None:
        return plain
    _set_submodule(net, last[0], nn.Identity())
    return TorchvisionSplitClassifier(net, last[1])


def _factory(name: str, *, num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or whatever the module raised while importing
        raise ConfigError(f"train.model={name!r}: cannot import {module_name!r} on this node ({_first_line(exc)}); "
                          "install the package on every node") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(f"train.model={name!r}: module {module_name!r} has no callable {attr!r}")
    try:
        model = factory(num_classes, in_channels, image_size)
    except Exception as exc:
        raise ConfigError(f"train.model={name!r}: factory({num_classes}, {in_channels}, {image_size}) raised "
                          f"{_first_line(exc)}") from exc
    if not isinstance(model, nn.Module):
        raise ConfigError(f"train.model={name!r}: factory({num_classes}, {in_channels}, {image_size}) returned "
                          f"{type(model).__name__}, not a torch.nn.Module")
    _probe(model, name, num_classes=num_classes, in_channels=in_channels, image_size=image_size)
    return model


def load_init_weights(model: nn.Module, path: Path) -> dict[str, str]:
    """train.init_weights: load a safetensors file into `model`, strictly (the same names, shapes and dtypes' kinds as
    its state_dict); ConfigError naming the file and the first mismatching key. Returns {"path", "sha256"} of the
    file, for the coordinator's record."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    key = f"train.init_weights={str(path)!r}"
    if not path.is_file():
        raise ConfigError(f"{key}: no such file (the coordinator reads it; clients need no copy)")
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ConfigError(f"{key} is not a safetensors file: {_first_line(exc)}") from exc
    expected = model.state_dict()
    for name in [*expected, *(k for k in state if k not in expected)]:
        if name not in state:
            raise ConfigError(f"{key} does not fit train.model: first mismatch at {name!r} (missing from the file; "
                              f"{len(state)} tensors in the file, {len(expected)} in the model)")
        if name not in expected:
            raise ConfigError(f"{key} does not fit train.model: first mismatch at {name!r} (not in the model)")
        if tuple(state[name].shape) != tuple(expected[name].shape):
            raise ConfigError(f"{key} does not fit train.model: first mismatch at {name!r} (shape "
                              f"{tuple(state[name].shape)} in the file, {tuple(expected[name].shape)} in the model)")
    model.load_state_dict(state, strict=True)
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {"path": str(path), "sha256": digest.hexdigest()}


def _check_positive_int(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _cnn(name: str, *, num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    return SmallCNN(num_classes=num_classes, in_channels=in_channels)  # any side >= 4 (the adaptive pool)


def _resnet18(name: str, *, num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    if image_size < 8:
        raise ConfigError(f"model 'resnet18' needs images of at least 8x8 pixels, got image_size={image_size}")
    return CifarResNet18(num_classes=num_classes, in_channels=in_channels)


def _unet(size: str) -> Callable[..., nn.Module]:
    def build(name: str, *, num_classes: int, in_channels: int, image_size: int) -> nn.Module:
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
    """Build model `name` (a name of MODELS, torchvision:<builder> or package.module:factory) for square images of
    `image_size` pixels. ConfigError naming train.model and the value when it cannot be built.

    The built-in classifiers and torchvision models whose logits are one final Linear layer's output have
    `features(x) -> N x D`, `head(rep) -> logits` and `forward = head(features(x))` (has_features_head); a factory's
    model has them where its class defines them. Weights come from torch's global RNG, so `torch.manual_seed(s)` right
    before this call makes the initialization reproducible (the coordinator seeds it and ships the weights to clients).
    """
    _check_positive_int("num_classes", num_classes, 2)
    _check_positive_int("in_channels", in_channels, 1)
    _check_positive_int("image_size", image_size, 4)
    form = model_form(name)
    if form is None:
        raise ConfigError(f"train.model must be {', '.join(CLASSIFIER_MODELS)}, {TORCHVISION_PREFIX}<builder> or "
                          f"package.module:factory, got {name!r}")
    build = {"builtin": _BUILDERS.get(name), "torchvision": _torchvision, "factory": _factory}[form]
    assert build is not None
    return build(name, num_classes=num_classes, in_channels=in_channels, image_size=image_size)
