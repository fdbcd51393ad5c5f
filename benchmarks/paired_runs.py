"""Paired comparison of finished run folders that `fedsynth experiment` did not plan (e.g. one arm rerun with another
generator): last-N accuracy per arm and seed, paired differences with Student-t intervals, generation cost.

    PYTHONPATH=. python benchmarks/paired_runs.py --seeds 0,1,2,3,4,5,6,7,8,9 \
        --arm fedavg=runs/experiments/cifar10-fedeas-fedgen/fedavg-{seed} \
        --arm central=runs/experiments/cifar10-cpu-small-recipe-10seeds/fedeas-{seed} \
        --pair central:fedavg --json summary.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from deploy.experiment import parse_seeds
from deploy.experiment_summary import run_metrics
from deploy.stats import paired_difference, summarize
from fedsynth.errors import ConfigError


def arm_runs(pattern: str, seeds: list[int], last_n: int) -> dict[int, dict[str, Any]]:
    """Each seed's run metrics; a seed whose folder is missing or whose run failed is left out, and said so."""
    runs = {}
    for seed in seeds:
        folder = Path(pattern.format(seed=seed))
        report = folder / "report.json"
        if not report.exists() or not json.loads(report.read_text()).get("success"):
            print(f"left out: {folder} (no successful report.json)", file=sys.stderr)
            continue
        runs[seed] = run_metrics(folder, last_n, threshold=1.0)
    return runs


def compare(arms: dict[str, str], pairs: list[tuple[str, str]], seeds: list[int], last_n: int,
            confidence: float) -> dict[str, Any]:
    metrics = {name: arm_runs(pattern, seeds, last_n) for name, pattern in arms.items()}
    accuracy = {name: {s: 100 * m["last_n_accuracy"] for s, m in runs.items()} for name, runs in metrics.items()}
    out: dict[str, Any] = {"last_n": last_n, "confidence": confidence, "arms": {}, "pairs": {}}
    for name, runs in metrics.items():
        out["arms"][name] = {
            "pattern": arms[name], "seeds": sorted(runs), "accuracy_by_seed": accuracy[name],
            "accuracy": summarize(list(accuracy[name].values()), confidence).to_dict(),
            "generated_images": summarize([m["budget"] for m in runs.values()], confidence).to_dict(),
            "device_seconds": summarize([m["device_seconds"] for m in runs.values()], confidence).to_dict(),
            "wall_clock_s": summarize([m["wall_clock_s"] for m in runs.values()], confidence).to_dict(),
        }
    for a, b in pairs:
        out["pairs"][f"{a} - {b}"] = paired_difference(accuracy[a], accuracy[b], confidence).to_dict()
    return out


def markdown(summary: dict[str, Any]) -> str:
    lines = [f"| arm | seeds | last-{summary['last_n']} accuracy, % (mean ± std) | generated images | device-s | wall-clock s |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, arm in summary["arms"].items():
        acc, images, device, wall = arm["accuracy"], arm["generated_images"], arm["device_seconds"], arm["wall_clock_s"]
        lines.append(f"| {name} | {acc['n']} | {acc['mean']:.2f} ± {acc['std'] or 0:.2f} | {images['mean']:.0f} | "
                     f"{device['mean']:.0f} | {wall['mean']:.0f} |")
    lines += ["", f"| paired difference, pp | seeds | mean | {summary['confidence']:.0%} interval | by seed |",
              "|---|---:|---:|---|---|"]
    for name, pair in summary["pairs"].items():
        interval = "n/a" if pair["ci_low"] is None else f"[{pair['ci_low']:+.2f}, {pair['ci_high']:+.2f}]"
        by_seed = ", ".join(f"{d:+.2f}" for d in pair["differences"])
        lines.append(f"| {name} | {pair['n']} | {pair['mean']:+.2f} | {interval} | {by_seed} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", required=True, help="comma-separated seeds, as fedsynth experiment's")
    parser.add_argument("--arm", action="append", required=True, help="NAME=FOLDER pattern with {seed}")
    parser.add_argument("--pair", action="append", default=[], help="A:B, reports A - B per seed")
    parser.add_argument("--last-n", type=int, default=10, help="rounds averaged at the end (default 10)")
    parser.add_argument("--confidence", type=float, default=0.95)
    parser.add_argument("--json", type=Path, help="write the summary here too")
    args = parser.parse_args()
    arms = dict(item.split("=", 1) for item in args.arm)
    pairs = [tuple(item.split(":", 1)) for item in args.pair]
    unknown = sorted({name for pair in pairs for name in pair} - set(arms))
    if unknown:
        parser.error(f"--pair names arms {unknown} that no --arm defines")
    try:
        seeds = parse_seeds(args.seeds, 0)
    except ConfigError as exc:
        parser.error(str(exc))
    summary = compare(arms, pairs, seeds, args.last_n, args.confidence)  # type: ignore[arg-type]
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    print(markdown(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
