"""``prepare``: a corpus tokenized once into parquet shards trains exactly like the text it came from."""

from __future__ import annotations

import json

import torch
from conftest import REPO, metrics, synthetic_rows, write_rows
from safetensors.torch import load_file

TRAIN = ["--max_steps=4", "--gradient_accumulation_steps=2", "--eval_steps=0", "--save_steps=0",
         "--max_eval_samples=4", "--logging_steps=1", "--max_source_len=24", "--max_target_len=24"]


def test_prepared_ids_are_cut_like_the_tokenizer_cuts_text(tokenizer):
    from data.collate import Seq2SeqCollator

    collate = Seq2SeqCollator(tokenizer, max_source_len=64, max_target_len=64)
    texts = [" ".join(r["prompt"] for r in synthetic_rows(n, seed=n)) for n in (1, 3, 9, 20)]
    full = collate.token_ids(texts, 64)
    for limit in (4, 9, 64):
        assert collate.token_ids(full, limit) == collate.token_ids(texts, limit)


def test_training_from_prepared_shards_equals_training_from_text(tmp_path, run_cli):
    rows = synthetic_rows(600, seed=5)
    rows.insert(7, {"prompt": None, "response": "x"})  # a bad row: counted by prepare, never trained on
    corpus = write_rows(tmp_path / "corpus.jsonl", rows)
    evals = write_rows(tmp_path / "eval.jsonl", synthetic_rows(8, seed=6))
    prepared = tmp_path / "prepared"
    proc = run_cli("prepare", f"--train_file={corpus}", f"--prepared_dir={prepared}", "--max_source_len=24",
                   "--max_target_len=24")
    assert proc.returncode == 0, proc.stderr[-2000:]
    manifest = json.loads((prepared / "prepared.manifest").read_text())
    assert manifest["rows"] == 600 and manifest["bad_rows"] == 1 and manifest["max_source_len"] == 24

    runs = {}
    for name, source in (("text", corpus), ("prepared", prepared)):
        out = tmp_path / f"run_{name}"
        proc = run_cli("train", f"--train_file={source}", f"--eval_file={evals}", f"--output_dir={out}", *TRAIN)
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs[name] = out
    # The bad row prepare skipped is reported by the run trained from the shards
    [errors] = [r for r in metrics(runs["prepared"]) if r["event"] == "data_errors"]
    assert errors["prepared_bad_rows"] == 1 and errors["prepared_by_reason"] == {"null_value": 1}
    losses = {n: [r["loss"] for r in metrics(o) if r["event"] == "train"] for n, o in runs.items()}
    assert losses["text"] == losses["prepared"] and len(losses["text"]) == 4
    a, b = (load_file(str(o / "final" / "model.safetensors")) for o in runs.values())
    assert all(torch.equal(a[k], b[k]) for k in a)
    # SFT with the encoder cache reads the shards' token ids too (it read the text columns, found none, and
    # stopped the run as if every row had changed), and trains as from the text
    tuned = {}
    for name, source in (("text", corpus), ("prepared", prepared)):
        tuned[name] = tmp_path / f"sft_{name}"
        proc = run_cli("train", "--is_finetune=True", f"--init_from={runs['text'] / 'final'}", f"--train_file={source}",
                       f"--eval_file={evals}", f"--output_dir={tuned[name]}", "--encoder_cache=memory", *TRAIN)
        assert proc.returncode == 0 and "encoder cache: encoding" in proc.stdout, proc.stderr[-2000:]
    a, b = (load_file(str(o / "final" / "model.safetensors")) for o in tuned.values())
    assert all(torch.equal(a[k], b[k]) for k in a)

    # Shorter limits than the shards were cut to are fine (cut again); longer ones, or another tokenizer, are refused.
    longer = run_cli("train", f"--train_file={prepared}", f"--eval_file={evals}", f"--output_dir={tmp_path / 'x'}",
                     "--max_source_len=64", "--max_steps=1")
    assert longer.returncode == 2 and "--max_source_len=24" in longer.stderr
    assert len(longer.stderr.strip().splitlines()) == 1
    other = tmp_path / "other_tokenizer"
    other.mkdir()
    for f in (REPO / "data" / "tokenizer").iterdir():
        text = f.read_text(encoding="utf-8")
        (other / f.name).write_text(text.replace('"▁the"', '"▁thee"') if f.name == "tokenizer.json" else text)
    refused = run_cli("train", f"--train_file={prepared}", f"--eval_file={evals}", f"--tokenizer_dir={other}",
                      f"--output_dir={tmp_path / 'y'}", *TRAIN)
    assert refused.returncode == 2 and "another tokenizer" in refused.stderr
    again = run_cli("prepare", f"--train_file={corpus}", f"--prepared_dir={prepared}")
    assert again.returncode == 2 and "exists" in again.stderr
    # preview reads the shards as train does, which it then reads beside an --eval_file: none is needed to look
    shown = [run_cli("preview", f"--train_file={prepared}", "--num_examples=3", "--max_source_len=24",
                     "--max_target_len=24", *flags) for flags in ([], [f"--eval_file={evals}"])]
    assert all(p.returncode == 0 for p in shown), shown[0].stderr[-2000:]
    assert len(shown[0].stdout.splitlines()) == 3 and shown[0].stdout == shown[1].stdout



def test_prepare_stops_at_the_bad_row_limit_and_leaves_nothing(tmp_path, run_cli):
    rows = synthetic_rows(40, seed=1)
    rows[::2] = [{"prompt": "p", "response": ""}] * 20  # half the rows have an empty answer
    corpus = write_rows(tmp_path / "half_bad.jsonl", rows)
    prepared = tmp_path / "prepared"
    proc = run_cli("prepare", f"--train_file={corpus}", f"--prepared_dir={prepared}")
    assert proc.returncode == 2 and "20 of 40 rows are bad" in proc.stderr and "empty_value: 20" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not prepared.exists() and not (tmp_path / "prepared.partial").exists()
    proc = run_cli("prepare", f"--train_file={corpus}", f"--prepared_dir={prepared}", "--max_bad_rows_fraction=0.5")
    assert proc.returncode == 0 and json.loads((prepared / "prepared.manifest").read_text())["rows"] == 20


def test_prepare_refuses_what_it_cannot_make_and_train_names_an_unfinished_one(tmp_path, run_cli):
    folder = tmp_path / "corpus"
    corpus = write_rows(folder / "pairs.jsonl", synthetic_rows(20, seed=1))
    evals = write_rows(tmp_path / "eval.jsonl", synthetic_rows(4, seed=2))

    def one_error(proc, words: str) -> None:
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and words in lines[0], proc.stderr[-2000:]

    # span corruption packs raw text as it trains: shards of prompt/response pairs would not be what it reads
    one_error(run_cli("prepare", f"--train_file={corpus}", f"--prepared_dir={tmp_path / 'a'}",
                      "--objective=span_corruption"), "prepare tokenizes prompt/response pairs")
    # shards inside the corpus folder would be read back as its rows
    one_error(run_cli("prepare", f"--train_file={folder}", f"--prepared_dir={folder / 'prepared'}"),
              "is inside --train_file")
    assert sorted(p.name for p in folder.iterdir()) == ["pairs.jsonl"]
    # a prepare stopped before its manifest (here: the shards and the marker, no manifest) is named as such
    prepared = tmp_path / "prepared"
    assert run_cli("prepare", f"--train_file={corpus}", f"--prepared_dir={prepared}").returncode == 0
    (prepared / "prepared.manifest").unlink()
    one_error(run_cli("train", f"--train_file={prepared}", f"--eval_file={evals}", f"--output_dir={tmp_path / 'run'}"),
              "holds an unfinished prepare")
    assert not (tmp_path / "run").exists()
