"""Rounding error of float16 / bfloat16 updates on ResNet-18 after one local step: absolute weights vs deltas.

Three clients each take one SGD step (FedAvg's client_update, max_steps 1, CIFAR-shaped random images) from the
same global ResNet-18; their updates are cast to the wire dtype either as absolute weights or as deltas from the
global model and folded by the real Aggregator. Against the float64 mean of the float32 updates it reports, over
the trainable parameters and over all floating-point tensors (BatchNorm's running statistics too, which move by
their momentum whatever the lr), ||error|| / ||exact model|| and ||error|| / ||exact model - global|| (the error
relative to the step the round takes). Prints a markdown table.

    python benchmarks/wire_dtype_rounding.py [--lr 0.05 0.001] [--clients 3]
"""

from __future__ import annotations

import argparse
import time

import torch

from fedsynth.algorithms import get_algorithm, snapshot_state
from fedsynth.algorithms.base import Aggregator
from fedsynth.learning.models import build_model
from fedsynth.learning.training import LocalTrainConfig, TrainData

StateDict = dict[str, torch.Tensor]


def local_states(global_state: StateDict, *, clients: int, lr: float) -> list[StateDict]:
    states = []
    for k in range(clients):
        model = build_model("resnet18", num_classes=10, in_channels=3, image_size=32)
        model.load_state_dict(global_state)
        gen = torch.Generator().manual_seed(100 + k)
        data = TrainData(torch.randn(64, 3, 32, 32, generator=gen), torch.randint(0, 10, (64,), generator=gen))
        cfg = LocalTrainConfig(lr=lr, momentum=0.9, batch_size=64, local_epochs=1, max_steps=1)
        update = get_algorithm("fedavg").client_update(model=model, data=data, cfg=cfg, server_extra={}, client_state={},
                                                       generator=torch.Generator().manual_seed(k))
        states.append(update.state)
    return states


def aggregate(global_state: StateDict, states: list[StateDict], dtype: torch.dtype | None, *, deltas: bool) -> StateDict:
    """The mean as the coordinator folds it: float64 sums of the (cast) updates, weights 1, 2, 3, ..."""
    aggregator = Aggregator(global_state)
    for weight, state in enumerate(states, start=1):
        sent = {}
        for key, value in state.items():
            if value.is_floating_point():
                value = value - global_state[key] if deltas else value
                value = value.to(dtype) if dtype is not None else value
            sent[key] = value
        aggregator.add(sent, {}, float(weight), deltas=deltas)
    mean, _ = aggregator.finish()
    return mean


def flat(state: StateDict, keys: list[str]) -> torch.Tensor:
    return torch.cat([state[key].double().reshape(-1) for key in keys])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lr", type=float, nargs="+", default=[0.05, 0.001])
    parser.add_argument("--clients", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model("resnet18", num_classes=10, in_channels=3, image_size=32)
    global_state = snapshot_state(model)
    groups = {"parameters": [name for name, _ in model.named_parameters()],
              "all floats": [key for key, value in global_state.items() if value.is_floating_point()]}
    print("| lr | wire dtype | sent as | tensors | error / model norm | error / update norm |")
    print("|---|---|---|---|---|---|")
    for lr in args.lr:
        started = time.monotonic()
        states = local_states(global_state, clients=args.clients, lr=lr)
        exact = aggregate(global_state, states, None, deltas=False)
        for name, dtype in (("float16", torch.float16), ("bfloat16", torch.bfloat16)):
            for deltas in (False, True):
                rounded = aggregate(global_state, states, dtype, deltas=deltas)
                for group, keys in groups.items():
                    want, g = flat(exact, keys), flat(global_state, keys)
                    error = (flat(rounded, keys) - want).norm()
                    print(f"| {lr:g} | {name} | {'delta' if deltas else 'absolute'} | {group} | {float(error / want.norm()):.2e} "
                          f"| {float(error / (want - g).norm()):.2e} |", flush=True)
        print(f"<!-- lr {lr:g}: {time.monotonic() - started:.0f} s -->")


if __name__ == "__main__":
    main()
