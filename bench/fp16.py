"""--mixed_precision=fp16 against float32 on the CPU: eval loss after the same steps, and a T5 built to overflow.

    python -m bench.fp16                                  # tiny preset: pretraining, SFT, the overflowing model
    python -m bench.fp16 --presets=tiny,small --steps=100 # the overflowing model on tiny only (--overflowing)
    python -m bench.fp16 --dropout_rate=0.1               # with dropout (see below)
    python -m bench.fp16 --accumulation=4 --steps=50      # a quick look

Every run is a real ``train_low_mem.py train`` process on the shipped data, side by side in one run:

1. pretraining from scratch, ``--steps`` steps, float32 and fp16 (the same seed, data and steps);
2. SFT (``--is_finetune=True``) from the float32 pretraining's ``best/``, float32 and fp16;
3. the overflowing model: that ``best/`` with every feed-forward output weight (``wo``) scaled until its outputs
   pass 1e5 on the eval rows (float16's largest is 65,504), SFT for ``2 x --steps`` steps, float32 and fp16. Plain
   float16 autocast gives it a NaN loss at the first step (tests/test_precision.py); fp16 here must show no
   non-finite loss.

Printed: each pair's final eval loss and their ratio, fp16's loss-scale skips and non-finite steps.
Targets: within 0.5 % of float32 (1, 2), within 2 % and no non-finite loss (3).

Dropout is off by default (--dropout_rate=0), so that a pair differs by float16's rounding alone. With dropout the
two runs draw different masks on the CPU: fp16 pads lengths to multiples of 16 there (as bf16 does: oneDNN keeps a
kernel per shape), and a mask is drawn for every padded position, so from the first step on the runs train on
different noise, as two seeds would.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from bench.harness import run_child, trainer
from config import SHIPPED_CORPORA


def train(out: Path, precision: str, args: list[str]) -> dict:
    done = run_child(trainer("train", f"--output_dir={out}", f"--mixed_precision={precision}",
                             "--eval_generate=False", "--eval_steps=0", "--save_steps=0", *args))
    if done.rc:
        raise SystemExit(f"{out.name} failed:\n{done.output[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train_records = [r for r in records if r["event"] == "train"]
    return {"eval_loss": [r["eval_loss"] for r in records if r["event"] == "eval"][-1],
            "skips": sum(r["event"] == "scaler_skip" for r in records),
            "nonfinite": sum(r["event"] == "nonfinite_step" for r in records),
            "loss_scale": train_records[-1].get("loss_scale") if train_records else None}


def overflowing(best: Path, folder: Path, eval_file: str) -> float:
    """A copy of ``best`` whose ``wo`` weights are scaled so their outputs reach ~2e5; returns the scale."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer, T5ForConditionalGeneration

    model = T5ForConditionalGeneration.from_pretrained(best)
    tokenizer = AutoTokenizer.from_pretrained(best)
    rows = [json.loads(line) for line in Path(eval_file).read_text(encoding="utf-8").splitlines()[:16]]
    texts = [next(iter(r.values())) for r in rows]
    inputs = tokenizer(texts, return_tensors="pt", padding=True, truncation=True, max_length=64)
    seen = []
    for name, module in model.named_modules():
        if name.endswith("DenseReluDense.wo"):
            module.register_forward_hook(lambda _m, _i, out: seen.append(out.abs().max().item()))
    with torch.no_grad():
        model.encoder(**inputs)
    scale = 2e5 / max(seen)
    shutil.copytree(best, folder)
    weights = load_file(folder / "model.safetensors")
    for name, tensor in weights.items():
        if name.endswith("DenseReluDense.wo.weight"):
            tensor.mul_(scale)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return scale


def pair(root: Path, name: str, args: list[str]) -> dict:
    runs = {p: train(root / f"{name}-{p}", p, args) for p in ("no", "fp16")}
    ratio = runs["fp16"]["eval_loss"] / runs["no"]["eval_loss"]
    print(f"{name:28} float32 {runs['no']['eval_loss']:.4f}  fp16 {runs['fp16']['eval_loss']:.4f}  "
          f"ratio {ratio:.4f}  scale skips {runs['fp16']['skips']}  non-finite {runs['fp16']['nonfinite']}  "
          f"final scale {runs['fp16']['loss_scale']}", flush=True)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--accumulation", type=int, default=16)
    parser.add_argument("--dropout_rate", type=float, default=0.0)
    parser.add_argument("--overflowing", default="tiny", help="the presets whose overflowing model is trained too")
    args = parser.parse_args()
    common = [f"--gradient_accumulation_steps={args.accumulation}", "--logging_steps=10", "--warmup_steps=10",
              f"--dropout_rate={args.dropout_rate}"]
    with tempfile.TemporaryDirectory(prefix="fp16-bench-") as tmp:
        root = Path(tmp)
        for preset in args.presets.split(","):
            pair(root, f"{preset} pretraining", [f"--model_preset={preset}", f"--max_steps={args.steps}", *common])
            best = root / f"{preset} pretraining-no" / "best"
            sft = ["--is_finetune=True", f"--init_from={best}", f"--max_steps={args.steps}", *common]
            pair(root, f"{preset} SFT", sft)
            if preset not in args.overflowing.split(","):
                continue
            big = root / f"{preset}-overflowing"
            scale = overflowing(best, big, str(SHIPPED_CORPORA["sft"][1]))
            print(f"  (wo scaled by {scale:.0f}: outputs ~2e5, past float16's 65,504)")
            pair(root, f"{preset} SFT, overflowing", ["--is_finetune=True", f"--init_from={big}",
                                                      f"--max_steps={2 * args.steps}", *common])


if __name__ == "__main__":
    main()
