"""Micro-batches sized to the memory budget (lowmem.memory.batch_budget): the same maths at any split, auto
within --max_rss_gb, requests lowered with one line, token budgets, evaluation independent of its batch."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import metrics
from test_training_math import COLS, grads, make_trainer

from config import SHIPPED_CORPORA
from data.collate import CALL_TOKENS, length_groups, micro_batches
from data.sources.eval_set import take_examples
from lowmem.cli.flags import load_config
from lowmem.memory import planner
from lowmem.memory.batch_budget import size_batches
from lowmem.memory.plan_sizes import Placement


def weights(trainer) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in trainer.core.parameters()])


def test_micro_16_x_2_trains_the_weights_of_2_x_16(tmp_path, tokenizer):
    """8 steps at the full learning rate on the shipped chat pairs. With the former ReLU presets these two runs
    ended 2.0e-5 apart (a ReLU unit on in one run and off in the other); gated-gelu has no such edge."""
    runs = {}
    chat = dict(train_file=str(SHIPPED_CORPORA["sft"][0]), max_source_len=32, max_target_len=32, max_steps=8,
                warmup_steps=0)
    for micro, accumulation in ((2, 16), (16, 2)):
        trainer = make_trainer(tmp_path / f"{micro}", tokenizer, batch_size=micro,
                               gradient_accumulation_steps=accumulation, **chat)
        try:
            trainer.train()
            setup = next(r for r in metrics(trainer.out) if r["event"] == "setup")
            assert (setup["micro_batch_size"], setup["gradient_accumulation_steps"]) == (micro, accumulation)
            runs[micro] = weights(trainer)
        finally:
            trainer.close()
    starter = make_trainer(tmp_path / "start", tokenizer, **chat)
    start = weights(starter)
    starter.close()
    moved = (runs[2] - start).abs().max().item()
    assert moved > 1e-3  # the steps changed the weights
    assert (runs[16] - runs[2]).abs().max().item() <= 1e-5


def test_token_budget_groups_short_rows_together_and_keeps_the_gradient(tmp_path, tokenizer):
    rng = random.Random(0)
    sources = [rng.choice([3, 5, 60, 120]) for _ in range(40)]
    targets = [rng.randint(1, 30) for _ in range(40)]
    groups = micro_batches(sources, targets, 2, max_tokens=250, multiple=16)
    assert sorted(i for g in groups for i in g) == list(range(40))  # every row once
    for g in groups:
        padded = len(g) * (-(-max(sources[i] for i in g) // 16) * 16 + -(-max(targets[i] for i in g) // 16) * 16)
        assert padded <= 250 or len(g) == 1
    sizes = [len(g) for g in groups]
    assert max(sizes) >= 5 and min(sizes) == 1  # short rows many together, a long one alone

    trainer = make_trainer(tmp_path, tokenizer)
    examples = take_examples(trainer.files.train, COLS, 32)
    trainer.accumulate_gradients(trainer.data.collator.window(examples, 2))
    by_rows = grads(trainer)
    trainer.optimizer.zero_grad(set_to_none=True)
    window = trainer.data.collator.window(examples, 2, max_tokens=120)
    assert len(window) < 16  # fewer, larger micro-batches than 16 of 2 rows
    trainer.accumulate_gradients(window)
    by_tokens = grads(trainer)
    assert ((by_tokens - by_rows).norm() / by_rows.norm()).item() <= 1e-5
    trainer.close()


def test_a_request_that_would_not_fit_is_lowered_with_one_line_and_auto_fills_the_budget(tokenizer):
    cfg, _ = load_config({"batch_size": 16, "gradient_accumulation_steps": 2, "max_eval_samples": 32})
    data = planner.plan_data(cfg, tokenizer, 1)
    baseline = 400.0

    def sized(budget_mb, **flags):
        trial, _ = load_config({"max_eval_samples": 32, **flags})
        return size_batches(trial, data, baseline, Placement("cpu", 1), budget_mb=budget_mb)

    roomy = sized(1e6, batch_size=16, gradient_accumulation_steps=2)
    assert (roomy.micro, roomy.accumulation, roomy.notes) == (16, 2, [])
    # A budget between the plans of micro-batches 4 and 8: lowered to 4 x 8 (the same 32 rows per step).
    at = {m: sized(1e6, batch_size=m, gradient_accumulation_steps=32 // m).predicted_mb for m in (4, 8)}
    assert at[4] < at[8]
    lowered = sized((at[4] + at[8]) / 2, batch_size=16, gradient_accumulation_steps=2)
    assert (lowered.micro, lowered.accumulation) == (4, 8)
    assert len(lowered.notes) == 1 and "--batch_size=16" in lowered.notes[0] and "above the budget" in lowered.notes[0]
    # auto: the largest size that fits with the margin, rows per step kept with --effective_batch_size.
    auto = sized(1.15 * at[8] + 1, batch_size="auto", effective_batch_size=32)
    assert (auto.micro, auto.accumulation, auto.predicted_mb) == (8, 4, at[8])
    roomy_auto = sized(1e6, batch_size="auto", effective_batch_size=32, eval_batch_size="auto")
    assert (roomy_auto.micro, roomy_auto.accumulation, roomy_auto.eval_batch) == (32, 1, 32)
    with pytest.raises(Exception, match="not a multiple of --batch_size=16"):
        sized(1e6, batch_size=16, effective_batch_size=40)
    # Nothing fits, not even 1 (asked for): 1 it is, with a line that says so (it raised IndexError before)
    tight = sized(1.0, batch_size=1, eval_batch_size=1)
    assert (tight.micro, tight.eval_batch) == (1, 1) and "even at a micro-batch of 1" in tight.notes[-1]


def test_length_groups_are_the_cheapest_split_within_the_budget():
    rng = random.Random(0)
    for _ in range(300):
        lengths = [rng.choice([1, 2, 3, 5, 8, 30, 64, 120]) for _ in range(rng.randint(1, 9))]
        budget = rng.choice([64, 256, 2048])
        groups = length_groups(lengths, budget)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        assert all(len(g) == 1 or len(g) * max(lengths[i] for i in g) <= budget for g in groups)

        def cost(runs):
            return sum(CALL_TOKENS + len(r) * max(r) for r in runs)

        # every split of the sorted lengths into runs within the budget: the cheapest one costs the same
        ordered, best = sorted(lengths), None
        for cuts in range(2 ** (len(ordered) - 1)):
            runs, start = [], 0
            for k in range(1, len(ordered) + 1):
                if k == len(ordered) or cuts >> (k - 1) & 1:
                    runs.append(ordered[start:k])
                    start = k
            if all(len(r) == 1 or len(r) * max(r) <= budget for r in runs):
                best = cost(runs) if best is None else min(best, cost(runs))
        assert cost([[lengths[i] for i in g] for g in groups]) == best


def test_eval_loss_grouped_by_each_side_equals_one_forward():
    from transformers import T5Config, T5ForConditionalGeneration

    from lowmem.training.evaluation import loss_and_encoded

    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=32, d_ff=64, num_layers=2, num_heads=2,
                                                d_kv=16, dropout_rate=0.0, decoder_start_token_id=0)).eval()
    sources, targets = [3, 40, 5, 7, 38, 2, 4, 6], [30, 2, 4, 33, 3, 5, 2, 6]  # long-tailed, uncorrelated sides
    ids = torch.randint(2, 64, (8, 40))
    mask = (torch.arange(40) < torch.tensor(sources)[:, None]).long()
    labels = torch.randint(2, 64, (8, 33)).masked_fill(torch.arange(33) >= torch.tensor(targets)[:, None], -100)
    batch = {"input_ids": ids * mask, "attention_mask": mask, "labels": labels}
    assert len(length_groups(sources, 64)) > 1 and length_groups(sources, 64) != length_groups(targets, 64)
    with torch.no_grad():
        grouped, encoded = loss_and_encoded(model, model, batch, 64, 1)
        whole, reference = loss_and_encoded(model, model, batch, 0, 1)
    assert grouped == pytest.approx(whole, rel=1e-5)
    real = mask.bool()
    assert torch.allclose(encoded["encoder_outputs"].last_hidden_state[real],
                          reference["encoder_outputs"].last_hidden_state[real], atol=1e-5)


def test_eval_loss_and_bleu_do_not_depend_on_the_eval_batch(tmp_path, tokenizer):
    trainer = make_trainer(tmp_path, tokenizer, max_eval_samples=16, max_target_len=16, max_steps=3)
    try:
        trainer.train()
        results = {}
        for size in (1, 5, 16):
            trainer.cfg.eval_batch_size = size
            results[size] = trainer.evaluate()
        trainer.cfg.eval_generate = False  # the loss alone, no BLEU: the same loss, without generating
        loss_only = trainer.evaluate()
    finally:
        trainer.close()
    assert results[1]["eval_examples"] == results[16]["eval_examples"] == loss_only["eval_examples"] == 16
    for size in (5, 16):
        assert results[size]["eval_loss"] == pytest.approx(results[1]["eval_loss"], rel=1e-5)
        assert results[size]["bleu"] == pytest.approx(results[1]["bleu"], abs=1e-6)
    assert loss_only["eval_loss"] == results[16]["eval_loss"] and "bleu" not in loss_only


def test_auto_stays_within_max_rss_gb_and_a_resume_keeps_its_sizes(tmp_path, run_cli):
    train, evals = SHIPPED_CORPORA["pretrain"]
    run = tmp_path / "run"
    # no accumulation: a step is one micro-batch of the size auto picks (the effective batch follows it)
    common = [f"--train_file={train}", f"--eval_file={evals}", f"--output_dir={run}", "--batch_size=auto",
              "--eval_batch_size=auto", "--max_rss_gb=0.75", "--gradient_accumulation_steps=1", "--eval_steps=0",
              "--save_steps=0", "--max_eval_samples=64"]
    proc = run_cli("train", *common, "--max_steps=2", fresh=True)  # (RSS as a user's process has it)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = metrics(run)
    setup = next(r for r in records if r["event"] == "setup")
    assert 2 < setup["micro_batch_size"] < 256  # above the old cap, below auto's limit: the budget decided
    assert setup["eval_batch_size"] > 4 and "auto: micro-batch" in proc.stdout
    config = json.loads((run / "config.json").read_text())  # the configuration as resolved, the sizes used
    assert (config["batch_size"], config["eval_batch_size"]) == (setup["micro_batch_size"], setup["eval_batch_size"])
    peak = next(r for r in records if r["event"] == "memory_peak")
    assert peak["measured_host_peak_mb"] < 0.75 * 1024
    proc = run_cli("train", *common, "--max_steps=3", "--is_keep_training=True", fresh=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "as the run began" in proc.stdout
    resumed = [r for r in metrics(run) if r["event"] == "setup"][-1]
    assert resumed["micro_batch_size"] == setup["micro_batch_size"]
    # plan takes the budget train takes: a fixed micro-batch above it is lowered there too, with the same line
    asked = [f"--train_file={train}", f"--eval_file={evals}", "--batch_size=256", "--gradient_accumulation_steps=1",
             "--max_rss_gb=0.55"]
    planned = run_cli("plan", *asked, "--json=True")
    assert planned.returncode == 0, planned.stderr[-2000:]
    assert "--batch_size=256: predicted peak" in planned.stderr
    lowered = int(planned.stderr.split("training micro-batches of ")[1].split()[0])
    assert lowered < 256 and json.loads(planned.stdout)["host_peak_mb"] < 0.9 * 0.55 * 1024
