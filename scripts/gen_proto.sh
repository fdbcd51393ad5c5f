#!/usr/bin/env bash
# Regenerate fedsynth/v1/*_pb2*.py from proto/. With --check, fail if the committed code differs.
set -euo pipefail
cd "$(dirname "$0")/.."
out=.
if [ "${1:-}" = "--check" ]; then
  out=$(mktemp -d)
  trap 'rm -rf "$out"' EXIT
fi
python -m grpc_tools.protoc -Iproto --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" proto/fedsynth/v1/*.proto
if [ "${1:-}" = "--check" ]; then
  status=0
  for f in "$out"/fedsynth/v1/*.py "$out"/fedsynth/v1/*.pyi; do
    rel=${f#"$out"/}
    if ! cmp -s "$f" "$rel"; then echo "generated code is stale: $rel (run scripts/gen_proto.sh)" >&2; status=1; fi
  done
  exit $status
fi
