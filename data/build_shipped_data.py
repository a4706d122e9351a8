"""Build the shipped corpora and the default tokenizer from installed, permissively licensed packages.

    pip install pypinyin chatterbot-corpus
    python data/build_shipped_data.py            # corpora + tokenizer
    python data/build_shipped_data.py --no_tokenizer
    python data/build_shipped_data.py --out_dir=/tmp/shipped   # elsewhere (tests compare it with data/)

Outputs (deterministic for a given package version):
    data/pinyin/{train,eval}.jsonl      pypinyin's phrase dictionary (MIT): phrase -> tone-marked pinyin
    data/chatterbot/{train,eval}.jsonl  chatterbot-corpus (BSD-3-Clause): Chinese + English turn pairs, each
                                        Chinese training pair written CHINESE_REPEAT times (see below); eval
                                        rows whose prompt is in training are left out
    data/tokenizer/                     sentencepiece tokenizer trained on both train splits (each row once)
"""

from __future__ import annotations

import glob
import json
import os
import random
import re
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

EVAL_EVERY = 20  # one row in 20 goes to the held-out eval split
# chatterbot-corpus has 514 Chinese training pairs beside 2,268 English ones. Hardly any Chinese pair
# repeats, while the English tech-support file repeats each of its 10 pairs about 100 times. The tiny model
# of the default job learns what it sees many times: with each pair written once it answered those 10
# prompts word for word and Chinese prompts with runs of commas. Each Chinese training pair is written 5
# times (2,570 of 4,838 rows); with 600 SFT steps the default job then answers Chinese prompts in Chinese
# (data/README.md). The split is drawn first, so eval rows are the source's draw, and the tokenizer counts
# each drawn row once.
CHINESE_REPEAT = 5
HAN = re.compile(r"[\u3400-\u9fff]")


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


def is_chinese(row: dict) -> bool:
    return bool(HAN.search(row["prompt"] + row["response"]))


def split(rows: list[dict], seed: int) -> tuple[list[dict], list[dict]]:
    """(train, eval): a seeded shuffle (the source order is alphabetical), then one row in EVAL_EVERY held out."""
    rows = list(rows)
    random.Random(seed).shuffle(rows)
    return [r for i, r in enumerate(rows) if i % EVAL_EVERY], [r for i, r in enumerate(rows) if not i % EVAL_EVERY]


def unseen(eval_rows: list[dict], train: list[dict]) -> list[dict]:
    """The eval rows whose prompt no training row has, each prompt once: the source repeats many
    conversations, and an eval row copied from training would make the eval loss and BLEU flatter
    than on prompts the model has not seen."""
    seen, out = {r["prompt"] for r in train}, []
    for row in eval_rows:
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            out.append(row)
    return out


def repeat_chinese(train: list[dict], times: int, seed: int) -> list[dict]:
    """``train`` with each Chinese row ``times`` times, shuffled again so the copies spread through the file."""
    if times == 1:
        return list(train)
    rows = [r for r in train for _ in range(times if is_chinese(r) else 1)]
    random.Random(seed).shuffle(rows)
    return rows


def write_rows(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")


def main(out: Path = HERE, no_tokenizer: bool = False) -> None:
    pinyin_train, pinyin_eval = split(pinyin_pairs(), seed=1)
    write_rows(pinyin_train, out / "pinyin" / "train.jsonl")
    write_rows(pinyin_eval, out / "pinyin" / "eval.jsonl")
    print("pinyin (train, eval):", (len(pinyin_train), len(pinyin_eval)))
    chat_train, chat_drawn = split(chatterbot_pairs(), seed=2)
    chat_eval = unseen(chat_drawn, chat_train)
    chat_written = repeat_chinese(chat_train, CHINESE_REPEAT, seed=3)
    write_rows(chat_written, out / "chatterbot" / "train.jsonl")
    write_rows(chat_eval, out / "chatterbot" / "eval.jsonl")
    chinese = sum(map(is_chinese, chat_train))
    print(f"chatterbot (train, eval): ({len(chat_written)}, {len(chat_eval)} of the {len(chat_drawn)} drawn: the rest "
          f"repeat a training prompt); train pairs {len(chat_train)}: "
          f"{chinese} Chinese (written {CHINESE_REPEAT} times), {len(chat_train) - chinese} English")
    if not no_tokenizer:
        from config import TrainConfig
        from data.tokenization import train_tokenizer

        defaults = TrainConfig()
        with tempfile.TemporaryDirectory() as tmp:
            # Each chatterbot training row once: the repetition is for training, not for the vocabulary.
            write_rows(chat_train, Path(tmp) / "chatterbot_train.jsonl")
            files = [out / "pinyin" / "train.jsonl", Path(tmp) / "chatterbot_train.jsonl"]
            tok = train_tokenizer(files, out / "tokenizer", ("prompt", "response"), defaults.vocab_size,
                                  defaults.tokenizer_max_sentences)
        print("tokenizer:", len(tok), "tokens")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out_dirs = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--out_dir=")]
    main(Path(out_dirs[-1]) if out_dirs else HERE, no_tokenizer="--no_tokenizer" in sys.argv)
