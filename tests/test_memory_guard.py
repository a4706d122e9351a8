"""The memory guard within an optimizer step: read after every micro-batch, a window over budget is dropped
before its optimizer step, the last step's checkpoint is written, and the run resumes exactly; with two
processes, one over budget stops both. The budget is crossed by a real micro-batch: two long rows (1,536
source and target tokens on the tiny model: about 1 GiB of activations, freed by the end of its backward)
among short ones, its window's third and fourth micro-batches (a window is ordered by length, ties in stream
order). The budget is set between the peaks an unguarded run of the same data measured before and during it."""

from __future__ import annotations

import random
import sys
from pathlib import Path

from conftest import WORDS, metrics, synthetic_rows, write_rows
from test_faults import error_line

from lowmem.checkpointing import checkpoint
from lowmem.memory.guard import MEMORY_GUARD_AT

LONG = ["--batch_size=1", "--gradient_accumulation_steps=4", "--shuffle_buffer_size=0", "--max_source_len=1536",
        "--max_target_len=1536", "--eval_steps=0", "--eval_generate=False", "--max_eval_samples=8",
        "--logging_steps=1", "--dump_consumed=True"]


def rows_with_long_pair(n: int, at: int) -> list[dict]:
    """``n`` short rows, rows ``at`` and ``at + 1`` replaced by one long row (3,000 words each side) twice."""
    rows = synthetic_rows(n, seed=1)
    rng = random.Random(3)
    words = [rng.choice(WORDS) for _ in range(3000)]
    rows[at] = rows[at + 1] = {"prompt": " ".join(words), "response": " ".join(reversed(words))}
    return rows


def budget_between(before_mb: float, during_mb: float) -> float:
    """The --max_rss_gb whose guard lies halfway between two measured peaks (MiB)."""
    assert during_mb - before_mb > 500, (before_mb, during_mb)  # the long micro-batch is what crosses it
    return round((before_mb + during_mb) / 2 / 1024 / MEMORY_GUARD_AT, 3)


def final_weights(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run / "final" / "model.safetensors"))


def assert_same_weights(a: Path, b: Path) -> None:
    import torch

    x, y = final_weights(a), final_weights(b)
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_a_transient_peak_trips_the_guard_and_check_names_where(processes):
    # In a fresh interpreter: its high-water mark is its own. 400 MiB allocated and freed before the reading
    # (a block that size is mapped and unmapped): the RSS read afterwards is under the limit, the peak is not.
    code = """
import torch
from lowmem.hardware.memory_use import rss_and_peak_bytes
from lowmem.memory.guard import MEMORY_GUARD_AT, MemoryGuard, StoppedForMemory
rss, _ = rss_and_peak_bytes()
budget = (rss + 200 * 2**20) / MEMORY_GUARD_AT / 2**30
guard = MemoryGuard(budget)
assert not guard.over("nothing yet") and not MemoryGuard(0).over("off")
block = torch.ones(100 * 2**20)  # 400 MiB, every page written
del block
now, peak = rss_and_peak_bytes()
assert now < guard.limit <= peak, (now, guard.limit, peak)
assert guard.over("after the block") and guard.tripped == "after the block"
assert guard.over("later") and guard.tripped == "after the block"  # it stays tripped, where it first did
try:
    guard.check("loading encoder.block.0 from model.safetensors", "load with --frozen_dtype=int8")
except StoppedForMemory as stop:
    print(stop)
"""
    proc = processes.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = proc.stdout.strip()
    assert line.startswith("memory guard: RSS") and "while after the block" in line and "--frozen_dtype=int8" in line


def test_a_budget_passed_mid_window_drops_the_window_saves_the_step_before_and_resumes_exactly(tmp_path, run_cli):
    train = write_rows(tmp_path / "train.jsonl", rows_with_long_pair(24, at=10))  # step 3: rows 8-11
    evals = write_rows(tmp_path / "eval.jsonl", synthetic_rows(8, seed=2))
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    common = [f"--train_file={train}", f"--eval_file={evals}", "--max_steps=5", *LONG]
    proc = run_cli("train", *common, f"--output_dir={straight}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    peaks = {r["step"]: r["peak_rss_mb"] for r in metrics(straight) if r["event"] == "train"}
    budget = budget_between(peaks[2], peaks[3])

    guarded = [*common, f"--output_dir={broken}", f"--max_rss_gb={budget}"]
    proc = run_cli("train", *guarded)
    assert proc.returncode == 3, proc.stderr[-3000:]
    line = error_line(proc)
    assert f"reached 90% of --max_rss_gb={budget:g} in micro-batch 3 of 4 of step 3, before its optimizer step" in line
    assert "step_000002 (step 2)" in line and "--is_keep_training=True" in line
    # the checkpoint of step 2, complete, and nothing else: no step 3, no staging folder left
    assert sorted(p.name for p in (broken / "checkpoints").iterdir()) == ["latest", "step_000002"]
    assert checkpoint.validate(broken / "checkpoints" / "step_000002") is None
    records = metrics(broken)
    assert [r["step"] for r in records if r["event"] == "train"] == [1, 2]  # step 3 was never taken
    [stop] = [r for r in records if r["event"] == "memory_guard"]
    assert stop["where"].startswith("in micro-batch 3 of 4 of step 3") and stop["rss_gb"] * 1024 > budget * 0.9 * 1024

    # under the same budget again: a note says the plan is above the guard, the same stop, the same checkpoint
    proc = run_cli("train", *guarded, "--is_keep_training=True")
    assert proc.returncode == 3 and "above the memory guard" in proc.stdout, proc.stdout[-2000:]
    assert "in micro-batch 3 of 4 of step 3" in error_line(proc)
    assert sorted(p.name for p in (broken / "checkpoints").iterdir()) == ["latest", "step_000002"]

    proc = run_cli("train", *common, f"--output_dir={broken}", "--is_keep_training=True")  # more memory: finishes
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stderr[-3000:]
    assert_same_weights(straight, broken)
    losses = [{r["step"]: r["loss"] for r in metrics(run) if r["event"] == "train"} for run in (straight, broken)]
    assert losses[0] == losses[1] and sorted(losses[1]) == [1, 2, 3, 4, 5]
    assert (straight / "consumed-rank0.tsv").read_text() == (broken / "consumed-rank0.tsv").read_text()


def test_one_process_over_budget_mid_window_stops_both_and_the_run_resumes_exactly(tmp_path, accelerate_launch):

    # One file of 24 rows: process 0 reads rows 0-11, process 1 rows 12-23; the long pair is process 1's
    # rows 6-7, the third and fourth micro-batches of its second window. Process 0 never comes near the budget.
    train = write_rows(tmp_path / "train.jsonl", rows_with_long_pair(24, at=18))
    evals = write_rows(tmp_path / "eval.jsonl", synthetic_rows(8, seed=2))
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    common = [f"--train_file={train}", f"--eval_file={evals}", "--max_steps=3", *LONG]
    proc = accelerate_launch(*common, f"--output_dir={straight}", port=29531)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [peak] = [r for r in metrics(straight) if r["event"] == "memory_peak"]
    budget = budget_between(*peak["measured_host_peak_mb_per_process"])

    proc = accelerate_launch(*common, f"--output_dir={broken}", f"--max_rss_gb={budget}", port=29532)
    assert proc.returncode != 0  # the launcher's own code, once its workers stopped with 3
    assert proc.stderr.count("error: memory guard") == 1, proc.stderr[-3000:]  # the same line on both, printed once
    assert ("memory guard: RSS of process 1 (peak" in proc.stderr and f"of --max_rss_gb={budget:g} in micro-batch 3 "
            "of 4 of step 2, before its optimizer step" in proc.stderr and "step_000001 (step 1)" in proc.stderr)
    assert "exitcode  : 3" in proc.stderr  # (torch's summary of the failed workers)
    assert sorted(p.name for p in (broken / "checkpoints").iterdir()) == ["latest", "step_000001"]
    assert checkpoint.validate(broken / "checkpoints" / "step_000001") is None
    records = metrics(broken)
    assert [r["step"] for r in records if r["event"] == "train"] == [1]
    assert [r["process"] for r in records if r["event"] == "memory_guard"] == [1]

    proc = accelerate_launch(*common, f"--output_dir={broken}", "--is_keep_training=True", port=29533)
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stderr[-3000:]
    assert_same_weights(straight, broken)
    for rank in (0, 1):
        assert (straight / f"consumed-rank{rank}.tsv").read_text() == (broken / f"consumed-rank{rank}.tsv").read_text()
