"""A run that used a generator reports the judge's figures for it, computed once per generator and then cached."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from deploy.generator_quality import cache_key
from fedsynth.config import load_config

RUN = ["data.clients=3", "runtime.clients_per_process=3", "train.rounds=1", "train.local_epochs=1",
       "generation.backend=holdout", "data.holdout_fraction=0.2"]


def run(tmp_path: Path, name: str, *extra: str) -> dict:
    out = tmp_path / name
    command = [sys.executable, "-m", "fedsynth.cli", "run", "--out-dir", str(out), "--no-progress"]
    for item in [*RUN, *extra]:
        command += ["--set", item]
    env = {**os.environ, "FEDSYNTH_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "report.json").read_text())


def test_the_holdout_generator_is_scored_near_the_judges_accuracy_once_then_from_the_cache(tmp_path: Path) -> None:
    first = run(tmp_path, "first")["generation"]
    quality = first["quality"]
    assert quality["cached"] is False and quality["backend"] == "holdout" and quality["n_images"] == 500
    # real held-out images: the ceiling, recognized about as well as the judge recognizes the real test set
    assert quality["recognizability"] > 0.9 and quality["judge_test_accuracy"] > 0.9 and quality["cas"] > 0.8
    assert len(quality["per_class_recognizability"]) == 10 and quality["frechet"] >= 0
    assert first["generator"]["images_total"] == first["total_images"]  # scoring's images are not the run's
    assert (tmp_path / "first" / "plots" / "generator-grid.png").stat().st_size > 1000
    assert "## Generator quality" in (tmp_path / "first" / "report.md").read_text()

    again = run(tmp_path, "again")["generation"]["quality"]
    assert (again["cached"], again["seconds"], quality["seconds"] > 0) == (True, 0.0, True)
    assert {k: v for k, v in again.items() if k not in ("cached", "seconds")} == {
        k: v for k, v in quality.items() if k not in ("cached", "seconds")}
    assert (tmp_path / "again" / "plots" / "generator-grid.png").is_file()


def test_scoring_the_generator_is_not_part_of_a_runs_identity() -> None:
    """A checkpoint resumes whatever generation.evaluate_per_class says: the default fingerprint is the one from
    before the key existed."""
    fingerprints = {load_config(None, [f"generation.evaluate_per_class={n}"]).fingerprint() for n in (0, 2, 50)}
    assert fingerprints == {"a131c5ba3d48046d"}


def test_the_figures_are_cached_per_generator_device_and_dtype() -> None:
    cfg = load_config(None, [])
    served = {"backend": "ddpm", "model_id": "digits-tiny-s10-w0", "device": "cpu", "dtype": "float32"}
    assert cache_key(cfg, served) == cache_key(cfg, dict(served))
    others = [{**served, "device": "cuda", "dtype": "float16"}, {**served, "dtype": "bfloat16"},
              {**served, "model_id": "digits-tiny-s20-w0"}]
    assert len({cache_key(cfg, served), *(cache_key(cfg, other) for other in others)}) == 4
