"""Process plumbing shared by every role: logging set-up, atomic file writes, exit codes."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

EXIT_OK = 0
EXIT_ERROR = 1  # bad configuration or input (the message names it)
EXIT_BELOW_QUORUM = 3  # too few clients registered or answered; the run cannot go on
EXIT_INTERNAL = 4  # an unexpected failure inside the coordinator (a bug): the message is in its log and coordinator.json
# `fedsynth run`: every round completed, but without some of its clients (excluded, or their process failed):
# report.json `failures` and `excluded_clients` name them. The coordinator itself exits 0 for such a run.
EXIT_INCOMPLETE = 5
EXIT_INTERRUPTED = 130


def lower_thread_priority(increment: int = 10) -> None:
    """Make the calling thread (only it) yield the CPU to the process's other threads and to other processes: its own
    nice value raised by `increment`. Linux only (there a thread is a schedulable task of its own); a no-op elsewhere,
    where setpriority would lower the whole process."""
    if sys.platform != "linux":
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + increment)
    except OSError:  # not permitted here: the thread keeps its priority
        pass


def setup_logging(role: str, level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def write_atomic(path: Path, content: str | bytes | Callable[[Path], object]) -> None:
    """Replace `path` so that readers see either the old or the whole new content, even after a crash.

    `content` is text (UTF-8), bytes, or a writer called with a temporary path beside `path` that it must create,
    as one file or as a folder of files (e.g. `lambda tmp: save_file(tensors, tmp)`). All of it is fsynced before
    the rename; a folder may only replace a path that does not exist yet.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}-", suffix=".tmp"))
    try:
        tmp = scratch / path.name
        if isinstance(content, (str, bytes)):
            tmp.write_bytes(content.encode() if isinstance(content, str) else content)
        else:
            content(tmp)
        for file in [tmp] if tmp.is_file() else sorted(p for p in tmp.rglob("*") if p.is_file()):
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
        folder = os.open(path.parent, os.O_RDONLY)  # the rename itself survives a power loss only once its folder is synced
        try:
            os.fsync(folder)
        finally:
            os.close(folder)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def write_json(path: Path, content: Any) -> None:
    write_atomic(path, json.dumps(content, indent=2, sort_keys=True) + "\n")


def dumps_with_encoded_list(content: dict[str, Any], key: str, encoded: Sequence[str]) -> str:
    """`json.dumps(content)` (the same object once parsed) where `content[key]` is the list whose items `encoded`
    holds already JSON-encoded: a growing log is encoded item by item once, not whole every time it is written."""
    head = json.dumps({name: value for name, value in content.items() if name != key})
    return head[:-1] + (", " if len(head) > 2 else "") + json.dumps(key) + ": [" + ", ".join(encoded) + "]}"
