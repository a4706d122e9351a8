"""Predicted versus measured peak RSS for random combinations of flags (the planner's blind test).

    python -m bench.planner_sweep                      # 20 configurations, seed 1
    python -m bench.planner_sweep --runs=40 --seed=7 --presets=tiny,small
    python -m bench.planner_sweep --seed=60 --profile_share=0.5   # half the runs use a --memory_profile

bench/memory_modes.py times a fixed list of configurations; this draws them at random, as a user
would combine flags: preset, corpus (short or long rows, jsonl, csv, parquet, a folder, prompts
several times their answers), pretraining or SFT, micro-batch, accumulation, sequence limits,
checkpointing, bf16, the optimizer, LoRA or the encoder cache, evaluation with generation,
checkpoint saves, the shuffle buffer and the schedule. With ``--profile_share=F`` a fraction F of the
runs instead take their batch, accumulation, checkpointing, precision and optimizer from a random
``--memory_profile``, as a user who picks one would (a separate random stream, so a seed draws the
same other flags with any F). Each is a real ``train_low_mem.py train`` run
of a few optimizer steps; the prediction is the ``memory_plan`` it wrote at start, the measurement
its peak RSS. One line per run (JSON), then the range of the ratios. Target: every ratio within
0.85-1.15.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import tempfile
from pathlib import Path

from bench.make_corpus import load_sources
from bench.memory_modes import make_corpora, measure, run
from lowmem.utils.presets import MEMORY_PROFILES


def more_corpora(folder: Path, made: dict) -> dict:
    """The shipped chat pairs as csv, and the long rows split over a folder of three jsonl files."""
    rows = load_sources()["chat"]
    with open(folder / "chat.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["prompt", "response"])
        writer.writeheader()
        writer.writerows(rows)
    parts = folder / "parts"
    parts.mkdir()
    lines = made["long"].read_text().splitlines(keepends=True)
    for k in range(3):
        (parts / f"part{k}.jsonl").write_text("".join(lines[k::3]))
    return {**made, "csv": folder / "chat.csv", "folder": parts}


def draw(rng: random.Random, presets: list[str]) -> tuple[str, str, bool, list[str]]:
    """(preset, corpus, is SFT, flags) of one random configuration."""
    preset = rng.choice(presets)
    kind = rng.choice(["short", "long", "sft", "sft_long", "docs", "csv", "folder"])
    sft = kind.startswith("sft") or (kind in ("docs", "csv", "folder") and rng.random() < 0.5)
    flags = [f"--gradient_accumulation_steps={rng.choice([1, 2, 4, 8])}", f"--batch_size={rng.choice([1, 2])}"]
    if rng.random() < 0.5:
        flags += [f"--max_source_len={rng.choice([32, 64, 256, 512])}",
                  f"--max_target_len={rng.choice([32, 64, 128, 256])}"]
    if rng.random() < 0.3:
        flags.append("--gradient_checkpointing=True")
    bf16 = rng.random() < 0.25
    if bf16:
        flags.append("--mixed_precision=bf16")
    optimizer = rng.choice(["adafactor", "adafactor", "adamw", "adamw8bit"])
    flags += [f"--optimizer={optimizer}"] + (["--learn_rate=1e-3"] if optimizer != "adafactor" else [])
    if rng.random() < 0.5:  # evaluation (loss and generation for BLEU) every few steps
        flags += [f"--eval_steps={rng.choice([2, 3])}", f"--max_eval_samples={rng.choice([8, 20, 50])}",
                  f"--eval_batch_size={rng.choice([1, 2, 4])}"]
    else:
        flags += ["--eval_steps=0", "--max_eval_samples=8"]
    flags.append(f"--save_steps={3 if rng.random() < 0.3 else 0}")
    if rng.random() < 0.2:
        flags.append(f"--shuffle_buffer_size={rng.choice([10, 1000, 20000])}")
    if rng.random() < 0.2:
        flags.append("--lr_scheduler=cosine")
    if sft:
        if rng.random() < 0.35:
            flags += [f"--lora_r={rng.choice([4, 8, 16])}",
                      f"--lora_target_modules={rng.choice(['q,v', 'q,k,v,o', 'wi,wo', 'q,v,wi'])}"]
        elif rng.random() < 0.5:
            flags += [f"--encoder_cache={rng.choice(['memory', 'disk'])}",
                      f"--encoder_cache_dtype={rng.choice(['float32', 'bfloat16'])}"]
        if bf16 and rng.random() < 0.5:
            flags.append("--frozen_dtype=bfloat16")
    return preset, kind, sft, flags


def with_profile(rng: random.Random, flags: list[str]) -> list[str]:
    """The flags with those a random memory profile sets replaced by the profile (and the drawn
    learning rate and frozen-weight dtype, which went with the drawn optimizer and precision)."""
    name = rng.choice(sorted(MEMORY_PROFILES))
    dropped = tuple(f"--{key}=" for key in [*MEMORY_PROFILES[name], "learn_rate", "frozen_dtype"])
    return [f"--memory_profile={name}", *(flag for flag in flags if not flag.startswith(dropped))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20, help="configurations to draw")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--presets", default="tiny,tiny,small,small,base", help="drawn from (repeat to weight)")
    parser.add_argument("--profile_share", type=float, default=0.0,
                        help="fraction of runs that use a random --memory_profile instead of drawn shape flags")
    options = parser.parse_args()
    rng = random.Random(options.seed)
    profile_rng = random.Random(f"profiles {options.seed}")
    presets = options.presets.split(",")
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpora = more_corpora(tmp, make_corpora(tmp))
        inits = {}
        for i in range(options.runs):
            preset, kind, sft, flags = draw(rng, presets)
            if profile_rng.random() < options.profile_share:
                flags = with_profile(profile_rng, flags)
            data = [f"--model_preset={preset}", f"--train_file={corpora[kind]}"]
            if sft:
                if preset not in inits:  # a pretrained model to fine-tune (one step is enough)
                    inits[preset] = tmp / f"init_{preset}"
                    run([*data, f"--output_dir={inits[preset]}", "--max_steps=1", "--gradient_accumulation_steps=1",
                         "--eval_steps=0", "--max_eval_samples=2"])
                data += ["--is_finetune=True", f"--init_from={inits[preset]}/final"]
            steps = 4 if preset == "base" else 6
            out = tmp / f"run{i}"
            run([*data, *flags, f"--max_steps={steps}", "--logging_steps=1", f"--output_dir={out}"])
            result = measure(out)
            ratios.append(result["ratio"])
            print(json.dumps({"preset": preset, "corpus": kind, "sft": sft, "flags": flags,
                              "predicted_mb": result["predicted"], "measured_mb": result["measured"],
                              "ratio": result["ratio"]}), flush=True)
    within = sum(0.85 <= r <= 1.15 for r in ratios)
    print(f"{within} of {len(ratios)} predictions within +-15% (ratios {min(ratios):.2f} to {max(ratios):.2f})")


if __name__ == "__main__":
    main()
