"""Every folder a command writes is new, empty or ours; anything else is one error line and stays
byte for byte as it was. Checkpoints load tensors and plain values only, never code."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import metrics, shared_folder, synthetic_rows, write_rows

from lowmem.checkpointing import checkpoint
from lowmem.utils.errors import UserError
from lowmem.utils.ownership import MARKERS

TINY = ["--max_steps=2", "--eval_steps=0", "--max_eval_samples=4", "--gradient_accumulation_steps=2",
        "--max_source_len=24", "--max_target_len=24", "--logging_steps=1"]


def user_files(folder: Path, model_like: bool = False) -> Path:
    """A folder of someone's files, some named as ours are (metrics.jsonl, best/, plots/, tokenizer_config.json)."""
    folder.mkdir(parents=True)
    (folder / "notes.txt").write_text("my notes\n")
    (folder / "metrics.jsonl").write_text('{"mine": 1}\n')
    (folder / "tokenizer_config.json").write_text('{"mine": true}\n')
    (folder / "best").mkdir()
    (folder / "best" / "thesis.tex").write_text("\\section{}\n")
    (folder / "plots").mkdir()
    (folder / "plots" / "loss.png").write_bytes(b"\x89PNG mine")
    (folder / ".hidden").write_text("also mine\n")
    if model_like:  # a downloaded model: a real tokenizer's name, weights, a model config
        (folder / "config.json").write_text(json.dumps({"model_type": "t5", "d_model": 8}))
        (folder / "model.safetensors").write_bytes(os.urandom(2048))
        (folder / "spiece.model").write_bytes(os.urandom(512))
    return folder


def snapshot(root: Path) -> dict[str, str]:
    """Every path under ``root`` (hidden ones too) with its content's hash ('dir' for a folder)."""
    found = {}
    for here, dirs, files in os.walk(root):
        for name in dirs:
            found[os.path.relpath(os.path.join(here, name), root)] = "dir"
        for name in files:
            path = os.path.join(here, name)
            found[os.path.relpath(path, root)] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return found


def error_line(proc) -> str:
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return lines[0]


# name: (command and flags, the flag refused, run in the folder of user files). {user}: user files;
# {model}: a model-like folder; {run}: a run with metrics (its plots/ is someone's folder); {corpus}, {tmp}.
REFUSED = {
    "train_tokenizer into user files": (["train_tokenizer", "--tokenizer_dir={user}"], "--tokenizer_dir", False),
    "train_tokenizer into a model": (["train_tokenizer", "--tokenizer_dir={model}"], "--tokenizer_dir", False),
    "train_tokenizer --tokenizer_dir=.": (["train_tokenizer", "--tokenizer_dir=."], "--tokenizer_dir", True),
    "train trains a tokenizer into user files": (["train", "--tokenizer_dir={user}", "--output_dir={tmp}/new_run"],
                                                 "--tokenizer_dir", False),
    "train into user files": (["train", "--output_dir={user}"], "--output_dir", False),
    "train --overwrite_output_dir into user files": (["train", "--output_dir={user}", "--overwrite_output_dir=True"],
                                                     "--output_dir", False),
    "train --is_keep_training in user files": (["train", "--output_dir={user}", "--is_keep_training=True"],
                                               "--output_dir", False),
    "train --overwrite_output_dir into a model": (["train", "--output_dir={model}", "--overwrite_output_dir=True"],
                                                  "--output_dir", False),
    "train --output_dir=.": (["train", "--output_dir=.", "--overwrite_output_dir=True"], "--output_dir", True),
    "prepare into user files": (["prepare", "--prepared_dir={user}"], "--prepared_dir", False),
    "prepare into a model": (["prepare", "--prepared_dir={model}"], "--prepared_dir", False),
    "prepare --prepared_dir=.": (["prepare", "--prepared_dir=."], "--prepared_dir", True),
    "plot into user files": (["plot", "--output_dir={run}", "--plot_dir={user}"], "--plot_dir", False),
    "plot into a model": (["plot", "--output_dir={run}", "--plot_dir={model}"], "--plot_dir", False),
    "plot into a run's plots/ of user files": (["plot", "--output_dir={run}"], "--plot_dir", False),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_folder_of_user_files_is_refused_and_left_untouched(tmp_path, case, cli_in_process):
    command, flag, inside = REFUSED[case]
    places = {"tmp": tmp_path, "corpus": write_rows(tmp_path / "data" / "train.jsonl", synthetic_rows(60, seed=1)),
              "run": tmp_path / "run", "user": user_files(tmp_path / "user"),
              "model": user_files(tmp_path / "model", model_like=True)}
    places["run"].mkdir()
    (places["run"] / MARKERS["run"]).touch()
    (places["run"] / "metrics.jsonl").write_text('{"event": "train", "step": 1, "loss": 2.5, "lr": 0.001}\n')
    shutil.copytree(places["user"], places["run"] / "plots")
    args = [a.format(**places) for a in command]
    if command[0] != "plot":
        args += [f"--train_file={places['corpus']}"] + (TINY if command[0] == "train" else [])
    before = snapshot(tmp_path)
    line = error_line(cli_in_process(*args, cwd=places["user"] if inside else tmp_path))
    assert f"{flag}=" in line and ("t5-lowmem did not write" in line or "holds a saved model" in line), line
    after = snapshot(tmp_path)
    if "new_run" in " ".join(args):  # the run folder it made for itself is new; nothing else changed
        after = {k: v for k, v in after.items() if k.split(os.sep)[0] != "new_run"}
    assert after == before


def test_a_run_folder_marked_by_another_process_while_it_is_checked_is_accepted(tmp_path):
    # Every process of a launch claims --output_dir. One may mark the new folder between another's first
    # look (no marker yet) and its listing (the marker there): that folder is this run's, not a stranger's.
    # The race is made deterministic here: the first look asks the recogniser, which marks the folder.
    from lowmem.utils.ownership import check_folder

    folder = tmp_path / "run"
    folder.mkdir()

    def another_process_marks_it(path: Path) -> bool:
        (path / MARKERS["run"]).write_text("marked by rank 1\n")
        return False

    assert check_folder(folder, "--output_dir", "run", another_process_marks_it) == folder
    # and a stranger's file is still refused, however the recogniser answers
    (folder / MARKERS["run"]).unlink()
    (folder / "notes.txt").write_text("mine\n")
    with pytest.raises(Exception, match="holds files t5-lowmem did not write"):
        check_folder(folder, "--output_dir", "run", lambda _path: False)


def test_an_earlier_versions_started_marker_vouches_only_among_a_runs_own_files(tmp_path):
    # Versions before 2026-11-28 marked a run folder with .started, a name other tools use too: it is taken
    # for ours only when empty or holding our marker text, with nothing beside it but what a run writes.
    from lowmem.utils.ownership import MARKER_TEXT, check_folder, is_run_folder

    folder = tmp_path / "run"
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("")
    (folder / "consumed-rank0.tsv").write_text("")
    for text in ("", MARKER_TEXT):
        (folder / ".started").write_text(text)
        assert is_run_folder(folder) and check_folder(folder, "--output_dir", "run", is_run_folder) == folder
    (folder / ".started").write_text("started by another tool\n")
    assert not is_run_folder(folder)
    (folder / ".started").write_text("")
    (folder / "notes.txt").write_text("mine\n")
    with pytest.raises(Exception, match="holds files t5-lowmem did not write"):
        check_folder(folder, "--output_dir", "run", is_run_folder)
    assert MARKERS["run"] != ".started"


def test_sibling_folders_survive_and_a_tokenizer_folder_of_ours_is_reused(tmp_path, run_cli):
    from data.tokenization import has_tokenizer, train_tokenizer

    corpus = write_rows(tmp_path / "c.jsonl", synthetic_rows(200, seed=2))
    for sibling in ("tok.tmp", "tok.partial", ".tok.partial"):  # names the old staging used, or might
        user_files(tmp_path / sibling)
    before = snapshot(tmp_path)
    proc = run_cli("train_tokenizer", f"--train_file={corpus}", f"--tokenizer_dir={tmp_path / 'tok'}",
                   "--vocab_size=400", "--max_source_len=16")  # a length limit: the tokenizer reads none
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "note: --max_source_len has no effect on train_tokenizer (it is read by train)" in proc.stderr
    assert {k: v for k, v in snapshot(tmp_path).items() if not k.startswith("tok/") and k != "tok"} == before
    assert has_tokenizer(tmp_path / "tok") and (tmp_path / "tok" / MARKERS["tokenizer"]).is_file()
    assert not (tmp_path / "tok" / ".saving").exists()
    proc = run_cli("train_tokenizer", f"--train_file={corpus}", f"--tokenizer_dir={tmp_path / 'tok'}")
    assert "holds a tokenizer already" in error_line(proc)

    # Ours: trained again in place (as the trainer does when it finds no tokenizer), a file put beside kept.
    (tmp_path / "tok" / "tokenizer.json").unlink()
    (tmp_path / "tok" / "README.md").write_text("mine\n")
    train_tokenizer([corpus], tmp_path / "tok", ("prompt", "response"), vocab_size=400, max_sentences=400)
    assert has_tokenizer(tmp_path / "tok") and (tmp_path / "tok" / "README.md").read_text() == "mine\n"
    # An empty folder is claimed.
    (tmp_path / "empty").mkdir()
    train_tokenizer([corpus], tmp_path / "empty", ("prompt", "response"), vocab_size=400, max_sentences=400)
    assert has_tokenizer(tmp_path / "empty") and (tmp_path / "empty" / MARKERS["tokenizer"]).is_file()


def test_prepare_and_plot_write_into_empty_folders_and_refuse_their_own_corpus(tmp_path, run_cli):
    corpus = write_rows(tmp_path / "c.jsonl", synthetic_rows(50, seed=3))
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    user_files(tmp_path / "prepared.partial")
    before = snapshot(tmp_path / "prepared.partial")
    proc = run_cli("prepare", f"--train_file={corpus}", f"--prepared_dir={prepared}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(p.name for p in prepared.iterdir()) == [MARKERS["prepared"], "prepared.manifest",
                                                          "shard-00000.parquet"]
    assert snapshot(tmp_path / "prepared.partial") == before
    proc = run_cli("prepare", f"--train_file={corpus}", f"--prepared_dir={prepared}")
    assert "holds a prepared corpus" in error_line(proc)

    run, charts = tmp_path / "run", tmp_path / "charts"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"event": "train", "step": 1, "time": 1.0, "loss": 2.5, "lr": 0.001}\n')
    charts.mkdir()
    for _ in range(2):  # empty, then ours
        proc = run_cli("plot", f"--output_dir={run}", f"--plot_dir={charts}")
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert {p.name for p in charts.iterdir()} == {MARKERS["plots"], "loss.png", "learning_rate.png"}


@pytest.fixture(scope="session")
def trained(request, tmp_path_factory, run_cli):
    """A tiny run with a checkpoint at step 2, trained into a folder that existed and was empty, and its flags;
    built once for the session (read only: conftest.shared_folder)."""
    def args(root):
        return [f"--train_file={root / 'train.jsonl'}", "--save_steps=2", *TINY]

    def build(root):
        write_rows(root / "train.jsonl", synthetic_rows(80, seed=4))
        run = root / "run"
        run.mkdir()
        proc = run_cli("train", f"--output_dir={run}", *args(root))
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert (run / MARKERS["run"]).is_file() and checkpoint.find_latest_valid(run / "checkpoints")

    root = shared_folder(request, tmp_path_factory, "ownership-trained", build)
    return root / "run", args(root)


def test_a_run_folder_of_ours_is_reused_marked_or_not(trained, tmp_path, run_cli):
    run, args = trained
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / MARKERS["run"]).unlink()  # as a run of a version that left no marker: config.json + metrics.jsonl
    (copy / "notes.txt").write_text("kept\n")  # overwriting removes only the run's own files
    proc = run_cli("train", f"--output_dir={copy}", *args)
    assert "already holds a run" in error_line(proc)
    proc = run_cli("train", f"--output_dir={copy}", *args, "--overwrite_output_dir=True")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (copy / MARKERS["run"]).is_file() and (copy / "notes.txt").read_text() == "kept\n"
    assert [r["step"] for r in metrics(copy) if r["event"] == "train"] == [1, 2]


def test_a_run_inside_another_runs_exports_or_checkpoints_is_refused(trained, tmp_path, run_cli):
    # Its best/ and final/ are replaced whole at its next export, its checkpoints removed as they rotate:
    # a run made inside one (from --init_from=RUN/best, say) would be lost with it.
    run, args = trained
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    for inside in (copy / "best" / "sft", copy / "final" / "a" / "b", copy / "checkpoints" / "x"):
        proc = run_cli("train", f"--output_dir={inside}", f"--init_from={copy / 'best'}", *args)
        assert f"is inside {copy / inside.relative_to(copy).parts[0]}, which the run in {copy}" in error_line(proc)
        assert not inside.exists()
    proc = run_cli("train", f"--output_dir={copy / 'sft'}", f"--init_from={copy / 'best'}", *args)
    assert proc.returncode == 0, proc.stderr[-2000:]  # beside them, in the run's folder: its own


class RunsCommand:
    """Unpickled, it runs a shell command: what a checkpoint from elsewhere could hold."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


class WritesFile:
    """Unpickled, it writes a file through exec."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return exec, (f"open({str(self.path)!r}, 'w').write('ran')",)


def replace_in_checkpoint(folder: Path, name: str, content) -> None:
    """Write ``content`` as ``name`` and record its size and checksum in the manifest, as a complete checkpoint has
    them (what a checkpoint made elsewhere, its manifest made to match, would hold)."""
    from lowmem.checkpointing.checksums import digest_file

    torch.save(content, folder / name)
    manifest = json.loads((folder / checkpoint.MANIFEST).read_text())
    manifest["files"][name] = (folder / name).stat().st_size
    manifest["checksums"][name] = digest_file(folder / name, manifest["checksum"])
    (folder / checkpoint.MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("name, payload", [("optimizer.pt", "system"), ("scheduler.pt", "system"),
                                           ("process_0.pt", "system"), ("optimizer.pt", "exec")])
def test_a_checkpoint_holding_code_is_refused_and_the_code_never_runs(trained, tmp_path, name, payload, run_cli):
    run, args = trained
    copy, sentinel = tmp_path / "run", tmp_path / "SENTINEL"
    shutil.copytree(run, copy)
    folder = checkpoint.find_latest_valid(copy / "checkpoints")
    evil = RunsCommand(f"touch {sentinel}") if payload == "system" else WritesFile(sentinel)
    replace_in_checkpoint(folder, name, {"state": {}, "param_groups": [], "rng": evil})
    weights = hashlib.sha256((copy / "final" / "model.safetensors").read_bytes()).hexdigest()
    proc = run_cli("train", f"--output_dir={copy}", *args, "--is_keep_training=True")
    # Refused outright (the optimizer's state is read as the weights load), or skipped as damaged by the resume's
    # check of its state files with a warning naming the file, leaving no checkpoint to continue from: one line
    said = error_line(proc) + "\n" + proc.stdout
    assert name in said and "not loaded" in said and ("posix.system" in said or "exec" in said), said[-2000:]
    assert not sentinel.exists()
    assert hashlib.sha256((copy / "final" / "model.safetensors").read_bytes()).hexdigest() == weights


def test_checkpoint_state_is_plain_and_an_older_one_with_numpy_arrays_still_loads(trained, tmp_path, run_cli):
    run, args = trained
    folder = checkpoint.find_latest_valid(run / "checkpoints")
    state = checkpoint.load_state(folder / "process_0.pt")
    assert isinstance(state["rng"]["numpy"][1], list)  # numpy's key stored as ints, no array
    # RNG states round-trip exactly.
    random.seed(5)
    np.random.seed(6)
    torch.manual_seed(7)
    saved = checkpoint.rng_state()
    torch.save(saved, tmp_path / "rng.pt")
    drawn = (random.random(), np.random.rand(), torch.rand(1).item())
    checkpoint.set_rng_state(checkpoint.load_state(tmp_path / "rng.pt"))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == drawn

    # A checkpoint of the previous version: numpy's state pickled as an array.
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    folder = checkpoint.find_latest_valid(copy / "checkpoints")
    old = checkpoint.load_state(folder / "process_0.pt")
    kind, key, *rest = old["rng"]["numpy"]
    old["rng"]["numpy"] = (kind, np.asarray(key, dtype=np.uint32), *rest)
    replace_in_checkpoint(folder, "process_0.pt", old)
    proc = run_cli("train", f"--output_dir={copy}", *args, "--is_keep_training=True")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"resumed from {folder}" in proc.stdout


def test_the_encoder_cache_removes_only_cache_folders_in_a_root_of_ours(tmp_path):
    from lowmem.training import encoder_cache
    from lowmem.utils.errors import UserError

    root = tmp_path / "encoder_cache"
    old = root / "0123456789abcdef"  # a cache of an earlier version: its own files, no marker
    old.mkdir(parents=True)
    for name in ("rows-rank0.bin", "states-rank0.bin", "done-rank0.json"):
        (old / name).write_bytes(b"0")
    user_files(root / "mine")

    def build(folder: Path) -> None:
        folder.mkdir()
        (folder / "rows-rank0.bin").write_bytes(b"")
        (folder / "states-rank0.bin").write_bytes(b"")
        (folder / "done-rank0.json").write_text(json.dumps({"d_model": 4, "dtype": "float32", "tokens": 0,
                                                            "bytes": 0}))

    share = encoder_cache.CacheShare(rank=0, world=1, files=[], columns=("prompt", "response"), shares=[])
    before = snapshot(tmp_path)
    with pytest.raises(UserError, match="the encoder cache folder .* did not write"):  # someone's folder in it
        encoder_cache.open_cache(root, "new", share, "disk", build, say=lambda _: None)
    assert snapshot(tmp_path) == before
    (root / MARKERS["encoder_cache"]).touch()  # ours: old caches go, anything else stays
    encoder_cache.open_cache(root, "new", share, "disk", build, say=lambda _: None).close()
    assert sorted(p.name for p in root.iterdir()) == [MARKERS["encoder_cache"], "mine", "new"]
    assert {k: v for k, v in snapshot(tmp_path).items() if k.startswith(os.path.join("encoder_cache", "mine"))} \
        == {k: v for k, v in before.items() if k.startswith(os.path.join("encoder_cache", "mine"))}


def test_files_of_ours_are_never_written_through_a_link_planted_under_their_name(tmp_path):
    from lowmem.monitoring.metrics_log import AppendLog, MetricsLog
    from lowmem.runs.run_folder import RunFolder
    from lowmem.runs.run_start import LOCK_FILE
    from lowmem.utils.errors import UserError
    from lowmem.utils.ownership import open_own, write_atomic

    mine = tmp_path / "mine.txt"
    mine.write_text("my notes\n")
    run = tmp_path / "run"
    run.mkdir()
    writers = {"metrics.jsonl": lambda: MetricsLog(run / "metrics.jsonl"),
               "consumed-rank0.tsv": lambda: AppendLog(run / "consumed-rank0.tsv"),
               LOCK_FILE: lambda: RunFolder(run).hold_lock(str(run)),
               "config.json": lambda: open_own(run / "config.json", "w"),
               "states-rank0.bin": lambda: open_own(run / "states-rank0.bin", "wb")}
    for name, write in writers.items():
        (run / name).symlink_to(mine)
        with pytest.raises(UserError, match="symbolic link"):
            write()
        assert (run / name).is_symlink() and mine.read_text() == "my notes\n", name
    (run / ".latest.tmp").symlink_to(mine)  # a rename-based write's temporary name
    with pytest.raises(UserError, match="symbolic link"):
        write_atomic(run / "latest", "step_000002\n")
    assert mine.read_text() == "my notes\n"
    log = AppendLog(run / "new.log")  # the files themselves are written as before
    log.write("a line\n")
    log.close()
    assert (run / "new.log").read_text() == "a line\n"


@pytest.mark.parametrize("given", sorted(MARKERS))
@pytest.mark.parametrize("found", sorted(MARKERS))
def test_a_folder_of_ours_of_another_kind_is_named_as_such(tmp_path, given, found):
    # A tokenizer folder given as --output_dir (and every other pairing) is refused by the kind it is,
    # not as "files t5-lowmem did not write" with its own marker listed among them.
    from lowmem.utils.ownership import KIND_NAMES, check_folder

    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / MARKERS[found]).write_text("")
    (folder / "held.bin").write_text("kept\n")
    if given == found:
        assert check_folder(folder, "--some_dir", given) == folder
        return
    with pytest.raises(UserError) as refused:
        check_folder(folder, "--some_dir", given)
    assert f"is a t5-lowmem {KIND_NAMES[found]} folder, not a {KIND_NAMES[given]} folder" in str(refused.value)
    assert "did not write" not in str(refused.value)
    assert (folder / "held.bin").read_text() == "kept\n"


def test_a_folder_a_run_wrote_inside_its_own_is_named_as_such(tmp_path):
    from lowmem.utils.ownership import check_folder

    run = tmp_path / "run"
    (run / "checkpoints" / "step_000004").mkdir(parents=True)
    (run / MARKERS["run"]).write_text("")
    (run / "checkpoints" / "latest").write_text("step_000004\n")
    (run / "mine").mkdir()  # a user's folder put in a run folder is not called the run's
    (run / "mine" / "notes.txt").write_text("mine\n")
    for flag, kind in (("--tokenizer_dir", "tokenizer"), ("--output_dir", "run"), ("--prepared_dir", "prepared")):
        with pytest.raises(UserError, match=f"is the checkpoints/ of the t5-lowmem training run folder {run}, not a"):
            check_folder(run / "checkpoints", flag, kind)
        with pytest.raises(UserError, match="holds files t5-lowmem did not write"):
            check_folder(run / "mine", flag, kind)
    for name, kind in (("plots", "plots"), ("encoder_cache", "encoder_cache")):  # the run's own of that kind,
        (run / name).mkdir()  # holding a stranger's file: named as such, with the file
        (run / name / "notes.txt").write_text("mine\n")
        with pytest.raises(UserError, match=r"holds files t5-lowmem did not write \(notes.txt\)"):
            check_folder(run / name, "--some_dir", kind)


def test_files_a_user_puts_in_an_export_survive_the_next_export_and_a_start_over(tmp_path, run_cli):
    corpus = write_rows(tmp_path / "c.jsonl", synthetic_rows(80, seed=4))
    evals = write_rows(tmp_path / "e.jsonl", synthetic_rows(4, seed=5))
    run = tmp_path / "run"
    common = [f"--train_file={corpus}", f"--eval_file={evals}", f"--output_dir={run}", "--save_steps=2",
              "--eval_steps=2", "--warmup_steps=0", *TINY[2:]]
    assert run_cli("train", *common, "--max_steps=2").returncode == 0
    (run / "best" / "README.md").write_text("# my model card\n")
    (run / "final" / "extra").mkdir()
    (run / "final" / "extra" / "keep.txt").write_text("mine\n")
    weights = (run / "final" / "model.safetensors").read_bytes()
    proc = run_cli("train", *common, "--max_steps=4", "--is_keep_training=True")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (run / "final" / "model.safetensors").read_bytes() != weights  # the export was replaced ...
    assert (run / "best" / "README.md").read_text() == "# my model card\n"  # ... and the user's files kept
    assert (run / "final" / "extra" / "keep.txt").read_text() == "mine\n"
    proc = run_cli("train", *common, "--max_steps=2", "--overwrite_output_dir=True")  # starting over
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (run / "best" / "README.md").read_text() == "# my model card\n"
    assert (run / "final" / "extra" / "keep.txt").read_text() == "mine\n"
    assert (run / "final" / "model.safetensors").is_file()
    # A start-over stopped by bad data before its first step leaves the user's files, and no model of the run's:
    # the same command with the data fixed starts over, as it does where no user file was left
    bad = tmp_path / "bad.jsonl"
    bad.write_text(corpus.read_text() + "{not json\n" * 40)
    stopped = run_cli("train", *[a for a in common if not a.startswith("--train_file")], f"--train_file={bad}",
                      "--max_steps=2", "--overwrite_output_dir=True")
    assert stopped.returncode == 2 and (run / "final" / "extra" / "keep.txt").is_file()
    proc = run_cli("train", *common, "--max_steps=2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "starting over" in proc.stdout and (run / "final" / "extra" / "keep.txt").read_text() == "mine\n"
