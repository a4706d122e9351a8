"""Damaged checkpoints: every file's checksum in the manifest (taken as it was written), verified on resume; a damaged
checkpoint or one holding invalid state is skipped with a warning, and the run resumed from the one before ends
bit-identical to the run never interrupted."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from conftest import shared_folder, synthetic_rows, write_rows
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_resume import assert_same_training

from lowmem.checkpointing import checkpoint, checksums

STEPS = 6  # checkpoints at 2, 4 and 6 (all three kept)


def args_of(run: Path, data: Path) -> list[str]:
    """The run's flags; ``data``: the shared run's corpus (its path is in the consumed log)."""
    return [f"--train_file={data}", f"--output_dir={run}", f"--max_steps={STEPS}", "--save_steps=2",
            "--save_total_limit=3", "--eval_steps=0", "--max_eval_samples=4", "--eval_generate=False",
            "--gradient_accumulation_steps=1", "--logging_steps=1", "--dump_consumed=True", "--max_source_len=32",
            "--max_target_len=32"]


@pytest.fixture(scope="module")
def trained(request, tmp_path_factory, processes):
    """One finished tiny run of ``STEPS`` steps (the run never interrupted), beside its data."""
    def build(folder: Path) -> None:
        write_rows(folder / "d.jsonl", synthetic_rows(60, seed=4))
        done = processes.cli("train", *args_of(folder / "run", folder / "d.jsonl"))
        assert done.returncode == 0, done.stderr[-3000:]

    return shared_folder(request, tmp_path_factory, "integrity-run", build) / "run"


def copy_run(trained: Path, tmp_path: Path) -> Path:
    shutil.copytree(trained, tmp_path / "run")
    return tmp_path / "run"


def flip(path: Path, at: int | None = None) -> None:
    """Change 4 bytes of ``path`` in place (its size kept): at ``at``, else in its middle."""
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if at is None else at
    data[at:at + 4] = bytes(b ^ 0x5A for b in data[at:at + 4])
    path.write_bytes(bytes(data))


def reseal(folder: Path, name: str) -> None:
    """Record ``name``'s new size and checksum in the manifest: damage only its values can show."""
    manifest = json.loads((folder / checkpoint.MANIFEST).read_text())
    manifest["files"][name] = (folder / name).stat().st_size
    manifest["checksums"][name] = checksums.digest_file(folder / name)
    (folder / checkpoint.MANIFEST).write_text(json.dumps(manifest))


def resume(run_cli, run: Path, trained: Path):
    done = run_cli("train", *args_of(run, trained.parent / "d.jsonl"), "--is_keep_training=True")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    return done


def test_the_streamed_safetensors_writer_writes_what_save_file_writes(tmp_path):
    tensors = {"w": torch.randn(3, 4), "b": torch.randn(5).bfloat16(), "h": torch.ones(2).half(), "i": torch.arange(3),
               "d": torch.randn(2).double(), "q": torch.arange(4, dtype=torch.int8), "m": torch.tensor([True, False]),
               "z": torch.zeros(0, 2), "s": torch.tensor(2.5), "t": torch.randn(4, 3).t(), "é": torch.ones(1)}
    contiguous = {k: v.contiguous() for k, v in tensors.items()}  # save_file takes contiguous tensors only
    for metadata in (None, {"format": "pt"}):
        save_file(contiguous, str(tmp_path / "ref.safetensors"), metadata=metadata)
        sums = {}
        checksums.save_safetensors(tensors, tmp_path, "ours.safetensors", sums, metadata)
        ours = (tmp_path / "ours.safetensors").read_bytes()
        assert ours == (tmp_path / "ref.safetensors").read_bytes()
        assert sums["ours.safetensors"] == checksums.digest_file(tmp_path / "ours.safetensors")
    # Two metadata keys: the Rust writer orders them as its hash map iterates; the same header otherwise
    metadata = {"format": "pt", "contents": checkpoint.TRAINED_ONLY}
    checksums.save_safetensors(tensors, tmp_path, "ours.safetensors", {}, metadata)
    with safe_open(str(tmp_path / "ours.safetensors"), "pt") as f:
        assert f.metadata() == metadata
    loaded = load_file(str(tmp_path / "ours.safetensors"))
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    assert all(loaded[k].dtype == tensors[k].dtype for k in tensors)


def test_a_whole_model_is_written_as_save_model_writes_it_tied_tensors_once(tmp_path):
    from safetensors.torch import save_model
    from transformers import T5Config, T5ForConditionalGeneration

    model = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=8, d_ff=16, d_kv=4, num_heads=2, num_layers=1))
    save_model(model, str(tmp_path / "ref.safetensors"))
    checkpoint.save_trained(model, tmp_path / "model.safetensors")
    ref, ours = (load_file(str(tmp_path / n)) for n in ("ref.safetensors", "model.safetensors"))
    assert ref.keys() == ours.keys() and all(torch.equal(ref[k], ours[k]) for k in ref)
    metadata = [safe_open(str(tmp_path / n), "pt").metadata() for n in ("ref.safetensors", "model.safetensors")]
    assert metadata[0] == metadata[1] and len(metadata[1]) >= 2  # the dropped aliases, named as save_model names them
    header = [(tmp_path / n).read_bytes() for n in ("ref.safetensors", "model.safetensors")]
    length = struct.unpack("<Q", header[0][:8])[0]
    assert header[0][8 + length:] == header[1][8 + length:]  # the same tensors in the same order
    for p in model.encoder.parameters():
        p.requires_grad_(False)
    checkpoint.save_trained(model, tmp_path / "trained.safetensors")
    trained = load_file(str(tmp_path / "trained.safetensors"))
    assert set(trained) == {n for n, p in model.named_parameters() if p.requires_grad}


def test_a_checkpoints_manifest_holds_each_files_checksum(trained):
    for folder in checkpoint.step_folders(trained / "checkpoints"):
        manifest = json.loads((folder / checkpoint.MANIFEST).read_text())
        assert manifest["checksum"] == checksums.ALGORITHM and set(manifest["checksums"]) == set(manifest["files"])
        assert {"model.safetensors", "optimizer.pt", "process_0.pt", "trainer_state.json"} <= set(manifest["files"])
        assert all(checksums.digest_file(folder / n) == s for n, s in manifest["checksums"].items())


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json",
                                  "run_config.json", "process_0.pt", "manifest.json"])
def test_a_file_changed_at_its_size_is_named_and_the_run_resumes_from_the_one_before(tmp_path, trained, run_cli, name):
    run = copy_run(trained, tmp_path)
    newest = run / "checkpoints" / "step_000006"
    if name == "manifest.json":  # its own damage: a checksum in it changed
        text = (newest / name).read_text()
        at = text.index('"optimizer.pt": "', text.index('"checksums"')) + len('"optimizer.pt": "')
        (newest / name).write_text(text[:at] + ("0000" if text[at:at + 4] != "0000" else "1111") + text[at + 4:])
    else:
        flip(newest / name)
    done = resume(run_cli, run, trained)
    said = done.stdout + done.stderr
    wrong = "optimizer.pt" if name == "manifest.json" else name
    assert f"skipping checkpoint {newest}: checksum mismatch in {wrong}" in said, said[-3000:]
    assert "resumed from" in said and "step_000004 at step 4" in said
    assert_same_training(trained, run)


def test_state_values_of_the_wrong_type_or_range_count_as_damage(tmp_path, trained, run_cli):
    run = copy_run(trained, tmp_path)
    newest, before = (run / "checkpoints" / f"step_{s:06d}" for s in (6, 4))
    state = json.loads((newest / "trainer_state.json").read_text())
    (newest / "trainer_state.json").write_text(json.dumps({**state, "step": -9}))
    reseal(newest, "trainer_state.json")
    done = resume(run_cli, run, trained)
    assert "trainer_state.json: step is -9, not a whole number >= 0" in done.stdout + done.stderr
    assert "step_000004 at step 4" in done.stdout
    assert_same_training(trained, run)
    # The values each check reads (no run needed: the folder's verdict is the resume's)
    cases = [({**state, "step": "6"}, "step is '6'"), ({**state, "epoch": 1.5}, "epoch is 1.5"),
             ({**state, "best_step": 7}, "best_step is 7"), ({**state, "examples": True}, "examples is True"),
             ({**state, "elapsed_s": -1}, "elapsed_s is -1"), ([state], "holds list"),
             ({**state, "step": 4}, "step is 4, in the folder of step 6")]
    copy = tmp_path / "copy" / "step_000006"
    for value, why in cases:
        shutil.rmtree(copy.parent, ignore_errors=True)
        shutil.copytree(newest, copy)
        (copy / "trainer_state.json").write_text(json.dumps(value))
        reseal(copy, "trainer_state.json")
        assert why in (checkpoint.validate(copy) or ""), value
    shutil.rmtree(copy.parent)
    shutil.copytree(before, copy.with_name("step_000004"))
    folder = copy.with_name("step_000004")
    (folder / "run_config.json").write_text("[1, 2]")
    reseal(folder, "run_config.json")
    assert "run_config.json holds list" in checkpoint.validate(folder)


def test_torch_state_files_are_read_and_their_values_checked_without_a_traceback(tmp_path, trained):
    process = torch.load(trained / "checkpoints" / "step_000004" / "process_0.pt", weights_only=False)
    cases = [("process_0.pt", {**process, "rng": None}, "process_0.pt: rng is NoneType"),
             ("process_0.pt", {k: v for k, v in process.items() if k != "data"}, "process_0.pt: data is NoneType"),
             ("process_0.pt", {**process, "log_offsets": {"metrics": -3}}, "log offset metrics is -3"),
             ("scheduler.pt", [1, 2], "scheduler.pt holds list"),
             ("process_0.pt", b"not a torch file", "cannot be read")]
    for i, (name, value, why) in enumerate(cases):
        folder = tmp_path / str(i) / "step_000004"
        shutil.copytree(trained / "checkpoints" / "step_000004", folder)
        if isinstance(value, bytes):
            (folder / name).write_bytes(value)
        else:
            torch.save(value, folder / name)
        reseal(folder, name)
        assert checkpoint.validate(folder) is None  # sizes, checksums, JSON fine: the trainer reads the torch files
        assert why in (checkpoint.validate(folder, states=True) or ""), (name, value)


def test_every_checkpoint_damaged_is_one_line_and_nothing_is_removed(tmp_path, trained, run_cli):
    run = copy_run(trained, tmp_path)
    for folder in checkpoint.step_folders(run / "checkpoints"):
        flip(folder / "optimizer.pt")
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    done = run_cli("train", *args_of(run, trained.parent / "d.jsonl"), "--is_keep_training=True")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert lines[-1].startswith("error: --is_keep_training: no checkpoint of the run") and "usable" in lines[-1]
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before  # final/ and the checkpoints kept


def test_a_manifest_of_sizes_only_still_resumes(tmp_path, trained, run_cli):
    run = copy_run(trained, tmp_path)
    shutil.rmtree(run / "checkpoints" / "step_000006")
    for folder in checkpoint.step_folders(run / "checkpoints"):  # as earlier versions wrote them
        manifest = json.loads((folder / checkpoint.MANIFEST).read_text())
        (folder / checkpoint.MANIFEST).write_text(json.dumps({"files": manifest["files"]}))
    done = resume(run_cli, run, trained)
    assert "skipping" not in done.stdout + done.stderr and "step_000004 at step 4" in done.stdout
    assert_same_training(trained, run)


def test_a_folder_is_verified_once_per_process_and_damage_found_keeps_it_out_of_the_pruning_count(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        sums = {}
        with checkpoint.atomic_folder(root / f"step_{step:06d}", sums=sums) as tmp:
            checksums.save_json({"weights": [step] * 1000}, tmp, "state.json", sums)
    newest = root / "step_000006"
    flip(newest / "state.json")
    warnings = []
    assert checkpoint.find_latest_valid(root, warn=warnings.append) == root / "step_000004"
    assert warnings == [f"warning: skipping checkpoint {newest}: checksum mismatch in state.json"]
    # A second look (the trainer's, after the command line's) reads nothing again: the verdict is kept while the
    # files keep their sizes and modification times, here even for damage done behind its back
    middle = root / "step_000004" / "state.json"
    stat = middle.stat()
    flip(middle)
    os.utime(middle, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert checkpoint.validate(root / "step_000004") is None
    middle.touch()  # a write it can see
    assert "checksum mismatch" in checkpoint.validate(root / "step_000004")
    flip(middle)  # (back as it was)
    os.utime(middle, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    # The resumed run's next checkpoint: pruning to 2 keeps it and step 4, the two it can resume from, not the
    # damaged step 6 (its sizes are right: the damage the resume found is remembered)
    sums = {}
    with checkpoint.atomic_folder(root / "step_000005", sums=sums) as tmp:
        checksums.save_json({"weights": [5]}, tmp, "state.json", sums)
    checkpoint.prune(root, keep=2, protect=root / "step_000005")
    assert sorted(p.name for p in root.iterdir()) == ["step_000004", "step_000005", "step_000006"]
    assert checkpoint.find_latest_valid(root, warn=warnings.append) == root / "step_000005"
