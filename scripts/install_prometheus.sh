#!/usr/bin/env bash
# Install Debian's `prometheus` package (server + promtool) when the binary is missing; idempotent; print the version.
# Called by scripts/test.sh (the README's test command) for tests/test_prometheus.py; developers may run it alone. Needs root or sudo, and an apt source.
# On a host with systemd the package also enables a system-wide prometheus on :9090; the test never uses that one
# (it starts its own on a free port), so the script leaves the service alone.
set -euo pipefail

if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
  if [ "$(id -u)" -eq 0 ]; then
    as_root=()
  elif command -v sudo >/dev/null 2>&1; then
    as_root=(sudo)
  else
    echo "install_prometheus.sh: prometheus is missing and this user ($(id -un)) is not root and has no sudo" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  "${as_root[@]}" apt-get update -qq
  # No recommends: prometheus-node-exporter is not needed to scrape our processes.
  "${as_root[@]}" apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi

prometheus --version 2>&1 | head -n 1
promtool --version 2>&1 | head -n 1
