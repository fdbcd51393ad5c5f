"""The side-by-side generator table on digits: central, federated (IID, Dirichlet), user and sample DP, SDA-FL's
DP-GANs and the `small` reference, each scored by `fedsynth generator evaluate` on the same cached judge.

One cell is one row x seed. A cell trains (its own subprocess), scores, and writes OUT/cells/ROW-sSEED.json; a cell
whose JSON exists is skipped, so a kill loses at most the cell in progress (its work folder is redone from scratch,
so its wall-clock stays that of one uninterrupted run). Cells run seed-major, one at a time.

    PYTHONPATH=. python benchmarks/federated_generator_table.py --out runs/gentable [--steps 1000] [--seeds 0,1,2]
        [--rows central,fed-iid,...] [--stop-at 11:00] [--smoke] [--table-only] [--curve]

Every row spends the same number of UNet optimizer steps, S = --steps, counted over all clients: a federated run of
K clients all sampled each round with L local steps plays R = S / (K L) rounds (sequential depth R L = S / K).
SDA-FL trains DP-GANs, not the UNet: its row runs `sdafl` at its defaults and scores the pooled images (read from the
run's final checkpoint, which keeps them) with the pseudo-labels SDA-FL gave them by its last round; the unlabelled
ones cannot be scored by class (their share is `coverage`), and when `evaluate` refuses the labelled ones (a class
with fewer than 2 images) the cell records why. All pooled images are also scored with round-robin labels, of which
only the label-free figures are kept (the Fréchet distance, the judge's classes).

`--curve` runs, instead, epsilon against quality: sample DP at epsilon 1, 10, 100 and 1,000 (K = 10, IID, so that only
DP separates them from the federated IID row), user DP at 100 and 1,000 (K = 100, IID; 10 is the table's row 4), and
per-image clipping with almost no noise (sigma 0.01) at S = 1 and S = 100.

The launcher gives the coordinator and each client process a process group of its own (one session): to pause a
running table, signal the session (`pkill -STOP -s SID`), not the driver's process group.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
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
PER_CLASS = 50  # images per class the judge scores (docs/federated-generator.md's K = 10 / 100 runs used 50 too)
# One torch thread a process, as the federated clients' runtime.torch_threads = 1: on the 2 shared cores, torch's
# default of 2 threads spent 4x the CPU-seconds per step of one thread once the load average passed 10.
THREADS = 1
LIVENESS = ["runtime.heartbeat_timeout_s=120", "runtime.rejoin_grace_s=120", "runtime.round_timeout_s=3600",
            "runtime.registration_timeout_s=900"]  # survive a SIGSTOP of the whole process group for ~40 s


@dataclass(frozen=True)
class Row:
    name: str
    label: str
    kind: str  # central | federate | sdafl
    size: str = "tiny"
    clients: int = 10
    partition: str = "iid"
    dp: str = "none"
    local_steps: int = 10
    clients_per_process: int = 5
    epsilon: float = 10.0  # the target epsilon of a DP row
    sigma: float | None = None  # instead of a target epsilon: this noise multiplier, and `clip`
    clip: float = 1.0


def rows(steps: int, smoke: bool) -> list[Row]:
    local = 1 if smoke else 10
    return [
        Row("central", "central, union of the shards (= the whole train split)", "central"),
        Row("fed-iid", "federated IID, K = 10", "federate", local_steps=local),
        Row("fed-dir", "federated Dirichlet 0.1, K = 10", "federate", partition="dirichlet", local_steps=local),
        Row("fed-user", "federated + user DP eps 10, K = 100 IID", "federate", clients=100, dp="user",
            local_steps=1 if smoke else 2, clients_per_process=50),
        Row("fed-sample", "federated + sample DP eps 10, K = 10, Dirichlet 0.1", "federate", partition="dirichlet",
            dp="sample", local_steps=local),
        Row("sdafl", "SDA-FL's DP-GANs pooled (eps 10 per client, K = 10, Dirichlet 0.1)", "sdafl"),
        Row("central-small", "`small`, central, whole train split (reference)", "central", size="small"),
    ]


def curve_rows(smoke: bool) -> list[Row]:
    """`--curve`: epsilon against quality, IID so that only DP differs from the federated IID row (its epsilon: none)."""
    local = 1 if smoke else 10
    sample = [Row(f"fed-sample-iid-e{e:g}", f"federated + sample DP eps {e:g}, K = 10 IID", "federate", dp="sample",
                  local_steps=local, epsilon=e) for e in (1.0, 10.0, 100.0, 1000.0)]
    user = [Row(f"fed-user-e{e:g}", f"federated + user DP eps {e:g}, K = 100 IID", "federate", clients=100, dp="user",
                local_steps=1 if smoke else 2, clients_per_process=50, epsilon=e) for e in (100.0, 1000.0)]
    # clipping alone (sigma 0.01: epsilon in the millions), at S = 1 and at S = 100: how much of the gap is the clip
    clipped = [Row(f"fed-sample-iid-clip{c:g}", f"federated + per-image clipping at S = {c:g}, sigma 0.01, K = 10 IID",
                   "federate", dp="sample", local_steps=local, sigma=0.01, clip=c) for c in (1.0, 100.0)]
    return sample + user + clipped


def rounds_for(row: Row, steps: int) -> int:
    per_round = row.clients * row.local_steps
    if steps % per_round:
        raise SystemExit(f"--steps {steps} is not a multiple of {row.name}'s {row.clients} clients x {row.local_steps} local steps")
    return steps // per_round


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "fedsynth.cli", *args]


def sets(items: list[str]) -> list[str]:
    return [part for item in items for part in ("--set", item)]


def federate_overrides(row: Row, seed: int) -> list[str]:
    out = [f"seed={seed}", f"data.clients={row.clients}", f"data.partition={json.dumps(row.partition)}",
           f"runtime.clients_per_process={row.clients_per_process}", *LIVENESS]
    return out + (["data.alpha=0.1"] if row.partition == "dirichlet" else [])


def train_command(row: Row, seed: int, steps: int, work: Path, smoke: bool) -> list[str]:
    if row.kind == "central":
        return cli("generator", "train", "--dataset", "digits", "--size", row.size, "--steps", str(steps), "--seed", str(seed),
                   "--grid-per-class", "0", "--no-progress", "--threads", str(THREADS), "--out", str(work / "model"))
    if row.kind == "federate":
        command = cli("generator", "federate", "--size", row.size, "--rounds", str(rounds_for(row, steps)),
                      "--local-steps", str(row.local_steps), "--dp", row.dp, "--grid-per-class", "0", "--no-progress",
                      "--out", str(work / "model"), *sets(federate_overrides(row, seed)))
        if row.dp != "none" and row.sigma is not None:
            return command + sets([f"federate.noise_multiplier={row.sigma}", f"federate.clip={row.clip}"])
        return command + (["--target-epsilon", f"{row.epsilon:g}"] if row.dp != "none" else [])
    extra = ["train.rounds=2", "sdafl.gan_steps=5"] if smoke else []
    return cli("run", "--no-progress", "--out-dir", str(work / "run"),
               *sets(['train.algorithm="sdafl"', 'generation.policy="none"', f"seed={seed}", "runtime.clients_per_process=5",
                      *LIVENESS, *extra]))


def pooled_from_checkpoint(run_dir: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(images, last pseudo-labels with -1 = unlabelled, uploading client) of SDA-FL's shared set, read from the run's
    final checkpoint, which keeps the set and its labels to resume (tensors `synthetic/images_K`, `synthetic/labels_K`)."""
    from safetensors.numpy import load_file

    tensors = load_file(str(run_dir / "checkpoint.safetensors"))
    clients = sorted(int(k.removeprefix("synthetic/images_")) for k in tensors if k.startswith("synthetic/images_"))
    x = np.concatenate([tensors[f"synthetic/images_{c}"] for c in clients])
    y = np.concatenate([tensors[f"synthetic/labels_{c}"] for c in clients])
    owner = np.concatenate([np.full(len(tensors[f"synthetic/labels_{c}"]), c) for c in clients])
    return x, y, owner


def pooled_sdafl_images(run_dir: Path, labelled: Path, every: Path) -> dict[str, Any]:
    """SDA-FL's pooled DP-GAN images: the labelled ones with their last pseudo-labels to `labelled`, and all of them to
    `every` with round-robin labels (for the label-free figures only: Fréchet distance, the judge's classes)."""
    from generator_service import load_judge

    x, y, owner = pooled_from_checkpoint(run_dir)
    keep = y >= 0
    np.savez(labelled, x=x[keep], y=y[keep])
    # `evaluate` refuses a labelled set that misses a class; its recognizability, computed the same way here
    judged = load_judge("digits").score(x[keep])[1].argmax(axis=1) if keep.any() else y[keep]
    np.savez(every, x=x, y=np.arange(len(x)) % 10)
    rounds = json.loads((run_dir / "coordinator.json").read_text())["rounds"]
    return {"pooled": int(len(y)), "labelled": int(keep.sum()), "coverage": float(keep.mean()),
            "uploaders": len(set(owner.tolist())), "labels_per_class": np.bincount(y[keep], minlength=10).tolist(),
            "labelled_by_client": {str(c): int(keep[owner == c].sum()) for c in sorted(set(owner.tolist()))},
            "judge_agrees_with_labels": float((judged == y[keep]).mean()) if keep.any() else None,
            "judge_classes_of_labelled": np.bincount(judged, minlength=10).tolist(),
            "coverage_per_round": [r.get("pseudo_label_coverage") for r in rounds],
            # SDA-FL's own diagnostic (sdafl.track_agreement): its labels against a logistic regression on the real split
            "reference_agreement_per_round": [r.get("pseudo_label_agreement") for r in rounds]}


def label_free(scores: Path) -> dict[str, Any]:
    """From `evaluate` on round-robin labels: only what does not depend on the labels."""
    full = json.loads(scores.read_text())
    return {"frechet": full["frechet"], "real_test_frechet": full["real_test_frechet"], "n_images": full["n_images"],
            "judge_classes": np.asarray(full["confusion"]).sum(axis=0).astype(int).tolist()}  # columns: the judge's class


def union_check(row: Row, seed: int) -> dict[str, Any]:
    """What a federated row's clients train on, together: the whole digits train split, each image once?"""
    from fedsynth.assembly import local_test_fraction
    from fedsynth.config import load_config
    from fedsynth.learning.data import load_labels
    from fedsynth.learning.partition import partition_for

    model = 'train.model="unet-tiny"' if row.kind == "federate" else 'train.model="cnn"'
    algorithm = '"ddpm"' if row.kind == "federate" else '"sdafl"'
    cfg = load_config(None, [f"train.algorithm={algorithm}", 'generation.policy="none"', model,
                             *(federate_overrides(row, seed) if row.kind == "federate" else [f"seed={seed}"])])
    labels = load_labels("digits", "train")
    parts = partition_for(cfg.data, cfg.seed, labels)
    joined = np.sort(np.concatenate(parts))
    return {"train_split": int(len(labels)), "union": int(len(np.unique(joined))), "sum_of_shards": int(len(joined)),
            "whole_split_once": bool(np.array_equal(joined, np.arange(len(labels)))),
            "local_test_fraction": local_test_fraction(cfg), "holdout_fraction": cfg.data.holdout_fraction,
            "shard_sizes": sorted(len(p) for p in parts)}


def score(source: list[str], target: Path, log: Path, cell: dict[str, Any], key: str) -> dict[str, Any]:
    """`generator evaluate` on `source` (its seconds under cell[key]); the headline figures, or the reason it refused."""
    try:
        cell[key] = timed(cli("generator", "evaluate", *source, "--seed", "0", "--threads", str(THREADS), "--json", str(target)), log)
    except SystemExit as failure:
        lines = [line for line in log.read_text().splitlines() if "error" in line.lower()]
        return {"error": lines[-1] if lines else str(failure)}
    full = json.loads(target.read_text())
    out = {k: full[k] for k in ("recognizability", "cas", "frechet", "real_test_frechet", "n_images", "judge_test_accuracy",
                                "mean_confidence") if k in full}
    return {**out, "per_class_recognizability": full.get("per_class_recognizability")}


def score_all_pooled(work: Path, cell: dict[str, Any]) -> None:
    target = work / "evaluate-all.json"
    failed = score(["--images", str(work / "pooled-all.npz"), "--dataset", "digits"], target, work / "cell.log", cell, "evaluate_all")
    cell["all_pooled"] = failed if "error" in failed else label_free(target)


def timed(command: list[str], log: Path) -> dict[str, float]:
    """Run `command` (its output to `log`); wall-clock and the CPU-seconds of it and every process it waited for."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    with log.open("a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        code = subprocess.call(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if code != 0:
        raise SystemExit(f"exit code {code}: {' '.join(command)} (see {log})")
    return {"wall_s": time.monotonic() - started, "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)}


def run_cell(row: Row, seed: int, steps: int, out: Path, smoke: bool) -> dict[str, Any]:
    work = out / "work" / f"{row.name}-s{seed}"
    shutil.rmtree(work, ignore_errors=True)  # a cell cut off mid-way is redone whole
    work.mkdir(parents=True)
    log = work / "cell.log"
    cell: dict[str, Any] = {"row": row.name, "label": row.label, "seed": seed, "steps": steps, "smoke": smoke,
                            "started": datetime.datetime.now().isoformat(timespec="seconds"), "load_before": os.getloadavg(),
                            "torch_threads": THREADS}
    if row.kind == "federate":
        rounds = rounds_for(row, steps)
        cell["setting"] = {"clients": row.clients, "partition": row.partition, "dp": row.dp, "rounds": rounds,
                           "local_steps": row.local_steps, "depth": rounds * row.local_steps, "batch_size": 64,
                           "clients_per_process": row.clients_per_process}
    if row.kind != "central":
        cell["union"] = union_check(row, seed)
    cell["train"] = timed(train_command(row, seed, steps, work, smoke), log)
    if row.kind == "sdafl":
        images = work / "pooled.npz"
        cell["sdafl"] = pooled_sdafl_images(work / "run", images, work / "pooled-all.npz")
        report = json.loads((work / "run" / "report.json").read_text())
        gans = report.get("sdafl") or {}
        cell["sdafl"]["gan_seconds"] = sum(v["gan_seconds"] for v in gans.values())
        cell["sdafl"]["epsilon_max"] = max((v["epsilon"] for v in gans.values()), default=None)
        cell["sdafl"]["classifier_final_accuracy"] = report.get("final_accuracy")
        source = ["--images", str(images), "--dataset", "digits"]
    else:
        source = ["--backend", "ddpm", "--model", str(work / "model"), "--dataset", "digits", "--per-class", str(PER_CLASS)]
        if row.kind == "federate":
            report = json.loads((work / "model" / "report.json").read_text())
            cell["privacy"] = report.get("privacy")
            cell["train"]["phases_s"] = report.get("phases_s")
            cell["train"]["bytes"] = report.get("bytes")
            cell["held_out_loss"] = [r["loss"] for r in report.get("rounds", [])]
    cell["scores"] = score(source, work / "evaluate.json", log, cell, "evaluate")
    if row.kind == "sdafl":
        score_all_pooled(work, cell)
    cell["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
    cell["load_after"] = os.getloadavg()
    return cell


def table(out: Path, all_rows: list[Row]) -> str:
    """Mean ± sample std over the seeds done; a cell whose images could not be scored counts in `seeds` only."""
    lines = ["| row | seeds | recognizability | CAS | Fréchet | train wall-clock s | train CPU-s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for row in all_rows:
        cells = [json.loads(p.read_text()) for p in sorted((out / "cells").glob(f"{row.name}-s[0-9]*.json"))]
        variants = [("scores", row.label)]
        if row.kind == "sdafl":
            variants.append(("all_pooled", "the same, all pooled images (Fréchet only: label-free)"))
        for key, label in variants:
            if not cells:
                continue

            def stat(get: Any, digits: int, key: str | None = key) -> str:
                values = np.array([get(c) for c in cells if key is None or "error" not in c[key]], dtype=float)
                if not len(values):
                    return "n/a"
                spread = f" ± {values.std(ddof=1):.{digits}f}" if len(values) > 1 else ""
                return f"{values.mean():.{digits}f}{spread}" + (f" ({len(values)})" if len(values) < len(cells) else "")

            labelled = key != "all_pooled"
            if row.kind == "sdafl" and labelled:  # `evaluate` refused the labelled set: the judge's agreement, by hand
                recognizable = stat(lambda c: c["sdafl"]["judge_agrees_with_labels"], 3, None) + "*"
            else:
                recognizable = stat(lambda c: c[key]["recognizability"], 3) if labelled else "-"
            lines.append(f"| {label} | {len(cells)} | {recognizable} | "
                         f"{stat(lambda c: c[key]['cas'], 3) if labelled else '-'} | {stat(lambda c: c[key]['frechet'], 1)} | "
                         f"{stat(lambda c: c['train']['wall_s'], 0, None)} | {stat(lambda c: c['train']['cpu_s'], 0, None)} |")
    return "\n".join(lines)


def cell_table(out: Path, all_rows: list[Row]) -> str:
    """Every cell's cost: training wall-clock and CPU-seconds (the command and every process it waited for), scoring
    wall-clock, and the load average (1 min) when it started."""
    lines = ["| row | seed | started | load | train wall s | train CPU-s | scoring wall s | torch threads (train / scoring) |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    for row in all_rows:
        for path in sorted((out / "cells").glob(f"{row.name}-s[0-9]*.json")):
            c = json.loads(path.read_text())
            threads = c.get("torch_threads", 2)  # cells before THREADS existed ran torch's default, 2 here
            train_threads = threads if row.kind == "central" else 1  # federated and SDA-FL processes: runtime.torch_threads
            scoring = c.get("evaluate", c.get("evaluate_all", {})).get("wall_s", float("nan"))
            lines.append(f"| {row.name} | {c['seed']} | {c['started'][11:16]} | {c['load_before'][0]:.1f} | {c['train']['wall_s']:.0f} | "
                         f"{c['train']['cpu_s']:.0f} | {scoring:.0f} | {train_threads} / {threads} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=1000, help="UNet optimizer steps per row, summed over clients")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--rows", default=None, help="comma-separated row names (default: all)")
    parser.add_argument("--stop-at", default=None, help="HH:MM: start no cell after this time of day")
    parser.add_argument("--smoke", action="store_true", help="seconds-long settings, to check every path")
    parser.add_argument("--table-only", action="store_true")
    parser.add_argument("--curve", action="store_true", help="the epsilon rows instead of the side-by-side table's")
    args = parser.parse_args()
    all_rows = curve_rows(args.smoke) if args.curve else rows(args.steps, args.smoke)
    chosen = [r for r in all_rows if args.rows is None or r.name in args.rows.split(",")]
    (args.out / "cells").mkdir(parents=True, exist_ok=True)
    stop = None
    if args.stop_at:
        hour, minute = map(int, args.stop_at.split(":"))
        stop = datetime.datetime.now().replace(hour=hour, minute=minute, second=0, microsecond=0)
    for path in sorted((args.out / "cells").glob("sdafl-s[0-9]*.json")):  # cells an earlier version of this file wrote
        cell, work = json.loads(path.read_text()), args.out / "work" / path.stem
        if not ("all_pooled" in cell and "judge_agrees_with_labels" in cell["sdafl"]) and (work / "run").is_dir():
            for stale in ("scores_judge_labels", "evaluate_judge_labels"):
                cell.pop(stale, None)
            cell["sdafl"] = {**cell["sdafl"], **pooled_sdafl_images(work / "run", work / "pooled.npz", work / "pooled-all.npz")}
            cell["sdafl"].pop("label_check", None)
            cell["sdafl"].pop("judge_labels_per_class", None)
            score_all_pooled(work, cell)
            path.write_text(json.dumps(cell, indent=2))
    for seed in ([] if args.table_only else [int(s) for s in args.seeds.split(",")]):
        for row in chosen:
            target = args.out / "cells" / f"{row.name}-s{seed}.json"
            if target.exists():
                continue
            if stop is not None and datetime.datetime.now() >= stop:
                print(f"{datetime.datetime.now():%H:%M:%S} past --stop-at {args.stop_at}: no more cells", flush=True)
                print(table(args.out, all_rows))
                return 0
            print(f"{datetime.datetime.now():%H:%M:%S} cell {row.name} seed {seed} ...", flush=True)
            cell = run_cell(row, seed, args.steps, args.out, args.smoke)
            target.write_text(json.dumps(cell, indent=2))
            print(f"{datetime.datetime.now():%H:%M:%S} cell {row.name} seed {seed}: {json.dumps(cell['scores'])[:300]}; "
                  f"train {cell['train']['wall_s']:.0f} s wall {cell['train']['cpu_s']:.0f} CPU-s", flush=True)
    print(table(args.out, all_rows))
    print()
    print(cell_table(args.out, all_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
