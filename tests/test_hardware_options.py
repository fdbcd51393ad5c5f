"""train.device, train.precision, train.optimizer and train.lr_schedule (docs/guides/gpus.md): device resolution and its
one-line refusals, the optimizers, the lr per round, bf16 autocast on the CPU, and the default path as it was."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedsynth.assembly import local_train_config
from fedsynth.config import load_config
from fedsynth.errors import ConfigError
from fedsynth.learning import hardware
from fedsynth.learning.hardware import resolve_device, resolve_hardware, set_node_device
from fedsynth.learning.training import (
    DeviceEvaluator,
    LocalTrainConfig,
    TrainData,
    augment_batch,
    batches,
    evaluate,
    make_optimizer,
    run_local_sgd,
    scheduled_lr,
)

NO_GPU = not torch.cuda.is_available()
needs_no_gpu = pytest.mark.skipif(not NO_GPU, reason="checks the refusals of a machine without a GPU")


class TinyCNN(nn.Module):
    def __init__(self, channels: int = 3, classes: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.adaptive_avg_pool2d(F.relu(self.norm(self.conv(x))), 4).flatten(1))


def tiny(seed: int = 0) -> TinyCNN:
    torch.manual_seed(seed)
    return TinyCNN()


def data(size: int = 32, n: int = 40) -> TrainData:
    g = torch.Generator().manual_seed(7)
    return TrainData(torch.rand(n, 3, size, size, generator=g) * 2 - 1, torch.randint(0, 4, (n,), generator=g))


def train(cfg: LocalTrainConfig, model: nn.Module | None = None, seed: int = 3) -> tuple[nn.Module, int, float]:
    model = model or tiny()
    steps, loss = run_local_sgd(model, data(), cfg, torch.Generator().manual_seed(seed),
                                loss_fn=lambda x, y: F.cross_entropy(model(x), y))
    return model, steps, loss


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.fixture(autouse=True)
def _no_node_device():
    yield
    set_node_device(None)  # a test's --device never leaks into the next


# ---- device resolution ---------------------------------------------------------------------------------------------

@needs_no_gpu
def test_auto_is_the_cpu_here_and_cuda_is_refused_in_one_line_naming_the_key() -> None:
    assert resolve_device("auto") == resolve_device("cpu") == torch.device("cpu")
    for spec in ("cuda", "cuda:0", "cuda:3"):
        with pytest.raises(ConfigError, match=rf"^train.device = '{spec}' but this machine has no CUDA GPU") as caught:
            resolve_device(spec)
        assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match=r"^train.device = 'cuda' but"):
        local_train_config(load_config(None, ["train.device=cuda"]))  # where a client node resolves it, each round


@needs_no_gpu
def test_client_device_flag_overrides_train_device_and_is_checked_at_once() -> None:
    cfg = load_config(None, ["train.device=cuda"])
    with pytest.raises(ConfigError, match=r"^--device cuda:1 but this machine has no CUDA GPU"):
        set_node_device("cuda:1")
    set_node_device("cpu")  # the coordinator's config says cuda; this node has none and says so
    assert local_train_config(cfg, 3) == replace(local_train_config(load_config(None)), round_number=3)


@needs_no_gpu
def test_fp16_needs_a_gpu_and_bf16_runs_on_the_cpu() -> None:
    with pytest.raises(ConfigError, match=r"^train.precision = 'fp16' needs a GPU"):
        resolve_hardware("auto", "fp16")
    with pytest.raises(ConfigError, match=r"^train.precision = 'fp16' needs a GPU"):
        local_train_config(load_config(None, ["train.precision=fp16"]))
    assert resolve_hardware("cpu", "bf16") == torch.device("cpu")


@needs_no_gpu
@pytest.mark.parametrize(("command", "flags", "key"), [
    ("run", ["--set", "train.device=cuda", "--no-progress", "--out-dir", "run"], "train.device = 'cuda'"),
    ("client", ["--coordinator", "127.0.0.1:9", "--device", "cuda"], "--device cuda"),
])
def test_the_cli_refuses_a_missing_gpu_in_one_line_before_starting_anything(tmp_path: Path, command: str,
                                                                              flags: list[str], key: str) -> None:
    script = str(Path(sys.executable).parent / "fedsynth")
    result = subprocess.run([script, command, *flags], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"fedsynth {command}: error: {key} but"), result.stderr
    assert not any(tmp_path.iterdir()), "no run folder, no logs, no process started"


def test_scaffold_with_adam_is_refused_naming_both_keys() -> None:
    for optimizer in ("adam", "adamw"):
        with pytest.raises(ConfigError, match=rf"train.optimizer = '{optimizer}' with train.algorithm = \"scaffold\""):
            load_config(None, ["train.algorithm=scaffold", f"train.optimizer={optimizer}"])
    load_config(None, ["train.algorithm=fedprox", "train.optimizer=adamw", "train.lr_schedule=cosine"])


# ---- optimizers and the lr per round -------------------------------------------------------------------------------

def test_adam_and_adamw_train_differently_from_sgd_and_repeat_under_a_seed() -> None:
    base = LocalTrainConfig(lr=0.01, momentum=0.9, weight_decay=0.01, batch_size=8, local_epochs=1, max_steps=3)
    models = {}
    for optimizer in ("sgd", "adam", "adamw"):
        cfg = replace(base, optimizer=optimizer)
        first, steps, loss = train(cfg)
        again, _, loss_again = train(cfg)
        assert steps == 3 and math.isfinite(loss) and loss == loss_again and same_weights(first, again)
        models[optimizer] = first
    assert type(make_optimizer(tiny().parameters(), replace(base, optimizer="adamw"))) is torch.optim.AdamW
    assert not same_weights(models["sgd"], models["adam"])
    assert not same_weights(models["adam"], models["adamw"])  # decoupled weight decay: a different step


def test_lr_schedules_per_round() -> None:
    assert [scheduled_lr(0.1, "constant", r, 4) for r in (1, 4)] == [0.1, 0.1]
    cosine = [scheduled_lr(1.0, "cosine", r, 4) for r in range(1, 5)]
    assert cosine == pytest.approx([1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 + math.cos(3 * math.pi / 4))])
    assert 0 < scheduled_lr(1.0, "cosine", 200, 200) < 1e-3  # near 0 at the end, never 0
    assert [scheduled_lr(1.0, "step", r, 8) for r in range(1, 9)] == [1, 1, 1, 1, 0.1, 0.1, 0.01, 0.01]
    cfg = local_train_config(load_config(None, ["train.lr_schedule=step", "train.rounds=8", "train.lr=0.5"]), 7)
    assert (cfg.round_number, cfg.rounds, cfg.round_lr) == (7, 8, 0.005)
    assert make_optimizer(tiny().parameters(), cfg).param_groups[0]["lr"] == 0.005


def test_local_training_steps_at_the_scheduled_lr() -> None:
    scheduled = LocalTrainConfig(lr=1.0, momentum=0.0, batch_size=8, local_epochs=1, max_steps=2, lr_schedule="step",
                                 rounds=4, round_number=3)  # round 3 of 4: x0.1
    constant = replace(scheduled, lr=0.1, lr_schedule="constant")
    assert same_weights(train(scheduled)[0], train(constant)[0])
    assert not same_weights(train(scheduled)[0], train(replace(scheduled, round_number=1))[0])


# ---- precision and the default path ---------------------------------------------------------------------------------

def test_bf16_autocast_on_the_cpu_trains_with_float32_weights() -> None:
    before = tiny()
    cfg = LocalTrainConfig(lr=0.05, momentum=0.9, batch_size=8, local_epochs=1, max_steps=4, precision="bf16")
    model, steps, loss = train(cfg, tiny())
    assert steps == 4 and math.isfinite(loss)
    assert all(p.dtype == torch.float32 for p in model.parameters()) and not same_weights(model, before)
    test_loss, accuracy = evaluate(model, data(), 16, precision="bf16")
    assert math.isfinite(test_loss) and 0 <= accuracy <= 1


def test_the_default_cpu_fp32_path_is_the_plain_sgd_loop_bit_for_bit() -> None:
    """run_local_sgd at the defaults against the loop as it was before train.optimizer/lr_schedule/device/precision."""
    cfg = LocalTrainConfig(lr=0.05, momentum=0.9, weight_decay=5e-4, batch_size=8, local_epochs=2, augment=True, max_steps=7)
    assert (cfg.optimizer, cfg.lr_schedule, cfg.device, cfg.precision, cfg.round_lr) == ("sgd", "constant", "cpu", "fp32", cfg.lr)
    model, steps, loss = train(cfg)

    reference, generator, losses = tiny(), torch.Generator().manual_seed(3), []
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    reference.train()
    for _ in range(2):
        for x, y in batches(data(), 8, generator):
            if len(losses) == 7:
                break
            out = F.cross_entropy(reference(augment_batch(x, generator)), y)
            optimizer.zero_grad(set_to_none=True)
            out.backward()
            optimizer.step()
            losses.append(out.detach().double())
    assert steps == 7 and loss == (sum(losses, torch.zeros((), dtype=torch.float64)).item() / 7)
    assert same_weights(model, reference)
    assert DeviceEvaluator(torch.device("cpu"))(model, data(), 16) == evaluate(reference, data(), 16)


def test_node_device_is_reported_where_it_came_from() -> None:
    assert hardware.node_device("auto") == ("auto", "train.device")
    set_node_device("cpu")
    assert hardware.node_device("cuda") == ("cpu", "--device")
