"""The default CPU recipe (tiny UNet, digits), cut to 300 of its 1,500 steps, makes images a classifier trained on real
digits recognizes."""

from __future__ import annotations

from pathlib import Path

import pytest

from generator_service.ddpm.quality import classifier_check
from generator_service.ddpm.training import TrainConfig, train_generator


@pytest.mark.slow
def test_tiny_generator_trained_on_digits_draws_recognizable_digits(tmp_path: Path) -> None:
    # 300 steps already give 0.999 recognizability (docs/results/generator-runs.md, "Evaluate") in a fifth of the full recipe's time.
    # The check runs on one torch and one BLAS thread (tests/conftest.py): on the default threads of a busy 2-core
    # machine its sampler and logistic regression took 78 s of CPU time, on one 3.5 s.
    folder = train_generator(TrainConfig(dataset="digits", out=tmp_path / "gen", size="tiny", device="cpu", steps=300,
                                         threads=1, progress=False))
    report = classifier_check(folder, per_class=50, seed=1)
    assert report.real_test_accuracy > 0.9  # the judge itself is competent
    assert report.generated_accuracy > 0.9, report
    assert min(report.per_class_accuracy) > 0.7, report
