"""Robust aggregation under attack: final accuracy and mean round time per rule, honest and with one attacker.

For each rule (mean; mean with runtime.max_update_norm = "auto"; median; trimmed_mean; krum) and each case (every
client honest; the last client sending its update x1,000, sign-flipped, or Gaussian noise of the honest norm, through
benchmarks/attack_client.py), over --seeds: one real federation on this machine (a coordinator, one process for the
honest clients, one for the attacker). Writes a JSON with every run and a markdown table.

    PYTHONPATH=. python benchmarks/robust_aggregation.py --clients 5 --rounds 10 --seeds 0,1,2 --out runs/robust
    # reduced CIFAR-10:
    PYTHONPATH=. python benchmarks/robust_aggregation.py --set data.dataset=\"cifar10\" --set data.data_dir=\"DIR\" ...

Read the honest column first: under strong label skew (digits' default Dirichlet alpha 0.1) the robust rules cost
accuracy with nobody attacking (DESIGN.md, docs/security.md).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from deploy.processes import ProcessGroup, fedsynth_command, wait_for_file

ATTACK_CLIENT = Path(__file__).resolve().parent / "attack_client.py"
RULES: dict[str, dict[str, Any]] = {
    "mean": {},
    "mean+auto": {"runtime.max_update_norm": "auto"},
    "median": {"train.aggregation": "median"},
    "trimmed_mean": {"train.aggregation": "trimmed_mean"},  # beta: --trim-beta
    "krum": {"train.aggregation": "krum"},
    "multi_krum": {"train.aggregation": "multi_krum"},
}
# Without --config: the embedded default run (digits, the small CNN) with no synthetic data (no generator service);
# the user's --set come after these.
DEFAULTS: dict[str, Any] = {"train.model": "cnn", "train.algorithm": "fedavg", "generation.policy": "none"}
DEFAULT_RULES = ("mean", "mean+auto", "median", "trimmed_mean", "krum")
CASES = ("honest", "scale", "signflip", "gaussian")


def toml_value(value: Any) -> str:
    """A --set value as TOML (what the coordinator parses): an inline table for a dict."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key} = {toml_value(item)}" for key, item in value.items()) + "}"
    return json.dumps(value)


def play(folder: Path, config: Path | None, raw_sets: list[str], settings: dict[str, Any], *, clients: int,
         attack: str | None, timeout_s: float) -> dict[str, Any]:
    """One run (`raw_sets`: the user's KEY=VALUE overrides as given; `settings` after them): {"final_accuracy",
    "accuracy_by_round", "mean_round_s", "mean_aggregation_s", "refused", "wall_s"}, or {"error"} where it failed."""
    sets = [item for override in raw_sets for item in ("--set", override)]
    sets += [item for key, value in settings.items() for item in ("--set", f"{key}={toml_value(value)}")]
    config_args = ["--config", str(config)] if config is not None else []
    shutil.rmtree(folder, ignore_errors=True)  # a run folder left from before would resume its checkpoint
    group = ProcessGroup(folder / "logs")
    started = time.monotonic()
    try:
        port_file = folder / "coordinator.port"
        coordinator = group.start("coordinator", fedsynth_command(
            "coordinator", *config_args, *sets, "--out-dir", str(folder / "run"), "--port", "0", "--port-file", str(port_file),
            "--insecure"))
        address = f"127.0.0.1:{wait_for_file(port_file, coordinator, timeout_s=180)}"
        common = ["--coordinator", address, "--torch-threads", "1", "--cache-dir", str(folder / "cache"), "--insecure"]
        honest = clients - 1 if attack else clients
        group.start("clients", fedsynth_command("client", "--clients", f"0-{honest - 1}", *common))
        if attack:
            group.start("attacker", [sys.executable, str(ATTACK_CLIENT), "--attack", attack, "--clients", str(clients - 1), *common])
        code = coordinator.process.wait(timeout=timeout_s)
    except Exception as exc:  # a run that fails is a result of the table, not the end of the benchmark
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        group.stop_all(grace_s=10.0)
    record_path = folder / "run" / "coordinator.json"
    if not record_path.exists():
        return {"error": f"coordinator exited with code {code}, no coordinator.json"}
    record = json.loads(record_path.read_text())
    rounds = record.get("rounds", [])
    if code != 0 or not rounds:
        return {"error": f"coordinator exited with code {code} after {len(rounds)} rounds"}
    return {
        "final_accuracy": float(rounds[-1]["accuracy"]),
        "accuracy_by_round": [float(r["accuracy"]) for r in rounds],
        "mean_round_s": statistics.fmean(float(r["duration_s"]) for r in rounds),
        "mean_aggregation_s": statistics.fmean(float(r.get("phases_s", {}).get("aggregation", 0.0)) for r in rounds),
        "refused": sum(len(r.get("update_norms", {}).get("refused", [])) for r in rounds),
        "wall_s": time.monotonic() - started,
    }


def cell(runs: list[dict[str, Any]], key: str, digits: int) -> str:
    values = [run[key] for run in runs if key in run]
    failed = len(runs) - len(values)
    if not values:
        return "failed"
    text = f"{statistics.fmean(values):.{digits}f}"
    if len(values) > 1:
        text += f" ± {statistics.stdev(values):.{digits}f}"
    return text + (f" ({failed} failed)" if failed else "")


LAST_ROUNDS = 5  # the second table's window: under strong label skew one round's accuracy swings by points


def with_last_rounds(run: dict[str, Any]) -> dict[str, Any]:
    """The run with `last_rounds_accuracy`: its mean accuracy over the last LAST_ROUNDS rounds."""
    accuracies = run.get("accuracy_by_round") or []
    return {**run, "last_rounds_accuracy": statistics.fmean(accuracies[-LAST_ROUNDS:])} if accuracies else run


def markdown(summary: dict[str, Any]) -> str:
    cases = summary["cases"]
    results = {rule: {case: [with_last_rounds(run) for run in runs] for case, runs in by_case.items()}
               for rule, by_case in summary["results"].items()}
    lines = [f"{summary['clients']} clients, {summary['rounds']} rounds, seeds {summary['seeds']} (mean ± std over "
             f"them); attacker = client {summary['clients'] - 1}; settings {summary['settings']}"]
    for key, title in (("final_accuracy", "Final accuracy"),
                       ("last_rounds_accuracy", f"Mean accuracy over the last {LAST_ROUNDS} rounds")):
        lines += ["", f"{title}:", "",
                  "| rule | " + " | ".join(cases) + f" | mean round s ({cases[0]}) | mean aggregation s ({cases[0]}) |",
                  "|---|" + "---:|" * (len(cases) + 2)]
        for rule, by_case in results.items():
            row = [cell(by_case[case], key, 4) for case in cases]
            lines.append(f"| {rule} | " + " | ".join(row) + f" | {cell(by_case[cases[0]], 'mean_round_s', 2)} | "
                         f"{cell(by_case[cases[0]], 'mean_aggregation_s', 4)} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, help="run config (TOML); without it the embedded default (digits)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override (TOML value)")
    parser.add_argument("--clients", type=int, default=5, help="K, all sampled each round (default 5)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seeds", default="0", help="comma-separated")
    parser.add_argument("--rules", default=",".join(DEFAULT_RULES), help=f"comma-separated, of {', '.join(RULES)}")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--trim-beta", type=float, default=0.2, help="trimmed_mean's beta (default 0.2: one cut at each "
                                                                     "end from 5 clients; the config default 0.1 cuts none below 10)")
    parser.add_argument("--out", type=Path, default=Path("runs/robust-aggregation"))
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="the most one run may take")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    rules = args.rules.split(",")
    cases = args.cases.split(",")
    unknown = sorted(set(rules) - set(RULES)) + sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown rule or case {unknown[0]!r}")
    base = {"data.clients": args.clients, "train.fraction": 1.0, "train.rounds": args.rounds}
    results: dict[str, dict[str, list[dict[str, Any]]]] = {rule: {case: [] for case in cases} for rule in rules}
    # Seed outermost, so a benchmark stopped part-way has whole tables for its first seeds; a run's result is kept
    # beside its folder and a rerun with the same --out skips it (resume).
    for seed in seeds:
        for rule in rules:
            settings = {**base, **RULES[rule]}
            if rule == "trimmed_mean":
                settings["train.aggregation_params"] = {"beta": args.trim_beta}
            for case in cases:
                folder = args.out / rule / case / f"seed-{seed}"
                kept = folder.with_name(f"seed-{seed}.json")
                if kept.exists():
                    run = json.loads(kept.read_text())
                else:
                    raw_sets = args.set if args.config else [f"{key}={toml_value(value)}" for key, value in DEFAULTS.items()] + args.set
                    run = play(folder, args.config, raw_sets, {**settings, "seed": seed}, clients=args.clients,
                               attack=None if case == "honest" else case, timeout_s=args.timeout_s)
                    if "error" not in run:
                        kept.write_text(json.dumps(run))
                print(f"{rule:>12} {case:>9} seed {seed}: {run.get('final_accuracy', run.get('error'))}", flush=True)
                results[rule][case].append({"seed": seed, **run})
    summary = {"clients": args.clients, "rounds": args.rounds, "seeds": seeds, "cases": cases, "settings": args.set,
               "trim_beta": args.trim_beta, "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    table = markdown(summary)
    (args.out / "summary.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
