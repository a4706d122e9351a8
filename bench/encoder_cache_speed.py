"""SFT step time with the encoder cache versus without, measured interleaved in one process.

    python -m bench.encoder_cache_speed                          # tiny and small, six corpora
    python -m bench.encoder_cache_speed --presets=small --windows=20
    python -m bench.encoder_cache_speed --corpus=my.jsonl         # your own prompt/response jsonl
    python -m bench.encoder_cache_speed --device=cuda --mixed_precision=bf16   # on a GPU, as gpu16g trains

Timing two separate runs on a shared machine compares two moments as much as two code paths (on
the 2-core development VM the same run's step time drifted by 30 % within a minute). Here every
accumulation window is trained twice, once per path, in alternating order (ABBA), on the same
model in the same process, and the ratio is the median of the per-window ratios.

Both paths are the trainer's own: ``token_loss_sum`` with the frozen encoder running (under
``no_grad``, each row at its own length) or with ``encoder_hidden_states`` in the batch — the very
tensors the cache stores, computed here by the same ``frozen_encoder_states`` — then the backward,
gradient clipping and the Adafactor step. Collation (tokenizing, reading the cache) is left out of
both: it is under 3 % of a step (bench/profile_run.py). Micro-batch 2 x accumulation 16, the
defaults, so the numbers describe ``train --is_finetune=True`` with and without
``--encoder_cache``.

With ``--device=cuda`` both paths train on the GPU: the encoder's inputs (plain) or the cached
states (cached) are copied from the host inside the timed step, as the trainer's collator hands
them over, and the clock stops after ``torch.cuda.synchronize``. ``--threads`` sets torch's CPU
threads (intra-op), to see how the ratio moves with the cores a machine has.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import tempfile
from pathlib import Path

import torch

from bench.harness import Column, Table, Timer
from bench.memory_modes import make_corpora


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def corpora(folder: Path, extra: list[str], turns: list[int]) -> dict[str, list[dict]]:
    """The shipped chat and pinyin pairs, prompts of k chat turns for each k in ``turns`` (the
    source grows, the answer stays one reply), the long-prompt SFT corpus of bench/memory_modes.py
    (five turns in, one reply out), and any jsonl files given."""
    made = make_corpora(folder)
    out = {"chat pairs": read_jsonl(made["sft"]), "pinyin pairs": read_jsonl(made["short"])}
    pairs = out["chat pairs"]
    rng = random.Random(1)
    for k in turns:
        rows = []
        for _ in range(600):
            picked = rng.sample(pairs, k + 1)
            rows.append({"prompt": " ".join(r["prompt"] + " " + r["response"] for r in picked[:k]),
                         "response": picked[k]["response"]})
        out[f"{k}-turn prompts"] = rows
    out["long prompts"] = read_jsonl(made["sft_long"])
    out.update({Path(path).name: read_jsonl(path) for path in extra})
    return out


def measure(preset: str, rows: list[dict], windows: int, device: str = "cpu", precision: str = "no",
            seed: int = 0) -> dict:
    from config import SHIPPED_TOKENIZER_DIR
    from data.collate import Seq2SeqCollator
    from data.sources.corpus import Example
    from data.tokenization import load_tokenizer
    from lowmem.cli.flags import load_config
    from lowmem.hardware.precision import PRECISIONS
    from lowmem.model.build import build_model, freeze_parts
    from lowmem.model.loss import frozen_encoder_states, target_index, token_loss_sum
    from lowmem.training.optim import build_optimizer, parameter_groups

    cfg = load_config({"model_preset": preset, "is_finetune": True})[0]
    tokenizer = load_tokenizer(cfg.tokenizer_dir or SHIPPED_TOKENIZER_DIR)
    torch.manual_seed(seed)
    model = build_model(cfg, tokenizer).to(device)
    freeze_parts(model, "encoder")
    model.train()
    model.encoder.eval()  # frozen: no dropout, as in the trainer
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(cfg, parameter_groups(model, cfg.weight_decay))
    cuda = torch.device(device).type == "cuda"
    multiple = PRECISIONS[precision].shape_multiple(not cuda)  # bf16 on the CPU pads as the trainer does
    collator = Seq2SeqCollator(tokenizer, cfg.max_source_len, cfg.max_target_len, multiple)
    rng = random.Random(seed)
    size = cfg.batch_size * cfg.gradient_accumulation_steps

    def autocast():
        if precision == "bf16":
            return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def on_device(batch: dict) -> dict:  # as the trainer's to_device: target positions found on the host
        batch = {**batch, "target_index": target_index(batch["labels"], multiple)}
        return {k: v.to(device, non_blocking=cuda) for k, v in batch.items()}

    def encoded(batch: dict) -> torch.Tensor:  # what the cache stores for this micro-batch, on the host
        with autocast():
            on = on_device(batch)
            return frozen_encoder_states(model.encoder, on["input_ids"], on["attention_mask"], multiple).float().cpu()

    plain, cached = [], []
    for _ in range(windows + 1):  # the first window warms both paths up and is not counted
        examples = [Example(r["prompt"], r["response"], 0, i) for i, r in enumerate(rng.sample(rows, size))]
        batches = collator.window(examples, cfg.batch_size)
        stored = [{"encoder_hidden_states": encoded(b), "attention_mask": b["attention_mask"], "labels": b["labels"]}
                  for b in batches]
        plain.append(batches)
        cached.append(stored)
    tokens = [sum(int(b["labels"].ne(-100).sum()) for b in w) for w in plain]

    def step(window: list[dict], n_tokens: int, frozen_encoder: bool) -> float:
        with Timer(sync=torch.cuda.synchronize if cuda else None) as timer:
            for batch in window:
                with autocast():
                    loss = token_loss_sum(model, model, on_device(batch), frozen_encoder=frozen_encoder,
                                          multiple=multiple)
                (loss / n_tokens).backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm or float("inf"))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return timer.seconds

    ratios, plain_s, cached_s = [], [], []
    for i in range(windows + 1):
        if i % 2:  # ABBA: neither path always runs first
            c = step(cached[i], tokens[i], False)
            p = step(plain[i], tokens[i], True)
        else:
            p = step(plain[i], tokens[i], True)
            c = step(cached[i], tokens[i], False)
        if i:
            ratios.append(c / p)
            plain_s.append(p)
            cached_s.append(c)
    source = statistics.mean(int(b["attention_mask"].sum()) for w in plain for b in w) / cfg.batch_size
    target = statistics.mean(int(b["labels"].ne(-100).sum()) for w in plain for b in w) / cfg.batch_size
    return {"plain_s": statistics.median(plain_s), "cached_s": statistics.median(cached_s),
            "ratio": statistics.median(ratios), "spread": (min(ratios), max(ratios)),
            "source_tokens": source, "target_tokens": target}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="tiny,small", help="comma-separated model presets")
    parser.add_argument("--windows", type=int, default=12, help="accumulation windows timed per path")
    parser.add_argument("--corpus", action="append", default=[], help="a prompt/response jsonl file (repeatable)")
    parser.add_argument("--turns", default="1,2,3",
                        help="comma-separated chat turns per prompt for the k-turn corpora ('' for none)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--mixed_precision", default="no", choices=["no", "bf16"], help="bf16: autocast")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    options = parser.parse_args()
    if options.threads:
        torch.set_num_threads(options.threads)
    if options.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device=cuda: torch sees no GPU here")
    print(f"device {options.device}, precision {options.mixed_precision}, {torch.get_num_threads()} CPU threads")
    table = Table([Column("preset", "preset", width=6), Column("corpus", "corpus", width=14),
                   Column("src tok", "source_tokens", ".1f"), Column("tgt tok", "target_tokens", ".1f"),
                   Column("uncached s", "plain_s", ".3f"), Column("cached s", "cached_s", ".3f"),
                   Column("ratio", "ratio", ".2f"), Column("per-window range", "range")], stream=True)
    with tempfile.TemporaryDirectory() as tmp:
        rows_by_name = corpora(Path(tmp), options.corpus, [int(k) for k in options.turns.split(",") if k])
    for name, rows in rows_by_name.items():
        for preset in options.presets.split(","):
            r = measure(preset, rows, options.windows, options.device, options.mixed_precision)
            table.add(f"{preset} {name}", {**r, "preset": preset, "corpus": name,
                                           "range": f"{r['spread'][0]:.2f}-{r['spread'][1]:.2f}"})


if __name__ == "__main__":
    main()
