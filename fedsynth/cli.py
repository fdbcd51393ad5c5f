"""The `fedsynth` console script: a table of sub-commands, each imported only when it is chosen."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from fedsynth.process import lifetime
from fedsynth.errors import FedsynthError

# name -> (module, one-line help). Each module defines add_arguments(parser) and run(args) -> int.
# Imported lazily so `fedsynth plan` never pays for torch/grpc start-up and roles stay independent.
COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("fedsynth.plan.plan_cmd", "allocation planner: synthetic budgets per client and class, no training"),
    "run": ("deploy.launcher", "local launcher: coordinator, generator and client nodes as processes"),
    "coordinator": ("coordinator.main", "the coordinator (server) process alone"),
    "client": ("client_node.main", "one client-node process (one or several logical clients)"),
    "generator serve": ("generator_service.serve_cmd", "serve a class-conditional generator over gRPC"),
    "generator train": ("generator_service.train_cmd", "train the class-conditional generator on a dataset"),
    "generator evaluate": ("generator_service.evaluate_cmd", "score a generator's images with a judge trained on real data"),
    "generator federate": ("generator_service.federate_cmd", "train the class-conditional generator across client nodes, optionally with DP"),
    "generator evolve": ("generator_service.evolve_cmd", "Private Evolution: a public generator's images, selected by the clients' noisy votes"),
    "generator dpgan": ("generator_service.dpgan_cmd", "train a DP WGAN-GP on local images and write unlabelled samples"),
    "experiment": ("deploy.experiment", "several arms on the same partition and seed, with a comparison table"),
    "data split": ("fedsynth.learning.split_cmd", "write per-client data folders (split mode's shards) for local mode"),
    "report": ("deploy.report_cmd", "re-render report.md and plots of a run folder, or render a coordinator's run folder"),
    "export": ("deploy.export_cmd", "write a run's trained model as safetensors and a JSON sidecar (classes, image size, ...)"),
    "predict": ("fedsynth.learning.predict_cmd", "class name and probability per image, with a model `fedsynth export` wrote"),
    "deploy provision": ("deploy.provision", "create a CA and per-role TLS certificates"),
}

EXIT_USAGE = 2
EXIT_ERROR = 1


def _overview() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: fedsynth COMMAND [options]   (fedsynth COMMAND --help for its flags)", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def _resolve(argv: Sequence[str]) -> tuple[str, list[str]] | None:
    """Match the longest command name (one or two words) at the start of argv."""
    for words in (2, 1):
        name = " ".join(argv[:words])
        if len(argv) >= words and name in COMMANDS:
            return name, list(argv[words:])
    return None


def main(argv: Sequence[str] | None = None) -> int:
    lifetime.bind_to_parent()  # first: a child started by a fedsynth process ends with it, even if it dies by kill -9
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_overview())
        return 0 if argv else EXIT_USAGE
    if argv[0] == "--version":
        from fedsynth import __version__

        print(f"fedsynth {__version__}")
        return 0
    resolved = _resolve(argv)
    if resolved is None:
        print(f"fedsynth: unknown command {' '.join(argv[:2])!r}\n\n{_overview()}", file=sys.stderr)
        return EXIT_USAGE
    name, rest = resolved
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"fedsynth {name}", description=COMMANDS[name][1])
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    try:
        return int(module.run(args) or 0)
    except FedsynthError as exc:
        print(f"fedsynth {name}: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `fedsynth plan --json | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
