"""`fedsynth report RUN_DIR`: re-render report.md and the plots of a run folder (or summary.md of an experiment)."""

from __future__ import annotations

import argparse
from pathlib import Path

from fedsynth.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run_dir", metavar="RUN_DIR",
        help="a run folder (holds report.json, written by `fedsynth run`) or an experiment folder (holds summary.json)",
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
    else:
        raise ConfigError(f"{str(folder)!r} holds neither report.json (a run folder) nor summary.json (an experiment folder)")
    for path in written:
        print(path)
    return 0
