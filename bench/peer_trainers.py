"""The peers this trainer is compared with, each run the way its users run it (used by bench/peers.py).

    python -m bench.peer_trainers --kind=map --train_file=corpus.jsonl --steps_out=steps.jsonl --cache_dir=/tmp/c
    python -m bench.peer_trainers --kind=streaming --train_file=corpus.jsonl --steps_out=steps.jsonl
    python -m bench.peer_trainers --kind=reference --train_file=corpus.jsonl --steps_out=steps.jsonl

Kinds:
    map        transformers' Seq2SeqTrainer over ``load_dataset("json")`` + ``.map(tokenize, batched=True)``
               (the whole corpus converted to Arrow and tokenized before the first step), DataCollatorForSeq2Seq.
    streaming  the same Seq2SeqTrainer over ``load_dataset(..., streaming=True)`` + a shuffle buffer of
               ``--shuffle_buffer`` rows + ``.map(tokenize, batched=True)``.
    reference  the reference project's approach: the whole table read into memory first
               (``pyarrow.json.read_json``), then a plain PyTorch loop: shuffled DataLoader over it,
               tokenization per micro-batch, Adafactor, gradient accumulation by hand.

All three use the model ``lowmem.model.build.build_model`` builds for ``--model_preset`` (same seed, so
the same initial weights as this trainer), the shipped tokenizer, Adafactor with the learning rate
applied as given, linear warmup and decay, gradient clipping at 1.0, and the loss this trainer uses:
sum of the token losses / target tokens of the whole accumulation window. For the Seq2SeqTrainer that
needs ``compute_loss_func``: T5's forward accepts ``**kwargs``, so transformers 5 stops dividing its
per-micro-batch mean loss by the accumulation steps and the loss and gradients come out x16.

Writes ``--steps_out`` (JSON lines): ``{"event": "ready", "time"}`` just before training starts, then
per optimizer step ``{"event": "step", "step", "time", "tokens", "loss"}`` where ``time`` is the unix
time at the end of the step, ``tokens`` the running count of non-pad source + target tokens trained
on, and ``loss`` the step's per-token mean loss.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.harness import REPO

# Set before datasets and transformers are imported (in the functions below): they read them once
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


class StepLog:
    """``--steps_out``: one JSON line per event, flushed at once (the parent reads it after the run)."""

    def __init__(self, path: str):
        self.fh = open(path, "w", encoding="utf-8")

    def write(self, event: str, **fields) -> None:
        self.fh.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")
        self.fh.flush()


def batch_tokens(batch: dict) -> int:
    """Non-pad source tokens + target tokens of one collated micro-batch."""
    return int(batch["attention_mask"].sum()) + int(batch["labels"].ne(-100).sum())


def build(options):
    """(tokenizer, model) exactly as the trainer builds them for the preset, seeded the same way."""
    from transformers import set_seed

    from data.tokenization import load_tokenizer
    from lowmem.cli.flags import load_config
    from lowmem.model.build import build_model

    set_seed(options.seed)  # the trainer seeds before building the model: same initial weights
    tokenizer = load_tokenizer(options.tokenizer_dir or REPO / "data" / "tokenizer")
    cfg, _ = load_config({"model_preset": options.model_preset, "max_target_len": options.max_target_len})
    return tokenizer, build_model(cfg, tokenizer)


def builder_of(path: str) -> str:
    """The datasets builder for a file: parquet, csv, or json (JSON lines or one JSON array)."""
    from data.sources.readers import file_kind

    kind = file_kind(Path(path))
    return kind if kind in ("parquet", "csv") else "json"


# --------------------------------------------------------------------------- Seq2SeqTrainer
def token_mean_loss(outputs, labels, num_items_in_batch=None):
    """Sum of the token losses of this micro-batch / target tokens of the whole accumulation window.

    The Trainer passes ``num_items_in_batch`` (the window's non -100 labels) and, with a
    ``compute_loss_func``, adds the micro-batches' results as they are: their sum over a window is
    the per-token mean, as in this trainer.
    """
    logits = outputs["logits"]
    labels = labels.to(logits.device)
    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    count = num_items_in_batch if num_items_in_batch is not None else labels.ne(-100).sum()
    return loss / count


class CountingCollator:
    """Wraps the collator and remembers each micro-batch's token count, in the order made.

    The optimizer step k has consumed exactly the first k x accumulation micro-batches, whatever the
    data loader fetched ahead, so the count at a step end is exact.
    """

    def __init__(self, collator):
        self.collator = collator
        self.counts: list[int] = []

    def __call__(self, features):
        batch = self.collator(features)
        self.counts.append(batch_tokens(batch))
        return batch


def step_logger(log: StepLog, counter: CountingCollator, accumulation: int):
    from transformers import TrainerCallback

    class StepTimes(TrainerCallback):
        """Time and token count at each optimizer step's end; the loss when the Trainer logs it."""

        def __init__(self):
            self.pending = None

        def on_step_end(self, args, state, control, **kwargs):
            step = state.global_step
            self.pending = {"step": step, "time": time.time(),
                            "tokens": sum(counter.counts[:step * accumulation])}

        def on_log(self, args, state, control, logs=None, **kwargs):
            if self.pending is not None and logs and "loss" in logs:
                log.fh.write(json.dumps({"event": "step", **self.pending, "loss": logs["loss"]}) + "\n")
                log.fh.flush()
                self.pending = None

    return StepTimes()


def tokenize_function(tokenizer, max_source_len: int, max_target_len: int):
    def tokenize(batch):
        out = tokenizer(batch["prompt"], max_length=max_source_len, truncation=True)
        targets = tokenizer(text_target=batch["response"], max_length=max_target_len, truncation=True)
        out["labels"] = targets["input_ids"]
        return out

    return tokenize


def run_seq2seq_trainer(options, log: StepLog) -> None:
    from datasets import load_dataset
    from transformers import DataCollatorForSeq2Seq, Seq2SeqTrainer, Seq2SeqTrainingArguments

    tokenizer, model = build(options)
    tokenize = tokenize_function(tokenizer, options.max_source_len, options.max_target_len)
    streaming = options.kind == "streaming"
    dataset = load_dataset(builder_of(options.train_file), data_files=options.train_file, split="train",
                           streaming=streaming, cache_dir=options.cache_dir)
    dataset = dataset.select_columns([options.prompt_column, options.response_column])
    renames = {options.prompt_column: "prompt", options.response_column: "response"}
    renames = {old: new for old, new in renames.items() if old != new}
    if renames:
        dataset = dataset.rename_columns(renames)
    if streaming:
        # The same shuffle buffer as this trainer's default (without one, rows come in file order).
        dataset = dataset.shuffle(seed=options.seed, buffer_size=options.shuffle_buffer)
    dataset = dataset.map(tokenize, batched=True, remove_columns=["prompt", "response"])
    # model=: the collator makes decoder_input_ids from the labels (the loss function takes the labels away).
    collator = CountingCollator(DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100))
    args = Seq2SeqTrainingArguments(
        output_dir=options.output_dir, per_device_train_batch_size=options.batch_size,
        gradient_accumulation_steps=options.accumulation, max_steps=options.steps, optim="adafactor",
        learning_rate=options.learn_rate, warmup_steps=options.warmup_steps, lr_scheduler_type="linear",
        weight_decay=0.0, max_grad_norm=1.0, save_strategy="no", eval_strategy="no", report_to=[],
        dataloader_num_workers=0, use_cpu=options.device == "cpu", seed=options.seed, logging_steps=1,
        disable_tqdm=True)
    trainer = Seq2SeqTrainer(model=model, args=args, train_dataset=dataset, data_collator=collator,
                             processing_class=tokenizer, compute_loss_func=token_mean_loss,
                             callbacks=[step_logger(log, collator, options.accumulation)])
    log.write("ready")
    trainer.train()


# --------------------------------------------------------------------------- reference approach
class InMemoryTable(torch.utils.data.Dataset):
    """The whole corpus as one in-memory Arrow table (the reference read its table with ``pq.read_table``)."""

    def __init__(self, path: str, prompt_column: str, response_column: str):
        from data.sources.readers import file_kind

        kind = file_kind(Path(path))
        if kind == "parquet":
            import pyarrow.parquet as pq

            table = pq.read_table(path, columns=[prompt_column, response_column])
        elif kind == "csv":
            import pyarrow.csv as pc

            table = pc.read_csv(path)
        elif kind == "json-array":  # pyarrow reads JSON lines only
            import pyarrow as pa

            table = pa.Table.from_pylist(json.loads(Path(path).read_text(encoding="utf-8")))
        else:
            import pyarrow.json as pj

            table = pj.read_json(path)
        self.prompts, self.responses = table.column(prompt_column), table.column(response_column)

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> tuple[str, str]:
        return self.prompts[i].as_py(), self.responses[i].as_py()


def run_reference(options, log: StepLog) -> None:
    from transformers import get_linear_schedule_with_warmup
    from transformers.optimization import Adafactor

    tokenizer, model = build(options)
    device = torch.device(options.device)
    model.to(device).train()
    table = InMemoryTable(options.train_file, options.prompt_column, options.response_column)

    def collate(rows):  # tokenization per micro-batch, padded to its longest row
        prompts, responses = zip(*rows)
        enc = tokenizer(list(prompts), max_length=options.max_source_len, truncation=True, padding=True,
                        return_tensors="pt")
        labels = tokenizer(text_target=list(responses), max_length=options.max_target_len, truncation=True,
                           padding=True, return_tensors="pt")["input_ids"]
        labels[labels == tokenizer.pad_token_id] = -100
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": labels}

    loader = torch.utils.data.DataLoader(table, batch_size=options.batch_size, shuffle=True, num_workers=0,
                                         collate_fn=collate, generator=torch.Generator().manual_seed(options.seed))
    optimizer = Adafactor(model.parameters(), lr=options.learn_rate, relative_step=False, scale_parameter=False,
                          warmup_init=False, weight_decay=0.0)
    scheduler = get_linear_schedule_with_warmup(optimizer, min(options.warmup_steps, options.steps), options.steps)
    log.write("ready")
    step = tokens = 0
    batches = iter(loader)
    while step < options.steps:
        window = []
        while len(window) < options.accumulation:
            try:
                window.append(next(batches))
            except StopIteration:  # next epoch
                batches = iter(loader)
        window_targets = sum(int(b["labels"].ne(-100).sum()) for b in window)
        loss_sum = torch.zeros((), device=device)
        for micro in window:
            tokens += batch_tokens(micro)
            batch = {k: v.to(device) for k, v in micro.items()}
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           decoder_input_ids=model._shift_right(batch["labels"]), use_cache=False).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(), ignore_index=-100,
                                   reduction="sum")
            (loss / window_targets).backward()
            loss_sum += loss.detach()
            del batch, logits, loss  # free this micro-batch's activations before the next one
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        log.write("step", step=step, tokens=tokens, loss=float(loss_sum) / window_targets)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", choices=["map", "streaming", "reference"], required=True)
    parser.add_argument("--train_file", required=True)
    parser.add_argument("--steps_out", required=True, help="JSON lines: ready, then one line per optimizer step")
    parser.add_argument("--output_dir", default=None, help="Trainer output folder (nothing is saved in it)")
    parser.add_argument("--cache_dir", default=None, help="datasets cache folder (the caller deletes it)")
    parser.add_argument("--model_preset", default="tiny")
    parser.add_argument("--tokenizer_dir", default=None, help="default: the shipped data/tokenizer")
    parser.add_argument("--prompt_column", default="prompt")
    parser.add_argument("--response_column", default="response")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--accumulation", type=int, default=16)
    parser.add_argument("--max_source_len", type=int, default=128)
    parser.add_argument("--max_target_len", type=int, default=128)
    parser.add_argument("--learn_rate", type=float, default=3e-3)
    parser.add_argument("--warmup_steps", type=int, default=2)
    parser.add_argument("--shuffle_buffer", type=int, default=1000, help="streaming only")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    options = parser.parse_args()
    if options.output_dir is None:
        options.output_dir = str(Path(options.steps_out).with_suffix("")) + "_trainer"
    log = StepLog(options.steps_out)
    if options.kind == "reference":
        run_reference(options, log)
    else:
        run_seq2seq_trainer(options, log)


if __name__ == "__main__":
    main()
