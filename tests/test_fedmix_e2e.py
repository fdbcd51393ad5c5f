"""FedMix / NaiveMix over gRPC: refused mean-data uploads change nothing, the pool ships once, runs through `fedsynth run`."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from coordinator.mean_pool import FILE_NAME, MeanDataPool
from fedsynth.wire import codec
from fedsynth.errors import StateError, WireError
from fedsynth.wire.tensor_buffer import decode_views
from fedsynth.wire.transfer import receive_inline
from fedsynth.v1 import coordinator_pb2 as pb
from fedsynth.v1 import coordinator_pb2_grpc as pb_grpc
from runtime_harness import Runtime, channel, register_request

N_K = 50  # what the test's clients register: floor(50 / 5) = 10 means each
M = 5
HWC = (8, 8, 1)
CLASSES = 10


def means(seed: int, count: int = N_K // M) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    images = rng.uniform(0, 255, size=(count, *HWC)).astype(np.float32)
    labels = np.eye(CLASSES, dtype=np.float32)[rng.integers(0, CLASSES, size=(count, M))].mean(axis=1)
    return images, labels


def upload(stub: pb_grpc.CoordinatorStub, session: str, tensors: dict[str, np.ndarray], *, client_id: int,
           **changes: int) -> pb.UploadReply:
    data = codec.encode({k: torch.from_numpy(v) for k, v in tensors.items()})
    meta = codec.describe(data)
    fields = {"client_id": client_id, "session": session, "count": N_K // M, "height": 8, "width": 8, "channels": 1,
              "num_classes": CLASSES, "mean_batch": M,
              "payload": pb.Payload(total_bytes=meta.total_bytes, sha256=meta.sha256, num_chunks=meta.num_chunks)}
    fields.update(changes)
    messages = [pb.MeanDataChunk(header=pb.MeanDataHeader(**fields))]
    messages += [pb.MeanDataChunk(chunk=pb.Chunk(seq=s, data=d)) for s, d in codec.split(data, 256)]
    return stub.UploadMeanData(iter(messages), timeout=30)


def _take(stream: Iterator[pb.ServerMessage]) -> tuple[pb.Task, dict[str, dict[str, torch.Tensor]]]:
    task = next(m for m in stream if m.WhichOneof("kind") == "task").task
    meta = codec.meta_of(task.payload)
    if task.inline_payload:  # a payload that fits one chunk travels in its task
        return task, codec.split_prefixed(decode_views(receive_inline(meta, task.inline_payload)))
    chunks = []
    while len(chunks) < task.payload.num_chunks:
        message = next(stream)
        if message.WhichOneof("kind") == "chunk":
            chunks.append((message.chunk.seq, message.chunk.data))
    return task, codec.split_prefixed(codec.decode(codec.assemble(meta, chunks)))


@pytest.mark.slow
def test_bad_mean_data_uploads_are_refused_by_name_and_never_enter_the_pool(runtime: Runtime, tmp_path: Path) -> None:
    settings = {"data.clients": 2, "train.rounds": 1, "train.algorithm": "fedmix", "train.algorithm_params.mean_batch": M}
    coordinator = runtime.coordinator(settings, tmp_path / "run")
    with channel(coordinator.address) as ch:
        stub = pb_grpc.CoordinatorStub(ch)
        spec = stub.GetRunSpec(pb.GetRunSpecRequest(), timeout=60, wait_for_ready=True)
        register = lambda k: stub.Register(register_request(spec, client_id=k, num_samples=N_K), timeout=30)  # noqa: E731
        stale = register(1).session
        reply = register(1)
        assert reply.mean_data_wanted
        images, labels = means(0)
        good = {"images": images, "labels": labels}
        bad_labels = labels.copy()
        bad_labels[3, 0] += 0.5
        negative_label = labels.copy()
        negative_label[2] = np.eye(CLASSES, dtype=np.float32)[0] * 1.5 - np.eye(CLASSES, dtype=np.float32)[1] * 0.5
        nan_images = images.copy()
        nan_images[1, 2, 3, 0] = np.nan
        invalid, failed = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
        s = reply.session
        cases = {
            "count disagrees with N_k": (lambda: upload(stub, s, good, client_id=1, count=9), invalid, "count=9"),
            "wrong image shape": (lambda: upload(stub, s, good, client_id=1, height=7), invalid, "(8, 8, 1)"),
            "wrong number of classes": (lambda: upload(stub, s, good, client_id=1, num_classes=9), invalid, "num_classes=9"),
            "wrong M": (lambda: upload(stub, s, good, client_id=1, mean_batch=4), invalid, "mean_batch=4"),
            "tensor shape": (lambda: upload(stub, s, {"images": images.reshape(10, 8, 4, 2), "labels": labels}, client_id=1),
                             invalid, "(10, 8, 8, 1)"),
            "too few means": (lambda: upload(stub, s, {"images": images[:9], "labels": labels[:9]}, client_id=1), invalid, "shape"),
            "float64": (lambda: upload(stub, s, {"images": images.astype(np.float64), "labels": labels}, client_id=1), invalid, "float32"),
            "negative pixel": (lambda: upload(stub, s, {"images": images - 300, "labels": labels}, client_id=1), invalid, "[0, 255]"),
            "NaN pixel": (lambda: upload(stub, s, {"images": nan_images, "labels": labels}, client_id=1), invalid, "NaN"),
            "negative label": (lambda: upload(stub, s, {"images": images, "labels": negative_label}, client_id=1), invalid, "-0.5"),
            "labels not summing to 1": (lambda: upload(stub, s, {"images": images, "labels": bad_labels}, client_id=1), invalid, "row 3 sums to 1.5"),
            "extra tensor": (lambda: upload(stub, s, {**good, "x": labels.copy()}, client_id=1), invalid, "exactly"),
            "not safetensors": (lambda: stub.UploadMeanData(iter([pb.MeanDataChunk(header=pb.MeanDataHeader(
                client_id=1, session=s, count=10, height=8, width=8, channels=1, num_classes=CLASSES, mean_batch=M,
                payload=pb.Payload(total_bytes=4, sha256=codec.sha256(b"junk"), num_chunks=1))),
                pb.MeanDataChunk(chunk=pb.Chunk(seq=0, data=b"junk"))]), timeout=30), invalid, "safetensors"),
            "unregistered client": (lambda: upload(stub, "nope", good, client_id=0), failed, "client 0 is not registered"),
            "stale session": (lambda: upload(stub, stale, good, client_id=1), failed, "session"),
        }
        for name, (call, code, fragment) in cases.items():
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == code, (name, info.value.details())
            assert fragment in info.value.details(), (name, info.value.details())

        assert upload(stub, s, good, client_id=1).stored == 10
        assert not register(1).mean_data_wanted  # held: a re-registered client is not asked again
        s = register(1).session
        with pytest.raises(grpc.RpcError) as info:
            upload(stub, s, good, client_id=1)
        assert info.value.code() == failed and "already uploaded" in info.value.details()

        # Client 0 uploads last; the pool closes and round 1 starts. Its task carries exactly the two accepted uploads.
        other = means(1)
        s0 = register(0).session
        assert upload(stub, s0, {"images": other[0], "labels": other[1]}, client_id=0).stored == 10
        stream = stub.Subscribe(pb.SubscribeRequest(client_id=1, session=s), timeout=300)
        _task, groups = _take(stream)
        stream.cancel()
    pool = groups["mean"]
    assert np.array_equal(pool["images"].numpy(), np.concatenate([other[0], images]))  # in client order
    assert np.array_equal(pool["labels"].numpy(), np.concatenate([other[1], labels]))
    kept = load_file(str(tmp_path / "run" / FILE_NAME))  # what a restarted coordinator would load
    assert sorted(kept) == ["images_0", "images_1", "labels_0", "labels_1"]
    assert np.array_equal(kept["labels_1"].numpy(), labels)


def test_the_pool_closes_before_round_one_and_a_late_upload_changes_nothing(tmp_path: Path) -> None:
    pool = MeanDataPool(image_shape_hwc=HWC, num_classes=CLASSES, mean_batch=M, run_id="r" * 16)
    images, labels = means(0)
    data = codec.encode({"images": torch.from_numpy(images), "labels": torch.from_numpy(labels)})
    meta = codec.describe(data)
    header = {"count": 10, "height": 8, "width": 8, "channels": 1, "num_classes": CLASSES, "mean_batch": M,
              "total_bytes": meta.total_bytes, "sha256": meta.sha256, "num_chunks": meta.num_chunks}
    assert pool.digest() == "" and pool.wanted(0)
    assert pool.accept(0, N_K, header, codec.split(data)) == 10
    pool.await_uploads([0], timeout_s=1, need=1)
    digest = pool.digest()
    assert len(digest) == 64 and not pool.wanted(1)
    with pytest.raises(StateError, match="closed"):
        pool.accept(1, N_K, header, codec.split(data))
    with pytest.raises(WireError, match="count=10"):  # N_k = 54 still makes 10 means; N_k = 55 makes 11
        MeanDataPool(image_shape_hwc=HWC, num_classes=CLASSES, mean_batch=M, run_id="r").check_header(1, 55, header)
    assert pool.total() == 10 and pool.digest() == digest
    pool.save(tmp_path)
    again = MeanDataPool(image_shape_hwc=HWC, num_classes=CLASSES, mean_batch=M, run_id="r" * 16)
    assert again.load(tmp_path) and again.closed and again.digest() == digest
    with pytest.raises(StateError, match="belongs to run"):
        MeanDataPool(image_shape_hwc=HWC, num_classes=CLASSES, mean_batch=M, run_id="other").load(tmp_path)


def _run(tmp_path: Path, name: str, sets: list[str]) -> dict:
    out = tmp_path / name
    command = [sys.executable, "-m", "fedsynth.cli", "run", "--out-dir", str(out), "--no-progress"]
    for item in sets:
        command += ["--set", item]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "report.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize(("algorithm", "policy"), [("fedmix", "none"), ("naivemix", "fedeas")])
def test_fedsynth_run_trains_with_the_pooled_means(tmp_path: Path, tiny_generator: Path, algorithm: str, policy: str) -> None:
    sets = [f"train.algorithm={algorithm}", f"generation.policy={policy}", "data.clients=4", "train.rounds=3",
            "train.local_epochs=1", "runtime.clients_per_process=4", f"generation.model_dir={json.dumps(str(tiny_generator))}"]
    report = _run(tmp_path, algorithm, sets)
    rounds = report["rounds"]
    assert len(rounds) == 3 and report["final_accuracy"] > 0.3, rounds
    if policy == "fedeas":
        assert report["generation"]["total_images"] > 0  # FedMix combines with FedEAS: the clients also generated
    record = json.loads((tmp_path / algorithm / "coordinator.json").read_text())
    sent = [r["bytes_sent"] for r in record["rounds"]]
    pool = load_file(str(tmp_path / algorithm / FILE_NAME))
    pool_bytes = sum(v.numel() * 4 for v in pool.values())
    assert sent[0] - sent[1] >= 4 * pool_bytes * 0.99  # round 1 carried the pool to each of the 4 clients; later rounds not
    assert sent[1] == sent[2]
