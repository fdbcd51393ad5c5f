"""What the data plane's mutual-TLS handshake costs per transfer at K = 100: each round every client opens two
connections (fetch, submit), so the coordinator completes 2 K handshakes a round.

Certificates from `fedsynth deploy provision` (K clients); the server side is the data plane's own context
(tls.ssl_server_context) in a thread of this process, each client its own (tls.ssl_client_context, built once per
client as a node does). Times K handshakes one after the other (the client's wall clock per transfer, and the
server thread's CPU time per handshake), then K at once from K threads.

    python benchmarks/tls_handshake.py [--clients 100]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

from deploy.provision import provision
from fedsynth.wire.tls import TLSFiles, ssl_client_context, ssl_server_context


def serve(listener: socket.socket, context: object, count: int, cpu: list[float]) -> None:
    """Accept `count` connections; handshake each (timed in this thread's CPU), read one byte, close."""
    for _ in range(count):
        raw, _ = listener.accept()
        started = time.thread_time()
        with context.wrap_socket(raw, server_side=True) as conn:  # type: ignore[attr-defined]
            cpu.append(time.thread_time() - started)
            conn.recv(1)


def handshake(port: int, context: object) -> float:
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as raw:
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as conn:  # type: ignore[attr-defined]
            elapsed = time.perf_counter() - started
            conn.sendall(b"x")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=100)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fedsynth-tls-") as tmp:
        folder = Path(tmp)
        started = time.perf_counter()
        provision(folder, args.clients)
        provisioned = time.perf_counter() - started
        server = ssl_server_context(TLSFiles.from_dir(folder, "coordinator"))
        clients = [ssl_client_context(TLSFiles.from_dir(folder, f"client-{k}")) for k in range(args.clients)]
        results = {}
        for mode in ("one after the other", "all at once"):
            listener = socket.create_server(("127.0.0.1", 0), backlog=args.clients)
            cpu: list[float] = []
            thread = threading.Thread(target=serve, args=(listener, server, args.clients, cpu))
            thread.start()
            port = listener.getsockname()[1]
            walls: list[float] = []
            began = time.perf_counter()
            if mode == "one after the other":
                walls = [handshake(port, context) for context in clients]
            else:
                workers = [threading.Thread(target=lambda c=c: walls.append(handshake(port, c))) for c in clients]
                for worker in workers:
                    worker.start()
                for worker in workers:
                    worker.join()
            total = time.perf_counter() - began
            thread.join()
            listener.close()
            results[mode] = (walls, cpu, total)
    print(f"{args.clients} clients, mutual TLS (the data plane's contexts); {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}; provisioning took {provisioned:.1f} s\n")
    print("| handshakes | per transfer, client's wall clock: median (ms) | p90 (ms) | server CPU per handshake, median (ms) | all K (s) |")
    print("|---|---:|---:|---:|---:|")
    for mode, (walls, cpu, total) in results.items():
        walls = sorted(walls)
        print(f"| {args.clients}, {mode} | {statistics.median(walls) * 1e3:.1f} | {walls[int(0.9 * len(walls))] * 1e3:.1f} | "
              f"{statistics.median(cpu) * 1e3:.2f} | {total:.2f} |")
    cpu_ms = statistics.median(results["one after the other"][1]) * 1e3
    print(f"\nper round at K = {args.clients} (fetch + submit: {2 * args.clients} handshakes): about "
          f"{2 * args.clients * cpu_ms / 1e3:.2f} s of the coordinator's CPU")


if __name__ == "__main__":
    main()
