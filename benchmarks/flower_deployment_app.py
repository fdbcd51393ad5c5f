"""The Flower app that benchmarks/flower_compare.py runs in Flower's deployment mode (SuperLink + SuperNodes).

It imports only flwr and numpy: flower_compare.py copies this file into a throw-away Flower app folder beside a
generated pyproject.toml whose [tool.flwr.app.config] names the arrays file, the number of nodes and rounds and the
timings file, and `flwr run` ships that folder as a FAB to the SuperLink, which starts the ServerApp, and to every
SuperNode, which starts the ClientApp.

ServerApp: FedAvg (flwr.serverapp.strategy, the Message API) seeded with the stored arrays, every node trains each
round, no evaluation; it writes when each round's configure_train began and its aggregate_train ended.
ClientApp: replies with the received ArrayRecord unchanged and a MetricRecord {"num-examples": 1}, which FedAvg needs.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

server_app = ServerApp()
client_app = ClientApp()


@client_app.train()
def echo(msg: Message, context: Context) -> Message:
    return Message(RecordDict({"arrays": msg.content.array_records["arrays"], "metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    clients, rounds = int(config["clients"]), int(config["rounds"])
    with np.load(str(config["arrays"])) as stored:
        arrays = [stored[f"a{i}"] for i in range(len(stored.files))]
    starts: dict[int, float] = {}
    ends: dict[int, float] = {}

    class TimedFedAvg(FedAvg):
        def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):  # type: ignore[no-untyped-def]
            starts[server_round] = time.monotonic()
            return super().configure_train(server_round, arrays, config, grid)

        def aggregate_train(self, server_round: int, replies):  # type: ignore[no-untyped-def]
            replies = list(replies)
            failed = [m for m in replies if m.has_error()]
            if failed or len(replies) != clients:
                raise RuntimeError(f"round {server_round}: {len(replies) - len(failed)} results, {len(failed)} failures")
            aggregated = super().aggregate_train(server_round, replies)
            ends[server_round] = time.monotonic()
            return aggregated

    strategy = TimedFedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=clients, min_available_nodes=clients)
    strategy.start(grid=grid, initial_arrays=ArrayRecord(arrays), num_rounds=rounds, timeout=float(config["round-timeout-s"]))
    timings = Path(str(config["timings"]))
    partial = timings.with_suffix(".partial")
    partial.write_text(json.dumps({"starts": starts, "ends": ends}))
    os.replace(partial, timings)
