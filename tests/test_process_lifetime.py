"""Process lifetime: children die with a killed launcher, SIGTERM stops local training at once, no DP-GAN orphan."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedsynth.process import lifetime
from fedsynth.process.runtime import EXIT_OK
from runtime_harness import Runtime, wait_exit, wait_until

pytestmark = pytest.mark.serial  # asserts time bounds: runs alone, after the parallel tests

START_TIMEOUT_S = 240.0  # several cold `import torch` on a busy 2-core machine


# ---- processes as /proc sees them (a zombie counts as gone: it has exited, only its parent has not reaped it) ----


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of a live process, None when it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else (fields[0], int(fields[1]))


def alive(pid: int) -> bool:
    return _stat(pid) is not None


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return ""


def live_pids() -> Iterator[int]:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and alive(int(entry.name)):
            yield int(entry.name)


def children(parent: int) -> list[int]:
    return [pid for pid in live_pids() if (_stat(pid) or ("", -1))[1] == parent]


def running_with(text: str) -> list[int]:
    """Live processes whose command line mentions `text` (a run's out-dir), this test process excepted."""
    return [pid for pid in live_pids() if pid != os.getpid() and text in cmdline(pid)]


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def seconds_until(predicate, *, timeout_s: float) -> float:  # type: ignore[no-untyped-def]
    """Seconds until predicate() holds, polled every 5 ms; TimeoutError past timeout_s."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"not within {timeout_s:.0f}s")
        time.sleep(0.005)
    return time.monotonic() - started


# ---- the mechanism alone, with plain Python processes ----------------------------------------------------------

SLEEPER = "from fedsynth.process import lifetime; lifetime.bind_to_parent(); print('ready', flush=True); import time; time.sleep(120)"
PARENT = (
    "import subprocess, sys, time; from fedsynth.process import lifetime; "
    f"child = subprocess.Popen([sys.executable, '-c', {SLEEPER!r}], env=lifetime.child_env()); "
    "print(child.pid, flush=True); time.sleep(120)"
)


@pytest.mark.slow
def test_a_bound_child_dies_with_its_parent_killed_by_sigkill() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "ready"  # bound: the child got past bind_to_parent()
        parent.kill()
        parent.wait(timeout=10)
        took = seconds_until(lambda: not alive(child), timeout_s=5)
        assert took < 1.0, took
    finally:
        parent.kill()
        parent.wait(timeout=10)


@pytest.mark.slow
def test_a_child_whose_parent_died_before_it_started_exits_at_once() -> None:
    env = {**os.environ, lifetime.PARENT_PID_ENV: "1"}  # not this child's parent: as if the real one had died
    done = subprocess.run([sys.executable, "-c", SLEEPER], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == lifetime.EXIT_PARENT_GONE and "ready" not in done.stdout, done.stderr


# ---- `fedsynth run`: kill -9 of the launcher, SIGTERM of a client in training ------------------------------------


def start_launcher(out: Path, *settings: str) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "fedsynth.cli", "run", "--out-dir", str(out), "--no-progress"]
    for item in ("generation.policy=none", "runtime.registration_timeout_s=240.0", *settings):
        command += ["--set", item]
    out.mkdir(parents=True)
    with open(out.parent / f"{out.name}-launcher.log", "wb") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def wait_for_logs(out: Path, launcher: subprocess.Popen[bytes], pattern: str, text: str, count: int) -> list[Path]:
    def found() -> list[Path]:
        assert launcher.poll() is None, (out.parent / f"{out.name}-launcher.log").read_text()[-3000:]
        logs = [p for p in sorted((out / "logs").glob(pattern)) if text in p.read_text(errors="replace")]
        return logs if len(logs) >= count else []

    return wait_until(found, timeout_s=START_TIMEOUT_S, what=f"{count} logs {pattern} saying {text!r}", interval_s=0.2)


def stop_launcher(out: Path, launcher: subprocess.Popen[bytes]) -> None:
    if launcher.poll() is None:
        launcher.send_signal(signal.SIGTERM)
        try:
            launcher.wait(timeout=60)
        except subprocess.TimeoutExpired:
            launcher.kill()
            launcher.wait(timeout=10)
    kill_all(running_with(str(out)))


@pytest.mark.slow
def test_no_process_outlives_a_launcher_killed_by_sigkill(tmp_path: Path) -> None:
    out = tmp_path / "run"
    launcher = start_launcher(out, "train.rounds=50", "data.clients=2", "runtime.clients_per_process=1")
    try:
        wait_for_logs(out, launcher, "client-*.log", "registered", 2)
        started = children(launcher.pid)
        assert len(started) == 3, [cmdline(pid) for pid in started]  # the coordinator and two client nodes
        launcher.kill()
        launcher.wait(timeout=10)
        took = seconds_until(lambda: not any(alive(p) for p in started) and not running_with(str(out)), timeout_s=30)
        assert took < 5.0, took
        print(f"no process left {took:.2f}s after kill -9 of the launcher")
    finally:
        stop_launcher(out, launcher)


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_sigterm_stops_a_client_in_local_training_within_a_second(tmp_path: Path) -> None:
    out = tmp_path / "run"
    launcher = start_launcher(
        out, "generation.policy=fedeas", "generation.backend=holdout", "data.holdout_fraction=0.2", "data.clients=2",
        "runtime.clients_per_process=2", "train.rounds=3", "train.local_epochs=100000", "runtime.round_timeout_s=600.0",
    )
    try:
        [log] = wait_for_logs(out, launcher, "client-*.log", "round 1: training on", 1)
        wait_until(lambda: log.read_text().count("round 1: training on") == 2, timeout_s=60, what="both clients training")
        time.sleep(1.0)  # well into the epochs
        [client] = [pid for pid in children(launcher.pid) if " client " in cmdline(pid)]
        cache = snapshot(out / "cache")
        assert any(name.endswith(".npy") for name in cache), cache  # FedEAS images, cached before training
        os.kill(client, signal.SIGTERM)
        took = seconds_until(lambda: not alive(client), timeout_s=30)
        assert took < 1.0, took
        print(f"client node exited {took:.3f}s after SIGTERM in local training")
        text = log.read_text()
        assert text.count("local training stopped after") == 2 and "uploading" not in text, text[-3000:]
        assert snapshot(out / "cache") == cache  # intact: every part and manifest as it was, no temporary file
    finally:
        stop_launcher(out, launcher)


# ---- SDA-FL: the client's DP-GAN child -------------------------------------------------------------------------

SDAFL: dict[str, object] = {
    "data.clients": 2,
    "train.algorithm": "sdafl",
    "sdafl.gan_steps": 100000,  # trains far longer than the test
    "sdafl.samples_per_client": 40,
}


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGKILL], ids=["sigint", "sigkill"])
def test_the_dpgan_child_dies_with_its_client(runtime: Runtime, tmp_path: Path, signum: int) -> None:
    """... and the client's private shard is never on disk: not while its DP-GAN trains, not after a kill -9; a copy an
    older version left behind is removed when the client starts."""
    leftover = tmp_path / "cache" / "client-0000" / "sdafl-0123456789abcdef" / ".private-shard.npz"
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"images an older client left when it was killed")
    coordinator = runtime.coordinator(SDAFL, tmp_path / "run")
    client = runtime.clients(coordinator.address, "0")

    def dpgan() -> list[int]:
        assert client.process.poll() is None, client.log_path.read_text()[-3000:]
        return [pid for pid in children(client.pid) if "dpgan" in cmdline(pid)]

    [gan] = wait_until(dpgan, timeout_s=START_TIMEOUT_S, what="the client's DP-GAN child", interval_s=0.1)
    try:
        assert f"removed {leftover}" in client.log_path.read_text()
        assert alive(gan) and not list((tmp_path / "cache").rglob("*.npz"))  # training, its shard read from a pipe
        client.process.send_signal(signum)
        took = seconds_until(lambda: not alive(gan), timeout_s=30)
        assert took < 5.0, took
        print(f"DP-GAN child gone {took:.3f}s after {signal.Signals(signum).name} to its client")
        if signum == signal.SIGINT:
            assert wait_exit(client, 10) == EXIT_OK
        assert not list((tmp_path / "cache").rglob("*.npz"))
    finally:
        kill_all([gan])
