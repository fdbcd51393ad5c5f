"""Any image size, end to end: `fedsynth data split --image-size` writes client folders at that size; `fedsynth run`
refuses a generator of another shape before any process starts; `generator train --data` learns the client folders
at their size; and a FedEAS run over 16x16 digits trains its generator on first use from those folders and has it
judged in report.json."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from deploy.processes import fedsynth_command
from fedsynth.learning.data import load_dataset
from fedsynth.learning.federation_folders import pooled
from fedsynth.learning.label_schema import read_schema_file

CLIENTS = 4


def _split(out: Path, *flags: str) -> dict:
    done = subprocess.run(fedsynth_command("data", "split", "--dataset", "digits", "--clients", str(CLIENTS), "--seed", "1",
                                           *flags, "--out", str(out)), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def folders16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("digits16") / "clients"
    _split(out, "--image-size", "16")
    return out


def _run(out: Path, sets: list[str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    command = fedsynth_command("run", "--out-dir", str(out), "--no-progress")
    for item in sets:
        command += ["--set", item]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def _local(folders: Path) -> list[str]:
    return ['data.source="local"', f"data.local_dir={json.dumps(str(folders))}", f"data.clients={CLIENTS}",
            "data.image_size=16", f"runtime.clients_per_process={CLIENTS}"]


def test_split_writes_the_folders_at_the_asked_size_and_pooling_them_gives_every_training_image(folders16: Path) -> None:
    schema = read_schema_file(folders16 / "schema.toml")
    assert (schema.image_size, schema.channels) == (16, 1)
    first = sorted((folders16 / "client-0" / "train").rglob("*.png"))[0]
    with Image.open(first) as image:
        assert (image.size, image.mode) == ((16, 16), "L")
    train = pooled(folders16, schema, "train")
    assert train.x.shape[1:] == (16, 16, 1) and train.num_classes == 10
    # every image of digits' training split once: the clients' shards cover it
    assert np.array_equal(np.bincount(train.y, minlength=10), np.bincount(load_dataset("digits", "train").y, minlength=10))
    assert len(pooled(folders16, schema, "test").y) == len(load_dataset("digits", "test").y)


def test_split_refuses_an_image_size_it_cannot_write(tmp_path: Path) -> None:
    done = subprocess.run(fedsynth_command("data", "split", "--dataset", "digits", "--clients", "2", "--image-size", "2",
                                           "--out", str(tmp_path / "x")), capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "--image-size must be in 4..1024, got 2" in done.stderr
    assert not (tmp_path / "x").exists()


def test_a_generator_of_another_shape_is_refused_before_any_process_starts(folders16: Path, tiny_generator: Path,
                                                                          tmp_path: Path) -> None:
    started = time.monotonic()
    done = _run(tmp_path / "run", [*_local(folders16), f"generation.model_dir={json.dumps(str(tiny_generator))}"])
    assert done.returncode == 1, done.stderr[-2000:]
    [line] = done.stderr.strip().splitlines()
    assert f"generation.model_dir {str(tiny_generator)!r} makes 1x8x8 images of 10 classes" in line
    assert "data.image_size = 16 and data.channels = 1 (1x16x16, 10 classes)" in line
    assert not (tmp_path / "run").exists() and time.monotonic() - started < 60
    # split mode: the generator trained on first use learns digits' own 8x8 images
    done = _run(tmp_path / "run", ["data.image_size=16"])
    assert done.returncode == 1 and "learns digits's own 1x8x8 images" in done.stderr and "--image-size 16" in done.stderr
    assert not (tmp_path / "run").exists()


def test_generator_train_names_a_folder_without_client_folders(tmp_path: Path) -> None:
    (tmp_path / "none").mkdir()
    done = subprocess.run(fedsynth_command("generator", "train", "--data", str(tmp_path / "none"), "--out", str(tmp_path / "g")),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].endswith("holds no client-<k>/ folders (`fedsynth data split` writes them)")
    assert not (tmp_path / "g").exists()


@pytest.mark.slow
def test_fedeas_over_16x16_folders_trains_its_generator_on_them_and_judges_it(folders16: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    # few synthetic images (beta 1) in few DDIM steps: what is checked is the path, not the images
    sets = [*_local(folders16), "train.rounds=1", "train.local_epochs=1", "generation.train_steps=4",
            "generation.evaluate_per_class=4", "generation.beta=1.0", "generation.ddim_steps=2"]
    done = subprocess.run([*fedsynth_command("run", "--out-dir", str(tmp_path / "run"), "--no-progress"),
                           *(part for item in sets for part in ("--set", item))],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "FEDSYNTH_CACHE": str(cache)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "training the generator on first use" in done.stderr
    [folder] = (cache / "generators").iterdir()
    meta = json.loads((folder / "fedsynth_generator.json").read_text())
    assert meta["image_shape"] == [1, 16, 16] and meta["extra"]["folders"] == str(folders16)
    assert "step 4/4 loss" in (tmp_path / "run" / "logs" / "generator-train.log").read_text()  # what the launcher follows
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["success"] and report["generation"]["total_images"] > 0
    quality = report["generation"]["quality"]
    assert "error" not in quality, quality
    # the judge learned the pooled 16x16 client folders: it reads real digits far above chance
    assert quality["judge_test_accuracy"] > 0.8 and quality["n_images"] == 40 and 0 <= quality["recognizability"] <= 1



def test_a_first_use_generator_size_that_cannot_take_the_image_side_is_refused_by_name() -> None:
    from deploy.generator_setup import check_generator_shape
    from fedsynth.config import load_config
    from fedsynth.errors import ConfigError

    local = ['data.source="local"', 'data.local_dir="clients"', "data.image_size=12"]
    with pytest.raises(ConfigError, match=r"generation.size = 'half' \(the UNet trained on first use\) needs data.image_size "
                                          r"divisible by 8, got 12: use generation.size = 'tiny'"):
        check_generator_shape(load_config(None, [*local, 'generation.size="half"']))
    check_generator_shape(load_config(None, [*local, 'generation.size="small"']))  # 12 = 3 x 4: small takes it
    check_generator_shape(load_config(None, [*local, 'generation.size="half"', 'generation.policy="none"']))  # no generator
