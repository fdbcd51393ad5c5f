"""What made a report: fedsynth's version, its git commit when it runs from a checkout, the library versions, the machine."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import fedsynth

PACKAGES = ("torch", "grpcio", "diffusers", "opacus")  # read from their installed metadata: none of them is imported here
GIT_TIMEOUT_S = 5.0
PACKAGE_DIR = Path(fedsynth.__file__).resolve().parent


def provenance() -> dict[str, Any]:
    """The `version` block of report.json, coordinator.json and an experiment's summary.json."""
    return {
        "fedsynth": fedsynth.__version__,
        "git": git_state(PACKAGE_DIR),
        "python": platform.python_version(),
        "packages": {name: package_version(name) for name in PACKAGES},
        "machine": machine(),
    }


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def git_state(package_dir: Path) -> dict[str, Any] | None:
    """{"commit", "dirty"} of the checkout `package_dir` is tracked in (dirty: a tracked file differs from that
    commit; untracked files do not count); None without git, outside a checkout, or for an installed copy that merely
    lies inside some other repository's folder (e.g. a virtual environment in a checkout)."""
    tracked = _git(package_dir, "ls-files", "--error-unmatch", "__init__.py")
    commit = _git(package_dir, "rev-parse", "HEAD")
    status = _git(package_dir, "status", "--porcelain", "--untracked-files=no")
    if tracked is None or commit is None or status is None:
        return None
    return {"commit": commit.strip(), "dirty": bool(status.strip())}


def _git(cwd: Path, *args: str) -> str | None:
    """git's stdout, or None when git is missing, fails or outlives GIT_TIMEOUT_S."""
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=GIT_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def machine() -> dict[str, Any]:
    """CPU count and the first GPU's name (None without one). torch.cuda.device_count() asks NVML where it can and
    creates no CUDA context; the name is read only when there is a device."""
    import torch  # every role has it loaded already

    gpu_count = torch.cuda.device_count()
    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "gpu": torch.cuda.get_device_name(0) if gpu_count else None,
        "gpu_count": gpu_count,
    }
