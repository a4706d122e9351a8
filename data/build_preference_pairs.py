"""Preference pairs for the demo and the tests, built offline from the shipped chat turns (data/chatterbot, itself
from chatterbot-corpus, BSD-3-Clause): no human judged them.

    python data/build_preference_pairs.py                  # data/chatterbot/preference_{train,eval}.jsonl
    python data/build_preference_pairs.py --out_dir=/tmp/pairs

Each turn (prompt, response) gives one pair: chosen is the turn's own answer; rejected is, alternately, the answer of
another prompt (drawn at random) or the answer corrupted (its words in reverse order: fluent tokens, wrong text).
A model that prefers the chosen answers has learned to answer the prompt it was given with well-formed text.
Repeated turns are written once. Deterministic for a given seed.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent


def corrupted(answer: str) -> str:
    """The answer's words in reverse order (a one-word answer: its characters reversed)."""
    words = answer.split()
    return " ".join(reversed(words)) if len(words) > 1 else answer[::-1]


def preference_rows(turns: list[dict], seed: int = 0) -> list[dict]:
    """One {prompt, chosen, rejected} row per distinct turn of ``turns`` ({prompt, response} rows)."""
    rng = random.Random(seed)
    distinct = list({(t["prompt"], t["response"]): t for t in turns}.values())
    answers = [t["response"] for t in distinct]
    rows = []
    for i, turn in enumerate(distinct):
        rejected = corrupted(turn["response"]) if i % 2 else rng.choice(answers)
        while rejected == turn["response"]:  # (a drawn answer equal to its own, or a palindrome)
            rejected = rng.choice(answers) + " " + corrupted(turn["response"])
        rows.append({"prompt": turn["prompt"], "chosen": turn["response"], "rejected": rejected})
    return rows


def main(out_dir: str = str(HERE / "chatterbot"), seed: int = 0) -> None:
    for split in ("train", "eval"):
        turns = [json.loads(line) for line in (HERE / "chatterbot" / f"{split}.jsonl").read_text().splitlines()]
        rows = preference_rows(turns, seed)
        out = Path(out_dir) / f"preference_{split}.jsonl"
        out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        print(f"{out}: {len(rows)} pairs")


if __name__ == "__main__":
    import fire

    fire.Fire(main)
