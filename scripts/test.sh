#!/usr/bin/env bash
# The README's test command: make the venv, install fedsynth with its test extras, install the system programs the
# tests drive (Prometheus, nftables, iproute2) when they are missing, then run pytest.
# Arguments go to pytest (one serial run); without any, the README's selection in two runs (below).
set -euo pipefail
cd "$(dirname "$0")/.."

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"
  elif command -v sudo >/dev/null 2>&1; then sudo "$@"
  else echo "scripts/test.sh: '$*' needs root or sudo" >&2; return 1
  fi
}

apt_updated=0
apt_install() {  # apt_install PACKAGE...: Debian packages, with one `apt-get update` per run
  if [ "$apt_updated" -eq 0 ]; then as_root apt-get update -qq; apt_updated=1; fi
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# A Debian python3 makes venvs only with python3-venv (ensurepip).
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv 2>/dev/null || { rm -rf .venv; apt_install python3-venv; python3 -m venv .venv; }
fi
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q -e '.[dev]'
# tests/test_any_model.py: a user's model package (train.model = "byo_model:tiny_net"), installed as any user's is.
.venv/bin/pip install -q ./tests/fixtures/byo_model

# tests/test_prometheus.py and tests/test_metrics_tls.py: a real Prometheus scrapes real processes.
bash scripts/install_prometheus.sh >/dev/null
# tests/test_multihost.py: network namespaces (iproute2) with 2% packet loss (nftables).
command -v ip >/dev/null || apt_install iproute2
command -v nft >/dev/null || apt_install nftables

# pytest exits 5 when it collected no test: a failure for us.
if [ "$#" -gt 0 ]; then exec .venv/bin/python -m pytest "$@"; fi
# The README's selection: every test but those needing ../shared/data. The tests that wait on processes (most of the
# suite) run on FEDSYNTH_TEST_WORKERS pytest-xdist workers (default 3: with 2 they left ~a quarter of 2 cores idle while
# tests waited on processes, and the whole .ci/run took 26 min on 2026-12-07); those marked serial
# (time bounds, network namespaces) run after them, alone. Both halves run; the script fails if either did.
status=0
.venv/bin/python -m pytest -n "${FEDSYNTH_TEST_WORKERS:-3}" -m "not shared_data and not serial" || status=$?
.venv/bin/python -m pytest -m "not shared_data and serial" || status=$?
exit "$status"
