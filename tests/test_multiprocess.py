"""`accelerate launch` with two CPU processes over gloo: disjoint data, agreement at epoch ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import LAUNCH_ENV, REPO, metrics, synthetic_rows, write_rows

ENV = LAUNCH_ENV


def test_two_processes_share_each_epoch_exactly_once(tmp_path, accelerate_launch):
    # 11 files of 3 rows: each file is split between the processes, 1 row to rank 0 and 2 to rank 1,
    # so rank 1 holds 22 of the 33 rows (not 17), rank 0 runs dry first at each epoch's end and must
    # still take part in the last gradient all-reduces, and the epoch has ceil(22 / (2 x 2)) = 6 steps.
    rows = synthetic_rows(33, seed=1)
    folder = tmp_path / "train"
    for i in range(11):
        write_rows(folder / f"part{i:02d}.jsonl", rows[3 * i:3 * i + 3])
    evals = write_rows(tmp_path / "eval.jsonl", synthetic_rows(7, seed=2))  # 4 + 3 eval rows
    out = tmp_path / "run"
    proc = accelerate_launch(f"--train_file={folder}", f"--eval_file={evals}", f"--output_dir={out}", "--epochs=2",
                             "--gradient_accumulation_steps=2", "--eval_steps=6", "--save_steps=6", "--logging_steps=1",
                             "--warmup_steps=2", "--max_source_len=32", "--max_target_len=32", "--dump_consumed=True",
                             port=29518)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = metrics(out)
    train_records = [r for r in records if r["event"] == "train"]
    assert [r["examples"] for r in train_records if r["step"] in (6, 12)] == [33, 66]
    assert [r["epoch"] for r in train_records if r["step"] in (5, 6, 12)] == [0, 1, 2]  # counted at its last step
    setup = next(r for r in records if r["event"] == "setup")
    assert setup["total_steps"] == train_records[-1]["step"] == 12
    # Every step trains: warmup's first step is not at rate 0, the last one is the decay's last (1/10).
    assert train_records[0]["lr"] == pytest.approx(3e-3 / 3) and train_records[-1]["lr"] == pytest.approx(3e-3 / 10)
    assert [r["step"] for r in records if r["event"] == "eval"] == [0, 6, 12]  # the last step evaluated once
    assert all(r["eval_examples"] == 7 for r in records if r["event"] == "eval")
    lines = [ln.split("\t") for rank in (0, 1) for ln in (out / f"consumed-rank{rank}.tsv").read_text().splitlines()]
    for epoch in ("0", "1"):
        seen = Counter((Path(path).name, int(row)) for e, _, path, row in lines if e == epoch)
        assert sorted(seen) == sorted((f"part{i:02d}.jsonl", r) for i in range(11) for r in range(3))
        assert max(seen.values()) == 1
    assert Counter(rank for _, rank, _, _ in lines) == {"0": 22, "1": 44}
    assert (out / "best" / "model.safetensors").is_file() and (out / "final" / "model.safetensors").is_file()


def test_two_processes_give_the_gradient_of_one_big_batch_and_sft_runs(tmp_path, accelerate_launch, run_cli):
    """2 processes x micro-batch 2 x accumulation 16 = one process x 64 rows in one step.

    Adafactor's step depends on the gradient, so equal weights after one step (to float summation
    order) mean the all-reduced, globally token-normalised gradient equals the single-process one.
    """
    train = write_rows(tmp_path / "train.jsonl", synthetic_rows(64, seed=9))
    evals = write_rows(tmp_path / "eval.jsonl", synthetic_rows(5, seed=2))
    common = [f"--train_file={train}", f"--eval_file={evals}", "--max_steps=1", "--shuffle_buffer_size=0",
              "--dropout_rate=0", "--warmup_steps=0", "--lr_scheduler=constant", "--eval_steps=0",
              "--max_source_len=32", "--max_target_len=32"]
    two = accelerate_launch(*common, f"--output_dir={tmp_path / 'two'}", "--gradient_accumulation_steps=16", port=29519)
    assert two.returncode == 0, two.stderr[-3000:]
    one = run_cli("train", *common, f"--output_dir={tmp_path / 'one'}", "--gradient_accumulation_steps=32")
    assert one.returncode == 0, one.stderr[-3000:]
    import torch
    from safetensors.torch import load_file

    a = load_file(str(tmp_path / "two" / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "one" / "final" / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        diff = (a[key] - b[key]).norm() / b[key].norm()
        assert diff <= 1e-5, (key, float(diff))
    # Adafactor's first update is close to sign(g), so also compare scale-sensitive numbers: the
    # gradient norm before clipping and the token-mean loss.
    two_step = [r for r in metrics(tmp_path / "two") if r["event"] == "train"][-1]
    one_step = [r for r in metrics(tmp_path / "one") if r["event"] == "train"][-1]
    assert two_step["grad_norm"] == pytest.approx(one_step["grad_norm"], rel=1e-5)
    assert two_step["loss"] == pytest.approx(one_step["loss"], rel=1e-5)
    assert two_step["examples"] == one_step["examples"] == 64
    assert len(two_step["rss_mb_per_process"]) == 2
    # The plan counts DDP's extra copy of the gradients (accumulation 16) and stays near the measurement.
    plan = next(r for r in metrics(tmp_path / "two") if r["event"] == "memory_plan")
    peak = next(r for r in metrics(tmp_path / "two") if r["event"] == "memory_peak")
    assert plan["host_mb"]["ddp_gradient_copy"] == plan["host_mb"]["weights"] > 0  # pretraining: every weight
    assert 0.6 <= peak["host_ratio"] <= 1.4, peak  # a sanity band; bench/memory_modes.py checks +-15%
    assert len(peak["measured_host_peak_mb_per_process"]) == 2  # the figure is the larger process's
    assert peak["measured_host_peak_mb"] == max(peak["measured_host_peak_mb_per_process"])
    assert two_step["target_tokens"] == one_step["target_tokens"] > 0  # the same window's targets, all processes'

    # SFT from that model on two processes: frozen encoder, decoder trains, best/ exported.
    sft = tmp_path / "sft"
    proc = accelerate_launch(f"--train_file={train}", f"--eval_file={evals}", "--is_finetune=True",
                             f"--init_from={tmp_path / 'two' / 'final'}", f"--output_dir={sft}", "--max_steps=3",
                             "--gradient_accumulation_steps=4", "--eval_steps=0", "--max_source_len=32",
                             "--max_target_len=32", port=29520)
    assert proc.returncode == 0, proc.stderr[-3000:]
    before, after = load_file(str(tmp_path / "two" / "final" / "model.safetensors")), load_file(
        str(sft / "final" / "model.safetensors"))
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith(("encoder.", "shared.")))
    assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith("decoder."))


def test_two_process_kill_and_resume_is_bit_identical(tmp_path, accelerate_launch, processes):
    # Two files of unequal size: each process reads whole files, and the one with the smaller file
    # runs dry first in every epoch.
    a = write_rows(tmp_path / "a.jsonl", synthetic_rows(180, seed=5))
    b = write_rows(tmp_path / "b.jsonl", synthetic_rows(97, seed=6))
    evals = write_rows(tmp_path / "eval.jsonl", synthetic_rows(5, seed=2))
    common = [f"--train_file={a},{b}", f"--eval_file={evals}", "--epochs=2", "--save_steps=2", "--eval_steps=0",
              "--gradient_accumulation_steps=4", "--shuffle_buffer_size=32", "--logging_steps=1",
              "--dump_consumed=True", "--max_source_len=32", "--max_target_len=32"]
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    proc = accelerate_launch(*common, f"--output_dir={straight}", port=29521)
    assert proc.returncode == 0, proc.stderr[-3000:]

    child = processes.popen(processes.launch_command(*common, f"--output_dir={broken}", port=29522), cwd=REPO, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    latest, deadline = broken / "checkpoints" / "latest", time.time() + 300
    while not (latest.exists() and latest.read_text() >= "step_000016"):
        assert child.poll() is None and time.time() < deadline, "the run ended before its step-16 checkpoint"
        time.sleep(0.05)
    os.killpg(child.pid, signal.SIGKILL)  # the launcher and both workers, as a scheduler would
    child.wait()
    proc = accelerate_launch(*common, f"--output_dir={broken}", "--is_keep_training=True", port=29523)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout

    import torch
    from safetensors.torch import load_file

    x = load_file(str(straight / "final" / "model.safetensors"))
    y = load_file(str(broken / "final" / "model.safetensors"))
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    for run in (straight, broken):
        lines = [ln.split("\t") for r in (0, 1) for ln in (run / f"consumed-rank{r}.tsv").read_text().splitlines()]
        for epoch in ("0", "1"):
            seen = Counter((f, int(row)) for e, _, f, row in lines if e == epoch)
            assert set(seen) == {(str(a), i) for i in range(180)} | {(str(b), i) for i in range(97)}
            assert max(seen.values()) == 1


CONFIGS = sorted((REPO / "accelerate_configs").glob("*.yaml"))


def test_shipped_accelerate_configs_load_and_the_cpu_one_starts_two_processes(tmp_path, processes):
    from accelerate.commands.config.config_args import ClusterConfig

    kinds = {path.stem: ClusterConfig.from_yaml_file(str(path)).distributed_type.value for path in CONFIGS}
    assert kinds == {"cpu_2proc": "MULTI_GPU", "multi_gpu": "MULTI_GPU", "fsdp": "FSDP", "fsdp_cpu": "FSDP",
                     "deepspeed_zero3_cpu": "DEEPSPEED",
                     **{f"deepspeed_zero{z}{o}": "DEEPSPEED" for z in (2, 3) for o in ("", "_offload")}}
    train = write_rows(tmp_path / "train.jsonl", synthetic_rows(20, seed=1))
    evals = write_rows(tmp_path / "eval.jsonl", synthetic_rows(3, seed=2))
    # As a user types it: no ACCELERATE_USE_CPU, no --cpu=True. accelerate alone would run every process on
    # its own (the whole run on each); with no GPU the trainer makes them a gloo group.
    user_env = {k: v for k, v in ENV.items() if k != "ACCELERATE_USE_CPU"}
    proc = processes.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                          str(REPO / "accelerate_configs" / "cpu_2proc.yaml"), "--main_process_port", "29541",
                          str(REPO / "train_low_mem.py"), "train", f"--train_file={train}",
                          f"--eval_file={evals}", f"--output_dir={tmp_path / 'run'}", "--max_steps=1",
                          "--gradient_accumulation_steps=2", "--eval_steps=0"],
                          cwd=REPO, capture_output=True, text=True, timeout=600, env=user_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert next(r for r in metrics(tmp_path / "run") if r["event"] == "setup")["world_size"] == 2


@pytest.mark.gpu
def test_deepspeed_zero2_config_trains_on_a_gpu(tmp_path, processes):
    pytest.importorskip("deepspeed")
    proc = processes.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                          str(REPO / "accelerate_configs" / "deepspeed_zero2.yaml"), "--num_processes", "1",
                          str(REPO / "train_low_mem.py"), "train", "--optimizer=adamw", "--max_steps=2",
                          "--gradient_accumulation_steps=2", "--eval_steps=0", "--max_eval_samples=4",
                          f"--output_dir={tmp_path / 'run'}"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
    assert (tmp_path / "run" / "checkpoints" / "step_000002" / "deepspeed").is_dir()


def test_a_mistake_met_by_every_process_is_printed_once(tmp_path, accelerate_launch):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt or response column"}\n')
    proc = accelerate_launch(f"--train_file={bad}", f"--eval_file={bad}", f"--output_dir={tmp_path / 'run'}",
                             port=29543)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if "error: --train_file" in line]
    assert len(lines) == 1 and lines[0].startswith("error: --train_file") and "--prompt_column" in lines[0], \
        proc.stderr[-3000:]


def test_two_processes_pack_disjoint_documents_for_span_corruption(tmp_path, accelerate_launch):
    # Raw text on 2 processes, 2 epochs without --max_steps: each process packs its own documents (a
    # contiguous share of the file), the steps are counted from the corpus's tokens, and every step trains.
    from test_span_corruption_training import write_corpus

    txt, _ = write_corpus(tmp_path, 120)
    out = tmp_path / "run"
    proc = accelerate_launch("--objective=span_corruption", f"--train_file={txt}", f"--output_dir={out}", "--epochs=2",
                             "--gradient_accumulation_steps=2", "--max_eval_samples=4", "--logging_steps=1",
                             "--eval_steps=1000", "--save_steps=1000", "--dump_consumed=True", port=29544)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = metrics(out)
    train_records = [r for r in records if r["event"] == "train"]
    setup = next(r for r in records if r["event"] == "setup")
    assert setup["total_steps"] == train_records[-1]["step"] and train_records[-1]["epoch"] == 2
    lines = [ln.split("\t") for rank in (0, 1) for ln in (out / f"consumed-rank{rank}.tsv").read_text().splitlines()]
    documents = [{int(row) for _, r, _, row in lines if r == rank} for rank in ("0", "1")]
    held_out = 120 - len(documents[0] | documents[1])  # the last rows of the file are the eval documents
    assert not documents[0] & documents[1] and documents[0] | documents[1] == set(range(120 - held_out))
    assert 0 < held_out <= 4
