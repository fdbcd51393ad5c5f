"""Federated evaluation: a client's test counts (the only thing it sends), its local test split, and the round's figures
computed from every client's counts."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedsynth.learning.hardware import to_device
from fedsynth.learning.training import TrainData

# The local test fraction used when train.evaluation is federated or both and data.local_test_fraction is left at 0.
DEFAULT_LOCAL_TEST_FRACTION = 0.2
P10 = 10  # the low percentile reported beside the worst client


@dataclass(frozen=True)
class EvaluationCounts:
    """What one client reports for one round: counts over its local test examples, no example and no prediction."""

    examples: int
    correct: int
    loss_sum: float  # summed cross-entropy (nats) over the examples
    class_correct: tuple[int, ...]  # per class of the run, in label order
    class_total: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.class_correct) != len(self.class_total):
            raise ValueError(f"{len(self.class_correct)} per-class correct counts for {len(self.class_total)} class totals")
        if any(c < 0 or c > t for c, t in zip(self.class_correct, self.class_total)):
            raise ValueError(f"per-class correct counts {list(self.class_correct)} exceed or undercut totals {list(self.class_total)}")
        if sum(self.class_total) != self.examples or sum(self.class_correct) != self.correct:
            raise ValueError(f"per-class counts sum to {sum(self.class_correct)}/{sum(self.class_total)}, "
                             f"not correct/examples {self.correct}/{self.examples}")
        if not np.isfinite(self.loss_sum) or self.loss_sum < 0:
            raise ValueError(f"loss_sum must be a finite number >= 0, got {self.loss_sum!r}")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "class_correct": list(self.class_correct), "class_total": list(self.class_total)}


def count_predictions(model: nn.Module, data: TrainData, num_classes: int, batch_size: int = 512) -> EvaluationCounts:
    """`model`'s counts on `data` in eval mode, on the model's device (a client's model stays on train.device between
    rounds); restores the previous mode."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    loss_sum = 0.0
    class_correct = torch.zeros(num_classes, dtype=torch.int64)
    class_total = torch.zeros(num_classes, dtype=torch.int64)
    with torch.inference_mode():
        for start in range(0, len(data), batch_size):
            x, y = data.x[start : start + batch_size], data.y[start : start + batch_size]
            logits = model(to_device(x, device)).float().cpu()
            loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
            class_total += torch.bincount(y, minlength=num_classes)
            class_correct += torch.bincount(y[logits.argmax(dim=1) == y], minlength=num_classes)
    model.train(was_training)
    totals, corrects = tuple(int(v) for v in class_total), tuple(int(v) for v in class_correct)
    return EvaluationCounts(sum(totals), sum(corrects), loss_sum, corrects, totals)


def held_out_indices(num_examples: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) positions of a shard: round(fraction * N) examples drawn by `seed` for testing (at least one, and
    one left to train on, when fraction > 0 and N >= 2), both in their original order. fraction 0: all train."""
    if fraction <= 0 or num_examples < 2:
        return np.arange(num_examples), np.arange(0)
    size = min(max(1, round(fraction * num_examples)), num_examples - 1)
    test = np.sort(np.random.default_rng(seed).choice(num_examples, size=size, replace=False))
    return np.setdiff1d(np.arange(num_examples), test), test


def summarize_round(round_number: int, counts: dict[int, EvaluationCounts], *, sampled: list[int]) -> dict[str, Any]:
    """The round's federated figures from its clients' counts (clients without test examples are listed but not ranked).

    weighted_accuracy: sum of correct / sum of examples (each client weighted by its test examples);
    mean_accuracy: the unweighted mean of the clients' accuracies; worst: the lowest (ties: the lower id);
    p10: the 10th percentile of the clients' accuracies (numpy's linear interpolation); spread: best - worst;
    per_class_recall: per class, correct / examples of that class summed over clients (None where no client has one)."""
    ranked = {cid: c.correct / c.examples for cid, c in sorted(counts.items()) if c.examples > 0}
    examples = sum(c.examples for c in counts.values())
    accuracies = np.array(list(ranked.values()), dtype=np.float64)
    worst = min(ranked, key=lambda cid: (ranked[cid], cid)) if ranked else None
    num_classes = max((len(c.class_total) for c in counts.values()), default=0)
    class_total = np.zeros(num_classes, dtype=np.int64)
    class_correct = np.zeros(num_classes, dtype=np.int64)
    for c in counts.values():
        class_total += np.asarray(c.class_total, dtype=np.int64)
        class_correct += np.asarray(c.class_correct, dtype=np.int64)
    return {
        "round": round_number,
        "sampled": sorted(sampled),
        "clients": len(counts),
        "examples": examples,
        "weighted_accuracy": sum(c.correct for c in counts.values()) / examples if examples else None,
        "loss": sum(c.loss_sum for c in counts.values()) / examples if examples else None,
        "mean_accuracy": float(accuracies.mean()) if ranked else None,
        "worst_accuracy": ranked[worst] if worst is not None else None,
        "worst_client": worst,
        "best_accuracy": float(accuracies.max()) if ranked else None,
        "p10_accuracy": float(np.percentile(accuracies, P10)) if ranked else None,
        "spread": float(accuracies.max() - accuracies.min()) if ranked else None,
        "per_client": {str(cid): {"accuracy": ranked.get(cid), "examples": c.examples, "correct": c.correct,
                                  "loss_sum": c.loss_sum, "class_correct": list(c.class_correct),
                                  "class_total": list(c.class_total)}
                       for cid, c in sorted(counts.items())},
        "per_class_recall": [int(k) / int(n) if n else None for k, n in zip(class_correct, class_total)],
    }
