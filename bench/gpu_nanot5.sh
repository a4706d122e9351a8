#!/usr/bin/env bash
# What a session with a lent GPU runs for issue 83 (one machine, about five minutes): nanoT5's recipe
# (recipes/nanot5.yaml: T5 v1.1 base, span corruption 512 -> 114, batch 128, AdamWScale) for STEPS steps in bf16
# with torch.compile as the recipe says, then in float32 without compile, on the shipped text and tokenizer (the
# machine reaches no hub). Prints each run's median seconds a step after the first few (compiles), its MFU, the
# bf16 / float32 ratio (goal: below 1), and nanoT5's 0.56 s a step on an A100 scaled by the GPUs' bf16 peaks
# (A100 312 TFLOP/s: lowmem/hardware/gpu_peaks.py). Writes its log and the runs' metrics under ${OUT:-/tmp/gpu_nanot5}.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_nanot5}
STEPS=${STEPS:-12}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

run() {  # name, extra flags...
  local name=$1; shift
  timeout "${RUN_S:-240}" python3 train_low_mem.py train --config=recipes/nanot5.yaml \
    --train_file=data/pinyin/train.jsonl --eval_file=data/pinyin/eval.jsonl --dataset_config=None \
    --text_column=response --tokenizer_dir=data/tokenizer \
    --output_dir="$OUT/$name" --overwrite_output_dir=True --max_steps="$STEPS" --warmup_steps=2 --logging_steps=1 \
    --eval_steps=0 --save_steps=0 --max_eval_samples=400 --eval_generate=False "$@" 2>&1 | tail -4 | tee -a "$OUT/log"
}
echo "== nanoT5 recipe, bf16 + compile" | tee -a "$OUT/log"
run bf16
echo "== nanoT5 recipe, float32, no compile" | tee -a "$OUT/log"
run float32 --mixed_precision=no --torch_compile=False

python3 - "$OUT" <<'EOF' | tee -a "$OUT/log"
import json, statistics, sys
from pathlib import Path

import torch

from lowmem.hardware.probe import capability

out, found = Path(sys.argv[1]), capability("cuda")
steps = {}
for name in ("bf16", "float32"):
    path = out / name / "metrics.jsonl"
    train = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    train = [r for r in train if r["event"] == "train"][3:]  # after the compiles
    if train:
        steps[name] = statistics.median(r["step_s"] for r in train)
        print(f"{name}: {steps[name]:.3f} s a step, MFU {statistics.median(r['mfu'] for r in train):.3f}, "
              f"micro-batch as planned: {json.loads((out / name / 'config.json').read_text())['batch_size']}")
if len(steps) == 2:
    print(f"bf16 / float32 step time: {steps['bf16'] / steps['float32']:.2f} (goal: below 1)")
scaled = 0.56 * 312e12 / found.peak(torch.bfloat16)
print(f"nanoT5's 0.56 s a step on an A100, scaled to {found.name}: {scaled:.3f} s")
EOF
