"""An experiment's summary: per-arm statistics over seeds, paired differences, summary.md and its plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deploy.report import PHASES
from deploy.experiment_spec import role_policy
from deploy.report_render import PLOTS, pyplot, read_json_object, save_figure
from deploy.stats import paired_difference, summarize
from fedsynth.errors import ConfigError
from fedsynth.process.provenance import provenance
from fedsynth.process.runtime import write_atomic

if TYPE_CHECKING:
    from deploy.experiment_spec import Experiment

# FedEAS against each baseline, when both roles are present.
PAIRS = (("fedeas", "uniform"), ("fedeas", "fedavg"), ("fedeas", "missing"), ("fedeas", "full"))


def run_metrics(run_dir: Path, last_n: int, threshold: float) -> dict[str, Any]:
    """What one finished run contributes: last-N mean accuracy, rounds to threshold, budget and cost."""
    report = json.loads((run_dir / "report.json").read_text())
    try:
        privacy = json.loads((run_dir / "coordinator.json").read_text()).get("sdafl") or {}
    except (OSError, json.JSONDecodeError):
        privacy = {}
    tested = [r for r in report["rounds"] if r["accuracy"] is not None]  # "federated" evaluation may skip rounds
    curve = [float(r["accuracy"]) for r in tested]
    tail = curve[-last_n:]
    reached = [r["round"] for r in tested if r["accuracy"] >= threshold]
    return {
        "last_n_accuracy": sum(tail) / len(tail) if tail else None,
        "final_accuracy": curve[-1] if curve else None,
        "rounds_completed": len(report["rounds"]),
        "rounds_to_threshold": reached[0] if reached else None,
        # synthetic images the method used: generated (FedEAS and baselines) or uploaded DP-GAN samples (SDA-FL)
        "budget": int(report["generation"]["total_images"]) + int(sum(p.get("samples", 0) for p in privacy.values())),
        # SDA-FL: each client's DP-GAN has its own (epsilon, delta); the largest of each bounds every client's guarantee
        "epsilon": max((float(p["epsilon"]) for p in privacy.values() if "epsilon" in p), default=None),
        "delta": max((float(p["delta"]) for p in privacy.values() if "delta" in p), default=None),
        "device_seconds": float(report["generation"]["device_seconds"]),
        "wall_clock_s": float(report["wall_clock_s"]),
        "phases_s": {phase: float(seconds) for phase, seconds in report["phases_s"].items()},
        "curve": curve,
    }


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def build_summary(experiment: Experiment, seeds: list[int], out_dir: Path, outcomes: dict[tuple[str, int], dict[str, Any]]) -> dict[str, Any]:
    s = experiment.settings
    runs: list[dict[str, Any]] = []
    for arm, seed in experiment.plan(seeds):
        outcome = outcomes[(arm.name, seed)]
        run_dir = out_dir / f"{arm.name}-{seed}"
        metrics = run_metrics(run_dir, s.last_n, s.threshold) if outcome["status"] == "ok" else {}
        runs.append({"arm": arm.name, "seed": seed, "run_dir": run_dir.name, **outcome, **metrics})
    arms: list[dict[str, Any]] = []
    for arm in experiment.arms:
        ok = [r for r in runs if r["arm"] == arm.name and r["status"] == "ok"]
        reached = [r["rounds_to_threshold"] for r in ok if r["rounds_to_threshold"] is not None]
        arms.append({
            "name": arm.name, "role": arm.role, "policy": experiment.arm_config(arm, 0, out_dir).generation.policy,  # the same on every seed
            "beta": arm.beta, "overrides": list(arm.overrides),
            "runs_ok": len(ok), "runs": sum(arm.runs_on(seed) for seed in seeds),
            "accuracy": summarize([r["last_n_accuracy"] for r in ok], s.confidence).to_dict(),
            "budget": _mean([r["budget"] for r in ok]),
            "device_seconds": _mean([r["device_seconds"] for r in ok]),
            "wall_clock_s": _mean([r["wall_clock_s"] for r in ok]),
            "phases_s": {phase: _mean([r["phases_s"][phase] for r in ok]) for phase in PHASES} if ok else {},
            "rounds_to_threshold": {"reached": len(reached), "of": len(ok), "mean": _mean([float(x) for x in reached])},
            "epsilon": max((r["epsilon"] for r in ok if r.get("epsilon") is not None), default=None),
            "delta": max((r["delta"] for r in ok if r.get("delta") is not None), default=None),
        })
    by_role = {a["role"]: a for a in arms if a["role"]}
    per_seed = {a["name"]: {r["seed"]: r["last_n_accuracy"] for r in runs if r["arm"] == a["name"] and r["status"] == "ok"} for a in arms}
    reference = per_seed[by_role["fedavg"]["name"]] if "fedavg" in by_role else None
    for a in arms:
        # eta = accuracy gain over FedAvg in percentage points per 1,000 synthetic images (ΔAcc·10^3 / B); the gain is
        # paired over the seeds both ran, so an arm run on seed 0 alone is compared with FedAvg's seed 0
        common = sorted(set(per_seed[a["name"]]) & set(reference or {}))
        gain = 100.0 * _mean([per_seed[a["name"]][x] - reference[x] for x in common]) if reference and common else None
        a["delta_accuracy_pp"] = gain
        a["efficiency"] = gain * 1e3 / a["budget"] if gain is not None and a["budget"] else None
    paired: list[dict[str, Any]] = []
    for x, y in PAIRS:
        if x in by_role and y in by_role:
            a, b = by_role[x]["name"], by_role[y]["name"]
            paired.append({"a": a, "b": b, **paired_difference(per_seed[a], per_seed[b], s.confidence).to_dict()})
    for arm in experiment.arms:
        for other in arm.compare:
            if not any(p["a"] == arm.name and p["b"] == other for p in paired):
                paired.append({"a": arm.name, "b": other, **paired_difference(per_seed[arm.name], per_seed[other], s.confidence).to_dict()})
    return {
        "experiment": s.name, "seeds": seeds, "last_n": s.last_n, "threshold": s.threshold, "confidence": s.confidence,
        "arms": arms, "paired": paired, "runs": runs, "version": provenance(),
    }


# ---- summary.md and plots ---------------------------------------------------------------------------


def _pct(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{100 * value:.{digits}f}"


def _interval(summary: dict[str, Any]) -> str:
    return "n/a" if summary["ci_low"] is None else f"[{_pct(summary['ci_low'])}, {_pct(summary['ci_high'])}]"


def _num(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _markdown(summary: dict[str, Any], plots: list[Path]) -> str:
    n, conf, thr = summary["last_n"], round(100 * summary["confidence"]), summary["threshold"]
    lines = [
        f"# Experiment {summary['experiment']}",
        "",
        (
            f"Seeds {', '.join(map(str, summary['seeds']))}. Accuracy (%) is each run's mean test accuracy over its last {n} rounds "
            f"(all rounds when fewer), then mean ± sample std and the {conf}% t-interval over seeds. Budget: synthetic images. "
            f"eta = ΔAcc × 10^3 / budget, ΔAcc being the percentage points over the FedAvg arm on the same seeds. An arm with fewer runs than seeds ran on some seeds only. Rounds to {_pct(thr, 1)}%: the first round "
            "at or above it (mean over the seeds that reached it)."
        ),
        "",
        (
            f"| arm | role | accuracy (%) | {conf}% interval | budget (images) | wall-clock (s) | device-s | ΔAcc (pp) | eta "
            f"| rounds to {_pct(thr, 1)}% | runs ok |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for a in summary["arms"]:
        acc, rt = a["accuracy"], a["rounds_to_threshold"]
        std = f" ± {_pct(acc['std'])}" if acc["std"] is not None else ""
        lines.append(
            f"| {a['name']} | {a['role'] or '-'} | {_pct(acc['mean'])}{std} | {_interval(acc)} | {_num(a['budget'], ',.0f')} "
            f"| {_num(a['wall_clock_s'], '.1f')} | {_num(a['device_seconds'], '.1f')} | {_num(a['delta_accuracy_pp'], '+.2f')} "
            f"| {_num(a['efficiency'], '.3f')} | {_num(rt['mean'], '.1f')} ({rt['reached']}/{rt['of']}) | {a['runs_ok']}/{a['runs']} |"
        )
    if summary["paired"]:
        lines += ["", "## Paired differences (same seed, same partition)", "",
                  f"| difference | per seed (pp) | mean (pp) | {conf}% interval (pp) |", "|---|---|---|---|"]
        for p in summary["paired"]:
            per_seed = ", ".join(f"s{seed}: {100 * d:+.2f}" for seed, d in zip(p["seeds"], p["differences"]))
            interval = "n/a" if p["ci_low"] is None else f"[{100 * p['ci_low']:+.2f}, {100 * p['ci_high']:+.2f}]"
            mean = "n/a" if p["mean"] is None else f"{100 * p['mean']:+.2f}"
            lines.append(f"| {p['a']} − {p['b']} | {per_seed or 'no common seed'} | {mean} | {interval} |")
    private = [a for a in summary["arms"] if a.get("epsilon") is not None]
    if private:
        lines += ["", "## Privacy (SDA-FL's DP-GANs)", "",
                  "The largest epsilon and the largest delta of any client in any of the arm's runs: a bound on every client's guarantee.", "",
                  "| arm | epsilon | delta |", "|---|---|---|"]
        lines += [f"| {a['name']} | {a['epsilon']:.2f} | {a['delta']:.1e} |" for a in private]
    if any(a.get("phases_s") for a in summary["arms"]):
        lines += ["", "## Wall-clock by phase (s, mean over the arm's runs)", "",
                  "| arm | " + " | ".join(PHASES) + " | wall-clock |", "|---|" + "---|" * (len(PHASES) + 1)]
        for a in summary["arms"]:
            if a.get("phases_s"):
                cells = " | ".join(_num(a["phases_s"].get(phase), ".1f") for phase in PHASES)
                lines.append(f"| {a['name']} | {cells} | {_num(a['wall_clock_s'], '.1f')} |")
    failed = [r for r in summary["runs"] if r["status"] != "ok"]
    if failed:
        lines += ["", "## Failed runs", "", *[f"- {r['arm']} seed {r['seed']}: {r['error']}" for r in failed]]
    lines += ["", "## Plots", "", *[f"![{p.stem}]({PLOTS}/{p.name})" for p in plots], ""]
    return "\n".join(lines)


def _zoom_percent(ax, values: list[float]) -> None:  # type: ignore[no-untyped-def]
    """Fit the accuracy axis to the values, within [0, 100]: an interval from few seeds can reach past either end."""
    if values:
        span = max(values) - min(values)
        ax.set_ylim(max(0.0, min(values) - 0.15 * span - 2), min(100.0, max(values) + 0.15 * span + 2))


# One colour per generation.policy (fedsynth.config_schema.POLICIES), so an arm without a role is drawn as what it runs.
POLICY_COLOURS = {"fedeas": "#dd8452", "uniform": "#4c72b0", "missing": "#55a868", "full": "#8172b3", "none": "#8c8c8c"}


def arm_policy(arm: dict[str, Any]) -> str:
    """The arm's generation.policy; summaries written before it was recorded fall back to the role's policy."""
    if arm.get("policy"):
        return str(arm["policy"])
    role = arm.get("role")
    return role_policy(role) if role else "unknown"


def plot_accuracy_bars(summary: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    arms = summary["arms"]
    fig, ax = plt.subplots(figsize=(max(6.4, 1.1 * len(arms)), 4.0))
    shown: list[float] = []  # every plotted value, to zoom the axis onto the differences
    for i, a in enumerate(arms):
        acc = a["accuracy"]
        if acc["mean"] is None:
            continue
        err = None if acc["ci_low"] is None else [[100 * (acc["mean"] - acc["ci_low"])], [100 * (acc["ci_high"] - acc["mean"])]]
        policy = arm_policy(a)
        ax.bar(i, 100 * acc["mean"], yerr=err, capsize=5, color=POLICY_COLOURS.get(policy, "#c44e52"), alpha=0.85, label=f"policy {policy}")
        ax.annotate(f"{100 * acc['mean']:.2f}", (i, 100 * acc["mean"]), xytext=(14, 3), textcoords="offset points", fontsize=8)
        seeds = [r["last_n_accuracy"] for r in summary["runs"] if r["arm"] == a["name"] and r["status"] == "ok"]
        ax.scatter([i] * len(seeds), [100 * v for v in seeds], color="black", s=12, zorder=3)
        shown += [100 * v for v in seeds] + [100 * v for v in (acc["ci_low"], acc["ci_high"]) if v is not None]
    ax.set_xticks(range(len(arms)), [f"{a['name']}\n{_num(a['budget'], ',.0f')} img" for a in arms], fontsize=8)
    _zoom_percent(ax, shown)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    if len(unique) > 1:
        ax.legend(unique.values(), unique.keys(), fontsize=8)
    ax.set_ylabel(f"accuracy (%), mean of last {summary['last_n']} rounds")
    ax.set_title(f"Accuracy per arm: mean, {round(100 * summary['confidence'])}% t-interval, seeds as dots")
    return save_figure(fig, path)


def plot_accuracy_curves(summary: dict[str, Any], path: Path) -> Path:
    import numpy as np

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.0, 4.2))
    for a in summary["arms"]:
        curves = [r["curve"] for r in summary["runs"] if r["arm"] == a["name"] and r["status"] == "ok" and r["curve"]]
        if not curves:
            continue
        length = min(len(c) for c in curves)
        values = 100 * np.array([c[:length] for c in curves])
        x = np.arange(1, length + 1)
        (line,) = ax.plot(x, values.mean(axis=0), label=f"{a['name']} ({len(curves)} seed{'s' if len(curves) > 1 else ''})")
        if len(curves) > 1:
            std = values.std(axis=0, ddof=1)
            ax.fill_between(x, values.mean(axis=0) - std, values.mean(axis=0) + std, color=line.get_color(), alpha=0.2)
    ax.axhline(100 * summary["threshold"], ls="--", color="gray", lw=1, label=f"threshold {_pct(summary['threshold'], 1)}%")
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("Accuracy per round: mean over seeds, band ± 1 std")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=8, loc="lower right")
    return save_figure(fig, path)


def plot_beta_sweep(points: list[dict[str, Any]], confidence: float, path: Path) -> Path:
    """Fig. 5a: accuracy against beta, with the budget each beta costs."""
    plt = pyplot()
    points = sorted(points, key=lambda a: a["beta"])
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    betas = [a["beta"] for a in points]
    accuracy = [a["accuracy"] for a in points]
    means = [100 * acc["mean"] for acc in accuracy]
    # no interval (one seed): a zero-length error bar
    errs = [[m - 100 * (acc["ci_low"] if acc["ci_low"] is not None else acc["mean"]) for m, acc in zip(means, accuracy)],
            [100 * (acc["ci_high"] if acc["ci_high"] is not None else acc["mean"]) - m for m, acc in zip(means, accuracy)]]
    ax.errorbar(betas, means, yerr=errs, marker="o", capsize=4, color="#dd8452", label=f"accuracy ({round(100 * confidence)}% interval)")
    _zoom_percent(ax, [m - e for m, e in zip(means, errs[0])] + [m + e for m, e in zip(means, errs[1])])
    ax.set_xticks(betas, [f"{b:g}" for b in betas])
    ax.set_xlabel("beta")
    ax.set_ylabel("accuracy (%)")
    budget_ax = ax.twinx()
    budget_ax.plot(betas, [a["budget"] for a in points], marker="s", ls="--", color="#4c72b0", label="budget (images)")
    budget_ax.set_ylabel("synthetic images", color="#4c72b0")
    lines = ax.get_legend_handles_labels()[0] + budget_ax.get_legend_handles_labels()[0]
    ax.legend(lines, [h.get_label() for h in lines], fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncols=2)
    ax.set_title("FedEAS beta sweep")
    return save_figure(fig, path)


def render_summary(out_dir: str | Path) -> list[Path]:
    """Write EXP/summary.md and EXP/plots/*.png from EXP/summary.json; return the paths written."""
    out_dir = Path(out_dir)
    summary = read_json_object(out_dir / "summary.json", "experiment folder (no summary.json)")
    if not isinstance(summary.get("arms"), list) or not isinstance(summary.get("runs"), list):
        raise ConfigError(f"{out_dir / 'summary.json'} has no 'arms' and 'runs' lists: not a fedsynth experiment summary")
    plots: list[Path] = []
    if any(a["accuracy"]["mean"] is not None for a in summary["arms"]):
        plots.append(plot_accuracy_bars(summary, out_dir / PLOTS / "accuracy_bars.png"))
        plots.append(plot_accuracy_curves(summary, out_dir / PLOTS / "accuracy_curves.png"))
    sweep = [a for a in summary["arms"] if a.get("beta") is not None and a["accuracy"]["mean"] is not None]
    if sweep:
        plots.append(plot_beta_sweep(sweep, summary["confidence"], out_dir / PLOTS / "beta_sweep.png"))
    markdown = out_dir / "summary.md"
    write_atomic(markdown, _markdown(summary, plots))
    return [markdown, *plots]


__all__ = ["build_summary", "render_summary", "run_metrics"]
