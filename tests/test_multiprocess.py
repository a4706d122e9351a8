"""`accelerate launch` with two CPU processes over gloo: disjoint data, agreement at epoch ends."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter

import pytest
from conftest import REPO, metrics, synthetic_rows, write_rows

pytestmark = pytest.mark.slow


def accelerate_launch(*args: str, processes: int = 2) -> subprocess.CompletedProcess:
    # `accelerate launch --cpu --num_processes 2` starts one process; this form starts two gloo ranks.
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
           "29517", str(REPO / "train_low_mem.py"), "train", "--cpu=True", *args]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)


def test_two_processes_share_each_epoch_exactly_once(tmp_path):
    # 33 rows in one file: the processes hold 17 and 16 rows, so one of them runs dry first at
    # each epoch's end and must still take part in the last gradient all-reduce.
    train = write_rows(tmp_path / "train.jsonl", synthetic_rows(33, seed=1))
    evals = write_rows(tmp_path / "eval.jsonl", synthetic_rows(7, seed=2))  # 4 + 3 eval rows
    out = tmp_path / "run"
    proc = accelerate_launch(f"--train_file={train}", f"--eval_file={evals}", f"--output_dir={out}", "--epochs=2",
                             "--gradient_accumulation_steps=4", "--eval_steps=2", "--save_steps=2", "--logging_steps=1",
                             "--max_source_len=32", "--max_target_len=32", "--dump_consumed=True")
    assert proc.returncode == 0, proc.stderr[-3000:]
    train_records = [r for r in metrics(out) if r["event"] == "train"]
    assert [r["examples"] for r in train_records if r["step"] in (3, 6)] == [33, 66]
    assert train_records[-1]["step"] == 6  # ceil(ceil(17 / 2) / 4) = 3 steps per epoch
    assert all(r["eval_examples"] == 7 for r in metrics(out) if r["event"] == "eval")
    lines = [ln.split("\t") for rank in (0, 1) for ln in (out / f"consumed-rank{rank}.tsv").read_text().splitlines()]
    for epoch in ("0", "1"):
        seen = Counter(int(row) for e, _, _, row in lines if e == epoch)
        assert sorted(seen) == list(range(33)) and max(seen.values()) == 1
    assert {rank for _, rank, _, _ in lines} == {"0", "1"}
    assert (out / "best" / "model.safetensors").is_file() and (out / "final" / "model.safetensors").is_file()
