"""Micro-batch size against throughput, side by side in one run: this trainer at 2 x 16, 8 x 4, 16 x 2
and auto (an effective batch of 32 each), transformers' Seq2SeqTrainer at 2 x 16 and 16 x 2, and
evaluation at --eval_batch_size=4 and auto.

    python -m bench.micro_batch                                   # tiny and small, short and long rows
    python -m bench.micro_batch --presets=small --rows=short --steps=6
    python -m bench.micro_batch --only=eval                       # the evaluation rows only

Rows: "short" are the shipped chat turns (data/chatterbot) cut to 32 tokens a side; "long" are
bench/make_corpus.py rows (50-300 tokens) cut to 128 a side. Every contender trains in its own process
(bench/peers.py's runner: peak RSS of the process tree sampled every 50 ms; tokens/s = non-pad source +
target tokens over optimizer steps 2..N) with the same model, seed, Adafactor, learning rate and warmup.
auto runs with --max_rss_gb=--auto_budget_gb. Evaluation: one optimizer step, then the final evaluation of
--eval_rows rows (an untrained model generates to --max_target_len: the slowest case), its eval_s and
eval_loss from metrics.jsonl.

Targets (issue 45): small on short rows, 16 x 2 at >= 1.6x the tokens/s of 2 x 16; the best setting
>= 1.2x Seq2SeqTrainer's best at the same effective batch; evaluation at auto <= 0.5x the time at 4.
Figures: docs/throughput.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from bench.harness import REPO, module, trainer
from bench.make_corpus import make_corpus
from bench.peers import run_contender, summarize, train_contender

SETTINGS = {"2 x 16": (2, 16), "8 x 4": (8, 4), "16 x 2": (16, 2), "auto": ("auto", None)}
PEER_SETTINGS = {"Seq2SeqTrainer 2 x 16": (2, 16), "Seq2SeqTrainer 16 x 2": (16, 2)}
LIMITS = {"short": 32, "long": 128}


def corpus_for(rows: str, work: Path) -> Path:
    if rows == "short":
        return REPO / "data" / "chatterbot" / "train.jsonl"
    path = work / "long.jsonl"
    if not path.exists():
        make_corpus(2, path, seed=0)
    return path


def ours(name: str, preset: str, corpus: Path, limit: int, run_dir: Path, options, **extra) -> list[str]:
    micro, accumulation = SETTINGS.get(name, (None, None))
    flags = dict(train_file=corpus, eval_file=corpus, output_dir=run_dir / "out", model_preset=preset,
                 max_steps=options.steps, max_source_len=limit, max_target_len=limit, eval_steps=0, save_steps=0,
                 logging_steps=1, max_eval_samples=4, warmup_steps=2, seed=0)
    if micro == "auto":
        flags.update(batch_size="auto", effective_batch_size=32, max_rss_gb=options.auto_budget_gb)
    elif micro is not None:
        flags.update(batch_size=micro, gradient_accumulation_steps=accumulation)
    flags.update(extra)
    return trainer("train", **flags)


def peer(name: str, preset: str, corpus: Path, limit: int, run_dir: Path, options) -> list[str]:
    micro, accumulation = PEER_SETTINGS[name]
    flags = dict(kind="map", train_file=corpus, steps_out=run_dir / "steps.jsonl", output_dir=run_dir / "trainer",
                 cache_dir=run_dir / "hf_cache", model_preset=preset, steps=options.steps, batch_size=micro,
                 accumulation=accumulation, max_source_len=limit, max_target_len=limit, warmup_steps=2, seed=0)
    return module("bench.peer_trainers", **flags)


def train_row(name: str, argv: list[str], run_dir: Path, options) -> dict:
    kind = "lowmem" if name in SETTINGS else "peer"
    run, steps, ready = train_contender(kind, argv, run_dir, options)
    if run["rc"] or len(steps) < options.steps:
        tail = run["log"].read_text(errors="replace").splitlines()[-8:]
        return {"error": f"exit code {run['rc']}: " + " | ".join(tail)}
    result = summarize(run, steps, ready)
    if kind == "lowmem":
        setup = next(json.loads(line) for line in (run_dir / "out" / "metrics.jsonl").read_text().splitlines()
                     if '"setup"' in line)
        result["sizes"] = f"{setup['micro_batch_size']} x {setup['gradient_accumulation_steps']}"
    else:
        result["sizes"] = name.split(" ", 1)[1]
    return result


def eval_row(eval_batch: str, preset: str, corpus: Path, limit: int, run_dir: Path, options) -> dict:
    argv = ours("eval", preset, corpus, limit, run_dir, options, max_steps=1, max_eval_samples=options.eval_rows,
                eval_batch_size=eval_batch, **({"max_rss_gb": options.auto_budget_gb} if eval_batch == "auto" else {}))
    run = run_contender(argv, run_dir, options)
    if run["rc"]:
        return {"error": f"exit code {run['rc']}"}
    records = [json.loads(line) for line in (run_dir / "out" / "metrics.jsonl").read_text().splitlines()]
    evaluation = [r for r in records if r["event"] == "eval"][-1]
    setup = next(r for r in records if r["event"] == "setup")
    return {"eval_s": evaluation["eval_s"], "eval_loss": evaluation["eval_loss"], "bleu": evaluation["bleu"],
            "eval_batch": setup["eval_batch_size"],
            "peak_rss_mib": max(s[1] for s in run["samples"]) / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="tiny,small")
    parser.add_argument("--rows", default="short,long")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--only", default="train,eval", help="train, eval or both")
    parser.add_argument("--auto_budget_gb", type=float, default=4.0, help="--max_rss_gb of the auto runs")
    parser.add_argument("--eval_rows", type=int, default=100)
    parser.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS of every run (0: torch's default)")
    parser.add_argument("--json_out", default=None)
    options = parser.parse_args()
    options.device = "cpu"
    work = Path(tempfile.mkdtemp(prefix="micro_batch_"))
    report = {}
    try:
        for preset in options.presets.split(","):
            for rows in options.rows.split(","):
                corpus, limit = corpus_for(rows, work), LIMITS[rows]
                key = f"{preset}, {rows} rows (<= {limit} tokens a side)"
                report[key] = table = {}
                if "train" in options.only:
                    for name in [*SETTINGS, *PEER_SETTINGS]:
                        run_dir = work / "run"
                        shutil.rmtree(run_dir, ignore_errors=True)
                        run_dir.mkdir()
                        make = ours if name in SETTINGS else peer
                        table[name] = train_row(name, make(name, preset, corpus, limit, run_dir, options), run_dir,
                                                options)
                        print(f"{key} | {name}: {summary(table[name])}", flush=True)
                    print_ratios(table)
                if "eval" in options.only:
                    for eval_batch in ("4", "auto"):
                        run_dir = work / "run"
                        shutil.rmtree(run_dir, ignore_errors=True)
                        run_dir.mkdir()
                        table[f"eval {eval_batch}"] = eval_row(eval_batch, preset, corpus, limit, run_dir, options)
                        print(f"{key} | eval batch {eval_batch}: {table[f'eval {eval_batch}']}", flush=True)
                    a, b = table["eval 4"], table["eval auto"]
                    if "error" not in a and "error" not in b:
                        print(f"  eval time auto / 4: {b['eval_s'] / a['eval_s']:.2f} (target <= 0.5); eval loss "
                              f"{a['eval_loss']} / {b['eval_loss']}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if options.json_out:
        Path(options.json_out).write_text(json.dumps(report, indent=1))


def summary(r: dict) -> str:
    if "error" in r:
        return "failed: " + r["error"]
    return (f"{r['sizes']}: {r['tokens_per_s']:,.0f} tokens/s, peak RSS {r['peak_rss_mib']:,.0f} MiB, "
            f"loss {r['loss_first']:.3f} -> {r['loss_last']:.3f}")


def print_ratios(table: dict) -> None:
    speed = {name: r["tokens_per_s"] for name, r in table.items() if "error" not in r and r.get("tokens_per_s")}
    base = speed.get("2 x 16")
    if base:
        print("  tokens/s against 2 x 16: " + ", ".join(f"{n} {speed[n] / base:.2f}x" for n in SETTINGS if n in speed)
              + " (target for small, short rows: 16 x 2 >= 1.6x)")
    peers = [speed[n] for n in PEER_SETTINGS if n in speed]
    mine = [speed[n] for n in SETTINGS if n in speed]
    if peers and mine:
        print(f"  best of ours / best Seq2SeqTrainer: {max(mine) / max(peers):.2f}x (target >= 1.2x)", flush=True)


if __name__ == "__main__":
    main()
