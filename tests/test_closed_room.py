"""The run folder is a closed room: none of a run's own entries (best/, final/, checkpoints/ and what it holds,
plots/, metrics.jsonl, consumed-rank*.tsv, ...) is read, written, moved or removed through a symbolic link. A link
in place of one is refused in one error line, before anything is written, and what it leads to stays byte for
byte as it was; links the user put in under other names are theirs, kept and never followed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import test_ownership
from test_ownership import error_line, snapshot

from lowmem.checkpointing import checkpoint
from lowmem.utils.errors import UserError
from lowmem.utils.ownership import MARKERS, check_closed

trained = test_ownership.trained  # the shared tiny run (built once a session), copied by each test that writes

# The run's own entries replaced by a link in each case (the trained run's checkpoint is at step 2)
LINKED = ["best", "final", "checkpoints", "checkpoints/step_000002", "checkpoints/latest", "plots", "metrics.jsonl",
          "consumed-rank0.tsv", "config.json", "tensorboard", "trackers.json"]
FOLDERS = ("best", "final", "checkpoints", "plots", "tensorboard")
COMMANDS = {"resume": ["--is_keep_training=True", "--max_steps=4"],
            "start over": ["--overwrite_output_dir=True"],
            "plot": None}


def outside(tmp_path: Path) -> Path:
    """A folder of the user's outside the run: a copy of an export (manifest.json and all, as a user who copied
    final/ away and linked it back has it), a notes file, and a file named as one of ours."""
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("my notes\n")
    (user / "metrics.jsonl").write_text('{"mine": 1}\n')
    (user / checkpoint.MANIFEST).write_text(json.dumps({"files": {"model.safetensors": 4}}))
    (user / "model.safetensors").write_bytes(b"mine")
    return user


def link_in(run: Path, name: str, user: Path) -> Path:
    """Replace ``run/name`` with a link to the user's folder (or, for a file of ours, to their notes)."""
    entry = run / name
    if entry.is_dir():
        shutil.rmtree(entry)
    elif entry.exists():
        entry.unlink()
    entry.symlink_to(user if name in FOLDERS or "step_" in name
                     else user / "notes.txt")
    return entry


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("name", LINKED)
def test_a_link_in_place_of_a_runs_own_entry_is_refused_and_its_target_untouched(trained, tmp_path, name, command,
                                                                                  cli_in_process):
    run, args = trained
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    user = outside(tmp_path)
    entry = link_in(copy, name, user)
    before, run_before = snapshot(user), snapshot(copy)
    if COMMANDS[command] is None:
        proc = cli_in_process("plot", f"--output_dir={copy}")
    else:
        proc = cli_in_process("train", f"--output_dir={copy}", *[a for a in args if not a.startswith("--max_steps")],
                              *(COMMANDS[command] if command == "resume" else ["--max_steps=2", *COMMANDS[command]]))
    line = error_line(proc)
    assert f"{entry} is a symbolic link to {entry.readlink()}" in line and "remove the link" in line, line
    assert snapshot(user) == before
    assert snapshot(copy) == run_before and entry.is_symlink()  # refused before anything was written


def test_the_reported_case_resume_with_final_linked_to_a_copy_of_it(trained, tmp_path, run_cli):
    # issue 82: a resume moved the user's file into the run's final/ and left a .old-final link behind
    run, args = trained
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    user = tmp_path / "my_model"
    shutil.move(copy / "final", user)  # the user moved the export away, linked it back, and added a file
    (user / "notes.txt").write_text("mine\n")
    (copy / "final").symlink_to(user)
    before = snapshot(user)
    proc = run_cli("train", f"--output_dir={copy}", *[a for a in args if not a.startswith("--max_steps")],
                   "--is_keep_training=True", "--max_steps=4")
    assert "final is a symbolic link" in error_line(proc)
    assert snapshot(user) == before and not (copy / ".old-final").exists()


def test_links_of_the_users_own_under_other_names_are_kept_and_never_followed(trained, tmp_path, run_cli):
    run, args = trained
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    user = outside(tmp_path)
    (copy / "my_data").symlink_to(user)  # beside the run's entries, and inside an export of ours
    (copy / "final" / "card.md").symlink_to(user / "notes.txt")
    before = snapshot(user)
    proc = run_cli("train", f"--output_dir={copy}", *[a for a in args if not a.startswith("--max_steps")],
                   "--is_keep_training=True", "--max_steps=4")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (copy / "my_data").is_symlink() and (copy / "final" / "card.md").is_symlink()  # carried into the new one
    assert (copy / "final" / "card.md").readlink() == user / "notes.txt"
    assert snapshot(user) == before


def test_the_writers_refuse_a_link_planted_after_the_early_checks(tmp_path):
    # What replaces, moves or removes the run's folders checks again where it writes: a link planted mid-run
    user = outside(tmp_path)
    before = snapshot(user)
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    (run / "checkpoints" / "step_000004").symlink_to(user)
    (run / "final").symlink_to(user)
    (run / ".old-best").symlink_to(user)
    writes = {"the swap of final/": lambda: checkpoint.atomic_folder(run / "final").__enter__(),
              "the swap of best/ (its aside name)": lambda: checkpoint.atomic_folder(run / "best").__enter__(),
              "a cut swap put back": lambda: checkpoint.restore_cut_swap(run / "best"),
              "the staging of a checkpoint": lambda: checkpoint.new_staging(run / "checkpoints" / "step_000004"),
              "pruning": lambda: checkpoint.prune(run / "checkpoints", keep=1),
              "a start-over's removal": lambda: checkpoint.remove_ours_in(run / "final"),
              "the run's own checks": lambda: check_closed(run)}
    for what, write in writes.items():
        with pytest.raises(UserError, match="is a symbolic link to"):
            write()
        assert snapshot(user) == before, what
    assert (run / "checkpoints" / "step_000002").is_dir() and not (run / ".tmp-final").exists()


def test_a_tokenizer_prepared_or_plot_folder_of_ours_with_a_link_inside_is_refused(tmp_path, cli_in_process):
    user = outside(tmp_path)
    before = snapshot(user)
    folders = {"tokenizer": (".saving", ["train_tokenizer", "--tokenizer_dir={}"]),
               "prepared": (".partial", ["prepare", "--prepared_dir={}"]),
               "plots": ("loss.png", ["plot", "--plot_dir={}"])}
    run = tmp_path / "run"
    run.mkdir()
    (run / MARKERS["run"]).write_text("")
    (run / "metrics.jsonl").write_text('{"event": "train", "step": 1, "time": 1.0, "loss": 2.5, "lr": 0.001}\n')
    for kind, (name, command) in folders.items():
        folder = tmp_path / kind
        folder.mkdir()
        (folder / MARKERS[kind]).write_text("")  # ours: written by an earlier command
        (folder / name).symlink_to(user if name.startswith(".") else user / "notes.txt")
        args = [a.format(folder) for a in command] + ([f"--output_dir={run}"] if kind == "plots" else [])
        proc = cli_in_process(*args)
        assert f"{folder / name} is a symbolic link to" in error_line(proc), kind
        assert snapshot(user) == before and (folder / name).is_symlink(), kind
