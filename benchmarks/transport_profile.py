"""Where the default (gRPC) round trip's time goes: cProfile of both ends of benchmarks/transport.py's path.

A real coordinator (ResNet-18, one client, no transport setting) runs in a child process with every thread profiled
(each its own cProfile, merged); this process is the client (transport.grpc_round_trips), profiled as a whole. Prints the top functions of each by own time, and the client's time inside gRPC's stream iteration.

    python benchmarks/transport_profile.py --rounds 7 [--top 12]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import tempfile
import threading
from pathlib import Path

from deploy.processes import ProcessGroup, wait_for_file
from local_federation import cifar_shaped_folder
from transport import grpc_round_trips


def coordinator(stats_path: Path, argv: list[str]) -> int:
    """The coordinator's main with every thread profiled (gRPC handlers, round loop, evaluation), the stats of all
    threads merged and written as it exits."""
    from fedsynth.cli import main
    from fedsynth.process import lifetime

    profiles: list[cProfile.Profile] = []
    lock = threading.Lock()

    def begin(*_event: object) -> None:  # a new thread's first event: give it a profiler of its own
        profile = cProfile.Profile()
        with lock:
            profiles.append(profile)
        profile.enable()

    threading.setprofile(begin)
    begin()
    exit_now = lifetime.exit_now

    def dump_and_exit(code: int):  # type: ignore[no-untyped-def]
        with lock:  # calls still running in other threads are left out
            pstats.Stats(*profiles).dump_stats(stats_path)
        exit_now(code)

    lifetime.exit_now = dump_and_exit  # type: ignore[assignment]
    return main(argv)


def summary(stats: pstats.Stats, top: int) -> str:
    out = io.StringIO()
    stats.stream = out  # type: ignore[attr-defined]
    stats.sort_stats("tottime").print_stats(top)
    return "\n".join(line for line in out.getvalue().splitlines() if line.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--role", choices=["coordinator"], help=argparse.SUPPRESS)
    parser.add_argument("--stats", type=Path, help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.role == "coordinator":
        sys.exit(coordinator(args.stats, rest[1:] if rest[:1] == ["--"] else rest))
    with tempfile.TemporaryDirectory(prefix="fedsynth-profile-") as tmp:
        folder = Path(tmp)
        cifar_shaped_folder(folder, train=40, test=2)
        settings = {"data.dataset": "cifar10", "data.data_dir": str(folder), "data.clients": 1, "train.model": "resnet18",
                    "train.rounds": args.rounds, "generation.policy": "none", "runtime.heartbeat_s": 5.0,
                    "runtime.heartbeat_timeout_s": 15.0}
        sets = [item for key, value in settings.items() for item in ("--set", f"{key}={json.dumps(value)}")]
        stats_path, port_file = folder / "coordinator.prof", folder / "port"
        group = ProcessGroup(folder / "logs")
        try:
            child = group.start("coordinator", [sys.executable, __file__, "--role", "coordinator", "--stats", str(stats_path), "--",
                                                "coordinator", *sets, "--out-dir", str(folder / "run"), "--port", "0",
                                                "--port-file", str(port_file), "--insecure"])
            address = f"127.0.0.1:{wait_for_file(port_file, child, timeout_s=180)}"
            client = cProfile.Profile()
            client.enable()
            rounds = grpc_round_trips(address, args.rounds)
            client.disable()
            child.process.wait(timeout=60)
        finally:
            group.stop_all(grace_s=5.0)
        total = sum(sum(v for k, v in r.items() if k != "bytes") for r in rounds)
        print(f"{args.rounds} round trips of {rounds[0]['bytes'] / 1e6:.1f} MB, {total:.3f} s in all on the client's clock\n")
        print("## client (this process), by own time\n")
        print(summary(pstats.Stats(client), args.top))
        print("\n## coordinator, all threads, by own time\n")
        print(summary(pstats.Stats(str(stats_path)), args.top))


if __name__ == "__main__":
    main()
