"""Stops diffusion training whose loss has gone non-finite or back to ~1, the loss of a UNet that predicts no noise."""

from __future__ import annotations

import math
from dataclasses import dataclass

from fedsynth.errors import FedsynthError

# The noise is N(0, 1), so a UNet that outputs zeros scores an MSE of 1.0: a loss back near it means collapse
# (docs/generator.md: `half` at lr 2e-3 fell to 0.14, then saved weights that scored 1.01).
COLLAPSED_LOSS = 0.9
SMOOTHING = 0.98
# Healthy runs measured here are below 0.2 by step 200 (tiny and half on digits); a run still at ~1 this long after
# warmup is not learning, and hours of GPU time should not wait for the end to say so.
STALLED_AFTER_STEPS = 1000


class TrainingDiverged(FedsynthError):
    """The training loss says the weights are broken; the message names the step, the loss and what to change."""


@dataclass
class LossGuard:
    """Feeds on each step's loss; `check` returns why training should stop, or None."""

    warmup_steps: int
    smoothed: float | None = None
    lowest: float = math.inf

    def check(self, step: int, loss: float) -> str | None:
        if not math.isfinite(loss):
            return f"the loss is {loss} at step {step + 1}"
        self.smoothed = loss if self.smoothed is None else SMOOTHING * self.smoothed + (1 - SMOOTHING) * loss
        self.lowest = min(self.lowest, self.smoothed)
        if step < self.warmup_steps:
            return None
        if self.lowest <= COLLAPSED_LOSS / 2 and self.smoothed >= COLLAPSED_LOSS:
            return (f"the smoothed loss fell to {self.lowest:.3f}, then rose back to {self.smoothed:.3f} by step "
                    f"{step + 1}: the UNet has collapsed to predicting no noise (a loss of 1.0)")
        if step >= self.warmup_steps + STALLED_AFTER_STEPS and self.lowest >= COLLAPSED_LOSS:
            return (f"the smoothed loss is still {self.smoothed:.3f} at step {step + 1}, {STALLED_AFTER_STEPS} steps "
                    f"after warmup: the UNet is not learning to predict the noise")
        return None
