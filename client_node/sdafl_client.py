"""SDA-FL on the client: train the DP-GAN on the private shard (in a child process, on this machine), upload once."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from client_node.uploads import payload_message, stream_upload
from fedsynth.wire import codec
from fedsynth.process import lifetime
from fedsynth.assembly import client_seed
from fedsynth.config import RunConfig
from fedsynth.errors import FedsynthError, StopRequested
from fedsynth.v1 import coordinator_pb2 as pb
from fedsynth.v1 import coordinator_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
POLL_S = 0.1  # how soon a stop request reaches a DP-GAN in training
STOP_GRACE_S = 5.0


def dpgan_fields(cfg: RunConfig, client_id: int, num_images: int) -> dict[str, Any]:
    s = cfg.sdafl
    fields: dict[str, Any] = {
        "latent_dim": s.gan_latent_dim,
        "generator_width": s.gan_width,
        "critic_width": s.gan_width,
        "steps": s.gan_steps,
        # Poisson sampling needs an expected batch of at most N_k: a client smaller than sdafl.gan_batch_size samples
        # every image each step (q = 1); the noise is still calibrated to target_epsilon at that rate.
        "batch_size": min(s.gan_batch_size, num_images),
        "lr": s.gan_lr,
        "secure_noise": s.secure_noise,
        "max_grad_norm": s.max_grad_norm,
        "accountant": s.accountant,
        "seed": client_seed(cfg, client_id, "dpgan") % (2**31),
    }
    if s.target_epsilon > 0:
        fields["target_epsilon"] = s.target_epsilon
    else:
        fields["noise_multiplier"] = s.noise_multiplier
    if s.delta > 0:
        fields["delta"] = s.delta
    return fields


def ensure_samples(
    cfg: RunConfig, client_id: int, real_x: np.ndarray, cache_dir: Path, *, timeout_s: float, torch_threads: int = 1,
    should_stop: Callable[[], bool] = lambda: False,
) -> tuple[np.ndarray, dict[str, Any]]:
    """The client's M DP-GAN samples: from its cache when the same settings made them, else trained now.

    Training runs in a child process that ends with this one; once `should_stop()` turns True it is
    terminated and StopRequested raised."""
    fields = dpgan_fields(cfg, client_id, len(real_x))
    identity = hashlib.sha256(json.dumps([fields, cfg.sdafl.samples_per_client, real_x.shape], sort_keys=True).encode()).hexdigest()[:16]
    folder = cache_dir / f"client-{client_id:04d}" / f"sdafl-{identity}"
    samples, privacy = folder / "samples.npz", folder / "privacy.json"
    if not (samples.is_file() and privacy.is_file()):
        folder.mkdir(parents=True, exist_ok=True)
        shard = io.BytesIO()  # the private images reach the child over its stdin: no copy of them is ever on disk
        np.savez(shard, x=real_x)
        command = [
            sys.executable, "-m", "fedsynth.cli", "generator", "dpgan", "--data", "-", "--out", str(folder),
            "--count", str(cfg.sdafl.samples_per_client), "--sample-seed", str(client_seed(cfg, client_id, "dpgan-sample") % (2**31)),
            "--config-json", json.dumps(fields),
        ]
        log.info("client %d: training its DP-GAN on %d private images", client_id, len(real_x))
        env = {**os.environ, "OMP_NUM_THREADS": str(torch_threads)}  # several clients may train at once on few cores
        # glibc would return the critic's large per-step buffers to the kernel and fault them in again every step
        # (a fifth of the DP-GAN's time in the kernel here); keep them in the heap instead. A user's setting wins.
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(2**32))
        env.setdefault("MALLOC_TRIM_THRESHOLD_", str(2**32))
        code, stderr = _train(command, env, shard.getvalue(), client_id=client_id, timeout_s=timeout_s, should_stop=should_stop)
        if code != 0:
            last = (stderr.strip().splitlines() or [f"exit code {code}, no output"])[-1]
            raise FedsynthError(f"client {client_id}: DP-GAN training failed: {last}")
    with np.load(samples, allow_pickle=False) as archive:
        images = np.ascontiguousarray(archive["x"])
    return images, json.loads(privacy.read_text())


def _train(command: list[str], env: dict[str, str], shard: bytes, *, client_id: int, timeout_s: float,
           should_stop: Callable[[], bool]) -> tuple[int, str]:
    """(exit code, stderr) of the DP-GAN child, fed `shard` on its stdin; on a stop, the deadline or any error it is
    terminated and waited for."""
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env=lifetime.child_env(env))
    deadline = time.monotonic() + timeout_s
    pending: bytes | None = shard  # communicate() keeps writing it across timeouts; later calls pass nothing
    try:
        while True:
            try:
                _, stderr = process.communicate(pending, timeout=POLL_S)
                return process.returncode, stderr.decode(errors="replace")
            except subprocess.TimeoutExpired:
                pending = None
            if should_stop():
                raise StopRequested(f"client {client_id}: stopped while training its DP-GAN")
            if time.monotonic() > deadline:
                raise FedsynthError(f"client {client_id}: DP-GAN training took longer than {timeout_s:.0f}s; lower sdafl.gan_steps")
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.communicate(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate()


def remove_leftover_shards(cache_dir: Path) -> list[Path]:
    """Delete the `.private-shard.npz` files that versions before the shard went over a pipe left in the cache when
    the client was killed during its DP-GAN; the paths removed."""
    leftovers = sorted(cache_dir.glob("client-*/sdafl-*/.private-shard.npz"))
    for path in leftovers:
        path.unlink(missing_ok=True)
        log.warning("removed %s: a copy of private images left by a client killed during its DP-GAN", path)
    return leftovers


def report_failure(stub: pb_grpc.CoordinatorStub, client_id: int, session: str, failure: FedsynthError, *, timeout_s: float) -> None:
    """Tell the coordinator at once that this client's DP-GAN failed, so it need not wait for an upload that will not
    come; best effort: a coordinator that cannot be told still gives up at its own deadline."""
    try:
        reason = str(failure).removeprefix(f"client {client_id}: ")
        stub.ReportSetupFailure(pb.SetupFailure(client_id=client_id, session=session, reason=reason), timeout=timeout_s)
        log.info("client %d: told the coordinator that its DP-GAN failed", client_id)
    except grpc.RpcError as exc:
        log.warning("client %d: could not report its DP-GAN failure to the coordinator: %s", client_id,
                    exc.details() if isinstance(exc, grpc.Call) else exc)


def upload(call: grpc.StreamUnaryMultiCallable, client_id: int, session: str, images: np.ndarray, privacy: dict[str, Any], *,
           timeout_s: float) -> int:
    """Upload the samples once over Coordinator.UploadSynthetic (`raw_messages.upload_call`), as raw uint8."""
    data = np.ascontiguousarray(images, dtype=np.uint8)
    n, h, w, c = images.shape

    def header(meta: codec.PayloadMeta, _inline: bytes) -> pb.SyntheticChunk:
        return pb.SyntheticChunk(header=pb.SyntheticHeader(
            client_id=client_id, session=session, count=n, height=h, width=w, channels=c, dtype="uint8", payload=payload_message(meta),
            epsilon=privacy["epsilon"], delta=privacy["delta"], noise_multiplier=privacy["noise_multiplier"],
            gan_seconds=privacy["gan_seconds"],
        ))

    reply = stream_upload(call, header, [memoryview(data.reshape(-1))], timeout_s=timeout_s, what=f"client {client_id} upload")
    log.info("client %d: uploaded %d synthetic samples (%s)", client_id, reply.stored, privacy.get("statement", ""))
    return int(reply.stored)
