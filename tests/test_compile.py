"""--torch_compile=True: training micro-batches padded to length buckets, the encoder and decoder stacks compiled
once per bucket they meet (never again, whatever the rows), and the loss of every step that of an eager run."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import metrics, synthetic_rows, write_rows

from data.collate import length_buckets, micro_batches, pad, round_up


def test_lengths_round_up_to_the_buckets_of_each_sides_longest():
    assert length_buckets((128, 128)) == (16, 32, 64, 128)
    assert length_buckets((100, 128)) == (16, 32, 64, 100, 128)
    assert length_buckets((512, 64), multiple=16) == (16, 32, 64, 128, 256, 512)
    assert length_buckets((40, 24), multiple=16) == (16, 32, 48)  # each side's longest, padded as bf16 pads
    buckets = length_buckets((128, 128))
    assert [round_up(n, buckets) for n in (1, 16, 17, 33, 64, 65, 128)] == [16, 16, 32, 64, 64, 128, 128]
    ids, mask = pad([[5] * 3, [6] * 20], value=0, multiple=buckets)
    assert ids.shape == (2, 32) and int(mask.sum()) == 23
    # a token budget counts the padded lengths the rows will have
    assert micro_batches([3, 20], [3, 20], batch_size=8, max_tokens=64, multiple=buckets) == [[0], [1]]


def corpus(path, n: int, seed: int):
    """Pairs whose targets fall in both buckets of a 32-token limit (16 and 32)."""
    rng = random.Random(seed)
    rows = synthetic_rows(n, seed=seed)
    for row in rows[::3]:
        row["response"] = " ".join([row["response"]] * rng.randint(2, 3))
    return write_rows(path, rows)


# Sources cut at 16 tokens (one bucket), targets at 32 (two): the encoder compiles one graph, the decoder two (its
# graphs are specialised to the (source, target) pair of buckets). Inductor takes ~25 s a graph on 2 cores.
LENGTHS = ["--max_source_len=16", "--max_target_len=32"]


def train_records(run) -> list[dict]:
    return [r for r in metrics(run) if r["event"] == "train"]


def test_compiled_steps_match_eager_and_compile_once_per_length_bucket(run_cli, tmp_path):
    train = corpus(tmp_path / "train.jsonl", 200, seed=1)
    common = ["train", "--model_preset=tiny", f"--train_file={train}", f"--eval_file={train}", "--max_steps=10",
              "--batch_size=4", "--gradient_accumulation_steps=2", *LENGTHS, "--dropout_rate=0", "--eval_steps=0",
              "--save_steps=0", "--logging_steps=1", "--max_eval_samples=4",
              "--eval_generate=False", "--warmup_steps=2"]
    runs = {compiled: tmp_path / f"compiled-{compiled}" for compiled in (False, True)}
    logs = {}
    for compiled, run in runs.items():
        done = run_cli(*common, f"--output_dir={run}", f"--torch_compile={compiled}")
        assert done.returncode == 0, done.stderr[-3000:]
        logs[compiled] = done.stdout + done.stderr
    eager, compiled = (train_records(run) for run in runs.values())
    assert [r["loss"] for r in compiled] == pytest.approx([r["loss"] for r in eager], abs=1e-4)
    # every bucket met (encoder 16; decoder 16 + 16 and 16 + 32) compiled once: graphs == buckets at every step
    assert [(r["compiled_buckets"], r["compiled_graphs"]) for r in compiled][-1] == (3, 3)
    assert all(r["compiled_graphs"] == r["compiled_buckets"] for r in compiled)
    assert logs[True].count("torch.compile: compiling the") == 3 and "torch.compile" not in logs[False]
    assert compiled[-1]["padding_pct"] > eager[-1]["padding_pct"]  # buckets pad more than the longest row


@pytest.mark.parametrize("flags", [
    ["--lora_r=4", "--mixed_precision=bf16", "--gradient_accumulation_steps=3"],
    ["--packing=True", "--mixed_precision=fp16", "--gradient_checkpointing=True"],
], ids=["lora-bf16-accumulation", "packing-fp16-checkpointing"])
def test_compiled_sft_with_memory_modes_follows_eager(run_cli, family_models, tmp_path, flags):
    train = corpus(tmp_path / "train.jsonl", 200, seed=2)
    common = ["train", "--is_finetune=True", f"--init_from={family_models['v1_1']}", f"--train_file={train}",
              f"--eval_file={train}", "--max_steps=4", "--batch_size=4", *LENGTHS, "--dropout_rate=0", "--eval_steps=0",
              "--save_steps=0", "--logging_steps=1", "--max_eval_samples=4",
              "--eval_generate=False", "--torch_compile_backend=aot_eager", *flags]
    runs = {compiled: tmp_path / f"compiled-{compiled}" for compiled in (False, True)}
    for compiled, run in runs.items():
        done = run_cli(*common, f"--output_dir={run}", f"--torch_compile={compiled}")
        assert done.returncode == 0, done.stderr[-3000:]
    eager, compiled = (train_records(run) for run in runs.values())
    assert [r["loss"] for r in compiled] == pytest.approx([r["loss"] for r in eager], rel=2e-3)
    assert compiled[-1]["compiled_graphs"] == compiled[-1]["compiled_buckets"] >= 2


def test_compile_refusals_are_one_line(cli_in_process, tmp_path):
    done = cli_in_process("train", "--torch_compile=True", "--torch_compile_backend=nope",
                          f"--output_dir={tmp_path / 'run'}")
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1 and "--torch_compile_backend must be" in errors[0], done.stderr
    assert not (tmp_path / "run").exists()


def test_a_compiled_stack_runs_eager_outside_training():
    from transformers import T5Config, T5ForConditionalGeneration

    from lowmem.model.compiled import CompiledStacks

    model = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_ff=32, d_kv=4, num_heads=2, num_layers=1,
                                                decoder_start_token_id=0, pad_token_id=0))
    stacks = CompiledStacks(True, backend="eager")  # (dynamo's capture alone: the fast subset stays fast)
    stacks.install(model, (16, 32), say=lambda _line: None)
    ids = torch.randint(1, 64, (2, 16))
    model.eval()
    with torch.no_grad():
        model(input_ids=ids, labels=ids)
        model.generate(input_ids=ids, max_new_tokens=3)
    assert stacks.log_fields() == {"compiled_buckets": 0, "compiled_graphs": 0}
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    assert stacks.log_fields() == {"compiled_buckets": 2, "compiled_graphs": 2}


def test_two_processes_train_compiled_as_they_train_eager(accelerate_launch, tmp_path):
    train = corpus(tmp_path / "train.jsonl", 200, seed=3)
    common = ["--model_preset=tiny", f"--train_file={train}", f"--eval_file={train}", "--max_steps=4", "--batch_size=4",
              "--gradient_accumulation_steps=2", *LENGTHS, "--dropout_rate=0", "--eval_steps=0", "--save_steps=0",
              "--logging_steps=1", "--max_eval_samples=4", "--eval_generate=False", "--torch_compile_backend=aot_eager"]
    runs = {compiled: tmp_path / f"compiled-{compiled}" for compiled in (False, True)}
    for (compiled, run), port in zip(runs.items(), (29561, 29562)):
        done = accelerate_launch(*common, f"--output_dir={run}", f"--torch_compile={compiled}", port=port)
        assert done.returncode == 0, done.stderr[-3000:]
    eager, compiled = (train_records(run) for run in runs.values())
    assert [r["loss"] for r in compiled] == pytest.approx([r["loss"] for r in eager], abs=1e-5)
    assert compiled[-1]["compiled_graphs"] == compiled[-1]["compiled_buckets"] >= 2  # (the main process's)
