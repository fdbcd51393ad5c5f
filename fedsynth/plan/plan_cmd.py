"""`fedsynth plan`: synthetic-image budgets per client and class for a partition or a counts file, no training."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedsynth.allocation import (
    DEFAULT_BETAS,
    MAX_SYNTHETIC,
    MIN_REMOVED,
    PAPER_EXPONENT,
    POLICIES,
    beta_path,
    fedeas_budgets,
    full_balance,
    generation_matrix,
    imbalance_score,
    normalized_entropies,
    select_beta,
    synthetic_fraction,
    validate_beta,
    validate_counts,
)
from fedsynth.config_schema import MAX_EXPONENT, PARTITIONS
from fedsynth.errors import ConfigError, DataError

DEFAULT_BETA = 12.0
PARTITION_FLAGS = ("clients", "alpha", "seed", "data_dir", "min_size", "partition", "holdout_fraction")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_argument_group("input: a dataset partition, or a counts file")
    source.add_argument(
        "--dataset", help="digits, cifar10, cifar100 or npz: Dirichlet/IID partition of its train labels"
    )
    source.add_argument("--clients", type=int, help="number of clients K (default 20)")
    source.add_argument("--alpha", type=float, help="Dirichlet concentration (default 0.1)")
    source.add_argument("--seed", type=int, help="partition seed (default 0)")
    source.add_argument("--data-dir", help="folder holding train.npz (or a torchvision copy) of the dataset")
    source.add_argument("--min-size", type=int, help="redraw the Dirichlet split until every client has this many (10)")
    source.add_argument("--partition", choices=PARTITIONS, help="partition scheme (default dirichlet)")
    source.add_argument("--holdout-fraction", type=float, help="share of train labels held out before partitioning (0)")
    source.add_argument("--counts", help='JSON file {"counts": [[n_k^c, ...], ...]}: K rows of C label counts')
    policy = parser.add_argument_group("policy")
    policy.add_argument("--policy", choices=POLICIES, default="fedeas", help="allocation policy (default fedeas)")
    policy.add_argument("--beta", type=float, default=DEFAULT_BETA, help="FedEAS beta (default 12)")
    policy.add_argument(
        "--budget", type=int, help="total images for uniform/missing (default: the FedEAS total at --beta)"
    )
    policy.add_argument(
        "--exponent", type=float, default=PAPER_EXPONENT,
        help=f"FedEAS b_k grows as (N_k / C)^exponent, in [0, {MAX_EXPONENT:g}] (default 0.5, the paper's sqrt; "
        "1.0 is its linear ablation)",
    )
    policy.add_argument(
        "--no-entropy-factor", dest="entropy_factor", action="store_false",
        help="drop the (1 - H_k / ln C) factor from b_k (the paper's entropy ablation)",
    )
    output = parser.add_argument_group("output")
    output.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    output.add_argument("--plot", metavar="DIR", help="write the figures (PNG) into DIR")


@dataclass(frozen=True)
class Source:
    """Where the counts came from, for the report."""

    counts: np.ndarray
    description: dict[str, Any]


def _read_counts_file(path: str) -> Source:
    file = Path(path)
    if not file.is_file():
        raise DataError(f"counts file {path!r} does not exist")
    try:
        document = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"counts file {path!r} is not valid JSON ({exc})") from exc
    if not isinstance(document, dict) or "counts" not in document:
        raise DataError(f'counts file {path!r} must hold a JSON object with a "counts" key')
    return Source(validate_counts(document["counts"]), {"counts_file": str(file)})


def _partition_counts(args: argparse.Namespace) -> Source:
    from fedsynth.learning.data import load_labels, num_classes
    from fedsynth.learning.partition import label_counts, partition

    clients = 20 if args.clients is None else args.clients
    alpha = 0.1 if args.alpha is None else args.alpha
    seed = 0 if args.seed is None else args.seed
    scheme = args.partition or "dirichlet"
    if clients < 1:
        raise ConfigError(f"--clients must be >= 1, got {clients}")
    if not (math.isfinite(alpha) and alpha > 0):
        raise ConfigError(f"--alpha must be > 0, got {alpha}")
    labels = load_labels(args.dataset, "train", data_dir=args.data_dir)
    parts = partition(
        labels,
        clients,
        scheme=scheme,
        alpha=alpha,
        seed=seed,
        min_size=10 if args.min_size is None else args.min_size,
        holdout_fraction=0.0 if args.holdout_fraction is None else args.holdout_fraction,
    )
    counts = label_counts(labels, parts, num_classes(args.dataset, labels))
    description = {"dataset": args.dataset, "partition": scheme, "clients": clients, "alpha": alpha, "seed": seed}
    return Source(validate_counts(counts), description)


def load_source(args: argparse.Namespace) -> Source:
    if (args.counts is None) == (args.dataset is None):
        raise ConfigError("give exactly one input: --dataset NAME (with --clients/--alpha/--seed) or --counts FILE")
    if args.counts is not None:
        extra = [f"--{flag.replace('_', '-')}" for flag in PARTITION_FLAGS if getattr(args, flag) is not None]
        if extra:
            raise ConfigError(f"{', '.join(extra)} applies only with --dataset; the counts file fixes the partition")
        return _read_counts_file(args.counts)
    return _partition_counts(args)


def build_plan(
    counts: np.ndarray, policy: str, beta: float, budget: int | None, *, exponent: float = PAPER_EXPONENT, entropy_factor: bool = True
) -> dict[str, Any]:
    """Everything `plan` reports, as plain JSON-ready values. exponent and entropy_factor set FedEAS's rule (the
    matched baselines spend its total); the beta rule's path uses the same rule."""
    rule = {"exponent": exponent, "entropy_factor": entropy_factor}
    generation = generation_matrix(policy, counts, beta=beta, budget=budget, **rule)
    full_total = int(full_balance(counts).sum())
    total = int(generation.sum())
    before, after = imbalance_score(counts), imbalance_score(counts, generation)
    selected = select_beta(beta_path(counts, DEFAULT_BETAS, **rule))
    return {
        "policy": policy,
        "beta": beta,
        "exponent": exponent,
        "entropy_factor": entropy_factor,
        "budget": budget,
        "num_clients": int(counts.shape[0]),
        "num_classes": int(counts.shape[1]),
        "counts": counts.tolist(),
        "generation": generation.tolist(),
        "client_budgets": fedeas_budgets(counts, beta, **rule).tolist() if policy == "fedeas" else None,
        "client_sizes": counts.sum(axis=1).tolist(),
        "normalized_entropy": [round(float(h), 6) for h in normalized_entropies(counts)],
        "client_totals": generation.sum(axis=1).tolist(),
        "total": total,
        "full_balance_total": full_total,
        "saving_vs_full_balance": 1.0 - total / full_total if full_total else 0.0,
        "imbalance_before": before,
        "imbalance_after": after,
        "imbalance_removed": 1.0 - after / before if before > 0 else 0.0,
        "imbalance_weights": "augmented",
        "synthetic_fraction": synthetic_fraction(counts, generation),
        "selected_beta": None if selected is None else selected.beta,
        "selection_rule": {"min_removed": MIN_REMOVED, "max_synthetic": MAX_SYNTHETIC, "betas": "0.5..48 step 0.5"},
    }


def format_plan(plan: dict[str, Any], source: dict[str, Any]) -> str:
    where = ", ".join(f"{key} {value}" for key, value in source.items())
    lines = [
        f"policy {plan['policy']}, beta {plan['beta']:g}"
        + (f", budget {plan['budget']}" if plan["budget"] is not None else "")
        + (f", exponent {plan['exponent']:g}" if plan["exponent"] != PAPER_EXPONENT else "")
        + ("" if plan["entropy_factor"] else ", no entropy factor")
        + f"; {plan['num_clients']} clients x {plan['num_classes']} classes ({where})",
        "",
        f"{'client':>6} {'N_k':>7} {'H~_k':>6} {'b_k':>6} {'images':>7} {'classes filled':>15}",
    ]
    budgets = plan["client_budgets"]
    for k, (size, h, row) in enumerate(zip(plan["client_sizes"], plan["normalized_entropy"], plan["generation"])):
        b_k = "-" if budgets is None else str(budgets[k])
        filled = sum(1 for n in row if n > 0)
        lines.append(f"{k:>6} {size:>7} {h:>6.3f} {b_k:>6} {sum(row):>7} {filled:>15}")
    lines.append(f"{'total':>6} {sum(plan['client_sizes']):>7} {'':>6} {'':>6} {plan['total']:>7}")
    selected = plan["selected_beta"]
    lines += [
        "",
        (
            f"images to generate: {plan['total']:,} (Full-Balance needs {plan['full_balance_total']:,}; "
            f"saving {plan['saving_vs_full_balance']:.1%})"
        ),
        (
            f"imbalance I: {plan['imbalance_before']:.4f} -> {plan['imbalance_after']:.4f} "
            f"({plan['imbalance_removed']:.1%} removed); synthetic fraction {plan['synthetic_fraction']:.1%}"
        ),
        f"beta rule (remove >= {MIN_REMOVED:.0%} of I, synthetic <= {MAX_SYNTHETIC:.0%}): "
        + ("no beta in 0.5..48 meets it" if selected is None else f"smallest beta = {selected:g}"),
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    beta = validate_beta(args.beta)
    if not (math.isfinite(args.exponent) and 0 <= args.exponent <= MAX_EXPONENT):
        raise ConfigError(f"--exponent must be in [0, {MAX_EXPONENT:g}], got {args.exponent}")
    if args.budget is not None and args.budget < 0:
        raise ConfigError(f"--budget must be >= 0, got {args.budget}")
    source = load_source(args)
    rule = {"exponent": args.exponent, "entropy_factor": args.entropy_factor}
    plan = build_plan(source.counts, args.policy, beta, args.budget, **rule)
    if args.plot is not None:
        from fedsynth.plan.plan_plots import write_plan_figures

        written = write_plan_figures(source.counts, beta, Path(args.plot), **rule)
        plan["plots"] = [str(path) for path in written]
    if args.json:
        print(json.dumps({**plan, "source": source.description}))
    else:
        print(format_plan(plan, source.description))
        for path in plan.get("plots", []):
            print(f"wrote {path}")
    return 0
