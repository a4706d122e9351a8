"""A jsonl training corpus of a requested size, built from the shipped data, for the benchmarks.

    python -m bench.make_corpus --size_mb=10 --out=/tmp/corpus_10mb.jsonl
    python -m bench.make_corpus --size_mb=1000 --out=/tmp/corpus_1000mb.jsonl --seed=0

Each generated row joins a few random rows of one shipped corpus: half of the rows are several
Chinese phrases -> their pinyin (data/pinyin), half are a few chat turns -> the replies of the next
turns (data/chatterbot, English and Chinese). That gives rows of about 50-300 tokens (source +
target with the shipped tokenizer: median about 140, 5-95 % about 45-260; about 7 % of the rows
exceed the benchmarks' 128-token limit on one side). Rows are drawn independently from one seeded
generator, so every size has the same length distribution (tokens/s stays comparable across sizes)
and a smaller corpus is the beginning of a larger one of the same seed. Rows are written as they
are made: memory stays bounded (a few MB of shipped rows) whatever the size.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

from bench.harness import REPO

SOURCES = {"pinyin": REPO / "data/pinyin/train.jsonl", "chat": REPO / "data/chatterbot/train.jsonl"}
# Shipped rows joined per generated row. A pinyin pair is about 8 tokens (both sides, separators
# included), a chat turn about 30: both ranges give roughly 50-300 tokens per generated row.
PINYIN_PAIRS = (7, 32)
CHAT_TURNS = (2, 9)
MB = 1_000_000


def load_sources() -> dict[str, list[dict]]:
    """The shipped rows (about 3 MB in all: the only thing held in memory)."""
    out = {}
    for name, path in SOURCES.items():
        with open(path, encoding="utf-8") as fh:
            out[name] = [json.loads(line) for line in fh if line.strip()]
    return out


def generate_rows(sources: dict[str, list[dict]], seed: int):
    """Endless generated rows ``{"prompt", "response"}``, deterministic for ``seed``."""
    rng = random.Random(seed)
    pinyin, chat = sources["pinyin"], sources["chat"]
    while True:
        if rng.random() < 0.5:
            picked = rng.sample(pinyin, rng.randint(*PINYIN_PAIRS))
            yield {"prompt": "，".join(r["prompt"] for r in picked),
                   "response": ", ".join(r["response"] for r in picked)}
        else:
            picked = rng.sample(chat, rng.randint(*CHAT_TURNS))
            half = len(picked) // 2  # the first turns are the context, the later replies the target
            yield {"prompt": " ".join(r["prompt"] + " " + r["response"] for r in picked[:half]),
                   "response": " ".join(r["response"] for r in picked[half:])}


def make_corpus(size_mb: float, out: str | Path, seed: int = 0) -> dict:
    """Write about ``size_mb`` MB (10^6 bytes) of generated rows to ``out`` (jsonl, UTF-8).

    The file appears under its name only when complete (written next to it, then renamed), so a
    killed run never leaves a short corpus that a later benchmark would reuse.

    Returns:
        ``{"path", "rows", "bytes"}``.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    target = int(size_mb * MB)
    staging = out.with_name(out.name + ".partial")
    rows = written = 0
    with open(staging, "wb", buffering=1 << 20) as fh:
        for row in generate_rows(load_sources(), seed):
            if written >= target:
                break
            line = (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8")
            fh.write(line)
            written += len(line)
            rows += 1
    os.replace(staging, out)
    return {"path": str(out), "rows": rows, "bytes": written}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size_mb", type=float, required=True, help="approximate size in MB (10^6 bytes)")
    parser.add_argument("--out", required=True, help="jsonl file to write")
    parser.add_argument("--seed", type=int, default=0, help="seed of the row generator")
    options = parser.parse_args()
    done = make_corpus(options.size_mb, options.out, options.seed)
    print(f"{done['path']}: {done['rows']:,} rows, {done['bytes'] / MB:,.1f} MB")


if __name__ == "__main__":
    main()
