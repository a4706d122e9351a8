"""Hugging Face datasets as --train_file (data/sources/hf_datasets.py, data/streams/dataset_stream.py), offline: a
folder written by save_to_disk, and a local copy of a hub dataset repository (a README.md dataset card declaring
configs), which goes through the code a hub id goes through (load_dataset_builder(...).as_streaming_dataset). Pairs and
span corruption: preview, the stream resumed exactly at any example, disjoint shares per process, the eval-set rule,
a killed run resumed bit-identically, and one error line per mistake. conftest sets HF_HUB_OFFLINE=1."""

from __future__ import annotations

import io
import json
import random
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import metrics, synthetic_rows
from test_resume import assert_same_training

from data.objectives.base import objective_for
from data.pipeline import DataProcess, build_data, check_data
from data.sources.corpus import resolve_files
from data.sources.hf_datasets import dataset_ref
from data.streams.dataset_stream import DatasetStream
from data.streams.file_stream import StreamSpec
from lowmem.cli.flags import load_config
from lowmem.utils.errors import UserError

WORDS = "the river runs over stone and light falls on the quiet town while birds sing in tall green trees".split()
PAIRS = ("prompt", "response")
SMALL = ["--max_source_len=32", "--max_target_len=32", "--max_eval_samples=4", "--logging_steps=1",
         "--eval_generate=False"]


def documents(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60))) + "." for _ in range(n)]


def save_pairs(folder: Path, n: int = 60, seed: int = 1, validation: int = 0) -> Path:
    """A save_to_disk folder of prompt/response rows: a Dataset, or a DatasetDict with a validation split."""
    from datasets import Dataset, DatasetDict

    rows = synthetic_rows(n + validation, seed=seed)
    train = Dataset.from_list(rows[:n])
    data = DatasetDict(train=train, validation=Dataset.from_list(rows[n:])) if validation else train
    data.save_to_disk(str(folder))
    return folder


def save_text(folder: Path, n: int = 80) -> Path:
    from datasets import Dataset

    Dataset.from_dict({"body": documents(n), "id": list(range(n))}).save_to_disk(str(folder))
    return folder


def write_repo(folder: Path, shards: int = 2, rows: int = 20, validation: int = 5) -> Path:
    """A local copy of a hub dataset repository: two configs (en, zh) of jsonl shards and a dataset card."""
    card = ["---", "configs:"]
    for config in ("en", "zh"):
        (folder / config).mkdir(parents=True)
        for shard in range(shards):
            part = synthetic_rows(rows, seed=100 * shard + len(config))
            (folder / config / f"train-{shard}.jsonl").write_text(
                "".join(json.dumps({**r, "n": shard * rows + i}) + "\n" for i, r in enumerate(part)))
        (folder / config / "validation.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in synthetic_rows(validation, seed=7)))
        card += [f"- config_name: {config}", "  data_files:", "  - split: train", f"    path: {config}/train-*.jsonl",
                 "  - split: validation", f"    path: {config}/validation.jsonl"]
    (folder / "README.md").write_text("\n".join(card + ["---", "# a test dataset"]) + "\n")
    return folder


def read_all(stream: DatasetStream, epochs: int = 2, cut: int | None = None) -> list[tuple[int, int, str]]:
    """(epoch, row, prompt) of every example over ``epochs``; with ``cut``, the stream is saved after that many
    examples (through torch.save / a weights_only load, as a checkpoint holds it) and a new one reads the rest."""
    out = []
    while stream.epoch < epochs:
        epoch = stream.epoch
        for example in stream.iter_epoch():
            out.append((epoch, example.row, example.prompt))
            if len(out) == cut:
                buffer = io.BytesIO()
                torch.save(stream.state_dict(), buffer)
                buffer.seek(0)
                resumed = DatasetStream(stream.source, stream.spec, stream.rank, stream.world_size, stream.skip)
                resumed.load_state_dict(torch.load(buffer, weights_only=True))
                return out + read_all(resumed, epochs)
    return out


def test_sources_are_told_apart(tmp_path):
    saved = save_pairs(tmp_path / "saved")
    both = save_pairs(tmp_path / "dict", validation=4)
    repo = write_repo(tmp_path / "repo")
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "a.jsonl").write_text(json.dumps(synthetic_rows(1)[0]) + "\n")
    assert [dataset_ref(str(p)).kind for p in (saved, both, repo)] == ["saved", "saved_dict", "hub"]
    assert dataset_ref("BelleGroup/train_0.5M_CN").kind == dataset_ref("imdb").kind == "hub"
    assert dataset_ref(str(plain)) is None and dataset_ref("missing.jsonl") is None
    assert resolve_files(str(plain)) == [plain / "a.jsonl"]  # a folder of files is read as files, as before
    with pytest.raises(UserError, match="does not exist"):
        resolve_files(str(tmp_path / "missing.jsonl"))
    with pytest.raises(UserError, match="name it alone"):
        resolve_files(f"{saved},{plain / 'a.jsonl'}")


@pytest.mark.parametrize("kind", ["saved", "repo"])
def test_stream_resumes_exactly_anywhere_and_processes_share_disjointly(tmp_path, kind):
    source = (dataset_ref(str(save_pairs(tmp_path / "d", n=37))) if kind == "saved"
              else dataset_ref(str(write_repo(tmp_path / "d", rows=19)), config="en"))
    rows = 37 if kind == "saved" else 38
    for world, skip in ((1, 0), (2, 0), (2, 3), (3, 3)):
        seen = []
        for rank in range(world):
            full = read_all(DatasetStream(source, StreamSpec(PAIRS, 3, 8), rank, world, skip))
            assert [e for e, _, _ in full].count(0) == [e for e, _, _ in full].count(1)  # the same rows each epoch
            for cut in (1, 9, len(full) // 2 + 1, len(full) - 1):  # in the buffer's fill, mid-epoch, at its end
                assert read_all(DatasetStream(source, StreamSpec(PAIRS, 3, 8), rank, world, skip), cut=cut) == full
            seen += [row for epoch, row, _ in full if epoch == 0]
        assert sorted(seen) == list(range(skip, rows)), (world, skip)  # disjoint, all of them, never the held rows
    strategies = {(w, s): DatasetStream(source, StreamSpec(PAIRS, 3, 8), 0, w, s).share_of.strategy
                  for w, s in ((2, 0), (2, 3))}
    # saved: one contiguous shard per process; streamed: 2 shards divide by 2, but held-out rows at the start
    # are skipped across shards only when every process reads the whole stream (one row in 2 each)
    assert strategies == ({(2, 0): "shards", (2, 3): "shards"} if kind == "saved"
                          else {(2, 0): "shards", (2, 3): "examples"})


def test_eval_set_comes_from_the_validation_split_or_the_first_rows(tmp_path, tokenizer):
    def data_of(train_file, **flags):
        cfg, _ = load_config({"train_file": str(train_file), "max_eval_samples": 4, **flags})
        objective = objective_for(cfg)
        return build_data(cfg, check_data(cfg, objective), tokenizer, DataProcess(report=lambda _: None))

    held = data_of(save_pairs(tmp_path / "saved", n=60))
    assert held.held_out_rows == 4 and held.rows == 56 and "first 4 rows" in held.eval_source
    rows = synthetic_rows(60, seed=1)
    assert [(e.prompt, e.row) for e in held.eval_examples] == [(r["prompt"], i) for i, r in enumerate(rows[:4])]
    assert sorted(e.row for e in held.stream.iter_epoch()) == list(range(4, 60))
    split = data_of(save_pairs(tmp_path / "dict", n=60, validation=6))
    assert split.held_out_rows == 0 and split.rows == 60 and "'validation' split" in split.eval_source
    assert [e.prompt for e in split.eval_examples] == [r["prompt"] for r in synthetic_rows(66, seed=1)[60:64]]
    repo = data_of(write_repo(tmp_path / "repo"), dataset_config="zh", max_steps=3)
    assert repo.held_out_rows == 0 and repo.rows == 0 and not repo.epoch_rows_known  # no counts in the card
    assert [e.prompt for e in repo.eval_examples] == [r["prompt"] for r in synthetic_rows(4, seed=7)]
    with pytest.raises(UserError, match="set --max_steps"):
        repo.steps(load_config({"train_file": "x"})[0])


def test_mistakes_are_one_error_line(tmp_path, cli_in_process):
    from datasets import Dataset, DatasetDict

    saved = save_pairs(tmp_path / "saved")
    empty = tmp_path / "empty"
    Dataset.from_dict({"prompt": [], "response": []}).save_to_disk(str(empty))
    no_train = tmp_path / "no_train"
    DatasetDict(a=Dataset.from_list(synthetic_rows(3)), b=Dataset.from_list(synthetic_rows(3))).save_to_disk(
        str(no_train))
    cases = {  # flags -> what the line says
        (f"--train_file={saved}", "--prompt_column=question"): "has no column 'question'",
        ("--train_file=nobody/nothing",): "the hub cannot be reached",
        (f"--train_file={empty}",): "is empty",
        (f"--train_file={no_train}",): "has the splits a, b and none named train",
        (f"--train_file={write_repo(tmp_path / 'repo')}",): "pick one among the available configs",
        ("--dataset_config=en",): "leave --dataset_config out",
    }
    for flags, message in cases.items():
        cfg, _ = load_config(dict(f.removeprefix("--").split("=", 1) for f in flags))
        with pytest.raises(UserError, match=message):
            check_data(cfg, objective_for(cfg))
    done = cli_in_process("train", f"--train_file={saved}", "--prompt_column=question",
                          f"--output_dir={tmp_path / 'run'}")
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].startswith("error:")
    assert "Traceback" not in done.stderr and "has no column 'question'" in done.stderr


def test_preview_on_a_saved_dataset_for_pairs_and_span_corruption(tmp_path, cli_in_process):
    pairs = cli_in_process("preview", f"--train_file={save_pairs(tmp_path / 'pairs')}", "--num_examples=3",
                           "--decode=True", "--shuffle_buffer_size=0")
    assert pairs.returncode == 0, pairs.stderr[-2000:]
    records = [json.loads(line) for line in pairs.stdout.splitlines()]
    rows = synthetic_rows(60, seed=1)
    assert [r["row"] for r in records] == [6, 7, 8]  # in order without shuffling, after the 6 held-out rows
    assert [r["input_ids_text"] for r in records] == [rows[i]["prompt"] + "</s>" for i in (6, 7, 8)]
    assert "streamed through datasets.IterableDataset" in pairs.stderr
    text = cli_in_process("preview", "--objective=span_corruption", f"--train_file={save_text(tmp_path / 'text')}",
                          "--text_column=body", "--num_examples=3", "--max_source_len=32", "--max_target_len=8")
    assert text.returncode == 0, text.stderr[-2000:]
    records = [json.loads(line) for line in text.stdout.splitlines()]
    assert [(len(r["original_ids"]), len(r["input_ids"]), len(r["labels"])) for r in records] == [(34, 32, 8)] * 3


def test_killed_run_on_a_saved_dataset_resumes_bit_identically(tmp_path, run_cli, kill_at_first_checkpoint_and_resume):
    # Pairs only: span corruption's packer state resumes the same over any stream
    # (tests/test_span_corruption_training.py), and the dataset's position is the stream's.
    data = [f"--train_file={save_pairs(tmp_path / 'd', n=30)}", "--epochs=2", "--max_target_len=32"]
    common = [*data, "--max_source_len=32", "--max_eval_samples=4", "--logging_steps=1", "--save_steps=2",
              "--eval_steps=4", "--gradient_accumulation_steps=2", "--shuffle_buffer_size=16", "--dump_consumed=True"]
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    done = run_cli("train", f"--output_dir={straight}", *common, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    # SIGKILL: mid-epoch, rows in the shuffle buffer, the dataset mid-shard
    kill_at_first_checkpoint_and_resume(broken, common, tmp_path / "killed.log", wait_s=900)
    consumed = assert_same_training(straight, broken)
    lines = [line.split("\t") for line in consumed.splitlines()]  # each training row once per epoch, none held out
    for epoch in ("0", "1"):
        assert sorted(int(row) for e, _, _, row in lines if e == epoch) == list(range(3, 30))  # 3 held out


def test_two_processes_read_disjoint_shares_of_a_saved_dataset(tmp_path, accelerate_launch):

    out = tmp_path / "run"
    done = accelerate_launch(f"--train_file={save_pairs(tmp_path / 'd', n=41)}", f"--output_dir={out}", "--epochs=1",
                             "--gradient_accumulation_steps=2", "--eval_steps=0", "--save_steps=0",
                             "--dump_consumed=True", *SMALL, port=29551)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line.split("\t") for rank in (0, 1)
             for line in (out / f"consumed-rank{rank}.tsv").read_text().splitlines()]
    seen = Counter(int(row) for _, _, _, row in lines)
    assert sorted(seen) == list(range(4, 41)) and max(seen.values()) == 1  # 4 held out, the rest once
    shares = [{int(row) for _, rank, _, row in lines if rank == r} for r in ("0", "1")]
    assert shares == [set(range(4, 23)), set(range(23, 41))]  # whole contiguous shards: 19 and 18 rows
    assert "whole shards per process, of 2" in done.stdout


def test_a_local_dataset_repository_trains_through_the_hub_code_path(tmp_path, run_cli):
    repo = write_repo(tmp_path / "repo", shards=3)
    common = [f"--train_file={repo}", "--dataset_config=en", *SMALL, "--eval_steps=0", "--save_steps=0"]
    done = run_cli("train", *common, f"--output_dir={tmp_path / 'unknown'}")  # the card gives no row counts
    assert done.returncode == 2 and "set --max_steps" in done.stderr.strip().splitlines()[-1]
    done = run_cli("train", *common, "--max_steps=2", f"--output_dir={tmp_path / 'run'}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "the local dataset repository" in done.stdout and "(config en, split train)" in done.stdout
    assert "eval rows 4 from the 'validation' split of --train_file" in done.stdout
    assert [r["step"] for r in metrics(tmp_path / "run") if r["event"] == "train"] == [1, 2]
