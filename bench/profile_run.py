"""Where the time of a training run goes: phases (py-spy) and operators (torch.profiler).

    python -m bench.profile_run --train_file=corpus.jsonl --max_steps=40         # phases, via py-spy
    python -m bench.profile_run --ops --train_file=corpus.jsonl --max_steps=10   # top operators

Phases: ``py-spy record`` (pip install py-spy) samples ``train_low_mem.py train`` with the given flags,
and each sampled stack is put in the first phase whose function it contains (evaluation and saving
before the training loop's parts, so the backward of an evaluation is not counted as training).
Operators: the same run in this process under ``torch.profiler``, operators by self CPU time.
Results and their reading: BENCHMARKS.md, 'Where the time goes'.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import tempfile
from pathlib import Path

from bench.harness import Column, Table, run_child, trainer

# (phase, substrings of a py-spy frame "function (file:line)"); the first phase that matches wins
PHASES = [
    ("background threads (mostly idle)", ["Thread._bootstrap", "Condition.wait (threading"]),
    ("imports", ["_find_and_load"]),
    ("evaluation", ["LowMemTrainer.evaluate (", "evaluate_and_keep_best", "evaluate_in_run", "evaluate_model"]),
    ("checkpoint and export", ["save_checkpoint", "LowMemTrainer.export", "Checkpointer.", "peak_against_plan"]),
    ("setup (model, planner, index)", ["LowMemTrainer.setup ("]),
    ("tokenization and padding", ["token_ids (data/collate", "pad (data/collate"]),
    ("reading and shuffling rows", ["iter_epoch (data/stream", "_upstream", "iter_rows"]),
    ("backward", ["backward ("]),
    ("optimizer step", ["(lowmem/training/optim.py"]),
    ("forward and loss", ["token_loss_sum"]),
    ("grad norm and counts", ["clip_grad_norm", "window_counts"]),
    ("logging and gc", ["maybe_log", "log_interval", "free_memory", "log_memory"]),
]
LOOP = {"tokenization and padding", "reading and shuffling rows", "backward", "optimizer step", "forward and loss",
        "grad norm and counts", "logging and gc", "other"}


def classify(raw: Path) -> collections.Counter:
    """Samples per phase from py-spy's raw (collapsed) output: one 'frame;frame;... count' line per stack."""
    totals = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack.strip():  # a sample py-spy could not unwind (native start-up and shut-down)
            totals["unresolved"] += int(count)
            continue
        phase = next((name for name, keys in PHASES if any(k in stack for k in keys)), "other")
        totals[phase] += int(count)
    return totals


def phases(flags: list[str], rate: int) -> None:
    if shutil.which("py-spy") is None:
        raise SystemExit("py-spy is not installed: pip install py-spy (or use --ops for torch.profiler)")
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "stacks.txt"
        out = [f for f in flags if f.startswith("--output_dir=")] or [f"--output_dir={tmp}/run"]
        done = run_child(["py-spy", "record", "-r", str(rate), "-f", "raw", "-o", str(raw), "--",
                          *trainer("train", *[f for f in flags if f not in out], *out, "--overwrite_output_dir=True")],
                         cwd=Path.cwd())  # the flags' paths are the caller's
        if done.rc:
            raise SystemExit(f"py-spy record failed:\n{done.output[-3000:]}")
        totals = classify(raw)
    run, loop = sum(totals.values()), sum(v for k, v in totals.items() if k in LOOP)
    table = Table([Column("phase", "name"), Column("share of run", "run", ".1%"),
                   Column("share of loop", "loop", ".1%")])
    for name, count in totals.most_common():
        table.add(name, {"run": count / run, "loop": count / loop if name in LOOP else ""})
    table.show()


def operators(flags: list[str], rows: int) -> None:
    import torch

    from lowmem.cli.flags import load_config
    from trainer_low_mem import LowMemTrainer

    options = dict(f.lstrip("-").split("=", 1) for f in flags)
    with tempfile.TemporaryDirectory() as tmp:
        options.setdefault("output_dir", f"{tmp}/run")
        cfg, _ = load_config({**options, "overwrite_output_dir": True})
        trainer = LowMemTrainer(cfg).setup()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            trainer.train()
        trainer.close()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", action="store_true", help="operators by self CPU time (torch.profiler)")
    parser.add_argument("--rate", type=int, default=50, help="py-spy samples per second")
    parser.add_argument("--rows", type=int, default=15, help="operators listed with --ops")
    options, flags = parser.parse_known_args()
    flags = flags or ["--max_steps=40"]
    if options.ops:
        operators(flags, options.rows)
    else:
        phases(flags, options.rate)


if __name__ == "__main__":
    main()
