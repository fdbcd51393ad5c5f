"""A client frozen (SIGSTOP) past the round deadline: the round closes with the quorum, the client rejoins later."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from runtime_harness import Runtime, completed_rounds, read_record, wait_exit, wait_until

SETTINGS: dict[str, object] = {
    "data.clients": 3,
    "train.rounds": 5,
    "train.local_epochs": 1,
    "runtime.round_timeout_s": 6.0,
    "runtime.quorum": 0.6,
    "runtime.rejoin_grace_s": 30.0,
}


@pytest.mark.slow
def test_frozen_client_misses_a_round_then_rejoins(runtime: Runtime, tmp_path: Path) -> None:
    out = tmp_path / "run"
    coordinator = runtime.coordinator(SETTINGS, out)
    runtime.clients(coordinator.address, "0")
    runtime.clients(coordinator.address, "1")
    frozen = runtime.clients(coordinator.address, "2")
    wait_until(lambda: completed_rounds(out) >= 1, timeout_s=180, what="round 1")
    frozen.process.send_signal(signal.SIGSTOP)
    try:
        stopped_at = completed_rounds(out)
        wait_until(lambda: completed_rounds(out) >= stopped_at + 2, timeout_s=60, what="two rounds without client 2")
    finally:
        frozen.process.send_signal(signal.SIGCONT)
    assert coordinator.wait(timeout_s=180) == 0, coordinator.log()[-2000:]
    assert wait_exit(frozen, 60) == 0
    rounds = read_record(out)["rounds"]
    missed = [r for r in rounds[stopped_at:] if 2 not in r["participants"]]
    assert missed and all(r["participants"] == [0, 1] for r in missed)  # closed with the quorum at the deadline
    assert all(r["duration_s"] >= SETTINGS["runtime.round_timeout_s"] - 0.5 for r in missed[:1])
    rejoined = [r for r in rounds if r["round"] > missed[-1]["round"] and 2 in r["participants"]]
    assert rejoined, [r["participants"] for r in rounds]  # the thawed client took part again
