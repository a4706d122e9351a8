"""Is the Seq2SeqTrainer's loss in bench/peers.py the per-token mean, or 16x too large? (BENCHMARKS.md)

    python -m bench.seq2seq_loss_check                    # on the shipped pinyin corpus, about a minute

Runs one optimizer step (micro-batch 2, accumulation 16) of transformers' Seq2SeqTrainer twice: with
``compute_loss_func=token_mean_loss`` as bench/peer_trainers.py passes it, and with the Trainer's
default. Each time it compares the logged step-1 loss with the per-token mean of the same 16
micro-batches, computed separately from the same initial weights. Dropout is off so both forwards
match. Expected ratios: 1.000 with the fix, about 16 without it. transformers 5.x stops dividing
by the accumulation steps because T5's forward accepts ``**kwargs``.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from bench import peer_trainers  # also sets the offline switches
from bench.harness import REPO

ACCUMULATION = 16


def no_dropout(model) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "dropout", None), float):  # T5Attention's functional dropout rate
            module.dropout = 0.0


def window_mean_loss(model, window: list[dict]) -> float:
    """Sum of the token losses of ``window`` / its target tokens, in eval mode."""
    model.eval()
    total = 0.0
    with torch.no_grad():
        for b in window:
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                           decoder_input_ids=b["decoder_input_ids"]).logits
            total += float(F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=-100,
                                           reduction="sum"))
    return total / sum(int(b["labels"].ne(-100).sum()) for b in window)


def first_step(train_file: str, fixed: bool, tmp: Path) -> tuple[float, float, int]:
    """(logged step-1 loss, separately computed per-token mean of the same window, vocabulary size)."""
    from datasets import load_dataset
    from transformers import DataCollatorForSeq2Seq, Seq2SeqTrainer, Seq2SeqTrainingArguments

    tokenizer, model = peer_trainers.build(SimpleNamespace(seed=42, model_preset="tiny", max_target_len=128))
    no_dropout(model)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    data = load_dataset("json", data_files=train_file, split="train", cache_dir=str(tmp / "cache"))
    data = data.map(peer_trainers.tokenize_function(tokenizer, 128, 128), batched=True,
                    remove_columns=["prompt", "response"])
    made = []

    def collate(features):  # keeps every micro-batch in the order the Trainer trains on them
        batch = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)(features)
        made.append({k: v.clone() for k, v in batch.items()})
        return batch

    args = Seq2SeqTrainingArguments(
        output_dir=str(tmp / "out"), per_device_train_batch_size=2, gradient_accumulation_steps=ACCUMULATION,
        max_steps=1, optim="adafactor", learning_rate=3e-3, save_strategy="no", eval_strategy="no", report_to=[],
        use_cpu=True, seed=42, logging_steps=1, disable_tqdm=True)
    trainer = Seq2SeqTrainer(model=model, args=args, train_dataset=data, data_collator=collate,
                             processing_class=tokenizer,
                             compute_loss_func=peer_trainers.token_mean_loss if fixed else None)
    trainer.train()
    logged = next(h["loss"] for h in trainer.state.log_history if "loss" in h)
    model.load_state_dict(initial)  # the step-1 loss was computed from the initial weights
    return logged, window_mean_loss(model, made[:ACCUMULATION]), len(tokenizer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train_file", default=str(REPO / "data" / "pinyin" / "train.jsonl"))
    options = parser.parse_args()
    for fixed in (True, False):
        with tempfile.TemporaryDirectory() as tmp:
            logged, mean, vocab = first_step(options.train_file, fixed, Path(tmp))
        name = "token_mean_loss" if fixed else "none (Trainer default)"
        print(f"compute_loss_func={name}: logged step-1 loss {logged:.4f}, per-token mean of the same window "
              f"{mean:.4f}, ratio {logged / mean:.3f} (ln vocabulary {math.log(vocab):.2f})", flush=True)


if __name__ == "__main__":
    main()
