"""FedEAS planning figures on CIFAR-10 (K=20, alpha=0.1, beta=12) over seeds 0..9, as a markdown table.

python benchmarks/plan_seeds.py --data-dir /work/shared/data/cifar10
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np

from fedsynth.allocation import (
    beta_path,
    fedeas_budgets,
    fedeas_generation,
    first_order_gain,
    full_balance,
    greedy_path,
    imbalance_removed,
    matched_quota,
    select_beta,
    synthetic_fraction,
)
from fedsynth.learning.data import load_labels
from fedsynth.learning.partition import label_counts, partition

# (name, how it is printed, the paper's figure for CIFAR-10, K = 20, alpha = 0.1, beta = 12)
METRICS: list[tuple[str, Callable[[float], str], str]] = [
    ("Full-Balance total", lambda v: f"{v:,.0f}", "226,783"),
    ("FedEAS total", lambda v: f"{v:,.0f}", "13,437"),
    ("saving vs Full-Balance", lambda v: f"{v:.1%}", "94.1%"),
    ("imbalance removed (p_k augmented)", lambda v: f"{v:.1%}", "51.8%"),
    ("imbalance removed (p_k original)", lambda v: f"{v:.1%}", "-"),
    ("Uniform at the same B: imbalance removed", lambda v: f"{v:.1%}", "-"),
    ("greedy reference at the same B: imbalance removed", lambda v: f"{v:.1%}", "-"),
    ("synthetic fraction", lambda v: f"{v:.1%}", "21.2%"),
    ("Uniform images on Delta < 0 pairs", lambda v: f"{v:.1%}", "12.5%"),
    ("b_k ratio max/min>0, sqrt rule", lambda v: f"{v:.1f}x", "7.2x"),
    ("b_k ratio max/min>0, linear rule", lambda v: f"{v:.1f}x", "38.5x"),
    ("selected beta (>=50% removed, <=25% synthetic)", lambda v: f"{v:.1f}", "-"),
]


def budget_ratio(budgets: np.ndarray) -> float:
    positive = budgets[budgets > 0]
    return float(positive.max() / positive.min())


def seed_metrics(labels: np.ndarray, seed: int, clients: int, alpha: float, beta: float) -> list[float]:
    counts = label_counts(labels, partition(labels, clients, alpha=alpha, seed=seed), int(labels.max()) + 1)
    fedeas = fedeas_generation(counts, beta)
    full_total, total = int(full_balance(counts).sum()), int(fedeas.sum())
    uniform = matched_quota("uniform", counts, total)
    negative = first_order_gain(counts) < 0
    selected = select_beta(beta_path(counts))
    return [
        full_total,
        total,
        1.0 - total / full_total,
        imbalance_removed(counts, fedeas, weights="augmented"),
        imbalance_removed(counts, fedeas, weights="original"),
        imbalance_removed(counts, uniform),
        imbalance_removed(counts, greedy_path(counts, total).generation),
        synthetic_fraction(counts, fedeas),
        uniform[negative].sum() / uniform.sum(),
        budget_ratio(fedeas_budgets(counts, beta)),
        budget_ratio(fedeas_budgets(counts, beta, exponent=1.0)),
        float("nan") if selected is None else selected.beta,
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="/work/shared/data/cifar10", help="folder holding CIFAR-10 train.npz")
    parser.add_argument("--seeds", type=int, default=10, help="seeds 0..N-1 (default 10)")
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--alpha", type=float, default=0.1)
    parser.add_argument("--beta", type=float, default=12.0)
    args = parser.parse_args()
    labels = load_labels("cifar10", data_dir=args.data_dir)
    rows = np.array([seed_metrics(labels, s, args.clients, args.alpha, args.beta) for s in range(args.seeds)])
    print(f"CIFAR-10, K={args.clients}, alpha={args.alpha}, beta={args.beta:g}, seeds 0..{args.seeds - 1}\n")
    print("| metric | mean | std | median | min | max | paper |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for (name, fmt, paper), values in zip(METRICS, rows.T):
        std = np.nanstd(values)
        std_text = fmt(std) if "%" not in fmt(1.0) else f"{std * 100:.1f} pp"
        print(
            f"| {name} | {fmt(np.nanmean(values))} | {std_text} | {fmt(np.nanmedian(values))} | {fmt(np.nanmin(values))} "
            f"| {fmt(np.nanmax(values))} | {paper} |"
        )
    print(
        "\nper seed (FedEAS total / Full-Balance total): "
        + ", ".join(f"{s}: {int(r[1]):,}/{int(r[0]):,}" for s, r in enumerate(rows))
    )


if __name__ == "__main__":
    main()
