"""An internal error in the coordinator's round loop: its own exit code, the message on record, every client told."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from deploy.processes import fedsynth_command
from fedsynth.process.runtime import EXIT_BELOW_QUORUM, EXIT_INTERNAL
from runtime_harness import Runtime, overrides, read_record, wait_exit

pytestmark = pytest.mark.slow
INJECTED = "injected aggregation failure"


def _injecting_env(tmp_path: Path) -> dict[str, str]:
    """A sitecustomize that makes every aggregation raise: a stand-in for a bug, in the real process."""
    folder = tmp_path / "inject"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import fedsynth.algorithms.base as base

        def _finish(self):
            raise RuntimeError({INJECTED!r})

        base.Aggregator.finish = _finish
    """))
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))}


@pytest.mark.serial  # asserts a 15 s bound: runs alone, after the parallel tests
def test_coordinator_error_gives_exit_4_a_record_and_ends_every_client(runtime: Runtime, tmp_path: Path) -> None:
    coord = runtime.coordinator({"data.clients": 3, "train.rounds": 3, "train.max_steps": 2}, tmp_path / "run",
                                env=_injecting_env(tmp_path))
    clients = [runtime.clients(coord.address, str(cid)) for cid in range(3)]
    assert coord.wait(240) == EXIT_INTERNAL, coord.log()[-3000:]
    coordinator_exit = time.monotonic()
    record = read_record(tmp_path / "run")
    assert record["success"] is False and record["exit_code"] == EXIT_INTERNAL
    assert INJECTED in record["error"] and "RuntimeError" in record["error"]
    assert INJECTED in coord.log() and "Traceback" in coord.log()  # the log keeps the stack for whoever fixes it
    assert record["rounds"] == []  # the failed round was never recorded as completed
    for child in clients:
        assert wait_exit(child, 15) == EXIT_INTERNAL, child.log_path.read_text()[-2000:]
    assert time.monotonic() - coordinator_exit < 15
    assert all(INJECTED in c.log_path.read_text() for c in clients)  # each client says why it stopped


def test_launcher_report_names_the_failed_process(tmp_path: Path) -> None:
    out = tmp_path / "run"
    sets = [item for o in overrides({"data.clients": 2, "train.rounds": 2, "train.max_steps": 2}) for item in ("--set", o)]
    done = subprocess.run(fedsynth_command("run", *sets, "--out-dir", str(out), "--no-progress"),
                          env={**os.environ, **_injecting_env(tmp_path)}, capture_output=True, text=True, timeout=400)
    assert done.returncode == EXIT_INTERNAL, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["exit_code"] == EXIT_INTERNAL and report["success"] is False
    first = report["failures"][0]
    assert first["process"] == "coordinator" and first["exit_code"] == EXIT_INTERNAL
    assert INJECTED in first["reason"] and Path(first["log"]).is_file()
    assert {f["process"] for f in report["failures"]} == {"coordinator", "client-0-0", "client-1-1"}
    assert "run failed: coordinator" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_run_whose_client_nodes_all_failed_ends_at_once_naming_each_failure(tmp_path: Path) -> None:
    """Each node's DP-GAN overruns its deadline (runtime.registration_timeout_s) and the node exits 1; without a word
    from the nodes the coordinator would wait registration + round timeout (620 s) for uploads that never come. Each
    node reports its failure (ReportSetupFailure), so the coordinator ends below its quorum of uploads (exit 3) at
    once, naming every node's reason."""
    out = tmp_path / "run"
    settings = {"data.clients": 2, "train.rounds": 1, "train.algorithm": "sdafl", "generation.policy": "none",
                "sdafl.gan_steps": 1_000_000, "runtime.registration_timeout_s": 40, "runtime.round_timeout_s": 580}
    sets = [item for o in overrides(settings) for item in ("--set", o)]
    started = time.monotonic()
    done = subprocess.run(fedsynth_command("run", *sets, "--out-dir", str(out), "--no-progress"),
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == EXIT_BELOW_QUORUM, done.stderr[-3000:]
    assert time.monotonic() - started < 200
    assert "only 0 of 2 clients uploaded synthetic samples (quorum 1; client 0: DP-GAN training took longer" in done.stderr
    assert done.stderr.count("lower sdafl.gan_steps") >= 2  # both nodes' reasons, as the coordinator heard them
    report = json.loads((out / "report.json").read_text())
    assert report["exit_code"] == EXIT_BELOW_QUORUM and report["success"] is False and report["failures"]
