"""Write the file_sd target files that deploy/prometheus/prometheus.yml reads: one JSON file per fedsynth role.

    python -m deploy.prometheus.render_targets --out-dir deploy/prometheus/targets \
        --coordinator run/coordinator.mport --client 10.0.0.5:9101 --client 10.0.0.6:9101 --generator gpu1:9200

A target is HOST:PORT, or a file holding a port (what `--metrics-port-file` writes), scraped on --host.
Only the roles named on the command line are rewritten; Prometheus picks up each rewrite by itself.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from fedsynth.errors import ConfigError
from fedsynth.process.runtime import write_atomic

ROLES = ("coordinator", "client", "generator")
# The scrape job of each role in prometheus.yml; its file_sd file is targets/<role>.json.
JOBS = {role: f"fedsynth-{role}" for role in ROLES}
LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def targets_file(out_dir: Path, role: str) -> Path:
    if role not in ROLES:
        raise ConfigError(f"unknown role {role!r}; known: {', '.join(ROLES)}")
    return out_dir / f"{role}.json"


def resolve_target(spec: str, *, host: str = "127.0.0.1") -> str:
    """'HOST:PORT' as given, or 'host:<port read from the file spec>'; ConfigError naming spec otherwise."""
    path = Path(spec)
    if path.is_file():
        text = path.read_text().strip()
        if not text.isdigit() or not 0 < int(text) < 65536:
            raise ConfigError(f"port file {spec} holds {text!r}, not a port")
        return f"{host}:{int(text)}"
    name, sep, port = spec.rpartition(":")
    if not sep or not name or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"target {spec!r} is neither HOST:PORT nor an existing port file")
    return spec


def target_groups(targets: Sequence[str], labels: Mapping[str, str] | None = None) -> list[dict[str, object]]:
    """The file_sd document: one group with every target (none: an empty list, which Prometheus accepts)."""
    if not targets:
        return []
    return [{"targets": list(targets), "labels": dict(labels or {})}]


def write_targets(out_dir: Path, role: str, targets: Sequence[str], *, labels: Mapping[str, str] | None = None) -> Path:
    """Replace targets/<role>.json atomically (Prometheus never reads half a file); return its path."""
    path = targets_file(out_dir, role)
    write_atomic(path, json.dumps(target_groups(targets, labels), indent=2) + "\n")
    return path


def parse_label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not LABEL_NAME.fullmatch(key) or key.startswith("__"):
        raise ConfigError(f"--label expects NAME=VALUE with a Prometheus label name, got {text!r}")
    return key, value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="render_targets", description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "targets",
                        help="folder of the target files (default: targets/ next to prometheus.yml)")
    parser.add_argument("--host", default="127.0.0.1", help="host for targets given as port files (default %(default)s)")
    for role in ROLES:
        parser.add_argument(f"--{role}", action="append", default=None, metavar="HOST:PORT|PORTFILE",
                            help=f"a {role} metrics endpoint (repeatable)")
    parser.add_argument("--label", action="append", default=[], metavar="NAME=VALUE",
                        help="extra label on every target, e.g. run=cifar10-a01 (repeatable)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        labels = dict(parse_label(text) for text in args.label)
        chosen = {role: getattr(args, role) for role in ROLES if getattr(args, role) is not None}
        if not chosen:
            raise ConfigError("name at least one target: --coordinator, --client or --generator")
        for role, specs in chosen.items():
            path = write_targets(args.out_dir, role, [resolve_target(s, host=args.host) for s in specs], labels=labels)
            print(f"{JOBS[role]}: {len(specs)} target(s) in {path}")
    except ConfigError as exc:
        print(f"render_targets: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
