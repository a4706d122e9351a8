"""Predicted versus measured peak RSS, and step time, for memory modes on the CPU.

    python -m bench.memory_modes                 # every configuration (a few minutes on 2 cores)
    python -m bench.memory_modes --quick         # tiny and small only
    python -m bench.memory_modes --only=t5-small # the flan-t5-small and mt5-small shapes (docs/t5_family.md)
    python -m bench.memory_modes --only=8        # 8-bit frozen weights (int8 / float8 rows and their baselines)
    python -m bench.memory_modes --accuracy      # base SFT eval loss after 100 steps: frozen bf16 / int8 / float8

Each configuration is a real ``train_low_mem.py train`` run in its own process (a few optimizer
steps, a final checkpoint and exports included). The prediction is the ``memory_plan`` record the
run writes at start (the same numbers ``plan`` prints); the measurement is the process's peak RSS
(the kernel's high-water mark) at the end. Step time is the mean of the optimizer steps after the
first, relative to the plain configuration of the same model and data; "rel. peak" is the measured peak
against that configuration's, and "eval loss" the run's final evaluation (8 rows). The flan-t5-small and mt5-small
rows fine-tune models of those releases' shapes (SHAPES: gated-gelu, untied lm_head, mT5's 250,112-row
embedding), built here from their configs with random weights and the shipped tokenizer (never
downloaded; the embedding has more rows than the tokenizer, as Google's do). Rows marked "2 processes"
run under ``accelerate launch`` on two CPU processes over gloo, with DDP (cpu_2proc.yaml), FSDP
(fsdp_cpu.yaml) or DeepSpeed ZeRO-3 (deepspeed_zero3_cpu.yaml; pip install '.[deepspeed]'); predicted
and measured are per process (rank 0); their step is twice the batch, so their time is compared only
with the DDP row of the same optimizer.
Target: every predicted / measured ratio within 0.85-1.15.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path

from bench.harness import REPO, Column, Table, run_child, trainer

STEPS = ["--max_steps=8", "--gradient_accumulation_steps=4", "--eval_steps=0", "--max_eval_samples=8",
         "--save_steps=0", "--logging_steps=1"]

LORA = ["--lora_r=8", "--learn_rate=1e-3"]
# name, preset, kind (pretrain on short / long rows, or sft), flags, the configuration it is timed against
CONFIGS = [
    ("tiny plain", "tiny", "long", [], None),
    ("tiny checkpointing", "tiny", "long", ["--gradient_checkpointing=True"], "tiny plain"),
    ("small plain", "small", "long", [], None),
    ("small batch 1, source 64", "small", "long", ["--batch_size=1", "--max_source_len=64"], "small plain"),
    ("small checkpointing", "small", "long", ["--gradient_checkpointing=True"], "small plain"),
    ("small, no accumulation", "small", "long", ["--gradient_accumulation_steps=1"], None),
    ("small adamw", "small", "long", ["--optimizer=adamw", "--learn_rate=1e-3"], "small plain"),
    ("small adamw8bit", "small", "long", ["--optimizer=adamw8bit", "--learn_rate=1e-3"], "small plain"),
    ("small bf16 autocast", "small", "long", ["--mixed_precision=bf16"], "small plain"),
    ("tiny short rows", "tiny", "short", [], None),
    ("tiny bf16, short rows", "tiny", "short", ["--mixed_precision=bf16"], "tiny short rows"),
    ("tiny SFT", "tiny", "sft", [], None),
    ("tiny SFT encoder cache", "tiny", "sft", ["--encoder_cache=memory"], "tiny SFT"),
    ("small SFT", "small", "sft", [], None),
    ("small SFT LoRA r=8", "small", "sft", ["--lora_r=8", "--learn_rate=1e-3"], "small SFT"),
    ("small SFT, no accumulation", "small", "sft", ["--gradient_accumulation_steps=1"], None),
    ("small SFT encoder cache", "small", "sft", ["--encoder_cache=memory"], "small SFT"),
    ("small SFT long prompts", "small", "sft_long", [], None),
    ("small SFT long prompts, cache", "small", "sft_long", ["--encoder_cache=memory"], "small SFT long prompts"),
    ("small SFT bf16", "small", "sft", ["--mixed_precision=bf16"], None),
    ("small SFT bf16, frozen bf16", "small", "sft", ["--mixed_precision=bf16", "--frozen_dtype=bfloat16"],
     "small SFT bf16"),
    ("tiny docstrings 512", "tiny", "docs", ["--max_source_len=512", "--max_target_len=512"], None),
    ("small docstrings 256, ckpt", "small", "docs", ["--max_source_len=256", "--max_target_len=256",
                                                    "--gradient_checkpointing=True"], None),
    ("base plain, short rows", "base", "short", [], None),
    ("base adamw, short rows", "base", "short", ["--optimizer=adamw", "--learn_rate=1e-3"], "base plain, short rows"),
    ("base SFT LoRA r=32 qkvo, ckpt", "base", "sft", ["--lora_r=32", "--lora_target_modules=q,k,v,o",
                                                      "--gradient_checkpointing=True", "--learn_rate=1e-3"], None),
    ("small, 2 processes", "small", "long", [], None),
    ("small SFT, 2 processes", "small", "sft", [], None),
    # sharded engines on 2 CPU processes: step time relative to the DDP row of the same optimizer
    ("small, 2 processes FSDP", "small", "long", [], "small, 2 processes"),
    ("small, 2 processes ZeRO-3", "small", "long", [], "small, 2 processes"),
    ("small adamw, 2 processes", "small", "long", ["--optimizer=adamw", "--learn_rate=1e-3"], None),
    ("small adamw, 2 processes FSDP", "small", "long", ["--optimizer=adamw", "--learn_rate=1e-3"],
     "small adamw, 2 processes"),
    ("small adamw, 2 processes ZeRO-3", "small", "long", ["--optimizer=adamw", "--learn_rate=1e-3"],
     "small adamw, 2 processes"),
    ("flan-t5-small SFT", "flan-t5-small", "sft", [], None),
    ("flan-t5-small full fine-tune", "flan-t5-small", "sft", ["--freeze=none"], "flan-t5-small SFT"),
    ("flan-t5-small LoRA q,v,wi,wo", "flan-t5-small", "sft", ["--lora_r=8", "--lora_target_modules=q,v,wi,wo",
                                                               "--learn_rate=1e-3"], "flan-t5-small SFT"),
    ("mt5-small SFT", "mt5-small", "sft", [], None),
    ("mt5-small SFT encoder cache", "mt5-small", "sft", ["--encoder_cache=memory"], "mt5-small SFT"),
    # 8-bit frozen weights (--frozen_dtype, optimum-quanto): peak and time against the float32 row
    ("small SFT int8", "small", "sft", ["--frozen_dtype=int8"], "small SFT"),
    ("small SFT float8", "small", "sft", ["--frozen_dtype=float8"], "small SFT"),
    ("small SFT LoRA r=8 int8", "small", "sft", ["--lora_r=8", "--learn_rate=1e-3", "--frozen_dtype=int8"],
     "small SFT LoRA r=8"),
    ("base SFT", "base", "sft", [], None),
    ("base SFT bf16, frozen bf16", "base", "sft", ["--mixed_precision=bf16", "--frozen_dtype=bfloat16"], "base SFT"),
    ("base SFT int8", "base", "sft", ["--frozen_dtype=int8"], "base SFT"),
    ("base SFT float8", "base", "sft", ["--frozen_dtype=float8"], "base SFT"),
    ("base SFT int8, wo too", "base", "sft", ["--frozen_dtype=int8", "--quantize_wo=True"], "base SFT"),
    ("base LoRA r=8", "base", "sft", LORA, None),
    ("base LoRA r=8 bf16, frozen bf16", "base", "sft", [*LORA, "--mixed_precision=bf16", "--frozen_dtype=bfloat16"],
     "base LoRA r=8"),
    ("base LoRA r=8 int8", "base", "sft", [*LORA, "--frozen_dtype=int8"], "base LoRA r=8"),
    ("base LoRA r=8 float8", "base", "sft", [*LORA, "--frozen_dtype=float8"], "base LoRA r=8"),
    ("base LoRA r=8 int8, wo too", "base", "sft", [*LORA, "--frozen_dtype=int8", "--quantize_wo=True"],
     "base LoRA r=8"),
    ("flan-t5-base LoRA r=8", "flan-t5-base", "sft", LORA, None),
    ("flan-t5-base LoRA r=8 int8", "flan-t5-base", "sft", [*LORA, "--frozen_dtype=int8"], "flan-t5-base LoRA r=8"),
]

# Released models' shapes (their config.json values), built by write_shape: model_type, then the config.
SHAPES = {
    "flan-t5-small": ("t5", dict(d_model=512, d_ff=1024, num_heads=6, d_kv=64, num_layers=8, num_decoder_layers=8,
                                 vocab_size=32128, feed_forward_proj="gated-gelu")),
    "mt5-small": ("mt5", dict(d_model=512, d_ff=1024, num_heads=6, d_kv=64, num_layers=8, num_decoder_layers=8,
                              vocab_size=250112, feed_forward_proj="gated-gelu")),
    "flan-t5-base": ("t5", dict(d_model=768, d_ff=2048, num_heads=12, d_kv=64, num_layers=12, num_decoder_layers=12,
                                vocab_size=32128, feed_forward_proj="gated-gelu")),
}


def write_shape(folder: Path, name: str) -> Path:
    """A model folder of a release's shape (SHAPES) as the hub lays it out: random weights with an untied
    ``lm_head`` of its own, ``tie_word_embeddings: false`` in config.json, and the shipped tokenizer."""
    import shutil

    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    model_type, shape = SHAPES[name]
    config = AutoConfig.for_model(model_type, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, **shape)
    torch.manual_seed(0)
    model = AutoModelForSeq2SeqLM.from_config(config)
    weights = {k: v.contiguous() for k, v in model.state_dict().items()
               if k not in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")}
    weights["lm_head.weight"] = torch.randn(shape["vocab_size"], shape["d_model"]) * shape["d_model"] ** -0.5
    folder.mkdir(parents=True)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    saved = config.to_dict()
    saved.pop("scale_decoder_outputs", None)
    saved.update(tie_word_embeddings=False)
    (folder / "config.json").write_text(json.dumps(saved, indent=2))
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(REPO / "data/tokenizer" / file, folder / file)
    return folder


def make_corpora(folder: Path) -> dict[str, Path]:
    """Short rows (the shipped pinyin pairs) and long rows (several chatterbot turns joined)."""
    rows = [json.loads(line) for line in (REPO / "data/chatterbot/train.jsonl").read_text().splitlines()]
    rng = random.Random(0)
    long_rows, sft_rows = [], []
    for _ in range(600):
        picked = rng.sample(rows, 8)
        long_rows.append({"prompt": " ".join(r["prompt"] + " " + r["response"] for r in picked[:5]),
                          "response": " ".join(r["response"] for r in picked[5:])})
        sft_rows.append({"prompt": long_rows[-1]["prompt"], "response": picked[5]["response"]})
    long_path = folder / "long.jsonl"
    long_path.write_text("".join(json.dumps(r) + "\n" for r in long_rows))
    # SFT with a conversation as the prompt and one reply as the answer (the encoder's share is larger)
    sft_long = folder / "sft_long.jsonl"
    sft_long.write_text("".join(json.dumps(r) + "\n" for r in sft_rows))
    return {"short": REPO / "data/pinyin/train.jsonl", "long": long_path,
            "sft": REPO / "data/chatterbot/train.jsonl", "sft_long": sft_long, "docs": docstrings(folder)}


def docstrings(folder: Path) -> Path:
    """A long-tailed corpus (~450 rows, median ~90 tokens, 2 % of sources at 512+): the two halves of the
    standard library's longer docstrings, as parquet."""
    import importlib
    import re
    import warnings

    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in ("argparse", "asyncio", "collections", "csv", "datetime", "decimal", "email", "functools",
                     "http.client", "inspect", "itertools", "json", "logging", "os", "pathlib", "pickle", "random",
                     "re", "shutil", "socket", "sqlite3", "statistics", "string", "subprocess", "tarfile",
                     "textwrap", "threading", "typing", "unittest", "urllib.request", "zipfile"):
            module = importlib.import_module(name)
            for attr in dir(module):
                doc = getattr(getattr(module, attr, None), "__doc__", None)
                if isinstance(doc, str) and len(doc) > 200:
                    texts.add(re.sub(r"\s+", " ", doc).strip())
    rows = []
    for text in sorted(texts):
        words = text.split()
        rows.append({"prompt": " ".join(words[:len(words) // 2]), "response": " ".join(words[len(words) // 2:])})
    random.Random(1).shuffle(rows)
    pq.write_table(pa.Table.from_pylist(rows), folder / "docs.parquet", row_group_size=256)
    return folder / "docs.parquet"


# the launch config of each kind of 2-process row (by the end of its name): DDP, FSDP or DeepSpeed ZeRO-3
LAUNCH_CONFIGS = {"2 processes": "cpu_2proc", "2 processes FSDP": "fsdp_cpu",
                  "2 processes ZeRO-3": "deepspeed_zero3_cpu"}


def launch_config(name: str) -> str | None:
    return next((config for ending, config in sorted(LAUNCH_CONFIGS.items(), key=lambda kv: -len(kv[0]))
                 if name.endswith(ending)), None)


def run(args: list[str], config: str | None = None) -> None:
    command, env = trainer("train", *args), None
    if config:  # two ranks on the CPU over gloo, with a shipped accelerate config
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   str(REPO / f"accelerate_configs/{config}.yaml"), "--main_process_port", "29533", *command[1:]]
        if config != "deepspeed_zero3_cpu":  # accelerate's CPU flag would turn DeepSpeed off
            command.append("--cpu=True")
            env = {**os.environ, "ACCELERATE_USE_CPU": "true"}
    done = run_child(command, env=env)
    if done.rc:
        raise SystemExit(f"failed: {' '.join(args)}\n{done.output[-4000:]}")


# One row a configuration; "rel. peak": its measured peak / its baseline configuration's
COLUMNS = [Column("configuration", "name", width=32), Column("predicted MiB", "predicted", ",.0f"),
           Column("measured MiB", "measured", ",.0f"), Column("ratio", "ratio", ".2f"),
           Column("step s", "step_s", ".2f"), Column("rel. time", "rel_time", ".2f"),
           Column("rel. peak", "measured", ".2f", ratio=True), Column("eval loss", "eval_loss", ".4f")]


def measure(out: Path) -> dict:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    peak = next(r for r in records if r["event"] == "memory_peak")
    train = [r for r in records if r["event"] == "train"]
    later = train[1:] or train  # logged every step: each record's step_s is one step's time
    step_s = sum(r["step_s"] for r in later) / len(later)
    evals = [r["eval_loss"] for r in records if r["event"] == "eval"]
    return {"predicted": peak["predicted_host_peak_mb"], "measured": peak["measured_host_peak_mb"],
            "ratio": peak["host_ratio"], "step_s": step_s, "eval_loss": evals[-1] if evals else float("nan")}


def sft_init(tmp: Path, corpora: dict, inits: dict, preset: str) -> Path:
    """A model of ``preset`` to fine-tune: one pretraining step (its weights are nearly the initial ones)."""
    if preset not in inits:
        inits[preset] = tmp / f"init_{preset}"
        run([f"--train_file={corpora['sft']}", f"--model_preset={preset}", f"--output_dir={inits[preset]}",
             "--max_steps=1", "--gradient_accumulation_steps=1", "--eval_steps=0", "--max_eval_samples=2"])
    return inits[preset] / "final"


def accuracy(tmp: Path, corpora: dict, inits: dict, steps: int = 100) -> None:
    """Eval loss of base SFT (encoder and embedding frozen) after ``steps`` optimizer steps of 2 rows, with the
    frozen weights in bfloat16 (bf16 autocast), int8 and float8 (float32 compute), on 64 of the shipped
    chatterbot eval rows."""
    init = sft_init(tmp, corpora, inits, "base")
    held_out = REPO / "data/chatterbot/eval.jsonl"  # the shipped eval split: 67 rows
    losses = {}
    for name, flags in (("bfloat16", ["--mixed_precision=bf16", "--frozen_dtype=bfloat16"]),
                        ("int8", ["--frozen_dtype=int8"]), ("float8", ["--frozen_dtype=float8"])):
        out = tmp / f"accuracy_{name}"
        run(["--is_finetune=True", f"--init_from={init}", f"--train_file={corpora['sft']}", f"--eval_file={held_out}",
             f"--max_steps={steps}", "--gradient_accumulation_steps=1", "--eval_steps=0", "--max_eval_samples=64",
             "--save_steps=0", "--logging_steps=10", "--learn_rate=1e-3", *flags, f"--output_dir={out}"])
        losses[name] = measure(out)["eval_loss"]
        print(f"base SFT, frozen {name:<9} eval loss after {steps} steps {losses[name]:.4f}  "
              f"({losses[name] / losses['bfloat16']:.3f} of bfloat16's)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny and small configurations only")
    parser.add_argument("--only", default="", help="run configurations whose name contains this (and their "
                                                   "baselines)")
    parser.add_argument("--accuracy", action="store_true", help="eval loss of base SFT after 100 steps with frozen "
                                                                "weights in bfloat16, int8 and float8")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpora = make_corpora(tmp)
        inits = {}
        results = {}
        table = Table(COLUMNS, stream=True)
        chosen = {name for name, preset, *_ in CONFIGS
                  if options.only in name and not (options.quick and preset not in ("tiny", "small"))}
        chosen |= {baseline for name, *_, baseline in CONFIGS if name in chosen and baseline}  # compared against
        if options.accuracy:
            accuracy(tmp, corpora, inits)
            return
        for name, preset, kind, flags, baseline in CONFIGS:
            if name not in chosen:
                continue
            out = tmp / name.replace(" ", "_").replace(",", "").replace("=", "")
            data = ["--train_file=" + str(corpora[kind]), "--model_preset=" + preset]
            if preset in SHAPES:
                if preset not in inits:
                    inits[preset] = write_shape(tmp / f"shape_{preset}", preset)
                data = ["--is_finetune=True", f"--init_from={inits[preset]}", f"--train_file={corpora[kind]}"]
            elif kind.startswith("sft"):
                init = sft_init(tmp, corpora, inits, preset)  # a pretrained model to fine-tune
                data = ["--is_finetune=True", f"--init_from={init}", f"--train_file={corpora[kind]}"]
            config = launch_config(name)
            run([*data, *STEPS, *flags, f"--output_dir={out}"], config)
            result = results[name] = measure(out)
            rel = result["step_s"] / results[baseline]["step_s"] if baseline in results else 1.0
            # a 2-process step is twice the batch: timed only against another 2-process row
            shown = None if config and not (baseline and launch_config(baseline)) else rel
            table.add(name, {**result, "rel_time": shown}, against=baseline)
        ratios = [r["ratio"] for r in results.values()]
        within = sum(0.85 <= r <= 1.15 for r in ratios)
        print(f"{within} of {len(ratios)} predictions within +-15% (ratios {min(ratios):.2f} to {max(ratios):.2f})")


if __name__ == "__main__":
    main()
