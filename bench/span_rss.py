"""Peak RSS of span-corruption pretraining on a 1 MB and a 500 MB raw-text corpus, .txt and jsonl (issue 43).

    python -m bench.span_rss                                   # 1 MB and 500 MB, .txt and jsonl: ~15 minutes
    python -m bench.span_rss --sizes=1,50 --steps=10           # a quicker look (a few minutes on 2 cores)
    python -m bench.span_rss --corpus_dir=/data/span_rss --rounds=2   # keep the corpora (1 GB at 500 MB)

The target: "peak RSS on a 500 MB text corpus within 64 MB of a 1 MB one". Each corpus is generated once into
``--corpus_dir`` (reused when there) as documents of words drawn at random from the shipped corpora's text
(English chat words, Chinese phrases and their pinyin, each as often as it occurs there), 5 to 3,000 words
long (log-uniform), in lines of 6 to 20 words: the .txt holds them separated by blank lines (the paragraph
layout, lines joined with newlines), the jsonl the same documents as ``{"text": ...}``. A corpus of
``--big_docs_from_mb`` MB or more also holds ``--big_docs`` single documents of ``--big_doc_mb`` MB: the first
is placed at the row the shuffle buffer hands out first (``random.Random(seed).randrange(buffer)``, as
data/streams/file_stream.py draws), so the packer streams it from the first step (checked with ``--dump_consumed``);
the others lie a third and two thirds into the file (indexed, not reached in a short run).

Each run is ``train_low_mem.py train --objective=span_corruption`` with the defaults a user gets (tiny, micro 2
x 16, shuffle buffer 1,000 documents, eval set held out of the file's last rows) and ``--max_steps``, in its own
process. Peak RSS is the process's kernel high-water mark (VmHWM), as metrics.jsonl records it: through the
last optimizer step (the last ``train`` record) and through the whole run (the ``end`` record: the final
evaluation and checkpoint included); the process's peak as the kernel reports it to this one (``wait4``
rusage: the same high-water mark, read from outside) is printed as a check. Printed: one row per
run and, per format, the largest corpus's peaks less the smallest's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.harness import REPO, Column, Table, child_env, run_child, trainer

SHUFFLE_BUFFER = 1000  # the trainer's default --shuffle_buffer_size
MB = 1_000_000


def shipped_words() -> list[str]:
    """Every word occurrence of the shipped corpora: chat text split at whitespace, each Chinese phrase and
    each pinyin syllable (so frequent words come often)."""
    words = []
    with open(REPO / "data/chatterbot/train.jsonl", encoding="utf-8") as fh:
        for line in fh:
            row = json.loads(line)
            words += [w for c in ("prompt", "response") for w in re.split(r"\s+", row[c]) if 0 < len(w) < 25]
    with open(REPO / "data/pinyin/train.jsonl", encoding="utf-8") as fh:
        for line in fh:
            row = json.loads(line)
            words += [row["prompt"], *row["response"].split()]
    return words


def document(words: np.ndarray, count: int, rng: np.random.Generator) -> str:
    """``count`` random words in lines of 6-20 words."""
    drawn = words[rng.integers(len(words), size=count)]
    lines, at = [], 0
    while at < count:
        step = int(rng.integers(6, 21))
        lines.append(" ".join(drawn[at:at + step]))
        at += step
    return "\n".join(lines)


def write_corpus(folder: Path, size_mb: float, big_docs: int, big_doc_mb: float, seed: int = 0) -> dict[str, Path]:
    """``corpus_{size}mb.txt`` and ``.jsonl`` with the same documents (see the module's docstring), written
    one document at a time; reused when both exist."""
    name = f"corpus_{size_mb:g}mb" + (f"_{big_docs}x{big_doc_mb:g}mb_docs" if big_docs else "")
    paths = {fmt: folder / f"{name}.{fmt}" for fmt in ("txt", "jsonl")}
    if all(p.exists() for p in paths.values()):
        return paths
    folder.mkdir(parents=True, exist_ok=True)
    rng, words = np.random.default_rng(seed), np.array(shipped_words(), dtype=object)
    first = first_drawn_row()
    target = size_mb * MB
    big_rows, big_at = {first} if big_docs else set(), [target * k / big_docs for k in range(1, big_docs)]
    parts = {fmt: p.with_suffix(p.suffix + ".part") for fmt, p in paths.items()}
    with open(parts["txt"], "w", encoding="utf-8") as txt, open(parts["jsonl"], "w", encoding="utf-8") as jsonl:
        row = written = 0
        while written < target:
            big = row in big_rows or (big_at and written >= big_at[0])
            if big and row not in big_rows:
                big_at.pop(0)
            count = int(big_doc_mb * MB / 6) if big else int(np.exp(rng.uniform(np.log(5), np.log(3000))))
            text = document(words, count, rng)
            txt.write(("\n\n" if row else "") + text)
            jsonl.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            written += len(text.encode("utf-8")) + 2
            row += 1
        txt.write("\n")
    for fmt, part in parts.items():
        part.rename(paths[fmt])
    return paths


def first_drawn_row(seed: int = 42) -> int:
    """The row a full shuffle buffer hands out first: data/streams/file_stream.py fills it, then draws the slot to give
    out with ``random.Random(seed).randrange(buffer)`` (the trainer's --seed, default 42)."""
    return random.Random(seed).randrange(SHUFFLE_BUFFER)


def train_run(corpus: Path, out: Path, options) -> dict:
    """One short span-corruption run; its peaks (MiB) and whether it trained on a big document."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    argv = trainer("train", "--objective=span_corruption", f"--train_file={corpus}", f"--output_dir={out / 'run'}",
                   f"--max_steps={options.steps}", "--eval_steps=0", "--save_steps=0", "--logging_steps=1",
                   "--dump_consumed=True", "--seed=42")
    done = run_child(argv, out / "log.txt", env=child_env(options.threads))
    if done.rc:
        raise SystemExit(f"{corpus} failed (exit {done.rc}):\n  " + "\n  ".join(done.tail(12)))
    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["event"] == "train"]
    end = next(r for r in records if r["event"] == "memory" and r["where"] == "end")
    setup = next(r for r in records if r["event"] == "setup")
    rows = {int(line.rsplit("\t", 1)[1]) for line in (out / "run" / "consumed-rank0.tsv").read_text().splitlines()}
    return {"train_peak": train[-1]["peak_rss_mb"], "run_peak": end["peak_rss_mb"], "rusage": done.peak_rss_mib,
            "rows": setup["train_rows"], "wall_s": done.wall_s, "documents_trained": len(rows),
            "first_row_trained": first_drawn_row() in rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,500", help="corpus sizes in MB (comma list; first = the baseline)")
    parser.add_argument("--formats", default="txt,jsonl")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=1, help="runs per corpus (order alternating)")
    parser.add_argument("--big_docs", type=int, default=3)
    parser.add_argument("--big_doc_mb", type=float, default=4.0)
    parser.add_argument("--big_docs_from_mb", type=float, default=50.0, help="corpora this large get big documents")
    parser.add_argument("--threads", type=int, default=1, help="OMP/MKL threads per run (0: torch's default)")
    parser.add_argument("--corpus_dir", default=None, help="where corpora go, reused (default: a temp folder)")
    parser.add_argument("--json_out", default=None)
    options = parser.parse_args()
    sizes = [float(s) for s in options.sizes.split(",")]
    formats = [f.strip() for f in options.formats.split(",")]
    folder = Path(options.corpus_dir) if options.corpus_dir else Path(tempfile.mkdtemp(prefix="span_rss_"))
    print(f"{platform.node()} | {os.cpu_count()} CPUs | {time.strftime('%Y-%m-%d %H:%M')} | threads per run "
          f"{options.threads or 'default'}\ncommand: python -m bench.span_rss {' '.join(sys.argv[1:])}", flush=True)
    results: dict[tuple[str, float], list[dict]] = {}
    try:
        corpora = {}
        for size in sizes:
            started = time.time()
            big = options.big_docs if size >= options.big_docs_from_mb else 0
            corpora[size] = write_corpus(folder, size, big, options.big_doc_mb)
            print(f"corpus {size:g} MB ({big} big documents): {time.time() - started:.0f} s", flush=True)
        for round_ in range(options.rounds):
            for size in (sizes if round_ % 2 == 0 else sizes[::-1]):
                for fmt in formats:
                    r = train_run(corpora[size][fmt], folder / "runs" / f"{fmt}_{size:g}_{round_}", options)
                    results.setdefault((fmt, size), []).append(r)
                    big = size >= options.big_docs_from_mb and options.big_docs
                    streamed = (f" (the big one, row {first_drawn_row()}, "
                                f"{'among them' if r['first_row_trained'] else 'NOT'})")
                    print(f"  {fmt:<5} {size:>6g} MB  {r['rows']:>9,} documents  peak RSS through training "
                          f"{r['train_peak']:6.1f} MiB, whole run {r['run_peak']:6.1f} (rusage {r['rusage']:6.1f})  "
                          f"chunks hold {r['documents_trained']} document(s){streamed if big else ''}  "
                          f"{r['wall_s']:.0f} s", flush=True)
    finally:
        if not options.corpus_dir:
            shutil.rmtree(folder, ignore_errors=True)
    print()
    table = Table([Column("format", "format"), Column("corpus", "name"), Column("documents", "rows", ","),
                   Column("on disk MB", "size", "g"), Column("train peak", "train_peak", ".1f"),
                   Column("run peak", "run_peak", ".1f")])
    for (fmt, size), runs in sorted(results.items()):
        table.add(f"{size:g}MB", {"format": fmt, "rows": runs[0]["rows"], "size": size,
                                  "train_peak": max(r["train_peak"] for r in runs),
                                  "run_peak": max(r["run_peak"] for r in runs)})
    table.show()
    for fmt in formats:
        small, large = results[(fmt, sizes[0])], results[(fmt, sizes[-1])]
        for key, what in (("train_peak", "through training"), ("run_peak", "whole run")):
            grow = max(r[key] for r in large) - max(r[key] for r in small)
            print(f"{fmt}: peak RSS {what}, {sizes[-1]:g} MB less {sizes[0]:g} MB: {grow:+.1f} MiB "
                  f"(target < 64 MB = 61.0 MiB: {'ok' if grow < 61.0 else 'MISSED'})")
    if options.json_out:
        Path(options.json_out).write_text(json.dumps({f"{k[0]}_{k[1]:g}": v for k, v in results.items()}, indent=1))


if __name__ == "__main__":
    main()
