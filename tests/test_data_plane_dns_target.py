"""A client node given the coordinator as dns:///NAME:PORT dials the data plane at NAME (not at "dns:///NAME"), and
the run moves its payloads there."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime_harness import Runtime, wait_exit

pytestmark = [pytest.mark.slow]


def test_a_client_given_a_dns_target_moves_its_payloads_on_the_data_plane(runtime: Runtime, tmp_path: Path) -> None:
    settings = {"runtime.data_plane": "tcp", "runtime.data_plane_min_bytes": 0, "data.clients": 1, "train.rounds": 2,
                "train.local_epochs": 1}
    coord = runtime.coordinator(settings, tmp_path / "run")
    client = runtime.clients(f"dns:///localhost:{coord.port}", "0", reconnect_timeout_s=20.0)
    assert coord.wait(240) == 0, coord.log()[-3000:]
    assert wait_exit(client, 60) == 0, client.log_path.read_text()[-3000:]
    assert "link lost" not in client.log_path.read_text()
