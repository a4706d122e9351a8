"""Model FLOPs utilisation: this trainer, a plain PyTorch loop and the device's matrix-product peak, side by side.

    python -m bench.mfu                        # small and base presets, span corruption 128 -> 29, micro-batch 8
    python -m bench.mfu --presets=small --steps=4 --rounds=1     # a quick look
    python -m bench.mfu --large                # also flan-t5-large's shape, LoRA r=8, int8 against float32 frozen

Each configuration runs in processes of its own, alternating ``--rounds`` times so load on the machine falls on all:

- trainer: ``train_low_mem.py train`` as a user runs it (span corruption of 128-token chunks of raw text made from the
  shipped chat pairs: every micro-batch 8 x 128 source and 8 x 29 target tokens; float32; Adafactor), stopped once it
  has logged ``--steps`` steps; its FLOP/s and MFU are its train records' (``flops_per_s``, ``mfu``), median of the
  steps after the first.
- plain loop: what one writes by hand: ``T5ForConditionalGeneration`` from the same ``T5Config``, transformers'
  ``Adafactor(lr=3e-3, relative_step=False, scale_parameter=False, warmup_init=False)``, batches of the same shapes,
  ``loss.backward(); step(); zero_grad()``; its FLOPs counted by the same formula (``lowmem.monitoring.flops``).
- peak: this CPU's float32 matrix-product rate, the higher of one measured now (``lowmem.hardware.cpu_probe``) and the
  cached one the trainer divides by.

Prints FLOP/s, MFU and trainer / plain loop per preset (target: >= 0.9) and, with ``--large``, int8 / float32.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path

from bench.harness import Column, Table, Timer, module, run_child, trainer
from bench.hub_checkpoint import build_checkpoint
from bench.int8_step import StepWatch
from bench.plain_loop import plain_setup, text_corpus

MICRO, SOURCE, TARGET = 8, 128, 29  # span corruption of 128-token chunks at 15 % noise, mean span 3


def trainer_run(flags: list[str], out: Path, steps: int) -> dict:
    """One trainer process stopped after ``steps`` logged steps: median FLOP/s, MFU and seconds of the steps after
    the first (compilation of kernels, pages of the weights read in)."""
    command = trainer("train", f"--output_dir={out}", f"--max_steps={steps}", "--logging_steps=1", "--eval_steps=0",
                      "--save_steps=0", "--max_eval_samples=2", "--eval_generate=False", "--overwrite_output_dir=True",
                      *flags)
    watch = StepWatch(out, steps)  # stops the run there: the final evaluation and exports are not what is measured
    run = run_child(command, watch=watch, every=0.2)
    records = watch.records
    if len(records) < steps:
        raise SystemExit(f"trainer run failed:\n{run.output[-3000:]}")
    shutil.rmtree(out, ignore_errors=True)
    timed = records[1:]
    return {key: statistics.median(r[key] for r in timed) for key in ("flops_per_s", "mfu", "step_s")}


def plain_loop(preset: str, steps: int) -> None:
    """The hand-written loop (in its own process): prints its median FLOP/s of the steps after the first."""
    import torch

    from lowmem.monitoring.flops import StepFlops

    tokenizer, model, optimizer = plain_setup(preset, tied=False)
    batch = {"input_ids": torch.randint(2, len(tokenizer), (MICRO, SOURCE)),
             "attention_mask": torch.ones(MICRO, SOURCE, dtype=torch.long),
             "labels": torch.randint(2, len(tokenizer), (MICRO, TARGET))}
    flops = StepFlops.of(model).micro_batch(batch, frozen_encoder=False)
    timer = Timer()
    for _ in range(steps):
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        timer.lap()
    seconds = timer.laps
    print(json.dumps({"flops_per_s": flops / statistics.median(seconds[1:]), "step_s": statistics.median(seconds[1:])}))


def plain_run(preset: str, steps: int) -> dict:
    done = run_child(module("bench.mfu", plain=preset, steps=steps))
    if done.rc:
        raise SystemExit(f"plain loop failed:\n{done.output[-3000:]}")
    return done.last_json()


def presets(args, tmp: Path, peak: float) -> None:
    corpus = text_corpus(tmp)
    table = Table([Column("preset", "name", width=6), Column("trainer GFLOP/s", "mine", ".1f"),
                   Column("plain GFLOP/s", "theirs", ".1f"), Column("trainer / plain", "ratio", ".2f"),
                   Column("trainer MFU", "mine_mfu", ".3f"), Column("plain MFU", "theirs_mfu", ".3f")], stream=True)
    for preset in args.presets.split(","):
        flags = [f"--model_preset={preset}", "--objective=span_corruption", f"--train_file={corpus}",
                 f"--max_source_len={SOURCE}", f"--batch_size={MICRO}", "--gradient_accumulation_steps=1"]
        ours, plain = [], []
        for _ in range(args.rounds):
            ours.append(trainer_run(flags, tmp / "run", args.steps)["flops_per_s"])
            plain.append(plain_run(preset, args.steps)["flops_per_s"])
        mine, theirs = statistics.median(ours), statistics.median(plain)
        table.add(preset, {"mine": mine / 1e9, "theirs": theirs / 1e9, "ratio": mine / theirs, "mine_mfu": mine / peak,
                           "theirs_mfu": theirs / peak})


def large_lora(args, tmp: Path, peak: float) -> None:
    """flan-t5-large's shape, LoRA r=8 on q and v, micro-batch 2 of the shipped chat pairs: int8 against float32."""
    init = Path(args.init_from) if args.init_from else Path(build_checkpoint(tmp / "large", "large")["folder"])
    found = {"float32": [], "int8": []}
    for _ in range(args.rounds):
        for frozen, kept in found.items():
            flags = ["--is_finetune=True", f"--init_from={init}", "--lora_r=8", "--learn_rate=1e-3",
                     f"--frozen_dtype={frozen}", "--batch_size=2", "--gradient_accumulation_steps=1"]
            kept.append(trainer_run(flags, tmp / "run", args.steps))
    for frozen, runs in found.items():
        rate = statistics.median(r["flops_per_s"] for r in runs)
        print(f"large LoRA r=8 {frozen:>7}: {rate / 1e9:.1f} GFLOP/s, MFU {rate / peak:.3f}, "
              f"{statistics.median(r['step_s'] for r in runs):.2f} s/step")
    step = {k: statistics.median(r["step_s"] for r in runs) for k, runs in found.items()}
    print(f"large LoRA r=8 int8 / float32 step time: {step['int8'] / step['float32']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", default="small,base")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run (the first untimed)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each configuration, alternating")
    parser.add_argument("--large", action="store_true", help="also flan-t5-large's shape, LoRA int8 vs float32")
    parser.add_argument("--init_from", help="with --large: a model folder to train instead of a new one (kept)")
    parser.add_argument("--plain", help=argparse.SUPPRESS)  # the plain loop's own process
    args = parser.parse_args()
    if args.plain:
        return plain_loop(args.plain, args.steps)
    import torch

    from lowmem.hardware.cpu_probe import measure_cpu
    from lowmem.hardware.probe import capability

    now, cached = measure_cpu()["float32"], capability("cpu").peak(torch.float32)
    peak = max(now, cached)  # as the trainer's: the highest rate seen (a loaded moment measures less)
    print(f"{capability('cpu').name}: float32 peak {peak / 1e9:.1f} GFLOP/s ({now / 1e9:.1f} measured now, "
          f"{cached / 1e9:.1f} cached: what the trainer's MFU divides by)")
    with tempfile.TemporaryDirectory(prefix="mfu_") as tmp:
        if args.presets:
            presets(args, Path(tmp), peak)
        if args.large:
            large_lora(args, Path(tmp), peak)


if __name__ == "__main__":
    main()
