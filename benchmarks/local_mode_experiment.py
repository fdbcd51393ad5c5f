"""Reduced CIFAR-10 in local mode with federated evaluation: FedAvg, Uniform, FedEAS over per-seed client folders,
then the weighted, mean-client and worst-client accuracy and per-class recall, with paired t-intervals.

The setting is deploy/configs/experiment-cifar10-cpu.toml's [base] and its fedavg/uniform/fedeas arms; each seed S
runs over the folders `fedsynth data split ... --seed S --holdout-fraction 0.5 --out LOCAL_ROOT/seed-S` wrote
(the holdout backend serves LOCAL_ROOT/seed-S/holdout). A run whose report.json exists is reused.

    python benchmarks/local_mode_experiment.py --local-root /work/cifar-local --runs /work/cifar-local-runs \
        --data-dir /work/cifar10-sub [--seeds 0,1,2] [--split-check] [--summary-only] --out docs/results/cifar10-local

`--split-check` also runs FedAvg seed 0 in split mode (data.data_dir) and compares its server accuracy per round
with the local run's weighted federated accuracy.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
import tomllib
from pathlib import Path
from typing import Any

from deploy.experiment import run_arm
from deploy.experiment_spec import load_experiment
from deploy.stats import paired_difference, summarize
from fedsynth.config import apply_overrides, from_dict

CONFIG = Path(__file__).resolve().parent.parent / "deploy" / "configs" / "experiment-cifar10-cpu.toml"
ARMS = ("fedavg", "uniform", "fedeas")
PAIRS = (("fedeas", "uniform"), ("fedeas", "fedavg"), ("uniform", "fedavg"))
log = logging.getLogger("local_mode_experiment")


def run_all(args: argparse.Namespace, seeds: list[int]) -> dict[str, dict[str, Any]]:
    """Run (or reuse) every arm × seed in local mode, plus the split-mode check; returns {run name: outcome}."""
    experiment = load_experiment(CONFIG, [f"data.data_dir={json.dumps(args.data_dir)}"])
    arms = {arm.name: arm for arm in experiment.arms}
    plan: list[tuple[str, str, int, list[str]]] = []
    for seed in seeds:
        local = [f"data.source={json.dumps('local')}", f"data.local_dir={json.dumps(str(Path(args.local_root) / f'seed-{seed}'))}"]
        plan += [(f"{name}-{seed}", name, seed, local) for name in ARMS]
        if args.split_check and seed == 0:
            plan.append(("split-fedavg-0", "fedavg", 0, []))
    outcomes: dict[str, dict[str, Any]] = {}
    for index, (run_name, arm_name, seed, extra) in enumerate(plan, start=1):
        arm_dir = Path(args.runs) / run_name
        if (arm_dir / "report.json").exists():
            log.info("[%d/%d] %s: report.json exists; reused", index, len(plan), run_name)
            outcomes[run_name] = {"status": "ok", "seconds": None, "reused": True}
            continue
        arm = arms[arm_name]
        raw = apply_overrides(experiment.base, [*arm.overrides, *extra, f"seed={seed}", f"out_dir={json.dumps(str(arm_dir))}"])
        log.info("[%d/%d] %s: running in %s", index, len(plan), run_name, arm_dir)
        started = time.strftime("%H:%M:%S")
        outcome = run_arm(from_dict(raw), arm_dir, arm.timeout_s)
        outcomes[run_name] = {**outcome, "reused": False, "started": started}
        log.info("[%d/%d] %s: %s in %.1f s %s", index, len(plan), run_name, outcome["status"], outcome["seconds"], outcome["error"] or "")
        (Path(args.runs) / "timings.json").write_text(json.dumps(_merged_timings(Path(args.runs), {run_name: outcomes[run_name]}), indent=2))
    return outcomes


def _merged_timings(runs: Path, new: dict[str, Any]) -> dict[str, Any]:
    path = runs / "timings.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    return {**old, **new}


def run_metrics(run_dir: Path, last_n: int) -> dict[str, Any]:
    """One run's federated figures: last-n means of the weighted, mean-client and worst-client accuracy, the
    last round's per-class recall, and each client's last-n mean accuracy (the worst of those named)."""
    report = json.loads((run_dir / "report.json").read_text())
    rounds = report["federated_evaluation"][-last_n:]
    clients = sorted(rounds[-1]["per_client"], key=int)
    per_client = {c: sum(r["per_client"][c]["accuracy"] for r in rounds) / len(rounds) for c in clients}
    worst_each_round = [r["worst_client"] for r in rounds]
    worst = min(per_client, key=lambda c: per_client[c])
    return {
        "rounds": len(report["federated_evaluation"]),
        "weighted_accuracy": sum(r["weighted_accuracy"] for r in rounds) / len(rounds),
        "mean_accuracy": sum(r["mean_accuracy"] for r in rounds) / len(rounds),
        "worst_accuracy": sum(r["worst_accuracy"] for r in rounds) / len(rounds),
        "per_class_recall": rounds[-1]["per_class_recall"],
        "per_client_accuracy": per_client,
        "test_examples": {c: rounds[-1]["per_client"][c]["examples"] for c in clients},
        "worst_client": int(worst),
        "worst_client_rounds": {str(c): worst_each_round.count(c) for c in sorted(set(worst_each_round))},
        "curve": [r["weighted_accuracy"] for r in report["federated_evaluation"]],
        "wall_clock_s": report["wall_clock_s"],
        "phases_s": report["phases_s"],
    }


def split_check(runs: Path) -> dict[str, Any] | None:
    """Split mode's server accuracy per round against local mode's weighted federated accuracy (FedAvg, seed 0)."""
    split, local = runs / "split-fedavg-0" / "report.json", runs / "fedavg-0" / "report.json"
    if not (split.exists() and local.exists()):
        return None
    server = [r["accuracy"] for r in json.loads(split.read_text())["rounds"]]
    federated = [r["weighted_accuracy"] for r in json.loads(local.read_text())["federated_evaluation"]]
    return {"rounds": len(server), "equal_rounds": sum(a == b for a, b in zip(server, federated)),
            "max_abs_difference": max(abs(a - b) for a, b in zip(server, federated)),
            "split_server_accuracy": server, "local_weighted_accuracy": federated,
            "split_wall_clock_s": json.loads(split.read_text())["wall_clock_s"]}


def summarize_runs(runs: Path, local_root: Path, seeds: list[int], last_n: int, confidence: float) -> dict[str, Any]:
    """Per arm: mean, sd and t-interval over seeds; paired differences; the worst client of every run."""
    metrics = {(arm, seed): run_metrics(runs / f"{arm}-{seed}", last_n) for arm in ARMS for seed in seeds
               if (runs / f"{arm}-{seed}" / "report.json").exists()}
    done = sorted({seed for (_, seed) in metrics})
    figures = ("weighted_accuracy", "mean_accuracy", "worst_accuracy")
    arms: dict[str, Any] = {}
    for arm in ARMS:
        by_seed = {seed: m for (a, seed), m in metrics.items() if a == arm}
        if not by_seed:
            continue
        recall = [sum(m["per_class_recall"][c] for m in by_seed.values()) / len(by_seed) for c in range(len(next(iter(by_seed.values()))["per_class_recall"]))]
        arms[arm] = {"seeds": sorted(by_seed), **{f: summarize([m[f] for m in by_seed.values()], confidence).to_dict() for f in figures},
                     "per_class_recall_last_round": recall,
                     "wall_clock_s": {str(s): m["wall_clock_s"] for s, m in sorted(by_seed.items())}}
    paired = {f"{a} − {b}": {f: paired_difference({s: metrics[(a, s)][f] for s in done if (a, s) in metrics},
                                                   {s: metrics[(b, s)][f] for s in done if (b, s) in metrics}, confidence).to_dict()
                              for f in figures} for a, b in PAIRS}
    worst: list[dict[str, Any]] = []
    for seed in done:
        schema = (local_root / f"seed-{seed}" / "schema.toml").read_text()
        counts = tomllib.loads(schema)["split"]["train_counts"]
        base = metrics.get(("fedavg", seed))
        for arm in ARMS:
            m = metrics.get((arm, seed))
            if m is None:
                continue
            c = m["worst_client"]
            row = {"seed": seed, "arm": arm, "worst_client": c, "accuracy": m["per_client_accuracy"][str(c)],
                   "train_images": sum(counts[c]), "test_images": m["test_examples"][str(c)],
                   "classes_held": [i for i, n in enumerate(counts[c]) if n > 0],
                   "worst_each_round": m["worst_client_rounds"]}
            if base is not None:  # FedAvg's worst client, followed into this arm
                fc = base["worst_client"]
                row["fedavg_worst_client"] = fc
                row["fedavg_worst_client_accuracy"] = m["per_client_accuracy"][str(fc)]
            worst.append(row)
    return {"last_n": last_n, "confidence": confidence, "seeds_done": done, "arms": arms, "paired": paired,
            "worst_clients": worst, "split_check": split_check(runs),
            "runs": {f"{a}-{s}": {k: v for k, v in m.items() if k not in ("curve",)} for (a, s), m in sorted(metrics.items())}}


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.2f}"


def _arm_cell(s: dict[str, Any]) -> str:
    if s["n"] < 2:
        return _pct(s["mean"])
    return f"{_pct(s['mean'])} ± {_pct(s['std'])}"


def _diff_cell(d: dict[str, Any]) -> str:
    per_seed = ", ".join(f"s{s}: {100 * v:+.2f}" for s, v in zip(d["seeds"], d["differences"]))
    interval = "n/a" if d["ci_low"] is None else f"[{100 * d['ci_low']:+.2f}, {100 * d['ci_high']:+.2f}]"
    mean = "n/a" if d["mean"] is None else f"{100 * d['mean']:+.2f}"
    return f"{per_seed} | {mean} | {interval}"


def markdown(summary: dict[str, Any], classes: list[str]) -> str:
    """The summary as the tables docs/cifar10-cpu-results.md shows."""
    n = summary["last_n"]
    lines = [f"Seeds done: {', '.join(map(str, summary['seeds_done']))}. Accuracy (%): each run's mean over its last {n} rounds "
             "of the federated evaluation (every client tests the global model on its own test/ folder), then mean ± "
             "sample sd over seeds.", "",
             "| arm | weighted accuracy | mean-client accuracy | worst-client accuracy | wall-clock per run (s) |", "|---|---|---|---|---|"]
    for arm, a in summary["arms"].items():
        walls = ", ".join(f"{v:.0f}" for v in a["wall_clock_s"].values())
        lines.append(f"| {arm} | {_arm_cell(a['weighted_accuracy'])} | {_arm_cell(a['mean_accuracy'])} | {_arm_cell(a['worst_accuracy'])} | {walls} |")
    lines += ["", f"Paired differences (same seed, same client folders), pp, {int(100 * summary['confidence'])}% t-interval:", "",
              "| difference | figure | per seed | mean | interval |", "|---|---|---|---|---|"]
    for pair, figs in summary["paired"].items():
        for fig in ("weighted_accuracy", "worst_accuracy", "mean_accuracy"):
            lines.append(f"| {pair} | {fig.replace('_', ' ')} | {_diff_cell(figs[fig])} |")
    lines += ["", "Per-class recall (%), last round, mean over seeds:", "",
              "| arm | " + " | ".join(classes) + " |", "|---|" + "---|" * len(classes)]
    for arm, a in summary["arms"].items():
        lines.append(f"| {arm} | " + " | ".join(f"{100 * r:.1f}" for r in a["per_class_recall_last_round"]) + " |")
    lines += ["", f"The worst client (lowest mean accuracy over the last {n} rounds), the clients that were worst in each of those "
              "rounds, and FedAvg's worst client followed into each arm:", "",
              "| seed | arm | worst client | its accuracy (%) | worst in rounds (client: rounds) | train / test images | classes it holds | FedAvg's worst client: accuracy (%) |",
              "|---|---|---|---|---|---|---|---|"]
    for w in summary["worst_clients"]:
        held = ", ".join(classes[i] for i in w["classes_held"])
        followed = f"client {w['fedavg_worst_client']}: {_pct(w['fedavg_worst_client_accuracy'])}" if "fedavg_worst_client" in w else "n/a"
        rounds = ", ".join(f"{c}: {k}" for c, k in w["worst_each_round"].items())
        lines.append(f"| {w['seed']} | {w['arm']} | {w['worst_client']} | {_pct(w['accuracy'])} | {rounds} | {w['train_images']} / {w['test_images']} | {held} | {followed} |")
    check = summary["split_check"]
    if check is not None:
        lines += ["", f"Split mode against local mode (FedAvg, seed 0): {check['equal_rounds']} of {check['rounds']} rounds equal, "
                  f"largest difference {check['max_abs_difference']:.3g}."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local-root", required=True, help="folder holding seed-<S>/ written by fedsynth data split")
    parser.add_argument("--runs", required=True, help="folder for the runs (<arm>-<seed>/)")
    parser.add_argument("--data-dir", required=True, help="the dataset folder (for the split-mode check)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--split-check", action="store_true", help="also run FedAvg seed 0 in split mode and compare")
    parser.add_argument("--summary-only", action="store_true", help="run nothing; summarise the runs that exist")
    parser.add_argument("--out", default=None, help="folder for summary.json and summary.md")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    seeds = [int(s) for s in args.seeds.split(",")]
    if not args.summary_only:
        run_all(args, seeds)
    if args.out:
        experiment = load_experiment(CONFIG, [f"data.data_dir={json.dumps(args.data_dir)}"])
        summary = summarize_runs(Path(args.runs), Path(args.local_root), seeds, experiment.settings.last_n, experiment.settings.confidence)
        classes = tomllib.loads((Path(args.local_root) / f"seed-{seeds[0]}" / "schema.toml").read_text())["data"]["classes"]
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        (out / "summary.md").write_text(markdown(summary, classes))
        log.info("wrote %s and %s", out / "summary.json", out / "summary.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
