"""T5's span corruption on raw text, through the pipeline and the CLI: packed chunks of exact lengths
from .txt and jsonl alike, the recipe's statistics, a killed run resumed bit-identically, SFT after it."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from conftest import REPO, metrics
from test_resume import assert_same_training

from config import SHIPPED_TOKENIZER_DIR
from data.objectives import span_noise
from data.objectives.base import objective_for
from data.pipeline import DataProcess, build_data, check_data
from data.preview import preview_examples
from data.tokenization import load_tokenizer
from lowmem.cli.flags import load_config

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
    raw, targets = span_noise.corrupted_lengths(128)
    sentinels = span_noise.sentinel_ids(tokenizer, 100)
    densities, spans = [], []
    for record in previews[0]:
        assert (len(record["original_ids"]), len(record["input_ids"]), len(record["labels"])) == (raw, 128, targets)
        assert span_noise.restore(record["input_ids"], record["labels"], sentinels,
                                       tokenizer.eos_token_id) == record["original_ids"]
        used = [t for t in record["labels"] if t in sentinels]
        assert used == sentinels[:len(used)]  # <extra_id_0>, <extra_id_1>, ... in order
        noise = len(record["labels"]) - len(used) - 1
        densities.append(noise / raw)
        spans.append(noise / len(used))
    assert abs(np.mean(densities) - 0.15) <= 0.01 and abs(np.mean(spans) - 3.0) <= 0.3
    assert len({tuple(r["labels"]) for r in previews[0]}) == len(previews[0])  # distinct masks


def test_prefix_lm_splits_each_chunk_at_a_random_point_and_trains(tmp_path, run_cli):
    txt, jsonl = write_corpus(tmp_path, 200)
    tokenizer = load_tokenizer(SHIPPED_TOKENIZER_DIR)
    cfg, _ = load_config({"objective": "prefix_lm", "train_file": str(txt), "max_source_len": 32,
                          "max_target_len": 12, "max_eval_samples": 4})
    records = list(preview_examples(cfg, tokenizer, 300, report=lambda _: None))
    eos = tokenizer.eos_token_id
    splits = []
    for record in records:
        inputs, labels = record["input_ids"], record["labels"]
        assert inputs[-1] == labels[-1] == eos and inputs[:-1] + labels[:-1] == record["original_ids"]
        assert len(record["original_ids"]) == 32 and len(inputs) <= 32 and 2 <= len(labels) <= 12
        splits.append(len(inputs) - 1)
    assert min(splits) == 32 - 11 and max(splits) == 31  # every split point drawn: 21..31
    assert abs(np.mean(splits) - 26) < 0.5  # uniform over them
    done = run_cli("train", "--objective=prefix_lm", f"--train_file={jsonl}", "--text_column=body", "--max_steps=4",
                   "--max_source_len=32", "--max_target_len=12", "--max_eval_samples=4",
                   f"--output_dir={tmp_path / 'run'}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "split at a random point into 22..32 input and 2..12 target tokens (prefix_lm)" in done.stdout
    assert [r["step"] for r in metrics(tmp_path / "run") if r["event"] == "eval"] == [0, 4]


def test_each_chunk_names_every_document_it_holds_tokens_of(tmp_path):
    txt, _ = write_corpus(tmp_path, 60)
    tokenizer = load_tokenizer(SHIPPED_TOKENIZER_DIR)
    cfg, _ = load_config({"objective": "span_corruption", "train_file": str(txt), "shuffle_buffer_size": 0,
                          "eval_file": str(txt), "max_eval_samples": 1})
    objective = objective_for(cfg)
    data = build_data(cfg, check_data(cfg, objective), tokenizer, DataProcess(report=lambda _: None))
    chunks = list(data.stream.iter_epoch())
    lengths = [len(tokenizer(d, add_special_tokens=False)["input_ids"]) + 1 for d in documents(60)]  # + EOS
    raw = span_noise.corrupted_lengths(128)[0]
    starts = np.cumsum([0, *lengths])
    for k, chunk in enumerate(chunks):
        holding = [row for row in range(60) if starts[row] < (k + 1) * raw and starts[row + 1] > k * raw]
        assert chunk.sources() == [(0, row) for row in holding]
    assert len(chunks) == starts[-1] // raw and any(len(c.sources()) > 2 for c in chunks)


def test_a_long_document_is_packed_a_slice_at_a_time_and_resumes_mid_document(tmp_path):
    from data.streams.packed_text import SLICE_CHARS, text_slices

    docs = [" ".join(documents(400, seed=1)), *documents(5, seed=2), "x" * (2 * SLICE_CHARS + 5)]  # ~140 KB; no spaces
    jsonl = tmp_path / "long.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    tokenizer = load_tokenizer(SHIPPED_TOKENIZER_DIR)
    cfg, _ = load_config({"objective": "span_corruption", "train_file": str(jsonl), "shuffle_buffer_size": 0,
                          "eval_file": str(jsonl), "max_eval_samples": 1})
    objective = objective_for(cfg)
    data = build_data(cfg, check_data(cfg, objective), tokenizer, DataProcess(report=lambda _: None))

    def plain():
        stream = data.fresh_stream()
        stream.make_example = lambda chunk, *_: chunk
        return stream

    for doc in docs:
        assert "".join(text_slices(doc)) == doc and max(map(len, text_slices(doc))) <= SLICE_CHARS
    assert all(s.endswith(" ") for s in list(text_slices(docs[0]))[:-1])  # cut after whitespace, words whole
    expected = [t for doc in docs for t in
                [*(i for s in text_slices(doc) for i in tokenizer(s, add_special_tokens=False)["input_ids"]),
                 tokenizer.eos_token_id]]
    chunks = list(plain().iter_epoch())
    assert sum(chunks, []) == expected[:len(chunks) * len(chunks[0])]

    stopped = plain()
    epoch = stopped.iter_epoch()
    head = [next(epoch) for _ in range(7)]  # stopped inside the first (long) document
    state = stopped.state_dict()
    assert 0 < len(state["pending"]) < len(docs[0])  # the untokenized rest of it, not the whole text
    resumed = plain()
    resumed.load_state_dict(state)
    assert head + list(resumed.iter_epoch()) == chunks


@pytest.mark.parametrize("documents_in_corpus", [300, 3000])  # counted (all sampled), estimated (512 of 3,000)
def test_an_epoch_of_packed_chunks_is_counted_or_estimated_without_max_steps(tmp_path, documents_in_corpus):
    txt, _ = write_corpus(tmp_path, documents_in_corpus)
    tokenizer = load_tokenizer(SHIPPED_TOKENIZER_DIR)
    cfg, _ = load_config({"objective": "span_corruption", "train_file": str(txt), "batch_size": 2,
                          "gradient_accumulation_steps": 4, "epochs": 2, "max_eval_samples": 1})
    objective = objective_for(cfg)
    data = build_data(cfg, check_data(cfg, objective), tokenizer, DataProcess(report=lambda _: None))
    stream = data.fresh_stream()
    chunks, second = (sum(1 for _ in stream.iter_epoch()) for _epoch in range(2))
    per_epoch, total = data.steps(cfg)
    tokens, how = data.epoch_tokens
    estimated = tokens[0] / span_noise.corrupted_lengths(128)[0]
    if documents_in_corpus < 512:  # the second epoch starts with the first's leftover tokens: it may hold one more
        assert how == "counted" and int(estimated) == chunks and per_epoch == -(-chunks // 8)
        assert total == -(-chunks // 8) + -(-second // 8) and second == int(2 * estimated) - chunks
    else:
        assert how == "estimated from 512 documents, the first of each file" and abs(estimated / chunks - 1) < 0.1


def test_an_epochs_estimate_takes_each_files_own_document_length(tmp_path):
    # 1,500 short documents and 150 long ones: estimated from the corpus's first 512 documents (the short
    # file's), the epoch was planned at 3 steps and took 7, 4 of them at learning rate 0.
    rng = random.Random(0)
    folder = tmp_path / "corpus"
    folder.mkdir()
    for name, n, words in (("a.txt", 1500, (3, 8)), ("b.txt", 150, (250, 350))):
        text = "\n\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(*words))) for _ in range(n))
        (folder / name).write_text(text + "\n", encoding="utf-8")
    tokenizer = load_tokenizer(SHIPPED_TOKENIZER_DIR)
    cfg, _ = load_config({"objective": "span_corruption", "train_file": str(folder), "batch_size": 2,
                          "gradient_accumulation_steps": 4, "max_eval_samples": 1})
    objective = objective_for(cfg)
    data = build_data(cfg, check_data(cfg, objective), tokenizer, DataProcess(report=lambda _: None))
    chunks = sum(1 for _ in data.fresh_stream().iter_epoch())
    tokens, how = data.epoch_tokens
    assert how.startswith("estimated from") and abs(tokens[0] / span_noise.corrupted_lengths(128)[0] / chunks
                                                    - 1) < 0.1


@pytest.mark.parametrize("name", ["linear", "cosine"])
def test_steps_past_an_estimated_schedule_keep_its_last_rate(name):
    import torch

    from lowmem.training.optim import warmup_schedule

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = warmup_schedule(optimizer, name, 2, 10)
    rates = []
    for _ in range(14):
        rates.append(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.step()
    assert rates[9] > 0 and rates[10:] == [rates[9]] * 4  # neither 0 (linear) nor a second cosine cycle
    assert rates[:10] == sorted(rates[:3]) + sorted(rates[2:10], reverse=True)[1:]


def test_eval_documents_shorter_than_a_chunk_are_one_error_line(tmp_path, cli_in_process):
    # The held-out documents would make no eval chunk, and an eval loss over nothing would read 0.
    train, evals = tmp_path / "train.txt", tmp_path / "eval.txt"
    train.write_text("\n\n".join(documents(100)) + "\n", encoding="utf-8")
    evals.write_text("a short document.\n\nand another one.\n", encoding="utf-8")
    done = cli_in_process("train", "--objective=span_corruption", f"--train_file={train}", f"--eval_file={evals}",
                          "--max_steps=2", f"--output_dir={tmp_path / 'run'}")
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].startswith("error: the 2 eval document(s)")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_text_shorter_than_a_chunk_carries_over_to_the_next_epochs(tmp_path, run_cli):
    """Five short lines (about 60 tokens an epoch) against chunks of 141: a chunk fills in the third epoch and
    another in the fifth (it was refused as 'all bad' after the first)."""
    train, evals = tmp_path / "short.txt", tmp_path / "eval.txt"
    train.write_text("the cat runs over the river\nthe quick brown fox jumps\na lazy dog sleeps all day\n"
                     "light and dark stone\nnight falls on the river\n", encoding="utf-8")
    evals.write_text("\n\n".join(documents(4)) + "\n", encoding="utf-8")
    done = run_cli("train", "--objective=span_corruption", f"--train_file={train}", f"--eval_file={evals}",
                   "--epochs=6", "--model_preset=tiny", "--cpu=True", "--max_eval_samples=2", "--eval_steps=0",
                   f"--output_dir={tmp_path / 'run'}")
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [r["step"] for r in metrics(tmp_path / "run") if r["event"] == "train"]
    assert steps[-1] == 2, steps


def test_targets_longer_than_max_target_len_are_one_error_line(tmp_path, cli_in_process):
    txt, _ = write_corpus(tmp_path, 20)
    done = cli_in_process("train", "--objective=span_corruption", f"--train_file={txt}", "--max_target_len=20",
                          "--max_steps=2", f"--output_dir={tmp_path / 'run'}")
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].startswith("error:")
    assert "--max_target_len=29" in done.stderr


def test_span_corruption_learns_resumes_bit_identically_and_sft_starts_from_it(
        tmp_path, run_cli, kill_at_first_checkpoint_and_resume):
    txt, _ = write_corpus(tmp_path)
    common = ["--objective=span_corruption", f"--train_file={txt}", "--max_steps=16", "--save_steps=4",
              "--eval_steps=8", "--gradient_accumulation_steps=4", "--max_eval_samples=8", "--logging_steps=2",
              "--shuffle_buffer_size=32", "--learn_rate=1e-2", "--dump_consumed=True"]
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    done = run_cli("train", f"--output_dir={straight}", *common, timeout=1200)  # a loaded CI machine is slow
    assert done.returncode == 0, done.stderr[-3000:]
    assert "plain text, documents separated by blank lines" in done.stdout
    evals = [r["eval_loss"] for r in metrics(straight) if r["event"] == "eval"]
    assert evals[-1] <= 0.75 * evals[0]

    # SIGKILL mid-run, a document split between chunks held by the packer
    kill_at_first_checkpoint_and_resume(broken, common, tmp_path / "killed.log", wait_s=600)
    consumed = assert_same_training(straight, broken)
    assert len(consumed.splitlines()) > 16 * 4 * 2  # chunks of several documents

    # generate answers a prompt holding sentinels (16 tiny steps do not teach the fill-ins themselves)
    prompt = "The <extra_id_0> walks in <extra_id_1> park"
    filled = run_cli("generate", f"--init_from={straight / 'best'}", f"--prompt={prompt}", "--max_new_tokens=12")
    assert filled.returncode == 0, filled.stderr[-3000:]
    assert filled.stdout.strip().splitlines()[-1].startswith(f"{prompt}  ->  ")

    sft = run_cli("train", "--is_finetune=True", f"--init_from={straight / 'best'}", "--max_steps=2",
                  f"--output_dir={tmp_path / 'sft'}", "--max_eval_samples=4", cwd=REPO)
    assert sft.returncode == 0, sft.stderr[-3000:]
