"""TEST ONLY: a wire-level client process that speaks the coordinator's protocol by hand and misbehaves in one way.

`python tests/adversarial/wire_attacker.py --coordinator ADDR --attacks K=NAME[,K=NAME...] --out FILE` plays each
client K on a thread of its own: it registers as K (or tries to), answers its tasks with the global model it was sent
(a zero update) except where its attack says otherwise, and writes what the coordinator answered to each of its moves
to FILE as JSON lines {"client", "attack", "round", "move", "code", "details"}. It ends when the run does (or when its
registrations are refused).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the harness

from fedsynth.v1 import coordinator_pb2 as pb  # noqa: E402
from fedsynth.v1 import coordinator_pb2_grpc as pb_grpc  # noqa: E402
from fedsynth.wire import codec  # noqa: E402
from fedsynth.wire.transfer import receive_inline  # noqa: E402
from runtime_harness import register_request  # noqa: E402

RPC_TIMEOUT_S = 30.0
WRITING = threading.Lock()
CHUNK = 16 * 1024
ATTACKS = ("old-protocol", "lying-n", "huge-header", "nested-header", "concurrent", "never-finishes", "replay",
           "stale-task", "inf-report", "lying-eval")


class Attacker:
    def __init__(self, stub: pb_grpc.CoordinatorStub, client: int, attack: str, out: Path, num_classes: int) -> None:
        self.stub, self.client, self.attack, self.out = stub, client, attack, out
        self.num_classes = num_classes
        self.session = ""
        self.earlier: tuple[pb.Task, bytes] | None = None  # round 1's task and answer (the replay's)

    def note(self, round_number: int, move: str, error: grpc.RpcError | None) -> None:
        entry = {"client": self.client, "attack": self.attack, "round": round_number, "move": move,
                 "code": "OK" if error is None else error.code().name, "details": "" if error is None else error.details()}
        with WRITING, self.out.open("a") as handle:
            handle.write(json.dumps(entry) + "\n")

    def call(self, round_number: int, move: str, fn: Any) -> Any:
        try:
            result = fn()
        except grpc.RpcError as exc:
            self.note(round_number, move, exc)
            return None
        self.note(round_number, move, None)
        return result

    # ---- registration ----------------------------------------------------------------------------

    def register(self, spec: pb.RunSpec) -> bool:
        request = register_request(spec, client_id=self.client, num_samples=50, test_samples=20)
        if self.attack == "old-protocol":  # what a node of the release before version checks sends
            request = pb.RegisterRequest(client_id=self.client, num_samples=50, run_id=spec.run_id)
        if self.attack == "lying-n":
            request.num_samples = 10**9
        reply = self.call(0, "register", lambda: self.stub.Register(request, timeout=RPC_TIMEOUT_S))
        if reply is None:
            return False
        self.session = reply.session
        return True

    # ---- tasks -----------------------------------------------------------------------------------

    def play(self) -> None:
        stream = self.stub.Subscribe(pb.SubscribeRequest(client_id=self.client, session=self.session), timeout=900)
        for message in stream:
            kind = message.WhichOneof("kind")
            if kind == "finished":
                self.note(0, "finished", None)
                return
            if kind != "task":
                continue
            task = message.task
            payload = self.payload(task, stream)
            if task.evaluate:
                self.evaluate(task)
            else:
                self.answer(task, payload)

    @staticmethod
    def payload(task: pb.Task, stream: Iterator[pb.ServerMessage]) -> bytes:
        meta = codec.meta_of(task.payload)
        if task.inline_payload:
            return bytes(receive_inline(meta, task.inline_payload).numpy())
        chunks = []
        while len(chunks) < task.payload.num_chunks:
            message = next(stream)
            if message.WhichOneof("kind") == "chunk":
                chunks.append((message.chunk.seq, message.chunk.data))
        return codec.assemble(meta, chunks)

    def header(self, task: pb.Task, data: bytes, *, chunks: bool = True, **changes: Any) -> pb.UpdateHeader:
        meta = codec.describe(data) if chunks else None
        fields: dict[str, Any] = {
            "client_id": self.client, "session": self.session, "round": task.round, "task_id": task.task_id,
            "payload": (pb.Payload(total_bytes=meta.total_bytes, sha256=meta.sha256, num_chunks=meta.num_chunks) if meta
                        else pb.Payload(total_bytes=len(data), sha256=codec.sha256(data))),
            "train_seconds": 0.1, "train_loss": 1.0, "num_steps": 1, "train_samples": 50,
        }
        if not chunks:
            fields["inline_payload"] = data
        fields.update(changes)
        return pb.UpdateHeader(**fields)

    def messages(self, task: pb.Task, data: bytes, **changes: Any) -> list[pb.UpdateChunk]:
        return [pb.UpdateChunk(header=self.header(task, data, **changes)),
                *(pb.UpdateChunk(chunk=pb.Chunk(seq=seq, data=piece)) for seq, piece in codec.split(data))]

    def submit(self, task: pb.Task, move: str, messages: list[pb.UpdateChunk]) -> None:
        self.call(task.round, move, lambda: self.stub.SubmitUpdate(iter(messages), timeout=RPC_TIMEOUT_S * 4))

    def answer(self, task: pb.Task, global_payload: bytes) -> None:
        model = codec.split_prefixed(codec.decode(global_payload))["model"]
        data = codec.encode(codec.join_prefixed(model=model))  # the global model back: a zero update
        attack, first = self.attack, task.round == 1
        if attack == "huge-header":
            self.submit(task, "huge-header", self.messages(task, many_entries(len(data))))
        elif attack == "nested-header":
            self.submit(task, "nested-header", self.messages(task, nested(100_000)))
        elif attack == "inf-report":
            self.submit(task, "inf-report", self.messages(task, data, train_seconds=float("inf")))
        elif attack == "stale-task":
            self.submit(task, "stale-task", self.messages(task, data, task_id="00" * 8))
            self.submit(task, "valid", self.messages(task, data))
        elif attack == "replay" and self.earlier is not None:
            old_task, old_data = self.earlier
            self.submit(task, "replay", self.messages(old_task, old_data))
            self.submit(task, "valid", self.messages(task, data))
        elif attack == "concurrent" and first:
            self.concurrent(task, data)
        elif attack == "never-finishes" and first:
            self.never_finishes(task, data)
        else:
            self.submit(task, "valid", self.messages(task, data))
        if first:
            self.earlier = (task, data)

    def concurrent(self, task: pb.Task, data: bytes) -> None:
        """Two uploads for one round at once: the first holds its stream open while the second is sent."""
        release = threading.Event()
        messages = self.messages(task, data)

        def held() -> Iterator[pb.UpdateChunk]:
            yield messages[0]
            release.wait(RPC_TIMEOUT_S)
            yield from messages[1:]

        first = self.stub.SubmitUpdate.future(held(), timeout=RPC_TIMEOUT_S * 4)
        threading.Event().wait(1.0)  # the first header is in
        self.submit(task, "second-upload", self.messages(task, data))
        release.set()
        self.call(task.round, "first-upload", first.result)

    def never_finishes(self, task: pb.Task, data: bytes) -> None:
        """The header, then nothing: the coordinator must end the upload itself."""
        messages = self.messages(task, data)
        forever = threading.Event()

        def stalled() -> Iterator[pb.UpdateChunk]:
            yield messages[0]
            forever.wait(600)

        self.call(task.round, "never-finishes", lambda: self.stub.SubmitUpdate(stalled(), timeout=600))
        forever.set()

    def evaluate(self, task: pb.Task) -> None:
        examples = 10_000 if self.attack == "lying-eval" else 0
        result = pb.EvaluationResult(client_id=self.client, session=self.session, round=task.round, task_id=task.task_id,
                                     examples=examples, correct=examples, loss_sum=0.0)
        result.class_correct.extend([examples] + [0] * (self.num_classes - 1))
        result.class_total.extend([examples] + [0] * (self.num_classes - 1))
        self.call(task.round, "evaluation", lambda: self.stub.SubmitEvaluation(result, timeout=RPC_TIMEOUT_S))


def many_entries(fill: int) -> bytes:
    """A safetensors buffer of `fill` bytes or so, its header nothing but empty tensors (~55 bytes each)."""
    count = max(1, fill // 56)
    header = json.dumps({f"model/e{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(count)})
    raw = header.encode()
    return len(raw).to_bytes(8, "little") + raw


def nested(depth: int) -> bytes:
    raw = ("[" * depth + "]" * depth).encode()
    return len(raw).to_bytes(8, "little") + raw


def run_one(stub: pb_grpc.CoordinatorStub, spec: pb.RunSpec, client: int, attack: str, out: Path) -> None:
    classes = json.loads(spec.config_json)["data"].get("classes")
    attacker = Attacker(stub, client, attack, out, len(classes) if classes else 10)  # digits: 10
    if attacker.register(spec):
        try:
            attacker.play()
        except grpc.RpcError as exc:
            attacker.note(0, "stream", exc)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--attacks", required=True, help="K=NAME,K=NAME,...: " + ", ".join(ATTACKS))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    attacks = {int(k): name for k, name in (item.split("=", 1) for item in args.attacks.split(","))}
    unknown = sorted(set(attacks.values()) - set(ATTACKS))
    if unknown:
        parser.error(f"unknown attacks {unknown}")
    with grpc.insecure_channel(args.coordinator) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        spec = stub.GetRunSpec(pb.GetRunSpecRequest(), timeout=120, wait_for_ready=True)
        threads = [threading.Thread(target=run_one, args=(stub, spec, k, name, args.out), name=f"attacker-{k}", daemon=True)
                   for k, name in attacks.items()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(900)
    return 0


if __name__ == "__main__":
    sys.exit(main())
