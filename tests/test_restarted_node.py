"""A client node killed -9 and started again at once takes its client id back once the coordinator lets go of the old
session (runtime.heartbeat_timeout_s), and the run completes; a second LIVE node claiming an id is still refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime_harness import Runtime, read_record, wait_exit, wait_until

# serial: the restarted process must reach Register within runtime.heartbeat_timeout_s of the kill (a few seconds
# alone; a loaded machine's start-up can take longer) for the test to see the wait it is about
pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(600)]
WAITING = "another node holds client id 0"


def test_a_node_killed_and_restarted_at_once_rejoins_and_the_run_completes(runtime: Runtime, tmp_path: Path) -> None:
    settings = {
        "data.clients": 1,
        "train.rounds": 3,
        # long enough that the restarted process (a few seconds to import torch and load its shard) still finds the
        # old session held, short enough to wait out
        "runtime.heartbeat_timeout_s": 30.0,
        "runtime.rejoin_grace_s": 60.0,
        "runtime.round_timeout_s": 300.0,
    }
    coord = runtime.coordinator(settings, tmp_path / "run")
    first = runtime.clients(coord.address, "0")
    wait_until(lambda: "round 1: training on" in first.log_path.read_text(), timeout_s=240, what="client 0 trains")
    runtime.kill(first)
    again = runtime.clients(coord.address, "0")

    assert coord.wait(300) == 0, coord.log()[-3000:]
    assert wait_exit(again, 60) == 0, again.log_path.read_text()[-3000:]
    log = again.log_path.read_text()
    assert WAITING in log and log.count(WAITING) == 1  # said once, however many tries it took
    assert "two nodes claim client id 0" in coord.log()  # it really was refused while the old session stood
    assert [r["participants"] for r in read_record(tmp_path / "run")["rounds"]] == [[0], [0], [0]]


def test_a_second_live_node_claiming_an_id_is_refused_after_waiting_and_the_run_goes_on(runtime: Runtime, tmp_path: Path) -> None:
    settings = {"data.clients": 2, "train.rounds": 2, "runtime.heartbeat_timeout_s": 8.0}
    coord = runtime.coordinator(settings, tmp_path / "run")
    holder = runtime.clients(coord.address, "0")
    wait_until(lambda: "registered" in holder.log_path.read_text(), timeout_s=240, what="client 0 registers")
    intruder = runtime.clients(coord.address, "0")  # the holder heartbeats all along: its id never comes free

    assert wait_exit(intruder, 120) == 1
    log = intruder.log_path.read_text()
    assert WAITING in log and "registration refused: client 0: two nodes claim client id 0" in log
    other = runtime.clients(coord.address, "1")
    assert coord.wait(300) == 0, coord.log()[-3000:]
    assert wait_exit(holder, 60) == 0 and wait_exit(other, 60) == 0
