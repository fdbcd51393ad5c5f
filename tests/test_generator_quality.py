"""The default CPU recipe (tiny UNet, digits), cut to 300 of its 1,500 steps, makes images a classifier trained on real
digits recognizes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from threadpoolctl import threadpool_limits

from generator_service.ddpm.quality import classifier_check
from generator_service.ddpm.training import TrainConfig, train_generator


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One torch thread and one BLAS thread (scikit-learn's): with the defaults, on 2 busy cores, the threads of
    the check's sampler and of its logistic regression spin against each other and against the other test worker
    (measured: the check took 78 s of CPU time, against 3.5 s on one thread; same images, same figures)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with threadpool_limits(1):
        yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_tiny_generator_trained_on_digits_draws_recognizable_digits(tmp_path: Path, one_thread: None) -> None:
    # 300 steps already give 0.999 recognizability (docs/generator.md, "Evaluate") in a fifth of the full recipe's time.
    folder = train_generator(TrainConfig(dataset="digits", out=tmp_path / "gen", size="tiny", device="cpu", steps=300,
                                         threads=1, progress=False))
    report = classifier_check(folder, per_class=50, seed=1)
    assert report.real_test_accuracy > 0.9  # the judge itself is competent
    assert report.generated_accuracy > 0.9, report
    assert min(report.per_class_accuracy) > 0.7, report
