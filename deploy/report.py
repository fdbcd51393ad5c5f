"""report.json from a run folder: the contract of DESIGN.md, built from what the coordinator recorded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PHASES = ("generation", "training", "communication", "aggregation", "evaluation")
LAST_N = 20


def build_report(
    coordinator: dict[str, Any],
    *,
    wall_clock_s: float,
    processes: dict[str, int],
    generation_wall_s: float = 0.0,
    generator_counters: dict[str, Any] | None = None,
    generator_quality: dict[str, Any] | None = None,
    version: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """generation.device_seconds is the generator's own sampling time (its Prometheus counter), when it ran; with the
    quality filter it includes the rejected candidates, and generation.quality_filter says how many there were.
    `version`: what made the run (fedsynth.process.provenance); the coordinator's own block when it is not given."""
    rounds = coordinator.get("rounds", [])
    # None: a round nobody tested (federated evaluation off its eval_every; local mode with no server test set)
    accuracies = [r["accuracy"] for r in rounds if r["accuracy"] is not None]
    tail = accuracies[-LAST_N:]
    tail = [] if None in tail else tail
    per_client = {cid: g for cid, g in coordinator.get("generation", {}).items()}
    phases = {phase: sum(r["phases_s"].get(phase, 0.0) for r in rounds) for phase in PHASES}
    phases["generation"] += generation_wall_s  # generator training/start-up before round 1, if any
    sdafl = coordinator.get("sdafl") or {}
    # SDA-FL: the clients' DP-GANs train in parallel before round 1; the slowest one is the wall-clock cost.
    phases["generation"] += max((p.get("gan_seconds", 0.0) for p in sdafl.values()), default=0.0)
    config = coordinator.get("config") or {}
    total_images = int(sum(g.get("images", 0) for g in per_client.values()))
    device_seconds = float(generator_counters["device_seconds"]) if generator_counters else 0.0
    return {
        "run_id": coordinator.get("run_id"),
        "version": version if version is not None else coordinator.get("version"),
        "success": coordinator.get("success", False),
        "error": coordinator.get("error"),
        "config": coordinator.get("config"),
        "initial_accuracy": coordinator.get("initial", {}).get("accuracy"),
        "rounds": [
            {
                "round": r["round"],
                "accuracy": r["accuracy"],
                "loss": r["loss"],
                "duration_s": r["duration_s"],
                "participants": r["participants"],
                "phases_s": r["phases_s"],
                "bytes_sent": r["bytes_sent"],
                "bytes_received": r["bytes_received"],
                **({"update_norms": r["update_norms"]} if "update_norms" in r else {}),  # runtime.max_update_norm set
                **({"epsilon": r["privacy"]["epsilon"]} if r.get("privacy") else {}),  # train.dp / federate.dp: spent so far
                **({"secure_aggregation": r["secure_aggregation"]} if "secure_aggregation" in r else {}),  # survivors, dropped
            }
            for r in rounds
        ],
        "accuracy_source": "federated" if config.get("train", {}).get("evaluation") == "federated" else "server",
        # each round's figures with its per-client counts, from which anyone can recompute them (docs/evaluation.md)
        "federated_evaluation": [r["federated_evaluation"] for r in rounds if r.get("federated_evaluation")],
        "final_accuracy": accuracies[-1] if accuracies else None,
        "last20_mean_accuracy": sum(tail) / len(tail) if tail else None,
        "generation": {
            "total_images": total_images,
            "per_client": {cid: int(g.get("images", 0)) for cid, g in per_client.items()},
            "device_seconds": device_seconds,
            # Sampling batches mix clients, so each client is charged its share of images of the generator's time.
            "per_client_device_seconds": {
                cid: device_seconds * g.get("images", 0) / total_images if total_images else 0.0 for cid, g in per_client.items()
            },
            "wall_seconds": float(max((g.get("wall_seconds", 0.0) for g in per_client.values()), default=0.0)),
            "cache_hits": sorted(cid for cid, g in per_client.items() if g.get("cache_hit")),
            "generator": generator_counters,
            "quality_filter": (generator_counters or {}).get("quality_filter"),
            # the judge's figures for this generator (deploy/generator_quality.py), or {"error": ...}; None: not scored
            "quality": generator_quality,
            "backend": (generator_counters or {}).get("backend") or config.get("generation", {}).get("backend"),
            "policy": config.get("generation", {}).get("policy"),
        },
        "sdafl": sdafl or None,
        # user-level DP (train.dp, or the federated generator's federate.dp): dp, epsilon, delta, noise_multiplier, clip, sample_rate
        "privacy": coordinator.get("privacy"),
        # untrusted members (docs/security.md): every refused update {round, client, reason, message}, and the clients
        # excluded after runtime.max_refusals refusals in a row {client, round, reason}
        "refused_updates": coordinator.get("refused_updates", []),
        "excluded_clients": coordinator.get("excluded_clients", []),
        "wall_clock_s": wall_clock_s,
        "phases_s": phases,
        "bytes": {
            "sent": int(sum(r["bytes_sent"] for r in rounds)),
            "received": int(sum(r["bytes_received"] for r in rounds)),
        },
        "processes": processes,
    }


def load_coordinator_record(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "coordinator.json"
    if not path.is_file():
        return {}
    return json.loads(path.read_text())
