"""This trainer's peak host RAM beside a plain PyTorch loop with the same model, batch and optimizer.

    python bench/plain_loop.py                       # base preset, --memory_profile=host16g, 5 optimizer steps
    python bench/plain_loop.py --preset=small --steps=10

Two pretraining jobs, each run twice in its own process, one after the other:

    shipped   the default pretraining data (data/pinyin): short rows, the micro-batches of real rows tokenized
    text      span corruption (--objective=span_corruption) on raw text made from the shipped chat pairs:
              every micro-batch 128 source and 29 target tokens

The plain loop is what one writes by hand: ``T5ForConditionalGeneration`` built from the same ``T5Config``,
transformers' ``Adafactor(lr=3e-3, relative_step=False, scale_parameter=False, warmup_init=False)`` (what
this trainer's Adafactor computes), micro-batches of 2 and 16 backward passes per optimizer step, the loss
divided by 16, ``zero_grad()`` after each step; no evaluation, no checkpoint. This trainer runs as a user
runs it (``train_low_mem.py train --memory_profile=host16g``), evaluating and saving as configured.
Measured: each process's peak RSS (the kernel's ``ru_maxrss`` of that child, the whole run), and the ratio
trainer / plain loop (target: <= 1.10).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MICRO, ACCUMULATION = 2, 16
SPAN_SHAPE = (128, 29)  # span corruption of 128-token chunks at 15 % noise: every micro-batch's shape


def peak_mib(command: list[str]) -> float:
    """Run ``command``; its peak RSS in MiB (fails loudly if it fails)."""
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    if status != 0:
        sys.exit(f"{' '.join(command[:4])} ... failed:\n{output[-2000:]}")
    return usage.ru_maxrss / 1024


def plain_loop(preset: str, steps: int, job: str) -> None:
    """The hand-written loop (run in its own process by ``main``)."""
    import torch
    from transformers import AutoTokenizer, T5Config, T5ForConditionalGeneration
    from transformers.optimization import Adafactor

    sys.path.insert(0, str(REPO))
    from config import SHIPPED_TOKENIZER_DIR
    from lowmem.model.presets import preset_shape

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(str(SHIPPED_TOKENIZER_DIR))
    config = T5Config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                      eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id,
                      tie_word_embeddings=True, **preset_shape(preset, "gated-gelu"))
    model = T5ForConditionalGeneration(config).train()
    optimizer = Adafactor(model.parameters(), lr=3e-3, relative_step=False, scale_parameter=False, warmup_init=False)
    rows = [json.loads(line) for line in itertools.islice(open(REPO / "data/pinyin/train.jsonl", encoding="utf-8"),
                                                           steps * ACCUMULATION * MICRO)]

    def micro_batch(i: int) -> dict:
        if job == "text":
            source, target = (torch.randint(2, len(tokenizer) - 100, (MICRO, n)) for n in SPAN_SHAPE)
            return {"input_ids": source, "attention_mask": torch.ones_like(source), "labels": target}
        chunk = rows[i * MICRO:(i + 1) * MICRO]
        batch = tokenizer([r["prompt"] for r in chunk], return_tensors="pt", padding=True)
        labels = tokenizer([r["response"] for r in chunk], return_tensors="pt", padding=True).input_ids
        return {**batch, "labels": labels.masked_fill(labels == tokenizer.pad_token_id, -100)}

    for step in range(steps):
        for k in range(ACCUMULATION):
            (model(**micro_batch(step * ACCUMULATION + k)).loss / ACCUMULATION).backward()
        optimizer.step()
        optimizer.zero_grad()


def text_corpus(folder: Path) -> Path:
    """Raw text made from the shipped chat pairs, one document per line."""
    path = folder / "corpus.txt"
    with open(REPO / "data/chatterbot/train.jsonl", encoding="utf-8") as rows, open(path, "w", encoding="utf-8") as out:
        for line in rows:
            row = json.loads(line)
            out.write(f"{row['prompt']} {row['response']}\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="base")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--plain", choices=["shipped", "text"], help=argparse.SUPPRESS)  # the loop's own process
    args = parser.parse_args()
    if args.plain:
        plain_loop(args.preset, args.steps, args.plain)
        return
    with tempfile.TemporaryDirectory() as tmp:
        jobs = {"shipped": [], "text": ["--objective=span_corruption", f"--train_file={text_corpus(Path(tmp))}"]}
        for job, flags in jobs.items():
            ours = peak_mib([sys.executable, "train_low_mem.py", "train", f"--model_preset={args.preset}",
                             "--memory_profile=host16g", f"--max_steps={args.steps}",
                             f"--output_dir={tmp}/{job}", *flags])
            plain = peak_mib([sys.executable, __file__, f"--preset={args.preset}", f"--steps={args.steps}",
                              f"--plain={job}"])
            print(json.dumps({"job": job, "preset": args.preset, "steps": args.steps, "trainer_mib": round(ours),
                              "plain_loop_mib": round(plain), "ratio": round(ours / plain, 3),
                              "target": "<= 1.10"}), flush=True)


if __name__ == "__main__":
    main()
