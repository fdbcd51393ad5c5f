"""Real coordinator and client-node processes for tests: port files, a deadline on every wait, cleanup always."""

from __future__ import annotations

import functools
import json
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc

from coordinator import checkpoint
from deploy.processes import Child, ProcessGroup, fedsynth_command, wait_for_file
from fedsynth.wire import grpcutil
from fedsynth.assembly import model_for
from fedsynth.config import RunConfig, from_json, load_config
from fedsynth.learning.data import load_dataset
from fedsynth.learning.label_schema import schema_of
from fedsynth.wire import versions
from fedsynth.v1 import coordinator_pb2 as pb
from fedsynth.v1 import coordinator_pb2_grpc as pb_grpc

T = TypeVar("T")
START_TIMEOUT_S = 90.0  # a cold `import torch` on a busy 2-core machine takes several seconds per process

# Settings every runtime test starts from: the embedded digits set, the small CNN, quick failure detection.
BASE_SETTINGS: dict[str, Any] = {
    "data.dataset": "digits",
    "train.model": "cnn",
    "train.algorithm": "fedavg",
    "generation.policy": "none",
    "runtime.registration_timeout_s": 180.0,  # a deadline for slow process start-up on a busy machine, not a speed check
    "runtime.round_timeout_s": 60.0,
    "runtime.rejoin_grace_s": 5.0,
    "runtime.heartbeat_s": 1.0,
}


@functools.lru_cache(maxsize=8)
def _model_fields(config_json: str) -> tuple[tuple[str, object], ...]:
    cfg = from_json(config_json)
    schema = schema_of(cfg.data)
    if cfg.data.source == "local" and schema is not None:
        classes, channels, size = len(schema.classes), schema.channels, schema.image_size
    else:
        test = load_dataset(cfg.data.dataset, "test", data_dir=cfg.data.data_dir)
        classes, (channels, size, _) = test.num_classes, test.image_shape
    model = model_for(cfg, num_classes=classes, in_channels=channels, image_size=size)
    return tuple(versions.registration_fields(model.state_dict()).items())


def register_request(spec: pb.RunSpec, **fields: Any) -> pb.RegisterRequest:
    """A RegisterRequest for the run `spec` describes, as this release's client node sends it: its release, protocol and
    model layout digest beside `fields`."""
    return pb.RegisterRequest(run_id=spec.run_id, **dict(_model_fields(spec.config_json)), **fields)


def overrides(settings: dict[str, Any]) -> list[str]:
    """{"train.rounds": 2} -> ["train.rounds=2"], values written as TOML (what `--set` parses)."""
    return [f"{key}={json.dumps(value)}" for key, value in {**BASE_SETTINGS, **settings}.items()]


def config(settings: dict[str, Any]) -> RunConfig:
    """The RunConfig the coordinator builds from the same settings (same parser, same validation)."""
    return load_config(None, overrides(settings))


def wait_until(predicate: Callable[[], T], *, timeout_s: float, what: str, interval_s: float = 0.02) -> T:
    """Poll until predicate() is truthy and return it; TimeoutError naming `what` otherwise."""
    stop_at = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= stop_at:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f}s")
        time.sleep(interval_s)


def completed_rounds(out_dir: Path) -> int:
    """Rounds in the checkpoint on disk (0 before the first one); the file is replaced atomically."""
    ckpt = checkpoint.load(out_dir)
    return 0 if ckpt is None else ckpt.completed_rounds


def read_record(out_dir: Path) -> dict[str, Any]:
    return json.loads((out_dir / "coordinator.json").read_text())


@dataclass
class CoordinatorProcess:
    child: Child
    out_dir: Path
    port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait(self, timeout_s: float) -> int:
        return wait_exit(self.child, timeout_s)

    def log(self) -> str:
        return self.child.log_path.read_text(errors="replace")


def wait_exit(child: Child, timeout_s: float) -> int:
    """The child's exit code; TimeoutError with the tail of its log if it is still running."""
    try:
        return child.process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        tail = "\n  ".join(child.log_path.read_text(errors="replace").splitlines()[-15:])
        raise TimeoutError(f"{child.role} (pid {child.pid}) still running after {timeout_s:.0f}s; log tail:\n  {tail}") from None


class Runtime:
    """Starts processes into one ProcessGroup (logs under ROOT/logs); `close()` kills whatever still runs.

    Use as a context manager (or through the `runtime` fixture) so that a failing test leaves no process behind.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.group = ProcessGroup(root / "logs")
        self._names: dict[str, int] = {}

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _role(self, base: str) -> str:
        self._names[base] = self._names.get(base, 0) + 1
        return base if self._names[base] == 1 else f"{base}.{self._names[base]}"

    def coordinator(self, settings: dict[str, Any], out_dir: Path, *, port: int = 0,
                    env: dict[str, str] | None = None) -> CoordinatorProcess:
        """Start `fedsynth coordinator` and wait (bounded) until it has bound its port."""
        role = self._role("coordinator")
        port_file = self.root / f"{role}.port"
        port_file.unlink(missing_ok=True)
        sets = [item for override in overrides(settings) for item in ("--set", override)]
        command = fedsynth_command(
            "coordinator", *sets, "--out-dir", str(out_dir), "--host", "127.0.0.1", "--port", str(port), "--port-file", str(port_file),
            "--insecure",
        )
        child = self.group.start(role, command, env=env)
        bound = int(wait_for_file(port_file, child, timeout_s=START_TIMEOUT_S))
        return CoordinatorProcess(child, out_dir, bound)

    def clients(self, address: str, ids: str, *, torch_threads: int = 1, reconnect_timeout_s: float = 60.0) -> Child:
        """Start one `fedsynth client` process hosting the logical clients `ids` ("0", "0-3", "0,2")."""
        command = fedsynth_command(
            "client", "--coordinator", address, "--clients", ids, "--torch-threads", str(torch_threads),
            "--cache-dir", str(self.root / "cache"), "--reconnect-timeout", str(reconnect_timeout_s), "--insecure",
        )
        return self.group.start(self._role(f"client-{ids}"), command)

    def kill(self, child: Child) -> None:
        """SIGKILL: no handler runs, sockets close as the kernel reaps the process."""
        child.process.send_signal(signal.SIGKILL)
        child.process.wait(timeout=10)

    def close(self) -> None:
        self.group.stop_all(grace_s=3.0)


# ---- talking to a coordinator from the test process ----------------------------------------------


def channel(address: str) -> grpc.Channel:
    return grpcutil.make_channel(address)


def watch_rounds(address: str, *, timeout_s: float) -> Iterator[pb.RoundSummary]:
    """The coordinator's pushed round summaries, ending with the `finished` one; the whole stream has a deadline."""
    with channel(address) as ch:
        stub = pb_grpc.CoordinatorStub(ch)
        yield from stub.WatchRounds(pb.WatchRequest(), timeout=timeout_s, wait_for_ready=True)
