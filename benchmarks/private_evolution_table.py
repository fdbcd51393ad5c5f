"""Private Evolution on digits, side by side with the public model alone: `fedsynth generator evolve` cells (each its
own processes: generator, coordinator, client nodes), each scored by `fedsynth generator evaluate` on the cached
digits judge, the same judge as docs/federated-generator.md's table.

    PYTHONPATH=. python benchmarks/private_evolution_table.py --public-model DIR --out runs/pe-table [--seeds 0,1,2]
        [--rows public,pe-sample-10,...] [--iterations 10] [--per-class 50] [--table-only]

A cell is one row x seed and writes OUT/cells/ROW-sSEED.json; a cell whose JSON exists is skipped (a kill loses at
most the cell in progress, whose folder is redone from scratch). The seed fixes the partition, the votes' noise, the
draws and the generator's noise; `public` scores the public model itself at scoring seed s (what an operator gets
without the clients at all). Every row is scored on the same number of images per class (`--score-per-class`):
beyond the M evolved images of a class, the evolved folder serves variations of them, as it would serve FedEAS.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
JUDGE_SEED = 0  # one judge for every cell: the cached digits judge of docs/federated-generator.md's table


@dataclass(frozen=True)
class Row:
    name: str
    label: str
    dp: str = "none"  # none | sample | user; "public" rows run no evolution
    epsilon: float | None = None
    clients: int = 10
    partition: str = "dirichlet"


ROWS = {row.name: row for row in (
    Row("public", "public model alone (no votes)", dp="public"),
    Row("pe-none", "PE, no DP (the votes unnoised)"),
    Row("pe-sample-10", "PE, sample-level DP, epsilon 10", "sample", 10.0),
    Row("pe-sample-1", "PE, sample-level DP, epsilon 1", "sample", 1.0),
    Row("pe-user-10", "PE, user-level DP, epsilon 10", "user", 10.0),
    Row("pe-user-1", "PE, user-level DP, epsilon 1", "user", 1.0),
    Row("pe-user-10-k100", "PE, user-level DP, epsilon 10, K = 100 IID", "user", 10.0, clients=100, partition="iid"),
)}


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(command: list[str], log: Path) -> None:
    with log.open("w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:4])} failed ({done.returncode}); see {log}")


def evaluate(model: Path, seed: int, per_class: int, out: Path) -> dict[str, Any]:
    json_path = out / "evaluate.json"
    run([sys.executable, "-m", "fedsynth.cli", "generator", "evaluate", "--backend", "ddpm", "--model", str(model),
         "--dataset", "digits", "--per-class", str(per_class), "--seed", str(seed), "--judge-seed", str(JUDGE_SEED), "--threads", "1",
         "--json", str(json_path), "--grid", str(out / "grid.png")], out / "evaluate.log")
    return json.loads(json_path.read_text())


def cell(row: Row, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    work = args.out / "work" / f"{row.name}-s{seed}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    started, cpu = time.monotonic(), children_cpu_s()
    result: dict[str, Any] = {"row": row.name, "label": row.label, "seed": seed, "started": time.strftime("%H:%M:%S")}
    model = args.public_model
    if row.dp != "public":
        model = work / "evolved"
        command = [sys.executable, "-m", "fedsynth.cli", "generator", "evolve", "--public-model", str(args.public_model),
                   "--iterations", str(args.iterations), "--candidates-per-class", str(args.per_class), "--dp", row.dp,
                   "--out", str(model), "--no-progress", "--grid-per-class", "10",
                   "--set", f"seed={seed}", "--set", f"data.clients={row.clients}", "--set", f'data.partition="{row.partition}"',
                   "--set", "runtime.torch_threads=1", "--set", f"runtime.clients_per_process={min(row.clients, 50)}"]
        if row.epsilon is not None:
            command += ["--target-epsilon", str(row.epsilon)]
        run(command, work / "evolve.log")
        report = json.loads((model / "report.json").read_text())
        rounds = report["rounds"]
        result.update(
            epsilon=report["provenance"]["epsilon"], noise_multiplier=report["provenance"]["noise_multiplier"],
            evolve_wall_s=time.monotonic() - started, evolve_cpu_s=children_cpu_s() - cpu,
            generator_device_s=report["generation"]["device_seconds"],
            generator_images=report["generation"]["generator"]["images_total"],
            bytes_sent_per_client_iteration=float(np.mean([r["bytes_sent"] / len(r["participants"]) for r in rounds])),
            bytes_received_per_client_iteration=float(np.mean([r["bytes_received"] / len(r["participants"]) for r in rounds])),
            client_vote_s_per_iteration=float(np.mean([r["phases_s"]["training"] for r in rounds])),
        )
    result.update(evaluate(model, seed, args.score_per_class, work))
    result["wall_s"] = time.monotonic() - started
    return result


def rescore(row: Row, seed: int, args: argparse.Namespace, done: dict[str, Any]) -> dict[str, Any]:
    """A cell scored by another judge (an older driver's, seeded by the cell's seed): its model scored again."""
    work = args.out / "work" / f"{row.name}-s{seed}"
    model = args.public_model if row.dp == "public" else work / "evolved"
    return {**done, **evaluate(model, seed, args.score_per_class, work)}


def table(cells: list[dict[str, Any]], rows: list[str]) -> str:
    lines = ["| row | seeds | recognizability | CAS | Fréchet | epsilon | generator device-s | bytes to / from a client per iteration | client voting s per iteration |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in rows:
        mine = [c for c in cells if c["row"] == name]
        if not mine:
            continue

        def stat(key: str, digits: int = 3) -> str:
            values = [c[key] for c in mine if c.get(key) is not None]
            if not values:
                return "-"
            return f"{np.mean(values):.{digits}f} ± {np.std(values):.{digits}f}" if len(values) > 1 else f"{values[0]:.{digits}f}"

        cost = "-" if "generator_device_s" not in mine[0] else stat("generator_device_s", 1)
        traffic = "-" if "bytes_sent_per_client_iteration" not in mine[0] else (
            f"{np.mean([c['bytes_sent_per_client_iteration'] for c in mine]) / 1e3:.1f} kB / "
            f"{np.mean([c['bytes_received_per_client_iteration'] for c in mine]) / 1e3:.1f} kB")
        lines.append(f"| {ROWS[name].label} | {len(mine)} | {stat('recognizability')} | {stat('cas')} | {stat('frechet', 1)} | "
                     f"{stat('epsilon', 2)} | {cost} | {traffic} | {stat('client_vote_s_per_iteration', 3)} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--public-model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--rows", default="public,pe-none,pe-sample-10,pe-sample-1,pe-user-10,pe-user-1")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--per-class", type=int, default=50, help="M, candidates per class")
    parser.add_argument("--score-per-class", type=int, default=50, help="images per class the judge scores")
    parser.add_argument("--table-only", action="store_true")
    args = parser.parse_args()
    rows = args.rows.split(",")
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    cells_dir = args.out / "cells"
    cells_dir.mkdir(parents=True, exist_ok=True)
    for seed in [int(s) for s in args.seeds.split(",")]:
        for name in rows:
            path = cells_dir / f"{name}-s{seed}.json"
            if args.table_only or (path.is_file() and json.loads(path.read_text()).get("judge_seed") == JUDGE_SEED):
                continue
            result = rescore(ROWS[name], seed, args, json.loads(path.read_text())) if path.is_file() else cell(ROWS[name], seed, args)
            path.write_text(json.dumps(result, indent=2) + "\n")
            print(f"{name} seed {seed}: recognizability {result['recognizability']:.3f} CAS {result['cas']:.3f} "
                  f"Fréchet {result['frechet']:.1f} ({result['wall_s']:.0f} s)", flush=True)
    cells = [json.loads(p.read_text()) for p in sorted(cells_dir.glob("*.json"))]
    print(table(cells, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
