"""Bad input and faults: counted bad rows, one-line errors, the memory guard, non-finite steps, a full disk."""

from __future__ import annotations

import fcntl
import json
import random
import re
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import REPO, metrics, synthetic_rows, write_rows

from lowmem.checkpointing import checkpoint
from lowmem.utils.ownership import MARKERS

SMALL = ["--max_source_len=32", "--max_target_len=32", "--max_eval_samples=8", "--logging_steps=2",
         "--gradient_accumulation_steps=4", "--eval_generate=False"]

# One line of each kind of bad row (and the reason it is counted under).
BAD_LINES = {
    b"{not json": "malformed_json",
    b"": "blank_line",
    b"\xff\xfe{\"prompt\": \"a\"}": "invalid_utf8",
    b"[\"prompt\", \"response\"]": "not_an_object",
    b"{\"question\": \"p\", \"response\": \"r\"}": "missing_column",
    b"{\"prompt\": null, \"response\": \"r\"}": "null_value",
    b"{\"prompt\": \"p\", \"response\": 42}": "non_string_value",
    b"{\"prompt\": \"p\", \"response\": \"  \"}": "empty_value",
}


def bad_corpus(path: Path, good: int, copies: int, seed: int = 0) -> dict:
    """Good rows with ``copies`` of every bad kind at random places; returns the expected counts."""
    lines = [json.dumps(r).encode() for r in synthetic_rows(good, seed=seed)]
    rng = random.Random(seed)
    for _ in range(copies):
        for line in BAD_LINES:
            lines.insert(rng.randrange(1, len(lines)), line)  # row 0 stays good
    lines.append(json.dumps({"prompt": "long " * 400_000, "response": "ok"}).encode())  # 2 MB: truncated, used
    path.write_bytes(b"\n".join(lines) + b"\n")
    return {reason: copies for reason in BAD_LINES.values()}


def error_line(proc) -> str:
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return lines[0]


def test_bad_rows_are_skipped_and_counted_exactly(tmp_path, run_cli):
    train = tmp_path / "train.jsonl"
    expected = bad_corpus(train, good=300, copies=2)  # 16 bad rows of 317 (5 %)
    parquet = write_rows(tmp_path / "more.parquet", synthetic_rows(40, seed=4)
                         + [{"prompt": None, "response": "x"}, {"prompt": "y", "response": None}])
    expected["null_value"] += 2
    evals = write_rows(tmp_path / "eval.jsonl", synthetic_rows(8, seed=9))
    out = tmp_path / "run"
    proc = run_cli("train", f"--train_file={train},{parquet}", f"--eval_file={evals}", f"--output_dir={out}",
                   "--epochs=2", "--max_bad_rows_fraction=0.06", *SMALL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [event] = [r for r in metrics(out) if r["event"] == "data_errors"]
    assert event["by_reason"] == expected  # counted once, not once per epoch
    assert event["bad_rows"] == 18 and event["train_rows"] == 317 + 42 and event["rows_read"] == 359
    assert event["by_file"] == {str(train): 16, str(parquet): 2}
    assert len(event["first"]) == 5 and all(str(train) in f or str(parquet) in f for f in event["first"])
    assert proc.stdout.count("skipping bad row:") == 5 and " line " in proc.stdout
    assert "bad rows skipped: 18 of 359" in proc.stdout
    # Epochs were planned from 359 rows (45 windows of 2 x 4 each); 341 good rows fill 43.
    assert "the epochs took 86 optimizer steps, not the 90 planned" in proc.stdout
    assert [r for r in metrics(out) if r["event"] == "train"][-1]["examples"] == 2 * (359 - 18)  # every good row


def test_too_many_bad_rows_and_only_bad_rows_stop_with_one_line(tmp_path, run_cli):
    train = tmp_path / "train.jsonl"
    bad_corpus(train, good=300, copies=2)  # 5 % bad: above the default 1 %
    evals = write_rows(tmp_path / "eval.jsonl", synthetic_rows(8, seed=9))
    proc = run_cli("train", f"--train_file={train}", f"--eval_file={evals}", f"--output_dir={tmp_path / 'a'}", *SMALL)
    assert proc.returncode == 2
    line = error_line(proc)
    assert "--max_bad_rows_fraction=0.01" in line and "malformed_json: 2" in line
    # The 1000-row shuffle buffer had read the whole file before the first step: all 16 are counted.
    assert [r["bad_rows"] for r in metrics(tmp_path / "a") if r["event"] == "data_errors"] == [16]
    assert not [r for r in metrics(tmp_path / "a") if r["event"] == "train"]  # stopped before any step

    only_bad = tmp_path / "bad.jsonl"
    only_bad.write_bytes(b"\n".join(list(BAD_LINES) * 3) + b"\n")
    proc = run_cli("train", f"--train_file={only_bad}", f"--eval_file={evals}", f"--output_dir={tmp_path / 'b'}",
                   "--max_bad_rows_fraction=1", *SMALL)
    assert proc.returncode == 2
    assert "yields no usable rows" in error_line(proc)


def test_blank_lines_are_counted_but_never_stop_a_run(tmp_path, run_cli):
    # A JSONL file ending in a blank line (or with blank lines between rows) loses no row: the blank lines are
    # shown in the counts, never held against --max_bad_rows_fraction (1 of 61 lines here, above its 1 %).
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in synthetic_rows(60, seed=3)) + "\n")
    evals = write_rows(tmp_path / "eval.jsonl", synthetic_rows(4, seed=9))
    out = tmp_path / "run"
    proc = run_cli("train", f"--train_file={train}", f"--eval_file={evals}", f"--output_dir={out}", "--max_steps=2",
                   *SMALL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [event] = [r for r in metrics(out) if r["event"] == "data_errors"]
    assert event["by_reason"] == {"blank_line": 1}
    # ... while a row lost in the same file still counts: 2 of 62 is above 1 %, and the fix is the data
    train.write_text(train.read_text() + "{not json\n{not json either\n")
    proc = run_cli("train", f"--train_file={train}", f"--eval_file={evals}", f"--output_dir={tmp_path / 'b'}",
                   "--max_steps=2", *SMALL)
    line = error_line(proc)
    assert proc.returncode == 2 and "2 of 63 training rows are bad" in line and "(malformed_json: 2)" in line


def test_a_run_stopped_by_bad_data_starts_over_once_fixed_and_a_trained_run_is_kept(tmp_path, run_cli):
    """Stopped before its first step, a run leaves nothing worth keeping: the same command starts
    over once the data is fixed. A run that trained is never overwritten without being asked."""
    train, out = tmp_path / "train.jsonl", tmp_path / "run"
    bad_corpus(train, good=300, copies=2)
    evals = write_rows(tmp_path / "eval.jsonl", synthetic_rows(8, seed=9))
    command = ["train", f"--train_file={train}", f"--eval_file={evals}", f"--output_dir={out}", "--max_steps=2",
               "--save_steps=2", *SMALL]
    assert run_cli(*command).returncode == 2
    write_rows(train, synthetic_rows(300, seed=3))  # the fix
    proc = run_cli(*command)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"the last run in {out} stopped before its first step: starting over" in proc.stdout
    trained = metrics(out)
    assert [r["bad_rows"] for r in trained if r["event"] == "data_errors"] == [0]  # the failed attempt's 16 are gone
    assert [r["step"] for r in trained if r["event"] == "train"] == [2]

    proc = run_cli(*command)
    assert proc.returncode == 2 and "already holds a run" in error_line(proc)
    assert metrics(out) == trained and (out / "final").is_dir() and checkpoint.find_latest_valid(out / "checkpoints")


@pytest.mark.parametrize("args, fragment", [
    (["train", "--learnrate=0.1"], "did you mean --learn_rate"),
    (["train", "--batch_size=two"], "--batch_size"),
    (["train", "--epochs=0"], "--epochs must be at least 1"),
    (["train", "--mixed_precision=half"], "--mixed_precision must be no, bf16 or fp16"),
    (["train", "--model_preset=huge"], "--model_preset must be one of"),
    (["train", "--max_bad_rows_fraction=2"], "--max_bad_rows_fraction"),
    (["train", "--train_file=/nonexistent/x.jsonl"], "does not exist"),
    (["train", "--train_file=/nonexistent/*.jsonl"], "matches no file"),
    (["train", "--train_file=data/trans.cvs"], "trans.cvs does not exist"),  # (run in the repo) a typo, not a hub id
    (["train", "--is_finetune=True", "--init_from={tmp}"], "is not a model folder"),
    (["train", "--is_keep_training=True", "--output_dir={tmp}/never_run"], "no run to continue"),
    (["train", "--output_dir=/proc/t5-lowmem-run"], "not writable"),
    (["train", "--config={tmp}/missing.yaml"], "missing.yaml"),
    (["nosuchcommand"], "unknown command"),
    (["train", "pretrain"], "unexpected argument 'pretrain'"),
    (["train", "--learn_rate=nan"], "--learn_rate must be a finite number"),
    (["train", "--seed=-1"], "--seed must be in [0, 2**32)"),
    (["train", "--freeze=encoder"], "--freeze=encoder needs a trained model"),
    (["train", "--init_from=no/such-model"], "not in the Hugging Face cache"),
    (["generate", "--prompt="], "--prompt is empty"),
    (["train", "--tokenizer_dir="], "--tokenizer_dir is empty: give a path"),  # not the current folder
    (["preview", "--num_examples=abc"], "--num_examples expects a positive whole number"),
    (["preview", "--num_example=3"], "did you mean --num_examples"),
    (["train_tokenizer"], "holds a tokenizer already"),
    (["train_tokenizer", "--train_file={tmp}/semi.csv", "--tokenizer_dir={tmp}/tok", "--prompt_column=q"],
     "has no column 'q'"),  # (it was sentencepiece's "INTERNAL: ... [!sentences_.empty()]")
    (["train", "--train_file={tmp}/empty.jsonl", "--output_dir={tmp}/run"], "is empty (no rows in 1 file(s))"),
    (["train", "--train_file={tmp}/texts", "--output_dir={tmp}/run"], "its .txt files are raw text"),
    (["train", "--train_file={tmp}/semi.csv", "--output_dir={tmp}/run"], "separated by ';', not commas"),
    (["train", "--train_file={tmp}/wrapped.json", "--output_dir={tmp}/run"], "whose 'data' holds a list: save"),
    (["train", "--train_file={tmp}/pretty.json", "--output_dir={tmp}/run"], "one JSON object spread over lines"),
    (["train", "--train_file={tmp}/cut.parquet", "--output_dir={tmp}/run"], "cannot read"),
    (["prepare", "--train_file={tmp}/cut.parquet", "--prepared_dir={tmp}/prepared"], "cannot read"),
])
def test_cli_mistakes_give_one_line_and_exit_code_2(tmp_path, args, fragment, cli_in_process):
    (tmp_path / "empty.jsonl").write_bytes(b"")
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("a document of raw text\n")
    (tmp_path / "semi.csv").write_text("prompt;response\nhello;world\n")
    rows = {"data": [{"prompt": "a b", "response": "c d"}] * 3}  # rows inside an object: not a row each
    (tmp_path / "wrapped.json").write_text(json.dumps(rows))
    (tmp_path / "pretty.json").write_text(json.dumps(rows, indent=2))
    (tmp_path / "cut.parquet").write_bytes(b"PAR1 a parquet file cut short")  # no footer
    proc = cli_in_process(*[a.format(tmp=tmp_path) for a in args])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert fragment in error_line(proc)



def test_preview_counts_the_bad_rows_it_met_and_refuses_a_file_without_a_usable_one(tmp_path, cli_in_process):
    bad = [{"prompt": 1, "response": "x"}, {"prompt": "", "response": "x"}]
    some = write_rows(tmp_path / "some.jsonl", [*bad, *synthetic_rows(3)])
    shown = cli_in_process("preview", f"--train_file={some}", f"--eval_file={some}", "--shuffle_buffer_size=0")
    assert shown.returncode == 0 and len(shown.stdout.splitlines()) == 3, shown.stderr[-2000:]
    assert "2 bad row(s) among the rows read so far" in shown.stderr and "non_string_value 1" in shown.stderr
    none = write_rows(tmp_path / "none.jsonl", bad)  # it printed the skipped rows, no example and exit 0
    refused = cli_in_process("preview", f"--train_file={none}", f"--eval_file={some}")
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert refused.stderr.strip().splitlines()[-1].startswith("error: --train_file has no usable row (2 bad: ")


def test_preview_says_which_rows_it_holds_out_and_shows_every_other_one(tmp_path, cli_in_process):
    corpus = write_rows(tmp_path / "rows.jsonl", synthetic_rows(40, seed=5))
    shown = cli_in_process("preview", f"--train_file={corpus}", "--max_eval_samples=4", "--num_examples=100")
    assert shown.returncode == 0, shown.stderr[-2000:]
    rows = sorted(json.loads(line)["row"] for line in shown.stdout.splitlines())
    assert rows == list(range(36))  # the last 4 are the eval set, as train holds them out
    assert "4 row(s) at the end of --train_file are held out as the eval set" in shown.stderr


def test_a_model_trained_on_its_own_data_is_not_scored_on_shipped_rows_that_do_not_fit_it(tmp_path, run_cli):
    docs = write_rows(tmp_path / "docs.jsonl", [{"body": " ".join(r.values())} for r in synthetic_rows(120, seed=2)])
    run = tmp_path / "run"
    proc = run_cli("train", "--objective=span_corruption", "--text_column=body", f"--train_file={docs}",
                   f"--output_dir={run}", "--max_steps=1", "--eval_steps=0", "--max_source_len=32", *SMALL[2:])
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = error_line(run_cli("evaluate", f"--output_dir={run}"))  # the shipped eval rows have no 'body'
    assert f"was trained on --train_file={docs}" in line and "pass that --train_file" in line
    assert "set --text_column" not in line  # the column is the model's own: the data is what to change
    proc = run_cli("evaluate", f"--output_dir={run}", f"--train_file={docs}")
    assert proc.returncode == 0 and "eval_loss" in proc.stdout, proc.stderr[-2000:]


def test_run_folder_and_data_refusals_come_before_torch_is_imported(tmp_path, processes):
    """A folder the run cannot start in, or data without the columns it reads, is refused by the command
    line itself, not after the trainer's imports (torch and transformers: several seconds before the line);
    the folders are left as they were, and no run folder is made for a run that never starts."""
    write_rows(tmp_path / "questions.jsonl", [{"question": "a b", "answer": "c d"}])
    (tmp_path / "mixed").mkdir()  # a file past the first with other columns
    write_rows(tmp_path / "mixed" / "a.jsonl", synthetic_rows(3))
    (tmp_path / "mixed" / "m.csv").write_text("question,answer\na b,c d\n")
    (tmp_path / "blank.jsonl").write_text("\n\n  \n")  # blank lines only: no row (the run folder was made first)
    run = tmp_path / "run"
    run.mkdir()
    (run / MARKERS["run"]).write_text("t5-lowmem\n")
    (run / "metrics.jsonl").write_text(json.dumps({"event": "train", "step": 1}) + "\n")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "t5"}))
    (tmp_path / "model" / "training_info.json").write_text(json.dumps({"step": 0}))  # a stopped run's best/
    (tmp_path / "locked").mkdir()
    (tmp_path / "locked" / MARKERS["run"]).write_text("t5-lowmem\n")
    cases = {  # flags: the refusal
        f"--output_dir={run}": "already holds a run",
        f"--output_dir={tmp_path / 'model'}": "holds a saved model",
        f"--output_dir={tmp_path / 'locked'}": "is in use by another run (process 4242)",
        f"--output_dir={tmp_path / 'none'} --is_keep_training=True": "no run to continue",
        f"--output_dir={run} --is_keep_training=True --resume_from={tmp_path}/step_000001":
            "is not one of this run's checkpoints",
        f"--output_dir={run} --is_keep_training=True --resume_from={run}/checkpoints/step_000001":
            "does not exist (--save_total_limit prunes old checkpoints); this run's checkpoints: none",
        f"--output_dir={run} --is_keep_training=True --resume_from={run}/checkpoints/step_000001.bak":
            "is not named step_NNNNNN: a copy of a checkpoint is never resumed from",
        f"--output_dir={run} --is_keep_training=True": "no checkpoint of the run",
        f"--output_dir={tmp_path / 'new'} --train_file={tmp_path / 'questions.jsonl'}": "has no column 'prompt'",
        f"--output_dir={tmp_path / 'new'} --train_file={tmp_path / 'mixed'}": "mixed/m.csv has no column 'prompt'",
        f"--output_dir={tmp_path / 'new'} --train_file={tmp_path / 'blank.jsonl'}": "is empty (no rows in 1 file(s))",
        f"--output_dir={tmp_path / 'new'} --init_from={tmp_path / 'model'}": "holds no weights",
        f"--output_dir={tmp_path / 'new'} --is_finetune=True --init_from={tmp_path / 'model'}":
            "is the untrained model its run exported at step 0, before its first optimizer step",
    }
    (run / "final").mkdir()  # a trained model: the last case may not start over
    (run / "checkpoints" / "step_000001.bak").mkdir(parents=True)  # a user's copy
    script = (
        "import json, sys, train_low_mem\n"
        "codes = []\n"
        f"for flags in {list(cases)!r}:\n"
        "    try:\n"
        "        train_low_mem.main(['train', *flags.split()])\n"
        "    except SystemExit as stop:\n"
        "        codes.append(stop.code)\n"
        "print(json.dumps({'codes': codes, 'torch': 'torch' in sys.modules}))\n")
    with open(tmp_path / "locked" / ".lock", "w") as held:  # as a run in progress holds it
        held.write("4242")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
        proc = processes.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"codes": [2] * len(cases), "torch": False}
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == len(cases) and all(line.startswith("error: ") for line in lines), proc.stderr
    for line, fragment in zip(lines, cases.values()):
        assert fragment in line, line
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize("command", [["train", "--is_finetune=True"], ["plan", "--is_finetune=True"], ["evaluate"]])
def test_init_from_a_run_folder_names_its_best_model(tmp_path, command, cli_in_process):
    """A training run's folder holds a config.json too (the run's flags): --init_from pointing at it
    gets one line naming the model folder inside, not a traceback from reading it as a T5 config."""
    run = tmp_path / "pretrain"
    (run / "best").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"model_preset": "tiny", "is_finetune": False}))
    (run / "best" / "config.json").write_text(json.dumps({"model_type": "t5"}))
    proc = cli_in_process(*command, f"--init_from={run}", f"--output_dir={tmp_path / 'sft'}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = error_line(proc)
    assert "is not a T5-family model folder" in line and f"pass --init_from={run / 'best'}" in line
    assert not (tmp_path / "sft").exists()


def test_a_trained_run_is_never_overwritten_or_shared(tmp_path, run_cli):
    """Run folders that hold trained models are protected: a resume with no usable checkpoint left
    is refused (it used to start again from step 0 over best/ and final/), as are a run into a saved
    model's folder, a second process on a folder in use, another run's or an export's folder as
    --resume_from, and a changed optimizer on resume. The time a run reports is its own."""
    import hashlib

    train = write_rows(tmp_path / "train.jsonl", synthetic_rows(300, seed=1))
    evals = write_rows(tmp_path / "eval.jsonl", synthetic_rows(8, seed=2))
    out = tmp_path / "run"
    common = [f"--train_file={train}", f"--eval_file={evals}", f"--output_dir={out}", *SMALL]
    started = time.time()
    proc = run_cli("train", *common, "--max_steps=12", "--save_steps=1", "--save_total_limit=20")
    wall = time.time() - started
    assert proc.returncode == 0, proc.stderr[-2000:]
    elapsed = [r["elapsed_s"] for r in metrics(out) if r["event"] == "train"]
    # Seconds were counted again at every checkpoint: 12 checkpoints made the last step's figure ~6x too big.
    assert elapsed == sorted(elapsed) and 0 < elapsed[-1] < wall
    assert json.loads((out / "final" / "training_info.json").read_text())["elapsed_s"] < wall
    digest = hashlib.sha1((out / "final" / "model.safetensors").read_bytes()).hexdigest()

    proc = run_cli("train", *common, "--is_keep_training=True", "--optimizer=adamw")
    assert proc.returncode == 2 and "resume with the --optimizer the run began with" in error_line(proc)
    proc = run_cli("train", *common, "--is_keep_training=True", f"--resume_from={out / 'best'}")
    assert proc.returncode == 2 and "is not one of this run's checkpoints" in error_line(proc)
    with open(out / ".lock", "a+") as held:  # as a run in progress holds it
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        proc = run_cli("train", *common, "--overwrite_output_dir=True")
    assert proc.returncode == 2 and "is in use by another run" in error_line(proc)
    proc = run_cli("train", *common[:2], f"--output_dir={out / 'final'}", *SMALL)
    assert proc.returncode == 2 and "holds a saved model" in error_line(proc)

    for folder in checkpoint.step_folders(out / "checkpoints"):
        (folder / "optimizer.pt").write_bytes(b"damaged")
    proc = run_cli("train", *common, "--is_keep_training=True")
    assert proc.returncode == 2 and "would replace the models it trained" in error_line(proc)
    shutil.rmtree(out / "checkpoints")
    proc = run_cli("train", *common, "--is_keep_training=True")
    assert proc.returncode == 2 and "would replace the models it trained" in error_line(proc)
    assert hashlib.sha1((out / "final" / "model.safetensors").read_bytes()).hexdigest() == digest
    # Starting over checks what it needs before the old run's files go: a tokenizer that cannot be loaded (it
    # used to remove best/ and final/, then stop with a traceback), a link where checkpoints/ was (rmtree
    # refused it mid-removal)
    broken = tmp_path / "broken_tokenizer"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{")
    proc = run_cli("train", *common, "--overwrite_output_dir=True", f"--tokenizer_dir={broken}")
    assert proc.returncode == 2 and "cannot be loaded" in error_line(proc), proc.stderr[-2000:]
    elsewhere = tmp_path / "checkpoints_on_another_disk"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("the user's")
    (out / "checkpoints").symlink_to(elsewhere)
    proc = run_cli("train", *common, "--overwrite_output_dir=True")
    assert proc.returncode == 2 and "checkpoints is a symbolic link" in error_line(proc), proc.stderr[-2000:]
    assert (elsewhere / "keep.txt").is_file() and (out / "best").is_dir()
    assert hashlib.sha1((out / "final" / "model.safetensors").read_bytes()).hexdigest() == digest
    (out / "checkpoints").unlink()

    other = tmp_path / "other_tokenizer"  # the same size, one word changed
    shutil.copytree(out / "final", other, ignore=lambda _dir, names: [n for n in names if "token" not in n])
    text = (other / "tokenizer.json").read_text(encoding="utf-8")
    (other / "tokenizer.json").write_text(text.replace('"▁the"', '"▁thee"'), encoding="utf-8")
    proc = run_cli("evaluate", f"--init_from={out / 'final'}", f"--tokenizer_dir={other}", f"--eval_file={evals}")
    assert proc.returncode == 2 and "is not the tokenizer saved with the model" in error_line(proc)
    proc = run_cli("plan", f"--init_from={out / 'final'}", f"--tokenizer_dir={other}")  # planned it from that one
    assert proc.returncode == 2 and "is not the tokenizer saved with the model" in error_line(proc)
    fresh = tmp_path / "sft_with_another_tokenizer"  # refused before the run folder is made
    proc = run_cli("train", "--is_finetune=True", f"--init_from={out / 'final'}", f"--tokenizer_dir={other}",
                   f"--train_file={train}", f"--output_dir={fresh}", "--max_steps=1")
    assert proc.returncode == 2 and "is not the tokenizer saved with the model" in error_line(proc)
    assert not fresh.exists()
    proc = run_cli("generate", f"--init_from={out / 'final'}", "--prompt=hello, world 1e3")
    assert proc.returncode == 0 and proc.stdout.count("hello, world 1e3  ->") == 1  # verbatim, printed once
    proc = run_cli("plan", *common, "--json=false")
    assert proc.returncode == 0 and not proc.stdout.lstrip().startswith("{")

def test_a_memory_guard_passed_before_the_first_step_stops_there_and_the_same_command_starts_again(tmp_path, run_cli):
    train = write_rows(tmp_path / "train.jsonl", synthetic_rows(400, seed=1))
    evals = write_rows(tmp_path / "eval.jsonl", synthetic_rows(8, seed=2))
    out = tmp_path / "run"
    common = [f"--train_file={train}", f"--eval_file={evals}", f"--output_dir={out}", "--max_steps=6", *SMALL]
    proc = run_cli("train", *common, "--max_rss_gb=0.2")  # a tiny run uses more than 90 % of this by its setup's end
    assert proc.returncode == 3, proc.stderr[-2000:]
    line = error_line(proc)
    assert "memory guard" in line and "reached 90% of --max_rss_gb=0.2 before step 1;" in line
    assert "no step was completed, so no checkpoint was written" in line and "run the same command again" in line
    assert "--batch_size" in line and "raise --max_rss_gb" in line
    assert not (out / "checkpoints").exists() or not checkpoint.step_folders(out / "checkpoints")
    said = float(re.search(r"peak ([0-9.]+) GiB\) reached 90%", line)[1])  # what tripped it, not what was left
    assert said * 1024 >= max(r["rss_mb"] for r in metrics(out) if "rss_mb" in r) - 6  # (its 2 decimals)
    [stop] = [r for r in metrics(out) if r["event"] == "memory_guard"]
    assert stop["where"] == "before step 1" and stop["step"] == 0
    proc = run_cli("train", *common, "--max_rss_gb=0.2", "--is_keep_training=True")  # again from step 0, again stopped
    assert proc.returncode == 3 and "starting the run again from step 0" in proc.stdout, proc.stdout[-2000:]
    proc = run_cli("train", *common)  # with the memory it needs: the run that stopped before its first step starts over
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "stopped before its first step: starting over" in proc.stdout and "steps:       6" in proc.stdout


def test_non_finite_steps_are_skipped_counted_then_abort(tmp_path, run_cli):
    train = write_rows(tmp_path / "train.jsonl", synthetic_rows(400, seed=1))
    evals = write_rows(tmp_path / "eval.jsonl", synthetic_rows(8, seed=2))
    out = tmp_path / "run"
    # An absurd learning rate blows the weights up within a few steps: every later loss is NaN.
    proc = run_cli("train", f"--train_file={train}", f"--eval_file={evals}", f"--output_dir={out}", "--max_steps=30",
                   "--learn_rate=1e30", "--max_nonfinite_steps=3", "--eval_steps=1", *SMALL)
    assert proc.returncode == 2
    assert "3 optimizer steps in a row had a non-finite loss" in error_line(proc)
    skipped = [r for r in metrics(out) if r["event"] == "nonfinite_step"]
    assert [r["skipped_total"] for r in skipped] == [1, 2, 3]
    from safetensors.torch import load_file

    best = load_file(str(out / "best" / "model.safetensors"))
    assert all(bool(t.isfinite().all()) for t in best.values())


@pytest.fixture(scope="session")
def _mount_tmpfs(processes):
    def _mount_tmpfs(path: Path, size: str) -> bool:
        path.mkdir()
        return processes.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True).returncode == 0
    return _mount_tmpfs


def test_full_disk_during_a_checkpoint_keeps_the_previous_one(tmp_path, _mount_tmpfs, processes, run_cli):
    disk = tmp_path / "disk"
    if shutil.which("mount") is None or not _mount_tmpfs(disk, "64m"):
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        train = write_rows(tmp_path / "train.jsonl", synthetic_rows(400, seed=1))
        evals = write_rows(tmp_path / "eval.jsonl", synthetic_rows(8, seed=2))
        out = disk / "run"
        common = [f"--train_file={train}", f"--eval_file={evals}", f"--output_dir={out}", "--max_steps=12",
                  "--save_steps=4", "--eval_steps=0", *SMALL]
        filler = disk / "filler"

        def fill_after_first_checkpoint():  # then the disk is full when the next checkpoint is written
            while not (out / "checkpoints" / "latest").exists():
                time.sleep(0.02)
            with open(filler, "wb") as fh:
                try:
                    while True:
                        fh.write(b"\0" * 2**20)
                except OSError:
                    pass

        filling = threading.Thread(target=fill_after_first_checkpoint, daemon=True)
        filling.start()
        proc = run_cli("train", *common)
        filling.join(timeout=60)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "no space left on the device" in error_line(proc)
        kept = checkpoint.step_folders(out / "checkpoints")
        assert kept and all(checkpoint.validate(f) is None for f in kept)
        assert not list((out / "checkpoints").glob(".tmp-*"))  # the partial write was removed
        filler.unlink()
        proc = run_cli("train", *common, "--is_keep_training=True")
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert f"resumed from {kept[0]}" in proc.stdout and "steps:       12" in proc.stdout
    finally:
        processes.run(["umount", str(disk)], capture_output=True)


def test_an_epoch_ending_in_bad_rows_evaluates_its_last_step_once(tmp_path, run_cli):
    # 10 good rows then 2 bad ones: the stream learns the epoch is over only when it reads them, one
    # window after the last step, so the run's last step has had its evaluation by then.
    train = tmp_path / "train.jsonl"
    good = "".join(json.dumps(r) + "\n" for r in synthetic_rows(10, seed=3))
    train.write_text(good + "{not json\n{not json either\n")
    evals = write_rows(tmp_path / "eval.jsonl", synthetic_rows(4, seed=4))
    out = tmp_path / "run"
    proc = run_cli("train", f"--train_file={train}", f"--eval_file={evals}", f"--output_dir={out}", "--epochs=2",
                   *SMALL, "--gradient_accumulation_steps=1", "--shuffle_buffer_size=0", "--max_bad_rows_fraction=0.2",
                   "--eval_steps=1", "--max_new_tokens=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [r["step"] for r in metrics(out) if r["event"] == "eval"]
    assert steps == list(range(11))  # the last step (10) once, not twice
    assert json.loads((out / "final" / "training_info.json").read_text())["epoch"] == 2


def test_a_ctrl_c_lost_in_a_finalizer_during_setup_still_stops_the_run():
    """Python discards an exception raised in a finalizer: a Ctrl-C whose KeyboardInterrupt lands in one
    (setup's gc.collect runs regex's) would let the run go on to train. The watch remembers it."""
    import os
    import signal

    from lowmem.training.stopping import SignalWatch

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    hook, shown = sys.unraisablehook, []
    sys.unraisablehook = shown.append  # Python's "Exception ignored in ..." report
    try:
        watch = SignalWatch(say=lambda _line: None)

        class Finalized:
            def __del__(self):
                os.kill(os.getpid(), signal.SIGINT)  # the handler runs here: its KeyboardInterrupt is discarded

        class Broken:
            def __del__(self):
                raise ValueError("a finalizer's own bug")

        Finalized()
        Broken()
        assert watch.received == "SIGINT"
        assert [type(u.exc_value) for u in shown] == [ValueError]  # the remembered Ctrl-C is not shown
        with pytest.raises(KeyboardInterrupt):
            watch.install()  # where training would begin
        untouched = SignalWatch(say=lambda _line: None)
        untouched.install()  # no signal: training begins
        assert untouched.received is None
    finally:
        sys.unraisablehook = hook
        for sig, handler in previous.items():
            signal.signal(sig, handler)
