"""A TCP relay that adds a fixed one-way delay to each direction: the user-space stand-in for `netem delay`.

    python deploy/netns/delay_relay.py --listen 10.77.0.2:0 --target 10.77.0.2:7000 --delay-ms 100 --port-file F

Every accepted connection gets its own upstream connection and two pumps, one per direction. A pump reads a
chunk, stamps it with `arrival + delay` and queues it; its writer sends each chunk when its time comes. Reading
never waits for writing, so the stream stays pipelined: a byte is late by the delay (plus the receiver's own
backpressure), never by the bytes ahead of it. Half-closes are forwarded after the same delay. SIGTERM or
SIGINT stops the listener, drops the open connections and exits 0. It imports the standard library and
fedsynth.process.runtime only (itself standard library only), so it starts fast.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from pathlib import Path

from fedsynth.process.runtime import write_atomic

log = logging.getLogger("delay_relay")

CHUNK_BYTES = 64 * 1024
# Chunks in flight per direction before reading pauses: bounds memory at QUEUE_CHUNKS * CHUNK_BYTES per direction
# while allowing QUEUE_CHUNKS * CHUNK_BYTES / delay of throughput (1024 * 64 KiB / 0.1 s = 640 MiB/s).
QUEUE_CHUNKS = 1024


def parse_address(flag: str, text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise SystemExit(f"delay_relay: error: {flag} expects HOST:PORT, got {text!r}")
    return host, int(port)


async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> int:
    """Copy reader to writer, each chunk `delay_s` after it arrived; forward EOF as a half-close. Returns bytes."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes | None]] = asyncio.Queue(maxsize=QUEUE_CHUNKS)

    async def receive() -> None:
        try:
            while True:
                data = await reader.read(CHUNK_BYTES)
                await queue.put((loop.time() + delay_s, data))
                if not data:  # EOF, forwarded in order after the same delay
                    return
        except OSError:  # a reset: delivered at once, as the kernel would
            await queue.put((loop.time(), None))

    async def deliver() -> int:
        sent = 0
        while True:
            due, data = await queue.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if data is None:
                raise ConnectionResetError("the sending side was reset")
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return sent
            writer.write(data)
            await writer.drain()
            sent += len(data)

    receiving = asyncio.create_task(receive())
    try:
        return await deliver()
    finally:
        receiving.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await receiving


class DelayRelay:
    def __init__(self, listen: tuple[str, int], target: tuple[str, int], delay_s: float) -> None:
        if delay_s < 0:
            raise ValueError(f"delay must be >= 0 s, got {delay_s}")
        self.listen, self.target, self.delay_s = listen, target, delay_s
        self.connections: set[asyncio.Task[None]] = set()
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        """Listen; returns the bound port."""
        self.server = await asyncio.start_server(self._accepted, self.listen[0], self.listen[1])
        return int(self.server.sockets[0].getsockname()[1])

    async def _accepted(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        me = asyncio.current_task()
        assert me is not None
        self.connections.add(me)
        try:
            await self._relay(client_reader, client_writer)
        except asyncio.CancelledError:
            pass  # stop() drops the connection; asyncio's stream callback would log a cancelled handler as an error
        finally:
            self.connections.discard(me)

    async def _relay(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        peer = client_writer.get_extra_info("peername")
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
        except OSError as exc:
            log.warning("%s: cannot reach %s:%d (%s); closing", peer, *self.target, exc)
            client_writer.close()
            return
        writers = (client_writer, upstream_writer)
        pumps = [
            asyncio.create_task(pump(client_reader, upstream_writer, self.delay_s)),
            asyncio.create_task(pump(upstream_reader, client_writer, self.delay_s)),
        ]
        try:
            # Both directions end on their own EOFs; a reset or write error on either ends both at once.
            await asyncio.wait(pumps, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for direction in pumps:
                direction.cancel()
            outcomes = await asyncio.gather(*pumps, return_exceptions=True)
            log.debug("%s: closed (bytes or error up, down: %s)", peer, outcomes)
            for writer in writers:
                writer.close()
            for writer in writers:
                with contextlib.suppress(ConnectionError, asyncio.CancelledError):
                    await writer.wait_closed()

    async def stop(self) -> None:
        """Stop listening and drop every open connection."""
        if self.server is not None:
            self.server.close()
        for task in list(self.connections):
            task.cancel()
        await asyncio.gather(*self.connections, return_exceptions=True)


async def serve(args: argparse.Namespace) -> None:
    relay = DelayRelay(parse_address("--listen", args.listen), parse_address("--target", args.target), args.delay_ms / 1000)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    port = await relay.start()
    log.info("relaying %s:%d -> %s, +%.0f ms each way", relay.listen[0], port, args.target, args.delay_ms)
    if args.port_file:
        write_atomic(Path(args.port_file), str(port))
    await stop.wait()
    await relay.stop()
    log.info("stopped")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="delay_relay", description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True, metavar="HOST:PORT", help="address to accept on; port 0 picks a free one")
    parser.add_argument("--target", required=True, metavar="HOST:PORT", help="address every connection is forwarded to")
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay added to each direction (ms)")
    parser.add_argument("--port-file", help="write the bound port here (atomically) once listening")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    if args.delay_ms < 0:
        parser.error(f"--delay-ms must be >= 0, got {args.delay_ms}")
    logging.basicConfig(level=args.log_level, format="%(asctime)s delay_relay %(levelname)s %(message)s")
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
