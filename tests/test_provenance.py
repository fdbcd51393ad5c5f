"""The version block: git state of a checkout (or none), installed library versions, the machine."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from fedsynth.process.provenance import git_state, package_version, provenance


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_checkout_gives_its_commit_and_whether_a_tracked_file_changed(tmp_path: Path) -> None:
    package = tmp_path / "repo" / "pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("x = 1\n")
    repo = package.parent
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    assert git_state(package) == {"commit": git(repo, "rev-parse", "HEAD"), "dirty": False}
    (package / "notes.txt").write_text("untracked files do not count\n")
    assert git_state(package)["dirty"] is False  # type: ignore[index]
    (package / "__init__.py").write_text("x = 2\n")
    assert git_state(package)["dirty"] is True  # type: ignore[index]


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_no_checkout_or_an_untracked_copy_inside_one_gives_none(tmp_path: Path) -> None:
    assert git_state(tmp_path) is None  # not a repository
    repo = tmp_path / "repo"
    copy = repo / ".venv" / "site-packages" / "pkg"  # an installed copy inside someone's checkout
    copy.mkdir(parents=True)
    (copy / "__init__.py").write_text("")
    git(repo, "init", "-q")
    (repo / "README").write_text("r\n")
    git(repo, "add", "README")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    assert git_state(copy) is None


def test_versions_come_from_installed_metadata() -> None:
    assert package_version("torch")
    assert package_version("no-such-package-fedsynth") is None
    block = provenance()
    assert set(block) == {"fedsynth", "git", "python", "packages", "machine"}
    assert set(block["machine"]) == {"cpu_count", "platform", "gpu", "gpu_count"}
    assert (block["machine"]["gpu"] is None) == (block["machine"]["gpu_count"] == 0)
