"""Liveness by heartbeat: a frozen (SIGSTOP'd) client is dropped in seconds; a long local training never is."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from runtime_harness import Runtime, read_record, wait_exit, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # serial: asserts time bounds
TIMEOUT_S = 3.0  # half runtime.heartbeat_timeout_s's default, so client 0's training can be short and still outlast 3 timeouts


def test_frozen_client_dropped_within_10s_while_a_long_training_is_not(runtime: Runtime, tmp_path: Path) -> None:
    settings = {
        "data.clients": 2,
        "train.rounds": 1,
        # ~0.06 s a step on a quiet machine (measured: 120 steps took 7.6 s), ~0.35 s on a busy one: 250 steps keep
        # client 0 busy for 15-90 s, over 3 * TIMEOUT_S and well inside the round's timeout
        "train.model": "resnet18",
        "train.local_epochs": 20,
        "train.max_steps": 250,
        "runtime.heartbeat_s": 1.0,
        "runtime.heartbeat_timeout_s": TIMEOUT_S,
        "runtime.round_timeout_s": 600.0,
    }
    coord = runtime.coordinator(settings, tmp_path / "run")
    clients = [runtime.clients(coord.address, str(cid)) for cid in range(2)]
    for child in clients:
        wait_until(lambda: "round 1: training on" in child.log_path.read_text(), timeout_s=240, what=f"{child.role} trains")
    clients[1].process.send_signal(signal.SIGSTOP)
    frozen_at = time.monotonic()
    wait_until(lambda: "client 1 dropped: no heartbeat" in coord.log(), timeout_s=30, what="client 1 dropped", interval_s=0.05)
    assert time.monotonic() - frozen_at < TIMEOUT_S + 4.0  # the timeout, a liveness check (half a heartbeat) and slack

    assert coord.wait(600) == 0, coord.log()[-3000:]
    assert wait_exit(clients[0], 30) == 0
    round_1 = read_record(tmp_path / "run")["rounds"][0]
    assert round_1["participants"] == [0]
    assert round_1["phases_s"]["training"] > 3 * TIMEOUT_S  # client 0 trained through several timeouts...
    assert "client 0 dropped" not in coord.log()  # ...and was never taken for dead
    runtime.kill(clients[1])
