"""The paper's Table 1 configs: every setting (dataset, K, alpha) partitions, and arms run a round of ResNet-18 on a CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from deploy.experiment_spec import load_experiment, write_run_toml
from fedsynth.config import RunConfig
from fedsynth.learning.data import NUM_CLASSES
from fedsynth.errors import ConfigError
from fedsynth.learning.partition import partition_for

CONFIGS = Path(__file__).resolve().parents[1] / "deploy" / "configs"
DATASETS = ("cifar10", "cifar100")
# (clients, participation, clients per node process): the paper's two federations
FEDERATIONS = ((20, 0.5, 5), (100, 0.1, 25))
ALPHAS = (0.05, 0.1, 0.3)
ALGORITHMS = ("fedavg", "fedprox", "scaffold", "moon", "fedgen", "fedmix")


def federation_overrides(clients: int, fraction: float, per_node: int) -> list[str]:
    return [f"data.clients={clients}", f"train.fraction={fraction}", f"runtime.clients_per_process={per_node}"]


@pytest.mark.parametrize("dataset", DATASETS)
def test_the_twelve_arms_are_the_papers_settings(dataset: str) -> None:
    experiment = load_experiment(CONFIGS / f"paper-{dataset}.toml")
    names = [arm.name for arm in experiment.arms]
    assert names == [name for algorithm in ALGORITHMS for name in (algorithm, "fedeas" if algorithm == "fedavg" else f"{algorithm}-fedeas")]
    assert experiment.settings.last_n == 20
    for arm in experiment.arms:
        cfg = experiment.arm_config(arm, 0, Path("."))
        t = cfg.train
        assert (t.model, t.rounds, t.local_epochs, t.lr, t.batch_size, t.fraction) == ("resnet18", 200, 10, 1e-3, 64, 0.5)
        assert (cfg.data.dataset, cfg.data.clients, cfg.generation.beta) == (dataset, 20, 12.0)
        with_fedeas = arm.name == "fedeas" or arm.name.endswith("-fedeas")
        assert cfg.generation.policy == ("fedeas" if with_fedeas else "none")
        assert t.algorithm == (arm.name.removesuffix("-fedeas") if arm.name not in ("fedavg", "fedeas") else "fedavg")
        if with_fedeas:  # "X + FedEAS" is paired with X, seed by seed, and differs from it in the policy alone
            [plain] = arm.compare
            assert cfg.to_dict() | {"generation": None} == experiment.arm_config(
                next(a for a in experiment.arms if a.name == plain), 0, Path(".")).to_dict() | {"generation": None}


@pytest.mark.parametrize("dataset", DATASETS)
@pytest.mark.parametrize("federation", FEDERATIONS, ids=("K20", "K100"))
@pytest.mark.parametrize("alpha", ALPHAS)
def test_every_setting_splits_the_full_training_set(dataset: str, federation: tuple[int, float, int], alpha: float) -> None:
    overrides = [*federation_overrides(*federation), f"data.alpha={alpha}"]
    classes = NUM_CLASSES[dataset]
    labels = np.repeat(np.arange(classes), 50_000 // classes)  # CIFAR's training labels: balanced, 50,000
    if (dataset, federation[0], alpha) == ("cifar10", 100, 0.05):
        # 10 classes over 100 clients at alpha 0.05: no draw in 1,000 gives every client 10 images (docs/experiments.md)
        experiment = load_experiment(CONFIGS / f"paper-{dataset}.toml", overrides)
        cfg = experiment.arm_config(experiment.arms[0], 0, Path("."))
        with pytest.raises(ConfigError, match=r"data\.clients=100, data\.min_size=10, data\.alpha=0\.05"):
            partition_for(cfg.data, 0, labels)
        overrides.append("data.min_size=2")
    experiment = load_experiment(CONFIGS / f"paper-{dataset}.toml", overrides)
    for seed in (0, 1, 2):
        cfg: RunConfig = experiment.arm_config(experiment.arms[0], seed, Path("."))
        shards = partition_for(cfg.data, seed, labels)
        assert len(shards) == federation[0] and sum(len(s) for s in shards) == len(labels)
        assert min(len(s) for s in shards) >= cfg.data.min_size


def cifar_shaped(folder: Path, classes: int, train: int, test: int) -> Path:
    rng = np.random.default_rng(0)
    folder.mkdir()
    for split, n in (("train", train), ("test", test)):
        y = np.repeat(np.arange(classes), n // classes)
        np.savez(folder / f"{split}.npz", x=rng.integers(0, 256, (len(y), 32, 32, 3), dtype=np.uint8), y=y)
    return folder


def test_an_arm_runs_a_round_of_resnet18_on_a_cpu(tmp_path: Path) -> None:
    """One round, one local step of batch 16 on 5,000 random CIFAR-shaped images, the holdout backend standing in for
    the DDPM: the paper's arm starts on a CPU (K = 20 in four nodes of 5; every arm of paper-cifar100.toml ran once at
    K = 100 in four nodes of 25, docs/experiments.md)."""
    dataset, arm, federation = "cifar100", "fedgen-fedeas", FEDERATIONS[0]
    data = cifar_shaped(tmp_path / "data", NUM_CLASSES[dataset], train=5_000, test=200)
    smoke = [*federation_overrides(*federation), f"data.data_dir={json.dumps(str(data))}", "data.holdout_fraction=0.2",
             "generation.backend=holdout", "train.rounds=1", "train.max_steps=1", "train.batch_size=16",
             "runtime.round_timeout_s=300", "generation.evaluate_per_class=0"]  # no judge for random pixels
    experiment = load_experiment(CONFIGS / f"paper-{dataset}.toml", smoke)
    out = tmp_path / "run"
    cfg = experiment.arm_config(next(a for a in experiment.arms if a.name == arm), 0, out)
    write_run_toml(cfg, tmp_path / "arm.toml")
    done = subprocess.run([sys.executable, "-m", "fedsynth.cli", "run", "--config", str(tmp_path / "arm.toml"), "--no-progress"],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    [round_1] = report["rounds"]
    sampled = round(federation[0] * federation[1])
    assert (report["config"]["train"]["model"], report["config"]["train"]["algorithm"]) == ("resnet18", arm.removesuffix("-fedeas"))
    assert len(round_1["participants"]) == sampled and report["generation"]["total_images"] > 0
    assert report["generation"]["quality"] is None  # generation.evaluate_per_class = 0: not scored
