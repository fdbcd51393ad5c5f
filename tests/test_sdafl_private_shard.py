"""A client's private shard never lies on disk for its DP-GAN: not while it trains, not after a kill -9, and a copy an
older version left behind is removed when the client starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime_harness import Runtime, wait_until

LONG_DPGAN: dict[str, object] = {
    "data.clients": 2,
    "train.algorithm": "sdafl",
    "sdafl.gan_steps": 100000,  # still training when it is killed
    "sdafl.samples_per_client": 40,
}


def _dpgan_children(parent: int) -> list[int]:
    """The pids of `fedsynth generator dpgan` processes whose parent is `parent`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            argv = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if ppid == parent and b"dpgan" in argv:
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_no_private_shard_on_disk_while_the_dpgan_trains_nor_after_a_kill_9(runtime: Runtime, tmp_path: Path) -> None:
    cache = runtime.root / "cache"
    leftover = cache / "client-0000" / "sdafl-0123456789abcdef" / ".private-shard.npz"
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"images an older client left when it was killed")
    coordinator = runtime.coordinator(LONG_DPGAN, tmp_path / "run")
    client = runtime.clients(coordinator.address, "0")
    children = wait_until(lambda: _dpgan_children(client.pid), timeout_s=180, what="the client's DP-GAN child")
    wait_until(lambda: "training its DP-GAN" in client.log_path.read_text(), timeout_s=30, what="the DP-GAN log line")
    assert f"removed {leftover}" in client.log_path.read_text()
    assert all(_alive(pid) for pid in children)  # it is training now
    assert list(cache.rglob("*.npz")) == []
    runtime.kill(client)
    wait_until(lambda: not any(_alive(pid) for pid in children), timeout_s=30, what="the DP-GAN child to end with its parent")
    assert list(cache.rglob("*.npz")) == []
