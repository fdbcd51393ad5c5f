#!/usr/bin/env bash
# One command on a GPU machine: train the full DDPM-CIFAR UNet (`--size ddpm-cifar`, 35.7M) on CIFAR-10 with Ho et
# al.'s recipe as far as `fedsynth generator train` supports it, then score it with `fedsynth generator evaluate`
# (a ResNet-18 judge on the GPU) at a grid of DDIM steps x guidance, plus the holdout ceiling with the same judge,
# and print a markdown table of the figures. See docs/generator.md, "GPU recipe".
#
#   DATA_DIR=../shared/data/cifar10 bash scripts/gpu_ddpm_cifar10.sh
#
# RECIPES="central federated" adds (c): the same UNet family trained FEDERATEDLY with differential privacy
# (`fedsynth generator federate`: FED_CLIENTS client nodes on a Dirichlet FED_ALPHA split of CIFAR-10, DP-SGD on every
# client at FED_EPSILON with DPDM's noise multiplicity, clients training on the GPU), scored at the same GRID with the
# same judge; RECIPES=federated runs only that (and the holdout ceiling). See docs/federated-generator.md.
#
# Every setting is an environment variable (defaults printed at the start). Rerun the same command after a crash:
# training continues from OUT/checkpoints (--resume), a finished model is not retrained, and an evaluation whose
# JSON is already in the results folder is not redone. Nothing is downloaded: DATA_DIR must hold train.npz and
# test.npz. Without a GPU it refuses to start unless ALLOW_CPU=1 (a smoke run of the plumbing; its figures mean
# nothing), e.g.
#
#   python scripts/subset_dataset.py --data-dir ../shared/data/cifar10 --train-fraction 0.02 --test-fraction 0.05 --out /tmp/cifar-tiny
#   ALLOW_CPU=1 SIZE=tiny STEPS=20 WARMUP=10 CHECKPOINT_EVERY=10 PER_CLASS=5 GRID="5:0" JUDGE_MODEL=cnn JUDGE_EPOCHS=1 \
#       MAX_BATCH=16 THREADS=1 DATA_DIR=/tmp/cifar-tiny OUT=/tmp/gpu-recipe-smoke bash scripts/gpu_ddpm_cifar10.sh
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"

# Training: Ho et al. (2020) CIFAR-10 used lr 2e-4, batch 128, EMA 0.9999, dropout 0.1 (in the ddpm-cifar size),
# 5000 warm-up steps and 800k steps. The default budget here is 100k steps (see docs/generator.md for the estimate).
: "${DATA_DIR:=}"
: "${OUT:=runs/gpu-ddpm-cifar10}"
: "${SIZE:=ddpm-cifar}"
: "${STEPS:=100000}"
: "${BATCH:=128}"
: "${LR:=2e-4}"
: "${WARMUP:=5000}"
: "${EMA:=0.9999}"
: "${LABEL_DROPOUT:=0.1}"
: "${CHECKPOINT_EVERY:=5000}"
: "${SEED:=0}"
# Evaluation: PER_CLASS images per class at each "DDIM_STEPS:GUIDANCE" pair of GRID, and the holdout ceiling
# (HOLDOUT_FRACTION 0.2 holds 1000 real CIFAR-10 training images per class, so 1000 per class are all distinct).
: "${PER_CLASS:=1000}"
: "${GRID:=10:0 10:1 10:3 25:0 25:1 25:3 50:0 50:1 50:3}"
: "${HOLDOUT_FRACTION:=0.2}"
: "${JUDGE_MODEL:=resnet18}"
: "${JUDGE_EPOCHS:=}"  # empty: the judge's default recipe (15 epochs with crop + flip for 32x32)
: "${JUDGE_CACHE:=}"   # empty: $FEDSYNTH_CACHE/judges (~/.cache/fedsynth/judges)
: "${MAX_BATCH:=256}"  # UNet rows per sampling batch
: "${EVAL_SEED:=0}"
: "${RESULTS:=}"       # empty: OUT/eval/<model id>-n<PER_CLASS>-<judge>-<device>
: "${THREADS:=0}"      # torch CPU threads, 0 = torch's default
: "${ALLOW_CPU:=0}"
: "${PYTHON:=}"
: "${RECIPES:=central}"  # central, federated, or both ("central federated")
# (c) the federated DP recipe. DPDM trains with DP-SGD at clipping norm 1, logical batches in the thousands, noise
# multiplicity and EMA; one GPU hosts every client here (clients_per_process = FED_CLIENTS, threads sharing it).
: "${FED_OUT:=${OUT}-federated}"
: "${FED_SIZE:=half}"
: "${FED_CLIENTS:=10}"
: "${FED_ALPHA:=0.1}"
: "${FED_ROUNDS:=100}"
: "${FED_LOCAL_STEPS:=20}"
: "${FED_DP:=sample}"          # sample (DP-SGD per client) | user (DP-FedAvg; needs hundreds of clients a round) | none
: "${FED_EPSILON:=10}"
: "${FED_DELTA:=1e-5}"
: "${FED_CLIP:=1.0}"
: "${FED_BATCH:=512}"          # expected logical batch per client step (Poisson); q = 1 / ceil(N_k / FED_BATCH)
: "${FED_MULTIPLICITY:=4}"     # diffusion-noise draws per image inside one per-image gradient
: "${FED_PHYSICAL:=256}"       # UNet rows (images x draws) per physical batch
: "${FED_LR:=}"                # empty: the size's (2e-4 for half and ddpm-cifar)
: "${FED_EMA:=0.99}"           # the server's EMA, per round
: "${FED_GRID:=10}"            # samples per class in FED_OUT/samples.png (0: none)
if [ -z "$PYTHON" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi

echo "== scripts/gpu_ddpm_cifar10.sh settings"
for name in DATA_DIR OUT SIZE STEPS BATCH LR WARMUP EMA LABEL_DROPOUT CHECKPOINT_EVERY SEED PER_CLASS GRID \
            HOLDOUT_FRACTION JUDGE_MODEL JUDGE_EPOCHS JUDGE_CACHE MAX_BATCH EVAL_SEED RESULTS THREADS ALLOW_CPU PYTHON \
            RECIPES FED_OUT FED_SIZE FED_CLIENTS FED_ALPHA FED_ROUNDS FED_LOCAL_STEPS FED_DP FED_EPSILON FED_DELTA FED_CLIP \
            FED_BATCH FED_MULTIPLICITY FED_PHYSICAL FED_LR FED_EMA FED_GRID; do
  printf '  %-16s %s\n' "$name" "${!name:-(default)}"
done

fail() { echo "scripts/gpu_ddpm_cifar10.sh: error: $*" >&2; exit 1; }

[ -n "$DATA_DIR" ] || fail "DATA_DIR is required: a folder with CIFAR-10's train.npz and test.npz (nothing is downloaded)"
for split in train test; do
  [ -f "$DATA_DIR/$split.npz" ] || fail "DATA_DIR=$DATA_DIR has no $split.npz (nothing is downloaded)"
done
DATA_DIR="$(cd "$DATA_DIR" && pwd)"
[ -n "${GRID// /}" ] || fail "GRID is empty: give at least one DDIM_STEPS:GUIDANCE pair (e.g. GRID=\"25:1\")"
for pair in $GRID; do
  [[ "$pair" =~ ^[0-9]+:[0-9.]+$ ]] || fail "GRID entry '$pair' is not DDIM_STEPS:GUIDANCE (e.g. 25:1)"
done
CENTRAL=0 FEDERATED=0
for recipe in $RECIPES; do
  case "$recipe" in
    central) CENTRAL=1 ;;
    federated) FEDERATED=1 ;;
    *) fail "RECIPES entry '$recipe' is not central or federated" ;;
  esac
done
[ "$CENTRAL$FEDERATED" != "00" ] || fail "RECIPES is empty: give central, federated or both"

if "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  DEVICE=cuda
  echo "== GPU: $("$PYTHON" -c 'import torch; print(torch.cuda.get_device_name(0))')"
elif [ "$ALLOW_CPU" = "1" ]; then
  DEVICE=cpu
  echo "== NO GPU: ALLOW_CPU=1, so this is a CPU smoke run of the plumbing; its figures mean nothing"
else
  fail "torch sees no CUDA device; this recipe needs a GPU (ALLOW_CPU=1 runs it on the CPU as a smoke test)"
fi

export HF_HUB_OFFLINE=1  # nothing here needs the network
fedsynth() { "$PYTHON" -m fedsynth.cli "$@"; }
common=(--threads "$THREADS")

# --- (a) train ------------------------------------------------------------------------------------------------
trained_steps() {  # the finished model's training steps, or nothing
  [ -f "$OUT/fedsynth_generator.json" ] || return 0
  "$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1]))["training_steps"])' "$OUT/fedsynth_generator.json"
}
if [ "$CENTRAL" = "0" ]; then
  echo "== training: RECIPES has no central; skipped"
elif [ "$(trained_steps)" = "$STEPS" ]; then
  echo "== training: $OUT already holds the model trained for $STEPS steps; not retrained"
else
  resume=()
  if compgen -G "$OUT/checkpoints/step-*[0-9]" >/dev/null || [ -f "$OUT/fedsynth_generator.json" ]; then
    resume=(--resume)
    echo "== training: $OUT holds checkpoints ($(ls "$OUT/checkpoints" 2>/dev/null | grep -v '\.tmp$' | tail -1)); resuming"
  fi
  echo "== training $SIZE on CIFAR-10 for $STEPS steps on $DEVICE"
  started=$SECONDS
  fedsynth generator train --dataset cifar10 --data-dir "$DATA_DIR" --size "$SIZE" --steps "$STEPS" \
    --batch-size "$BATCH" --lr "$LR" --warmup-steps "$WARMUP" --ema-decay "$EMA" --label-dropout "$LABEL_DROPOUT" \
    --checkpoint-every "$CHECKPOINT_EVERY" --seed "$SEED" --device "$DEVICE" --out "$OUT" ${resume[@]+"${resume[@]}"} "${common[@]}"
  echo "== training took $((SECONDS - started)) s (wall, this invocation)"
fi
model_id() { "$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1]))["model_id"])' "$1/fedsynth_generator.json"; }
if [ "$CENTRAL" = "1" ]; then
  MODEL_ID="$(model_id "$OUT")"
  echo "== model $MODEL_ID"
  RESULTS="${RESULTS:-$OUT/eval/$MODEL_ID-n$PER_CLASS-$JUDGE_MODEL${JUDGE_EPOCHS:+-e$JUDGE_EPOCHS}-$DEVICE}"
else
  RESULTS="${RESULTS:-$FED_OUT/eval/holdout-n$PER_CLASS-$JUDGE_MODEL${JUDGE_EPOCHS:+-e$JUDGE_EPOCHS}-$DEVICE}"
fi

# --- (c) the federated DP generator ---------------------------------------------------------------------------
if [ "$FEDERATED" = "1" ]; then
  if [ -f "$FED_OUT/fedsynth_generator.json" ]; then
    echo "== federated: $FED_OUT already holds the federated generator; not retrained"
  else
    echo "== federated $FED_SIZE on CIFAR-10: $FED_CLIENTS clients (Dirichlet $FED_ALPHA), $FED_ROUNDS rounds x $FED_LOCAL_STEPS steps, dp $FED_DP at epsilon $FED_EPSILON (a rerun resumes $FED_OUT/run)"
    fed=(--size "$FED_SIZE" --rounds "$FED_ROUNDS" --local-steps "$FED_LOCAL_STEPS" --dp "$FED_DP" --delta "$FED_DELTA"
         --set data.dataset='"cifar10"' --set data.data_dir="\"$DATA_DIR\"" --set data.clients="$FED_CLIENTS"
         --set data.alpha="$FED_ALPHA" --set runtime.clients_per_process="$FED_CLIENTS" --set runtime.torch_threads=2
         --set runtime.round_timeout_s=86400 --set seed="$SEED" --set federate.device="\"$DEVICE\""
         --set federate.clip="$FED_CLIP" --set federate.batch_size="$FED_BATCH" --set federate.noise_multiplicity="$FED_MULTIPLICITY"
         --set federate.max_physical_batch="$FED_PHYSICAL" --set federate.ema_decay="$FED_EMA"
         --set federate.label_dropout="$LABEL_DROPOUT" --ddim-steps 50 --grid-per-class "$FED_GRID" --no-progress --out "$FED_OUT")
    [ "$FED_DP" = "none" ] || fed+=(--target-epsilon "$FED_EPSILON")
    [ -z "$FED_LR" ] || fed+=(--set federate.lr="$FED_LR")
    started=$SECONDS
    fedsynth generator federate "${fed[@]}"
    echo "== federated training took $((SECONDS - started)) s (wall, this invocation)"
  fi
  FED_MODEL_ID="$(model_id "$FED_OUT")"
  echo "== federated model $FED_MODEL_ID: $("$PYTHON" -c 'import json, sys; p = json.load(open(sys.argv[1])); print("dp {dp}, epsilon {epsilon}, delta {delta}, {rounds} rounds, {clients} clients".format(**p))' "$FED_OUT/provenance.json")"
fi

# --- (b) evaluate ---------------------------------------------------------------------------------------------
mkdir -p "$RESULTS"
judge=(--judge-model "$JUDGE_MODEL" --judge-device "$DEVICE" --per-class "$PER_CLASS" --seed "$EVAL_SEED"
       --data-dir "$DATA_DIR" --max-batch "$MAX_BATCH" "${common[@]}")
[ -z "$JUDGE_EPOCHS" ] || judge+=(--judge-epochs "$JUDGE_EPOCHS")
[ -z "$JUDGE_CACHE" ] || judge+=(--judge-cache "$JUDGE_CACHE")

evaluate() {  # evaluate NAME FLAG...: RESULTS/NAME.json (atomic, written last), .png and .log; skipped when present
  local name=$1; shift
  if [ -f "$RESULTS/$name.json" ]; then
    echo "== $name: $RESULTS/$name.json exists; not redone"
    return 0
  fi
  echo "== evaluating $name"
  fedsynth generator evaluate "$@" "${judge[@]}" --json "$RESULTS/$name.json" --grid "$RESULTS/$name.png" 2>&1 \
    | tee "$RESULTS/$name.log"
}

# The holdout ceiling first: it also trains (and caches) the judge the other evaluations read.
evaluate holdout --backend holdout --dataset cifar10 --holdout-fraction "$HOLDOUT_FRACTION"
for pair in $GRID; do
  steps=${pair%%:*} w=${pair#*:}
  [ "$CENTRAL" = "0" ] || evaluate "ddpm-s$steps-w$w" --backend ddpm --model "$OUT" --device "$DEVICE" --ddim-steps "$steps" --guidance "$w"
  [ "$FEDERATED" = "0" ] || evaluate "federated-$FED_MODEL_ID-s$steps-w$w" --backend ddpm --model "$FED_OUT" --device "$DEVICE" \
    --ddim-steps "$steps" --guidance "$w"
done

# --- the table ------------------------------------------------------------------------------------------------
"$PYTHON" - "$RESULTS" "$GRID" "$HOLDOUT_FRACTION" "$CENTRAL" "${FED_MODEL_ID:-}" "$FED_OUT" <<'PY' | tee "$RESULTS/table.md"
import json
import sys
from pathlib import Path

results, grid, fraction = Path(sys.argv[1]), sys.argv[2].split(), sys.argv[3]
central, fed_model, fed_out = sys.argv[4] == "1", sys.argv[5], Path(sys.argv[6])
holdout = json.loads((results / "holdout.json").read_text())
ddpm = {pair: json.loads((results / "ddpm-s{}-w{}.json".format(*pair.split(":"))).read_text()) for pair in grid} if central else {}
federated = {pair: json.loads((results / "federated-{}-s{}-w{}.json".format(fed_model, *pair.split(":"))).read_text())
             for pair in grid} if fed_model else {}
j = holdout["judge"]
trained = "read from its cache" if j["cached"] else f"trained in {holdout['seconds']['judge']:.0f} s (in the holdout row's seconds)"
names = [f"central {next(iter(ddpm.values()))['model_id'].rsplit('-s', 1)[0]}"] if ddpm else []
if federated:
    p = json.loads((fed_out / "provenance.json").read_text())
    names.append(f"federated {fed_model} (dp {p['dp']}, epsilon {p['epsilon']}, delta {p['delta']}, {p['rounds']} rounds, "
                 f"{p['clients']} clients)")
print(f"Generators: {'; '.join(names)}; judge {j['model']} on {j['device']}, "
      f"test accuracy {j['test_accuracy']:.4f}, {trained}; {holdout['n_per_class']} images per class, seed "
      f"{holdout['seed']}; JSON in {results}\n")
print("| source | DDIM steps | w | recognizability (lowest class) | CAS | Fréchet (largest class) | seconds |")
print("|---|---:|---:|---:|---:|---:|---:|")


def row(source, steps, w, r):
    print(f"| {source} | {steps} | {w} | {r['recognizability']:.3f} ({min(r['per_class_recognizability']):.2f}) | "
          f"{r['cas']:.3f} | {r['frechet']:.3f} ({max(r['per_class_frechet']):.2f}) | {r['seconds']['total']:.0f} |")


row(f"holdout, F = {fraction} (the ceiling)", "", "", holdout)
print(f"| real test split | | | {holdout['judge_test_accuracy']:.3f} (judge test accuracy) | | "
      f"{holdout['real_test_frechet']:.3f} | |")
for pair, result in ddpm.items():
    row("ddpm", *pair.split(":"), result)
for pair, result in federated.items():
    row("federated DP ddpm", *pair.split(":"), result)
PY
