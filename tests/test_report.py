"""report.md and plots of a real run folder: written by `fedsynth run`, re-rendered by `fedsynth report`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest

from fedsynth import __version__ as FEDSYNTH_VERSION

PLOTS = ("accuracy.png", "phases.png", "bytes.png", "generation.png")


def fedsynth(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fedsynth.cli", *args], capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny real run (3 clients in one process, 2 rounds, no synthesis), shared by the tests below."""
    out = tmp_path_factory.mktemp("report") / "run"
    overrides = ["data.clients=3", "train.rounds=2", "train.local_epochs=1", "runtime.clients_per_process=3", "generation.policy=none"]
    result = fedsynth("run", *[a for o in overrides for a in ("--set", o)], "--out-dir", str(out), "--no-progress", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_run_writes_report_md_and_readable_plots(run_dir: Path) -> None:
    assert (run_dir / "report.md").is_file()
    for name in PLOTS:
        image = matplotlib.image.imread(run_dir / "plots" / name)
        height, width = image.shape[:2]
        assert width >= 600 and height >= 300, (name, image.shape)
        assert image[..., :3].std() > 0.05, f"{name} is blank"


def test_report_md_states_the_reports_numbers(run_dir: Path) -> None:
    report = json.loads((run_dir / "report.json").read_text())
    text = (run_dir / "report.md").read_text()
    assert text.startswith(f"# Run {report['run_id']}: succeeded")
    assert f"| final accuracy | {report['final_accuracy']:.4f} |" in text
    assert f"| mean accuracy, last 2 rounds | {report['last20_mean_accuracy']:.4f} |" in text
    for r in report["rounds"]:
        assert f"| {r['round']} | {r['accuracy']:.4f} | {r['loss']:.4f} | {r['duration_s']:.2f} | 3 | {r['bytes_sent']:,} |" in text
    assert f"| training | {report['phases_s']['training']:.2f} |" in text
    for name in PLOTS:
        assert f"(plots/{name})" in text


def test_report_command_rerenders_the_same_markdown(run_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("report.md", "plots"))
    result = fedsynth("report", str(copy))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(copy / "report.md"), *(str(copy / "plots" / n) for n in PLOTS)]
    # Rendering depends only on the folder's JSON: the launcher's report.md and the re-rendered one agree.
    assert (copy / "report.md").read_text() == (run_dir / "report.md").read_text()


def test_report_command_names_a_missing_folder(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-run"
    result = fedsynth("report", str(missing))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [f"fedsynth report: error: run folder {str(missing)!r} does not exist"]


def test_report_command_refuses_a_folder_without_a_report(tmp_path: Path) -> None:
    result = fedsynth("report", str(tmp_path))
    assert result.returncode == 1
    assert "neither report.json" in result.stderr and str(tmp_path) in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_report_command_names_an_invalid_report(tmp_path: Path) -> None:
    (tmp_path / "report.json").write_text('{"rounds": ')
    result = fedsynth("report", str(tmp_path))
    assert result.returncode == 1
    assert f"{tmp_path / 'report.json'} is not valid JSON" in result.stderr
    (tmp_path / "report.json").write_text('{"success": true}')
    result = fedsynth("report", str(tmp_path))
    assert result.returncode == 1 and "has no 'rounds' list" in result.stderr


def test_report_and_coordinator_record_say_what_made_the_run(run_dir: Path) -> None:
    """The version block (fedsynth.process.provenance): this checkout's commit, the libraries, the machine."""
    from fedsynth.process.provenance import PACKAGE_DIR

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=PACKAGE_DIR, capture_output=True, text=True, check=False)
    for name in ("report.json", "coordinator.json"):
        version = json.loads((run_dir / name).read_text())["version"]
        assert version["fedsynth"] == FEDSYNTH_VERSION, name
        assert version["python"] == ".".join(map(str, sys.version_info[:3])), name
        assert set(version["packages"]) == {"torch", "grpcio", "diffusers", "opacus"}, name
        assert version["packages"]["torch"] and version["packages"]["grpcio"], name
        assert version["machine"]["cpu_count"] >= 1, name
        assert "gpu" in version["machine"], name
        if commit.returncode == 0:  # run from a checkout (CI and here): its commit
            assert version["git"]["commit"] == commit.stdout.strip(), name
            assert isinstance(version["git"]["dirty"], bool), name
        else:
            assert version["git"] is None, name
