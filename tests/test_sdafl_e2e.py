"""SDA-FL over gRPC with real processes: DP-GAN uploads, pseudo-label coverage per round, and refused uploads."""

from __future__ import annotations

import math
import sys
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest
from sklearn.linear_model import LogisticRegression

from coordinator import checkpoint
from coordinator.sdafl_server import SdaflServer
from fedsynth.errors import QuorumError, StateError
from fedsynth.wire import codec
from fedsynth.learning.data import load_dataset
from fedsynth.wire.transfer import receive_inline
from fedsynth.v1 import coordinator_pb2 as pb
from fedsynth.v1 import coordinator_pb2_grpc as pb_grpc
from runtime_harness import Runtime, channel, config, read_record, wait_exit, register_request

SDAFL: dict[str, object] = {
    "data.clients": 3,
    "train.algorithm": "sdafl",
    "train.rounds": 4,
    "train.local_epochs": 3,
    "sdafl.gan_steps": 5,
    "sdafl.samples_per_client": 40,
    "sdafl.tau": 0.5,
    "sdafl.server_steps": 5,
    "sdafl.server_lr": 0.001,
    "runtime.registration_timeout_s": 120.0,
    "runtime.round_timeout_s": 120.0,
}
UNLABELLED = -1  # a synthetic sample's label on the wire until a local model is confident about it (max prob > tau)


@pytest.mark.slow
def test_sdafl_run_uploads_once_pseudo_labels_and_reports_privacy(runtime: Runtime, tmp_path: Path) -> None:
    coordinator = runtime.coordinator(SDAFL, tmp_path / "run")
    clients = runtime.clients(coordinator.address, "0-2")
    assert coordinator.wait(timeout_s=400) == 0, coordinator.log()[-3000:]
    assert wait_exit(clients, 30) == 0
    record = read_record(tmp_path / "run")
    rounds = record["rounds"]
    assert len(rounds) == 4
    for r in rounds:  # coverage: the share of all 3 x 40 uploaded samples that carry a pseudo-label
        assert r["pseudo_label_coverage"] == pytest.approx(r["pseudo_labelled"] / 120, abs=1e-12), r
    # What the coordinator holds after the last round (the checkpoint is written right after the round's record).
    synthetic = checkpoint.load(tmp_path / "run").synthetic
    images = np.concatenate([synthetic[f"images_{c}"].numpy() for c in range(3)])
    labels = np.concatenate([synthetic[f"labels_{c}"].numpy() for c in range(3)])
    labelled = labels != UNLABELLED
    assert images.shape == (120, 8, 8, 1)
    assert rounds[-1]["pseudo_labelled"] == labelled.sum() > 0  # with tau 0.5 the local models label some samples
    expected = _reference_agreement(images[labelled], labels[labelled], seed=config(SDAFL).seed)
    assert rounds[-1]["pseudo_label_agreement"] == pytest.approx(expected, abs=1e-12)
    privacy = record["sdafl"]
    assert sorted(privacy) == ["0", "1", "2"]
    for entry in privacy.values():
        assert entry["samples"] == 40
        assert 0 < entry["epsilon"] <= 10.0 + 1e-9  # target epsilon 10 is never overshot
        assert 0 < entry["delta"] < 1e-4
        assert entry["gan_seconds"] > 0


def _reference_agreement(images: np.ndarray, labels: np.ndarray, *, seed: int) -> float:
    """The share of pseudo-labels a logistic regression trained centrally on the real training split agrees with
    (up to 10,000 images drawn by the run seed, as the coordinator draws them; digits has fewer: all, in that order)."""
    train = load_dataset("digits", "train")
    keep = np.random.default_rng(seed).permutation(len(train.y))[:10_000]
    model = LogisticRegression(max_iter=300).fit(train.x[keep].reshape(len(keep), -1) / 255.0, train.y[keep])
    return float((model.predict(images.reshape(len(images), -1) / 255.0) == labels).mean())


def _upload(stub: pb_grpc.CoordinatorStub, session: str, images: np.ndarray, *, client_id: int, dtype: str = "uint8",
            epsilon: float = 1.0) -> pb.UploadReply:
    data = images.tobytes()
    meta = codec.describe(data)
    n, h, w, c = images.shape
    header = pb.SyntheticHeader(
        client_id=client_id, session=session, count=n, height=h, width=w, channels=c, dtype=dtype,
        payload=pb.Payload(total_bytes=meta.total_bytes, sha256=meta.sha256, num_chunks=meta.num_chunks),
        epsilon=epsilon, delta=1e-5, noise_multiplier=1.0, gan_seconds=0.1,
    )
    messages = [pb.SyntheticChunk(header=header)] + [pb.SyntheticChunk(chunk=pb.Chunk(seq=s, data=d)) for s, d in codec.split(data)]
    return stub.UploadSynthetic(iter(messages), timeout=30)


@pytest.mark.slow
def test_bad_uploads_are_refused_and_never_enter_the_synthetic_set(runtime: Runtime, tmp_path: Path) -> None:
    settings = {**SDAFL, "data.clients": 2, "train.rounds": 1}
    cfg = config(settings)
    coordinator = runtime.coordinator(settings, tmp_path / "run")
    runtime.clients(coordinator.address, "0")  # a real client: trains its DP-GAN and uploads 40 samples
    with channel(coordinator.address) as ch:
        stub = pb_grpc.CoordinatorStub(ch)
        spec = stub.GetRunSpec(pb.GetRunSpecRequest(), timeout=60, wait_for_ready=True)
        reply = stub.Register(register_request(spec, client_id=1, num_samples=50), timeout=30)
        good = np.random.default_rng(0).integers(0, 256, size=(7, 8, 8, 1), dtype=np.uint8)

        cases = {
            "wrong shape": (lambda: _upload(stub, reply.session, good.reshape(7, 8, 4, 2), client_id=1), grpc.StatusCode.INVALID_ARGUMENT, "(8, 8, 1)"),
            "wrong dtype": (lambda: _upload(stub, reply.session, good, client_id=1, dtype="float32"), grpc.StatusCode.INVALID_ARGUMENT, "uint8"),
            "too many": (lambda: _upload(stub, reply.session, np.zeros((41, 8, 8, 1), np.uint8), client_id=1), grpc.StatusCode.INVALID_ARGUMENT, "41"),
            "unregistered client": (lambda: _upload(stub, "nope", good, client_id=2), grpc.StatusCode.FAILED_PRECONDITION, "client 2"),
            "stale session": (lambda: _upload(stub, "stale", good, client_id=1), grpc.StatusCode.FAILED_PRECONDITION, "session"),
            "NaN epsilon": (lambda: _upload(stub, reply.session, good, client_id=1, epsilon=math.nan), grpc.StatusCode.INVALID_ARGUMENT, "epsilon must be a finite number >= 0, got nan"),
            "negative epsilon": (lambda: _upload(stub, reply.session, good, client_id=1, epsilon=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "got -1.0"),
        }
        for name, (call, code, fragment) in cases.items():
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == code, name
            assert fragment in info.value.details(), (name, info.value.details())

        with pytest.raises(grpc.RpcError) as info:
            stub.ReportSetupFailure(pb.SetupFailure(client_id=1, session="stale", reason="x"), timeout=30)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "session" in info.value.details()
        assert _upload(stub, reply.session, good, client_id=1).stored == 7
        with pytest.raises(grpc.RpcError) as info:
            _upload(stub, reply.session, good, client_id=1)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # uploaded once
        with pytest.raises(grpc.RpcError) as info:
            stub.ReportSetupFailure(pb.SetupFailure(client_id=1, session=reply.session, reason="x"), timeout=30)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # a failure after its upload is a lie
        assert "already uploaded" in info.value.details()

        # The first task's payload carries exactly the accepted samples: client 0's 40 and our 7.
        stream = stub.Subscribe(pb.SubscribeRequest(client_id=1, session=reply.session), timeout=300)
        task = next(m for m in stream if m.WhichOneof("kind") == "task").task
        chunks = ((m.chunk.seq, m.chunk.data) for m in stream if m.WhichOneof("kind") == "chunk")
        meta = codec.meta_of(task.payload)
        payload = bytes(receive_inline(meta, task.inline_payload).numpy()) if task.inline_payload else codec.assemble(
            meta, _take(chunks, task.payload.num_chunks))
        groups = codec.split_prefixed(codec.decode(payload))
        stream.cancel()
    images = groups["synthetic"]["images"].numpy()
    # Client 0's DP-GAN samples exactly as its node cached and uploaded them, then our 7; none labelled yet.
    uploaded = np.load(next((tmp_path / "cache" / "client-0000").glob("sdafl-*/samples.npz")))["x"]
    assert uploaded.shape == (cfg.sdafl.samples_per_client, 8, 8, 1)
    assert np.array_equal(images, np.concatenate([uploaded, good]))
    assert groups["synthetic"]["labels"].tolist() == [UNLABELLED] * 47


# Starts `fedsynth client` with a file-size limit that the DP-GAN child inherits: it trains, then cannot write its
# samples (EFBIG), as on a client whose disk quota is used up. The client's own log stays far below the limit.
_WITH_FILE_SIZE_LIMIT = ("import os, resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536)); "
                         "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")


@pytest.mark.slow
def test_a_client_whose_dpgan_fails_tells_the_coordinator_which_goes_on_with_the_quorum(runtime: Runtime, tmp_path: Path) -> None:
    """Client 1's DP-GAN fails (its samples, 2,000 x 64 bytes, exceed its 64 KiB file-size limit): it reports the
    failure and exits 1; the coordinator stops waiting for its upload at once (registration_timeout_s is 900 s, far
    past this test's deadlines) and plays the run with client 0's samples, naming the failure in its log."""
    settings = {**SDAFL, "data.clients": 2, "train.rounds": 1, "runtime.quorum": 0.5, "sdafl.samples_per_client": 2000,
                "runtime.registration_timeout_s": 900.0}
    coordinator = runtime.coordinator(settings, tmp_path / "run")
    runtime.clients(coordinator.address, "0")
    failing = runtime.group.start("client-1", [sys.executable, "-c", _WITH_FILE_SIZE_LIMIT, "-m", "fedsynth.cli", "client",
                                               "--coordinator", coordinator.address, "--clients", "1", "--torch-threads", "1",
                                               "--cache-dir", str(tmp_path / "cache"), "--insecure"])
    assert wait_exit(failing, 300) == 1
    failure = "client 1: DP-GAN training failed: OSError: [Errno 27] File too large"
    assert "told the coordinator that its DP-GAN failed" in failing.log_path.read_text()
    assert coordinator.wait(timeout_s=300) == 0, coordinator.log()[-3000:]
    log = coordinator.log()
    assert "client 1 will upload no synthetic samples: DP-GAN training failed: OSError: [Errno 27] File too large" in log
    assert f"going on with the synthetic samples of 1 of 2 clients (quorum 1); {failure}" in log
    assert sorted(read_record(tmp_path / "run")["sdafl"]) == ["0"]


def _take(iterator, count: int):
    for _ in range(count):
        yield next(iterator)


def test_a_reported_dpgan_failure_ends_the_upload_wait_at_once_below_the_quorum() -> None:
    """In process: with quorum 1.0 a reported failure ends the wait (its deadline an hour away) with QuorumError
    naming the client and why; the failure after an upload is refused."""
    cfg = config({**SDAFL, "data.clients": 3, "runtime.quorum": 1.0, "sdafl.track_agreement": False})
    server = SdaflServer(cfg, (1, 8, 8), 10)
    server.pool.add(0, np.zeros((4, 8, 8, 1), np.uint8), {"epsilon": 1.0, "delta": 1e-5, "noise_multiplier": 1.0, "gan_seconds": 0.1})
    with pytest.raises(StateError, match="client 0 already uploaded"):
        server.fail(0, "too late")
    server.fail(2, "DP-GAN training failed: OSError: [Errno 28]\n No space left on device")
    threading.Timer(0.2, server.fail, args=(1, "DP-GAN training failed: out of memory")).start()
    with pytest.raises(QuorumError) as ended:
        server.await_uploads([0, 1, 2], timeout_s=3600.0, need=3)
    assert str(ended.value) == ("only 1 of 3 clients uploaded synthetic samples (quorum 3; client 1: DP-GAN training "
                                "failed: out of memory; client 2: DP-GAN training failed: OSError: [Errno 28] No space "
                                "left on device)")
