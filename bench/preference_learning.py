"""Held-out reward accuracy over training, DPO and SimPO on the small preset.

    python -m bench.preference_learning                       # the shipped demo pairs, after SFT on their turns
    python -m bench.preference_learning --steps=300 --only=dpo

First an SFT run on the demo pairs' prompts and chosen answers (the usual order: SFT, then preference tuning), then
DPO (cached reference) and SimPO from its final model, each evaluated on the 67 held-out demo pairs every
--eval_every steps. Prints each evaluation's reward accuracy, the steps and seconds each run took to reach 0.9,
and DPO's final held-out accuracy by kind of rejected answer (another prompt's, or the answer corrupted), with the
misses whose chosen answer gained more per token but less in sum (lost on length).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from bench.harness import REPO, child_env, run_child, trainer

DATA = REPO / "data" / "chatterbot"
LENGTH = 64  # sources and answers cut at this many tokens, in the runs and in dpo_by_kind's recomputation
COMMON = ["--model_preset=small", f"--max_source_len={LENGTH}", f"--max_target_len={LENGTH}", "--eval_generate=False",
          "--save_steps=0", "--logging_steps=10", "--batch_size=8", "--gradient_accumulation_steps=2"]


def sft_rows(folder: Path) -> Path:
    rows = [json.loads(line) for line in (DATA / "preference_train.jsonl").read_text().splitlines()]
    path = folder / "sft.jsonl"
    path.write_text("".join(json.dumps({"prompt": r["prompt"], "response": r["chosen"]}, ensure_ascii=False) + "\n"
                            for r in rows))
    return path


def curve(run: Path) -> list[tuple[int, float, float]]:
    """(step, eval reward accuracy, elapsed seconds) of each evaluation of a run."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [(r["step"], r["elapsed_s"]) for r in records if r["event"] == "train"]  # (every --logging_steps)
    return [(r["step"], r["eval_reward_accuracy"], max((t for s, t in trained if s <= r["step"]), default=0.0))
            for r in records if r["event"] == "eval"]


def dpo_by_kind(policy: Path, reference: Path, pairs: Path) -> str:
    """Held-out DPO reward accuracy of each kind of rejected answer, the rewards recomputed from the two saved
    models (the cached reference is the SFT model's log-probabilities)."""
    import torch
    from transformers import AutoTokenizer, T5ForConditionalGeneration

    from data.build_preference_pairs import corrupted

    tokenizer = AutoTokenizer.from_pretrained(str(reference))
    models = [T5ForConditionalGeneration.from_pretrained(str(folder)).eval() for folder in (policy, reference)]

    def gained(prompt: str, answer: str) -> tuple[float, int]:  # (log π - log π_ref of the answer, its tokens)
        source = tokenizer(prompt, max_length=LENGTH, truncation=True, return_tensors="pt")
        labels = tokenizer(answer, max_length=LENGTH, truncation=True, return_tensors="pt").input_ids
        with torch.no_grad():
            sums = [-model(**source, labels=labels).loss.item() * labels.shape[1] for model in models]
        return sums[0] - sums[1], labels.shape[1]

    kinds: dict[str, list[int]] = {}  # kind -> [pairs, wins, misses lost on length]
    for row in map(json.loads, pairs.read_text().splitlines()):
        (chosen, n_chosen), (rejected, n_rejected) = (gained(row["prompt"], row[side]) for side in
                                                      ("chosen", "rejected"))
        name = "corrupted" if row["rejected"] == corrupted(row["chosen"]) else "another prompt's"
        kind = kinds.setdefault(name, [0] * 3)
        kind[0] += 1
        kind[1] += chosen > rejected
        kind[2] += chosen <= rejected and chosen / n_chosen > rejected / n_rejected
    return "; ".join(f"rejected = {name} answer: {wins / n:.3f} of {n} (misses lost on length: {length})"
                     for name, (n, wins, length) in kinds.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--sft_steps", type=int, default=600)
    parser.add_argument("--eval_every", type=int, default=25)
    parser.add_argument("--only", choices=("dpo", "simpo"), default=None)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_preference_") as tmp:
        folder = Path(tmp)
        sft = folder / "sft"
        done = run_child(trainer("train", f"--train_file={sft_rows(folder)}", f"--output_dir={sft}", *COMMON,
                                 f"--max_steps={options.sft_steps}", "--eval_steps=0", "--learn_rate=1e-3"),
                         env=child_env())
        assert done.rc == 0, done.output[-3000:]
        print(f"SFT {options.sft_steps} steps: {done.wall_s:.0f} s", flush=True)
        for objective in ("dpo", "simpo"):
            if options.only not in (None, objective):
                continue
            run = folder / objective
            extra = ["--reference=cached"] if objective == "dpo" else []
            done = run_child(trainer("train", f"--objective={objective}", f"--init_from={sft / 'final'}",
                                     "--freeze=none", f"--train_file={DATA / 'preference_train.jsonl'}",
                                     f"--eval_file={DATA / 'preference_eval.jsonl'}", f"--output_dir={run}", *COMMON,
                                     *extra, f"--max_steps={options.steps}", f"--eval_steps={options.eval_every}",
                                     "--learn_rate=1e-4", "--optimizer=adamw", "--warmup_steps=10"),
                             env=child_env())
            assert done.rc == 0, done.output[-3000:]
            points = curve(run)
            reached = next(((s, t) for s, a, t in points if a >= 0.9), None)
            print(f"{objective}: " + ", ".join(f"{s}: {a:.3f}" for s, a, _ in points), flush=True)
            print(f"{objective}: reached 0.9 at " + (f"step {reached[0]} ({reached[1]:.0f} s)" if reached else
                                                      "no evaluation") + f"; run {done.wall_s:.0f} s", flush=True)
            if objective == "dpo":
                print("dpo by kind: " + dpo_by_kind(run / "final", sft / "final", DATA / "preference_eval.jsonl"))


if __name__ == "__main__":
    main()
