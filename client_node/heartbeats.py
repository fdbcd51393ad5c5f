"""The client's side of the dispatch stream's liveness: a Heartbeat RPC at a fixed rate from a thread of its own."""

from __future__ import annotations

import logging
import threading
import time

import grpc

from fedsynth.v1 import coordinator_pb2 as pb
from fedsynth.v1 import coordinator_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


def send_heartbeats(stub: pb_grpc.CoordinatorStub, client_id: int, session: str, every_s: float, done: threading.Event) -> None:
    """Until `done`: tell the coordinator this client is alive, training or not. At a fixed rate, each call with half a
    period to answer, so one slow call never stretches the gap past two periods (heartbeat_timeout_s >= 2 periods)."""
    request = pb.ClientHeartbeat(client_id=client_id, session=session)
    next_at = time.monotonic()
    while not done.is_set():
        try:
            stub.Heartbeat(request, timeout=every_s / 2)
        except grpc.RpcError as exc:  # the stream and the other RPCs handle a lost link; this only reports it
            log.debug("client %d: heartbeat failed: %s", client_id, exc.code() if isinstance(exc, grpc.Call) else exc)
        except ValueError:  # the channel was closed under us: the session is over
            return
        next_at += every_s
        done.wait(max(0.0, next_at - time.monotonic()))
