"""--torch_compile=True against eager, side by side in one run: steps/s after warm-up, graphs compiled against
length buckets met, and the loss of every step against eager's.

    python -m bench.compile                         # tiny preset, 100 steps of 4 x 2 on length-skewed pairs
    python -m bench.compile --presets=tiny,small --steps=40 --packing=True
    python -m bench.compile --init_from=MODEL --corpus=glossary --max_len=64   # SFT of a trained model

Rows: bench/packing.py's skewed chat pairs (85 % 1-4 words a side, 15 % several turns joined, up to --max_len
tokens a side). Both contenders train the same examples from scratch (same seed, dropout 0, Adafactor) in their own
process (bench/peers.py's runner). Reported for each:

- steps/s after warm-up: optimizer steps whose train record shows no new length bucket (a step that compiled is
  warm-up), and the median step time over them;
- compiled: length buckets met by the two stacks, graphs dynamo compiled for them; recompiles = graphs - buckets
  (target: 0, so at most one compile per bucket);
- the largest |loss - eager's| over the first 10 steps, the first 25 and all of them (target: <= 1e-4), against
  eager with dynamic padding and against eager at the same length buckets (dynamo's ``eager`` backend: the
  captured graphs run op by op, so only the padding differs from plain eager and only inductor's kernels from the
  compiled run). Float rounding that differs in the last bit grows with training steps in any two runs whose
  kernels or padding differ: the first steps show whether the compiled step computes the same loss.

Figures: docs/throughput.md "Compiled steps".
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path

from bench.harness import trainer
from bench.packing import bench_corpus
from bench.peers import run_contender


def train(flags: dict, run_dir: Path, options) -> dict:
    run = run_contender(trainer("train", **flags), run_dir, options)
    if run["rc"]:
        return {"error": " | ".join(run["log"].read_text(errors="replace").splitlines()[-6:])}
    records = [json.loads(line) for line in (run_dir / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["event"] == "train"]
    warm, met = [], 0
    for record in steps:  # a step that met a new bucket compiled: warm-up
        if record.get("compiled_buckets", 0) == met:
            warm.append(record["step_s"])
        met = record.get("compiled_buckets", 0)
    warm = warm[1:] if "compiled_buckets" not in steps[0] else warm  # eager: step 1 is warm-up too
    last = steps[-1]
    return {"losses": [r["loss"] for r in steps], "steps_per_s": len(warm) / sum(warm) if warm else 0.0,
            "median_step_s": statistics.median(warm) if warm else 0.0, "warm_steps": len(warm),
            "buckets": last.get("compiled_buckets"), "graphs": last.get("compiled_graphs"),
            "padding_pct": statistics.mean(r["padding_pct"] for r in steps),
            "peak_rss_mib": max(s[1] for s in run["samples"]) / 2**20,
            "compile_s": sum(r["step_s"] for r in steps) - sum(warm) if "compiled_buckets" in last else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="tiny")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--max_len", type=int, default=64)
    parser.add_argument("--packing", default="False")
    parser.add_argument("--corpus", default="skewed", help="skewed, glossary (see bench/packing.py) or a .jsonl file")
    parser.add_argument("--init_from", default="", help="a trained model to fine-tune (SFT) instead of a preset")
    parser.add_argument("--mixed_precision", default="no")
    parser.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS of every run (0: torch's default)")
    options = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="compile_bench_"))
    try:
        corpus = bench_corpus(options.corpus, work)
        for preset in [options.init_from] if options.init_from else options.presets.split(","):
            table = {}
            for name, compiled, backend in (("eager", False, "inductor"), ("eager, bucketed", True, "eager"),
                                            ("compiled", True, "inductor")):
                run_dir = work / "run"
                shutil.rmtree(run_dir, ignore_errors=True)
                run_dir.mkdir()
                model = dict(is_finetune=True, init_from=preset) if options.init_from else dict(model_preset=preset)
                flags = dict(train_file=corpus, eval_file=corpus, output_dir=run_dir / "out", **model,
                             max_steps=options.steps, max_source_len=options.max_len, max_target_len=options.max_len,
                             batch_size=options.batch_size, gradient_accumulation_steps=options.accumulation,
                             packing=options.packing, mixed_precision=options.mixed_precision, dropout_rate=0,
                             eval_steps=0, save_steps=0, logging_steps=1, max_eval_samples=4, warmup_steps=10, seed=0,
                             torch_compile=compiled, torch_compile_backend=backend)
                table[name] = row = train(flags, run_dir, options)
                if "error" in row:
                    print(f"{preset} | {name}: {row['error']}", flush=True)
                    continue
                print(f"{preset} | {name}: {row['steps_per_s']:.2f} steps/s after warm-up ({row['warm_steps']} steps, "
                      f"median {row['median_step_s'] * 1000:.0f} ms), padding {row['padding_pct']:.1f} %, peak RSS "
                      f"{row['peak_rss_mib']:,.0f} MiB" + (f", {row['buckets']} length buckets, {row['graphs']} graphs "
                      f"(recompiles {row['graphs'] - row['buckets']}), {row['compile_s']:.0f} s of compiling steps"
                      if name == "compiled" else ""), flush=True)
            if all("losses" in row for row in table.values()):
                compiled = table["compiled"]
                speed = compiled["steps_per_s"] / max(table["eager"]["steps_per_s"], 1e-9)
                print(f"{preset} | compiled / eager: {speed:.2f}x steps/s after warm-up", flush=True)
                for name in ("eager", "eager, bucketed"):
                    gaps = [abs(a - b) for a, b in zip(table[name]["losses"], compiled["losses"])]
                    print(f"{preset} | largest |loss - {name}'s| over steps 1-10 {max(gaps[:10]):.1e}, 1-25 "
                          f"{max(gaps[:25]):.1e}, 1-{len(gaps)} {max(gaps):.1e}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
