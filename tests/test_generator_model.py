"""UNet sizes, the generator folder, batch-independent DDIM sampling, and training with exact resume."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedsynth.cli import main as fedsynth_main
from fedsynth.errors import ConfigError
from generator_service.ddpm.model import (
    GeneratorMetadata,
    build_unet,
    load_generator,
    make_train_scheduler,
    parameter_count,
    read_metadata,
    save_generator,
)
from generator_service.ddpm.sampling import DdimSampler, ImageKey, SamplingConfig
from generator_service.ddpm.training import TrainConfig, read_optimizer_state, train_generator


def test_sizes_have_the_documented_parameter_counts() -> None:
    assert parameter_count(build_unet("tiny", num_classes=10, image_shape=(1, 8, 8))) < 1_000_000
    assert parameter_count(build_unet("small", num_classes=10, image_shape=(3, 32, 32))) == 2_737_507
    assert 8_000_000 < parameter_count(build_unet("half", num_classes=10, image_shape=(3, 32, 32))) < 10_000_000
    full = parameter_count(build_unet("ddpm-cifar", num_classes=10, image_shape=(3, 32, 32)))
    assert abs(full - 35.7e6) < 0.1e6


def test_bad_size_and_shape_are_named() -> None:
    with pytest.raises(ConfigError, match="'huge'"):
        build_unet("huge", num_classes=10, image_shape=(1, 8, 8))
    with pytest.raises(ConfigError, match="divisible by 8, got 12x12"):
        build_unet("half", num_classes=10, image_shape=(3, 12, 12))


def test_folder_round_trip_keeps_weights_and_metadata(tmp_path: Path) -> None:
    unet = build_unet("tiny", num_classes=4, image_shape=(1, 8, 8), seed=3)
    meta = save_generator(tmp_path, unet, make_train_scheduler(),
                          GeneratorMetadata("digits", 4, (1, 8, 8), "tiny", training_steps=7, guidance=2.0, ddim_steps=5))
    loaded = load_generator(tmp_path)
    assert loaded.metadata == meta == read_metadata(tmp_path)
    assert meta.model_id.startswith("ddpm-tiny-digits-") and meta.parameters == parameter_count(unet)
    for (name, a), (_, b) in zip(unet.state_dict().items(), loaded.unet.state_dict().items()):
        assert torch.equal(a, b), name
    assert loaded.scheduler_config["num_train_timesteps"] == 1000
    with pytest.raises(ConfigError, match="fedsynth_generator.json is missing"):
        read_metadata(tmp_path / "nowhere")
    wrong = tmp_path / "wrong"
    save_generator(wrong, unet, make_train_scheduler(),
                   GeneratorMetadata("cifar10", 4, (3, 8, 8), "tiny", training_steps=7, guidance=2.0, ddim_steps=5))
    with pytest.raises(ConfigError, match=r"takes 1 channels at 8 pixels, but the metadata says image shape \(3, 8, 8\)"):
        load_generator(wrong)


def test_an_image_does_not_depend_on_what_shares_its_batch() -> None:
    unet = build_unet("tiny", num_classes=10, image_shape=(1, 8, 8), seed=0)
    sampler = DdimSampler(unet, dict(make_train_scheduler().config), num_classes=10, image_shape=(1, 8, 8),
                          config=SamplingConfig(steps=3, guidance=1.5, batch_size=12), device=torch.device("cpu"))
    key = ImageKey(seed=11, class_id=4, index=2)
    alone = sampler.sample([key])
    others = [ImageKey(5, c, i) for c in range(3) for i in range(3)]
    crowded = sampler.sample(others[:4] + [key] + others[4:])
    assert alone[0].tobytes() == crowded[4].tobytes()
    assert sampler.sample([ImageKey(11, 4, 3)])[0].tobytes() != alone[0].tobytes()


def _micro(out: Path, steps: int, **overrides: object) -> TrainConfig:
    settings: dict[str, object] = {"dataset": "digits", "out": out, "steps": steps, "batch_size": 8,
                                   "checkpoint_every": 2, "grid_per_class": 0, "ddim_steps": 2, "progress": False,
                                   "device": "cpu", "warmup_steps": 1, **overrides}
    return TrainConfig(**settings)  # type: ignore[arg-type]


def test_resumed_training_equals_an_uninterrupted_run(tmp_path: Path) -> None:
    straight = train_generator(_micro(tmp_path / "straight", steps=4))
    train_generator(_micro(tmp_path / "resumed", steps=2))
    with pytest.raises(ConfigError, match="already holds a trained generator"):
        train_generator(_micro(tmp_path / "resumed", steps=4))
    resumed = train_generator(_micro(tmp_path / "resumed", steps=4, resume=True))
    assert read_metadata(straight).model_id == read_metadata(resumed).model_id  # content hash of the weights
    assert read_metadata(resumed).training_steps == 4
    assert [p.name for p in (resumed / "checkpoints").iterdir()] == ["step-00000004"]
    with pytest.raises(ConfigError, match="trained with"):
        train_generator(_micro(tmp_path / "resumed", steps=6, resume=True, seed=1))


def test_checkpoints_hold_no_pickle_and_older_pickled_optimizer_state_still_resumes(tmp_path: Path) -> None:
    straight = train_generator(_micro(tmp_path / "straight", steps=4))
    train_generator(_micro(tmp_path / "legacy", steps=2))
    checkpoint = tmp_path / "legacy" / "checkpoints" / "step-00000002"
    assert sorted(p.name for p in checkpoint.iterdir()) == ["ema", "optimizer.safetensors", "state.json", "unet"]
    # a checkpoint of the format before 2026-12-06: the same AdamW state, pickled by torch.save
    state = read_optimizer_state(checkpoint)
    torch.save(state, checkpoint / "optimizer.pt")
    (checkpoint / "optimizer.safetensors").unlink()
    resumed = train_generator(_micro(tmp_path / "legacy", steps=4, resume=True))
    assert read_metadata(straight).model_id == read_metadata(resumed).model_id


def test_train_command_writes_a_servable_folder_and_a_grid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "gen"
    code = fedsynth_main(["generator", "train", "--dataset", "digits", "--size", "tiny", "--steps", "2",
                          "--batch-size", "8", "--out", str(out), "--ddim-steps", "2", "--guidance", "0.5",
                          "--grid-per-class", "3", "--no-progress", "--threads", "1"])
    assert code == 0
    meta = json.loads((out / "fedsynth_generator.json").read_text())
    assert (meta["dataset"], meta["num_classes"], meta["image_shape"], meta["size"]) == ("digits", 10, [1, 8, 8], "tiny")
    assert (meta["training_steps"], meta["guidance"], meta["ddim_steps"], meta["extra"]["label_dropout"]) == (2, 0.5, 2, 0.1)
    grid = np.asarray(Image.open(out / "samples.png"))
    assert grid.shape == (10 * 36, 3 * 36)  # a row per class; 8x8 cells + a 1-pixel gap, scaled by 4
    assert fedsynth_main(["generator", "train", "--dataset", "digits", "--out", str(out), "--steps", "0"]) == 1
    assert "fedsynth generator train: error: steps must be >= 1, got 0" in capsys.readouterr().err


def test_the_default_learning_rate_is_the_sizes_and_the_launcher_names_it_in_new_cache_folders(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from deploy.generator_setup import default_model_dir
    from fedsynth.config import from_dict
    from fedsynth.config_schema import GENERATOR_TRAIN_LR
    from generator_service.ddpm.model import SIZES

    assert set(GENERATOR_TRAIN_LR) == set(SIZES)
    # At 2e-3 `half` collapsed on digits (docs/generator.md); the DDPM-CIFAR layouts default to Ho et al.'s 2e-4.
    assert [TrainConfig(dataset="digits", out=tmp_path, size=size).lr for size in ("tiny", "small", "half", "ddpm-cifar")] \
        == [2e-3, 2e-3, 2e-4, 2e-4]
    assert TrainConfig(dataset="digits", out=tmp_path, size="half", lr=1e-3).lr == 1e-3
    out = tmp_path / "half"
    assert fedsynth_main(["generator", "train", "--dataset", "digits", "--size", "half", "--steps", "1", "--batch-size", "4",
                          "--out", str(out), "--grid-per-class", "0", "--no-progress", "--threads", "1"]) == 0
    assert json.loads((out / "fedsynth_generator.json").read_text())["extra"]["lr"] == 2e-4
    # The launcher's train-on-first-use folder: tiny's name is the one cached before (still found); a half model cached
    # before, trained at 2e-3, is not picked up.
    monkeypatch.setenv("FEDSYNTH_CACHE", str(tmp_path))
    names = [default_model_dir(from_dict({"generation": {"size": size}})).name for size in ("tiny", "half")]
    assert names == ["digits-tiny-1500steps-seed0", "digits-half-1500steps-seed0-lr0.0002"]
