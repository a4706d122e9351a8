"""Peak host RAM of preference tuning against SFT of the same model, micro-batch and answers, side by side in one run.

    python -m bench.preference_memory                 # small preset, then a flan-t5-large-shaped LoRA pair
    python -m bench.preference_memory --only=small    # the small preset's rows only (a few minutes on 2 cores)

Each row is a real ``train_low_mem.py train`` run in its own process on the shipped demo pairs
(data/chatterbot/preference_train.jsonl; ``data/build_preference_pairs.py``); the peak is the process's RSS
high-water mark. SFT trains on the same answers as the preference run: its rows are each pair's chosen and rejected
answers (the ``answers`` corpus: 2 rows per pair, micro-batch 2x the pairs'), so both decode the same tokens; the
SFT row on the chosen answers alone (micro-batch of the pairs') is shown too. The pre-pass's peak is read from a run
stopped once its reference cache is complete. The flan-large rows build a hub-shaped checkpoint with random weights
(``bench.hub_checkpoint``, 3.1 GB float32, removed at the end) and compare LoRA SFT with LoRA DPO, whose reference is
the model with its adapters off.

Targets (issue 86): DPO with a cached reference <= 1.25x SFT's peak; LoRA DPO <= 1.3x LoRA SFT; the pre-pass <= SFT.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from bench.harness import REPO, child_env, run_child, trainer

PAIRS = REPO / "data" / "chatterbot" / "preference_train.jsonl"
COMMON = ["--max_steps=4", "--eval_steps=0", "--save_steps=0", "--logging_steps=1", "--max_eval_samples=8",
          "--gradient_accumulation_steps=2", "--max_source_len=64", "--max_target_len=64", "--eval_generate=False",
          "--dropout_rate=0"]


def corpora(folder: Path) -> dict:
    """The demo pairs, and SFT's rows of the same answers (both answers; the chosen alone)."""
    rows = [json.loads(line) for line in PAIRS.read_text().splitlines()]
    out = {"pairs": PAIRS}
    for name, answers in (("answers", ("chosen", "rejected")), ("chosen", ("chosen",))):
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"prompt": r["prompt"], "response": r[a]}, ensure_ascii=False) + "\n"
                                for r in rows for a in answers))
        out[name] = path
    return out


def peak(folder: Path, name: str, corpus: Path, args: list[str], stop_when=None) -> float:
    """Peak RSS (MiB) of one training run (``stop_when(run folder)``: killed once it holds)."""
    out = folder / name.replace(" ", "_")
    watch = (lambda _pid: stop_when(out)) if stop_when else None
    run = run_child(trainer("train", f"--train_file={corpus}", f"--output_dir={out}", *COMMON, *args),
                    env=child_env(threads=2), watch=watch)
    if stop_when is None and run.rc != 0:
        raise RuntimeError(f"{name} failed:\n{run.output[-3000:]}")
    print(f"{name:<44} peak {run.peak_rss_mib:8.0f} MiB   ({run.wall_s:.0f} s)", flush=True)
    return run.peak_rss_mib


def cache_done(run: Path) -> bool:
    return bool(list(run.glob("reference/*/done-rank0.json")))


def small_rows(folder: Path, data: dict, pairs: int) -> dict:
    model = ["--model_preset=small"]
    got = {
        "sft_answers": peak(folder, "small SFT, both answers", data["answers"], [*model, f"--batch_size={2 * pairs}"]),
        "sft_chosen": peak(folder, "small SFT, chosen answers", data["chosen"], [*model, f"--batch_size={pairs}"]),
        "dpo_cached": peak(folder, "small DPO, cached reference", data["pairs"],
                           [*model, "--objective=dpo", "--reference=cached", f"--batch_size={pairs}"]),
        "pre_pass": peak(folder, "small DPO pre-pass (stopped when cached)", data["pairs"],
                         [*model, "--objective=dpo", "--reference=cached", f"--batch_size={pairs}"], cache_done),
        "dpo_copy": peak(folder, "small DPO, reference copy", data["pairs"],
                         [*model, "--objective=dpo", "--reference=copy", f"--batch_size={pairs}"]),
        "simpo": peak(folder, "small SimPO", data["pairs"], [*model, "--objective=simpo", f"--batch_size={pairs}"]),
    }
    print(f"small: DPO cached / SFT same answers {got['dpo_cached'] / got['sft_answers']:.3f} (target <= 1.25); "
          f"pre-pass / SFT {got['pre_pass'] / got['sft_answers']:.3f} (<= 1); DPO copy / SFT "
          f"{got['dpo_copy'] / got['sft_answers']:.3f}; SimPO / SFT {got['simpo'] / got['sft_answers']:.3f}; "
          f"DPO cached / SFT chosen only {got['dpo_cached'] / got['sft_chosen']:.3f}", flush=True)
    return got


def large_rows(folder: Path, data: dict, pairs: int) -> dict:
    from bench.hub_checkpoint import build_checkpoint

    model_dir = folder / "flan-large"
    build_checkpoint(model_dir, "large")
    lora = [f"--init_from={model_dir}", "--lora_r=8", "--max_steps=2"]
    try:
        got = {"lora_sft": peak(folder, "flan-large LoRA SFT, both answers", data["answers"],
                                [*lora, f"--batch_size={2 * pairs}"]),
               "lora_dpo": peak(folder, "flan-large LoRA DPO, adapter off", data["pairs"],
                                [*lora, "--objective=dpo", "--reference=adapter", f"--batch_size={pairs}"])}
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    print(f"flan-large LoRA: DPO / SFT {got['lora_dpo'] / got['lora_sft']:.3f} (target <= 1.3)", flush=True)
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=("small", "large"), default=None)
    parser.add_argument("--pairs", type=int, default=4, help="pairs per micro-batch")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_preference_") as tmp:
        folder = Path(tmp)
        data = corpora(folder)
        results = {}
        if options.only in (None, "small"):
            results["small"] = small_rows(folder, data, options.pairs)
        if options.only in (None, "large"):
            results["large"] = large_rows(folder, data, options.pairs)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
