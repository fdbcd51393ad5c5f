"""What a node says it runs at registration, and the coordinator's check of it: release, wire protocol, model layout."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

from fedsynth import __version__
from fedsynth.errors import StateError

# The wire protocol: bumped whenever a message or a payload's layout changes meaning. 1 was every release before
# registration carried versions (they send 0, protobuf's default); 2 added the checks of docs/security.md.
PROTOCOL_VERSION = 2
# Protocols this release's coordinator serves (a later release may keep serving older nodes for a while).
SUPPORTED_PROTOCOLS = frozenset({PROTOCOL_VERSION})


class VersionRefused(StateError):
    """A node that runs an incompatible release, protocol or model: refused FAILED_PRECONDITION, by name."""


def layout_digest(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 (hex) of a state dict's layout: each tensor's name, shape and dtype, in order. Two nodes whose models
    would exchange weights have the same digest; any other model (a factory building something else) does not."""
    rows = [[name, list(value.shape), str(value.dtype).removeprefix("torch.")] for name, value in state.items()]
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class NodeVersion:
    """What a registration says the node runs (RegisterRequest fields 13-15; empty and 0 from an older release)."""

    fedsynth: str
    protocol: int
    model_digest: str


def registration_fields(state: dict[str, torch.Tensor]) -> dict[str, object]:
    """The RegisterRequest fields that say what this node runs, for a node whose model has this state dict."""
    return {"fedsynth_version": __version__, "protocol_version": PROTOCOL_VERSION, "model_layout_digest": layout_digest(state)}


def check_node(client_id: int, node: NodeVersion, *, expected_digest: str) -> None:
    """VersionRefused with one line naming both sides' releases and protocols, or both layout digests."""
    ours = f"fedsynth {__version__}, protocol {PROTOCOL_VERSION}"
    release = node.fedsynth[:40] or "?"  # a peer's string: as much as a release name needs, in a status message
    if node.protocol not in SUPPORTED_PROTOCOLS:
        theirs = (f"fedsynth {release}, protocol {node.protocol}" if node.protocol
                  else "a release before fedsynth 0.2.0 (protocol 1: it sends no version)")
        raise VersionRefused(f"client {client_id} runs {theirs}; this coordinator runs {ours}: run the coordinator's "
                             "release on the client node")
    if node.model_digest != expected_digest:
        raise VersionRefused(f"client {client_id} builds a model of layout {node.model_digest[:16] or '(none)'}, the "
                             f"coordinator's is {expected_digest[:16]}: train.model and data.image_size/channels must build "
                             f"the same model on every node (client fedsynth {release}, coordinator {ours})")
