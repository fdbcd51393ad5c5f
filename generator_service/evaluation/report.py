"""Score generated images with a judge: recognizability, CAS and Fréchet distances, as one JSON-ready dict."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from fedsynth.learning.data import ArrayDataset, load_dataset
from generator_service.evaluation.judge import Judge, accuracy, describe, train_classifier
from generator_service.evaluation.metrics import confusion, feature_stats, frechet_to, recognizability
from generator_service.evaluation.sources import GeneratedImages


def evaluate_images(judge: Judge, generated: GeneratedImages, *, seed: int, data_dir: Any = None) -> dict[str, Any]:
    """All figures for `generated` (already checked against the judge's classes and image shape)."""
    started = time.perf_counter()
    c = judge.num_classes
    features, probs = judge.score(generated.images)
    predicted = probs.argmax(axis=1)
    overall, per_class = recognizability(predicted, generated.labels, c)
    confidence = probs[np.arange(len(probs)), generated.labels]
    frechet, per_class_frechet = frechet_to(judge.reference, feature_stats(features, generated.labels, c))
    counts = np.bincount(generated.labels, minlength=c)
    test = load_dataset(judge.dataset, "test", data_dir=data_dir)
    real = _matched_sample(test, counts, seed)  # Fréchet estimates grow as N shrinks: compare at the same N
    real_frechet, real_per_class = frechet_to(judge.reference, feature_stats(judge.score(real.x)[0], real.y, c))
    scored_s = time.perf_counter() - started
    cas_started = time.perf_counter()
    synthetic = ArrayDataset(judge.dataset, generated.images, generated.labels, c)
    classifier = train_classifier(judge.recipe, synthetic, seed, steps=judge.recipe.cas_steps, device=judge.device)
    cas = accuracy(classifier, test)
    return {
        "recognizability": overall,
        "per_class_recognizability": per_class,
        "mean_confidence": float(confidence.mean()),  # the judge's mean probability of the intended class
        "cas": cas,
        "frechet": frechet,
        "per_class_frechet": per_class_frechet,
        "real_test_frechet": real_frechet,  # real test images (as many per class as generated, where there are) vs the same reference
        "real_test_per_class_frechet": real_per_class,
        "real_test_n_per_class": np.bincount(real.y, minlength=c).tolist(),
        "judge_test_accuracy": judge.test_accuracy,
        "judge_train_accuracy": judge.train_accuracy,
        "chance": 1.0 / c,
        "confusion": confusion(predicted, generated.labels, c),
        "n_per_class": int(counts.min()) if int(counts.min()) == int(counts.max()) else counts.tolist(),
        "n_images": int(len(generated.labels)),
        "num_classes": c,
        "dataset": judge.dataset,
        "backend": generated.backend,
        "model_id": generated.model_id,
        "seed": seed,
        "features": describe(judge)["features"],
        "judge": describe(judge),
        "seconds": {"judge": judge.seconds, "images": generated.seconds, "scoring": scored_s,
                    "cas": time.perf_counter() - cas_started},
    }


def _matched_sample(test: ArrayDataset, counts: np.ndarray, seed: int) -> ArrayDataset:
    """A seeded sample of the real test split with counts[c] images of class c (all of them where it holds fewer)."""
    rng = np.random.default_rng([seed, 0x7E57])
    chosen = [rng.permutation(np.flatnonzero(test.y == c))[: int(n)] for c, n in enumerate(counts)]
    return test.subset(np.sort(np.concatenate(chosen)))
