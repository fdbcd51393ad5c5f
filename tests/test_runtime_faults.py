"""Faults with real processes: a client killed mid-round, the coordinator killed and restarted, too few clients."""

from __future__ import annotations

import re
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import SAMPLED_RUN, FinishedRun
from coordinator import checkpoint
from runtime_harness import Runtime, completed_rounds, read_record, wait_exit, wait_until

# Local training of a few seconds per round, so that a client can be killed while it trains.
SLOW_TRAINING_RUN: dict[str, Any] = {
    "data.clients": 3,
    "train.rounds": 3,
    "train.local_epochs": 25,
    "runtime.quorum": 0.5,
    "runtime.rejoin_grace_s": 2.0,
    "runtime.round_timeout_s": 60.0,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_client_killed_mid_round_the_round_closes_with_the_others(runtime: Runtime, tmp_path: Path) -> None:
    out = tmp_path / "run"
    coord = runtime.coordinator(SLOW_TRAINING_RUN, out)
    clients = [runtime.clients(coord.address, str(k)) for k in range(3)]
    wait_until(lambda: "round 2: sampled" in coord.log(), timeout_s=150, what="round 2 dispatched")
    time.sleep(0.1)  # the payload is on its way; training takes seconds
    runtime.kill(clients[2])
    assert "round 2 done" not in clients[2].log_path.read_text(), "client 2 finished round 2 before the kill; train longer"

    assert coord.wait(120) == 0, coord.log()[-3000:]
    assert [wait_exit(c, 30) for c in clients[:2]] == [0, 0]
    rounds = read_record(out)["rounds"]
    assert [r["round"] for r in rounds] == [1, 2, 3]
    assert [r["sampled"] for r in rounds] == [[0, 1, 2]] * 3
    assert [r["participants"] for r in rounds] == [[0, 1, 2], [0, 1], [0, 1]]
    # Closed once the dead client stayed unreachable for rejoin_grace_s, not at round_timeout_s.
    assert rounds[1]["duration_s"] < SLOW_TRAINING_RUN["runtime.round_timeout_s"] / 2
    assert re.search(r"round 2: clients \[2\] gone; closing with the quorum", coord.log())


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_client_gone_for_good_costs_one_rejoin_grace_not_one_per_round(runtime: Runtime, tmp_path: Path) -> None:
    grace_s = 30.0
    settings = {"data.clients": 3, "train.rounds": 5, "runtime.quorum": 0.5, "runtime.rejoin_grace_s": grace_s,
                "runtime.round_timeout_s": 120.0}
    out = tmp_path / "run"
    coord = runtime.coordinator(settings, out)
    clients = [runtime.clients(coord.address, str(k)) for k in range(3)]
    wait_until(lambda: completed_rounds(out) >= 1, timeout_s=150, what="round 1")
    runtime.kill(clients[2])

    assert coord.wait(150) == 0, coord.log()[-3000:]
    rounds = read_record(out)["rounds"]
    without = [r for r in rounds if r["participants"] == [0, 1]]
    assert [r["sampled"] for r in rounds] == [[0, 1, 2]] * 5 and len(without) >= 3, [r["participants"] for r in rounds]
    # The first round without it waits for it to come back; every later one closes once the other two answered.
    assert [r["duration_s"] < grace_s / 2 for r in without[1:]] == [True] * len(without[1:]), [r["duration_s"] for r in rounds]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_coordinator_killed_after_a_round_resumes_and_ends_as_if_never_interrupted(
    runtime: Runtime, tmp_path: Path, reference_run: FinishedRun
) -> None:
    out = tmp_path / "run"
    first = runtime.coordinator(SAMPLED_RUN, out)
    clients = runtime.clients(first.address, "0-3")
    wait_until(lambda: completed_rounds(out) >= 1, timeout_s=150, what="round 1 checkpointed", interval_s=0.01)
    runtime.kill(first.child)
    done = completed_rounds(out)
    assert 1 <= done < SAMPLED_RUN["train.rounds"], f"killed too late: {done} rounds done"

    second = runtime.coordinator(SAMPLED_RUN, out, port=first.port)  # same address: the clients reconnect by themselves
    assert second.wait(150) == 0, second.log()[-3000:]
    assert wait_exit(clients, 30) == 0
    log = second.log()
    assert f"resuming after round {done})" in log
    played = [int(n) for n in re.findall(r"round (\d+): sampled", log)]
    assert played == list(range(done + 1, SAMPLED_RUN["train.rounds"] + 1))

    record = read_record(out)
    assert [r["round"] for r in record["rounds"]] == list(range(1, SAMPLED_RUN["train.rounds"] + 1))
    assert [r["sampled"] for r in record["rounds"]] == [r["sampled"] for r in reference_run.record["rounds"]]
    final = checkpoint.load(out)
    assert final is not None
    for key, value in reference_run.final_state.items():
        assert torch.equal(final.global_state[key], value), f"{key} differs from the uninterrupted run"


@pytest.mark.serial  # asserts a time bound: runs alone, after the parallel tests
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_below_quorum_the_coordinator_exits_3_within_the_registration_timeout(runtime: Runtime, tmp_path: Path) -> None:
    timeout_s = 8.0
    settings = {"data.clients": 3, "runtime.quorum": 0.5, "runtime.registration_timeout_s": timeout_s}
    port = free_port()
    # The lone client starts first and waits for the coordinator, so it is surely registered before the timeout.
    lone = runtime.clients(f"127.0.0.1:{port}", "0")
    coord = runtime.coordinator(settings, tmp_path / "run", port=port)
    serving = time.monotonic()
    assert coord.wait(timeout_s + 60) == 3, coord.log()[-3000:]
    assert time.monotonic() - serving < timeout_s + 15
    message = "only 1 of 3 clients registered within 8s (quorum 2)"
    assert message in coord.log()
    record = read_record(tmp_path / "run")
    assert record["success"] is False and record["error"] == message and record["rounds"] == []
    assert wait_exit(lone, 30) == 3  # the client learns the run failed and exits with the same code


@pytest.mark.serial  # asserts a time bound: runs alone, after the parallel tests
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sigterm_stops_the_coordinator_with_143_and_its_checkpoint_kept(runtime: Runtime, tmp_path: Path) -> None:
    out = tmp_path / "run"
    coord = runtime.coordinator({**SLOW_TRAINING_RUN, "train.rounds": 6}, out)
    runtime.clients(coord.address, "0-2")
    wait_until(lambda: completed_rounds(out) >= 1, timeout_s=150, what="round 1 checkpointed", interval_s=0.05)
    coord.child.process.send_signal(signal.SIGTERM)
    stopped_at = time.monotonic()
    assert coord.wait(30) == 143, coord.log()[-3000:]
    assert time.monotonic() - stopped_at < 15
    kept = completed_rounds(out)
    assert 1 <= kept < 6
    assert f"stopped by signal after round {kept} (checkpoint kept)" in coord.log()


@pytest.mark.serial  # asserts a time bound: runs alone, after the parallel tests
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sigterm_ends_a_client_waiting_for_a_coordinator_that_is_gone(runtime: Runtime, tmp_path: Path) -> None:
    # Client 1 never comes: the coordinator waits for it, client 0 sits registered on its dispatch stream.
    settings = {"data.clients": 2, "runtime.quorum": 1.0, "runtime.registration_timeout_s": 150.0}
    coord = runtime.coordinator(settings, tmp_path / "run")
    client = runtime.clients(coord.address, "0")
    wait_until(lambda: "client 0: registered" in client.log_path.read_text(), timeout_s=150, what="client 0 registered")
    runtime.kill(coord.child)
    wait_until(lambda: "client 0: link lost" in client.log_path.read_text(), timeout_s=30, what="client 0 lost the link")
    time.sleep(2.0)  # past the reconnect pause: inside the wait for a ready coordinator (30 s per try)
    client.process.send_signal(signal.SIGTERM)
    stopped_at = time.monotonic()
    assert wait_exit(client, 30) == 0
    assert time.monotonic() - stopped_at < 5, "the SIGTERM waited on the call for the run spec"
    assert "client 0: stopped while waiting for the coordinator" in client.log_path.read_text()
