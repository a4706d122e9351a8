"""--packing=True: examples packed several to a row with segment masks give each example exactly its own loss and
gradient (T5 v1.0 and v1.1 shapes, trained and frozen encoders), rows hold whole examples within the limits, and a
packed SFT run trains the weights of an unpacked one with almost no padding."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import metrics, synthetic_rows, write_rows

from data.collate import Seq2SeqCollator
from data.packing import PackingCollator, best_fit, examples_in, packed_rows
from data.sources.corpus import Example
from lowmem.model.loss import token_loss_sum


def skewed_sizes(n: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(2, 6), rng.randint(2, 8)) if rng.random() < 0.85 else (rng.randint(20, 60), rng.randint(5, 40))
            for _ in range(n)]


@pytest.mark.parametrize("seed", range(5))
def test_rows_hold_every_example_once_whole_within_the_limits_and_evenly(seed):
    sizes, capacity = skewed_sizes(200, seed), (64, 48)
    rows = packed_rows(sizes, capacity)
    assert sorted(i for row in rows for i in row) == list(range(len(sizes)))
    assert all(sum(sizes[i][0] for i in row) <= 64 and sum(sizes[i][1] for i in row) <= 48 for row in rows)
    assert len(rows) == len(best_fit(sizes, capacity))
    total = sum(s + t for s, t in sizes)
    assert total / (len(rows) * sum(capacity)) > 0.85  # few rows: the window's tokens over the rows' room
    # with room to spare, rows come out even (a row of a micro-batch pads to the longest): within one example
    short = [(s, t) for s, t in sizes if s + t <= 14][:60]
    rows = packed_rows(short, (128, 128))
    for side in (0, 1):
        loads = [sum(short[i][side] for i in row) for row in rows]
        assert max(loads) - min(loads) <= 8, loads


def test_evening_lowers_the_padding_of_long_target_rows_and_keeps_them_whole():
    from data.packing import balanced, evened

    capacity, gains = (128, 128), []
    for seed in range(6):
        rng = random.Random(seed)  # glossary-like: short names, glosses of 2-60 words (one side binds)
        sizes = [(rng.randint(3, 9), rng.choice([rng.randint(3, 20), rng.randint(20, 90)])) for _ in range(32)]
        before = balanced(sizes, capacity, len(best_fit(sizes, capacity))) or best_fit(sizes, capacity)
        after = evened(sizes, before, capacity)

        def padded(rows):  # one micro-batch of all the rows: each side padded to its longest row
            return len(rows) * sum(max(sum(sizes[i][k] for i in row) for row in rows) for k in (0, 1))  # noqa: B023

        assert sorted(i for row in after for i in row) == list(range(len(sizes))) and len(after) == len(before)
        assert all(sum(sizes[i][k] for i in row) <= capacity[k] for row in after for k in (0, 1))
        assert padded(after) <= padded(before)
        real = sum(s + t for s, t in sizes)
        gains.append((padded(before) - real, padded(after) - real))  # padded tokens
    assert sum(a for _, a in gains) < 0.7 * sum(b for b, _ in gains), gains


def examples(n: int, seed: int) -> list[Example]:
    return [Example(r["prompt"], r["response"], 0, i) for i, r in enumerate(synthetic_rows(n, seed=seed))]


def gradients(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["t5", "v1_1"])
@pytest.mark.parametrize("frozen_encoder", [False, True])
def test_a_packed_row_gives_each_example_its_own_loss_and_gradient(family_models, family, frozen_encoder):
    from transformers import AutoTokenizer, T5ForConditionalGeneration

    folder = family_models[family]
    model = T5ForConditionalGeneration.from_pretrained(folder, dropout_rate=0.0).train()  # (attention's too)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    window = examples(12, seed=3)
    packed = PackingCollator(tokenizer, 48, 48).window(window, batch_size=8)
    assert sum(examples_in(mb) for mb in packed) == 12 and sum(len(mb["labels"]) for mb in packed) < 12
    plain = Seq2SeqCollator(tokenizer, 48, 48).window(window, batch_size=1)  # each example alone

    def run(micro_batches) -> tuple[float, dict]:
        model.zero_grad()
        total = 0.0
        for batch in micro_batches:
            loss = token_loss_sum(model, model, batch, frozen_encoder=frozen_encoder, loss_chunk=0)
            loss.backward()
            total += float(loss)
        return total, gradients(model)

    (packed_loss, packed_grads), (plain_loss, plain_grads) = run(packed), run(plain)
    assert packed_loss == pytest.approx(plain_loss, rel=1e-6)
    assert sorted(packed_grads) == sorted(plain_grads)
    for name, grad in plain_grads.items():
        assert float((packed_grads[name] - grad).abs().max()) <= 1e-5 * max(float(grad.abs().max()), 1e-3), name
    # each example's own loss: the packed row with the other segments' labels hidden (segment ids count per row)
    batch = packed[0]
    segments = batch["target_segments"]
    for segment in range(1, int(segments[0].max()) + 1):
        mine = torch.zeros_like(segments, dtype=torch.bool)
        mine[0] = segments[0] == segment
        only = {**batch, "labels": batch["labels"].masked_fill(~mine, -100)}
        target = batch["labels"][mine].tolist()
        alone = next(mb for mb in plain if mb["labels"][0][mb["labels"][0] != -100].tolist() == target)
        with torch.no_grad():
            losses = [float(token_loss_sum(model, model, b, frozen_encoder=frozen_encoder, loss_chunk=0))
                      for b in (only, alone)]
        assert losses[0] == pytest.approx(losses[1], rel=1e-5, abs=1e-5)


def test_packing_refuses_what_it_cannot_pack_in_one_line(cli_in_process, tmp_path):
    for flags, says in ((["--objective=span_corruption"], "--packing=True packs pairs, prefix_lm examples"),
                        (["--is_finetune=True", "--encoder_cache=memory", "--init_from=x"],
                         "--packing=True does not run with --encoder_cache")):
        done = cli_in_process("train", "--packing=True", f"--output_dir={tmp_path / 'run'}", *flags)
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert done.returncode == 2 and len(errors) == 1 and says in errors[0], done.stderr
    assert not (tmp_path / "run").exists()


def test_packed_sft_trains_the_weights_of_unpacked_sft_with_little_padding(run_cli, family_models, tmp_path):
    from safetensors.torch import load_file

    rng = random.Random(4)
    rows = synthetic_rows(300, seed=4)
    for row in rows[::9]:  # a long tail
        row["prompt"] = " ".join([row["prompt"]] * rng.randint(3, 6))
    train = write_rows(tmp_path / "train.jsonl", rows)
    common = ["train", "--is_finetune=True", f"--init_from={family_models['v1_1']}", f"--train_file={train}",
              f"--eval_file={train}", "--max_steps=6", "--gradient_accumulation_steps=2", "--batch_size=16",
              "--dropout_rate=0", "--eval_steps=0", "--save_steps=0", "--logging_steps=1", "--eval_generate=False",
              "--max_eval_samples=8"]
    runs = {packing: tmp_path / f"packing-{packing}" for packing in (False, True)}
    for packing, run in runs.items():
        done = run_cli(*common, f"--output_dir={run}", f"--packing={packing}")
        assert done.returncode == 0, done.stderr[-3000:]
    a, b = (load_file(str(run / "final" / "model.safetensors")) for run in runs.values())
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-5
    records = [[r for r in metrics(run) if r["event"] == "train"] for run in runs.values()]
    assert [r["loss"] for r in records[0]] == pytest.approx([r["loss"] for r in records[1]], rel=1e-5)
    padding = [sum(r["padding_pct"] for r in rs) / len(rs) for rs in records]
    assert padding[1] <= 5 and padding[0] >= 20, padding
    assert all(r["examples_per_row"] > 2 for r in records[1]) and all(r["examples_per_row"] == 1 for r in records[0])


def test_the_planner_prices_packed_rows_as_the_trainer_packs_them():
    from lowmem.memory.plan_batches import micro_batch_lengths

    sizes = skewed_sizes(64, seed=1)
    unpacked = micro_batch_lengths([sizes], batch_size=2)
    packed = micro_batch_lengths([sizes], batch_size=2, capacity=(128, 128))
    assert len(unpacked) == 32 and len(packed) < 8
    # the same target tokens, in rows near full: the costliest micro-batch is two rows of about the capacity
    assert sum(b[2] for b in packed) == sum(b[2] for b in unpacked) == sum(t for _, t in sizes)
    assert max(b[0] for b in packed) > 0.8 * 128 and max(b[3] for b in packed) == 2


def test_preview_shows_the_segments_of_packed_rows(cli_in_process, tmp_path):
    import json

    train = write_rows(tmp_path / "train.jsonl", synthetic_rows(64, seed=2))
    done = cli_in_process("preview", f"--train_file={train}", "--packing=True", "--num_examples=2", "--decode=True",
                          "--max_source_len=40", "--max_target_len=40")
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert len(row["input_ids"]) == len(row["source_segments"]) <= 40
        assert len(row["labels"]) == len(row["target_segments"]) <= 40
        assert row["source_segments"][0] == 1 and max(row["source_segments"]) == len(row["examples"]) > 1
        assert len(row["segments_text"]) == len(row["examples"])


def test_a_killed_packed_run_resumes_bit_identically(kill_at_first_checkpoint_and_resume, run_cli, tmp_path):
    from safetensors.torch import load_file

    train = write_rows(tmp_path / "train.jsonl", synthetic_rows(120, seed=6))
    args = ["--model_preset=tiny", f"--train_file={train}", f"--eval_file={train}", "--max_steps=6", "--save_steps=2",
            "--eval_steps=0", "--max_eval_samples=4", "--eval_generate=False", "--gradient_accumulation_steps=2",
            "--batch_size=4", "--packing=True", "--logging_steps=1"]
    straight = tmp_path / "straight"
    done = run_cli("train", f"--output_dir={straight}", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    broken = tmp_path / "broken"
    kill_at_first_checkpoint_and_resume(broken, args, tmp_path / "killed.log", wait_s=300)
    a, b = (load_file(str(run / "final" / "model.safetensors")) for run in (straight, broken))
    assert all(torch.equal(a[k], b[k]) for k in a)
    losses = [[(r["step"], r["loss"], r["examples_per_row"]) for r in metrics(run) if r["event"] == "train"]
              for run in (straight, broken)]
    assert losses[0] == losses[1] and len(losses[0]) == 6
