"""`fedsynth generator evaluate`: the judge scores real held-out digits near its own test accuracy and noise near
chance; the CLI writes the contract's keys; the judge is trained once and then read from its cache; bad input is
one line and exit 1."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fedsynth import cli
from fedsynth.learning.data import load_dataset

ROOT = Path(__file__).resolve().parents[1]
CONTRACT_KEYS = ("recognizability", "per_class_recognizability", "cas", "frechet", "judge_test_accuracy")
FAST = ["--threads", "1", "--per-class", "40"]


@pytest.fixture(scope="module")
def judges(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("judges")


def _evaluate(tmp_path: Path, judges: Path, *flags: str, name: str = "result") -> dict[str, Any]:
    out = tmp_path / f"{name}.json"
    assert cli.main(["generator", "evaluate", *flags, *FAST, "--judge-cache", str(judges), "--json", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def holdout_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("holdout")


@pytest.fixture(scope="module")
def holdout(holdout_dir: Path, judges: Path) -> dict[str, Any]:
    return _evaluate(holdout_dir, judges, "--backend", "holdout", "--dataset", "digits", "--holdout-fraction", "0.2",
                     "--grid", str(holdout_dir / "grid.png"))


def test_holdout_digits_score_near_the_judges_own_accuracy(holdout: dict[str, Any]) -> None:
    assert holdout["judge_test_accuracy"] > 0.95
    assert holdout["recognizability"] > 0.9
    # Real images: near the ceiling (held-out images are training images, so the judge may even beat its test score).
    assert abs(holdout["recognizability"] - holdout["judge_test_accuracy"]) < 0.05, holdout
    assert min(holdout["per_class_recognizability"]) > 0.8
    assert holdout["cas"] > 0.8  # a classifier trained on 40 real images per class
    assert holdout["backend"] == "holdout" and holdout["model_id"].startswith("holdout-digits-f0.2-s0-")
    assert holdout["n_per_class"] == 40 and len(holdout["per_class_frechet"]) == 10


def test_uniform_noise_scores_near_chance_and_far_in_feature_space(tmp_path: Path, judges: Path,
                                                                   holdout: dict[str, Any]) -> None:
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(10), 40)
    np.savez(tmp_path / "noise.npz", x=rng.integers(0, 256, (400, 8, 8, 1), dtype=np.uint8), y=labels)
    noise = _evaluate(tmp_path, judges, "--images", str(tmp_path / "noise.npz"), "--dataset", "digits")
    assert noise["recognizability"] < 0.25, noise["per_class_recognizability"]
    assert noise["cas"] < 0.3  # nothing to learn from noise
    assert noise["frechet"] > 5 * holdout["frechet"], (noise["frechet"], holdout["frechet"])
    assert noise["judge"]["cached"]  # the holdout run trained it; this one read it


def test_the_same_seed_gives_the_same_figures_and_reuses_the_judge(tmp_path: Path, judges: Path,
                                                                  holdout: dict[str, Any]) -> None:
    weights = Path(holdout["judge"]["folder"]) / "weights.safetensors"
    mtime = weights.stat().st_mtime_ns
    again = _evaluate(tmp_path, judges, "--backend", "holdout", "--dataset", "digits", "--holdout-fraction", "0.2")
    assert again["judge"]["cached"] and weights.stat().st_mtime_ns == mtime
    assert again["seconds"]["judge"] < holdout["seconds"]["judge"]
    for key in ("recognizability", "per_class_recognizability", "cas", "frechet", "per_class_frechet", "model_id"):
        assert again[key] == holdout[key], key


def test_the_grid_has_a_row_per_class(holdout: dict[str, Any], holdout_dir: Path) -> None:
    from PIL import Image

    with Image.open(holdout_dir / "grid.png") as grid:  # 10 x 10 cells of 8x8 digits plus a 1-pixel gap, scaled 4x
        assert grid.size == (10 * 9 * 4, 10 * 9 * 4)


def test_cli_from_a_fresh_environment_writes_the_contract(tmp_path: Path) -> None:
    env = {**os.environ, "FEDSYNTH_CACHE": str(tmp_path / "cache")}
    out = tmp_path / "f.json"
    proc = subprocess.run(
        [sys.executable, "-m", "fedsynth.cli", "generator", "evaluate", "--backend", "holdout", "--dataset", "digits",
         "--holdout-fraction", "0.2", "--json", str(out), "--threads", "1", "--per-class", "20"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    for key in CONTRACT_KEYS:
        assert key in result, key
    assert isinstance(result["per_class_recognizability"], list) and len(result["per_class_recognizability"]) == 10
    assert (tmp_path / "cache" / "judges").is_dir()  # FEDSYNTH_CACHE holds the judge
    assert "recognizability" in proc.stdout


@pytest.mark.parametrize(("flags", "message"), [
    (["--backend", "nosuch", "--dataset", "digits"], "unknown generator backend 'nosuch'"),
    (["--backend", "holdout", "--dataset", "digits", "--holdout-fraction", "0.2", "--per-class", "1"], "--per-class must be >= 2"),
    (["--images", "/nonexistent/x.npz", "--dataset", "digits"], "does not exist"),
    (["--dataset", "digits"], "exactly one of --generator, --backend, --images"),
    (["--backend", "ddpm", "--model", "/nonexistent", "--holdout-fraction", "0.2"], "--holdout-fraction is a flag of --backend holdout"),
])
def test_bad_input_is_one_line_and_exit_1(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["generator", "evaluate", *flags]) == 1
    _assert_one_error_line(capsys.readouterr().err, message)


def test_a_missing_data_folder_is_refused_before_any_image_is_drawn(tmp_path: Path, tiny_generator: Path,
                                                                   caplog: pytest.LogCaptureFixture,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The judge's data is checked first: sampling 1,000 CIFAR-10 images takes minutes on a CPU, and they were lost."""
    caplog.set_level(logging.INFO)
    empty = tmp_path / "no-cifar"
    empty.mkdir()
    code = cli.main(["generator", "evaluate", "--backend", "ddpm", "--model", str(tiny_generator), "--dataset", "cifar10",
                     "--data-dir", str(empty), "--threads", "1"])
    assert code == 1
    _assert_one_error_line(capsys.readouterr().err, str(empty))
    assert not [r for r in caplog.records if "serving" in r.getMessage()], "the generator started before the data was checked"


def test_images_with_other_classes_or_shapes_are_refused(tmp_path: Path, judges: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    np.savez(tmp_path / "three.npz", x=np.zeros((6, 8, 8, 1), np.uint8), y=np.repeat(np.arange(3), 2))
    np.savez(tmp_path / "big.npz", x=np.zeros((20, 16, 16, 1), np.uint8), y=np.repeat(np.arange(10), 2))
    np.savez(tmp_path / "one.npz", x=np.zeros((19, 8, 8, 1), np.uint8), y=np.r_[np.repeat(np.arange(9), 2), 9])
    for name, message in (("three", "the images have 3 classes but digits has 10"), ("big", "the images are 1x16x16"),
                          ("one", "every class needs at least 2 images")):
        code = cli.main(["generator", "evaluate", "--images", str(tmp_path / f"{name}.npz"), "--dataset", "digits",
                         "--threads", "1", "--judge-cache", str(judges)])
        assert code == 1
        _assert_one_error_line(capsys.readouterr().err, message)


def _assert_one_error_line(err: str, message: str) -> None:
    errors = [line for line in err.splitlines() if line.startswith("fedsynth generator evaluate: error:")]
    assert "Traceback" not in err and len(errors) == 1 and message in errors[0], err


def test_a_served_generator_gives_the_same_figures_as_the_same_backend_in_process(
        tmp_path: Path, judges: Path, holdout: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    from prometheus_client import CollectorRegistry

    from generator_service import ServeConfig, create_server

    server = create_server(ServeConfig(backend="holdout", dataset="digits", holdout_fraction=0.2, seed=0, metrics_port=-1,
                                       max_request_images=500, queue_limit=500), registry=CollectorRegistry())
    port = server.start()
    server.load()
    try:
        served = _evaluate(tmp_path, judges, "--generator", f"127.0.0.1:{port}", "--insecure")
        for key in ("recognizability", "per_class_recognizability", "cas", "frechet", "model_id", "backend"):
            assert served[key] == holdout[key], key
        code = cli.main(["generator", "evaluate", "--generator", f"127.0.0.1:{port}", "--insecure", "--per-class", "60",
                         "--threads", "1", "--judge-cache", str(judges)])
        assert code == 1  # 600 images > --max-request-images 500: the server's refusal, in one line
        _assert_one_error_line(capsys.readouterr().err, "answered INVALID_ARGUMENT")
    finally:
        server.stop(0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: --judge-device cuda is valid here")
def test_judge_device_cuda_without_a_gpu_is_one_line_and_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["generator", "evaluate", "--backend", "holdout", "--dataset", "digits", "--holdout-fraction", "0.2",
                     "--judge-device", "cuda", "--threads", "1"])
    assert code == 1
    _assert_one_error_line(capsys.readouterr().err, "--judge-device cuda was asked for but torch sees no CUDA device")


def _key_before_judge_device(dataset: str, data_dir: Path | None, seed: int, recipe: Any) -> str:
    """The cache folder name exactly as it was computed before --judge-device existed (no device in the key)."""
    from generator_service.evaluation.judge import FORMAT, _data_digest

    key = {"format": FORMAT, "dataset": dataset, "data_dir": None if data_dir is None else str(Path(data_dir).resolve()),
           "seed": seed, "recipe": dataclasses.asdict(recipe),
           "train_sha256": _data_digest(load_dataset(dataset, "train", data_dir=data_dir))}
    return f"{dataset}-{recipe.model}-seed{seed}-{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]}"


def test_a_cpu_judge_keeps_its_cache_folder_and_a_gpu_judge_gets_another(tmp_path: Path, judges: Path,
                                                                       holdout: dict[str, Any]) -> None:
    from generator_service.evaluation.judge import JUDGE_FILE, _data_digest, default_recipe, judge_key

    recipe = default_recipe(8)
    before = _key_before_judge_device("digits", None, 0, recipe)
    digest = _data_digest(load_dataset("digits", "train"))
    cpu_key, cpu_name = judge_key("digits", data_dir=None, seed=0, recipe=recipe, train_sha256=digest, device="cpu")
    cuda_key, cuda_name = judge_key("digits", data_dir=None, seed=0, recipe=recipe, train_sha256=digest, device="cuda")
    assert cpu_name == before and "device" not in cpu_key  # judges cached before the flag are still found
    assert cuda_name != cpu_name and cuda_key["device"] == "cuda"
    # An explicit --judge-device cpu uses that folder, whose judge.json records the key its name is the hash of.
    again = _evaluate(tmp_path, judges, "--backend", "holdout", "--dataset", "digits", "--holdout-fraction", "0.2",
                      "--judge-device", "cpu")
    folder = Path(again["judge"]["folder"])
    assert again["judge"]["device"] == "cpu" and folder.name == before
    meta = json.loads((folder / JUDGE_FILE).read_text())
    assert meta["key"] == cpu_key
    # What made its bits: another torch or other CPU kernels give another judge from the same recipe and seed.
    assert meta["trained_on"]["device"] == "cpu" and meta["trained_on"]["torch"] == torch.__version__
    assert meta["trained_on"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    if holdout["judge"]["device"] == "cpu":  # auto chose the CPU here: the same judge, read from its cache
        assert again["judge"]["cached"] and holdout["judge"]["folder"] == again["judge"]["folder"]
        assert again["recognizability"] == holdout["recognizability"] and again["cas"] == holdout["cas"]


def test_load_judge_is_the_cached_judge_evaluate_scored_with(judges: Path, holdout: dict[str, Any]) -> None:
    from generator_service import load_judge

    judge = load_judge("digits", cache=judges)
    assert judge.cached and str(judge.folder) == holdout["judge"]["folder"]  # the one `evaluate` trained, not a new one
    test = load_dataset("digits", "test")
    _, probs = judge.score(test.x)
    assert float((probs.argmax(axis=1) == test.y).mean()) == pytest.approx(holdout["judge_test_accuracy"])
