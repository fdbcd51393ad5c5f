"""Generator training stops, with a message that names the lr, on a loss that goes non-finite or back to ~1."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from fedsynth.cli import main as fedsynth_main
from generator_service.ddpm.loss_guard import STALLED_AFTER_STEPS, LossGuard, TrainingDiverged
from generator_service.ddpm.training import TrainConfig, train_generator


def _first_stop(losses: list[float], warmup_steps: int = 100) -> tuple[int, str] | None:
    guard = LossGuard(warmup_steps=warmup_steps)
    for step, loss in enumerate(losses):
        why = guard.check(step, loss)
        if why:
            return step, why
    return None


def _curve(points: list[tuple[int, float]]) -> list[float]:
    """A per-step loss curve through (step, loss) points, linear in between."""
    losses: list[float] = []
    for (a, la), (b, lb) in zip(points, points[1:]):
        losses += [la + (lb - la) * (s - a) / (b - a) for s in range(a, b)]
    return losses


def test_healthy_and_slow_runs_are_not_stopped() -> None:
    # tiny on digits at 2e-3 and at 0.1 (learning slowly), as measured every 20 steps; then a long healthy tail
    healthy = _curve([(0, 1.02), (20, 0.19), (100, 0.14), (300, 0.10), (3000, 0.06)])
    slow = _curve([(0, 1.02), (60, 1.08), (100, 0.92), (300, 0.62), (3000, 0.30)])
    assert _first_stop(healthy) is None
    assert _first_stop(slow) is None


def test_a_loss_back_near_one_after_falling_is_a_collapse() -> None:
    collapsed = _curve([(0, 1.0), (200, 0.14), (400, 0.14), (450, 1.01), (1000, 1.01)])
    stop = _first_stop(collapsed)
    assert stop is not None and 400 < stop[0] < 1000
    assert "collapsed to predicting no noise" in stop[1] and "fell to 0.1" in stop[1]


def test_a_loss_that_never_falls_stops_after_the_stall_window() -> None:
    stop = _first_stop([1.0] * 3000, warmup_steps=100)
    assert stop is not None and stop[0] == 100 + STALLED_AFTER_STEPS
    assert "not learning" in stop[1]


def test_a_non_finite_loss_stops_at_once_even_in_warmup() -> None:
    stop = _first_stop([1.0, 0.9, math.nan], warmup_steps=100)
    assert stop is not None and stop[0] == 2 and "nan at step 3" in stop[1]


def test_train_command_stops_a_diverging_run_without_saving_broken_weights(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "gen"
    code = fedsynth_main(["generator", "train", "--dataset", "digits", "--size", "tiny", "--steps", "6",
                          "--batch-size", "8", "--lr", "1e20", "--warmup-steps", "1", "--checkpoint-every", "1",
                          "--out", str(out), "--grid-per-class", "0", "--no-progress", "--threads", "1",
                          "--device", "cpu"])
    assert code == 1
    err = capsys.readouterr().err
    assert "at lr 1e+20" in err and "give a loss of nan" in err and "lower --lr" in err
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
    assert not (out / "fedsynth_generator.json").exists()


def test_a_diverged_run_resumes_from_its_last_checkpoint_with_a_lower_lr(tmp_path: Path) -> None:
    settings: dict[str, object] = {"dataset": "digits", "out": tmp_path / "gen", "batch_size": 8, "grid_per_class": 0,
                                   "ddim_steps": 2, "progress": False, "device": "cpu", "warmup_steps": 1,
                                   "checkpoint_every": 2, "threads": 1}
    train_generator(TrainConfig(steps=2, **settings))  # type: ignore[arg-type]
    with pytest.raises(TrainingDiverged, match=r"--resume from the last checkpoint, .*step-00000002"):
        train_generator(TrainConfig(steps=6, lr=1e20, resume=True, **settings))  # type: ignore[arg-type]
    assert [p.name for p in (tmp_path / "gen" / "checkpoints").iterdir()] == ["step-00000002"]
    folder = train_generator(TrainConfig(steps=4, resume=True, **settings))  # type: ignore[arg-type]
    assert (folder / "fedsynth_generator.json").exists()
