"""The run behind `generator federate` and `generator evolve`: `fedsynth run` in a child process, into a folder its
output lives beside, stopped with the command (SIGTERM passed on, Ctrl-C as 130)."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
from pathlib import Path

EXIT_INTERRUPTED = 130


def run_in_child(args: argparse.Namespace, overrides: list[str], run_dir: Path) -> int:
    """`fedsynth run` with the command's --config, the overrides as --set, into run_dir; its exit code (130 on Ctrl-C).
    Rerunning the same command resumes the run from its checkpoint."""
    run_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "fedsynth.cli", "run", *(["--config", args.config] if args.config else []),
               *(part for item in overrides for part in ("--set", item)), "--out-dir", str(run_dir), "--log-level", args.log_level,
               *(["--no-progress"] if args.no_progress else [])]
    child = subprocess.Popen(command)
    previous = signal.signal(signal.SIGTERM, lambda *_: child.send_signal(signal.SIGTERM))  # the launcher stops its children
    try:
        return child.wait()
    except KeyboardInterrupt:
        child.send_signal(signal.SIGINT)
        child.wait()
        return EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGTERM, previous)
