"""The label-schema check at registration: a client whose data does not fit the run's classes and image shape is
refused (FAILED_PRECONDITION), with one line naming the client, the field, what was expected and what was found."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from fedsynth.errors import StateError

log = logging.getLogger(__name__)


class SchemaRefused(StateError):
    """A client's data does not fit the run's label schema; it will not fit on a retry either."""


@dataclass(frozen=True)
class Schema:
    """The run's schema as the coordinator knows it; a client reports its own in the same terms."""

    digest: str  # "" where the run has none (an npz split run without data.classes)
    channels: int
    image_size: int


def check_schema(client_id: int, expected: Schema, found: Schema, unknown_classes: tuple[str, ...]) -> None:
    """Raise SchemaRefused for the first misfit; a client that sends no digest (it predates the check) passes."""
    if not found.digest:
        return
    where = f"client {client_id}"
    if unknown_classes:
        problem = (f"{where}: data.classes: expected only the run's class names, found {', '.join(map(repr, unknown_classes))} "
                   "not in data.classes")
    elif found.channels != expected.channels:
        problem = f"{where}: data.channels: expected {expected.channels}, found {found.channels}"
    elif found.image_size != expected.image_size:
        problem = f"{where}: data.image_size: expected {expected.image_size}, found {found.image_size}"
    elif expected.digest and found.digest != expected.digest:
        problem = (f"{where}: schema digest: expected {expected.digest} (this run's data.classes, image_size, channels), "
                   f"found {found.digest} (the schema.toml its data was written for)")
    else:
        return
    log.warning("refused %s", problem)
    raise SchemaRefused(problem)
