"""BENCHMARK ONLY: a real `fedsynth client` that sends a poisoned update every round, for benchmarks/robust_aggregation.py.

    python benchmarks/attack_client.py --attack {scale,signflip,gaussian} [--factor X] [--attack-seed S] \
        <fedsynth client arguments>

It wraps fedsynth.wire.wire_dtype.outgoing, the function the client node passes its trained state through on the way
to the wire, in this process only (as tests/scaled_update_client.py does), then runs the unchanged client node. With
the honest update u = local - global over the floating-point tensors (integer ones are sent as trained):
- scale: global + X * u (X default 1,000): a finite model-replacement-sized update;
- signflip: global - X * u (X default 1): the honest step reversed;
- gaussian: global + g * ||u|| / ||g||, g ~ N(0, I) (seeded): noise of the honest norm, pointing nowhere.
Nothing in the fedsynth package can turn any of this on.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from fedsynth import cli
from fedsynth.wire import wire_dtype

StateDict = dict[str, torch.Tensor]
ATTACKS = ("scale", "signflip", "gaussian")
DEFAULT_FACTOR = {"scale": 1000.0, "signflip": 1.0, "gaussian": 1.0}


def poisoned(attack: str, factor: float, generator: torch.Generator, state: StateDict, global_state: StateDict) -> StateDict:
    floats = [key for key, value in state.items() if value.is_floating_point()]
    update = {key: state[key].to(torch.float32) - global_state[key].to(torch.float32) for key in floats}
    if attack == "scale":
        moved = {key: factor * u for key, u in update.items()}
    elif attack == "signflip":
        moved = {key: -factor * u for key, u in update.items()}
    else:
        noise = {key: torch.randn(u.shape, generator=generator) for key, u in update.items()}
        honest = math.sqrt(sum(float(u.double().square().sum()) for u in update.values()))
        drawn = math.sqrt(sum(float(n.double().square().sum()) for n in noise.values())) or 1.0
        moved = {key: factor * honest / drawn * n for key, n in noise.items()}
    return {key: (global_state[key] + moved[key]).to(value.dtype) if key in moved else value for key, value in state.items()}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    parser.add_argument("--attack", choices=ATTACKS, required=True)
    parser.add_argument("--factor", type=float, help="scale: the multiple (1000); signflip: the multiple (1); gaussian: "
                                                     "the multiple of the honest norm (1)")
    parser.add_argument("--attack-seed", type=int, default=0, help="gaussian: the noise's seed")
    args, client_args = parser.parse_known_args(argv)
    factor = DEFAULT_FACTOR[args.attack] if args.factor is None else args.factor
    generator = torch.Generator().manual_seed(args.attack_seed)
    honest_outgoing = wire_dtype.outgoing

    def attacking_outgoing(state: StateDict, extra: StateDict, global_state: StateDict, name: str) -> tuple[StateDict, StateDict]:
        return honest_outgoing(poisoned(args.attack, factor, generator, state, global_state), extra, global_state, name)

    wire_dtype.outgoing = attacking_outgoing  # type: ignore[assignment]
    return cli.main(["client", *client_args])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
