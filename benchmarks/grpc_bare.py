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
# Round trips run and dropped on a new channel: the first few are slower while gRPC's flow-control window (BDP
# probing) grows (measured: 0.068 s falling to 0.048 s over the first nine).
WARM_UP = 3
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


class BareServer:
    """The bare server in its own process, and a client of it: `round_trip()` times one push and one upload."""

    def __enter__(self) -> BareServer:
        self._server = subprocess.Popen([sys.executable, __file__, "--role", "server"], stdout=subprocess.PIPE, text=True)
        assert self._server.stdout is not None
        try:
            port = int(self._server.stdout.readline())
            self._channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS)
            self._push = self._channel.unary_stream("/bare/push", identity, identity)
            self._upload = self._channel.stream_unary("/bare/upload", identity, identity)
            self._messages = [os.urandom(CHUNK_BYTES) for _ in range(CHUNKS)]
            for _ in range(WARM_UP):
                self.round_trip()
        except BaseException:
            self._server.kill()
            self._server.wait(10)
            raise
        return self

    def round_trip(self) -> tuple[float, float]:
        """Seconds of (43 MiB down a server stream, 43 MiB up a client stream)."""
        started = time.perf_counter()
        received = sum(len(m) for m in self._push(b"", timeout=60))
        pushed = time.perf_counter()
        assert received == CHUNKS * CHUNK_BYTES and self._upload(iter(self._messages), timeout=60)
        return pushed - started, time.perf_counter() - pushed

    def __exit__(self, *exc: object) -> None:
        self._channel.close()
        self._server.kill()
        self._server.wait(10)


def bare_round_trips(rounds: int) -> tuple[float, float]:
    """Median seconds of (43 MiB down a server stream, 43 MiB up a client stream) to and from a bare gRPC server."""
    with BareServer() as bare:
        trips = [bare.round_trip() for _ in range(rounds)]
    return statistics.median(t[0] for t in trips), statistics.median(t[1] for t in trips)


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
