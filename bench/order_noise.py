"""The float noise floor of a short training run: how far two runs of the same maths end apart when only
the order of their additions differs.

    python -m bench.order_noise                                    # small preset, 6 steps, shipped chat rows
    python -m bench.order_noise --preset=tiny --steps=8 --train_file=rows.jsonl
    python -m bench.order_noise --feed_forward_proj=relu                 # the original T5's feed-forward

Plain transformers and torch, none of the trainer: a T5 of the preset from one seed (dropout 0, fp32),
windows of 32 rows of ``--train_file`` taken in file order, the loss summed over target tokens and divided
by the window's count (as the trainer normalises it), clipping at 1.0, the trainer's warmup (30 steps to
3e-3) and either torch's AdamW or the trainer's Adafactor. Runs per optimizer:
- the reference: micro-batch 2 x 16 accumulation steps;
- ``--orders`` runs of the same micro-batches of 2, each window's micro-batches taken in a random order
  and the two rows of each swapped at random: the same pairs, the same padded shapes, the same gradient,
  added up in another order;
- the same micro-batches of 2 in the same order, each padded to a multiple of 16 tokens: padding is
  masked out of attention and the loss, so this too is the same maths, in matrix products of other shapes;
- micro-batch 16 x 2 (what the throughput issue compares; FSDP or ZeRO against DDP change the order of
  the sums too, in other places).
Printed: the largest weight difference from the reference after each step. The reordered and padded runs
are the floor: no batching or engine can be expected to end closer to the reference than the same
computation with its additions reordered or its shapes changed.
Figures: docs/throughput.md ("The noise floor").
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from bench.harness import REPO, Column, Table
from data.collate import pad
from lowmem.training.optim import Adafactor
from lowmem.utils.presets import FEED_FORWARD_WIDTHS, MODEL_PRESETS, preset_shape

WINDOW, PEAK_LR, WARMUP = 32, 3e-3, 30


def token_rows(path: Path, count: int) -> tuple[list[tuple[list[int], list[int]]], int]:
    """The first ``count`` rows of ``path`` as token ids (the shipped tokenizer), and its vocabulary size."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(REPO / "data/tokenizer/tokenizer.json"))
    rows = []
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            if len(rows) == count:
                break
            row = json.loads(line)
            rows.append(tuple(tokenizer(row[k], add_special_tokens=False)["input_ids"][:127] + [1]
                              for k in ("prompt", "response")))
    return rows, len(tokenizer)


def train(rows: list, vocab: int, shape: dict, optimizer: str, micro: int, steps: int,
          multiple: int = 1) -> list[dict]:
    """The weights after each step."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(vocab_size=vocab, decoder_start_token_id=0, pad_token_id=0,
                                                eos_token_id=1, dropout_rate=0.0, **shape))
    opt = (Adafactor(model.parameters(), lr=PEAK_LR) if optimizer == "adafactor"
           else torch.optim.AdamW(model.parameters(), lr=PEAK_LR, weight_decay=0.0))
    weights = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = PEAK_LR * (step + 1) / (WARMUP + 1)
        window = rows[step * WINDOW:(step + 1) * WINDOW]
        targets = sum(len(t) for _, t in window)
        for start in range(0, WINDOW, micro):
            part = window[start:start + micro]
            source, mask = pad([s for s, _ in part], 0, multiple)
            labels, _ = pad([t for _, t in part], -100, multiple)
            logits = model(input_ids=source, attention_mask=mask, labels=labels).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
            (loss / targets).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        weights.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return weights


def reordered(rows: list, seed: int) -> list:
    """Each window's pairs in a random order, the two rows of each pair swapped at random."""
    rng, result = random.Random(seed), []
    for start in range(0, len(rows), WINDOW):
        pairs = [rows[i:i + 2] for i in range(start, start + WINDOW, 2)]
        rng.shuffle(pairs)
        result += [row for pair in pairs for row in (pair[::-1] if rng.random() < 0.5 else pair)]
    return result


def largest_difference(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", choices=sorted(MODEL_PRESETS))
    parser.add_argument("--feed_forward_proj", default="gated-gelu", choices=sorted(FEED_FORWARD_WIDTHS))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--train_file", default=str(REPO / "data/chatterbot/train.jsonl"))
    parser.add_argument("--optimizers", default="adafactor,adamw")
    parser.add_argument("--orders", type=int, default=3, help="reordered runs per optimizer")
    options = parser.parse_args()
    rows, vocab = token_rows(Path(options.train_file), WINDOW * options.steps)
    if len(rows) < WINDOW * options.steps:
        raise SystemExit(f"error: --train_file has {len(rows)} rows; {WINDOW * options.steps} are needed")
    shape = preset_shape(options.preset, options.feed_forward_proj)
    print(f"{options.preset} preset ({options.feed_forward_proj}), {options.steps} steps of {WINDOW} rows from "
          f"{options.train_file}")
    steps = [f"step {s + 1}" for s in range(options.steps)]
    table = Table([Column("optimizer", "optimizer"), Column("run", "run"), *(Column(s, s, ".1e") for s in steps)],
                  markdown=True, stream=True)
    for optimizer in options.optimizers.split(","):
        reference = train(rows, vocab, shape, optimizer, 2, options.steps)
        runs = [(f"2 x 16 reordered ({seed})", reordered(rows, seed), 2, 1) for seed in range(options.orders)]
        for name, run_rows, micro, multiple in [*runs, ("2 x 16 padded to 16s", rows, 2, 16), ("16 x 2", rows, 16, 1)]:
            other = train(run_rows, vocab, shape, optimizer, micro, options.steps, multiple)
            gaps = {s: largest_difference(a, b) for s, a, b in zip(steps, reference, other)}
            table.add(f"{optimizer} {name}", {"optimizer": optimizer, "run": name, **gaps})


if __name__ == "__main__":
    main()
