"""On a GPU: tokens/s and peak GPU memory per memory profile and preset, and what larger micro-batches buy.

    python bench/gpu_profiles.py                         # every gpu* profile x tiny, small, base
    python bench/gpu_profiles.py --presets=tiny --profiles=gpu16g --steps=4   # a quick look
    python bench/gpu_profiles.py --sweep_only            # the micro-batch sweep alone

Part 1 runs ``train_low_mem.py train --memory_profile=P --model_preset=X`` on the long-row corpus of
bench/memory_modes.py (chat turns joined, sources up to 128 tokens) for a few optimizer steps with
4 micro-batches each (the profile's own accumulation is only a count of micro-batches: it does not
change tokens/s), and reads the run's own records: tokens/s (the mean of the steps after the first)
and the ``memory_peak`` event (the planner's predicted GPU peak beside the measured one: torch's
reserved peak plus the CUDA context).

Part 2 is plain torch, outside the trainer: a T5 of each preset, bf16 autocast, AdamW, forward +
backward + step on random token ids of 128 tokens a side, at micro-batches 2 to 64, timed after
``torch.cuda.synchronize``. It says how much a micro-batch above the trainer's cap of 2 would speed
training up on this GPU (issue "micro-batches sized to the memory budget"); it is not the trainer.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.memory_modes import make_corpora  # noqa: E402


def profile_run(preset: str, profile: str, corpus: Path, out: Path, steps: int) -> dict:
    command = [sys.executable, str(REPO / "train_low_mem.py"), "train", f"--memory_profile={profile}",
               f"--model_preset={preset}", f"--train_file={corpus}", f"--output_dir={out}", f"--max_steps={steps}",
               "--gradient_accumulation_steps=4", "--eval_steps=0", "--save_steps=0", "--max_eval_samples=8",
               "--logging_steps=1"]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        return {"error": (done.stderr.strip().splitlines() or ["?"])[-1][:200]}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["event"] == "train"][1:]
    peak = next(r for r in records if r["event"] == "memory_peak")
    return {"tokens_per_s": sum(r["tokens_per_s"] for r in train) / max(len(train), 1),
            "predicted_gpu_mb": peak.get("predicted_gpu_peak_mb"), "measured_gpu_mb": peak.get("measured_gpu_peak_mb"),
            "gpu_ratio": peak.get("gpu_ratio"), "measured_host_mb": peak["measured_host_peak_mb"],
            "wall_s": round(time.perf_counter() - started, 1)}


def sweep(preset: str, micro_batches: list[int], length: int, repeats: int) -> dict[int, float]:
    """Training tokens/s (source + target) of plain torch at each micro-batch; 0 where it runs out of memory."""
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    from config import MODEL_PRESETS

    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(vocab_size=32128, decoder_start_token_id=0, dropout_rate=0.0,
                                                **MODEL_PRESETS[preset])).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    result = {}
    for micro in micro_batches:
        ids = torch.randint(2, 32000, (micro, length), device="cuda")
        try:
            for i in range(repeats + 2):  # two warm-up steps
                if i == 2:
                    torch.cuda.synchronize()
                    started = time.perf_counter()
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            result[micro] = 2 * micro * length * repeats / (time.perf_counter() - started)
        except torch.OutOfMemoryError:
            result[micro] = 0.0
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="tiny,small,base")
    parser.add_argument("--profiles", default="gpu8g,gpu12g,gpu16g,gpu24g,gpu80g")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--sweep_only", action="store_true")
    parser.add_argument("--json", default="", help="also write every figure to this file")
    options = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("error: bench/gpu_profiles.py measures a GPU; torch sees none here")
    print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    figures = {"gpu": torch.cuda.get_device_name(0), "profiles": {}, "sweep": {}}
    presets = options.presets.split(",")
    if not options.sweep_only:
        print("| preset | profile | tokens/s | predicted GPU MiB | measured GPU MiB | ratio | host peak MiB |")
        print("|---|---|---:|---:|---:|---:|---:|", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            corpus = make_corpora(Path(tmp))["long"]
            for preset in presets:
                for profile in options.profiles.split(","):
                    row = profile_run(preset, profile, corpus, Path(tmp) / f"{preset}-{profile}", options.steps)
                    figures["profiles"][f"{preset} {profile}"] = row
                    if "error" in row:
                        print(f"| {preset} | {profile} | failed: {row['error']} |||||", flush=True)
                        continue
                    print(f"| {preset} | {profile} | {row['tokens_per_s']:,.0f} | {row['predicted_gpu_mb']:,.0f} | "
                          f"{row['measured_gpu_mb']:,.0f} | {row['gpu_ratio']:.2f} | {row['measured_host_mb']:,.0f} |",
                          flush=True)
    micro_batches = [2, 4, 8, 16, 32, 64]
    print("\nplain torch, bf16 autocast, AdamW, 128 tokens a side: training tokens/s by micro-batch")
    print("| preset | " + " | ".join(str(m) for m in micro_batches) + " | best / 2 |")
    print("|---|" + "---:|" * (len(micro_batches) + 1), flush=True)
    for preset in presets:
        speeds = sweep(preset, micro_batches, 128, repeats=10)
        figures["sweep"][preset] = speeds
        print(f"| {preset} | " + " | ".join(f"{s:,.0f}" for s in speeds.values()) +
              f" | {max(speeds.values()) / speeds[2]:.1f}x |", flush=True)
    if options.json:
        Path(options.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
