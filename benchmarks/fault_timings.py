"""Time to notice a dead client (kill -9) and a frozen one (SIGSTOP: its heartbeats stop), whether a long local
training is ever taken for a frozen client, and from a coordinator restart to the next round.

python benchmarks/fault_timings.py            # prints a markdown table; each figure is one measurement
python benchmarks/fault_timings.py --train-steps 400   # a shorter local training (ResNet-18 steps) in the second part
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import socket
import tempfile
import time
from datetime import datetime
from pathlib import Path

from deploy.processes import ProcessGroup, fedsynth_command, wait_for_file
from deploy.scrape import scrape

SETTINGS = [
    "data.clients=4", "train.rounds=400", "train.local_epochs=1", "generation.policy=none", "runtime.quorum=0.5",
    "runtime.round_timeout_s=120", "runtime.rejoin_grace_s=3", "runtime.heartbeat_s=2",
]
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*client (\d+) (?:disconnected|dropped)")
ROUND_STARTED = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*round \d+: sampled")
SCRAPE_INTERVAL_S = 0.05  # polling /metrics faster would load the coordinator it times


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rounds(metrics_port_file: Path) -> int:
    """The last completed round, from the coordinator's `fedsynth_coordinator_round` gauge (docs/metrics.md)."""
    try:
        values = scrape(f"http://127.0.0.1:{metrics_port_file.read_text().strip()}/metrics")
    except OSError:
        return 0
    return int(values.get("fedsynth_coordinator_round", 0))


def _wait(predicate, timeout_s: float, what: str, interval_s: float = 0.01):
    stop_at = time.monotonic() + timeout_s
    while time.monotonic() < stop_at:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise TimeoutError(what)


def _stamp(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _round_started(log: Path) -> float | None:
    for line in log.read_text().splitlines():
        match = ROUND_STARTED.match(line)
        if match:
            return _stamp(match.group(1))
    return None


def _disconnect_time(log: Path, client_id: int) -> float | None:
    for line in log.read_text().splitlines():
        match = STAMP.match(line)
        if match and int(match.group(2)) == client_id:
            return _stamp(match.group(1))
    return None


def frozen_versus_training(root: Path, train_steps: int) -> tuple[float, float, bool]:
    """Two clients train ResNet-18 for train_steps steps; one is SIGSTOP'd as training starts. Returns (seconds until
    the frozen one is dropped, the other's local training seconds, whether the other was ever dropped)."""
    group = ProcessGroup(root / "logs")
    out, port_file = root / "run", root / "coordinator.port"
    settings = ["data.clients=2", "train.rounds=1", "train.model=resnet18", "train.local_epochs=100",
                f"train.max_steps={train_steps}", "generation.policy=none", "runtime.quorum=0.5",
                "runtime.round_timeout_s=1800", "runtime.rejoin_grace_s=3"]  # heartbeat_s, heartbeat_timeout_s: defaults
    sets = [item for s in settings for item in ("--set", s)]
    try:
        coord = group.start("coordinator", fedsynth_command("coordinator", *sets, "--out-dir", str(out), "--port", "0",
                                                            "--port-file", str(port_file), "--insecure"))
        port = wait_for_file(port_file, coord, timeout_s=120)
        clients = [group.start(f"client-{k}", fedsynth_command("client", "--coordinator", f"127.0.0.1:{port}", "--clients",
                                                               str(k), "--cache-dir", str(root / "cache"), "--insecure"))
                   for k in range(2)]
        for child in clients:
            _wait(lambda: "round 1: training on" in child.log_path.read_text(), 300, f"{child.role} training")
        frozen_at = time.time()
        clients[1].process.send_signal(signal.SIGSTOP)
        dropped = _wait(lambda: _disconnect_time(coord.log_path, 1), 120, "SIGSTOP detection") - frozen_at
        coord.process.wait(timeout=3600)
        record = json.loads((out / "coordinator.json").read_text())
        training = record["rounds"][0]["phases_s"]["training"]
        return dropped, training, "client 0 dropped" in coord.log_path.read_text()  # it disconnects at the end
    finally:
        group.stop_all(grace_s=5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train-steps", type=int, default=800, help="ResNet-18 steps of the long local training")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="fault-timings-"))
    group = ProcessGroup(root / "logs")
    out, port = root / "run", _free_port()
    sets = [item for s in SETTINGS for item in ("--set", s)]

    def coordinator(name: str):
        port_file, metrics = root / f"{name}.port", root / f"{name}.metrics-port"
        child = group.start(name, fedsynth_command("coordinator", *sets, "--out-dir", str(out), "--port", str(port),
                                                   "--port-file", str(port_file), "--metrics-port", "0",
                                                   "--metrics-port-file", str(metrics), "--insecure"))
        wait_for_file(port_file, child, timeout_s=120)
        return child, metrics

    try:
        coord, metrics = coordinator("coordinator")
        clients = [group.start(f"client-{k}", fedsynth_command("client", "--coordinator", f"127.0.0.1:{port}", "--clients", str(k),
                                                               "--cache-dir", str(root / "cache"), "--insecure")) for k in range(4)]
        _wait(lambda: _rounds(metrics) >= 2, 180, "round 2", SCRAPE_INTERVAL_S)
        killed_at = time.time()
        clients[3].process.send_signal(signal.SIGKILL)
        detected = _wait(lambda: _disconnect_time(coord.log_path, 3), 60, "kill -9 detection")
        frozen_at = time.time()
        clients[2].process.send_signal(signal.SIGSTOP)
        frozen_detected = _wait(lambda: _disconnect_time(coord.log_path, 2), 120, "SIGSTOP detection", 0.05)
        clients[2].process.send_signal(signal.SIGCONT)

        before = _rounds(metrics)
        coord.process.send_signal(signal.SIGKILL)
        coord.process.wait(10)
        restarted_at = time.time()
        restarted, metrics = coordinator("coordinator-restarted")
        listening = time.time() - restarted_at
        round_started = _wait(lambda: _round_started(restarted.log_path), 300, "a round after the restart") - restarted_at
        _wait(lambda: _rounds(metrics) > before, 300, "a round completed after the restart", SCRAPE_INTERVAL_S)
        next_round = time.time() - restarted_at
    finally:
        group.stop_all(grace_s=5)
    dropped, training, false_drop = frozen_versus_training(root / "training", args.train_steps)
    print("| event | seconds |\n|---|---|")
    print(f"| kill -9 of a client -> coordinator logs it disconnected | {detected - killed_at:.3f} |")
    print(f"| SIGSTOP of a client between rounds (no FIN) -> dropped, its heartbeats stopped | {frozen_detected - frozen_at:.1f} |")
    print(f"| SIGSTOP of a client as local training starts -> dropped | {dropped:.1f} |")
    print(f"| the other client's local training ({args.train_steps} ResNet-18 steps), never dropped: {not false_drop} | {training:.1f} |")
    print(f"| coordinator restart -> listening (process start, imports, checkpoint load) | {listening:.1f} |")
    print(f"| coordinator restart -> next round dispatched (clients reconnect and re-register by themselves) | {round_started:.1f} |")
    print(f"| coordinator restart -> that round completed (one client stays dead: closes after rejoin_grace_s = 3) | {next_round:.1f} |")


if __name__ == "__main__":
    main()
