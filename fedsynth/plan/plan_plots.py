"""The `plan --plot` figures: Full-Balance vs FedEAS per client, cumulative shares, I against B, the beta rule."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from fedsynth.allocation import (
    DEFAULT_BETAS,
    MAX_SYNTHETIC,
    MIN_REMOVED,
    beta_path,
    client_imbalance,
    fedeas_generation,
    full_balance,
    greedy_path,
    matched_path,
    select_beta,
)
from fedsynth.errors import ConfigError

DPI = 130


def _pyplot():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:  # type: ignore[no-untyped-def]
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    _pyplot().close(fig)
    return path


def plot_demand_per_client(counts: np.ndarray, beta: float, path: Path, **rule: Any) -> Path:
    """Fig. 1a: images each client needs under Full-Balance vs what FedEAS generates."""
    plt = _pyplot()
    full = full_balance(counts).sum(axis=1)
    fedeas = fedeas_generation(counts, beta, **rule).sum(axis=1)
    clients = np.arange(len(counts))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * len(counts)), 3.8))
    ax.bar(
        clients - 0.2, np.maximum(full, 0.5), width=0.4, label=f"Full-Balance (total {full.sum():,})", color="#c44e52"
    )
    ax.bar(
        clients + 0.2,
        np.maximum(fedeas, 0.5),
        width=0.4,
        label=f"FedEAS beta={beta:g} (total {fedeas.sum():,})",
        color="#4c72b0",
    )
    ax.set_yscale("log")
    ax.set_ylim(top=max(full.max(), fedeas.max(), 1) * 10)  # headroom so the legend covers no bar
    ax.set_xlabel("client k")
    ax.set_ylabel("synthetic images (log scale)")
    ax.set_title("Per-client demand: Full-Balance vs FedEAS")
    ax.set_xticks(clients if len(clients) <= 40 else clients[:: max(1, len(clients) // 20)])
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_cumulative_shares(counts: np.ndarray, beta: float, path: Path, **rule: Any) -> Path:
    """Fig. 2a: clients sorted by their share of I; cumulative share of I and of each policy's images."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    terms = client_imbalance(counts)
    order = np.argsort(-terms, kind="stable")
    x = np.arange(len(counts) + 1)

    def cumulative(values: np.ndarray) -> np.ndarray:
        total = values.sum()
        return np.concatenate([[0.0], np.cumsum(values[order]) / total]) if total > 0 else np.zeros(len(x))

    fig, ax = plt.subplots(figsize=(5.5, 4.0))
    ax.plot(x, cumulative(terms), "k-o", ms=3, label="imbalance I")
    ax.plot(
        x,
        cumulative(fedeas_generation(counts, beta, **rule).sum(axis=1).astype(float)),
        "-s",
        ms=3,
        color="#4c72b0",
        label=f"FedEAS images (beta={beta:g})",
    )
    ax.plot(
        x,
        cumulative(full_balance(counts).sum(axis=1).astype(float)),
        "-^",
        ms=3,
        color="#c44e52",
        label="Full-Balance images",
    )
    ax.plot(x, x / len(counts), ":", color="gray", label="equal share per client")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("clients, sorted by their share of I (largest first)")
    ax.set_ylabel("cumulative share")
    ax.set_xlim(0, len(counts))
    ax.set_ylim(0, 1.02)
    ax.set_title("Where the imbalance is vs where the images go")
    ax.legend(fontsize=8, loc="lower right")
    return _save(fig, path)


def plot_reduction_vs_budget(counts: np.ndarray, beta: float, path: Path, **rule: Any) -> Path:
    """Fig. 2b: 1 - I(B)/I(0) against the total budget B for Uniform, FedEAS over beta and the greedy reference."""
    plt = _pyplot()
    betas = [b for b in DEFAULT_BETAS if b <= max(24.0, 2 * beta)]
    points = beta_path(counts, sorted(set(betas) | {beta}), **rule)
    max_total = max(p.total for p in points)
    greedy = greedy_path(counts, max_total)
    before = greedy.imbalance[0]
    totals = np.linspace(0, max_total, 41).astype(int)
    uniform = 1.0 - matched_path("uniform", counts, totals) / before
    missing = 1.0 - matched_path("missing", counts, totals) / before if (counts == 0).any() else None
    fig, ax = plt.subplots(figsize=(5.5, 4.0))
    ax.plot(np.arange(len(greedy.imbalance)), 1.0 - greedy.imbalance / before, "k-", lw=1.2, label="greedy reference")
    ax.plot(
        [p.total for p in points],
        [p.imbalance_removed for p in points],
        "o-",
        ms=3,
        color="#4c72b0",
        label="FedEAS (beta path)",
    )
    ax.plot(totals, uniform, "-", color="#dd8452", label="Uniform (matched B)")
    if missing is not None:
        ax.plot(totals, missing, "--", color="#8172b3", label="Missing-only (matched B)")
    chosen = next(p for p in points if p.beta == beta)
    ax.plot([chosen.total], [chosen.imbalance_removed], "*", ms=12, color="#4c72b0")
    ax.annotate(
        f"beta={beta:g}: {chosen.imbalance_removed:.1%}",
        (chosen.total, chosen.imbalance_removed),
        textcoords="offset points",
        xytext=(-95, 10),
        fontsize=8,
    )
    ax.set_xlabel("total synthetic images B")
    ax.set_ylabel("imbalance reduction 1 - I(B)/I(0)")
    ax.set_title("Imbalance removed per image budget")
    ax.legend(fontsize=8, loc="lower right")
    return _save(fig, path)


def plot_beta_selection(counts: np.ndarray, beta: float, path: Path, **rule: Any) -> Path:
    """Fig. 5b: the FedEAS beta path in (synthetic fraction, imbalance removed) with the selection region."""
    plt = _pyplot()
    points = beta_path(counts, sorted(set(DEFAULT_BETAS) | {beta}), **rule)
    selected = select_beta(points)
    fractions = np.array([p.synthetic_fraction for p in points])
    removed = np.array([p.imbalance_removed for p in points])
    fig, ax = plt.subplots(figsize=(5.5, 4.0))
    ax.axvspan(
        0,
        MAX_SYNTHETIC,
        ymin=MIN_REMOVED,
        ymax=1.0,
        color="#55a868",
        alpha=0.18,
        label=f"rule: removed >= {MIN_REMOVED:.0%}, synthetic <= {MAX_SYNTHETIC:.0%}",
    )
    ax.plot(fractions, removed, "o-", ms=3, color="#4c72b0", label="FedEAS, beta 0.5..48")
    for p in points:
        if p.beta in (1.0, 4.0, 8.0, 16.0, 24.0, 32.0, 48.0):
            ax.annotate(
                f"{p.beta:g}",
                (p.synthetic_fraction, p.imbalance_removed),
                textcoords="offset points",
                xytext=(4, -10),
                fontsize=7,
                color="#4c72b0",
            )
    chosen = next(p for p in points if p.beta == beta)
    ax.plot(
        [chosen.synthetic_fraction],
        [chosen.imbalance_removed],
        "*",
        ms=12,
        color="#c44e52",
        label=f"beta={beta:g} (this plan)",
    )
    if selected is not None:
        ax.plot(
            [selected.synthetic_fraction],
            [selected.imbalance_removed],
            "D",
            ms=7,
            mfc="none",
            color="k",
            label=f"selected beta={selected.beta:g}",
        )
    ax.set_xlim(0, max(0.5, float(fractions.max()) * 1.05))
    ax.set_ylim(0, 1)
    ax.set_xlabel("synthetic fraction  generated / (real + generated)")
    ax.set_ylabel("imbalance removed  1 - I(B)/I(0)")
    ax.set_title("Choosing beta")
    ax.legend(fontsize=8, loc="lower right")
    return _save(fig, path)


FIGURES = {
    "fig1a_demand_per_client.png": plot_demand_per_client,
    "fig2a_cumulative_shares.png": plot_cumulative_shares,
    "fig2b_reduction_vs_budget.png": plot_reduction_vs_budget,
    "fig5b_beta_selection.png": plot_beta_selection,
}


def write_plan_figures(counts: np.ndarray, beta: float, out_dir: Path, **rule: Any) -> list[Path]:
    """Write every figure into out_dir (created if needed); returns the paths. `rule` (exponent, entropy_factor)
    goes to every FedEAS computation."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--plot folder {str(out_dir)!r} cannot be created ({exc})") from exc
    return [plot(counts, beta, out_dir / name, **rule) for name, plot in FIGURES.items()]
