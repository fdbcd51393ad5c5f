"""The floor of any gRPC transport of ResNet-18's bytes from Python: 43 messages of 1 MiB each way, nothing else.

A generic gRPC server in a second process (no fedsynth code, no hashing, no copies into buffers) streams 43 MiB to
this process (a server stream, as fedsynth's Subscribe) and receives 43 MiB back (a client stream, as SubmitUpdate),
beside a raw TCP echo of the same bytes. Whatever fedsynth adds on top, a round trip over gRPC cannot be faster than
this on the same machine; benchmarks/transport.py measures fedsynth's real paths.

    python benchmarks/grpc_bare.py --rounds 9
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from concurrent import futures

import grpc

CHUNKS, CHUNK_BYTES = 43, 1 << 20
OPTIONS = [("grpc.max_receive_message_length", 8 << 20), ("grpc.max_send_message_length", 8 << 20)]


def identity(message: bytes) -> bytes:
    return message


def serve() -> None:
    """The server process: prints its port, serves until killed."""
    data = [os.urandom(CHUNK_BYTES) for _ in range(CHUNKS)]

    def push(request: bytes, context: grpc.ServicerContext) -> object:
        yield from data

    def upload(messages: object, context: grpc.ServicerContext) -> bytes:
        return str(sum(len(m) for m in messages)).encode()  # type: ignore[attr-defined]

    handler = grpc.method_handlers_generic_handler("bare", {
        "push": grpc.unary_stream_rpc_method_handler(push, identity, identity),
        "upload": grpc.stream_unary_rpc_method_handler(upload, identity, identity),
    })
    server = grpc.server(futures.ThreadPoolExecutor(4), handlers=[handler], options=OPTIONS)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    server.wait_for_termination()


def raw_echo_round_trip(data: bytes, rounds: int) -> float:
    """Median seconds to send `data` to an echo process over loopback TCP and read it back."""
    echo = subprocess.Popen([sys.executable, "-c", ECHO, str(len(data))], stdout=subprocess.PIPE, text=True)
    try:
        assert echo.stdout is not None
        with socket.create_connection(("127.0.0.1", int(echo.stdout.readline())), timeout=30) as conn:
            back = bytearray(len(data))
            times = []
            for _ in range(rounds):
                started = time.perf_counter()
                conn.sendall(data)
                view, got = memoryview(back), 0
                while got < len(data):
                    got += conn.recv_into(view[got:])
                times.append(time.perf_counter() - started)
        return statistics.median(times)
    finally:
        echo.kill()
        echo.wait(10)


ECHO = r"""
import socket, sys
listener = socket.create_server(("127.0.0.1", 0))
print(listener.getsockname()[1], flush=True)
conn, _ = listener.accept()
buffer = bytearray(int(sys.argv[1]))
while True:
    view, got = memoryview(buffer), 0
    while got < len(buffer):
        n = conn.recv_into(view[got:])
        if n == 0:
            sys.exit(0)
        got += n
    conn.sendall(buffer)
"""


def bare_round_trips(rounds: int) -> tuple[float, float]:
    """Median seconds of (43 MiB down a server stream, 43 MiB up a client stream) to and from a bare gRPC server."""
    server = subprocess.Popen([sys.executable, __file__, "--role", "server"], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS) as channel:
            push = channel.unary_stream("/bare/push", identity, identity)
            upload = channel.stream_unary("/bare/upload", identity, identity)
            messages = [os.urandom(CHUNK_BYTES) for _ in range(CHUNKS)]
            downs, ups = [], []
            for _ in range(rounds):
                started = time.perf_counter()
                received = sum(len(m) for m in push(b"", timeout=60))
                pushed = time.perf_counter()
                assert received == CHUNKS * CHUNK_BYTES and upload(iter(messages), timeout=60)
                downs.append(pushed - started)
                ups.append(time.perf_counter() - pushed)
    finally:
        server.kill()
        server.wait(10)
    return statistics.median(downs), statistics.median(ups)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--role", choices=["server"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "server":
        return serve()
    down, up = bare_round_trips(args.rounds)
    raw = raw_echo_round_trip(os.urandom(CHUNKS * CHUNK_BYTES), args.rounds)
    print(f"{CHUNKS} x {CHUNK_BYTES >> 10} KiB each way, median of {args.rounds}; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}\n")
    print("| path | seconds |\n|---|---:|")
    print(f"| gRPC server stream, 43 messages down | {down:.3f} |")
    print(f"| gRPC client stream, 43 messages up | {up:.3f} |")
    print(f"| **gRPC round trip, nothing else** | **{down + up:.3f}** |")
    print(f"| raw TCP round trip of the same bytes | {raw:.3f} |")
    print(f"\nthe highest ratio (raw ÷ round trip) any gRPC transport of these bytes could reach here: {raw / (down + up):.2f}")


if __name__ == "__main__":
    main()
