"""Build the shipped corpora and the default tokenizer from installed, permissively licensed packages.

    pip install pypinyin chatterbot-corpus
    python data/build_shipped_data.py            # corpora + tokenizer
    python data/build_shipped_data.py --no_tokenizer

Outputs (deterministic for a given package version):
    data/pinyin/{train,eval}.jsonl      pypinyin's phrase dictionary (MIT): phrase -> tone-marked pinyin
    data/chatterbot/{train,eval}.jsonl  chatterbot-corpus (BSD-3-Clause): Chinese + English turn pairs
    data/tokenizer/                     sentencepiece tokenizer trained on both train splits
"""

from __future__ import annotations

import glob
import json
import os
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

EVAL_EVERY = 20  # one row in 20 goes to the held-out eval split


def pinyin_pairs() -> list[dict]:
    import pypinyin

    path = Path(pypinyin.__file__).parent / "phrases_dict.json"
    phrases = json.loads(path.read_text(encoding="utf-8"))
    # The first reading of each character is the dictionary's preferred one.
    return [{"prompt": phrase, "response": " ".join(r[0] for r in readings)} for phrase, readings in phrases.items()]


def chatterbot_pairs() -> list[dict]:
    import chatterbot_corpus
    import yaml

    root = Path(chatterbot_corpus.__file__).parent / "data"
    pairs = []
    for language in ("chinese", "english"):
        for path in sorted(glob.glob(str(root / language / "*.yml"))):
            doc = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
            for turns in doc.get("conversations") or []:
                turns = [str(t).strip() for t in turns if t is not None and str(t).strip()]
                pairs.extend({"prompt": a, "response": b} for a, b in zip(turns, turns[1:]))
    return pairs


def write_split(rows: list[dict], folder: Path, seed: int) -> tuple[int, int]:
    rows = list(rows)
    random.Random(seed).shuffle(rows)  # the source order is alphabetical; shuffle once on disk
    folder.mkdir(parents=True, exist_ok=True)
    train = [r for i, r in enumerate(rows) if i % EVAL_EVERY]
    held = [r for i, r in enumerate(rows) if not i % EVAL_EVERY]
    for name, part in (("train", train), ("eval", held)):
        with open(folder / f"{name}.jsonl", "w", encoding="utf-8") as fh:
            for row in part:
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    return len(train), len(held)


def main(no_tokenizer: bool = False) -> None:
    print("pinyin (train, eval):", write_split(pinyin_pairs(), HERE / "pinyin", seed=1))
    print("chatterbot (train, eval):", write_split(chatterbot_pairs(), HERE / "chatterbot", seed=2))
    if not no_tokenizer:
        from config import TrainConfig
        from data.tokenization import train_tokenizer

        defaults = TrainConfig()
        files = [HERE / "pinyin" / "train.jsonl", HERE / "chatterbot" / "train.jsonl"]
        tok = train_tokenizer(files, HERE / "tokenizer", ("prompt", "response"), defaults.vocab_size,
                              defaults.tokenizer_max_sentences)
        print("tokenizer:", len(tok), "tokens")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(no_tokenizer="--no_tokenizer" in sys.argv)
