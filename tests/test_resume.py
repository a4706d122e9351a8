"""Exact, crash-safe resume: kills at random moments, SIGTERM, damaged checkpoints, consumed logs."""

from __future__ import annotations

import json
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import REPO, metrics, synthetic_rows, write_rows
from safetensors.torch import load_file

from lowmem.checkpointing import checkpoint
from lowmem.utils.errors import UserError

SMALL = ["--max_source_len=32", "--max_target_len=32", "--max_eval_samples=8", "--logging_steps=2",
         "--eval_generate=False"]


@pytest.fixture(scope="session")
def launch(processes):
    def launch(args: list[str], log: Path) -> subprocess.Popen:
        """Start a training process whose output goes to ``log`` (a pipe nobody reads could block it)."""
        with open(log, "w") as fh:
            return processes.popen([sys.executable, str(REPO / "train_low_mem.py"), "train", *args], cwd=REPO,
                                   stdout=fh, stderr=subprocess.STDOUT, text=True)
    return launch


def assert_same_training(straight: Path, broken: Path) -> str:
    """The two runs' final weights, logged losses (and padding shares: an interval a resume cut in two counted
    only its second part's) and consumed logs are identical; returns the consumed log."""
    a, b = (load_file(str(run / "final" / "model.safetensors")) for run in (straight, broken))
    assert all(torch.equal(a[k], b[k]) for k in a)
    losses = [{r["step"]: (r["loss"], r["padding_pct"]) for r in metrics(run) if r["event"] == "train"}
              for run in (straight, broken)]
    assert losses[0] == losses[1]
    consumed = [(run / "consumed-rank0.tsv").read_text() for run in (straight, broken)]
    assert consumed[0] == consumed[1]
    return consumed[0]


def train_losses(run: Path) -> dict[int, float]:
    records = [r for r in metrics(run) if r["event"] == "train"]
    steps = [r["step"] for r in records]
    assert len(steps) == len(set(steps)), "a step was logged twice: the log was not cut back on resume"
    return {r["step"]: r["loss"] for r in records}


def test_kills_sigterm_and_damage_resume_bit_identically(tmp_path, launch, run_cli):
    train = write_rows(tmp_path / "a.jsonl", synthetic_rows(300, seed=5))
    train2 = write_rows(tmp_path / "b.parquet", synthetic_rows(211, seed=8))
    evals = write_rows(tmp_path / "eval.jsonl", synthetic_rows(8, seed=6))
    common = [f"--train_file={train},{train2}", f"--eval_file={evals}", "--epochs=2", "--save_steps=3",
              "--eval_steps=10", "--shuffle_buffer_size=64", "--batch_size=16", "--gradient_accumulation_steps=2",
              "--dump_consumed=True", *SMALL]  # micro-batches of 16: resume is exact at any split too
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    proc = run_cli("train", f"--output_dir={straight}", *common)
    assert proc.returncode == 0, proc.stderr[-3000:]

    rng = random.Random(0)
    args = [f"--output_dir={broken}", *common]
    logs = [tmp_path / f"launch{i}.log" for i in range(7)]
    child = launch(args, logs[0])
    # Killed once setup has written its first record, before any checkpoint exists (the baseline
    # eval and 3 optimizer steps come first): resume starts the run again from step 0.
    started = time.time()
    while not _safe_metrics(broken):
        assert child.poll() is None and time.time() < started + 300, logs[0].read_text()[-2000:]
        time.sleep(0.05)
    child.kill()
    child.wait()
    for attempt in range(5):
        started = time.time()
        child = launch([*args, "--is_keep_training=True"], logs[attempt + 1])
        if attempt == 0:  # SIGTERM early (so the run is far from its end): finish the step, checkpoint, exit
            while not any(r["event"] == "train" and r["time"] > started + 1 for r in _safe_metrics(broken)):
                assert child.poll() is None and time.time() < started + 300, logs[attempt + 1].read_text()[-2000:]
                time.sleep(0.05)
            done = len((broken / "consumed-rank0.tsv").read_text().splitlines()) // 32  # steps of 16 x 2 rows
            child.send_signal(signal.SIGTERM)
            assert child.wait(timeout=120) == 128 + signal.SIGTERM, logs[attempt + 1].read_text()[-2000:]
            assert "plus --is_keep_training=True" in logs[attempt + 1].read_text()
            stopped = int(re.search(r"stopped at step (\d+);", logs[attempt + 1].read_text()).group(1))
            assert stopped <= done + 1  # the step under way finishes, and no other starts
            continue
        # Killed at a random moment once this attempt has written a checkpoint of its own (a fixed delay
        # killed slow starts, on a busy machine, before they had saved anything)
        latest = broken / "checkpoints" / "latest"
        before = latest.read_text() if latest.is_file() else None
        while (latest.read_text() if latest.is_file() else None) == before and child.poll() is None:
            assert time.time() < started + 600, logs[attempt + 1].read_text()[-2000:]
            time.sleep(0.05)
        time.sleep(rng.uniform(0, 3))
        child.kill()
        child.wait()
        if attempt == 3:  # damage the newest checkpoint: resume must fall back to the one before
            newest = checkpoint.step_folders(broken / "checkpoints")[0]
            with open(newest / "optimizer.pt", "r+b") as fh:
                fh.truncate(10)
    proc = run_cli("train", *args, "--is_keep_training=True")
    assert proc.returncode == 0, proc.stderr[-3000:]
    outputs = [log.read_text() for log in logs[1:6]] + [proc.stdout]
    assert "starting the run again from step 0" in outputs[0]
    assert sum("resumed from" in out for out in outputs) >= 3
    assert "skipping checkpoint" in outputs[4] + outputs[5]  # the damaged one was passed over
    # The plan of the process that finished the run is the one its measured peak sits beside
    # (a resume cuts metrics.jsonl back to its checkpoint, which used to drop that plan)
    records = metrics(broken)
    plans = [r["host_peak_mb"] for r in records if r["event"] == "memory_plan"]
    peak = [r for r in records if r["event"] == "memory_peak"][-1]
    assert plans[-1] == peak["predicted_host_peak_mb"]
    # Each checkpoint's record once, the ones resumed from included (a resume cuts the log back to
    # its checkpoint, which used to drop that checkpoint's own record); beyond the uninterrupted
    # run's, only the one the SIGTERM stop wrote
    saved = [r["step"] for r in records if r["event"] == "checkpoint"]
    saved_straight = [r["step"] for r in metrics(straight) if r["event"] == "checkpoint"]
    assert len(saved) == len(set(saved)) and set(saved_straight) <= set(saved) <= set(saved_straight) | {stopped}

    a = load_file(str(straight / "final" / "model.safetensors"))
    b = load_file(str(broken / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert train_losses(straight) == train_losses(broken)

    # Every example exactly once per epoch, in both runs, with the same order.
    rows = {(str(train), i) for i in range(300)} | {(str(train2), i) for i in range(211)}
    for run in (straight, broken):
        lines = [ln.split("\t") for ln in (run / "consumed-rank0.tsv").read_text().splitlines()]
        for epoch in ("0", "1"):
            seen = Counter((f, int(r)) for e, _, f, r in lines if e == epoch)
            assert set(seen) == rows and max(seen.values()) == 1
    assert (straight / "consumed-rank0.tsv").read_text() == (broken / "consumed-rank0.tsv").read_text()


def _safe_metrics(run: Path) -> list[dict]:
    try:
        return metrics(run)
    except (FileNotFoundError, ValueError):  # not written yet, or a line being written
        return []


def test_damaged_checkpoints_are_skipped(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        with checkpoint.atomic_folder(root / f"step_{step:06d}") as tmp:
            (tmp / "model.safetensors").write_bytes(b"x" * 100)
    (root / "step_000006" / "model.safetensors").write_bytes(b"x" * 10)  # truncated
    (root / "step_000004" / checkpoint.MANIFEST).unlink()  # write never finished
    (root / ".tmp-step_000008").mkdir()  # killed mid-write
    shutil.copytree(root / "step_000006", root / "step_000006.bak")  # a user's copy: not ours to read or prune
    warnings = []
    assert checkpoint.find_latest_valid(root, warn=warnings.append) == root / "step_000002"
    assert "truncated model.safetensors" in warnings[0] and "no manifest" in warnings[1] and len(warnings) == 2
    checkpoint.prune(root, keep=1)  # the damaged ones do not count: the one complete checkpoint stays
    assert sorted(p.name for p in root.iterdir()) == [".tmp-step_000008", "step_000002", "step_000004",
                                                      "step_000006", "step_000006.bak"]
    with checkpoint.atomic_folder(root / "step_000008") as tmp:  # the resumed run's next checkpoint
        (tmp / "model.safetensors").write_bytes(b"x" * 100)
    checkpoint.prune(root, keep=1)  # ... and the complete and damaged ones behind it go
    assert sorted(p.name for p in root.iterdir()) == ["step_000006.bak", "step_000008"]


def test_resuming_from_an_older_checkpoint_sets_the_newer_ones_aside(tmp_path):
    from lowmem.runs.run_folder import RunFolder

    folder = RunFolder(tmp_path / "run")
    for step in (2, 4, 6):
        with checkpoint.atomic_folder(folder.checkpoints / f"step_{step:06d}") as tmp:
            (tmp / "model.safetensors").write_bytes(b"x")
    for name, step in (("best", 4), ("final", 6)):  # exported by the continuation that is replaced
        (folder.path / name).mkdir()
        (folder.path / name / "training_info.json").write_text(json.dumps({"step": step}))
    lines = []
    folder.set_aside_newer(folder.checkpoints / "step_000002", lines.append)
    # a later --is_keep_training finds the continuation of step 2, not the steps it replaced
    assert checkpoint.find_latest_valid(folder.checkpoints) == folder.checkpoints / "step_000002"
    [aside] = folder.checkpoints.glob("abandoned-*")
    assert sorted(p.name for p in aside.iterdir()) == ["best", "final", "step_000004", "step_000006"]
    assert "moved to" in lines[0] and not (folder.path / "best").exists()
    assert checkpoint.validate(aside / "step_000006") is None  # kept whole
    (folder.path / "best").mkdir()  # exported at step 2, before the point resumed from: it stays
    (folder.path / "best" / "training_info.json").write_text(json.dumps({"step": 2}))
    folder.set_aside_newer(folder.checkpoints / "step_000002", lines.append)
    assert (folder.path / "best").is_dir() and len(lines) == 1


def test_a_resume_cuts_a_log_back_but_never_pads_it(tmp_path):
    from lowmem.monitoring.metrics_log import AppendLog

    log = AppendLog(tmp_path / "metrics.jsonl")
    log.write("one\ntwo\n")
    log.truncate(4)  # back to the checkpoint's offset
    log.truncate(100)  # a log found shorter than the checkpoint knew it (removed, lost in a crash): kept as is
    log.write("three\n")
    log.close()
    assert (tmp_path / "metrics.jsonl").read_bytes() == b"one\nthree\n"


def test_failed_write_leaves_previous_checkpoint(tmp_path):
    final = tmp_path / "best"
    with checkpoint.atomic_folder(final) as tmp:
        (tmp / "a.txt").write_text("old")
    with pytest.raises(UserError, match="no space left on the device"), checkpoint.atomic_folder(final) as tmp:
        (tmp / "a.txt").write_text("new")
        raise OSError(28, "No space left on device")
    assert (final / "a.txt").read_text() == "old" and checkpoint.validate(final) is None
    assert not (tmp_path / ".tmp-best").exists()
    # Killed between the swap's two renames (best/ moved to .old-best/, the new one not yet in place): the
    # next export puts the previous one back first, then replaces it as usual
    final.rename(tmp_path / ".old-best")
    with pytest.raises(RuntimeError), checkpoint.atomic_folder(final) as tmp:
        raise RuntimeError("stopped")
    assert (final / "a.txt").read_text() == "old" and not (tmp_path / ".old-best").exists()


def test_writes_the_user_can_make_possible_say_what_to_do_and_the_rest_are_raised(tmp_path, monkeypatch):
    from lowmem.runs.run_folder import RunFolder

    final = tmp_path / "best"
    with checkpoint.atomic_folder(final) as tmp:
        (tmp / "a.txt").write_text("old")
    said = "a file grew past the size limit .* then start over"  # safetensors and tokenizers name the errno so
    with pytest.raises(UserError, match=said), checkpoint.atomic_folder(final, then=lambda: "start over"):
        raise Exception("Error while serializing: IoError(File too large (os error 27))")
    with pytest.raises(UserError, match="cannot be written .* then continue with --is_keep_training=True"), \
            checkpoint.atomic_folder(final) as tmp:
        raise PermissionError(13, "Permission denied", str(tmp / "model.safetensors"))
    with pytest.raises(PermissionError), checkpoint.atomic_folder(final):  # reading a file of the user's: raised
        raise PermissionError(13, "Permission denied", str(tmp_path.parent / "source" / "spiece.model"))
    with pytest.raises(RuntimeError), checkpoint.atomic_folder(final):
        raise RuntimeError("a bug, not a write")
    mkdir = Path.mkdir

    def unwritable(path, *args, **kwargs):  # the run's folder made read-only mid-run: the staging folder fails
        if path.name.startswith(".tmp-"):
            raise PermissionError(1, "Operation not permitted", str(path))
        return mkdir(path, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", unwritable)
    with pytest.raises(UserError, match="cannot be written"), checkpoint.atomic_folder(final):
        pass
    monkeypatch.undo()
    assert (final / "a.txt").read_text() == "old" and not (tmp_path / ".tmp-best").exists()
    run = RunFolder(tmp_path / "run")  # a run without a checkpoint cannot be continued from one
    assert "--overwrite_output_dir=True" in run.how_to_continue()
    with checkpoint.atomic_folder(run.checkpoint_path(3)) as tmp:
        (tmp / "a.txt").write_text("state")
    assert run.how_to_continue().startswith("continue with --is_keep_training=True")


def test_a_file_size_limit_stops_the_run_with_one_line_and_it_starts_again(tmp_path, processes, run_cli):
    import resource

    corpus = write_rows(tmp_path / "c.jsonl", synthetic_rows(120))
    args = [sys.executable, str(REPO / "train_low_mem.py"), "train", f"--train_file={corpus}", "--max_steps=2",
            f"--output_dir={tmp_path / 'run'}", "--save_steps=0", "--eval_steps=1", "--max_eval_samples=4",
            "--eval_generate=False", "--gradient_accumulation_steps=2"]
    limit = 2**20  # best/'s weights (8 MB) cannot be written; metrics.jsonl and config.json can
    proc = processes.run(args, capture_output=True, text=True, timeout=600, preexec_fn=lambda: resource.setrlimit(
        resource.RLIMIT_FSIZE, (limit, limit)))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert lines[-1].startswith("error: a file grew past the size limit") and "--overwrite_output_dir=True" in lines[-1]
    assert not (tmp_path / "run" / "best").exists()
    again = run_cli(*args[2:], "--overwrite_output_dir=True")  # as the line says
    assert again.returncode == 0 and (tmp_path / "run" / "final" / "model.safetensors").is_file(), again.stderr[-2000:]


def test_an_export_interrupted_between_its_two_renames_puts_the_previous_one_back(tmp_path, monkeypatch):
    final = tmp_path / "best"
    with checkpoint.atomic_folder(final) as tmp:
        (tmp / "a.txt").write_text("old")
    rename, calls = Path.rename, []

    def second_interrupted(self, target):  # a second Ctrl-C landing between best -> .old-best and .tmp -> best
        calls.append(target)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", second_interrupted)
    with pytest.raises(KeyboardInterrupt), checkpoint.atomic_folder(final) as tmp:
        (tmp / "a.txt").write_text("new")
    monkeypatch.undo()
    assert (final / "a.txt").read_text() == "old" and not (tmp_path / ".old-best").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best"]


def test_a_resume_after_a_kill_between_an_exports_renames_keeps_the_best_model(tmp_path, run_cli):
    # best/ at .old-best (killed mid-swap): the resume puts it back and still compares with its metric, so
    # a worse model does not replace it
    data = write_rows(tmp_path / "d.jsonl", synthetic_rows(60, seed=3))
    run = tmp_path / "run"
    common = [f"--train_file={data}", f"--eval_file={data}", f"--output_dir={run}", "--eval_steps=2",
              "--max_eval_samples=8", "--eval_generate=False", "--gradient_accumulation_steps=2", "--save_steps=2"]
    done = run_cli("train", *common, "--max_steps=2")
    assert done.returncode == 0, done.stderr[-2000:]
    best = json.loads((run / "best" / "training_info.json").read_text())
    (run / "best").rename(run / ".old-best")
    done = run_cli("train", *common, "--max_steps=4", "--is_keep_training=True", "--learn_rate=200",
                   "--warmup_steps=0")
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((run / "best" / "training_info.json").read_text()) == best
    assert not (run / ".old-best").exists() and "new best" not in done.stdout


def test_a_finished_run_continued_times_only_its_training_steps(tmp_path, run_cli):
    # The final evaluation (generation with beams) and checkpoint ran outside untimed(): the checkpoint's
    # training time counted them, and the continued run's summary step_s was 3x its records'
    data = write_rows(tmp_path / "d.jsonl", synthetic_rows(60, seed=5))
    common = [f"--train_file={data}", f"--eval_file={data}", f"--output_dir={tmp_path / 'run'}", "--eval_steps=0",
              "--max_eval_samples=16", "--num_beams=3", "--gradient_accumulation_steps=1", "--logging_steps=1"]
    for steps, more in ((2, []), (4, ["--is_keep_training=True"])):
        done = run_cli("train", *common, f"--max_steps={steps}", *more)
        assert done.returncode == 0, done.stderr[-2000:]
    records = [r["step_s"] for r in metrics(tmp_path / "run") if r["event"] == "train"]
    summary = float(re.search(r"step_s:\s+([\d.]+)", done.stdout).group(1))
    assert len(records) == 4 and summary == pytest.approx(sum(records) / 4, rel=0.02)
    assert "| tokenizer the shipped one (8,100 tokens)" in done.stdout  # the default, named
    # A --max_steps below the checkpoint's step would train nothing (it exited 0, blaming a token estimate)
    fewer = run_cli("train", *common, "--max_steps=3", "--is_keep_training=True")
    assert fewer.returncode == 2 and "--max_steps=3 is below step 4" in fewer.stderr, fewer.stderr[-2000:]


def test_keep_training_without_a_run_is_a_clear_error(tmp_path, cli_in_process):
    proc = cli_in_process("train", f"--output_dir={tmp_path / 'nothing'}", "--is_keep_training=True")
    assert proc.returncode == 2 and "no run to continue" in proc.stderr


def test_an_epoch_ending_on_a_full_window_is_counted_at_its_last_step_and_resumes_exactly(tmp_path, run_cli):
    # 64 rows, windows of 2 x 4 = 8: each epoch ends exactly on a window, so the stream does not know
    # it has ended until asked for more. The epoch must be counted at its 8th step, before that step's
    # evaluation and checkpoint; the run's last step must be evaluated and saved once, not twice.
    train = write_rows(tmp_path / "train.jsonl", synthetic_rows(64, seed=3))
    evals = write_rows(tmp_path / "eval.jsonl", synthetic_rows(6, seed=4))
    common = [f"--train_file={train}", f"--eval_file={evals}", "--epochs=2", "--gradient_accumulation_steps=4",
              "--eval_steps=8", "--save_steps=8", "--max_new_tokens=8", *SMALL]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    proc = run_cli("train", f"--output_dir={straight}", *common)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = metrics(straight)
    assert [r["step"] for r in records if r["event"] == "eval"] == [0, 8, 16]
    assert [r["step"] for r in records if r["event"] == "checkpoint"] == [8, 16]
    assert {r["step"]: r["epoch"] for r in records if r["event"] == "train"} == {2: 0, 4: 0, 6: 0, 8: 1, 10: 1,
                                                                                12: 1, 14: 1, 16: 2}
    assert json.loads((straight / "final" / "training_info.json").read_text())["epoch"] == 2
    assert [r["epoch"] for r in records if r["event"] == "memory" and r["where"] == "epoch_end"] == [1, 2]
    # Continue from the checkpoint at the epoch boundary: the second epoch is trained as it was.
    shutil.copytree(straight, resumed)
    proc = run_cli("train", f"--output_dir={resumed}", *common, "--is_keep_training=True",
                   f"--resume_from={resumed / 'checkpoints' / 'step_000008'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "at step 8 (epoch 1)" in proc.stdout
    # The checkpoint of the continuation it replaced is kept aside, where no later resume picks it up
    assert re.search(r"step_000016.* belong to the continuation this run replaces", proc.stdout)
    assert [p.name for p in (resumed / "checkpoints").glob("abandoned-*/step_*")] == ["step_000016"]
    assert train_losses(resumed) == train_losses(straight)
    assert [r["epoch"] for r in metrics(resumed) if r["event"] == "memory" and r["where"] == "epoch_end"] == [1, 2]
    for export in ("final", "best"):  # exported again (best/ from step 16 was set aside with the rest)
        a = load_file(straight / export / "model.safetensors")
        b = load_file(resumed / export / "model.safetensors")
        assert all(torch.equal(a[k], b[k]) for k in a), export
    # Continuing the finished run (from its final checkpoint) does not evaluate its last step again.
    proc = run_cli("train", f"--output_dir={resumed}", *common, "--is_keep_training=True")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in metrics(resumed) if r["event"] == "eval"] == [0, 8, 16]
    # A --max_steps stop inside an epoch ends no epoch
    proc = run_cli("train", f"--output_dir={tmp_path / 'short'}", *common, "--max_steps=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not [r for r in metrics(tmp_path / "short") if r["event"] == "memory" and r["where"] == "epoch_end"]


@pytest.mark.parametrize("key, saved_value, value", [("seed", 1, 2), ("shuffle_buffer_size", 3, 0),
                                                     ("metric_for_best", "eval_loss", "bleu"),
                                                     ("objective", "pairs", "prefix_lm"),
                                                     ("shuffle_buffer_mb", 64, 1)])
def test_a_resume_refuses_another_row_order_or_best_metric(tmp_path, key, saved_value, value):
    """The checkpoint's data position counts rows in the order its seed and shuffle gave (another order
    repeated one file's rows and skipped another's), its best model was chosen by its metric (a BLEU was
    compared with the best eval loss), its data position is one of its objective's stream (prefix_lm read a
    pairs position: a KeyError); other settings change with a note."""
    from lowmem.runs.run_folder import compare_settings

    saved = {"seed": 1, "shuffle_buffer_size": 3, "metric_for_best": "eval_loss", "objective": "pairs",
             "learn_rate": 1e-3, key: saved_value}
    notes = []
    with pytest.raises(UserError, match=f"resume with --{key}={saved_value}, or use a new --output_dir"):
        compare_settings(saved, {**saved, key: value}, tmp_path, notes.append)
    compare_settings(saved, {**saved, "learn_rate": 2e-3}, tmp_path, notes.append)
    assert notes == ["resume: --learn_rate was 0.001 in the checkpoint; using 0.002 from this command"]
    # a run begun before --shuffle_buffer_mb existed shuffled without a text bound: it resumes with 0 only
    # other training data under the same eval flags: said so (it read "resume with --max_eval_samples=8", as given)
    eval_flags = {"eval_file": None, "max_eval_samples": 8}
    with pytest.raises(UserError, match="the training data is not the run's"):
        compare_settings({**saved, **eval_flags, "held_out_rows": 3, "train_file": "data/txt"},
                         {**saved, **eval_flags, "held_out_rows": 8, "train_file": "trans.csv"}, tmp_path)
    before = {k: v for k, v in saved.items() if k != "shuffle_buffer_mb"}
    with pytest.raises(UserError, match="resume with --shuffle_buffer_mb=0"):
        compare_settings(before, {**before, "shuffle_buffer_mb": 64}, tmp_path)
    compare_settings(before, {**before, "shuffle_buffer_mb": 0}, tmp_path)


def test_a_run_begun_with_relu_presets_resumes_only_with_relu(tmp_path):
    """The presets' feed-forward became gated-gelu after runs had begun with ReLU ones, whose checkpoints hold
    wi, not wi_0 and wi_1: such a run is told the flag to resume with. --init_from's model keeps its own shape."""
    from lowmem.runs.run_folder import compare_settings

    before = {"model_preset": "tiny", "init_from": None}
    with pytest.raises(UserError, match="written with feed_forward_proj=relu but this run has gated-gelu; resume "
                                        "with the --feed_forward_proj the run began with"):
        compare_settings(before, {**before, "feed_forward_proj": "gated-gelu"}, tmp_path)
    compare_settings(before, {**before, "feed_forward_proj": "relu"}, tmp_path)
    now = {**before, "feed_forward_proj": "gated-gelu"}
    with pytest.raises(UserError, match="feed_forward_proj=gated-gelu but this run has relu"):
        compare_settings(now, {**now, "feed_forward_proj": "relu"}, tmp_path)
    tuned = {**before, "init_from": "runs/pretrain/final"}  # neither flag is read: the model has its own shape
    compare_settings(tuned, {**tuned, "feed_forward_proj": "gated-gelu", "model_preset": "small"}, tmp_path)


def test_a_run_begun_with_tied_presets_resumes_only_with_a_tied_head(tmp_path):
    """The presets' output layer became a matrix of its own after runs had begun with it tied to the embedding,
    whose checkpoints hold no lm_head: such a run is told the flag to resume with."""
    from lowmem.runs.run_folder import compare_settings

    before = {"model_preset": "tiny", "feed_forward_proj": "gated-gelu", "init_from": None}
    with pytest.raises(UserError, match="written with tie_word_embeddings=True but this run has False"):
        compare_settings(before, {**before, "tie_word_embeddings": False}, tmp_path)
    compare_settings(before, {**before, "tie_word_embeddings": True}, tmp_path)
    tuned = {**before, "init_from": "runs/pretrain/final"}  # not read: the model has its own head
    compare_settings(tuned, {**tuned, "tie_word_embeddings": False}, tmp_path)


def test_a_resume_refuses_another_lora_scale_or_another_compute_dtype_for_8_bit_weights(tmp_path):
    """The adapters were trained under alpha / r (another alpha changed the next loss from 6.84 to 8.43), and
    8-bit weights keep their scales in the compute dtype (another one crashed in the first matmul)."""
    from lowmem.runs.run_folder import compare_settings

    lora = {"lora_r": 8, "lora_alpha": 16.0, "frozen_dtype": "float32", "mixed_precision": "no"}
    with pytest.raises(UserError, match="lora_alpha=16.0 but this run has 256.0"):
        compare_settings(lora, {**lora, "lora_alpha": 256.0}, tmp_path)
    compare_settings({**lora, "lora_r": 0}, {**lora, "lora_r": 0, "lora_alpha": 256.0}, tmp_path)  # unused
    compare_settings(lora, {**lora, "mixed_precision": "bf16"}, tmp_path, lambda _: None)
    quantized = {**lora, "frozen_dtype": "int8"}
    with pytest.raises(UserError, match="int8 weights with scales in the dtype of --mixed_precision=no"):
        compare_settings(quantized, {**quantized, "mixed_precision": "bf16"}, tmp_path)


def test_an_epochs_run_resumes_only_at_the_rows_per_step_its_schedule_counts(tmp_path):
    """The schedule of an --epochs run is planned in optimizer steps: resumed at 4 micro-batches a step where
    it began at 2, the planned steps ran out with 16 of 40 rows left, trained at learning rate 0."""
    from lowmem.runs.run_folder import compare_settings

    saved = {"max_steps": -1, "batch_size": 2, "gradient_accumulation_steps": 2, "batch_request": {"batch_size": 2}}
    with pytest.raises(UserError, match="written at 4 rows per optimizer step .* this run has 8"):
        compare_settings(saved, {**saved, "gradient_accumulation_steps": 4}, tmp_path)
    notes = []
    compare_settings(saved, {**saved, "batch_size": 1, "gradient_accumulation_steps": 4,
                             "batch_request": {"batch_size": 1}}, tmp_path, notes.append)  # the same rows
    compare_settings(saved, {**saved, "max_steps": 50, "gradient_accumulation_steps": 4}, tmp_path, notes.append)
    assert not [note for note in notes if "batch_request" in note]  # not a flag: the flags behind it are said
    assert len(notes) == 4


def test_a_resume_on_another_eval_set_says_best_is_chosen_anew():
    """best/ chosen by eval losses over 8 rows was compared with losses over 100 ('new best' 7.877 against
    8.256); the decoding settings count where BLEU picks best/."""
    from lowmem.runs.run_folder import eval_changes

    saved = {"eval_file": "a.jsonl", "max_eval_samples": 8, "max_source_len": 128, "max_target_len": 128,
             "num_beams": 1, "metric_for_best": "eval_loss", "learn_rate": 1e-3}
    assert eval_changes(saved, {**saved, "learn_rate": 2e-3, "num_beams": 4}) == []
    assert eval_changes(saved, {**saved, "max_eval_samples": 100}) == ["--max_eval_samples=8 -> 100"]
    assert eval_changes({**saved, "metric_for_best": "bleu"}, {**saved, "metric_for_best": "bleu", "num_beams": 4}) \
        == ["--num_beams=1 -> 4"]
    rouge = {**saved, "eval_metrics": "rouge", "metric_for_best": "rougeL"}  # as where any score of answers does
    assert eval_changes(rouge, {**rouge, "eval_metrics": "rouge,bleu", "repetition_penalty": 1.2, "num_beams": 4}) \
        == ["--num_beams=1 -> 4"]


def test_a_resume_under_another_zero_stage_is_one_line(tmp_path):
    """A ZeRO-3 checkpoint resumed under --zero_stage 2 failed in DeepSpeed's loader with 98 traceback lines."""
    from lowmem.runs.run_folder import compare_settings

    with pytest.raises(UserError, match="written with DeepSpeed ZeRO-3 and this run uses DeepSpeed ZeRO-1/2"):
        compare_settings({"sharding": "zero3"}, {"sharding": "zero2"}, tmp_path)
    compare_settings({}, {"sharding": None}, tmp_path)  # written before the engine was recorded: as before
