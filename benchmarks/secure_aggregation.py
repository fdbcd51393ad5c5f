"""Secure aggregation (SecAgg+) cost: round time and bytes against plain FedAvg, client masking CPU, coordinator unmasking.

Part 1 starts real `fedsynth run`s, alternating plain and secure (runtime.secure_aggregation) so that the machine's
noise falls on both alike: K = 10 clients with ResNet-18 on digits (train.max_steps 1, so a round is mostly transfer,
masking and aggregation) and K = 100 with the small CNN (digits, alpha 0.3, one local epoch). Per run it reads
report.json: the median round duration_s over rounds 2.. (round 1 carries the warm-up: first model build, first
gRPC streams), the coordinator's bytes_received and bytes_sent per round, and the secure rounds' unmask_s. Part 2
times in process, with fedsynth.secagg's functions on real keys (advertise, share_keys through a ServerRound): one
client's stage-2 work (share_keys) and stage-3 work (flat_move + encode + with_weight + masked_input, what
client_node/secure_update.masked_update does) for ResNet-18- and CNN-sized vectors and several neighbour counts, in
CPU (time.process_time) and wall seconds; and the coordinator's ServerRound.unmask with 0, 1 and 2 dropped clients
(dropout recovery = unmask with dropouts minus without), checked against the known sum. Writes results.json and
table.md to --out and prints the tables.

    python benchmarks/secure_aggregation.py [--repeats 2] [--rounds-k10 3] [--skip-runs] [--out runs/benchmarks/secure-aggregation]

--repeats 2 (BENCHMARKS.md) took 10 minutes on 2 vCPUs; --skip-runs (part 2 only) about 30 s.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from deploy.processes import fedsynth_command  # noqa: E402
from fedsynth.learning.models import build_model  # noqa: E402
from fedsynth.secagg.model_vector import flat_move, round_context, vector_length  # noqa: E402
from fedsynth.secagg.protocol import ServerRound, advertise, masked_input, share_keys, unmask_shares  # noqa: E402
from fedsynth.secagg.quantize import QuantRange, encode, with_weight  # noqa: E402

SETTINGS = {  # the two federations of part 1; every run adds generation.policy "none" and the secure switch
    "K=10 ResNet-18": {"data.clients": 10, "train.model": "resnet18", "train.max_steps": 1, "runtime.clients_per_process": 10},
    "K=100 CNN": {"data.clients": 100, "train.model": "cnn", "data.alpha": 0.3, "data.min_size": 2, "train.local_epochs": 1,
                  "train.rounds": 3, "runtime.clients_per_process": 50},
}


# ---- part 1: real runs -------------------------------------------------------------------------------------------

def one_run(out: Path, settings: dict[str, Any], secure: bool) -> dict[str, Any]:
    settings = {**settings, "generation.policy": "none", "runtime.secure_aggregation": secure}
    sets = [item for key, value in settings.items() for item in ("--set", f"{key}={json.dumps(value)}")]
    started = time.monotonic()
    done = subprocess.run(fedsynth_command("run", *sets, "--out-dir", str(out), "--no-progress"), capture_output=True, text=True)
    result: dict[str, Any] = {"secure": secure, "exit_code": done.returncode, "wall_s": time.monotonic() - started,
                              "load_average": os.getloadavg()[0]}
    report_path = out / "report.json"
    if done.returncode != 0 or not report_path.exists():
        logs = "".join(f"--- {log.name}\n{log.read_text()[-1500:]}" for log in sorted((out / "logs").glob("*.log")))
        return {**result, "error": done.stderr[-2000:], "logs_tail": logs}
    rounds = json.loads(report_path.read_text())["rounds"]
    later = rounds[1:] or rounds
    result.update({
        "round_s": [r["duration_s"] for r in rounds],
        "median_round_s": statistics.median(r["duration_s"] for r in later),
        "median_aggregation_s": statistics.median(r["phases_s"]["aggregation"] for r in later),
        "median_phases_s": {phase: statistics.median(r["phases_s"].get(phase, 0.0) for r in later) for phase in later[0]["phases_s"]},
        "bytes_received": statistics.mean(r["bytes_received"] for r in rounds),
        "bytes_sent": statistics.mean(r["bytes_sent"] for r in rounds),
    })
    if secure:
        result["unmask_s"] = [r["secure_aggregation"]["unmask_s"] for r in rounds]
        result["dropped"] = [r["secure_aggregation"]["dropped"] for r in rounds]
    return result


def runs_table(runs: dict[str, list[dict[str, Any]]]) -> str:
    lines = ["| federation | mode | runs ok | median round s (rounds 2..) | aggregation s | bytes received / round "
             "| bytes sent / round | unmask s (median) |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, results in runs.items():
        medians = {}
        for secure in (False, True):
            ok = [r for r in results if r["secure"] == secure and "median_round_s" in r]
            count = sum(r["secure"] == secure for r in results)
            if not ok:
                lines.append(f"| {name} | {'secure' if secure else 'plain'} | 0/{count} | failed | | | | |")
                continue
            medians[secure] = m = {key: statistics.median(r[key] for r in ok)
                                   for key in ("median_round_s", "median_aggregation_s", "bytes_received", "bytes_sent")}
            unmask = f"{statistics.median(s for r in ok for s in r['unmask_s'][1:] or r['unmask_s']):.2f}" if secure else ""
            lines.append(f"| {name} | {'secure' if secure else 'plain'} | {len(ok)}/{count} | {m['median_round_s']:.2f} "
                         f"| {m['median_aggregation_s']:.2f} | {m['bytes_received']:,.0f} | {m['bytes_sent']:,.0f} | {unmask} |")
        if len(medians) == 2:
            p, s = medians[False], medians[True]
            lines.append(f"| {name} | secure / plain | | {s['median_round_s'] / p['median_round_s']:.2f} "
                         f"| {s['median_aggregation_s'] / p['median_aggregation_s']:.2f} "
                         f"| {s['bytes_received'] / p['bytes_received']:.4f} | {s['bytes_sent'] / p['bytes_sent']:.4f} | |")
    return "\n".join(lines)


# ---- part 2: in process ------------------------------------------------------------------------------------------

def timed(work) -> tuple[Any, float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    value = work()
    return value, time.process_time() - cpu, time.perf_counter() - wall


def key_stages(k: int, holders: int) -> dict[str, Any]:
    """Stages 1 and 2 for clients 0..k-1 as the coordinator sets them up (degree, majority threshold), timed per client."""
    context = round_context("benchmark", 1, "task")
    degree, threshold = holders + holders % 2, holders // 2 + 1
    server = ServerRound(list(range(k)), degree=degree, threshold=threshold, graph_seed=hashlib.sha256(context).digest(),
                         context=context, length=1)
    keys = {c: advertise() for c in range(k)}
    for c, pair in keys.items():
        server.add_public_keys(c, pair.public())
    states, boxes, cpu = {}, {}, []
    for c in range(k):
        (states[c], boxes[c]), used, _ = timed(lambda: share_keys(c, keys[c], server.keys_for(c), threshold=threshold, context=context))
        server.add_sealed(c, boxes[c])
        cpu.append(used)
    received = {c: server.sealed_for(c) for c in range(k)}
    return {"k": k, "holders": holders, "degree": degree, "threshold": threshold, "context": context, "keys": keys,
            "states": states, "boxes": boxes, "received": received, "share_keys_cpu_s": statistics.median(cpu)}


def model_states(name: str) -> tuple[dict, dict]:
    torch.manual_seed(0)
    old = build_model(name, num_classes=10, in_channels=1, image_size=8).state_dict()
    new = {key: value + 0.01 * torch.randn_like(value) if value.is_floating_point() else value for key, value in old.items()}
    return new, old


def quantise(new: dict, old: dict, quant: QuantRange, weight: int = 1) -> np.ndarray:
    return with_weight(encode(flat_move(new, old), weight, quant), weight)


def mask(setup: dict[str, Any], client: int, vector: np.ndarray) -> np.ndarray:
    setup["states"][client].masked = False  # the benchmark masks again with the same keys; a real client never does
    return masked_input(setup["states"][client], vector, setup["received"][client])


def masking_cost(setup: dict[str, Any], name: str, new: dict, old: dict, repeats: int) -> dict[str, Any]:
    """What masked_update does, without DP (the move, quantised, weighted; then masked), after one untimed warm-up."""
    quant = QuantRange(4.0, total_weight=setup["k"])
    mask(setup, 0, quantise(new, old, quant))
    samples = []
    for _ in range(repeats):
        vector, prep_cpu, prep_wall = timed(lambda: quantise(new, old, quant))
        _, mask_cpu, mask_wall = timed(lambda: mask(setup, 0, vector))
        samples.append((prep_cpu + mask_cpu, prep_wall + mask_wall, mask_cpu))
    return {"model": name, "length": vector_length(old), "k": setup["k"], "neighbours": setup["holders"], "repeats": repeats,
            "cpu_s": statistics.median(s[0] for s in samples), "wall_s": statistics.median(s[1] for s in samples),
            "masked_input_cpu_s": statistics.median(s[2] for s in samples), "share_keys_cpu_s": setup["share_keys_cpu_s"]}


def unmask_cost(setup: dict[str, Any], name: str, new: dict, old: dict, repeats: int) -> list[dict[str, Any]]:
    """ServerRound.unmask with the first d = 0, 1, 2 clients dropped after sharing keys (they never send a masked
    input): the median of `repeats` calls after one untimed warm-up (unmask changes nothing it reads)."""
    k, length = setup["k"], vector_length(old)
    quant = QuantRange(4.0, total_weight=k)
    encoded = quantise(new, old, quant)  # every client sends the same input: the sum is known
    masked = {c: mask(setup, c, encoded) for c in range(k)}
    rows = []
    for d in (0, 1, 2):
        server = ServerRound(list(range(k)), degree=setup["degree"], threshold=setup["threshold"],
                             graph_seed=hashlib.sha256(setup["context"]).digest(), context=setup["context"], length=length)
        for c in range(k):
            server.add_public_keys(c, setup["keys"][c].public())
        for c in range(k):
            server.keys_for(c)
            server.add_sealed(c, setup["boxes"][c])
        for c in range(d, k):
            server.sealed_for(c)
            server.add_masked_input(c, masked[c])
        survivors, dropped = frozenset(range(d, k)), frozenset(range(d))
        replies, client_cpu = {}, []
        for c in survivors:
            setup["states"][c].unmasked = False
            replies[c], used, _ = timed(lambda: unmask_shares(setup["states"][c], setup["received"][c], survivors=survivors, dropped=dropped))
            client_cpu.append(used)
        total = server.unmask(replies)
        samples = [timed(lambda: server.unmask(replies))[1:] for _ in range(repeats)]
        cpu, wall = statistics.median(x[0] for x in samples), statistics.median(x[1] for x in samples)
        rows.append({"model": name, "length": length, "k": k, "neighbours": setup["holders"], "dropped": d, "cpu_s": cpu,
                     "wall_s": wall, "client_unmask_shares_cpu_s": statistics.median(client_cpu),
                     "exact": bool(np.array_equal(total, encoded * np.uint32(k - d)))})
        del server
    for row in rows:
        row["recovery_wall_s"] = row["wall_s"] - rows[0]["wall_s"]
    return rows


def in_process(repeats: int) -> dict[str, list[dict[str, Any]]]:
    states = {name: model_states(name) for name in ("resnet18", "cnn")}
    masking, unmasking = [], []
    for k, holders, cases in ((10, 9, (("resnet18", 3 * repeats), ("cnn", 5 * repeats))),
                              (100, 10, (("resnet18", 3 * repeats), ("cnn", 5 * repeats))),
                              (100, 99, (("resnet18", repeats), ("cnn", 5 * repeats)))):
        setup = key_stages(k, holders)
        for name, count in cases:
            masking.append(masking_cost(setup, name, *states[name], count))
            print(f"masking {name} K={k} neighbours={holders}: {masking[-1]['cpu_s']:.3f} CPU s", flush=True)
        unmask_model = "resnet18" if k == 10 else "cnn"
        unmasking += unmask_cost(setup, unmask_model, *states[unmask_model], 3 * repeats)
        print(f"unmask {unmask_model} K={k} neighbours={holders}: " + ", ".join(f"{r['wall_s']:.2f} s" for r in unmasking[-3:]), flush=True)
    return {"masking": masking, "unmasking": unmasking}


def in_process_tables(results: dict[str, list[dict[str, Any]]]) -> str:
    lines = ["| model (vector length) | K | neighbours | stage 3 CPU s | of which masked_input | wall s | stage 2 share_keys CPU s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['model']} ({r['length']:,}) | {r['k']} | {r['neighbours']} | {r['cpu_s']:.3f} | {r['masked_input_cpu_s']:.3f} | {r['wall_s']:.3f} "
              f"| {r['share_keys_cpu_s']:.4f} |" for r in results["masking"]]
    lines += ["", "| model (vector length) | K | neighbours | dropped | unmask CPU s | wall s | dropout recovery s "
              "| client unmask_shares CPU s | sum exact |", "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    lines += [f"| {r['model']} ({r['length']:,}) | {r['k']} | {r['neighbours']} | {r['dropped']} | {r['cpu_s']:.3f} "
              f"| {r['wall_s']:.3f} | {r['recovery_wall_s']:+.3f} | {r['client_unmask_shares_cpu_s']:.4f} | {r['exact']} |"
              for r in results["unmasking"]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1, help="plain/secure pairs per federation (part 1); in-process repeats scale with it")
    parser.add_argument("--rounds-k10", type=int, default=3, help="train.rounds of the K = 10 ResNet-18 runs")
    parser.add_argument("--skip-runs", action="store_true", help="part 2 only")
    parser.add_argument("--out", type=Path, default=Path("runs/benchmarks/secure-aggregation"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    SETTINGS["K=10 ResNet-18"]["train.rounds"] = args.rounds_k10
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in SETTINGS}
    started = time.monotonic()
    if not args.skip_runs:
        with tempfile.TemporaryDirectory(prefix="secure-aggregation-") as folder:
            for repeat in range(args.repeats):
                for name, settings in SETTINGS.items():
                    for secure in ((False, True) if repeat % 2 == 0 else (True, False)):  # alternate which goes first
                        run = one_run(Path(folder) / f"{name.replace(' ', '_')}-{repeat}-{secure}", settings, secure)
                        runs[name].append(run)
                        print(f"{name} {'secure' if secure else 'plain'}: exit {run['exit_code']}, rounds "
                              f"{[round(s, 2) for s in run.get('round_s', [])]}, {run['wall_s']:.0f} s "
                              f"(load average {run['load_average']:.1f})", flush=True)
                        if "error" in run:
                            print(run["error"][-800:], run["logs_tail"][-3000:], sep="\n", flush=True)
    local = in_process(args.repeats)
    text = "\n\n".join(([runs_table(runs)] if not args.skip_runs else []) + [in_process_tables(local)])
    print(text)
    (args.out / "results.json").write_text(json.dumps({"runs": runs, **local, "wall_s": time.monotonic() - started,
                                                        "cpus": os.cpu_count()}, indent=1) + "\n")
    (args.out / "table.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
