"""Clients that fail before they register, seen at once: `fedsynth run` over local folders where one client holds a
corrupt PNG, one an empty folder and one a class outside the schema. Each says why in one line on the launcher's
terminal as it happens, the launcher tells the coordinator (ReleaseClients), which stops waiting for them, the run
goes on with the others, and the launcher's exit code, last line, `success` and report.json `failures` agree."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import grpc
import pytest

from deploy.processes import fedsynth_command
from fedsynth.process.runtime import EXIT_INCOMPLETE
from fedsynth.v1 import coordinator_pb2 as pb
from fedsynth.v1 import coordinator_pb2_grpc as pb_grpc
from runtime_harness import Runtime, channel

BROKEN = {2: "corrupt PNG", 3: "empty folder", 4: "class outside the schema"}
# A registration wait far longer than the test's whole budget: were the coordinator to wait for the broken clients,
# the run could not end in time.
REGISTRATION_TIMEOUT_S = 600.0


def break_client(folder: Path, how: str) -> None:
    train = folder / "train"
    if how == "corrupt PNG":
        first = sorted(train.rglob("*.png"))[0]
        first.write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 10)
    elif how == "empty folder":
        for entry in folder.iterdir():
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    else:
        classes = sorted(p for p in train.iterdir() if p.is_dir() and any(p.iterdir()))
        classes[0].rename(train / "eleven")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_clients_that_fail_before_registering_are_named_at_once_and_the_run_goes_on(tmp_path: Path) -> None:
    split = subprocess.run(fedsynth_command("data", "split", "--dataset", "digits", "--clients", "5", "--alpha", "1.0",
                                            "--seed", "1", "--out", str(tmp_path / "clients")),
                           capture_output=True, text=True, timeout=300)
    assert split.returncode == 0, split.stderr[-2000:]
    for client, how in BROKEN.items():
        break_client(tmp_path / "clients" / f"client-{client}", how)
    sets = ["data.source=\"local\"", f"data.local_dir=\"{tmp_path / 'clients'}\"", "data.clients=5", "train.rounds=2",
            "train.local_epochs=1", "generation.policy=\"none\"", "runtime.quorum=0.4",
            f"runtime.registration_timeout_s={REGISTRATION_TIMEOUT_S}"]
    command = fedsynth_command("run", "--out-dir", str(tmp_path / "run"), "--no-progress", *[a for s in sets for a in ("--set", s)])
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=360)
    took = time.monotonic() - started
    assert done.returncode == EXIT_INCOMPLETE, done.stderr[-3000:]
    assert took < REGISTRATION_TIMEOUT_S / 3, took  # nobody waited out the registration timeout
    lines = done.stderr.splitlines()
    for client, how in BROKEN.items():
        said = [line for line in lines if f"client-{client}-{client} (pid" in line and "exited with code 1" in line]
        assert len(said) == 1, (how, said, done.stderr[-3000:])
    assert "Traceback" not in done.stderr
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["exit_code"] == EXIT_INCOMPLETE and report["success"] is False
    assert {f["process"] for f in report["failures"]} == {f"client-{c}-{c}" for c in BROKEN}
    assert [r["round"] for r in report["rounds"]] == [1, 2] and report["rounds"][-1]["participants"] == [0, 1]
    assert "run completed without some clients" in lines[-1], lines[-1]
    coordinator_log = (tmp_path / "run" / "logs" / "coordinator.log").read_text()
    assert "released" in coordinator_log


@pytest.mark.slow
def test_release_names_only_this_runs_clients(tmp_path: Path) -> None:
    """Hostile or mistaken input to ReleaseClients: no ids, ids outside 0..K-1 (refused by name, nothing released)."""
    with Runtime(tmp_path) as rt:
        coordinator = rt.coordinator({"data.clients": 2, "train.rounds": 1}, tmp_path / "run")
        with channel(coordinator.address) as ch:
            stub = pb_grpc.CoordinatorStub(ch)
            stub.GetRunSpec(pb.GetRunSpecRequest(), timeout=30, wait_for_ready=True)
            for ids, text in (([], "(none)"), ([0, 7], "[7]"), ([2**31], f"[{2**31}]")):
                with pytest.raises(grpc.RpcError) as refused:
                    stub.ReleaseClients(pb.ReleaseRequest(client_ids=ids, reason="x" * 10_000), timeout=30)
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
                assert f"names client ids {text}" in refused.value.details()
            reply = stub.ReleaseClients(pb.ReleaseRequest(client_ids=[1, 1], reason="client-1 exited"), timeout=30)
            assert list(reply.released) == [1]
        coordinator.child.process.terminate()
        assert coordinator.wait(60) == 143
