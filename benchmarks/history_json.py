"""The checkpoint record's JSON each round: the whole history encoded again, against each round encoded once.

The round loop writes a checkpoint after every round whose record holds the summary of every round so far (at K = 100
with full participation each summary lists 100 participants and 100 sampled ids). Encoding all of it again each round
costs O(rounds) a round with the GIL held, beside the next round's transfers; the coordinator's checkpoint splices in
entries encoded once (fedsynth.process.runtime.dumps_with_encoded_list). Summaries shaped like the round driver's, seconds per
checkpoint record (median of 5):

    python benchmarks/history_json.py --clients 100 --rounds 40 200 1000
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from fedsynth.process.runtime import dumps_with_encoded_list


def summary(number: int, clients: int, rng: random.Random) -> dict[str, object]:
    phases = ("dispatch", "waiting", "generation", "training", "communication", "aggregation", "evaluation")
    return {
        "round": number, "accuracy": rng.random(), "loss": rng.random() * 3, "duration_s": rng.random(),
        "participants": list(range(clients)), "sampled": list(range(clients)),
        "phases_s": {name: rng.random() for name in phases}, "bytes_sent": 44_700_000 * clients,
        "bytes_received": 44_700_000 * clients, "train_loss": rng.random(),
    }


def seconds(fn: object, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--rounds", type=int, nargs="+", default=[10, 50, 200])
    args = parser.parse_args()
    rng = random.Random(0)
    print(f"K = {args.clients}, every client in every round; seconds to encode the record of one checkpoint\n")
    print("| rounds so far | whole history again s | entries encoded once s | ratio |\n|---:|---:|---:|---:|")
    for rounds in args.rounds:
        history = [summary(r, args.clients, rng) for r in range(1, rounds + 1)]
        record = {"fingerprint": "0" * 16, "rng": {"state": {"state": 1, "inc": 2}}, "initial": {}, "quota": None, "history": history}
        encoded = [json.dumps(entry) for entry in history]
        assert json.loads(dumps_with_encoded_list(record, "history", encoded)) == json.loads(json.dumps(record))
        whole = seconds(lambda: json.dumps(record))
        # what a round costs now: its own summary encoded, and the spliced record
        once = seconds(lambda: (json.dumps(history[-1]), dumps_with_encoded_list(record, "history", encoded)))
        print(f"| {rounds} | {whole:.4f} | {once:.4f} | {whole / once:.1f}x |")


if __name__ == "__main__":
    main()
