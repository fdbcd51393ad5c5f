"""Bounded updates (runtime.max_update_norm): how far a client's update moves the global model, and the verdict on one
that moves it further than the bound: scaled down onto it ("clip") or left out of the round ("refuse").

The norm is the L2 norm, accumulated in float64, of every floating-point tensor the update carries as a difference from
the round's global model: the model's weights and floating-point buffers (BatchNorm's running statistics) minus the
global ones (an update sent as float16 / bfloat16 deltas is that difference already), plus the algorithm's extra
tensors, which are differences too (SCAFFOLD's delta c_i). Integer buffers (num_batches_tracked) are left out of the
norm and bounded on their own: a counter of local steps never moves backwards, and no honest round advances it by
MAX_INTEGER_STEP (which keeps it exact, below 2**53, in the float64 fold for two million rounds).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any
from dataclasses import dataclass

import torch

from fedsynth.config import RuntimeConfig
from fedsynth.errors import WireError

StateDict = dict[str, torch.Tensor]
MAX_INTEGER_STEP = 1 << 32  # the most an integer buffer may advance in one round (a round of 2**32 local batches: never)


def update_norm(state: StateDict, extra: StateDict, global_state: StateDict, *, deltas: bool) -> float:
    """The L2 distance the update moves the global model (see the module docstring for what it covers); WireError naming
    the tensor when an integer buffer moves backwards or advances by more than MAX_INTEGER_STEP."""
    squares = 0.0
    with torch.no_grad():
        for key, value in state.items():
            if not value.is_floating_point():
                check_integer_step(key, value, global_state[key])
            else:
                difference = value if deltas else value - global_state[key].to(value.device, value.dtype)
                squares += float(torch.linalg.vector_norm(difference, dtype=torch.float64)) ** 2
        for value in extra.values():
            if value.is_floating_point():
                squares += float(torch.linalg.vector_norm(value, dtype=torch.float64)) ** 2
    return math.sqrt(squares)


def check_integer_step(key: str, value: torch.Tensor, global_value: torch.Tensor) -> None:
    """An integer buffer (absolute, also in a delta update) may only advance, by at most MAX_INTEGER_STEP."""
    step = value.to("cpu", torch.int64) - global_value.to("cpu", torch.int64)
    if step.numel() and int(step.min()) < 0:
        raise WireError(f"integer buffer {key!r} moves backwards, from {int(global_value.flatten()[int(step.argmin())])} to "
                        f"{int(value.flatten()[int(step.argmin())])}: refused (runtime.max_update_norm)")
    if step.numel() and int(step.max()) > MAX_INTEGER_STEP:
        raise WireError(f"integer buffer {key!r} advances by {int(step.max())} in one round, more than {MAX_INTEGER_STEP}: "
                        "refused (runtime.max_update_norm)")


@dataclass(frozen=True)
class Verdict:
    """What becomes of one update: folded with its floating-point differences times `scale` (1 within the bound, below
    1 clipped onto it), or refused (scale 0)."""

    norm: float
    bound: float
    scale: float

    @property
    def action(self) -> str:
        return "refused" if self.scale == 0 else "clipped" if self.scale < 1 else "accepted"

    def describe(self, client_id: int, round_number: int) -> str:
        return (f"round {round_number}: client {client_id}'s update has L2 norm {self.norm:.4g}, above the bound "
                f"{self.bound:.4g} (runtime.max_update_norm): {self.action}")


# "auto" judges a round's updates against the median of their norms AND of the updates folded in the last rounds: with
# one or two updates a round, a round's own median is its largest update's half or whole, so it would bound nothing.
REFERENCE_ROUNDS = 3


class NormBound:
    """runtime.max_update_norm as the coordinator applies it. A number is checked as each update arrives; "auto" needs
    the round's median, so the round's updates are held (received, not yet folded) until the round closes."""

    def __init__(self, runtime: RuntimeConfig) -> None:
        self.setting = runtime.max_update_norm
        self.factor = runtime.max_update_norm_factor
        self.action = runtime.update_norm_action
        # the norms of the updates folded as sent (neither clipped nor refused) in each of the last rounds: part of
        # "auto"'s median
        self.recent: deque[list[float]] = deque(maxlen=REFERENCE_ROUNDS)

    def remember(self, norms: dict[int, float], left_out: Iterable[int]) -> None:
        """A closed round's norms but those of its clipped or refused updates (`left_out`)."""
        skipped = set(left_out)
        self.recent.append([norm for client, norm in sorted(norms.items()) if client not in skipped])

    def restore(self, history: Sequence[dict[str, Any]]) -> None:
        """The recent norms as the rounds in a resumed run's history left them (each round's `update_norms`)."""
        self.recent.clear()
        for summary in history[-REFERENCE_ROUNDS:]:
            record = summary.get("update_norms") or {}
            self.remember({int(c): n for c, n in record.get("norms", {}).items()}, [*record.get("refused", []), *record.get("clipped", [])])

    @property
    def enabled(self) -> bool:
        return self.setting != 0

    @property
    def auto(self) -> bool:
        return self.setting == "auto"

    def bound(self, norms: Sequence[float] = ()) -> float:
        """The bound: the configured number, or (auto) factor times the median of `norms`, the round's update norms,
        together with the norms folded in the last REFERENCE_ROUNDS rounds."""
        if not self.auto:
            return float(self.setting)
        if not norms:
            raise ValueError("an automatic bound needs the round's update norms")
        return self.factor * statistics.median([*norms, *(norm for past in self.recent for norm in past)])

    def verdict(self, norm: float, bound: float) -> Verdict:
        if norm <= bound:
            return Verdict(norm, bound, 1.0)
        return Verdict(norm, bound, 0.0 if self.action == "refuse" else bound / norm)
