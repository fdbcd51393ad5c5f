"""The quality filter (`--min-confidence`): serves only images the judge assigns to their class with at least that probability.

It wraps whatever backend is loaded, as the batcher's sampling function, so every backend gets it. Image j of class c
for seed s is the first candidate a = 0, 1, 2, ... that the judge accepts, where candidate a is the backend's own image
(s, c, j + a * 2^32): a pure function of (model, judge, min_confidence, s, c, j) whatever the batching, the offsets or
the replica, and an image the judge accepts unfiltered (a = 0) is served unchanged. Only candidates a < MAX_CANDIDATES
are ever drawn: an image whose first MAX_CANDIDATES are all rejected is unservable, which is as pure a function of its
key (never of the other images in its sampling batch).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedsynth.config_schema import DATASETS
from fedsynth.errors import ConfigError, DataError
from fedsynth.learning.training import images_to_tensor
from generator_service.backends import BackendDescription, GeneratorBackend, PartlyUnservable
from generator_service.ddpm.sampling import ImageKey
from generator_service.metrics import GeneratorMetrics

log = logging.getLogger(__name__)
CANDIDATE_STRIDE = 1 << 32  # requested indices stay below 2^32, so no candidate is another image's first draw
# An image may use its candidates a = 0 .. MAX_CANDIDATES - 1, its own whatever else is batched with it: at acceptance
# rate p it is unservable with probability (1 - p)^220 (p = 10%: 1e-10, 5%: 1e-5, 2%: 1%), and an impossible threshold
# costs at most 220 candidates per image.
MAX_CANDIDATES = 220
JUDGE_SEED = 0  # `fedsynth generator evaluate`'s default --seed: the same cached judge
JUDGE_ROWS = 64  # fixed whatever --max-batch, so that servers with other batch sizes judge alike
# `--filter-batches`: the batcher hands the filter this many backend batches of keys at once. A padded backend batch
# costs the same however few rows are pending, so the images a batch rejects are best retried beside fresh keys, not
# in a batch of their own: measured side by side on CIFAR-10 at 71% acceptance, one batch of keys per call drew 2.30
# candidates per served image, eight 1.54, against a floor of 1 / 0.71 = 1.41 (docs/generator.md, "Quality filter").
# The price: a request's first images wait for up to eight batches' candidates, not one.
BATCHES_PER_CALL = 8


class JudgeScorer:
    """The judge's probability for the requested class. It always scores `rows` rows (zero padding), because CPU
    kernels give slightly different floats for different batch sizes while a row never depends on its neighbours."""

    def __init__(self, model: nn.Module, rows: int = JUDGE_ROWS) -> None:
        self.model = model.eval()
        self.rows = rows

    @torch.inference_mode()
    def confidence(self, images: np.ndarray, classes: np.ndarray) -> np.ndarray:
        scores = []
        for start in range(0, len(images), self.rows):
            x = images_to_tensor(images[start : start + self.rows])
            padded = torch.zeros((self.rows, *x.shape[1:]), dtype=x.dtype)
            padded[: len(x)] = x
            probs = F.softmax(self.model.head(self.model.features(padded)), dim=1)  # type: ignore[operator]
            scores.append(probs[: len(x)].double().numpy())
        probs = np.concatenate(scores)
        return probs[np.arange(len(classes)), classes]


def weights_digest(model: nn.Module) -> str:
    """12 hex digits of the judge's weights: the filtered images depend on them, so the served model id names them."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:12]


class QualityFilter:
    """A GeneratorBackend that draws candidates from `inner` until the judge accepts one per requested image."""

    def __init__(self, inner: GeneratorBackend, scorer: JudgeScorer, *, min_confidence: float, max_batch: int,
                 judge_id: str, metrics: GeneratorMetrics | None = None) -> None:
        if not 0.0 < min_confidence < 1.0:
            raise ConfigError(f"--min-confidence must be in (0, 1) to filter, got {min_confidence}")
        self.inner = inner
        self.scorer = scorer
        self.min_confidence = min_confidence
        self.max_batch = max_batch
        self._metrics = metrics
        served = inner.description
        self._description = dataclasses.replace(served, model_id=f"{served.model_id}-q{min_confidence:g}-j{judge_id}")

    @property
    def description(self) -> BackendDescription:
        return self._description

    def check_counts(self, counts: Sequence[int]) -> None:
        self.inner.check_counts(counts)

    def sample(self, keys: Sequence[ImageKey]) -> np.ndarray:
        channels, height, width = self._description.image_shape
        images = np.zeros((len(keys), height, width, channels), dtype=np.uint8)
        attempt = [0] * len(keys)  # a row's candidates before this one were all rejected; -1: served
        wanted = Counter(key.class_id for key in keys)
        judged: Counter[int] = Counter()
        accepted: Counter[int] = Counter()
        pending, failed = list(range(len(keys))), set()
        while pending:
            failed |= {row for row in pending if attempt[row] >= MAX_CANDIDATES}  # its own candidates all rejected
            pending = [row for row in pending if row not in failed]
            plan = self._plan(pending, attempt)
            if not plan:
                break
            candidates = [ImageKey(keys[r].seed, keys[r].class_id, keys[r].index + a * CANDIDATE_STRIDE) for r, a in plan]
            classes = np.array([key.class_id for key in candidates], dtype=np.int64)
            started = time.perf_counter()
            drawn_images = self.inner.sample(candidates)
            sampled = time.perf_counter()
            passed = self.scorer.confidence(drawn_images, classes) >= self.min_confidence
            outcome = []  # per candidate: "accepted", "rejected", or "spare" (its row took an earlier candidate)
            for (row, a), image, ok in zip(plan, drawn_images, passed):
                c = keys[row].class_id
                if a != attempt[row]:  # an earlier candidate of this row was accepted in this round
                    outcome.append("spare")
                    continue
                judged[c] += 1
                if ok:
                    images[row] = image
                    accepted[c] += 1
                    attempt[row] = -1  # served
                    outcome.append("accepted")
                else:
                    attempt[row] += 1
                    outcome.append("rejected")
            self._count(classes, outcome, sample_s=sampled - started, judge_s=time.perf_counter() - sampled)
            pending = [row for row in pending if attempt[row] >= 0]
        if failed:
            raise PartlyUnservable(self._shortfall(keys, failed, wanted, judged, accepted), images, frozenset(failed))
        return images

    def _plan(self, pending: list[int], attempt: list[int]) -> list[tuple[int, int]]:
        """(row, candidate) pairs for one call of the backend: each pending row's next candidate, in row order, up to
        max_batch; then, since padded backends (ddpm, text2image) cost the same for fewer rows, the spare rows go to
        the following candidates of the same rows, round-robin. No row passes its own MAX_CANDIDATES, so neither what
        a row is served nor whether it fails depends on the other rows."""
        rows = pending[: self.max_batch]  # every pending row has attempt < MAX_CANDIDATES
        plan = [(row, attempt[row]) for row in rows]
        ahead = 1
        while len(plan) < self.max_batch and any(attempt[row] + ahead < MAX_CANDIDATES for row in rows):
            for row in rows:
                if len(plan) < self.max_batch and attempt[row] + ahead < MAX_CANDIDATES:
                    plan.append((row, attempt[row] + ahead))
            ahead += 1
        return plan

    def _count(self, classes: np.ndarray, outcome: list[str], *, sample_s: float, judge_s: float) -> None:
        if self._metrics is None:
            return
        m = self._metrics
        for class_id in np.unique(classes):
            mine = [o for c, o in zip(classes, outcome) if c == class_id]
            m.filter_candidates.labels(str(class_id)).inc(len(mine))
            m.filter_accepted.labels(str(class_id)).inc(mine.count("accepted"))
            m.filter_rejected.labels(str(class_id)).inc(mine.count("rejected"))
        m.filter_judge_seconds.inc(judge_s)
        m.filter_unserved_device_seconds.inc(sample_s * (1.0 - outcome.count("accepted") / len(outcome)))

    def _shortfall(self, keys: Sequence[ImageKey], failed: set[int], wanted: Counter[int], judged: Counter[int],
                   accepted: Counter[int]) -> str:
        parts = []
        for c in sorted({keys[row].class_id for row in failed}):
            lost = sum(keys[row].class_id == c for row in failed)
            rate = accepted[c] / judged[c] if judged[c] else 0.0
            parts.append(f"class {c}: {lost} of {wanted[c]} images had all their {MAX_CANDIDATES} candidates rejected; "
                         f"the judge accepted {accepted[c]} of {judged[c]} candidates (acceptance rate {rate:.2%})")
        return (f"quality filter at min_confidence {self.min_confidence:g}: {'; '.join(parts)}; an image may use "
                f"{MAX_CANDIDATES} candidates. Lower generation.min_confidence (--min-confidence) or use a better "
                f"generator")


def load_quality_filter(inner: GeneratorBackend, *, min_confidence: float, max_batch: int, data_dir: Path | None,
                        judge_cache: Path | None, threads: int = 0, metrics: GeneratorMetrics | None = None) -> QualityFilter:
    """Wrap `inner` with the judge of its dataset (`fedsynth generator evaluate`'s, seed 0, default recipe): loaded
    from the judge cache, or trained on the dataset's real training split and cached there when absent."""
    from generator_service.evaluation.judge import load_or_train_judge

    if threads:  # the holdout backend sets none; torch's default oversubscribes a crowded CPU (10x slower measured)
        torch.set_num_threads(threads)
    served = inner.description
    if served.dataset not in DATASETS:
        raise ConfigError(f"--min-confidence needs a judge of the generator's dataset, but the backend names "
                          f"{served.dataset!r}, not one of {', '.join(DATASETS)}")
    try:
        judge = load_or_train_judge(served.dataset, data_dir=data_dir, seed=JUDGE_SEED, root=judge_cache)
    except (DataError, OSError) as exc:
        raise ConfigError(f"--min-confidence {min_confidence:g} needs the judge trained on {served.dataset}'s real "
                          f"training split, which could not be read: {exc}") from exc
    if (judge.num_classes, judge.image_shape) != (served.num_classes, served.image_shape):
        raise ConfigError(f"the judge of {served.dataset} sees {judge.num_classes} classes of "
                          f"{'x'.join(map(str, judge.image_shape))} images, the generator serves {served.num_classes} "
                          f"of {'x'.join(map(str, served.image_shape))}")
    log.info("quality filter: min_confidence %g, judge %s (test accuracy %.4f, %s)", min_confidence, judge.folder,
             judge.test_accuracy, "cached" if judge.cached else "trained now")
    return QualityFilter(inner, JudgeScorer(judge.model), min_confidence=min_confidence,
                         max_batch=max_batch, judge_id=weights_digest(judge.model), metrics=metrics)
