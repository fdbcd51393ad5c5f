"""kill -9 a client while its update is on the wire: the partial stream is refused, the round closes without it."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from runtime_harness import Runtime, read_record, wait_exit, wait_until

# ResNet-18 on 8x8 digits: a 45 MB update takes long enough on the wire to be cut, and one step trains fast.
SETTINGS: dict[str, object] = {
    "data.clients": 3,
    "train.model": "resnet18",
    "train.rounds": 2,
    "train.max_steps": 1,
    "runtime.rejoin_grace_s": 2.0,
}


@pytest.mark.slow
def test_client_killed_mid_upload(runtime: Runtime, tmp_path: Path) -> None:
    out = tmp_path / "run"
    coordinator = runtime.coordinator(SETTINGS, out)
    survivors = runtime.clients(coordinator.address, "0-1")
    victim = runtime.clients(coordinator.address, "2")
    # The coordinator logs an update's header before its 45 MB of chunks: kill the sender right then.
    wait_until(lambda: "receiving client 2's update" in coordinator.log(), timeout_s=240, what="client 2's upload", interval_s=0.002)
    victim.process.send_signal(signal.SIGKILL)
    victim.process.wait(timeout=10)
    assert coordinator.wait(timeout_s=240) == 0, coordinator.log()[-2000:]
    assert wait_exit(survivors, 60) == 0
    rounds = read_record(out)["rounds"]
    assert rounds[0]["participants"] == [0, 1]  # the cut update never entered the aggregate
    log = coordinator.log()
    assert "update from client 2 accepted" not in log
    assert "broke off before its last chunk" in log or "payload ended after" in log, log[-2000:]
    assert len(rounds) == 2
