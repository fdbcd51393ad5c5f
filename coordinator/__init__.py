"""The coordinator process: registration, rounds, sampling, aggregation, evaluation and checkpoints."""
