"""T5's span corruption on raw text, through the pipeline and the CLI: packed chunks of exact lengths
from .txt and jsonl alike, the recipe's statistics, a killed run resumed bit-identically, SFT after it."""

from __future__ import annotations

import json
import random
import time

import numpy as np
import pytest
import torch
from conftest import REPO, metrics, run_cli
from safetensors.torch import load_file
from test_resume import launch

from config import SHIPPED_TOKENIZER_DIR
from data import span_corruption
from data.preview import preview_examples
from data.tokenization import load_tokenizer
from lowmem.flags import load_config

WORDS = ("the river runs over stone and light falls on the quiet town while birds sing in tall green trees "
         "a cat sleeps under warm sun near old walls").split()


def documents(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 150))) + "." for _ in range(n)]


def write_corpus(tmp_path, n: int = 500):
    docs = documents(n)
    txt = tmp_path / "corpus.txt"
    txt.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    jsonl = tmp_path / "corpus.jsonl"
    jsonl.write_text("".join(json.dumps({"body": d}) + "\n" for d in docs), encoding="utf-8")
    return txt, jsonl


def test_preview_gives_the_t5_recipe_for_txt_and_jsonl_alike(tmp_path):
    txt, jsonl = write_corpus(tmp_path)
    tokenizer = load_tokenizer(SHIPPED_TOKENIZER_DIR)
    previews = []
    for path, column in ((txt, "text"), (jsonl, "body")):
        cfg, _ = load_config({"objective": "span_corruption", "train_file": str(path), "text_column": column,
                              "max_eval_samples": 4})  # --max_source_len=128: chunks of 141 tokens
        previews.append(list(preview_examples(cfg, tokenizer, 200, report=lambda _: None)))
    assert [(r["input_ids"], r["labels"]) for r in previews[0]] == [(r["input_ids"], r["labels"]) for r in previews[1]]
    raw, targets = span_corruption.corrupted_lengths(128)
    sentinels = span_corruption.sentinel_ids(tokenizer, 100)
    densities, spans = [], []
    for record in previews[0]:
        assert (len(record["original_ids"]), len(record["input_ids"]), len(record["labels"])) == (raw, 128, targets)
        assert span_corruption.restore(record["input_ids"], record["labels"], sentinels,
                                       tokenizer.eos_token_id) == record["original_ids"]
        used = [t for t in record["labels"] if t in sentinels]
        assert used == sentinels[:len(used)]  # <extra_id_0>, <extra_id_1>, ... in order
        noise = len(record["labels"]) - len(used) - 1
        densities.append(noise / raw)
        spans.append(noise / len(used))
    assert abs(np.mean(densities) - 0.15) <= 0.01 and abs(np.mean(spans) - 3.0) <= 0.3
    assert len({tuple(r["labels"]) for r in previews[0]}) == len(previews[0])  # distinct masks


def test_targets_longer_than_max_target_len_are_one_error_line(tmp_path):
    txt, _ = write_corpus(tmp_path, 20)
    done = run_cli("train", "--objective=span_corruption", f"--train_file={txt}", "--max_target_len=20",
                   "--max_steps=2", f"--output_dir={tmp_path / 'run'}")
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].startswith("error:")
    assert "--max_target_len=29" in done.stderr


@pytest.mark.slow
def test_span_corruption_learns_resumes_bit_identically_and_sft_starts_from_it(tmp_path):
    txt, _ = write_corpus(tmp_path)
    common = ["--objective=span_corruption", f"--train_file={txt}", "--max_steps=16", "--save_steps=4",
              "--eval_steps=8", "--gradient_accumulation_steps=4", "--max_eval_samples=8", "--logging_steps=2",
              "--shuffle_buffer_size=32", "--learn_rate=1e-2"]
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    done = run_cli("train", f"--output_dir={straight}", *common, timeout=1200)  # a loaded CI machine is slow
    assert done.returncode == 0, done.stderr[-3000:]
    assert "plain text, documents separated by blank lines" in done.stdout
    evals = [r["eval_loss"] for r in metrics(straight) if r["event"] == "eval"]
    assert evals[-1] <= 0.75 * evals[0]

    child = launch([f"--output_dir={broken}", *common], tmp_path / "killed.log")
    started = time.time()
    while not (broken / "checkpoints" / "latest").is_file():
        assert child.poll() is None and time.time() < started + 600, (tmp_path / "killed.log").read_text()[-2000:]
        time.sleep(0.05)
    child.kill()  # mid-run, a document split between chunks held by the packer
    child.wait()
    done = run_cli("train", f"--output_dir={broken}", *common, "--is_keep_training=True", timeout=1200)
    assert done.returncode == 0 and "resumed from" in done.stdout, done.stderr[-3000:]
    a, b = (load_file(str(run / "final" / "model.safetensors")) for run in (straight, broken))
    assert all(torch.equal(a[k], b[k]) for k in a)
    losses = [{r["step"]: r["loss"] for r in metrics(run) if r["event"] == "train"} for run in (straight, broken)]
    assert losses[0] == losses[1]

    sft = run_cli("train", "--is_finetune=True", f"--init_from={straight / 'best'}", "--max_steps=2",
                  f"--output_dir={tmp_path / 'sft'}", "--max_eval_samples=4", cwd=REPO)
    assert sft.returncode == 0, sft.stderr[-3000:]
