"""`fedsynth report RUN_DIR`: re-render report.md and the plots of a run folder (or summary.md of an experiment); a
coordinator's run folder (coordinator.json, no report.json: the coordinator started on its own) gets its report.json
built from coordinator.json first."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from fedsynth.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run_dir", metavar="RUN_DIR",
        help="a run folder (holds report.json, written by `fedsynth run`), a coordinator's run folder (holds "
             "coordinator.json, written by `fedsynth coordinator`) or an experiment folder (holds summary.json)",
    )


def run(args: argparse.Namespace) -> int:
    folder = Path(args.run_dir)
    if not folder.is_dir():
        raise ConfigError(f"run folder {str(folder)!r} does not exist" if not folder.exists() else f"{str(folder)!r} is not a folder")
    if (folder / "summary.json").is_file() and not (folder / "report.json").is_file():
        from deploy.experiment_summary import render_summary

        written = render_summary(folder)
    elif (folder / "report.json").is_file():
        from deploy.report_render import render_report

        written = render_report(folder)
    elif (folder / "coordinator.json").is_file():
        from deploy.report_render import render_report

        write_coordinator_report(folder)
        written = [folder / "report.json", *render_report(folder)]
    else:
        raise ConfigError(f"{str(folder)!r} holds neither report.json (a run folder) nor coordinator.json (a "
                          "coordinator's run folder) nor summary.json (an experiment folder)")
    for path in written:
        print(path)
    return 0


def write_coordinator_report(folder: Path) -> dict[str, Any]:
    """report.json of a coordinator's run folder, from its coordinator.json alone: no launcher ran, so no process ids,
    no generator counters and no failures of other processes; wall_clock_s is the sum of the rounds' durations (the
    time before round 1, e.g. registration, is not in the record)."""
    from deploy.report import build_report, load_coordinator_record
    from fedsynth.process.runtime import write_json

    try:
        record = load_coordinator_record(folder)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"{folder / 'coordinator.json'}: not readable JSON ({exc})") from None
    if not isinstance(record, dict) or not isinstance(record.get("rounds"), list):
        raise ConfigError(f"{folder / 'coordinator.json'} has no 'rounds' list: not a fedsynth coordinator record")
    try:
        report = build_report(record, wall_clock_s=sum(float(r.get("duration_s") or 0.0) for r in record["rounds"]),
                              processes={})
    except (KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"{folder / 'coordinator.json'}: not a fedsynth coordinator record (missing {exc})") from None
    report["failures"] = []
    report["exit_code"] = record.get("exit_code")
    report["source"] = "coordinator.json"  # rendered by `fedsynth report`, not written by `fedsynth run`
    write_json(folder / "report.json", report)
    return report
