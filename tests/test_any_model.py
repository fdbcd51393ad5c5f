"""train.model's three forms (a built-in name, torchvision:<builder>, package.module:factory) and train.init_weights:
the config's syntax check (no torch), the builds and their one-line refusals, MOON/FedGen's features/head need, the
layout digest that refuses a node building another model, and two real runs on client folders of 32x32 images
(docs/guides/bring-your-own-model.md).

byo_model is tests/fixtures/byo_model, a small package that scripts/test.sh installs into the test venv, as a user
installs theirs on every node."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from fedsynth import __version__
from fedsynth.assembly import model_for
from fedsynth.config import load_config
from fedsynth.errors import ConfigError
from fedsynth.learning.models import build_model, has_features_head, load_init_weights
from fedsynth.wire import versions

MODEL_ERROR = "train.model must be cnn, resnet18, torchvision:<builder> or package.module:factory, got {!r}"
ACCEPTED = ["cnn", "resnet18", "torchvision:resnet18", "torchvision:mobilenet_v3_small", "byo_model:tiny_net",
            "some_pkg.models.v2:make_net", "not_installed_here:factory"]  # syntax only: nothing is imported
REFUSED = ["x", "vgg11", "unet-large", "torchvision:", "torchvision:res-net", "torchvision:1net", "pkg.mod:", ":f",
           "pkg..mod:f", "pkg.mod:f.g", "pkg-name.mod:f", "pkg.mod:f:g", "byo_model.tiny_net"]

CHECK_WITHOUT_TORCH = """
import json, sys
from fedsynth.config import load_config
from fedsynth.errors import ConfigError
results = {}
for value in json.loads(sys.argv[1]):
    try:
        results[value] = load_config(None, ["train.model=" + json.dumps(value)]).train.model
    except ConfigError as exc:
        results[value] = "ConfigError: " + str(exc)
ddpm = load_config(None, ['train.algorithm="ddpm"', 'train.model="unet-tiny"', 'generation.policy="none"']).train.model
print(json.dumps({"results": results, "ddpm": ddpm, "torch": "torch" in sys.modules}))
"""


def test_the_config_checks_the_model_syntax_without_importing_torch() -> None:
    done = subprocess.run([sys.executable, "-c", CHECK_WITHOUT_TORCH, json.dumps(ACCEPTED + REFUSED)],
                          capture_output=True, text=True, timeout=60, check=True)
    out = json.loads(done.stdout)
    assert out["torch"] is False  # the check reads the syntax; the build (fedsynth.learning.models) imports
    assert out["ddpm"] == "unet-tiny"  # the generator's UNets still work for `fedsynth generator federate`
    for value in ACCEPTED:
        assert out["results"][value] == value
    for value in REFUSED:
        assert out["results"][value] == "ConfigError: " + MODEL_ERROR.format(value)


def test_a_unet_is_refused_for_a_classifier_algorithm() -> None:
    with pytest.raises(ConfigError, match="unet-tiny"):
        load_config(None, ['train.model="unet-tiny"'])


def test_a_bad_model_on_the_command_line_is_one_line_and_exit_1() -> None:
    done = subprocess.run([sys.executable, "-m", "fedsynth.cli", "run", "--set", "train.model=mypkg:My-Net"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [f"fedsynth run: error: {MODEL_ERROR.format('mypkg:My-Net')}"]


@pytest.mark.parametrize(("channels", "size"), [(3, 32), (1, 8)])
def test_torchvision_resnet18_gets_the_cifar_stem_and_a_features_head_split(channels: int, size: int) -> None:
    torch.manual_seed(0)
    model = build_model("torchvision:resnet18", num_classes=10, in_channels=channels, image_size=size)
    stem = model.net.conv1
    assert (stem.in_channels, stem.kernel_size, stem.stride) == (channels, (3, 3), (1, 1))
    assert isinstance(model.net.maxpool, nn.Identity) and isinstance(model.net.fc, nn.Identity)
    assert has_features_head(model) and model.representation_dim == 512
    assert list(model.state_dict())[-2:] == ["classifier.weight", "classifier.bias"]  # FedGen's head prefix
    x = torch.randn(3, channels, size, size)
    assert model(x).shape == (3, 10)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model.head(model.features(x)), model(x))


def test_a_torchvision_builder_without_one_final_linear_has_no_split_and_moon_refuses_it() -> None:
    model = build_model("torchvision:squeezenet1_0", num_classes=10, in_channels=3, image_size=32)  # a conv head
    assert not has_features_head(model) and model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    moon = load_config(None, ['train.model="torchvision:squeezenet1_0"', 'train.algorithm="moon"'])
    with pytest.raises(ConfigError, match=r"train.algorithm='moon' cannot train train.model='torchvision:squeezenet1_0'"):
        model_for(moon, num_classes=10, in_channels=3, image_size=32)


def test_a_factory_model_is_used_as_built() -> None:
    model = build_model("byo_model:tiny_net", num_classes=10, in_channels=1, image_size=8)
    assert type(model).__name__ == "TinyNet" and model(torch.randn(4, 1, 8, 8)).shape == (4, 10)
    assert list(model.state_dict()) == ["body.0.weight", "body.0.bias", "classifier.weight", "classifier.bias"]


def test_moon_and_fedgen_take_a_model_with_features_and_head_and_refuse_one_without() -> None:
    for algorithm in ("moon", "fedgen"):
        cfg = load_config(None, ['train.model="byo_model:tiny_net"', f'train.algorithm="{algorithm}"'])
        model = model_for(cfg, num_classes=10, in_channels=1, image_size=8)
        assert model(torch.randn(2, 1, 8, 8)).shape == (2, 10)
        plain = load_config(None, ['train.model="byo_model:plain_net"', f'train.algorithm="{algorithm}"'])
        with pytest.raises(ConfigError, match=rf"^train.algorithm='{algorithm}' cannot train train.model='byo_model:plain_net'"
                                              r": it needs features\(x\) and head\(rep\)"):
            model_for(plain, num_classes=10, in_channels=1, image_size=8)
    assert model_for(load_config(None, ['train.model="byo_model:plain_net"']), num_classes=10, in_channels=1, image_size=8)


@pytest.mark.parametrize(("value", "says"), [
    ("torchvision:no_such_net", "has no classification builder 'no_such_net'"),
    ("torchvision:alexnet", "cannot take 1x8x8 images"),  # left as is: its stem does not fit 8x8 images
    ("no_such_package.models:net", "cannot import 'no_such_package.models'"),
    ("byo_model:missing", "module 'byo_model' has no callable 'missing'"),
    ("byo_model:broken_net", "factory(10, 1, 8) raised ValueError: this factory always fails"),
    ("byo_model:not_a_module", "returned str, not a torch.nn.Module"),
    ("byo_model:wrong_output", "must output N x 10 logits"),
])
def test_a_model_that_cannot_be_built_is_one_config_error_naming_train_model(value: str, says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        build_model(value, num_classes=10, in_channels=1, image_size=8)
    message = str(caught.value)
    assert message.startswith(f"train.model={value!r}") and says in message and "\n" not in message


def test_another_factory_has_another_layout_digest_and_the_coordinator_refuses_its_node() -> None:
    ours = versions.layout_digest(build_model("byo_model:tiny_net", num_classes=10, in_channels=1, image_size=8).state_dict())
    theirs = versions.layout_digest(build_model("byo_model:wider_net", num_classes=10, in_channels=1, image_size=8).state_dict())
    assert ours != theirs
    versions.check_node(3, versions.NodeVersion(__version__, versions.PROTOCOL_VERSION, ours), expected_digest=ours)
    with pytest.raises(versions.VersionRefused, match=rf"^client 3 builds a model of layout {theirs[:16]}, the "
                                                      rf"coordinator's is {ours[:16]}"):
        versions.check_node(3, versions.NodeVersion(__version__, versions.PROTOCOL_VERSION, theirs), expected_digest=ours)


def test_init_weights_load_strictly_and_a_mismatch_names_the_file_and_the_key(tmp_path: Path) -> None:
    model = build_model("byo_model:tiny_net", num_classes=10, in_channels=1, image_size=8)
    wider = build_model("byo_model:wider_net", num_classes=10, in_channels=1, image_size=8)
    good, bad, short = tmp_path / "good.safetensors", tmp_path / "bad.safetensors", tmp_path / "short.safetensors"
    state = {k: torch.full_like(v, 0.5) for k, v in model.state_dict().items()}
    save_file(state, good)
    save_file(wider.state_dict(), bad)
    save_file({k: v for k, v in state.items() if k != "classifier.bias"}, short)
    record = load_init_weights(model, good)
    assert record["path"] == str(good) and len(record["sha256"]) == 64
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    for path, says in [(bad, "first mismatch at 'body.0.weight' (shape (16, 1, 3, 3) in the file, (8, 1, 3, 3) in the model)"),
                       (short, "first mismatch at 'classifier.bias' (missing from the file"),
                       (tmp_path / "absent.safetensors", "no such file")]:
        with pytest.raises(ConfigError) as caught:
            load_init_weights(model, path)
        assert str(caught.value).startswith(f"train.init_weights={str(path)!r}") and says in str(caught.value)
        assert "\n" not in str(caught.value)


@pytest.fixture(scope="module")
def folders32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two clients' folders of 32x32 digits (`fedsynth data split --image-size 32`): the runs below use a model of the
    user's on client folders, as a user would."""
    out = tmp_path_factory.mktemp("digits32") / "clients"
    done = subprocess.run([sys.executable, "-m", "fedsynth.cli", "data", "split", "--dataset", "digits", "--clients", "2",
                           "--alpha", "0.5", "--image-size", "32", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def _run(out: Path, folders: Path, *sets: str) -> dict:
    command = [sys.executable, "-m", "fedsynth.cli", "run", "--out-dir", str(out), "--no-progress",
               "--set", "generation.policy=none", "--set", "data.clients=2", "--set", "train.rounds=1",
               "--set", "train.local_epochs=1", "--set", "runtime.clients_per_process=2", "--set", "data.source=local",
               "--set", f"data.local_dir={json.dumps(str(folders))}", "--set", "data.image_size=32"]
    for item in sets:
        command += ["--set", item]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["success"] and [r["round"] for r in report["rounds"]] == [1]
    return report


def _checkpoint(out: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(out / "checkpoint.safetensors"), "pt") as f:
        return {k.removeprefix("model/"): f.get_tensor(k) for k in f.keys() if k.startswith("model/")}


@pytest.mark.slow
def test_a_factory_model_run_starts_from_init_weights(tmp_path: Path, folders32: Path) -> None:
    torch.manual_seed(123)
    state = build_model("byo_model:tiny_net", num_classes=10, in_channels=1, image_size=32).state_dict()
    state["classifier.bias"] = torch.arange(10, dtype=torch.float32) / 8  # one tensor no seeded build would give
    init = tmp_path / "init.safetensors"
    save_file(state, init)
    out = tmp_path / "run"
    # train.max_steps = 0: the clients train nothing, so round 1's aggregate is the model the coordinator sent them
    report = _run(out, folders32, 'train.model="byo_model:tiny_net"', f"train.init_weights={json.dumps(str(init))}", "train.max_steps=0")
    assert report["config"]["train"]["model"] == "byo_model:tiny_net"
    assert report["config"]["train"]["init_weights"] == str(init)
    record = json.loads((out / "coordinator.json").read_text())["init_weights"]
    assert record == {"path": str(init), "sha256": hashlib.sha256(init.read_bytes()).hexdigest()}
    final = _checkpoint(out)
    assert final.keys() == state.keys()
    assert torch.equal(final["classifier.bias"], state["classifier.bias"])
    assert all(torch.allclose(final[k], state[k], rtol=0, atol=1e-6) for k in state)


@pytest.mark.slow
def test_a_torchvision_resnet18_run_on_32x32_client_folders(tmp_path: Path, folders32: Path) -> None:
    report = _run(tmp_path / "run", folders32, 'train.model="torchvision:resnet18"', "train.max_steps=2", "train.batch_size=16")
    assert report["config"]["train"]["model"] == "torchvision:resnet18"
    assert 0.0 <= report["final_accuracy"] <= 1.0
    assert "classifier.weight" in _checkpoint(tmp_path / "run")
