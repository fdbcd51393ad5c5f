"""Child processes of the launcher: start with logs in the run folder, wait for a port file, stop cleanly."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from fedsynth.process import lifetime

log = logging.getLogger(__name__)
def fedsynth_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "fedsynth.cli", *args]


@dataclass
class Child:
    role: str
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid


@dataclass
class ProcessGroup:
    log_dir: Path
    children: list[Child] = field(default_factory=list)

    def start(self, role: str, command: list[str], *, env: dict[str, str] | None = None) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{role}.log"
        handle = open(log_path, "ab")
        process = subprocess.Popen(
            command,
            stdout=handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=lifetime.child_env({**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}),
            # Its own process group: Ctrl-C reaches only this process, which stops the children in order, and a
            # child's grandchildren (a client's DP-GAN) can be killed with it. No preexec_fn: it forces fork() in a
            # process that has used gRPC, whose fork handlers can abort the child; the child arms its parent-death
            # signal itself (fedsynth.process.lifetime), so it dies with this process even after a kill -9.
            process_group=0,
        )
        handle.close()
        child = Child(role, process, log_path)
        self.children.append(child)
        log.debug("started %s (pid %d): %s", role, process.pid, " ".join(command))
        return child

    def pids(self) -> dict[str, int]:
        return {c.role: c.pid for c in self.children}

    def stop_all(self, grace_s: float = 10.0) -> None:
        """SIGTERM every child still running, wait up to grace_s, then SIGKILL what is left of its process group."""
        alive = [c for c in self.children if c.process.poll() is None]
        for child in alive:
            child.process.send_signal(signal.SIGTERM)
        stop_at = time.monotonic() + grace_s
        for child in alive:
            try:
                child.process.wait(timeout=max(0.0, stop_at - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) ignored SIGTERM for %.0fs; killing it", child.role, child.pid, grace_s)
                _kill_group(child.pid)
                child.process.wait(timeout=5)
        for child in alive:  # a grandchild its parent failed to stop (only groups whose leader was reaped just now)
            _kill_group(child.pid)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # nothing left in it


class ChildFailed(RuntimeError):
    """A child exited (exit_code set) or hung (exit_code None) where it should have run on; the message names it."""

    def __init__(self, child: Child, exit_code: int | None, why: str) -> None:
        super().__init__(f"{child.role} (pid {child.pid}) {why}")
        self.child = child
        self.exit_code = exit_code

    def describe(self) -> dict[str, object]:
        """What report.json says of the failure."""
        return {"process": self.child.role, "pid": self.child.pid, "exit_code": self.exit_code, "reason": str(self),
                "log": str(self.child.log_path)}


def log_tail(child: Child, lines: int = 5) -> str:
    return "\n  ".join(child.log_path.read_text(errors="replace").strip().splitlines()[-lines:])


def wait_for_file(path: Path, child: Child, *, timeout_s: float) -> str:
    """The content of a file a child writes once it is ready; fails early if the child exits first."""
    stop_at = time.monotonic() + timeout_s
    while time.monotonic() < stop_at:
        if path.is_file() and path.read_text().strip():
            return path.read_text().strip()
        code = child.process.poll()
        if code is not None:
            raise ChildFailed(child, code, f"exited with code {code} before it was ready:\n  {log_tail(child)}")
        time.sleep(0.05)
    raise ChildFailed(child, None, f"did not write {path} within {timeout_s:.0f}s (log: {child.log_path})")
