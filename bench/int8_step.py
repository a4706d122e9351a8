"""Step time of 8-bit frozen weights (``--frozen_dtype=int8``) against float32 frozen weights on the CPU.

    python -m bench.int8_step                       # LoRA r=8 on flan-t5-large's shape, float32 and bf16
    python -m bench.int8_step --precision=no        # --mixed_precision=no only (the CPU default)
    python -m bench.int8_step --micro_only          # one quantized layer against a float32 one
    python -m bench.int8_step --shape=tiny --steps=4 --rounds=1   # a quick look

Two parts, both side by side in one run:

- Training: real ``train_low_mem.py train`` runs (LoRA r=8 on q and v, micro-batch 2, no accumulation, the
  shipped chatterbot rows) of a model of the shape ``--shape`` (flan-t5-large: d_model 1024, d_ff 2816,
  16 heads, 24 + 24 layers, gated-gelu, untied head, 783M parameters) with random weights, written once
  into a temporary folder and deleted at the end. Each run is one process; the float32 and int8 runs of
  a precision alternate (``--rounds`` times each), so load on the machine falls on both alike. A run is
  stopped once it has logged ``--steps`` steps (the final checkpoint and exports of a 783M model would
  take longer than the steps): its step time is the median ``step_s`` of the steps after the first, beside
  the CPU time the process spent on them (wall time on a shared machine moves with its load, CPU time
  much less), its peak the process's peak RSS then (loading and quantizing included).
- Micro: one frozen linear layer's forward and input-gradient backward (``y = x W^T``, ``dx = dy W``; no
  weight gradient) at flan-t5-large's shapes, quantized as the trainer does (``quantize_block``) against
  a float32 ``nn.Linear``, interleaved, median of ``--repeats``.

Target: int8 at most 1.3x float32's step time.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path

from bench.harness import Timer, cpu_seconds, run_child, trainer
from bench.hub_checkpoint import build_checkpoint

LAYER_SHAPES = [(1024, 2816), (2816, 1024), (1024, 1024)]  # (in, out): wi_0 / wi_1, wo, q / k / v / o
TOKENS = [(2, 64), (2, 256)]  # batch x tokens


def train_run(init: Path, out: Path, frozen: str, precision: str, steps: int) -> dict:
    """One trainer process, stopped after ``steps`` logged steps: the wall and CPU seconds of each step
    after the first, and its peak RSS (MiB). The CPU seconds (user + system, both threads) are read when
    each step's record appears: they count this run's work, not the time other processes took the cores."""
    command = trainer("train", "--is_finetune=True", f"--init_from={init}", f"--output_dir={out}", "--lora_r=8",
                      "--learn_rate=1e-3", f"--frozen_dtype={frozen}", f"--mixed_precision={precision}",
                      "--batch_size=2", "--gradient_accumulation_steps=1", f"--max_steps={steps}", "--eval_steps=0",
                      "--max_eval_samples=2", "--eval_generate=False", "--save_steps=0", "--logging_steps=1",
                      "--overwrite_output_dir=True")
    watch = StepWatch(out, steps)
    run = run_child(command, watch=watch, every=0.2)
    records, cpu = watch.records, watch.cpu
    if len(records) < steps:
        raise SystemExit(f"run failed ({frozen}, {precision}):\n{run.output[-3000:]}")
    shutil.rmtree(out, ignore_errors=True)
    return {"step_s": [r["step_s"] for r in records[1:steps]], "cpu_s": [b - a for a, b in zip(cpu, cpu[1:steps])],
            "peak_mb": records[steps - 1]["peak_rss_mb"]}


class StepWatch:
    """A ``run_child`` watcher of a trainer run: stops it once ``steps`` train records are logged (its final
    evaluation, checkpoint and exports are not what is measured), and keeps the process's CPU seconds as each
    record appears (``cpu``, one a record)."""

    def __init__(self, out: Path, steps: int):
        self.out, self.steps = out, steps
        self.records: list[dict] = []
        self.cpu: list[float] = []

    def __call__(self, pid: int) -> bool:
        self.records = train_records(self.out)
        used = cpu_seconds(pid) if len(self.records) > len(self.cpu) else None
        if used is not None:
            self.cpu += [used] * (len(self.records) - len(self.cpu))
        return len(self.records) >= self.steps


def train_records(out: Path) -> list[dict]:
    """The train records a run has logged to its metrics.jsonl so far (none before it exists)."""
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # the line being written
            break
    return [r for r in records if r.get("event") == "train"]


def training(args, tmp: Path) -> None:
    init = Path(args.init_from) if args.init_from else Path(build_checkpoint(tmp / args.shape, args.shape)["folder"])
    for precision in args.precision.split(","):
        found = {k: {"step_s": [], "cpu_s": [], "peak_mb": []} for k in ("float32", "int8")}
        for round_ in range(args.rounds):
            for frozen, kept in found.items():
                run = train_run(init, tmp / "run", frozen, precision, args.steps)
                for key, value in run.items():
                    kept[key] += value if isinstance(value, list) else [value]
                print(f"  {precision:>3} {frozen:>7} round {round_ + 1}: step {statistics.median(run['step_s']):.2f} s,"
                      f" CPU {statistics.median(run['cpu_s']):.2f} s | peak {run['peak_mb']:,.0f} MiB", flush=True)
        wall, cpu = ({k: statistics.median(v[key]) for k, v in found.items()} for key in ("step_s", "cpu_s"))
        each = [f"{k} {wall[k]:.2f} s/step ({cpu[k]:.2f} CPU s), peak {max(v['peak_mb']):,.0f} MiB"
                for k, v in found.items()]
        print(f"{args.shape} LoRA r=8, --mixed_precision={precision}, median of {len(found['int8']['step_s'])} steps: "
              f"{' | '.join(each)} | int8 / float32: step time {wall['int8'] / wall['float32']:.2f}, "
              f"CPU time {cpu['int8'] / cpu['float32']:.2f}", flush=True)


def micro(args) -> None:
    """One frozen layer's forward and input-gradient backward: quantized against float32, interleaved. Under
    bf16 both run in autocast as the trainer runs them: float32 frozen weights cast to bf16 at each use, the
    8-bit layer with bf16 scales (``quantize_frozen``'s choice); the input is float32 (a T5 layer norm's)."""
    import contextlib
    from types import SimpleNamespace

    import torch

    from lowmem.model.quantize import quantize_block

    print(f"one frozen linear layer, forward + input-gradient backward, {torch.get_num_threads()} threads, "
          f"median of {args.repeats}:")
    for precision in args.precision.split(","):
        scales = torch.bfloat16 if precision == "bf16" else torch.float32
        autocast = (lambda: torch.autocast("cpu", torch.bfloat16)) if precision == "bf16" else contextlib.nullcontext
        for fan_in, fan_out in LAYER_SHAPES:
            torch.manual_seed(0)
            plain = torch.nn.Linear(fan_in, fan_out, bias=False).requires_grad_(False)
            holder = torch.nn.Sequential(torch.nn.Linear(fan_in, fan_out, bias=False).to(scales).requires_grad_(False))
            quantize_block(SimpleNamespace(frozen_dtype="int8"), holder, ["0"])
            for batch, tokens in TOKENS:
                x = torch.randn(batch, tokens, fan_in, requires_grad=True)
                times = {"float": [], "int8": []}
                for _ in range(args.repeats):
                    for name, layer in (("float", plain), ("int8", holder)):
                        with Timer() as timer:
                            with autocast():
                                out = layer(x)
                            out.backward(torch.ones_like(out))
                        times[name].append(timer.seconds)
                base, eight = (statistics.median(times[k]) * 1000 for k in ("float", "int8"))
                print(f"  --mixed_precision={precision:<3} {fan_in:>4}x{fan_out:<4} {batch}x{tokens:<3}: float32 "
                      f"{base:6.2f} ms | int8 {eight:6.2f} ms | ratio {eight / base:.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="large", help="a shape in bench/hub_checkpoint.py (large: flan-t5-large)")
    parser.add_argument("--precision", default="no,bf16", help="--mixed_precision values, comma-separated")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps logged per run (the first untimed)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each configuration, alternating")
    parser.add_argument("--repeats", type=int, default=20, help="micro benchmark: timings per layer and size")
    parser.add_argument("--micro_only", action="store_true", help="only the one-layer micro benchmark")
    parser.add_argument("--init_from", help="a model folder to train instead of a new one of --shape (kept)")
    args = parser.parse_args()
    micro(args)
    if args.micro_only:
        return
    with tempfile.TemporaryDirectory(prefix="int8_step_") as tmp:  # the model folder goes with it
        training(args, Path(tmp))


if __name__ == "__main__":
    main()
