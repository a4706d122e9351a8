"""Model FLOPs utilisation: this trainer, a plain PyTorch loop and the device's matrix-product peak, side by side.

    python bench/mfu.py                        # small and base presets, span corruption 128 -> 29, micro-batch 8
    python bench/mfu.py --presets=small --steps=4 --rounds=1     # a quick look
    python bench/mfu.py --large                # also flan-t5-large's shape, LoRA r=8, int8 against float32 frozen

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
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from int8_step import train_records  # this folder is on sys.path when the script runs
from plain_loop import text_corpus

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
MICRO, SOURCE, TARGET = 8, 128, 29  # span corruption of 128-token chunks at 15 % noise, mean span 3


def trainer_run(flags: list[str], out: Path, steps: int) -> dict:
    """One trainer process stopped after ``steps`` logged steps: median FLOP/s, MFU and seconds of the steps after
    the first (compilation of kernels, pages of the weights read in)."""
    command = [sys.executable, str(REPO / "train_low_mem.py"), "train", f"--output_dir={out}", f"--max_steps={steps}",
               "--logging_steps=1", "--eval_steps=0", "--save_steps=0", "--max_eval_samples=2",
               "--eval_generate=False", "--overwrite_output_dir=True", *flags]
    log = out.with_suffix(".log")
    with open(log, "w") as sink:
        process = subprocess.Popen(command, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT)
        while len(train_records(out)) < steps and process.poll() is None:
            time.sleep(0.2)
        records = train_records(out)
        if process.poll() is None:
            process.kill()  # the final evaluation and exports are not what is measured
        process.wait()
    if len(records) < steps:
        raise SystemExit(f"trainer run failed:\n{log.read_text()[-3000:]}")
    shutil.rmtree(out, ignore_errors=True)
    log.unlink()
    timed = records[1:]
    return {key: statistics.median(r[key] for r in timed) for key in ("flops_per_s", "mfu", "step_s")}


def plain_loop(preset: str, steps: int) -> None:
    """The hand-written loop (in its own process): prints its median FLOP/s of the steps after the first."""
    import torch
    from transformers import AutoTokenizer, T5Config, T5ForConditionalGeneration
    from transformers.optimization import Adafactor

    from config import SHIPPED_TOKENIZER_DIR
    from lowmem.model.presets import preset_shape
    from lowmem.monitoring.flops import StepFlops

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(str(SHIPPED_TOKENIZER_DIR))
    config = T5Config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                      eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id,
                      tie_word_embeddings=False, **preset_shape(preset, "gated-gelu"))
    model = T5ForConditionalGeneration(config).train()
    optimizer = Adafactor(model.parameters(), lr=3e-3, relative_step=False, scale_parameter=False, warmup_init=False)
    batch = {"input_ids": torch.randint(2, len(tokenizer), (MICRO, SOURCE)),
             "attention_mask": torch.ones(MICRO, SOURCE, dtype=torch.long),
             "labels": torch.randint(2, len(tokenizer), (MICRO, TARGET))}
    flops = StepFlops.of(model).micro_batch(batch, frozen_encoder=False)
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        seconds.append(time.perf_counter() - start)
    print(json.dumps({"flops_per_s": flops / statistics.median(seconds[1:]), "step_s": statistics.median(seconds[1:])}))


def plain_run(preset: str, steps: int) -> dict:
    done = subprocess.run([sys.executable, __file__, f"--plain={preset}", f"--steps={steps}"], cwd=REPO, check=True,
                          capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def presets(args, tmp: Path, peak: float) -> None:
    corpus = text_corpus(tmp)
    print(f"{'preset':<8}{'trainer GFLOP/s':>17}{'plain GFLOP/s':>15}{'trainer / plain':>17}{'trainer MFU':>13}"
          f"{'plain MFU':>11}")
    for preset in args.presets.split(","):
        flags = [f"--model_preset={preset}", "--objective=span_corruption", f"--train_file={corpus}",
                 f"--max_source_len={SOURCE}", f"--batch_size={MICRO}", "--gradient_accumulation_steps=1"]
        trainer, plain = [], []
        for _ in range(args.rounds):
            trainer.append(trainer_run(flags, tmp / "run", args.steps)["flops_per_s"])
            plain.append(plain_run(preset, args.steps)["flops_per_s"])
        mine, theirs = statistics.median(trainer), statistics.median(plain)
        print(f"{preset:<8}{mine / 1e9:>17.1f}{theirs / 1e9:>15.1f}{mine / theirs:>17.2f}{mine / peak:>13.3f}"
              f"{theirs / peak:>11.3f}", flush=True)


def large_lora(args, tmp: Path, peak: float) -> None:
    """flan-t5-large's shape, LoRA r=8 on q and v, micro-batch 2 of the shipped chat pairs: int8 against float32."""
    from hub_checkpoint import build_checkpoint  # this folder is on sys.path when the script runs

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
