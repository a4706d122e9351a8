"""The real entry point, end to end on tiny sizes: files on disk, metrics.jsonl, export, resume, memory."""

from __future__ import annotations

import json

import torch
from conftest import metrics, synthetic_rows, write_rows
from safetensors.torch import load_file

SMALL = ["--max_source_len=32", "--max_target_len=32", "--max_eval_samples=16", "--logging_steps=5",
         "--eval_generate=False"]


def weights(folder):
    return load_file(str(folder / "model.safetensors"))


def test_pretrain_sft_resume_and_export(tmp_path, run_cli):
    pre_train = write_rows(tmp_path / "pre" / "train.jsonl", synthetic_rows(3000, seed=1))
    pre_eval = write_rows(tmp_path / "pre" / "eval.jsonl", synthetic_rows(32, seed=2))
    sft_train = write_rows(tmp_path / "sft" / "train.parquet", synthetic_rows(2000, seed=3))
    sft_eval = write_rows(tmp_path / "sft" / "eval.parquet", synthetic_rows(32, seed=4))
    pre, sft = tmp_path / "runs" / "pre", tmp_path / "runs" / "sft"

    proc = run_cli("train", f"--train_file={pre_train}", f"--eval_file={pre_eval}", f"--output_dir={pre}",
                   "--max_steps=40", "--learn_rate=3e-3", "--eval_steps=20", "--save_steps=20",
                   "--batch_size=16", "--gradient_accumulation_steps=1", *SMALL)  # 16 rows a step, fast on CPUs
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = metrics(pre)
    train = [r for r in records if r["event"] == "train"]
    evals = [r for r in records if r["event"] == "eval"]
    assert {"loss", "lr", "tokens_per_s", "step_s", "rss_mb", "elapsed_s"} <= set(train[0])
    assert [r["step"] for r in evals] == [0, 20, 40]
    # step_s times training only: between two log lines, the steps' time plus the evaluations run
    # in between fit in the wall time that passed (evaluation counted in step_s would overflow it).
    for before, after in zip(train, train[1:]):
        steps = after["step"] - before["step"]
        eval_s = sum(r["eval_s"] for r in evals if before["step"] <= r["step"] < after["step"])
        assert 0 < after["step_s"] * steps + eval_s <= after["time"] - before["time"] + 0.01 * steps
    assert "step_s:" in proc.stdout
    assert evals[-1]["eval_loss"] < 0.7 * evals[0]["eval_loss"]
    assert {"start", "model_built", "prepared", "eval_start", "eval_end", "end"} <= {
        r["where"] for r in records if r["event"] == "memory"}
    assert (pre / "checkpoints" / "latest").read_text() == "step_000040"
    assert json.loads((pre / "config.json").read_text())["learn_rate"] == 3e-3

    # best/ is a plain transformers model folder.
    from transformers import AutoTokenizer, T5ForConditionalGeneration

    model = T5ForConditionalGeneration.from_pretrained(pre / "best")
    tok = AutoTokenizer.from_pretrained(pre / "best")
    out = model.generate(**tok(["the cat runs"], return_tensors="pt"), max_new_tokens=8)
    assert out.shape[0] == 1 and out.shape[1] > 1

    proc = run_cli("train", "--is_finetune=True", f"--init_from={pre / 'best'}", f"--train_file={sft_train}",
                   f"--eval_file={sft_eval}", f"--output_dir={sft}", "--max_steps=20", "--eval_steps=10",
                   "--save_steps=10", "--learn_rate=3e-3", "--batch_size=8", "--gradient_accumulation_steps=1", *SMALL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "frozen encoder" in proc.stdout
    before, after = weights(pre / "best"), weights(sft / "final")
    for key in before:
        if key.startswith(("encoder.", "shared.")):
            assert torch.equal(before[key], after[key]), key
    assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith("decoder."))
    assert sorted(p.name for p in (pre / "checkpoints").iterdir() if p.name.startswith("step_")) == [
        "step_000020", "step_000040"]  # SFT wrote nothing into the pretraining run

    proc = run_cli("train", "--is_finetune=True", f"--init_from={pre / 'best'}", f"--train_file={sft_train}",
                   f"--eval_file={sft_eval}", f"--output_dir={sft}", "--max_steps=30", "--eval_steps=10",
                   "--save_steps=10", "--learn_rate=3e-3", "--batch_size=8", "--gradient_accumulation_steps=1",
                   "--is_keep_training=True",
                   *SMALL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "step_000020" in proc.stdout
    steps = [r["step"] for r in metrics(sft) if r["event"] == "train"]
    assert steps[-1] == 30 and 25 in steps

    proc = run_cli("generate", f"--init_from={sft / 'best'}", "--prompt=the dog jumps", f"--eval_file={sft_eval}",
                   "--learn_rate=0.5")  # a training option: read by nothing here, and said so
    assert proc.returncode == 0 and "the dog jumps  ->" in proc.stdout
    assert "note: --learn_rate has no effect on generate (it is read by train)" in proc.stdout
    # An SFT model answering the shipped pretraining eval prompts (no --is_finetune) is told so.
    proc = run_cli("generate", f"--init_from={sft / 'best'}", "--max_eval_samples=2", "--max_new_tokens=4")
    assert proc.returncode == 0 and proc.stdout.count("  ->  ") == 2
    assert "was trained by sft, and these are the shipped pretrain eval rows" in proc.stdout
    assert "--is_finetune=True for the sft ones" in proc.stdout
    # ... and a model trained on the user's own rows scored on the shipped SFT eval rows
    proc = run_cli("generate", f"--init_from={sft / 'best'}", "--is_finetune=True", "--max_eval_samples=1",
                   "--max_new_tokens=2")
    assert proc.returncode == 0 and f"was trained on --train_file={sft_train}, and these are the shipped" in proc.stdout


def test_peak_rss_does_not_grow_with_corpus_size(tmp_path, run_cli):
    base = synthetic_rows(10_000, seed=7)  # ~1 MB
    small = write_rows(tmp_path / "small.jsonl", base)
    large = tmp_path / "large.jsonl"
    with open(large, "w", encoding="utf-8") as fh:  # 50x larger, written without holding it in memory
        for _ in range(50):
            fh.writelines(json.dumps(r) + "\n" for r in base)
    evals = write_rows(tmp_path / "eval.jsonl", synthetic_rows(8))
    peaks = {}
    for name, corpus in (("small", small), ("large", large)):
        out = tmp_path / name
        proc = run_cli("train", f"--train_file={corpus}", f"--eval_file={evals}", f"--output_dir={out}",
                       "--max_steps=30", "--eval_steps=0", "--save_steps=0", "--shuffle_buffer_size=1000",
                       "--gradient_accumulation_steps=4", *SMALL)  # 30 steps of 8 rows
        assert proc.returncode == 0, proc.stderr[-3000:]
        peaks[name] = [r for r in metrics(out) if r["event"] == "memory" and r["where"] == "end"][-1]["peak_rss_mb"]
    assert large.stat().st_size > 50 * small.stat().st_size * 0.99
    assert peaks["large"] - peaks["small"] < 64, peaks


def test_own_train_file_without_eval_file_holds_out_its_last_rows(tmp_path, run_cli):
    """Your own --train_file and no --eval_file: its last rows are the eval set (not the shipped eval
    split, of another corpus), announced, never trained on, found again by `evaluate`, and a resume that
    would hold out other rows is refused."""
    train = write_rows(tmp_path / "train.jsonl", synthetic_rows(300, seed=8))
    out = tmp_path / "run"
    # Named twice (a slip in a comma list), the file is read once: no row trains twice, none held out
    common = [f"--train_file={train},{train}", f"--output_dir={out}", "--eval_steps=0", "--save_steps=50",
              "--gradient_accumulation_steps=2", "--dump_consumed=True", *SMALL[:2], "--max_eval_samples=12"]
    proc = run_cli("train", *common, "--max_new_tokens=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "note: --max_new_tokens has no effect on train (it is read by generate)" in proc.stdout
    assert "eval rows 12 from the last 12 rows of --train_file" in proc.stdout
    assert f"read once: 1 file(s) that --train_file reaches more than once: {train}" in proc.stdout
    records = metrics(out)
    setup = next(r for r in records if r["event"] == "setup")
    assert (setup["train_rows"], setup["held_out_rows"], setup["eval_rows"]) == (288, 12, 12)
    assert [r["eval_examples"] for r in records if r["event"] == "eval"] == [12]
    consumed = [line.split("\t") for line in (out / "consumed-rank0.tsv").read_text().splitlines()]
    assert sorted(int(row) for *_, row in consumed) == list(range(288))  # rows 288-299 never trained on

    # The default --max_eval_samples (100) would hold out 30 rows, 18 of them trained on: the model's 12 are read
    proc = run_cli("evaluate", f"--init_from={out / 'best'}", f"--train_file={train}", *SMALL[:2])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eval_examples: 12" in proc.stdout and "evaluating the 12 rows training held out" in proc.stdout
    assert f"eval_file:     the rows held out of --train_file={train}" in proc.stdout
    fewer = run_cli("evaluate", f"--init_from={out / 'best'}", f"--train_file={train}", *SMALL[:2],
                    "--max_eval_samples=4", "--eval_generate=False", "--repetition_penalty=1.2")  # the first 4, said
    assert fewer.returncode == 0 and "eval_examples: 4" in fewer.stdout, fewer.stderr[-3000:]
    assert "--repetition_penalty has no effect with --eval_generate=False" in fewer.stdout + fewer.stderr
    assert "evaluating the first 4 of the 12 rows training held out" in fewer.stdout
    bad = tmp_path / "bad_eval.jsonl"  # a broken line among an --eval_file's rows is said and counted
    bad.write_text(write_rows(tmp_path / "good.jsonl", synthetic_rows(2, seed=3)).read_text() + "{not json\n")
    proc = run_cli("evaluate", f"--init_from={out / 'best'}", f"--eval_file={bad}", "--eval_generate=False")
    assert proc.returncode == 0 and "eval_examples: 2" in proc.stdout, proc.stderr[-3000:]
    assert "skipping bad row" in proc.stdout and "1 bad eval row(s) skipped" in proc.stdout

    before = [(out / name).read_bytes() for name in ("config.json", "metrics.jsonl")]
    proc = run_cli("train", *common[:-1], "--max_eval_samples=20", "--epochs=2", "--is_keep_training=True")
    assert proc.returncode == 2
    assert "held out 12 rows of --train_file for evaluation, this run would hold out 20" in proc.stderr
    # the refused resume left the run's records and configuration as they were
    assert [(out / name).read_bytes() for name in ("config.json", "metrics.jsonl")] == before
