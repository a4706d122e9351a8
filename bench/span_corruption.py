"""Span-corruption pretraining side by side with the pairs objective and a nanoT5-style loop (issue 43).

    python -m bench.span_corruption                             # --max_source_len=128, tiny: ~6 minutes on 2 cores
    python -m bench.span_corruption --lengths=128,512 --rounds=3   # the tables in docs/span_corruption.md: ~25 minutes
    python -m bench.span_corruption --model_preset=small --lengths=512 --threads=0   # a bigger machine
    python -m bench.span_corruption --corpus_dir=/tmp/span_bench --json_out=span.json --markdown_out=span.md

Four contenders train the same T5 (``lowmem.model.build.build_model`` for ``--model_preset``, same seed, so
the same initial weights) at the same ``--max_source_len`` L, micro-batch 2 x accumulation 16, Adafactor at
the same learning rate and schedule, each in its own process:

    span          python train_low_mem.py train --objective=span_corruption on a jsonl of raw text (``text``):
                  documents packed into chunks that corrupt to exactly L inputs and T targets (T = 29 at 128,
                  114 at 512)
    pairs         python train_low_mem.py train --objective=pairs --max_source_len=L --max_target_len=T on pairs
                  cut from the same text (``cut_pairs``): the token stream cut into L-1 source tokens and the next
                  T-1 target tokens, each decoded to text; re-tokenized with EOS they are L and T tokens long, give
                  or take a token where a cut falls inside a word (the longer ones truncated to L / T): the same
                  shapes as span corruption, the pairs objective's best case
    pairs_varied  the same, with lengths drawn uniformly from L/2..L and T/2..T: pairs pad each micro-batch to
                  its longest row (the trainer pairs similar lengths within an accumulation window); span
                  corruption never pads
    nanot5        this file's ``--child=nanot5``: a span-corruption loop written the way nanoT5 does it, from its
                  recipe (not its code): ``datasets.load_dataset("json", streaming=True)`` over the same jsonl, a
                  batched ``.map`` that tokenizes (EOS per document), concatenates and slices into rows of the
                  expanded length (the remainder of each map batch dropped), ``.shuffle(buffer_size=10_000)``, a
                  DataLoader (no workers) with a numpy collator drawing T5's random-span masks and unique
                  sentinels (counted down from the top of the vocabulary), then a plain PyTorch loop:
                  ``model(**batch).loss / accumulation``, backward, clip 1.0, the trainer's Adafactor class
                  (transformers' arithmetic) and linear schedule

Contenders run one after the other, in ``--rounds`` rounds whose order alternates (span ... nanot5, then the
reverse), so a machine shared with other jobs slows all of them alike; each figure is the median over rounds,
with the spread. ``--threads`` (default 1) sets OMP/MKL threads for every contender: on 2 shared cores torch's
default of 2 spinning threads made a tiny step 13x slower (20 s instead of 1.5 s) whenever another job ran.

What each number covers:
    target tok/s   non-pad label tokens trained / training seconds, optimizer steps 2..N (step 1 holds the
                   shuffle-buffer fill). Training seconds: this trainer's ``step_s`` in metrics.jsonl (reading,
                   packing, collating, forward, backward, optimizer; no setup, evaluation or checkpoint); the
                   nanoT5 loop's time between the ends of consecutive optimizer steps (the same work)
    input tok/s    non-pad encoder tokens over the same seconds (metrics.jsonl ``tokens_per_s`` less targets)
    pad %          padded positions / all positions of the collated micro-batches of steps 1..N, inputs and
                   targets together (this trainer's: its stream and collator replayed here, same seed)
    target tok/CPU-s  the same target tokens / the CPU seconds (user + system, all threads) the process used
                   between the ends of steps 1 and N (sampled from /proc every 50 ms): the compute each one
                   costs, far less disturbed by other jobs on the machine than seconds are
    s/step         training seconds per optimizer step, steps 2..N
    batches s/step the contender's data path alone (no model), run in the bench's own process just before the
                   contender trains: seconds per optimizer step to read, tokenize, pack or mask and collate its
                   batches, steps 2..N. The model's share of a step is the rest
    CPU/wall       CPU seconds / training seconds: 1.0 when a 1-thread run had a core to itself
    1st step s     process start to the end of optimizer step 1 (imports, model, indexing, buffer fill)
    peak RSS       the process's kernel high-water mark (VmHWM) at the end of its last optimizer step, as the
                   process itself reports it (metrics.jsonl ``peak_rss_mb`` for this trainer), in MiB
    vs span        the contender's median / span's median
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import REPO, Column, Table, Timer, child_env, cpu_seconds, module, run_child, trainer
from bench.make_corpus import generate_rows, load_sources

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

NAMES = {"span": "this trainer, span corruption", "pairs": "this trainer, pairs (matched)",
         "pairs_varied": "this trainer, pairs (varied)", "nanot5": "nanoT5-style loop"}


# --------------------------------------------------------------------------- corpora
def text_corpus(path: Path, size_mb: float, seed: int = 0) -> Path:
    """A jsonl of raw-text documents (``text``) of about ``size_mb`` MB: each is one generated row of
    bench/make_corpus.py (shipped chat turns or Chinese phrases and their pinyin) as one text, about
    50-300 tokens. Written once and reused."""
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    part, written = path.with_suffix(".part"), 0
    with open(part, "w", encoding="utf-8") as fh:
        for row in generate_rows(load_sources(), seed):
            line = json.dumps({"text": row["prompt"] + "\n" + row["response"]}, ensure_ascii=False) + "\n"
            fh.write(line)
            written += len(line.encode("utf-8"))
            if written >= size_mb * 1e6:
                break
    part.rename(path)
    return path


def cut_pairs(texts: Path, out: Path, source_len: int, target_len: int, rows: int, varied: bool = False) -> dict:
    """``rows`` prompt/response pairs cut from the token stream of ``texts``, decoded to text: L-1 source
    tokens, then the next T-1 as the target (with EOS: L and T), or with ``varied`` lengths drawn uniformly
    from L/2-1..L-1 and T/2-1..T-1. Returns the re-tokenized lengths' statistics."""
    import random

    from data.tokenization import load_tokenizer

    tokenizer, rng = load_tokenizer(REPO / "data" / "tokenizer"), random.Random(source_len)
    stream, pairs = [], []

    def sizes() -> tuple[int, int]:
        if not varied:
            return source_len - 1, target_len - 1
        return rng.randint(source_len // 2, source_len) - 1, rng.randint(target_len // 2, target_len) - 1

    source, target = sizes()
    with open(texts, encoding="utf-8") as fh:
        for line in fh:
            stream.extend(tokenizer(json.loads(line)["text"], add_special_tokens=False)["input_ids"])
            while len(stream) >= source + target and len(pairs) < rows:
                pairs.append({"prompt": tokenizer.decode(stream[:source]),
                              "response": tokenizer.decode(stream[source:source + target])})
                stream = stream[source + target:]
                source, target = sizes()
            if len(pairs) >= rows:
                break
    out.write_text("".join(json.dumps(p, ensure_ascii=False) + "\n" for p in pairs), encoding="utf-8")
    lengths = [(len(tokenizer(p["prompt"])["input_ids"]), len(tokenizer(p["response"])["input_ids"])) for p in pairs]
    return {"rows": len(pairs), "source_mean": statistics.mean(min(s, source_len) for s, _ in lengths),
            "target_mean": statistics.mean(min(t, target_len) for _, t in lengths),
            "truncated_pct": 100 * sum(s > source_len or t > target_len for s, t in lengths) / len(lengths)}


# --------------------------------------------------------------------------- the nanoT5-style loop (child)
def expanded_length(inputs_length: int, density: float = 0.15, mean_span: float = 3.0) -> tuple[int, int]:
    """T5's random_spans_helper: the raw length whose corruption gives ``inputs_length`` inputs, and the
    targets length (both with EOS)."""
    def sizes(raw: int) -> tuple[int, int]:
        noise = int(round(raw * density))
        spans = int(round(noise / mean_span))
        return raw - noise + spans + 1, noise + spans + 1

    raw = inputs_length
    while sizes(raw + 1)[0] <= inputs_length:
        raw += 1
    return raw, sizes(raw)[1]


def span_mask(length: int, density: float = 0.15, mean_span: float = 3.0):
    """One random-spans noise mask (numpy's global generator, seeded once, as nanoT5 does): noise and
    non-noise tokens each cut into the same number of non-empty runs at random, alternating, starting
    with non-noise."""
    import numpy as np

    noise = min(max(int(round(length * density)), 1), length - 1)
    spans = max(int(round(noise / mean_span)), 1)

    def runs(items: int) -> np.ndarray:  # ``spans`` positive lengths summing to ``items``, uniformly
        cuts = np.sort(np.random.permutation(items - 1)[:spans - 1] + 1)
        return np.diff(np.concatenate([[0], cuts, [items]]))

    lengths = np.stack([runs(length - noise), runs(noise)], axis=1).reshape(-1)
    return np.repeat(np.tile([False, True], spans), lengths)


def with_sentinels(ids, drop, top: int, eos: int):
    """Rows of ``ids`` with each run of ``drop`` replaced by one sentinel (``top - 1``, ``top - 2``, ...
    per row, i.e. <extra_id_0>, <extra_id_1>, ...), then EOS. Every row keeps the same count."""
    import numpy as np

    starts = drop & ~np.pad(drop, ((0, 0), (1, 0)))[:, :-1]
    filled = np.where(starts, top - np.cumsum(starts, axis=1), ids)
    kept = filled[~drop | starts].reshape(len(ids), -1)
    return np.concatenate([kept, np.full((len(ids), 1), eos)], axis=1)


class SpanCollator:
    """Rows of ``raw`` token ids -> {input_ids, attention_mask, labels} of fixed lengths, no padding."""

    def __init__(self, tokenizer, density: float = 0.15, mean_span: float = 3.0):
        self.top, self.eos = len(tokenizer), tokenizer.eos_token_id
        self.density, self.mean_span = density, mean_span

    def __call__(self, rows: list[dict]) -> dict:
        import numpy as np
        import torch

        ids = np.array([r["input_ids"] for r in rows], dtype=np.int64)
        noise = np.stack([span_mask(ids.shape[1], self.density, self.mean_span) for _ in rows])
        inputs = with_sentinels(ids, noise, self.top, self.eos)
        labels = with_sentinels(ids, ~noise, self.top, self.eos)
        return {"input_ids": torch.from_numpy(inputs), "attention_mask": torch.ones(inputs.shape, dtype=torch.long),
                "labels": torch.from_numpy(labels)}


def nanot5_loader(train_file, raw: int, tokenizer, options):
    """The nanoT5 recipe's data path: streamed json, tokenized / concatenated / sliced in a batched map,
    shuffled through a buffer, collated by ``SpanCollator``."""
    import datasets
    import numpy as np
    import torch

    def pack(batch: dict) -> dict:  # tokenize (EOS per document), concatenate, slice; drop the remainder
        flat = np.fromiter((i for ids in tokenizer(batch["text"])["input_ids"] for i in ids), dtype=np.int64)
        return {"input_ids": flat[:len(flat) // raw * raw].reshape(-1, raw)}

    dataset = datasets.load_dataset("json", data_files=str(train_file), split="train", streaming=True)
    dataset = dataset.map(pack, batched=True, remove_columns=["text"])
    dataset = dataset.shuffle(seed=options.seed, buffer_size=options.nanot5_buffer)
    return torch.utils.data.DataLoader(dataset, batch_size=options.batch_size, collate_fn=SpanCollator(tokenizer),
                                       num_workers=0)


def nanot5_child(options) -> None:
    """Train ``options.steps`` optimizer steps; one JSON line per step to ``options.steps_out``."""
    import numpy as np
    import torch

    from data.tokenization import load_tokenizer
    from lowmem.cli.flags import load_config
    from lowmem.hardware.memory_use import peak_rss_bytes
    from lowmem.model.build import build_model
    from lowmem.training.optim import Adafactor, build_scheduler

    raw, target_len = expanded_length(options.max_source_len)
    torch.manual_seed(options.seed)
    np.random.seed(options.seed)
    tokenizer = load_tokenizer(REPO / "data" / "tokenizer")
    cfg, _ = load_config({"model_preset": options.model_preset, "max_source_len": options.max_source_len,
                          "max_target_len": target_len, "learn_rate": options.learn_rate,
                          "warmup_steps": options.warmup_steps, "seed": options.seed})
    from transformers import set_seed

    set_seed(options.seed)  # as the trainer seeds before building: the same initial weights
    model = build_model(cfg, tokenizer)
    model.train()
    loader = nanot5_loader(options.train_file, raw, tokenizer, options)
    optimizer = Adafactor(model.parameters(), lr=options.learn_rate)
    scheduler = build_scheduler(cfg, optimizer, options.steps)
    log = open(options.steps_out, "w", encoding="utf-8")
    log.write(json.dumps({"event": "ready", "time": time.time()}) + "\n")
    step, window = 0, {"targets": 0, "inputs": 0, "positions": 0, "loss": 0.0}
    for batch_id, batch in enumerate(loader, start=1):
        loss = model(**batch).loss
        (loss / options.accumulation).backward()
        window["targets"] += int(batch["labels"].ne(-100).sum())
        window["inputs"] += int(batch["attention_mask"].sum())
        window["positions"] += batch["input_ids"].numel() + batch["labels"].numel()
        window["loss"] += float(loss) / options.accumulation
        del loss, batch  # free this micro-batch's activations before the next one
        if batch_id % options.accumulation:
            continue
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        log.write(json.dumps({"event": "step", "step": step, "time": time.time(), **window,
                              "peak_rss_mb": peak_rss_bytes() / 2**20}) + "\n")
        log.flush()
        window = dict.fromkeys(window, 0)
        if step >= options.steps:
            break
    log.close()


# --------------------------------------------------------------------------- reading a contender
def cpu_at(samples: list[tuple[float, float]], moment: float) -> float:
    """The process's CPU seconds at ``moment``, interpolated between the watcher's samples."""
    import bisect

    at = min(max(bisect.bisect_left([t for t, _ in samples], moment), 1), len(samples) - 1)
    (t0, c0), (t1, c1) = samples[at - 1], samples[at]
    return c0 + (c1 - c0) * (moment - t0) / (t1 - t0) if t1 > t0 else c1


def our_steps(run_dir: Path) -> list[dict]:
    """Per optimizer step from metrics.jsonl (logging_steps=1): end time, training seconds, target and input
    tokens, peak RSS so far (MiB)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps, seen = [], 0
    for r in sorted((r for r in records if r["event"] == "train"), key=lambda r: r["step"]):
        targets = r["target_tokens"] - seen
        seen = r["target_tokens"]
        steps.append({"time": r["time"], "seconds": r["step_s"], "targets": targets,
                      "inputs": r["tokens_per_s"] * r["step_s"] - targets, "peak_rss_mb": r["peak_rss_mb"]})
    return steps


def nanot5_steps(path: Path) -> list[dict]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    previous = next(r["time"] for r in records if r["event"] == "ready")
    steps = []
    for r in (r for r in records if r["event"] == "step"):
        steps.append({"time": r["time"], "seconds": r["time"] - previous, "targets": r["targets"],
                      "inputs": r["inputs"], "peak_rss_mb": r["peak_rss_mb"],
                      "pad_pct": 100 * (1 - (r["targets"] + r["inputs"]) / r["positions"])})
        previous = r["time"]
    return steps


def our_flags(name: str, corpus: Path, eval_file: Path, out: Path, length: int, target: int, options) -> dict:
    objective = dict(objective="span_corruption", text_column="text") if name == "span" else dict(objective="pairs")
    return dict(train_file=corpus, eval_file=eval_file, output_dir=out, max_steps=options.steps,
                batch_size=options.batch_size, gradient_accumulation_steps=options.accumulation,
                max_source_len=length, max_target_len=target, learn_rate=options.learn_rate,
                warmup_steps=options.warmup_steps, lr_scheduler="linear", optimizer="adafactor",
                model_preset=options.model_preset, seed=options.seed, eval_steps=0, save_steps=0,
                logging_steps=1, max_eval_samples=8, overwrite_output_dir=True, **objective)


def data_path(name: str, files: dict, length: int, target: int, options) -> dict:
    """A contender's batches alone, without the model, in this process: the padded share (%) of the
    micro-batches of its first ``options.steps`` optimizer steps and the seconds per step spent making them
    (steps 2..N). This trainer's stream and collator are rebuilt from its flags (same seed, same stream)."""
    import itertools

    from data.streams.file_stream import batched
    from data.tokenization import load_tokenizer

    tokenizer = load_tokenizer(REPO / "data" / "tokenizer")
    per_step = options.batch_size * options.accumulation
    if name == "nanot5":
        loader = nanot5_loader(files["span"][0], expanded_length(length)[0], tokenizer, options)
        windows = batched(loader, options.accumulation)
    else:
        from data.objectives.base import objective_for
        from data.pipeline import DataProcess, build_data, check_data
        from lowmem.cli.flags import load_config

        flags = our_flags(name, *files[name], Path(tempfile.gettempdir()) / "span_bench_replay", length, target,
                          options)
        cfg, _ = load_config({k: str(v) for k, v in flags.items() if k != "overwrite_output_dir"})
        objective = objective_for(cfg)
        data = build_data(cfg, check_data(cfg, objective), tokenizer,
                          DataProcess(report=lambda _: None, warn=lambda _: None))
        windows = (data.collator.window(examples, cfg.batch_size)
                   for examples in batched(data.stream.iter_epoch(), per_step))
    real = positions = 0
    timer = Timer()  # a lap a step: reading, tokenizing, packing or masking, collating its window
    for window in itertools.islice(windows, options.steps):
        for batch in window:
            real += int(batch["attention_mask"].sum()) + int(batch["labels"].ne(-100).sum())
            positions += batch["input_ids"].numel() + batch["labels"].numel()
        timer.lap()
    later = timer.laps[1:]
    return {"pad_pct": 100 * (1 - real / positions), "data_s_per_step": sum(later) / len(later)}


def measure(name: str, files: dict, run_dir: Path, length: int, target: int, options) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    if name == "nanot5":
        argv = module("bench.span_corruption", "--child=nanot5", *child_flags(options), train_file=files["span"][0],
                      steps_out=run_dir / "steps.jsonl", max_source_len=length)
    else:
        argv = trainer("train", **our_flags(name, *files[name], run_dir / "out", length, target, options))
    cpu_samples: list[tuple[float, float]] = []  # (time, CPU seconds) of the running contender

    def sample(pid: int) -> bool:
        used = cpu_seconds(pid)
        if used is not None:
            cpu_samples.append((time.time(), used))
        return False

    run = run_child(argv, run_dir / "log.txt", env=child_env(options.threads), watch=sample)
    try:
        steps = nanot5_steps(run_dir / "steps.jsonl") if name == "nanot5" else our_steps(run_dir / "out")
    except (OSError, StopIteration, KeyError, ValueError):
        steps = []
    if run.rc or len(steps) < options.steps:
        raise SystemExit(f"{name} failed (exit {run.rc}, {len(steps)} of {options.steps} steps):\n  " +
                         "\n  ".join(run.tail(12)))
    later = steps[1:]
    seconds = sum(s["seconds"] for s in later)
    cpu = cpu_at(cpu_samples, steps[-1]["time"]) - cpu_at(cpu_samples, steps[0]["time"])
    return {"target_tok_s": sum(s["targets"] for s in later) / seconds,
            "target_tok_cpu_s": sum(s["targets"] for s in later) / cpu, "cpu_per_wall": cpu / seconds,
            "input_tok_s": sum(s["inputs"] for s in later) / seconds, "s_per_step": seconds / len(later),
            "first_step_s": steps[0]["time"] - run.start, "peak_rss_mib": steps[-1]["peak_rss_mb"],
            "run_peak_rss_mib": run.peak_rss_mib, "targets_per_step": later[-1]["targets"],
            "pad_pct": statistics.mean(s["pad_pct"] for s in steps) if name == "nanot5" else None}


def child_flags(options) -> list[str]:
    keys = ("model_preset", "steps", "batch_size", "accumulation", "learn_rate", "warmup_steps", "seed",
            "nanot5_buffer")
    return [f"--{k}={getattr(options, k)}" for k in keys]


# --------------------------------------------------------------------------- one table per length
def prepare_files(folder: Path, length: int, target: int, options) -> tuple[dict, dict]:
    """(train file, eval file) per contender of this trainer: the raw-text corpus (shared by every length and
    by the nanoT5 loop) and the pairs cut from it for ``length``; and the pairs' length statistics."""
    text = text_corpus(folder / f"text_{options.corpus_mb:g}mb.jsonl", options.corpus_mb, options.corpus_seed)
    text_eval = folder / "text_eval.jsonl"
    if not text_eval.exists():
        with open(text, encoding="utf-8") as fh:
            text_eval.write_text("".join(next(fh) for _ in range(20)), encoding="utf-8")
    files, stats = {"span": (text, text_eval)}, {}
    rows = options.steps * options.batch_size * options.accumulation + 1000 + 50  # + the shuffle buffer, eval
    for name in ("pairs", "pairs_varied"):
        pairs, pairs_eval = folder / f"{name}_{length}.jsonl", folder / f"{name}_{length}_eval.jsonl"
        stats[name] = cut_pairs(text, pairs, length, target, rows, varied=name == "pairs_varied")
        lines = pairs.read_text(encoding="utf-8").splitlines(keepends=True)
        pairs_eval.write_text("".join(lines[-50:]), encoding="utf-8")
        pairs.write_text("".join(lines[:-50]), encoding="utf-8")
        files[name] = (pairs, pairs_eval)
    return files, stats


def one_length(length: int, folder: Path, options) -> dict:
    raw, target = expanded_length(length)
    files, stats = prepare_files(folder, length, target, options)
    print(f"\n--max_source_len={length}: span corruption cuts {raw}-token chunks -> {length} inputs + {target} targets",
          flush=True)
    for name, s in stats.items():
        print(f"  {NAMES[name]}: {s['source_mean']:.1f} + {s['target_mean']:.1f} tokens per row on average after "
              f"truncation to {length} / {target} ({s['truncated_pct']:.1f} % of the rows truncated)")
    runs = {name: [] for name in options.only}
    for round_ in range(options.rounds):
        order = options.only if round_ % 2 == 0 else options.only[::-1]
        for name in order:
            batches = data_path(name, files, length, target, options)  # just before its run: the same conditions
            result = measure(name, files, folder / "runs" / f"{length}_{name}_{round_}", length, target, options)
            result.update(pad_pct=result["pad_pct"] if name == "nanot5" else batches["pad_pct"],
                          data_s_per_step=batches["data_s_per_step"])
            runs[name].append(result)
            print(f"  round {round_ + 1} {name:<12} target tok/s {result['target_tok_s']:>6,.0f}, per CPU-s "
                  f"{result['target_tok_cpu_s']:>6,.0f}  s/step {result['s_per_step']:.2f} (batches alone "
                  f"{result['data_s_per_step']:.3f})  peak RSS {result['peak_rss_mib']:,.0f} MiB", flush=True)
    return {"length": length, "raw": raw, "target": target, "pairs": stats, "runs": runs}


def median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


# One row a contender: medians over the rounds, the spread of the two rates, and three ratios to span's medians
COLUMNS = [Column("contender", "name"), Column("target tok/s", "target_tok_s", ",.0f"),
           Column("(min-max)", "target_tok_s_spread"), Column("target tok/CPU-s", "target_tok_cpu_s", ",.0f"),
           Column("(min-max)", "target_tok_cpu_s_spread"), Column("input tok/s", "input_tok_s", ",.0f"),
           Column("pad %", "pad_pct", ".2f"), Column("s/step", "s_per_step", ".2f"),
           Column("batches s/step", "data_s_per_step", ".3f"), Column("CPU/wall", "cpu_per_wall", ".2f"),
           Column("1st step s", "first_step_s", ".1f"), Column("peak RSS MiB", "peak_rss_mib", ",.0f"),
           Column("tok/s vs span", "target_tok_s", ".2f", ratio=True),
           Column("tok/CPU-s vs span", "target_tok_cpu_s", ".2f", ratio=True),
           Column("RSS vs span", "peak_rss_mib", ".2f", ratio=True)]


def print_table(table: dict, options) -> list[str]:
    """The table of one length (also returned as markdown lines)."""
    span = table["runs"].get("span")
    rows = Table(COLUMNS, baseline=NAMES["span"])
    for name, runs in table["runs"].items():
        values = {key: median(runs, key) for key in ("target_tok_s", "target_tok_cpu_s", "input_tok_s", "pad_pct",
                                                     "s_per_step", "data_s_per_step", "cpu_per_wall", "first_step_s",
                                                     "peak_rss_mib")}
        for key in ("target_tok_s", "target_tok_cpu_s"):
            spread = [r[key] for r in runs]
            values[f"{key}_spread"] = f"({min(spread):,.0f}-{max(spread):,.0f})" if len(runs) > 1 else None
        rows.add(NAMES[name], values)
    print(f"\nmax_source_len {table['length']} (targets {table['target']}), {options.model_preset}, "
          f"{options.steps} steps x {options.batch_size * options.accumulation} examples, median of {options.rounds} "
          "(min-max)")
    rows.show()
    markdown = rows.render(markdown=True)
    for name in ("pairs", "pairs_varied"):
        if span and name in table["runs"]:
            ratios = [median(span, key) / median(table["runs"][name], key)
                      for key in ("target_tok_cpu_s", "target_tok_s")]
            line = (f"span corruption trains at least as many target tokens per unit of compute as {NAMES[name]}: "
                    f"span / {name} = {ratios[0]:.2f} per CPU-second ({'holds' if ratios[0] >= 1.0 else 'MISSED'}), "
                    f"{ratios[1]:.2f} per second")
            print(line)
            markdown.append(f"\n{line}")
    return markdown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="128", help="comma list of --max_source_len values")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per run (at least 3)")
    parser.add_argument("--rounds", type=int, default=2, help="runs per contender, order alternating")
    parser.add_argument("--only", default="span,pairs,pairs_varied,nanot5", help="comma list of " + ", ".join(NAMES))
    parser.add_argument("--model_preset", default="tiny", help="tiny, small or base")
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--accumulation", type=int, default=16)
    parser.add_argument("--learn_rate", type=float, default=3e-3)
    parser.add_argument("--warmup_steps", type=int, default=2)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--threads", type=int, default=1, help="OMP/MKL threads per contender (0: torch's default)")
    parser.add_argument("--corpus_mb", type=float, default=40.0,
                        help="raw text generated (MB): more than the nanoT5 loop's shuffle buffer takes in")
    parser.add_argument("--corpus_seed", type=int, default=0)
    parser.add_argument("--nanot5_buffer", type=int, default=10_000, help="the nanoT5 loop's shuffle buffer (rows)")
    parser.add_argument("--corpus_dir", default=None, help="where corpora and runs go (default: a temp folder)")
    parser.add_argument("--json_out", default=None)
    parser.add_argument("--markdown_out", default=None)
    parser.add_argument("--child", choices=["nanot5"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--train_file", help=argparse.SUPPRESS)
    parser.add_argument("--steps_out", help=argparse.SUPPRESS)
    parser.add_argument("--max_source_len", type=int, default=128, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        nanot5_child(options)
        return
    options.only = [n.strip() for n in options.only.split(",") if n.strip()]
    if options.steps < 3 or not set(options.only) <= set(NAMES):
        parser.error(f"--steps must be at least 3 and --only a comma list of {', '.join(NAMES)}")
    folder = Path(options.corpus_dir) if options.corpus_dir else Path(tempfile.mkdtemp(prefix="span_bench_"))
    print(f"{platform.node()} | {os.cpu_count()} CPUs | {platform.platform()} | python {platform.python_version()} | "
          f"{time.strftime('%Y-%m-%d %H:%M')} | threads per run {options.threads or 'default'}\n"
          f"command: python -m bench.span_corruption {' '.join(sys.argv[1:])}", flush=True)
    try:
        tables = [one_length(int(n), folder, options) for n in options.lengths.split(",")]
        markdown = [line for table in tables for line in ["", *print_table(table, options)]]
    finally:
        if not options.corpus_dir:
            shutil.rmtree(folder, ignore_errors=True)
    if options.json_out:
        Path(options.json_out).write_text(json.dumps(tables, indent=1, default=str))
    if options.markdown_out:
        Path(options.markdown_out).write_text("\n".join(markdown) + "\n")


if __name__ == "__main__":
    main()
