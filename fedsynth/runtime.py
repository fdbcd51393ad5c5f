"""Process plumbing shared by every role: logging set-up, atomic file writes, exit codes."""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

EXIT_OK = 0
EXIT_ERROR = 1  # bad configuration or input (the message names it)
EXIT_BELOW_QUORUM = 3  # too few clients registered or answered; the run cannot go on
EXIT_INTERRUPTED = 130


def setup_logging(role: str, level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def write_atomic(path: Path, text: str) -> None:
    """Write a file so that readers see either the old or the whole new content."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, content: Any) -> None:
    write_atomic(path, json.dumps(content, indent=2, sort_keys=True) + "\n")
