"""Child processes that end with their parent: a parent-death signal, a watchdog thread, and the start-up race."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from typing import NoReturn

PARENT_PID_ENV = "FEDSYNTH_PARENT_PID"
EXIT_PARENT_GONE = 128 + signal.SIGTERM  # what a SIGTERM'd role returns (143)
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
WATCH_INTERVAL_S = 0.5
HARD_EXIT_S = 30.0  # still alive this long after the parent died: hung on its way out; end it without cleanup


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's environment) plus this process's pid, for a fedsynth child that must not
    outlive it: the child calls bind_to_parent() at start-up. Start it from a thread that lives as long as the child:
    Linux sends the parent-death signal when the spawning thread ends, not only the process."""
    return {**(os.environ if env is None else env), PARENT_PID_ENV: str(os.getpid())}


def bind_to_parent() -> None:
    """SIGTERM this process when the parent named in FEDSYNTH_PARENT_PID dies, even by kill -9; no-op without it.

    Linux delivers the signal itself (PR_SET_PDEATHSIG); elsewhere a thread polls getppid(). Either way a process
    still running HARD_EXIT_S later exits. A parent that died before this ran means exit at once.
    """
    value = os.environ.pop(PARENT_PID_ENV, None)  # popped: a grandchild must name its own parent, not inherit ours
    if value is None or not value.isdigit():
        return
    parent = int(value)
    armed = _arm_parent_death_signal()
    if os.getppid() != parent:
        print(f"fedsynth: parent process {parent} is gone; exiting", file=sys.stderr)
        raise SystemExit(EXIT_PARENT_GONE)
    threading.Thread(target=_watch, args=(parent, not armed), name="parent-watchdog", daemon=True).start()


def _arm_parent_death_signal() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent: int, send_sigterm: bool) -> None:
    while os.getppid() == parent:
        time.sleep(WATCH_INTERVAL_S)
    if send_sigterm:  # where PR_SET_PDEATHSIG is armed the kernel has sent it already
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(HARD_EXIT_S)
    os._exit(EXIT_PARENT_GONE)


def exit_now(code: int) -> NoReturn:
    """Exit without the interpreter's teardown, which after `import torch` takes 1-2 s (measured) and does nothing a
    role needs once its own shutdown is done: files written atomically, children waited for, channels closed."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
