"""MFU in the train records: each record's model FLOPs (FLOP/s x the interval's seconds) equal what torch's
``FlopCounterMode`` counts for the same optimizer steps, and its MFU is those FLOP/s over the device's peak in the
run's compute dtype (``lowmem.hardware``)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import synthetic_rows, write_rows
from test_flops import cpu_flash_attention
from torch.utils.flop_counter import FlopCounterMode

from lowmem.cli.flags import load_config
from lowmem.hardware.probe import capability
from trainer_low_mem import LowMemTrainer


class CountedTrainer(LowMemTrainer):
    """The trainer with each optimizer step run inside FlopCounterMode (its products counted as torch counts them,
    with torch's formula for its CUDA flash kernels given to SDPA's fused CPU kernel, which torch 2.13 lacks)."""

    counted: list[int]

    def train_step(self, window, counts):
        with FlopCounterMode(display=False, custom_mapping=cpu_flash_attention()) as counter:
            stepped = super().train_step(window, counts)
        self.counted.append(counter.get_total_flops())
        return stepped


def run(tmp_path, tokenizer, **flags) -> tuple[list[dict], list[int]]:
    train = write_rows(tmp_path / "train.jsonl", synthetic_rows(64, seed=1))
    evals = write_rows(tmp_path / "eval.jsonl", synthetic_rows(8, seed=2))
    base = dict(train_file=str(train), eval_file=str(evals), output_dir=str(tmp_path / "run"), max_steps=4,
                eval_steps=0, save_steps=0, logging_steps=1, max_eval_samples=4, eval_generate=False,
                batch_size=3, gradient_accumulation_steps=2, warmup_steps=1)
    cfg, _ = load_config({**base, **flags})
    trainer = CountedTrainer(cfg, tokenizer=tokenizer).setup()
    trainer.counted = []
    trainer.train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # what the probe found is in config.json and the setup record, as the start-up summary said it
    found = capability("cpu").record()
    assert json.loads((tmp_path / "run" / "config.json").read_text())["hardware"] == found
    assert [r["hardware"] for r in records if r["event"] == "setup"] == [found]
    return [r for r in records if r["event"] == "train"], trainer.counted


def tiny_model(folder, tokenizer, **flags) -> str:
    """A tiny T5 of the given shape flags saved as a model folder with its tokenizer (an --init_from)."""
    from lowmem.model.build import build_model

    cfg, _ = load_config(flags)
    build_model(cfg, tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


SHAPE = {"feed_forward_proj": "relu", "tie_word_embeddings": True}


@pytest.mark.parametrize("flags", [
    {}, {"gradient_checkpointing": True, "max_target_len": 9},
    {"is_finetune": True, "init_from": SHAPE, "lora_r": 4, "lora_target_modules": "q,k,v,o,wi,wo"},
    {"is_finetune": True, "init_from": SHAPE, "freeze": "embeddings", "packing": True}],
    ids=["pretraining", "checkpointing, targets cut", "LoRA everywhere, frozen encoder", "frozen embeddings, packed"])
def test_every_train_records_flops_are_what_flop_counter_counts_for_its_step(tmp_path, tokenizer, flags):
    """Gradient checkpointing's recomputed forward is no model FLOPs: there the counter's count is higher by it."""
    if isinstance(flags.get("init_from"), dict):
        flags = {**flags, "init_from": tiny_model(tmp_path / "model", tokenizer, **flags["init_from"])}
    records, counted = run(tmp_path, tokenizer, **flags)
    assert len(records) == len(counted) == 4
    peak = capability("cpu").peak(torch.float32)
    for record, flops in zip(records, counted):
        logged = record["flops_per_s"] * record["step_s"]  # one step per record
        print(f"logged {logged:,.0f} counted {flops:,} ({logged / flops - 1:+.2%})")
        if flags.get("gradient_checkpointing"):
            assert 1.1 * logged < flops < 1.5 * logged  # each block's forward run again (dropout 0.1: all of it)
        else:
            assert abs(logged - flops) <= 0.05 * flops
        assert record["mfu"] == pytest.approx(record["flops_per_s"] / peak, rel=1e-3, abs=1e-4)
