"""`fedsynth experiment`: several arms × seeds, each a full `fedsynth run` on the same partition and generator."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from deploy.experiment_spec import load_experiment, write_run_toml
from deploy.processes import fedsynth_command
from fedsynth.process import lifetime
from fedsynth.config import RunConfig
from fedsynth.errors import ConfigError
from fedsynth.process.runtime import setup_logging, write_atomic

log = logging.getLogger("experiment")
CHECKPOINT_FILE = "checkpoint.safetensors"  # coordinator/checkpoint.py (deploy does not import a role)
STOP_GRACE_S = 30.0  # after SIGTERM, the launcher stops its own children (10 s grace each) before SIGKILL


def _comparable(config: dict[str, Any] | None) -> dict[str, Any]:
    """Everything that changes results (runtime settings and the output folder do not)."""
    return {k: v for k, v in (config or {}).items() if k not in ("runtime", "out_dir")}


def _generates_nothing(config: dict[str, Any]) -> bool:
    generation = config.get("generation")
    return isinstance(generation, dict) and generation.get("policy") == "none"


def config_differences(old: dict[str, Any] | None, new: dict[str, Any], *, results_only: bool = False) -> list[str]:
    """'section.key: old -> new' for every differing value but runtime settings and the output folder. With
    results_only, two runs that both generate nothing (policy none: FedAvg, the FL baselines, SDA-FL) are also
    compared without their generator settings: such a run is the same run under every generator backend."""
    a, b = _comparable(old), _comparable(new)
    if results_only and _generates_nothing(a) and _generates_nothing(b):
        a, b = {**a, "generation": {"policy": "none"}}, {**b, "generation": {"policy": "none"}}

    def walk(a: dict[str, Any], b: dict[str, Any], defaults: dict[str, Any], prefix: str) -> list[str]:
        found = []
        for key in sorted(set(a) | set(b)):
            x, y = a.get(key), b.get(key)
            if isinstance(x, dict) and isinstance(y, dict):
                found += walk(x, y, defaults.get(key) or {}, f"{prefix}{key}.")
            elif key not in a and key in defaults and y == defaults[key]:
                continue  # a key added to the config after the old run, at its default (e.g. generation.exponent)
            elif x != y:
                found.append(f"{prefix}{key}: {x!r} -> {y!r}")
        return found

    return walk(a, b, RunConfig().to_dict(), "")


def previous_run(arm_dir: Path, cfg: RunConfig) -> tuple[str, str | None]:
    """What the folder holds: ('done', None) a successful run with the same results; ('stale', why) the checkpoint
    of another config, which the coordinator would refuse; ('todo', None) nothing, or a run to resume or extend."""
    try:
        report = json.loads((arm_dir / "report.json").read_text())
    except (OSError, json.JSONDecodeError):
        return "todo", None
    if not isinstance(report, dict) or not isinstance(report.get("config"), dict):
        return "todo", None
    if report.get("success") is True and not config_differences(report["config"], cfg.to_dict(), results_only=True):
        return "done", None
    # resuming needs the exact config: the coordinator checks the checkpoint's fingerprint, generator settings included
    differences = config_differences(report["config"], cfg.to_dict())
    if not differences or all(d.startswith("train.rounds:") for d in differences) or not (arm_dir / CHECKPOINT_FILE).exists():
        return "todo", None  # a checkpoint resumes and extends to the new number of rounds; no checkpoint: run afresh
    return "stale", f"{arm_dir} holds a run of another config ({'; '.join(differences)}); delete it or use another --out-dir"


def stop_session(process: subprocess.Popen[bytes], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the launcher's session (the launcher stops its own children), wait up to grace_s, then SIGKILL
    whatever is still in the session, so that nothing a timed-out run started outlives it."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return  # nothing left in the session
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        log.warning("the launcher (pid %d) ignored SIGTERM for %.0f s; killing its session", process.pid, grace_s)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=10)


def run_arm(cfg: RunConfig, arm_dir: Path, timeout_s: float) -> dict[str, Any]:
    """One `fedsynth run` as a child process under a deadline; returns {status, error, seconds}."""
    write_run_toml(cfg, arm_dir / "config.toml")
    log_path = arm_dir / "logs" / "launcher.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    report_path = arm_dir / "report.json"
    before = report_path.stat().st_mtime_ns if report_path.exists() else None
    started = time.monotonic()
    command = fedsynth_command("run", "--config", str(arm_dir / "config.toml"), "--out-dir", str(arm_dir), "--no-progress")
    with open(log_path, "ab") as log_file:
        # its own session: on a deadline the whole process tree is stopped, grandchildren included
        # and bound to this process (fedsynth.process.lifetime): a kill -9 of the experiment ends its arm's run too
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True, env=lifetime.child_env())
    try:
        code = process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_session(process)
        return {"status": "failed", "error": f"timed out after {timeout_s:g} s (see {log_path})", "seconds": time.monotonic() - started}
    except KeyboardInterrupt:
        stop_session(process)
        raise
    seconds = time.monotonic() - started
    fresh = report_path.exists() and report_path.stat().st_mtime_ns != before
    report = json.loads(report_path.read_text()) if fresh else None
    if code == 0 and report is not None and report.get("success") is True:
        return {"status": "ok", "error": None, "seconds": seconds}
    tail = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()][-1:]
    reason = (report or {}).get("error") or (tail[0].strip() if tail else "no output")
    return {"status": "failed", "error": f"launcher exited with code {code}: {reason} (see {log_path})", "seconds": seconds}


def parse_seeds(text: str | None, default: int) -> list[int]:
    if text is None:
        return [default]
    try:
        seeds = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise ConfigError(f"--seeds must be a comma-separated list of integers, got {text!r}") from exc
    if not seeds or len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds must list distinct integers, got {text!r}")
    return seeds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="experiment TOML: [experiment], [base] (a run config), [[arms]], optional [sweep]")
    parser.add_argument("--seeds", help="comma-separated seeds, e.g. 0,1,2 (default: the base config's seed)")
    parser.add_argument("--out-dir", help="experiment folder (default: experiment.out_dir, else runs/experiments/NAME)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override [base] for every arm (e.g. train.rounds=5), or experiment.KEY (e.g. experiment.threshold=0.9)",
    )
    parser.add_argument("--log-level", default="INFO")


def run(args: argparse.Namespace) -> int:
    from deploy.experiment_summary import build_summary, render_summary

    setup_logging("experiment", args.log_level)

    def _on_sigterm(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt  # stop the running arm's processes, as on Ctrl-C

    signal.signal(signal.SIGTERM, _on_sigterm)
    experiment = load_experiment(args.config, args.set)
    settings = experiment.settings
    seeds = parse_seeds(args.seeds, experiment.base_seed)
    out_dir = Path(args.out_dir or settings.out_dir or Path("runs") / "experiments" / settings.name)
    plan = experiment.plan(seeds)
    for arm in experiment.arms:
        if arm.seeds is not None and not any(arm.runs_on(seed) for seed in seeds):
            log.warning("arm %s runs on seeds %s, none of --seeds %s: it is left out", arm.name, list(arm.seeds), seeds)
    if not plan:
        raise ConfigError(f"no arm runs on seeds {seeds}: every arm's 'seeds' list leaves them out")
    configs = {(arm.name, seed): experiment.arm_config(arm, seed, out_dir / f"{arm.name}-{seed}") for arm, seed in plan}
    outcomes: dict[tuple[str, int], dict[str, Any]] = {}
    for index, (arm, seed) in enumerate(plan, start=1):
        arm_dir = out_dir / f"{arm.name}-{seed}"
        cfg = configs[(arm.name, seed)]
        state, why = previous_run(arm_dir, cfg)
        if state == "done":
            outcomes[(arm.name, seed)] = {"status": "ok", "error": None, "seconds": None, "reused": True}
            log.info("[%d/%d] %s seed %d: already done in %s; reused", index, len(plan), arm.name, seed, arm_dir)
            continue
        if state == "stale":
            outcomes[(arm.name, seed)] = {"status": "failed", "error": why, "seconds": None, "reused": False}
            log.error("[%d/%d] %s seed %d: %s", index, len(plan), arm.name, seed, why)
            continue
        log.info("[%d/%d] %s seed %d: running in %s (deadline %g s)", index, len(plan), arm.name, seed, arm_dir, arm.timeout_s)
        arm_dir.mkdir(parents=True, exist_ok=True)
        outcome = {**run_arm(cfg, arm_dir, arm.timeout_s), "reused": False}
        outcomes[(arm.name, seed)] = outcome
        log.log(logging.INFO if outcome["status"] == "ok" else logging.ERROR, "[%d/%d] %s seed %d: %s in %.1f s%s",
                index, len(plan), arm.name, seed, outcome["status"], outcome["seconds"], f": {outcome['error']}" if outcome["error"] else "")
    summary = build_summary(experiment, seeds, out_dir, outcomes)
    write_atomic(out_dir / "summary.json", json.dumps(summary, indent=2, sort_keys=True) + "\n")
    written = render_summary(out_dir)
    failed = [f"{r['arm']}-{r['seed']}" for r in summary["runs"] if r["status"] != "ok"]
    log.info("summary: %s", written[0])
    if failed:
        log.error("%d of %d runs failed: %s", len(failed), len(plan), ", ".join(failed))
        return 1
    return 0
