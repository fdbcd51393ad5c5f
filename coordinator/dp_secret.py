"""The coordinator's secret in DP-FedAvg's noise: every client is sent the run config, seed included, so noise drawn
from the seed alone could be recomputed and subtracted by any of them. The secret stays in the coordinator's run folder
(mode 0600), so a resumed coordinator adds the same noise and no client can."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from fedsynth.errors import ConfigError

SECRET_FILE = "dp-noise.secret"
SECRET_BYTES = 32


def noise_secret(out_dir: Path) -> bytes:
    """The run folder's secret, made on first use."""
    path = out_dir / SECRET_FILE
    if path.is_file():
        secret = path.read_bytes()
        if len(secret) != SECRET_BYTES:
            raise ConfigError(f"{path}: the DP noise secret must be {SECRET_BYTES} bytes, found {len(secret)}")
        return secret
    out_dir.mkdir(parents=True, exist_ok=True)
    secret = secrets.token_bytes(SECRET_BYTES)
    partial = path.with_name(f".{SECRET_FILE}.{os.getpid()}")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, secret)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(partial, path)
    return secret
