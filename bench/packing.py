"""--packing=True against unpacked micro-batches on length-skewed pairs, side by side in one run: non-padding tokens/s
and peak RSS.

    python -m bench.packing                          # tiny preset, 12 steps of 32 examples, skewed chat pairs
    python -m bench.packing --corpus=glossary --max_len=128 --presets=tiny,small --steps=12

Rows (--corpus): skewed, the shipped chat turns (data/chatterbot) made skewed: 85 % cut to their first 1-4 words a
side (short), 15 % several turns joined (a long tail, up to --max_len tokens a side); glossary, a real dictionary
made here from the Python standard library's docstrings (a qualified name -> the first paragraph of its docstring,
2-60 words; ~1,400 pairs); or a .jsonl file of prompt/response pairs. Every contender trains the same 32 examples
per optimizer step from scratch (same seed, model, Adafactor, warmup) in its own process (bench/peers.py's
runner: peak RSS of the process tree; tokens/s = non-padding source + target tokens over optimizer steps 2..N):

- for each --rows (micro-batch x accumulation): unpacked, and packed with the same --batch_size (then packed rows,
  each at most --max_len + --max_len tokens, which an unpacked micro-batch of long-tailed rows pads to anyway);
- for each --budgets (padded tokens a micro-batch, in rows of 2 x --max_len): unpacked with
  --max_tokens_per_batch at that budget (as many rows as fit), and packed at the same budget (rows of up to
  --max_len + --max_len tokens, as many as fit).

Target (issue 74): packed >= 1.3x the non-padding tokens/s of the unpacked run at the same micro-batch budget, and
its padding <= 5 %. Figures: docs/throughput.md "Packing".
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
from pathlib import Path

from bench.harness import REPO, trainer
from bench.peers import read_steps, run_contender, summarize


def skewed_corpus(path: Path, rows: int, seed: int = 0) -> Path:
    turns = [json.loads(line) for line in (REPO / "data" / "chatterbot" / "train.jsonl").read_text().splitlines()]
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        if rng.random() < 0.85:
            turn = rng.choice(turns)
            out.append({k: " ".join(turn[k].split()[:rng.randint(1, 4)]) for k in ("prompt", "response")})
        else:
            joined = [rng.choice(turns) for _ in range(rng.randint(3, 8))]
            out.append({k: " ".join(t[k] for t in joined) for k in ("prompt", "response")})
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in out), encoding="utf-8")
    return path


def glossary_corpus(path: Path, seed: int = 0) -> Path:
    """(qualified name, first paragraph of its docstring) of the standard library's public callables, 2-60 words."""
    import importlib
    import inspect
    import re

    modules = ("os os.path re json collections itertools functools math string random pathlib datetime typing shutil "
               "subprocess statistics heapq bisect textwrap argparse logging csv sqlite3 zipfile tarfile gzip hashlib "
               "base64 uuid decimal fractions socket threading queue asyncio inspect ast copy pickle struct enum "
               "dataclasses contextlib io tempfile glob fnmatch time calendar unicodedata operator weakref types "
               "warnings traceback pprint difflib html urllib.parse email.utils http.client").split()
    out, seen = [], set()
    for name in modules:
        module = importlib.import_module(name)
        for attr in sorted(a for a in dir(module) if not a.startswith("_")):
            obj = getattr(module, attr, None)
            doc = inspect.getdoc(obj) if callable(obj) else None
            gloss = re.sub(r"\s+", " ", doc.split("\n\n")[0]).strip() if doc else ""
            if 2 <= len(gloss.split()) <= 60 and gloss not in seen:
                seen.add(gloss)
                out.append({"prompt": f"{name}.{attr}", "response": gloss})
    random.Random(seed).shuffle(out)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in out), encoding="utf-8")
    return path


def bench_corpus(choice: str, work: Path) -> Path:
    """--corpus: ``skewed`` or ``glossary`` written into ``work``, else the path given."""
    made = {"skewed": lambda: skewed_corpus(work / "skewed.jsonl", 4000),
            "glossary": lambda: glossary_corpus(work / "glossary.jsonl")}
    return made[choice]() if choice in made else Path(choice)


def contenders(rows: list[tuple[int, int]], budgets: list[int]) -> dict[str, dict]:
    """For each (micro-batch, accumulation) and each budget (padded tokens a micro-batch): unpacked and packed."""
    out = {}
    for micro, accumulation in rows:
        for packing in (False, True):
            out[f"{'packed' if packing else 'unpacked'} {micro} x {accumulation}"] = dict(
                batch_size=micro, gradient_accumulation_steps=accumulation, packing=packing)
    for budget in budgets:
        for packing in (False, True):
            out[f"{'packed' if packing else 'unpacked'}, {budget} tokens a micro-batch"] = dict(
                batch_size=32, gradient_accumulation_steps=1, max_tokens_per_batch=budget, packing=packing)
    return out


def train(flags: dict, run_dir: Path, options) -> dict:
    run = run_contender(trainer("train", **flags), run_dir, options)
    if run["rc"]:
        return {"error": " | ".join(run["log"].read_text(errors="replace").splitlines()[-6:])}
    steps, ready = read_steps("lowmem", run_dir)
    result = summarize(run, steps, ready)
    records = [json.loads(line) for line in (run_dir / "out" / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if r["event"] == "train"][1:]
    result["padding_pct"] = sum(r["padding_pct"] for r in train_records) / max(len(train_records), 1)
    result["examples_per_row"] = sum(r.get("examples_per_row", 1) for r in train_records) / max(len(train_records), 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="tiny")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--max_len", type=int, default=64)
    parser.add_argument("--corpus", default="skewed", help="skewed, glossary, or a .jsonl of prompt/response pairs")
    parser.add_argument("--rows", default="16x2,4x8", help="micro-batch x accumulation settings (32 examples a step)")
    parser.add_argument("--budgets", default="1,4,16", help="micro-batch budgets, in rows of 2 x --max_len tokens")
    parser.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS of every run (0: torch's default)")
    options = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="packing_bench_"))
    try:
        corpus = bench_corpus(options.corpus, work)
        for preset in options.presets.split(","):
            table = {}
            budgets = [2 * options.max_len * int(k) for k in options.budgets.split(",")]
            rows = [tuple(int(n) for n in setting.split("x")) for setting in options.rows.split(",") if setting]
            for name, sizes in contenders(rows, budgets).items():
                run_dir = work / "run"
                shutil.rmtree(run_dir, ignore_errors=True)
                run_dir.mkdir()
                flags = dict(train_file=corpus, eval_file=corpus, output_dir=run_dir / "out", model_preset=preset,
                             max_steps=options.steps, max_source_len=options.max_len, max_target_len=options.max_len,
                             eval_steps=0, save_steps=0, logging_steps=1, max_eval_samples=4, warmup_steps=2, seed=0,
                             **sizes)
                table[name] = row = train(flags, run_dir, options)
                print(f"{preset} | {name}: " + (row["error"] if "error" in row else
                      f"{row['tokens_per_s']:,.0f} non-padding tok/s, padding {row['padding_pct']:.1f} %, "
                      f"{row['examples_per_row']:.1f} examples/row, peak RSS {row['peak_rss_mib']:,.0f} MiB"),
                      flush=True)
            rates = {name: row.get("tokens_per_s") or 0 for name, row in table.items()}
            for setting in [f"{m} x {a}" for m, a in rows] + [f", {b} tokens a micro-batch" for b in budgets]:
                gap = "" if setting.startswith(",") else " "
                packed, unpacked = (f"{kind}{gap}{setting}" for kind in ("packed", "unpacked"))
                ratio = rates[packed] / max(rates[unpacked], 1e-9)
                memory = [table[name].get("peak_rss_mib", 0) for name in (packed, unpacked)]
                print(f"{preset} | {setting.lstrip(', ')}: packed / unpacked {ratio:.2f}x tokens/s, peak RSS "
                      f"{memory[0]:,.0f} / {memory[1]:,.0f} MiB", flush=True)
            best = max(rates, key=rates.get)
            print(f"{preset} | fastest: {best} ({rates[best]:,.0f} tok/s)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
