"""Pictures of a run: the plot command's PNG charts and --report_to=tensorboard, on a real tiny run."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from conftest import REPO, metrics, shared_folder, synthetic_rows, write_rows

from lowmem.monitoring.plots import plot_run, series

CHARTS = {"loss.png", "bleu.png", "learning_rate.png", "tokens_per_s.png", "rss.png"}
TINY = ["--max_steps=12", "--eval_steps=4", "--logging_steps=2", "--save_steps=4", "--save_total_limit=3",
        "--gradient_accumulation_steps=2", "--warmup_steps=2", "--max_eval_samples=4", "--max_source_len=32",
        "--max_target_len=16", "--report_to=tensorboard"]


@pytest.fixture(scope="session")
def tiny_run(request, tmp_path_factory, run_cli):
    """A 12-step run with evaluations at 0, 4, 8, 12, checkpoints at 4, 8, 12 and TensorBoard events, and its
    flags; built once for the session (read only: conftest.shared_folder)."""
    def args(root):
        return [f"--train_file={root / 'train.jsonl'}", f"--eval_file={root / 'eval.jsonl'}", *TINY]

    def build(root):
        write_rows(root / "train.jsonl", synthetic_rows(200, seed=11))
        write_rows(root / "eval.jsonl", synthetic_rows(4, seed=12))
        proc = run_cli("train", f"--output_dir={root / 'run'}", *args(root))
        assert proc.returncode == 0, proc.stderr[-3000:]

    root = shared_folder(request, tmp_path_factory, "plots-tiny-run", build)
    return root / "run", args(root)


def scalars(run, tag: str) -> list[tuple[int, float]]:
    """(step, value) of ``tag`` as TensorBoard shows it (purged events left out)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def recorded(run, event: str, field: str) -> list[tuple[int, float]]:
    return [(r["step"], r[field]) for r in metrics(run) if r["event"] == event]


def test_plot_writes_one_png_per_chart(tiny_run, tmp_path, run_cli):
    import matplotlib.image
    import numpy as np

    run = tmp_path / "run"
    shutil.copytree(tiny_run[0], run)  # (the charts go into the run's plots/)
    proc = run_cli("plot", f"--output_dir={run}", "--max_steps=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "note: --max_steps has no effect on plot (it is read by train)" in proc.stderr
    assert {p.name for p in (run / "plots").iterdir()} == CHARTS | {".t5-lowmem-plots"}  # the charts and our marker
    for name in CHARTS:
        path = run / "plots" / name
        pixels = matplotlib.image.imread(path)
        assert path.stat().st_size > 10_000 and pixels.shape[:2] == (450, 800), name
        colours = np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)
        assert len(colours) > 50, name  # axes, text, lines and antialiasing: not a blank canvas
    assert "skipped:" in proc.stdout and "{}" in proc.stdout


def test_plot_skips_charts_without_data_and_keeps_last_of_a_repeated_step(tiny_run, tmp_path):
    run, _ = tiny_run
    kept = [r for r in metrics(run) if r["event"] not in ("eval", "memory_plan", "memory_peak")]
    last_train = [r for r in kept if r["event"] == "train"][-1]
    kept.append({**last_train, "loss": 123.0})  # the same step again: the last value wins
    assert series(kept, "train", "loss")[-1] == (last_train["step"], 123.0)
    assert len(series(kept, "train", "loss")) == len([r for r in kept if r["event"] == "train"]) - 1
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
    result = plot_run(tmp_path, tmp_path / "charts")
    assert set(result["skipped"]) == {"bleu"} and "no eval records with bleu" in result["skipped"]["bleu"]
    assert {os.path.basename(p) for p in result["written"]} == CHARTS - {"bleu.png"}
    assert {p.name for p in (tmp_path / "charts").iterdir()} == CHARTS - {"bleu.png"} | {".t5-lowmem-plots"}


def test_a_chart_that_cannot_be_written_leaves_the_one_before_whole(tiny_run, tmp_path, processes, run_cli):
    # A full disk, made real with a file-size limit: the write fails (EFBIG) after the PNG's first bytes.
    import resource
    import signal
    import sys

    run, _ = tiny_run
    charts = tmp_path / "charts"
    assert run_cli("plot", f"--output_dir={run}", f"--plot_dir={charts}").returncode == 0
    before = {p.name: p.read_bytes() for p in charts.iterdir()}

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead of killing the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    proc = processes.run([sys.executable, str(REPO / "train_low_mem.py"), "plot", f"--output_dir={run}",
                          f"--plot_dir={charts}"], capture_output=True, text=True, preexec_fn=small_files, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    assert "could not be written" in lines[0] and "--plot_dir" in lines[0]
    assert {p.name: p.read_bytes() for p in charts.iterdir()} == before  # no part of a chart, no temporary


@pytest.mark.parametrize("make", ["nothing", "empty metrics", "no train records", "a line not an object",
                                  "a record without a step", "a step not a number"])
def test_plot_without_train_records_is_one_error_line(tmp_path, make, cli_in_process):
    run = tmp_path / "run"
    if make != "nothing":
        run.mkdir()
        lines = {"no train records": '{"event": "memory", "step": 0, "time": 1.0, "rss_mb": 200.0}\n',
                 "a line not an object": '{"event": "train", "step": 1, "loss": 2.0}\n[1, 2]\n',
                 "a record without a step": '{"event": "train", "loss": 1.0}\n',
                 "a step not a number": '{"event": "train", "step": "1", "loss": 1.0}\n'}.get(make, "")
        (run / "metrics.jsonl").write_text(lines, encoding="utf-8")
    proc = cli_in_process("plot", f"--output_dir={run}")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    assert "train" in lines[0] and not (run / "plots").exists()


def test_tensorboard_scalars_equal_metrics_jsonl(tiny_run):
    run, _ = tiny_run
    loss = recorded(run, "train", "loss")
    assert [s for s, _ in loss] == [2, 4, 6, 8, 10, 12]
    assert scalars(run, "train/loss") == [(s, pytest.approx(v, rel=1e-6)) for s, v in loss]  # float32 in TB
    assert scalars(run, "eval/bleu") == [(s, pytest.approx(v, abs=1e-5)) for s, v in recorded(run, "eval", "bleu")]
    assert [s for s, _ in scalars(run, "eval/eval_loss")] == [0, 4, 8, 12]
    peak = recorded(run, "memory_peak", "measured_host_peak_mb")
    assert scalars(run, "memory_peak/measured_host_peak_mb") == [(s, pytest.approx(v)) for s, v in peak]


def test_resume_does_not_show_steps_twice_in_tensorboard(tiny_run, tmp_path, run_cli):
    """A resume from step 8 re-logs steps 10 and 12, which the first run logged after that checkpoint."""
    run, args = tiny_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    proc = run_cli("train", f"--output_dir={copy}", *args, "--is_keep_training=True",
                   f"--resume_from={copy / 'checkpoints' / 'step_000008'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(list((copy / "tensorboard").glob("events.out.tfevents.*"))) == 2  # one file per process start
    loss = recorded(copy, "train", "loss")
    assert [s for s, _ in loss] == [2, 4, 6, 8, 10, 12]  # metrics.jsonl was cut back at the checkpoint
    assert scalars(copy, "train/loss") == [(s, pytest.approx(v, rel=1e-6)) for s, v in loss]
    assert [s for s, _ in scalars(copy, "eval/eval_loss")] == [0, 4, 8, 12]


def test_report_to_is_validated(tmp_path, cli_in_process):
    done = cli_in_process("train", f"--output_dir={tmp_path / 'run'}", "--report_to=comet")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "--report_to: unknown tracker 'comet'; a comma list of tensorboard, wandb, mlflow, trackio" in done.stderr
    assert not (tmp_path / "run").exists()


def test_a_missing_tensorboard_is_named_before_anything_is_written(tmp_path, run_cli):
    # (a process of its own: the interpreter must start without tensorboard)
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['tensorboard'] = None\n")
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    done = run_cli("train", f"--output_dir={tmp_path / 'run'}", "--report_to=tensorboard", env=env)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "pip install '.[tensorboard]'" in done.stderr
    assert not (tmp_path / "run").exists()  # refused before anything was written
