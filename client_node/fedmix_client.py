"""FedMix / NaiveMix on the client: average the private shard in random groups of M, upload the means once, and
unpack the coordinator's pool when a task carries it."""

from __future__ import annotations

import logging

import grpc
import numpy as np
import torch

from client_node.uploads import payload_message, stream_upload
from fedsynth.wire import codec
from fedsynth.errors import WireError
from fedsynth.wire.tensor_buffer import encode_parts
from fedsynth.v1 import coordinator_pb2 as pb

log = logging.getLogger(__name__)


def mean_data(images: np.ndarray, labels: np.ndarray, *, num_classes: int, mean_batch: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(means of the images, float32 N x H x W x C in [0, 255]; means of their one-hot labels, float32 N x classes).

    The shard is shuffled by `seed` and cut into floor(N_k / M) groups of exactly M images (the paper's random
    batches of M); the N_k mod M left over are not used, so no mean covers fewer than M images."""
    count = len(labels) // mean_batch
    order = np.random.default_rng(seed).permutation(len(labels))[: count * mean_batch].reshape(count, mean_batch)
    one_hot = np.eye(num_classes, dtype=np.float64)[labels]
    means_x = images[order].astype(np.float64).mean(axis=1).astype(np.float32)
    means_y = one_hot[order].mean(axis=1).astype(np.float32)
    return means_x.reshape(count, *images.shape[1:]), means_y.reshape(count, num_classes)


def upload_mean_data(call: grpc.StreamUnaryMultiCallable, client_id: int, session: str, images: np.ndarray, labels: np.ndarray, *,
                     mean_batch: int, timeout_s: float) -> int:
    """Upload the means once over Coordinator.UploadMeanData (`raw_messages.upload_call`)."""
    _, h, w, c = images.shape

    def header(meta: codec.PayloadMeta, _inline: bytes) -> pb.MeanDataChunk:
        return pb.MeanDataChunk(header=pb.MeanDataHeader(
            client_id=client_id, session=session, count=len(labels), height=h, width=w, channels=c,
            num_classes=labels.shape[1], mean_batch=mean_batch, payload=payload_message(meta),
        ))

    parts = encode_parts({"images": torch.from_numpy(images), "labels": torch.from_numpy(labels)})
    reply = stream_upload(call, header, parts, timeout_s=timeout_s, what=f"client {client_id} mean-data upload")
    log.info("client %d: uploaded %d means of %d images", client_id, reply.stored, mean_batch)
    return int(reply.stored)


def pool_from_group(group: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(pooled images on the model's input scale, N x C x H x W; pooled labels N x classes; the pool's digest) from a
    task's "mean" group that carries the data."""
    images, labels, digest = group.get("images"), group.get("labels"), group.get("digest")
    if images is None or labels is None or digest is None:
        raise WireError(f"the task's mean group must hold images, labels and digest, got {sorted(group)}")
    if images.dtype != torch.float32 or labels.dtype != torch.float32 or images.ndim != 4 or labels.ndim != 2 or len(images) != len(labels):
        raise WireError(f"pooled mean data of {images.dtype} {tuple(images.shape)} and {labels.dtype} {tuple(labels.shape)}")
    # The same affine map as fedsynth.learning.training.images_to_tensor: the mean of scaled images is the scaled mean.
    x = images.permute(0, 3, 1, 2).contiguous().div(127.5).sub(1.0)
    return x, labels.clone(), bytes(digest.tolist()).hex()  # kept all run: not a view of the task's buffer
