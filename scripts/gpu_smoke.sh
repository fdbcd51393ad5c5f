#!/usr/bin/env bash
# GPU smoke run (docs/guides/gpus.md): a ResNet-18 federation on CIFAR-shaped data (random 32x32x3 images written here:
# no download) with the clients and the coordinator's test pass on the GPU (train.device=cuda), then the same run with
# train.device=cpu, and the mean round time of each. Meant to finish in under 5 minutes on one GPU machine.
#
#   bash scripts/gpu_smoke.sh                     # on a machine with a GPU
#   GPU_SMOKE_DRY=1 bash scripts/gpu_smoke.sh     # anywhere: the CPU half only, 1 round, tiny settings (the plumbing)
#
# Settings (environment; defaults printed at the start): CLIENTS, ROUNDS, TRAIN_IMAGES (in all, split among the
# clients), TEST_IMAGES, EPOCHS, BATCH, PRECISION (fp32 | bf16 | fp16: the GPU run's; the CPU run uses fp32, or bf16
# when PRECISION=bf16), THREADS (torch threads of each process; default: the machine's cores), OUT.
# POLICY=none (default) or fedeas: FedEAS draws its synthetic images from the holdout backend (real held-out images,
# no generator model), or from a trained ddpm generator folder of 32x32 RGB images with MODEL_DIR=DIR, which the
# generator service runs on the GPU. The logical clients share one client-node process (runtime.clients_per_process),
# so they share one CUDA context on the GPU.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python}"
FEDSYNTH="${FEDSYNTH:-fedsynth}"
if ! command -v "$FEDSYNTH" >/dev/null 2>&1; then FEDSYNTH="$PYTHON -m fedsynth.cli"; fi

: "${GPU_SMOKE_DRY:=0}"
if [ "$GPU_SMOKE_DRY" = "1" ]; then
  : "${CLIENTS:=2}" "${ROUNDS:=1}" "${TRAIN_IMAGES:=64}" "${TEST_IMAGES:=32}" "${EPOCHS:=1}" "${BATCH:=16}" "${MAX_STEPS:=2}"
else
  : "${CLIENTS:=4}" "${ROUNDS:=4}" "${TRAIN_IMAGES:=2000}" "${TEST_IMAGES:=1000}" "${EPOCHS:=1}" "${BATCH:=64}" "${MAX_STEPS:=}"
fi
: "${PRECISION:=fp32}" "${POLICY:=none}" "${MODEL_DIR:=}" "${THREADS:=$(nproc 2>/dev/null || echo 1)}"
: "${OUT:=${TMPDIR:-/tmp}/fedsynth-gpu-smoke}"
echo "gpu_smoke: CLIENTS=$CLIENTS ROUNDS=$ROUNDS TRAIN_IMAGES=$TRAIN_IMAGES TEST_IMAGES=$TEST_IMAGES EPOCHS=$EPOCHS BATCH=$BATCH" \
     "MAX_STEPS=${MAX_STEPS:-none} PRECISION=$PRECISION POLICY=$POLICY MODEL_DIR=${MODEL_DIR:-none} THREADS=$THREADS OUT=$OUT" \
     "DRY=$GPU_SMOKE_DRY"

rm -rf "$OUT"
mkdir -p "$OUT/data"
# CIFAR-shaped data: random uint8 32x32x3 images, labels 0..9 in turn, as data.dataset = "cifar10" reads from data_dir
"$PYTHON" - "$OUT/data" "$TRAIN_IMAGES" "$TEST_IMAGES" <<'EOF'
import sys
from pathlib import Path

import numpy as np

folder, sizes = Path(sys.argv[1]), {"train": int(sys.argv[2]), "test": int(sys.argv[3])}
rng = np.random.default_rng(0)
for split, n in sizes.items():
    np.savez(folder / f"{split}.npz", x=rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8), y=np.arange(n) % 10)
EOF

common=(--no-progress
  --set data.dataset=cifar10 --set "data.data_dir=\"$OUT/data\"" --set "data.clients=$CLIENTS" --set data.partition=iid
  --set data.min_size=1 --set train.model=resnet18 --set "train.rounds=$ROUNDS" --set "train.local_epochs=$EPOCHS"
  --set "train.batch_size=$BATCH" --set train.lr=0.05 --set train.augment=true
  --set "runtime.clients_per_process=$CLIENTS" --set "runtime.torch_threads=$THREADS"
  --set generation.evaluate_per_class=0)
if [ -n "$MAX_STEPS" ]; then common+=(--set "train.max_steps=$MAX_STEPS"); fi
case "$POLICY" in
  none) common+=(--set generation.policy=none) ;;
  fedeas)
    common+=(--set generation.policy=fedeas --set data.partition=dirichlet --set data.alpha=0.5)
    if [ -n "$MODEL_DIR" ]; then
      common+=(--set generation.backend=ddpm --set "generation.model_dir=\"$MODEL_DIR\"")
    else
      common+=(--set generation.backend=holdout --set data.holdout_fraction=0.1)
    fi ;;
  *) echo "gpu_smoke: POLICY must be none or fedeas, got $POLICY" >&2; exit 1 ;;
esac

run() {  # run NAME DEVICE PRECISION
  local name=$1 device=$2 precision=$3 started
  started=$(date +%s)
  echo "gpu_smoke: $name run (train.device=$device, train.precision=$precision) -> $OUT/$name"
  # shellcheck disable=SC2086
  $FEDSYNTH run "${common[@]}" --set "train.device=\"$device\"" --set "train.precision=$precision" --out-dir "$OUT/$name"
  echo "gpu_smoke: $name run took $(( $(date +%s) - started ))s"
}

cpu_precision=fp32
if [ "$PRECISION" = "bf16" ]; then cpu_precision=bf16; fi
names=()
if [ "$GPU_SMOKE_DRY" != "1" ]; then
  "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "gpu_smoke: torch sees no GPU here (GPU_SMOKE_DRY=1 runs the CPU half only)")'
  run gpu cuda "$PRECISION"
  names+=(gpu)
fi
run cpu cpu "$cpu_precision"
names+=(cpu)

"$PYTHON" - "$OUT" "${names[@]}" <<'EOF'
import json
import sys
from pathlib import Path

out, names = Path(sys.argv[1]), sys.argv[2:]
means = {}
for name in names:
    report = json.loads((out / name / "report.json").read_text())
    durations = [r["duration_s"] for r in report["rounds"]]
    later = durations[1:] or durations  # round 1 pays CUDA's start-up and cuDNN's autotuning
    means[name] = sum(later) / len(later)
    print(f"gpu_smoke: {name}: {len(durations)} rounds, mean round {sum(durations) / len(durations):.2f}s "
          f"({sum(later) / len(later):.2f}s from round 2), final accuracy {report['final_accuracy']}, "
          f"wall clock {report['wall_clock_s']:.1f}s, success {report['success']}")
if "gpu" in means:
    print(f"gpu_smoke: mean round time from round 2: gpu {means['gpu']:.2f}s vs cpu {means['cpu']:.2f}s "
          f"({means['cpu'] / means['gpu']:.1f}x)")
EOF
