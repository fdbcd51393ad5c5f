"""ResNet-18's weights (~45 MB) to one client and back through the coordinator's real gRPC path, beside raw TCP.

A real `fedsynth coordinator` process (ResNet-18, CIFAR-shaped data, one client) pushes each round's global
model; this script is the client, on the real client's path (fedsynth.wire.transfer, fedsynth.wire.tensor_buffer): it
receives the task over Subscribe into one buffer, checksumming as chunks arrive, decodes tensors as views of it, and
sends the same weights back with SubmitUpdate, which the coordinator verifies, decodes, validates and folds into
its aggregate. Between the two the client "trains" for --train-s seconds (it sleeps): in a real round the coordinator
tests and checkpoints the last round while its clients train, not during the transfers. At the end of that wait, with
the coordinator idle, one bare gRPC round trip runs (the same bytes as 43 x 1 MiB down a server stream and up a
client stream, benchmarks/grpc_bare.py: the floor of any gRPC transport), so every round is compared with a floor
timed within the same second; the floor alone, after the coordinator has exited, is reported too. With --train-s 0
the coordinator's test pass and checkpoint run beside the next transfers (the case of a round without training),
and the paired floor shares the CPU with them: compare with the floor alone then. Also beside it, the raw baseline:
the same bytes to an echo process over a plain TCP socket and back; the echo receives every message into one buffer
(a second raw row, a fresh buffer per message, is the baseline used before 2026-12-04).
Prints a markdown table.

    python benchmarks/transport.py --rounds 9 [--planes default tcp] [--train-s 1.0] [--test-images N] [--json FILE]

Planes: "default" (no runtime.data_plane setting at all: what a user who sets nothing gets), "grpc", "tcp".
--json writes {"raw_round_trip_s", "bare_grpc_round_trip_s", "default_ratio" (raw / the default round trip),
"default_round_trip_s", "fedsynth_round_trip_s" and "ratio" (raw / the best plane measured), "round_trip_s" and
"ratios" per plane, "over_bare_grpc_per_round" per plane, "default_over_bare_grpc_paired" (their median),
"bare_grpc_alone_round_trip_s", "train_s", "raw_fresh_buffer_round_trip_s", "bytes", "rounds", "test_images",
"load_average", "steps_s", ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from deploy.processes import ProcessGroup, fedsynth_command, wait_for_file
from fedsynth.assembly import model_for
from fedsynth.config import from_json
from fedsynth.learning.label_schema import schema_of
from fedsynth.wire import codec, data_plane, grpcutil, versions
from fedsynth.wire.raw_messages import submit_update_call, subscribe_call
from fedsynth.wire.tensor_buffer import ReceiveBuffers, decode_views, encode_parts
from fedsynth.wire.transfer import chunk_messages, describe_parts, receive_into
from fedsynth.v1 import coordinator_pb2 as pb
from fedsynth.v1 import coordinator_pb2_grpc as pb_grpc
from grpc_bare import BareServer
from local_federation import cifar_shaped_folder

MB = 1e6
# Receives a length-prefixed blob, then sends it back whole: the same bytes, the same direction pattern. argv[1]
# "reuse": one receive buffer for every message (the baseline); "fresh": a new one per message, as this script did
# until 2026-12-04 (a fresh 45 MB buffer is a new mapping whose pages all fault on first write: ~0.05 s a round here).
ECHO_SERVER = r"""
import socket, sys
reuse = sys.argv[1] == "reuse"
listener = socket.create_server(("127.0.0.1", 0))
print(listener.getsockname()[1], flush=True)
conn, _ = listener.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
buffer = bytearray()
while True:
    head = conn.recv(8, socket.MSG_WAITALL)
    if len(head) < 8:
        break
    size = int.from_bytes(head, "little")
    if size != len(buffer) or not reuse:
        buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        got += conn.recv_into(view[got:])
    conn.sendall(buffer)
"""


def start_coordinator(group: ProcessGroup, folder: Path, rounds: int, plane: str) -> str:
    settings = {
        "data.dataset": "cifar10", "data.data_dir": str(folder), "data.clients": 1, "train.model": "resnet18",
        "train.rounds": rounds, "generation.policy": "none", "runtime.heartbeat_s": 5.0, "runtime.heartbeat_timeout_s": 600.0,
    }
    if plane != "default":  # "default": no transport setting at all
        settings["runtime.data_plane"] = plane
    sets = [item for key, value in settings.items() for item in ("--set", f"{key}={json.dumps(value)}")]
    port_file = folder / f"coordinator-{plane}.port"
    child = group.start(f"coordinator-{plane}", fedsynth_command("coordinator", *sets, "--out-dir", str(folder / f"run-{plane}"), "--port", "0",
                                                                "--port-file", str(port_file), "--insecure"))
    return f"127.0.0.1:{wait_for_file(port_file, child, timeout_s=180)}"


def grpc_round_trips(address: str, rounds: int, *, training: Callable[[], None]) -> list[dict[str, float]]:
    """Per round: seconds spent receiving, verifying and decoding the push, and sending the weights back, on the
    client's path: chunks on gRPC streams, or the data plane when the task carries a ticket. `training` runs between
    the two, where a real client trains (not timed)."""
    channel = grpcutil.make_channel(address)
    stub = pb_grpc.CoordinatorStub(channel)
    submit = submit_update_call(channel)
    subscribe = subscribe_call(channel)
    spec = stub.GetRunSpec(pb.GetRunSpecRequest(), timeout=60, wait_for_ready=True)
    cfg = from_json(spec.config_json)
    schema = schema_of(cfg.data)  # the model a client node of this run builds: its layout is checked at registration
    assert schema is not None, "the benchmark's runs are local-mode runs on CIFAR-shaped folders"
    model = model_for(cfg, num_classes=len(schema.classes), in_channels=schema.channels, image_size=schema.image_size)
    reply = stub.Register(pb.RegisterRequest(client_id=0, num_samples=1, run_id=spec.run_id,
                                             **versions.registration_fields(model.state_dict())), timeout=60)
    session, endpoint = reply.session, data_plane.Endpoint("127.0.0.1", reply.data_port)
    stream = subscribe(pb.SubscribeRequest(client_id=0, session=session), timeout=3600)
    timings = []
    buffers = ReceiveBuffers(keep=2)  # as a client process keeps them (client_node.main.RECEIVE_BUFFERS_KEPT)
    try:
        for _ in range(rounds):
            task = next(m.task for m in stream if m.WhichOneof("kind") == "task")
            started = time.perf_counter()
            if task.data_ticket:  # checksummed (XXH3-128) as it arrives
                buffer = data_plane.fetch(endpoint, task.data_ticket, timeout_s=600, buffers=buffers)
            else:  # the XXH3-128 is computed while the chunks arrive
                meta = codec.meta_of(task.payload)
                buffer = receive_into(meta, ((m.chunk.seq, m.chunk.data) for m in _chunks(stream, task.payload.num_chunks)),
                                      buffers=buffers)
            received = verified = time.perf_counter()
            state = codec.split_prefixed(decode_views(buffer))["model"]
            decoded = time.perf_counter()
            training()
            resumed = time.perf_counter()
            parts = encode_parts(codec.join_prefixed(model=state))  # sent from the tensors' own memory (views of the buffer)
            if task.data_ticket:
                reply_meta = codec.PayloadMeta(sum(part.nbytes for part in parts), "", 0)
            else:
                reply_meta = describe_parts(parts)
            encoded = time.perf_counter()
            header = pb.UpdateHeader(
                client_id=0, session=session, round=task.round, task_id=task.task_id,
                payload=pb.Payload(total_bytes=reply_meta.total_bytes, sha256=reply_meta.sha256, num_chunks=reply_meta.num_chunks,
                                   xxh3_128=reply_meta.xxh3_128),
            )
            if task.data_ticket:  # hashed as it is sent
                data_plane.submit(endpoint, task.data_ticket, header.SerializeToString(), parts, timeout_s=600)
            else:
                submit(_reply(header, parts), timeout=600)
            sent = time.perf_counter()
            timings.append({
                "bytes": float(buffer.numel()), "push_transfer": received - started, "push_verify": verified - received,
                "push_decode": decoded - verified, "reply_encode": encoded - resumed, "reply_submit": sent - encoded,
            })
            del buffer, state, parts  # as the client's round ends: the buffer is free for the next global model
    finally:
        stream.cancel()
        channel.close()
    return timings


def _round_trip(steps: dict[str, float]) -> float:
    return sum(steps[key] for key in ("push_transfer", "push_verify", "push_decode", "reply_encode", "reply_submit"))


def _reply(header: pb.UpdateHeader, parts: list[memoryview]) -> Iterator[pb.UpdateChunk | bytes]:
    yield pb.UpdateChunk(header=header)
    yield from chunk_messages(parts)


def _chunks(stream: Iterator[pb.ServerMessage], count: int) -> Iterator[pb.ServerMessage]:
    got = 0
    while got < count:
        message = next(stream)
        if message.WhichOneof("kind") == "chunk":
            got += 1
            yield message


def raw_tcp_round_trips(data: bytes, repeats: int, *, reuse: bool = True) -> list[float]:
    """Seconds to send `data` to an echo process over loopback TCP and read it all back (`reuse`: the echo receives
    every message into one buffer)."""
    echo = subprocess.Popen([sys.executable, "-c", ECHO_SERVER, "reuse" if reuse else "fresh"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(echo.stdout.readline())
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            back = bytearray(len(data))
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                conn.sendall(len(data).to_bytes(8, "little"))
                conn.sendall(data)
                view, got = memoryview(back), 0
                while got < len(data):
                    got += conn.recv_into(view[got:])
                times.append(time.perf_counter() - started)
            assert bytes(back) == data
        return times
    finally:
        echo.kill()
        echo.wait(10)


def coordinator_processing(payload: bytes, repeats: int) -> float:
    """Seconds the coordinator spends on one received update besides the transfer, timed here on the same bytes.

    With one intra-op thread: on a busy 2-core machine torch's default of 2 threads can make the elementwise
    checks many times slower (threads spin waiting for a core), which would hide the transfer in the estimate.
    """
    import torch

    from fedsynth.algorithms import Aggregator

    torch.set_num_threads(1)

    meta = describe_parts([memoryview(payload)])
    chunks = list(codec.split(payload))
    state = codec.split_prefixed(codec.decode(payload))["model"]
    layout = codec.layout_of(state)
    times = []
    for _ in range(repeats):
        aggregator = Aggregator(state)
        started = time.perf_counter()
        received = codec.split_prefixed(decode_views(receive_into(meta, chunks)))["model"]
        codec.check_like(received, layout, what="update")
        aggregator.add(received, {}, 1.0, layout_checked=True)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="measured round trips (the median is reported)")
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    parser.add_argument("--planes", nargs="+", choices=("default", "grpc", "tcp"), default=["default", "tcp"],
                        help="runtime.data_plane settings to measure, one coordinator each, one after the other "
                             "(default: %(default)s; \"default\" sets nothing, which is gRPC)")
    parser.add_argument("--test-images", type=int, default=2,
                        help="the coordinator's test split (default %(default)s): its per-round test pass runs during the client's training (beside the "
                             "next round's transfers with --train-s 0); one ResNet-18 pass over 20 images takes ~0.27 s of this 2-core CPU")
    parser.add_argument("--train-s", type=float, default=1.0,
                        help="the client's stand-in for training, between the push and the reply (default %(default)s s): "
                             "the coordinator tests and checkpoints the last round then, as in a real round; the bare "
                             "gRPC round trip paired with each round runs at its end")
    args = parser.parse_args()
    steps: dict[str, dict[str, float]] = {}
    paired: dict[str, list[tuple[float, float, float]]] = {}  # plane: per round (fedsynth, bare down, bare up)
    with tempfile.TemporaryDirectory(prefix="fedsynth-transport-") as tmp, BareServer() as bare:
        folder = Path(tmp)
        cifar_shaped_folder(folder, train=40, test=args.test_images)
        group = ProcessGroup(folder / "logs")
        try:
            for plane in args.planes:
                trips: list[tuple[float, float]] = []

                def training() -> None:
                    time.sleep(args.train_s)  # the coordinator's test pass and checkpoint of the last round run now
                    trips.append(bare.round_trip())  # then the coordinator waits for the update: nothing else runs

                rounds = grpc_round_trips(start_coordinator(group, folder, args.rounds, plane), args.rounds, training=training)
                group.children[-1].process.wait(timeout=60)  # the run ends by itself after the last round
                steps[plane] = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
                paired[plane] = [(_round_trip(r), down, up) for r, (down, up) in zip(rounds, trips)]
        finally:
            group.stop_all(grace_s=5.0)
        alone = [sum(bare.round_trip()) for _ in range(args.rounds)]  # no coordinator alive: the pairing's cost, if any

    from fedsynth.algorithms import snapshot_state
    from fedsynth.learning.models import build_model

    weights = codec.encode(codec.join_prefixed(model=snapshot_state(build_model("resnet18", num_classes=10, in_channels=3, image_size=32))))
    raw = statistics.median(raw_tcp_round_trips(weights, args.rounds))
    every_pair = [pair for pairs in paired.values() for pair in pairs]
    bare_down, bare_up = statistics.median(p[1] for p in every_pair), statistics.median(p[2] for p in every_pair)
    bare = statistics.median(p[1] + p[2] for p in every_pair)
    # Each round over the bare round trip timed beside it (within the same second): the bare floor itself moves 1.5x
    # between runs minutes apart on this shared machine, so a ratio of two medians taken minutes apart is noisy.
    over_bare = {plane: [t / (down + up) for t, down, up in pairs] for plane, pairs in paired.items()}
    raw_fresh = statistics.median(raw_tcp_round_trips(weights, args.rounds, reuse=False))
    processing = coordinator_processing(weights, args.rounds)
    totals = {plane: statistics.median(p[0] for p in pairs) for plane, pairs in paired.items()}
    size = next(iter(steps.values()))["bytes"]
    rate = lambda seconds, n=1: f"{n * size / seconds / MB:,.0f}"  # noqa: E731
    column = lambda key: " | ".join(f"{steps[p][key]:.3f}" for p in steps)  # noqa: E731

    print(f"ResNet-18 weights: {size / MB:.1f} MB of safetensors; gRPC in {codec.CHUNK_BYTES >> 10} KiB chunks; median of "
          f"{args.rounds}; {args.test_images} test images; {args.train_s} s of client training a round; {platform.node()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}\n")
    print("| step | " + " | ".join(f"runtime.data_plane = {p} (s)" for p in steps) + " |")
    print("|---|" + "---:|" * len(steps))
    print(f"| push: task header to last byte, written in place and hashed as it arrives (gRPC: 1 MiB chunks on the Subscribe stream; tcp: one connection; XXH3-128 both) | {column('push_transfer')} |")
    decode = " | ".join(f"{m['push_verify'] + m['push_decode']:.3f}" for m in steps.values())
    print(f"| push: safetensors header + tensor views (client) | {decode} |")
    print(f"| reply: safetensors header (the tensors are sent from their own memory; gRPC: + XXH3-128 of them, announced in the header; tcp: hashed while sending) | {column('reply_encode')} |")
    print(f"| reply: upload until the coordinator answers (received, verified and checked; folded after) | {column('reply_submit')} |")
    print("| **round trip, real path (everything above)** | " + " | ".join(f"**{t:.3f}**" for t in totals.values()) + " |")
    print("| ratio: raw TCP ÷ round trip | " + " | ".join(f"{raw / t:.2f}" for t in totals.values()) + " |")
    print("| **round trip ÷ the bare gRPC round trip beside it, median over rounds [lowest, highest]** | "
          + " | ".join(f"**{statistics.median(r):.2f}** [{min(r):.2f}, {max(r):.2f}]" for r in over_bare.values()) + " |")
    print(f"\nbare gRPC from Python, the same bytes as 43 x 1 MiB each way (benchmarks/grpc_bare.py), one round trip at "
          f"the end of each round's training, median: {bare:.3f} s "
          f"({bare_down:.3f} down, {bare_up:.3f} up; raw ÷ bare {raw / bare:.2f}).")
    print(f"\nthe same bare round trip with no coordinator alive, median of {args.rounds}: {statistics.median(alone):.3f} s; "
          "round trip ÷ that: " + ", ".join(f"{p} {t / statistics.median(alone):.2f}" for p, t in totals.items()) + ".")
    print(f"\nraw TCP round trip (same bytes to an echo process and back, one receive buffer): {raw:.3f} s ({rate(raw, 2)} MB/s); "
          f"with a fresh buffer per message (the baseline before 2026-12-04): {raw_fresh:.3f} s. The coordinator's in-place "
          f"receive + XXH3-128 + views + validation + aggregation of one update, timed in-process: {processing:.3f} s.")
    if args.json is not None:
        best = min(totals, key=totals.__getitem__)
        default = totals.get("default", totals.get("grpc"))  # "grpc" is what the default means
        args.json.write_text(json.dumps({
            "raw_round_trip_s": raw, "fedsynth_round_trip_s": totals[best], "ratio": raw / totals[best], "fedsynth_data_plane": best,
            "bare_grpc_round_trip_s": bare, "bare_grpc_down_s": bare_down, "bare_grpc_up_s": bare_up,
            "default_round_trip_s": default, "default_ratio": None if default is None else raw / default,
            "default_over_bare_grpc": None if default is None else default / bare, "load_average": os.getloadavg()[0],
            "over_bare_grpc_per_round": over_bare, "train_s": args.train_s, "bare_grpc_alone_round_trip_s": statistics.median(alone),
            "default_over_bare_grpc_paired": statistics.median(over_bare.get("default", over_bare.get("grpc", [float("nan")]))),
            "round_trip_s": totals, "ratios": {p: raw / t for p, t in totals.items()}, "bytes": size,
            "raw_fresh_buffer_round_trip_s": raw_fresh, "rounds": args.rounds, "test_images": args.test_images,
            "coordinator_processing_s": processing, "steps_s": steps,
        }, indent=2) + "\n")


if __name__ == "__main__":
    main()
