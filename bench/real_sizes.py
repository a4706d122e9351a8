"""flan-t5-large / -xl / -xxl shapes on this machine: planned and measured peaks, step times, folder sizes.

    python -m bench.real_sizes --root=/work/big                        # large and xl, the default configurations
    python -m bench.real_sizes --root=/work/big --only=xxl-lora-int8   # one configuration
    python -m bench.real_sizes --root=/work/big --plan_only            # the plans alone (seconds)

Each model folder is a hub-shaped checkpoint with random weights, written by ``bench/hub_checkpoint.py`` (one
tensor at a time) under ``--root`` when it is not there yet: large and xl in float32 (the hub's dtype; xl in
two ~9.5 GB shards), xxl in bfloat16 (three shards). Each configuration is a real ``train_low_mem.py train``
run in its own process, SFT on the shipped chat pairs: the prediction is the run's ``memory_plan`` record, the
measurement its peak RSS (the kernel's high-water mark); the step time is the mean of the steps after the
first; the checkpoint and final/ sizes are what the run wrote. Remove the folders when done (xxl: 22 GB).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from bench.harness import run_child, trainer
from bench.hub_checkpoint import build_checkpoint

FOLDERS = {"large": ("large", "float32"), "xl": ("xl", "float32"), "xxl": ("xxl", "bfloat16")}
SHARD_BYTES = int(9.5e9)
# A short run: two optimizer steps of two rows, the eval loss only on 8 rows, a checkpoint and final/ written
RUN = ["--is_finetune=True", "--max_steps=3", "--batch_size=2", "--gradient_accumulation_steps=1", "--eval_steps=0",
       "--eval_generate=False", "--max_eval_samples=8", "--save_steps=0", "--logging_steps=1", "--warmup_steps=0"]
CONFIGS = {
    "large-full": ("large", ["--freeze=none"]),
    "large-lora-fp32": ("large", ["--lora_r=8"]),
    "large-lora-int8": ("large", ["--lora_r=8", "--frozen_dtype=int8"]),
    "xl-lora-int8": ("xl", ["--lora_r=8", "--frozen_dtype=int8"]),
    "xxl-lora-int8": ("xxl", ["--lora_r=8", "--frozen_dtype=int8"]),
}
DEFAULT = ("large-full", "large-lora-fp32", "large-lora-int8", "xl-lora-int8")


def model_folder(root: Path, name: str) -> Path:
    """The hub-shaped folder of ``name`` under ``root``, built when missing."""
    folder = root / name
    if not (folder / "config.json").is_file():
        shape, dtype = FOLDERS[name]
        print(build_checkpoint(folder, shape, dtype, SHARD_BYTES))
    return folder


def folder_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def run(name: str, folder: Path, flags: list[str], out: Path) -> dict:
    """One training run; its planned and measured peak, step time and the sizes it wrote."""
    done = run_child(trainer("train", f"--init_from={folder}", f"--output_dir={out}", *RUN, *flags), cwd=Path.cwd())
    if done.rc:
        return {"config": name, "error": done.tail(1)}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    peak = next(r for r in records if r.get("event") == "memory_peak")
    steps = [r["step_s"] for r in records if r.get("event") == "train" and r.get("step", 0) > 1]
    checkpoint = sorted((out / "checkpoints").glob("step_*"))[-1]
    return {"config": name, "planned_mb": peak["predicted_host_peak_mb"], "measured_mb": peak["measured_host_peak_mb"],
            "ratio": peak["host_ratio"], "step_s": round(sum(steps) / max(len(steps), 1), 1),
            "checkpoint_mb": round(folder_mb(checkpoint), 1), "final_mb": round(folder_mb(out / "final"), 1)}


def plan(name: str, folder: Path, flags: list[str]) -> dict:
    done = run_child(trainer("plan", "--json=True", f"--init_from={folder}", *RUN, *flags), cwd=Path.cwd())
    if done.rc:
        return {"config": name, "error": done.tail(1)}
    result = done.last_json()
    return {"config": name, "planned_mb": result["host_peak_mb"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, required=True, help="where the model folders are (or are built)")
    parser.add_argument("--only", default=",".join(DEFAULT), help="comma list of " + ", ".join(CONFIGS))
    parser.add_argument("--plan_only", action="store_true")
    args = parser.parse_args()
    for name in args.only.split(","):
        model, flags = CONFIGS[name]
        folder = model_folder(args.root, model)
        if args.plan_only:
            print(json.dumps(plan(name, folder, flags)), flush=True)
            continue
        with tempfile.TemporaryDirectory(dir=args.root) as tmp:
            print(json.dumps(run(name, folder, flags, Path(tmp) / "run")), flush=True)


if __name__ == "__main__":
    main()
