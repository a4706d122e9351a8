"""On a GPU: tokens/s and peak GPU memory per memory profile and preset, what `auto` micro-batches buy over
2 x 16, and 8-bit frozen weights.

    python -m bench.gpu_profiles                         # every gpu* profile x tiny, small, base
    python -m bench.gpu_profiles --presets=tiny --profiles=gpu16g --steps=4   # a quick look
    python -m bench.gpu_profiles --parts=sweep           # the micro-batch sweep alone
    python -m bench.gpu_profiles --parts=frozen --jobs=8 # base SFT and LoRA, frozen float32 / bfloat16 / int8

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
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.harness import Column, Table, Timer, run_child, trainer
from bench.memory_modes import make_corpora


def trainer_run(args: list[str], out: Path, steps: int, eval_rows: int = 64) -> dict:
    """One ``train`` run of ``steps`` optimizer steps with one eval pass of ``eval_rows`` rows at the end (loss
    and generation: at eval batch 4 on a GPU most of a short run's time), read from the run's records."""
    command = trainer("train", *args, f"--output_dir={out}", f"--max_steps={steps}", f"--eval_steps={steps}",
                      "--save_steps=0", f"--max_eval_samples={eval_rows}", "--logging_steps=1")
    done = run_child(command)
    if done.rc:
        return {"error": (done.tail(1) or ["?"])[-1][:200]}
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
            "wall_s": round(done.wall_s, 1)}


# Part 1's rows: 2 x 16, then the profile's own choice with its ratios to 2 x 16
PROFILE_COLUMNS = [Column("preset", "preset"), Column("profile", "profile"), Column("micro x accumulation", "sizes"),
                   Column("tokens/s", "tokens_per_s", ",.0f"), Column("vs 2 x 16", "tokens_per_s", ".2f", ratio=True),
                   Column("eval s (batch)", "eval"), Column("vs batch 4", "eval_s", ".2f", ratio=True),
                   Column("predicted GPU MiB", "predicted_gpu_mb", ",.0f"),
                   Column("measured GPU MiB", "measured_gpu_mb", ",.0f"), Column("ratio", "gpu_ratio", ".2f")]
# Part 2's rows: each mode's float32 row first, the peaks of the others against it
FROZEN_COLUMNS = [Column("base", "mode"), Column("frozen", "dtype"), Column("step s", "step_s", ".3f"),
                  Column("predicted GPU MiB", "predicted_gpu_mb", ",.0f"),
                  Column("measured GPU MiB", "measured_gpu_mb", ",.0f"), Column("ratio", "gpu_ratio", ".2f"),
                  Column("GPU peak vs float32", "measured_gpu_mb", ".2f", ratio=True),
                  Column("eval loss", "eval_loss", ".4f")]


def profiles(presets: list[str], names: list[str], steps: int, figures: dict, corpora: dict, tmp: Path) -> None:
    """Part 1: each profile as it chooses against 2 x 16 (the same effective batch of 32)."""
    table = Table(PROFILE_COLUMNS, markdown=True, stream=True)
    corpus = corpora["long"]
    for preset in presets:
        for profile in names:
            common = [f"--memory_profile={profile}", f"--model_preset={preset}", f"--train_file={corpus}"]
            base = trainer_run([*common, "--batch_size=2", "--gradient_accumulation_steps=16",
                                "--eval_batch_size=4"], tmp / f"{preset}-{profile}-2x16", steps)
            row = trainer_run(common, tmp / f"{preset}-{profile}", steps)
            figures["profiles"][f"{preset} {profile}"] = {"auto": row, "2x16": base}
            failed = {name: r for name, r in (("2 x 16", base), ("auto", row)) if "error" in r}
            for name, r in failed.items():
                table.add(f"{preset} {profile} {name}", {"preset": preset, "error": f"{profile} {name}: {r['error']}"})
            if failed:
                continue
            for name, r in (("2 x 16", base), ("auto", row)):
                table.add(f"{preset} {profile} {name}", {
                    **r, "preset": preset, "profile": profile, "sizes": f"{r['micro']} x {r['accumulation']}",
                    "eval": f"{r['eval_s']:.1f} ({r['eval_batch']})"}, against=f"{preset} {profile} 2 x 16")


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
    table = Table(FROZEN_COLUMNS, markdown=True, stream=True)

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
        for dtype in dtypes:
            r = figures["frozen"][f"{mode} {dtype}"] = runs[mode, dtype].result()
            shown = {"error": f"{dtype}: {r['error']}"} if "error" in r else r
            table.add(f"{mode} {dtype}", {**shown, "mode": mode, "dtype": dtype}, against=f"{mode} float32")


def sweep(preset: str, micro_batches: list[int], length: int, repeats: int) -> dict[int, float]:
    """Training tokens/s (source + target) of plain torch at each micro-batch; 0 where it runs out of memory."""
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    from lowmem.utils.presets import preset_shape

    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(vocab_size=32128, decoder_start_token_id=0, dropout_rate=0.0,
                                                **preset_shape(preset, "gated-gelu"))).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(ids: torch.Tensor) -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    result = {}
    for micro in micro_batches:
        ids = torch.randint(2, 32000, (micro, length), device="cuda")
        try:
            step(ids)  # two warm-up steps
            step(ids)
            with Timer(sync=torch.cuda.synchronize) as timer:
                for _ in range(repeats):
                    step(ids)
            result[micro] = 2 * micro * length * repeats / timer.seconds
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
    table = Table([Column("preset", "name"), *(Column(str(m), str(m), ",.0f") for m in micro_batches),
                   Column("best / 2", "best", ".1f")], markdown=True, stream=True)
    for preset in presets:
        speeds = sweep(preset, micro_batches, 128, repeats=10)
        figures["sweep"][preset] = speeds
        table.add(preset, {**{str(m): s for m, s in speeds.items()}, "best": max(speeds.values()) / speeds[2]})
    save()


if __name__ == "__main__":
    main()
