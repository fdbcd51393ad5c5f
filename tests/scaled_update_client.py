"""TEST ONLY: a real `fedsynth client` whose every update moves the global model SCALE times as far as its training did.

tests/test_bounded_updates_e2e.py starts it as a script (`python tests/scaled_update_client.py <fedsynth client args>`)
to play a client that sends finite updates 1,000 times the honest norm. It is no part of the fedsynth package and
nothing there can turn it on: it wraps fedsynth.wire.wire_dtype.outgoing, the function the client node passes its
trained state through on the way to the wire, in this process only, then runs the unchanged client node."""

from __future__ import annotations

import sys

import torch

from fedsynth import cli
from fedsynth.wire import wire_dtype

SCALE = 1000.0
_honest_outgoing = wire_dtype.outgoing


def scaled_outgoing(state: dict[str, torch.Tensor], extra: dict[str, torch.Tensor], global_state: dict[str, torch.Tensor],
                    name: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    scaled = {key: global_state[key] + SCALE * (value - global_state[key]) if value.is_floating_point() else value
              for key, value in state.items()}
    return _honest_outgoing(scaled, extra, global_state, name)


if __name__ == "__main__":
    wire_dtype.outgoing = scaled_outgoing
    sys.exit(cli.main(["client", *sys.argv[1:]]))
