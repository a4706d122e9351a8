"""This trainer's peak host RAM beside a plain PyTorch loop with the same model, batch and optimizer.

    python -m bench.plain_loop                       # base preset, --memory_profile=host16g, 5 optimizer steps
    python -m bench.plain_loop --preset=small --steps=10

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
import sys
import tempfile
from pathlib import Path

from bench.harness import REPO, module, run_child, trainer

MICRO, ACCUMULATION = 2, 16
SPAN_SHAPE = (128, 29)  # span corruption of 128-token chunks at 15 % noise: every micro-batch's shape


def peak_mib(command: list[str]) -> float:
    """Run ``command``; its peak RSS in MiB (fails loudly if it fails)."""
    done = run_child(command)
    if done.rc:
        sys.exit(f"{' '.join(command[:4])} ... failed:\n{done.output[-2000:]}")
    return done.peak_rss_mib


def plain_setup(preset: str, tied: bool):
    """What one writes by hand: the shipped tokenizer, ``T5ForConditionalGeneration`` of ``preset`` from a
    ``T5Config`` (seed 0, the head ``tied`` to the embedding or not, in training mode) and transformers' Adafactor
    at what this trainer's Adafactor computes. Returns (tokenizer, model, optimizer)."""
    import torch
    from transformers import AutoTokenizer, T5Config, T5ForConditionalGeneration
    from transformers.optimization import Adafactor

    from config import SHIPPED_TOKENIZER_DIR
    from lowmem.utils.presets import preset_shape

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(str(SHIPPED_TOKENIZER_DIR))
    config = T5Config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                      eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id,
                      tie_word_embeddings=tied, **preset_shape(preset, "gated-gelu"))
    model = T5ForConditionalGeneration(config).train()
    optimizer = Adafactor(model.parameters(), lr=3e-3, relative_step=False, scale_parameter=False, warmup_init=False)
    return tokenizer, model, optimizer


def plain_loop(preset: str, steps: int, job: str) -> None:
    """The hand-written loop (run in its own process by ``main``)."""
    import torch

    tokenizer, model, optimizer = plain_setup(preset, tied=True)
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
            ours = peak_mib(trainer("train", f"--model_preset={args.preset}", "--memory_profile=host16g",
                                    f"--max_steps={args.steps}", f"--output_dir={tmp}/{job}", *flags))
            plain = peak_mib(module("bench.plain_loop", preset=args.preset, steps=args.steps, plain=job))
            print(json.dumps({"job": job, "preset": args.preset, "steps": args.steps, "trainer_mib": round(ours),
                              "plain_loop_mib": round(plain), "ratio": round(ours / plain, 3),
                              "target": "<= 1.10"}), flush=True)


if __name__ == "__main__":
    main()
