"""On a GPU: tokens/s and peak GPU memory per memory profile and preset, what `auto` micro-batches buy over
2 x 16, and 8-bit frozen weights.

    python bench/gpu_profiles.py                         # every gpu* profile x tiny, small, base
    python bench/gpu_profiles.py --presets=tiny --profiles=gpu16g --steps=4   # a quick look
    python bench/gpu_profiles.py --parts=sweep           # the micro-batch sweep alone
    python bench/gpu_profiles.py --parts=frozen --jobs=8 # base SFT and LoRA, frozen float32 / bfloat16 / int8

Part 1 runs ``train_low_mem.py train --memory_profile=P --model_preset=X`` on the long-row corpus of
bench/memory_modes.py (chat turns joined, sources up to 128 tokens) for a few optimizer steps of the
profile's effective batch of 32 rows, twice: as the profile chooses (``--batch_size=auto``, the eval batch
auto too) and at the reference's ``--batch_size=2 --gradient_accumulation_steps=16 --eval_batch_size=4``.
It reads each run's own records: the micro-batch used, tokens/s (the mean of the steps after the first),
the eval pass's time (64 rows, loss and generation) and the ``memory_peak`` event (the planner's predicted
GPU peak beside the measured one: torch's reserved peak plus the CUDA context).

Part 2 (``--parts=frozen``) fine-tunes the base preset with the encoder and embedding frozen (SFT) and with
everything frozen under LoRA r=8, frozen weights in float32, int8 (optimum-quanto; computing in float32, and
in bf16) and bfloat16, and reports the GPU peak of each against float32's (the LoRA rows first: they are
where 8 bits matter most). ``--jobs=N`` runs N of them at once (peaks stay each process's own).

Part 3 is plain torch, outside the trainer: a T5 of each preset, bf16 autocast, AdamW, forward +
backward + step on random token ids of 128 tokens a side, at micro-batches 2 to 64, timed after
``torch.cuda.synchronize``. It is the ceiling a larger micro-batch approaches on this GPU, not the trainer.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.memory_modes import make_corpora  # noqa: E402


def trainer_run(args: list[str], out: Path, steps: int, eval_rows: int = 64) -> dict:
    """One ``train`` run of ``steps`` optimizer steps with one eval pass of ``eval_rows`` rows at the end (loss
    and generation: at eval batch 4 on a GPU most of a short run's time), read from the run's records."""
    command = [sys.executable, str(REPO / "train_low_mem.py"), "train", *args, f"--output_dir={out}",
               f"--max_steps={steps}", f"--eval_steps={steps}", "--save_steps=0", f"--max_eval_samples={eval_rows}",
               "--logging_steps=1"]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        return {"error": (done.stderr.strip().splitlines() or ["?"])[-1][:200]}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    setup = next(r for r in records if r["event"] == "setup")
    train = [r for r in records if r["event"] == "train"][1:]
    peak = next(r for r in records if r["event"] == "memory_peak")
    evals = [r for r in records if r["event"] == "eval"]
    return {"micro": setup["micro_batch_size"], "accumulation": setup["gradient_accumulation_steps"],
            "eval_batch": setup["eval_batch_size"],
            "tokens_per_s": sum(r["tokens_per_s"] for r in train) / max(len(train), 1),
            "step_s": sum(r["step_s"] for r in train) / max(len(train), 1),
            "eval_s": evals[-1]["eval_s"] if evals else float("nan"),
            "eval_loss": evals[-1]["eval_loss"] if evals else float("nan"),
            "predicted_gpu_mb": peak.get("predicted_gpu_peak_mb"), "measured_gpu_mb": peak.get("measured_gpu_peak_mb"),
            "gpu_ratio": peak.get("gpu_ratio"), "measured_host_mb": peak["measured_host_peak_mb"],
            "wall_s": round(time.perf_counter() - started, 1)}


def profiles(presets: list[str], names: list[str], steps: int, figures: dict, corpora: dict, tmp: Path) -> None:
    """Part 1: each profile as it chooses against 2 x 16 (the same effective batch of 32)."""
    print("| preset | profile | micro x accumulation | tokens/s | vs 2 x 16 | eval s (batch) | vs batch 4 | "
          "predicted GPU MiB | measured GPU MiB | ratio |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    corpus = corpora["long"]
    for preset in presets:
        for profile in names:
            common = [f"--memory_profile={profile}", f"--model_preset={preset}", f"--train_file={corpus}"]
            base = trainer_run([*common, "--batch_size=2", "--gradient_accumulation_steps=16",
                                "--eval_batch_size=4"], tmp / f"{preset}-{profile}-2x16", steps)
            row = trainer_run(common, tmp / f"{preset}-{profile}", steps)
            figures["profiles"][f"{preset} {profile}"] = {"auto": row, "2x16": base}
            for name, r in (("2 x 16", base), ("auto", row)):
                if "error" in r:
                    print(f"| {preset} | {profile} | {name} failed: {r['error']} ||||||||", flush=True)
            if "error" in row or "error" in base:
                continue
            for r, speed, evals in ((base, "1.00", "1.00"),
                                    (row, f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}",
                                     f"{row['eval_s'] / base['eval_s']:.2f}")):
                print(f"| {preset} | {profile} | {r['micro']} x {r['accumulation']} | {r['tokens_per_s']:,.0f} | "
                      f"{speed} | {r['eval_s']:.1f} ({r['eval_batch']}) | {evals} | {r['predicted_gpu_mb']:,.0f} | "
                      f"{r['measured_gpu_mb']:,.0f} | {r['gpu_ratio']:.2f} |", flush=True)


FROZEN = {"LoRA r=8": ["--lora_r=8", "--learn_rate=1e-3"], "SFT": []}
FROZEN_DTYPES = {"float32": ["--frozen_dtype=float32"], "int8": ["--frozen_dtype=int8"],
                 "bfloat16": ["--mixed_precision=bf16", "--frozen_dtype=bfloat16"],
                 # int8 computes in float32 unless bf16 is asked for: on a GPU that is the pair to compare
                 "int8 + bf16": ["--mixed_precision=bf16", "--frozen_dtype=int8"]}


def frozen(steps: int, figures: dict, corpora: dict, tmp: Path, jobs: int = 1, only: list[str] | None = None) -> None:
    """Part 2: base SFT and LoRA with the frozen weights in float32, bfloat16 and int8 (float32 or bf16 compute);
    ``only``: these of FROZEN_DTYPES."""
    init = tmp / "init_base"
    pretrain = trainer_run([f"--train_file={corpora['sft']}", "--model_preset=base", "--mixed_precision=no",
                            "--gradient_accumulation_steps=1"], init, 1, eval_rows=2)
    if "error" in pretrain:
        print(f"base init failed: {pretrain['error']}", flush=True)
        return
    print("| base | frozen | step s | predicted GPU MiB | measured GPU MiB | ratio | GPU peak vs float32 | eval loss |")
    print("|---|---|---:|---:|---:|---:|---:|---:|", flush=True)

    def run(mode: str, dtype: str) -> dict:
        out = tmp / f"frozen-{mode}-{dtype}".replace(" ", "").replace("=", "").replace("+", "")
        return trainer_run(["--is_finetune=True", f"--init_from={init / 'final'}", f"--train_file={corpora['sft']}",
                            "--batch_size=8", "--gradient_accumulation_steps=1", *FROZEN[mode],
                            *FROZEN_DTYPES[dtype]], out, steps, eval_rows=16)

    # Each run's GPU peak is its own process's, so the runs may share the GPU (jobs > 1); their step times
    # then measure the sharing too.
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        dtypes = [d for d in FROZEN_DTYPES if not only or d in only]
        runs = {(mode, dtype): pool.submit(run, mode, dtype) for mode in FROZEN for dtype in dtypes}
    for mode in FROZEN:
        first = None
        for dtype in dtypes:
            r = figures["frozen"][f"{mode} {dtype}"] = runs[mode, dtype].result()
            if "error" in r:
                print(f"| {mode} | {dtype} failed: {r['error']} ||||||", flush=True)
                continue
            first = r if dtype == "float32" else first  # float32 is the first row when it runs
            against = f"{r['measured_gpu_mb'] / first['measured_gpu_mb']:.2f}" if first else "-"
            print(f"| {mode} | {dtype} | {r['step_s']:.3f} | {r['predicted_gpu_mb']:,.0f} | "
                  f"{r['measured_gpu_mb']:,.0f} | {r['gpu_ratio']:.2f} | {against} | {r['eval_loss']:.4f} |",
                  flush=True)


def sweep(preset: str, micro_batches: list[int], length: int, repeats: int) -> dict[int, float]:
    """Training tokens/s (source + target) of plain torch at each micro-batch; 0 where it runs out of memory."""
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    from lowmem.model.presets import preset_shape

    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(vocab_size=32128, decoder_start_token_id=0, dropout_rate=0.0,
                                                **preset_shape(preset, "gated-gelu"))).cuda()
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
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--parts", default="profiles,frozen,sweep", help="which of profiles, frozen, sweep to run")
    parser.add_argument("--jobs", type=int, default=1,
                        help="frozen runs at once on the GPU (their GPU peaks stay their own; step times are shared)")
    parser.add_argument("--frozen_dtypes", default="", help="the frozen rows to run, comma-separated (default: all "
                        f"of {', '.join(FROZEN_DTYPES)})")
    parser.add_argument("--json", default="", help="also write every figure to this file")
    options = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("error: bench/gpu_profiles.py measures a GPU; torch sees none here")
    print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    figures = {"gpu": torch.cuda.get_device_name(0), "profiles": {}, "frozen": {}, "sweep": {}}
    presets, parts = options.presets.split(","), options.parts.split(",")

    def save() -> None:
        if options.json:
            Path(options.json).write_text(json.dumps(figures, indent=2))

    with tempfile.TemporaryDirectory() as tmp:
        corpora = make_corpora(Path(tmp)) if {"profiles", "frozen"} & set(parts) else {}
        if "profiles" in parts:
            profiles(presets, options.profiles.split(","), options.steps, figures, corpora, Path(tmp))
            save()
        if "frozen" in parts:
            print()
            frozen(options.steps, figures, corpora, Path(tmp), options.jobs,
                   [d.strip() for d in options.frozen_dtypes.split(",") if d.strip()])
            save()
    if "sweep" not in parts:
        return
    micro_batches = [2, 4, 8, 16, 32, 64]
    print("\nplain torch, bf16 autocast, AdamW, 128 tokens a side: training tokens/s by micro-batch")
    print("| preset | " + " | ".join(str(m) for m in micro_batches) + " | best / 2 |")
    print("|---|" + "---:|" * (len(micro_batches) + 1), flush=True)
    for preset in presets:
        speeds = sweep(preset, micro_batches, 128, repeats=10)
        figures["sweep"][preset] = speeds
        print(f"| {preset} | " + " | ".join(f"{s:,.0f}" for s in speeds.values()) +
              f" | {max(speeds.values()) / speeds[2]:.1f}x |", flush=True)
    save()


if __name__ == "__main__":
    main()
