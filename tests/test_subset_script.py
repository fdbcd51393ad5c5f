"""scripts/subset_dataset.py: a seeded, class-stratified subset that a run reads as its data_dir."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from fedsynth.learning.data import load_dataset

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "subset_dataset.py"


def write_dataset(folder: Path) -> None:
    folder.mkdir()
    rng = np.random.default_rng(0)
    for split, per_class in (("train", 40), ("test", 20)):
        y = np.repeat(np.arange(3, dtype=np.uint8), per_class)
        np.savez_compressed(folder / f"{split}.npz", x=rng.integers(0, 256, (len(y), 4, 4, 3), dtype=np.uint8), y=y)


def subset(source: Path, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, str(SCRIPT), "--data-dir", str(source), "--out", str(out), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


def test_each_class_keeps_its_share_and_the_seed_fixes_which(tmp_path: Path) -> None:
    write_dataset(tmp_path / "full")
    assert subset(tmp_path / "full", tmp_path / "a", "--train-fraction", "0.25", "--test-fraction", "0.5").returncode == 0
    assert subset(tmp_path / "full", tmp_path / "b", "--train-fraction", "0.25", "--test-fraction", "0.5").returncode == 0
    assert subset(tmp_path / "full", tmp_path / "c", "--train-fraction", "0.25", "--seed", "1").returncode == 0
    full = load_dataset("npz", "train", data_dir=tmp_path / "full")
    a, b, c = (load_dataset("npz", "train", data_dir=tmp_path / name) for name in "abc")
    assert np.bincount(a.y).tolist() == [10, 10, 10]
    assert np.bincount(load_dataset("npz", "test", data_dir=tmp_path / "a").y).tolist() == [10, 10, 10]
    assert np.bincount(load_dataset("npz", "test", data_dir=tmp_path / "c").y).tolist() == [20, 20, 20]
    assert np.array_equal(a.x, b.x) and not np.array_equal(a.x, c.x)
    # every kept image is an image of the source with its own label
    rows = {full.x[i].tobytes(): int(full.y[i]) for i in range(len(full.y))}
    assert all(rows[a.x[i].tobytes()] == int(a.y[i]) for i in range(len(a.y)))
    assert json.loads((tmp_path / "a" / "subset.json").read_text())["counts"]["train"]["images"] == 30


def test_a_fraction_outside_zero_to_one_is_named(tmp_path: Path) -> None:
    write_dataset(tmp_path / "full")
    result = subset(tmp_path / "full", tmp_path / "out", "--train-fraction", "1.5")
    assert result.returncode == 2 and "--train-fraction must be in (0, 1], got 1.5" in result.stderr
    assert not (tmp_path / "out").exists()
    result = subset(tmp_path / "full", tmp_path / "full", "--train-fraction", "0.5")
    assert result.returncode == 2 and "the subset would overwrite its source" in result.stderr
    result = subset(tmp_path / "nowhere", tmp_path / "out", "--train-fraction", "0.5")
    assert result.returncode == 2 and f"no such file: {tmp_path / 'nowhere' / 'train.npz'}" in result.stderr


def test_the_public_folder_holds_exactly_the_training_images_the_subset_left_out(tmp_path: Path) -> None:
    write_dataset(tmp_path / "full")
    done = subset(tmp_path / "full", tmp_path / "sub", "--train-fraction", "0.25", "--test-fraction", "0.5",
                  "--public-out", str(tmp_path / "public"))
    assert done.returncode == 0, done.stderr
    full, sub, public = (load_dataset("npz", "train", data_dir=tmp_path / name) for name in ("full", "sub", "public"))
    kept = {row.tobytes() for row in sub.x}
    left_out = {row.tobytes() for row in public.x}
    assert not kept & left_out and kept | left_out == {row.tobytes() for row in full.x}
    assert np.bincount(public.y).tolist() == [30, 30, 30]
    # the public folder is judged on the subset's own test images
    assert (tmp_path / "public" / "test.npz").read_bytes() == (tmp_path / "sub" / "test.npz").read_bytes()
    label = json.loads((tmp_path / "public" / "public.json").read_text())
    assert "90 images" in label["public_data"] and "disjoint from every client's shard" in label["relation_to_clients"]
    for bad in ("sub", "full"):  # the public folder must not overwrite the subset or its source
        refused = subset(tmp_path / "full", tmp_path / "sub", "--train-fraction", "0.25", "--public-out", str(tmp_path / bad))
        assert refused.returncode == 2 and f"--public-out {tmp_path / bad} must be a folder of its own" in refused.stderr
    refused = subset(tmp_path / "full", tmp_path / "all", "--train-fraction", "1", "--public-out", str(tmp_path / "p2"))
    assert refused.returncode == 2 and "--public-out needs --train-fraction below 1" in refused.stderr
