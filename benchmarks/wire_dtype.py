"""Accuracy and bytes received with runtime.wire_dtype float32 / float16 / bfloat16: real `fedsynth run`s, several seeds.

The default run settings (digits, 10 clients, small CNN, FedAvg) with generation.policy none and train.rounds 10,
once per (seed, wire dtype); prints a markdown table of the last round's test accuracy and the coordinator's
bytes_received per round (report.json), and writes it to --out when given.

    python benchmarks/wire_dtype.py --seeds 0 1 2 [--rounds 10] [--clients-per-process 10] [--set KEY=VALUE ...] [--out FILE]

--set passes more settings to every run (TOML values, as `fedsynth run --set`), e.g. another dataset and model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from deploy.processes import fedsynth_command

DTYPES = ("float32", "float16", "bfloat16")


def one_run(folder: Path, seed: int, dtype: str, rounds: int, clients_per_process: int, extra: list[str]) -> dict[str, Any]:
    settings = {"seed": seed, "train.rounds": rounds, "generation.policy": "none", "runtime.wire_dtype": dtype,
                "runtime.clients_per_process": clients_per_process}
    pairs = [f"{key}={json.dumps(value)}" for key, value in settings.items()] + extra
    sets = [item for pair in pairs for item in ("--set", pair)]
    out = folder / f"{dtype}-seed{seed}"
    started = time.monotonic()
    done = subprocess.run(fedsynth_command("run", *sets, "--out-dir", str(out), "--no-progress"), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"run {out.name} failed ({done.returncode}): {done.stderr[-2000:]}")
    report = json.loads((out / "report.json").read_text())
    rounds_ = report["rounds"]
    return {"accuracy": rounds_[-1]["accuracy"], "bytes_received": statistics.mean(r["bytes_received"] for r in rounds_),
            "bytes_per_update": statistics.mean(r["bytes_received"] / len(r["participants"]) for r in rounds_),
            "wall_s": time.monotonic() - started}


def table(results: dict[str, list[dict[str, Any]]], seeds: list[int]) -> str:
    base = statistics.mean(r["bytes_received"] for r in results["float32"])
    lines = ["| wire dtype | last-round accuracy, mean ± sd | per seed (" + ", ".join(map(str, seeds)) + ") "
             "| bytes_received per round | per update | vs float32 |", "|---|---|---|---|---|---|"]
    for dtype, runs in results.items():
        accs = [r["accuracy"] for r in runs]
        received = statistics.mean(r["bytes_received"] for r in runs)
        lines.append(f"| {dtype} | {100 * statistics.mean(accs):.2f}% ± {100 * statistics.stdev(accs):.2f} "
                     f"| {', '.join(f'{100 * a:.2f}%' for a in accs)} | {received:,.0f} "
                     f"| {statistics.mean(r['bytes_per_update'] for r in runs):,.0f} | {received / base:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--clients-per-process", type=int, default=10, help="a runtime setting: results do not depend on it")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results: dict[str, list[dict[str, Any]]] = {dtype: [] for dtype in DTYPES}
    with tempfile.TemporaryDirectory(prefix="wire-dtype-") as folder:
        for seed in args.seeds:
            for dtype in DTYPES:
                run = one_run(Path(folder), seed, dtype, args.rounds, args.clients_per_process, args.settings)
                results[dtype].append(run)
                print(f"seed {seed} {dtype}: accuracy {run['accuracy']:.4f}, {run['bytes_received']:,.0f} bytes received per "
                      f"round, {run['wall_s']:.0f} s (load average {os.getloadavg()[0]:.1f})", flush=True)
    text = table(results, args.seeds)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
