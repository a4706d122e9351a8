#!/usr/bin/env bash
# The sharded launch configs on one lent GPU (one process each: the engine's code paths on CUDA, not
# the sharding maths, which tests/test_sharding.py checks on 2 CPU processes): fsdp.yaml,
# deepspeed_zero2.yaml, deepspeed_zero3.yaml and deepspeed_zero3_offload.yaml with Adafactor and AdamW,
# their final weights against a plain one-process run of the same job, and a resume under ZeRO-3.
# Wheels the device lacks (transformers, datasets, fire, deepspeed and its dependencies) in $WHEELS.
# Writes its log under ${OUT:-/tmp/gpu_sharding}.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_sharding}
WHEELS=${WHEELS:-.whl_ds}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
log() { echo "== $*" | tee -a "$OUT/log"; }
runs=$(mktemp -d)

if [ -d "$WHEELS" ]; then
  python3 -m pip install -q --no-index --find-links "$WHEELS" "$WHEELS"/*.whl 2>&1 | tail -3 | tee -a "$OUT/log"
fi
log "GPU"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$OUT/log"
python3 -c "import torch, transformers, accelerate, deepspeed; print(torch.__version__, transformers.__version__, \
accelerate.__version__, deepspeed.__version__)" 2>&1 | tail -1 | tee -a "$OUT/log"

job=(--model_preset=${PRESET:-small} --max_steps=12 --gradient_accumulation_steps=2 --eval_steps=12 --save_steps=6
     --max_eval_samples=16 --dropout_rate=0 --mixed_precision=no --logging_steps=6)
train() {  # name, launcher args..., -- , trainer args...
  local name=$1; shift
  local launcher=()
  while [ "$1" != "--" ]; do launcher+=("$1"); shift; done; shift
  local started=$SECONDS
  if [ ${#launcher[@]} -eq 0 ]; then
    timeout 240 python3 train_low_mem.py train "${job[@]}" "$@" --output_dir="$runs/$name" > "$OUT/$name.log" 2>&1
  else
    timeout 240 python3 -m accelerate.commands.launch "${launcher[@]}" --num_processes 1 train_low_mem.py train \
      "${job[@]}" "$@" --output_dir="$runs/$name" > "$OUT/$name.log" 2>&1
  fi
  local rc=$?
  log "$name: rc $rc, $((SECONDS - started)) s"
  grep -E "^step 12/|eval step 12|peak|^error|Error" "$OUT/$name.log" | tail -4 | tee -a "$OUT/log"
}
compare() {  # two runs' final weights: the largest difference
  python3 - "$runs/$1/final/model.safetensors" "$runs/$2/final/model.safetensors" <<'EOF' 2>&1 | tee -a "$OUT/log"
import sys
from safetensors.torch import load_file
try:
    a, b = (load_file(p) for p in sys.argv[1:3])
    print(f"   {sys.argv[1].split('/')[-3]} vs {sys.argv[2].split('/')[-3]}: max weight difference",
          max(float((a[k].float() - b[k].float()).abs().max()) for k in a))
except Exception as e:
    print("   compare failed:", e)
EOF
}

for optimizer in ${OPTIMIZERS:-adafactor adamw}; do
  log "optimizer $optimizer"
  train "plain-$optimizer" -- --optimizer=$optimizer
  for config in ${CONFIGS:-fsdp deepspeed_zero2 deepspeed_zero3 deepspeed_zero3_offload}; do
    train "$config-$optimizer" --config_file "accelerate_configs/$config.yaml" --mixed_precision no -- \
      --optimizer=$optimizer
    compare "plain-$optimizer" "$config-$optimizer"
  done
done

log "ZeRO-3 resume: the step-6 checkpoint of deepspeed_zero3-adafactor continued to step 12"
cp -r "$runs/deepspeed_zero3-adafactor" "$runs/resumed"
rm -rf "$runs/resumed/final" "$runs/resumed/checkpoints/step_000012"
train resumed --config_file accelerate_configs/deepspeed_zero3.yaml --mixed_precision no -- --is_keep_training=True
compare deepspeed_zero3-adafactor resumed

log "bf16 under ZeRO-3 (the config's own mixed precision)"
train zero3-bf16 --config_file accelerate_configs/deepspeed_zero3.yaml -- --mixed_precision=bf16

log "GPU-marked tests"
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 0 -m gpu tests 2>&1 | tail -8 | tee -a "$OUT/log"
