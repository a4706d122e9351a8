"""The corruption sweep (issue 82, behaviour 6): every file a finished run folder and an exported model folder hold,
damaged several ways, then the commands that read it.

A tiny run (two checkpoints, then ``final/``) is built once per session. Damages: cut to half its size
(``truncate``), four bytes changed at the same size (``flip``), ``zero`` bytes, a ``symlink`` to a copy in a user's
folder outside, a folder where a file was or a file where a folder was (``swap``), a JSON document wrapped in a
list (``json_list``), with strings where its numbers were (``json_strings``), its whole numbers made negative
(``json_negative``) or other (``json_values``: 2n + 1); a ``.bin`` rewritten by ``pickle.dump`` (``pickle``), a
shard index leading outside its folder (``escape``). Each is made in a copy of the run, which is then resumed with
a larger ``--max_steps`` (``run_targets``: which files get which), and in a copy of its ``final/`` model folder,
which SFT (``--init_from``), ``evaluate``, ``generate`` and ``plan`` read (``MODEL_DAMAGES``), and of the same
weights as shards with their index and of t5-v1_1's layout (``pytorch_model.bin``, ``spiece.model`` alone:
``LAYOUT_DAMAGES``). Each outcome must be one of three:

- ``a``: works as before: exit 0 and the undamaged input's result (a resume: ``final/`` bit-identical to the run
  trained to that step at once; SFT: its ``final/``; ``evaluate``: its loss; ``generate``: its answers; ``plan``:
  its table). A model folder whose bytes were changed at the same size, or whose numbers were changed in a file
  but config.json, is a model of its own: any result goes;
- ``b``: (resume) from an earlier checkpoint, after a warning that names the newest, and ``final/`` bit-identical;
- ``c``: one ``error:`` line on standard error and exit code 2 (the only one for an index leading out).

Anything else fails: a traceback, another exit code, exit 0 with an export (``best/``, ``final/``) that
``transformers`` cannot load, or a byte changed outside the folder the command writes (the user's folder a symlink
leads to, the model folder a command reads). Each test prints its counts per outcome (``pytest -s`` shows them),
lists its failures, and writes both to ``sweep-<command>-<damage>.json`` in the session's temporary folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest
from conftest import shared_folder, synthetic_rows, write_rows

SMALL = ["--eval_steps=0", "--max_eval_samples=4", "--gradient_accumulation_steps=2", "--max_source_len=24",
         "--max_target_len=24", "--logging_steps=1", "--eval_generate=False"]
# A constant learning rate (within the default warmup) and the consumed log: a run stopped at step 4 and continued
# to step 5, from either checkpoint, is the run trained to 5 at once (and writes every file a run can hold).
RUN = ["--save_steps=2", "--lr_scheduler=constant", "--dump_consumed=True", *SMALL]
BUILT_STEPS, MORE_STEPS = 4, 5
NEWEST = f"step_{BUILT_STEPS:06d}"
SFT = ["--is_finetune=True", "--max_steps=1", "--save_steps=0", *SMALL]
EVALUATE = ["--max_eval_samples=4", "--max_source_len=24", "--max_target_len=24", "--eval_generate=False"]
GENERATE = ["--prompt=the quick brown fox", "--max_new_tokens=4"]

FILE_DAMAGES = ("truncate", "flip", "zero", "symlink", "swap")
JSON_DAMAGES = ("json_list", "json_strings", "json_negative", "json_values")
DAMAGES = FILE_DAMAGES + JSON_DAMAGES
RUN_DAMAGES = DAMAGES[:-1]  # (a checkpoint's numbers other than its own: json_negative's negative step, sizes)
FOLDER_DAMAGES = ("symlink", "swap")  # a folder of the run's own: a link to a user's copy of it, a file in its place
ALLOWED = ("a", "b", "c")


@pytest.fixture(scope="session")
def built(request, tmp_path_factory, run_cli):
    """The finished run (``run``), the run trained to MORE_STEPS at once (``straight``), and the results of SFT,
    ``evaluate`` and ``generate`` on the run's undamaged ``final/`` (read only: conftest.shared_folder)."""
    def build(root: Path) -> None:
        write_rows(root / "train.jsonl", synthetic_rows(80, seed=4))
        write_rows(root / "eval.jsonl", synthetic_rows(8, seed=6))
        for name, steps in (("run", BUILT_STEPS), ("straight", MORE_STEPS)):
            done = run_cli("train", *data_flags(root), f"--output_dir={root / name}", f"--max_steps={steps}", *RUN)
            assert done.returncode == 0, done.stderr[-3000:]
        model = root / "run" / "final"
        write_sharded(model, root / "sharded")
        reference = {c: run_model_command(run_cli, c, root, model, root / "sft") for c in MODEL_DAMAGES}
        assert all(proc.returncode == 0 for proc in reference.values()), {c: p.stderr[-2000:] for c, p in
                                                                         reference.items()}
        (root / "reference.json").write_text(json.dumps({c: result_of(c, p, root / "sft", model) for c, p in
                                                         reference.items()}))

    root = shared_folder(request, tmp_path_factory, "corruption-sweep", build)
    assert len(checkpoint_folders(root / "run")) >= 2
    return root


def write_sharded(model: Path, folder: Path) -> None:
    """``model``'s weights as the hub shards them: three safetensors files and their index, beside its config and
    tokenizer."""
    from safetensors.torch import load_file, save_file

    folder.mkdir()
    tensors = load_file(str(model / "model.safetensors"))
    names, weight_map = sorted(tensors), {}
    for i in range(3):
        shard = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file({name: tensors[name] for name in names[i::3]}, str(folder / shard), metadata={"format": "pt"})
        weight_map.update({name: shard for name in names[i::3]})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                     "weight_map": weight_map}))
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(model / name, folder / name)


def data_flags(root: Path) -> list[str]:
    return [f"--train_file={root / 'train.jsonl'}", f"--eval_file={root / 'eval.jsonl'}"]


def run_targets(run: Path, kind: str) -> list[str]:
    """What the resume test damages as ``kind``: files, folders (their name ends in '/'), and every file of a folder
    at once ('/*'). Each file the resume reads gets every damage: the newest checkpoint's, the run's own. The files
    it only replaces or prunes (the exports, the older checkpoint, which a resume from the newest does not read) are
    linked out, or swapped for folders, a folder at a time: those damages are what could move or change a user's
    file, and the sweep's case count is its run time."""
    older = checkpoint_folders(run)[0].name
    whole = ("best/", "final/", f"checkpoints/{older}/")
    targets = [name for name in entries(run) if not name.startswith(whole) or name in whole]
    targets = [name for name in targets if kind in (FOLDER_DAMAGES if name.endswith("/") else RUN_DAMAGES)]
    return targets + [f"{folder}*" for folder in whole if kind in ("symlink", "swap")]


# The model folder: SFT reads it through train's checks, evaluate and generate through one loader (each takes part
# of the damages), plan its config and its weights' headers; json_values gives a config that disagrees with the
# weights. About 2 s a case on an idle core.
MODEL_DAMAGES = {"sft": FILE_DAMAGES + ("json_strings", "json_values"),
                 "evaluate": ("truncate", "flip", "swap", "json_strings", "json_values"),
                 "generate": ("zero", "symlink", "json_list"), "plan": ("truncate", "json_values")}


def checkpoint_folders(run: Path) -> list[Path]:
    return sorted(p for p in (run / "checkpoints").glob("step_*") if p.is_dir())


def run_model_command(run_cli, command: str, root: Path, model: Path, out: Path):
    """SFT from ``model`` into ``out``, or ``evaluate`` / ``generate`` with it."""
    if command == "sft":
        return run_cli("train", *data_flags(root), f"--init_from={model}", f"--output_dir={out}", *SFT)
    if command == "plan":
        return run_cli("plan", "--is_finetune=True", f"--init_from={model}", *SMALL[1:])
    flags = EVALUATE if command == "evaluate" else GENERATE
    return run_cli(command, f"--init_from={model}", f"--eval_file={root / 'eval.jsonl'}", *flags)


def result_of(command: str, proc, out: Path, model: Path):
    """What an undamaged input's command gives: SFT's final weights (their digest), the loss, the answers, the
    plan."""
    if command == "sft":
        return weights_digest(out / "final")
    if command == "plan":  # (its first line names the model folder)
        return proc.stdout.replace(str(model), "MODEL")
    if command == "evaluate":
        return re.search(r"eval_loss:\s+(\S+)", proc.stdout).group(1)
    return [line for line in proc.stdout.splitlines() if "  ->  " in line]


def weights_digest(folder: Path) -> str:
    import torch
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "model.safetensors"))
    digest = hashlib.sha256()
    for name in sorted(tensors):  # (the tensors, not the file: its header's order is no part of the model)
        digest.update(name.encode() + tensors[name].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def entries(folder: Path) -> list[str]:
    """Every file under ``folder``, then every folder in it (ending in '/'), as paths relative to it."""
    return (sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
            + sorted(f"{p.relative_to(folder)}/" for p in folder.rglob("*") if p.is_dir()))


def retyped(value, numbers: bool):
    """``value`` with every number a string (``numbers``), else every string a number."""
    if isinstance(value, dict):
        return {k: retyped(v, numbers) for k, v in value.items()}
    if isinstance(value, list):
        return [retyped(v, numbers) for v in value]
    if numbers and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not numbers and isinstance(value, str):
        return 7
    return value


def renumbered(value, change):
    """``value`` with ``change`` applied to every whole number in it."""
    if isinstance(value, dict):
        return {k: renumbered(v, change) for k, v in value.items()}
    if isinstance(value, list):
        return [renumbered(v, change) for v in value]
    return change(value) if isinstance(value, int) and not isinstance(value, bool) else value


def damage(path: Path, kind: str, user: Path) -> bool:
    """Damage ``path`` (a file or a folder) as ``kind`` says; False where that damage does not apply to it. A
    symlink leads to a copy of what it replaces in the user's folder ``user``."""
    if kind.startswith("json_") and (path.is_dir() or path.suffix != ".json"):
        return False
    if kind in ("truncate", "zero", "flip") and path.stat().st_size == 0:  # (a marker: nothing to damage)
        return False
    if kind == "zero" and path.suffix == ".json":  # (no JSON either way: truncate covers it)
        return False
    if (kind == "pickle" and path.suffix != ".bin") or (kind == "escape" and not path.name.endswith(".index.json")):
        return False
    if path.is_dir() and kind not in FOLDER_DAMAGES:
        return False
    if kind == "symlink":
        copy = user / f"{len(list(user.iterdir()))}-{path.name}"
        (shutil.copytree if path.is_dir() else shutil.copy2)(path, copy)
        shutil.rmtree(path) if path.is_dir() else path.unlink()
        path.symlink_to(copy, target_is_directory=copy.is_dir())
    elif kind == "swap" and path.is_dir():
        shutil.rmtree(path)
        path.write_text("not a folder\n")
    elif kind == "swap":
        path.unlink()
        path.mkdir()
    elif kind == "truncate":
        os.truncate(path, path.stat().st_size // 2)
    elif kind == "zero":
        os.truncate(path, 0)
    elif kind == "flip":
        data = bytearray(path.read_bytes())
        for at in sorted({len(data) // 3, len(data) // 2, 2 * len(data) // 3, 3 * len(data) // 4}):
            data[at] ^= 0x5A
        path.write_bytes(bytes(data))
    elif kind == "pickle":  # a legacy .bin written by pickle.dump, not torch.save (unpickling can run code)
        import pickle

        import torch

        tensors = torch.load(path, weights_only=True)
        with open(path, "wb") as fh:
            pickle.dump(tensors, fh)
    elif kind == "escape":  # an index naming shards outside its folder (copies of them, where it leads)
        index = json.loads(path.read_text())
        for shard in set(index["weight_map"].values()):
            shutil.copy2(path.parent / shard, user / shard)
        index["weight_map"] = {k: os.path.relpath(user / v, path.parent) for k, v in index["weight_map"].items()}
        path.write_text(json.dumps(index))
    elif kind.startswith("json_"):
        return damage_json(path, kind)
    return True


def damage_json(path: Path, kind: str) -> bool:
    """The JSON damages (``damage``); False where the document has no number to change."""
    document = json.loads(path.read_text())
    if kind == "json_list":
        changed = [document]
    elif kind == "json_strings":  # a string where a number is (or, in a file without numbers, the other way round)
        changed = retyped(document, numbers=True)
        changed = changed if changed != document else retyped(document, numbers=False)
    else:  # a negative step or size; a config that disagrees with its weights
        changed = renumbered(document, (lambda n: -n - 1) if kind == "json_negative" else (lambda n: 2 * n + 1))
    path.write_text(json.dumps(changed))
    return changed != document


def snapshot(folder: Path) -> dict[str, str]:
    """Every entry under ``folder``: a file's digest, a link's target, a folder's mark."""
    state = {}
    for p in sorted(folder.rglob("*")):
        key = str(p.relative_to(folder))
        state[key] = (f"-> {os.readlink(p)}" if p.is_symlink() else "dir" if p.is_dir()
                      else hashlib.sha256(p.read_bytes()).hexdigest())
    return state


def one_error_line(proc) -> bool:
    return proc.returncode == 2 and sum(line.startswith("error:") for line in proc.stderr.splitlines()) == 1


def unloadable_exports(folder: Path) -> list[str]:
    """The exports in ``folder`` (``best/``, ``final/``) that ``transformers`` cannot load."""
    from transformers import AutoModelForSeq2SeqLM
    from transformers.utils import logging

    logging.set_verbosity_error()  # (its notes on tied weights, once per load)
    logging.disable_progress_bar()
    broken = []
    for name in ("best", "final"):
        if (folder / name).exists() or (folder / name).is_symlink():
            try:
                AutoModelForSeq2SeqLM.from_pretrained(folder / name)
            except Exception as err:  # noqa: BLE001 (any failure to load is the finding)
                broken.append(f"{name}/: {type(err).__name__}: {str(err)[:120]}")
    return broken


def common_failure(proc) -> str | None:
    """A failure any command can have, or None; then ``c`` for one error line and exit 2."""
    if "Traceback" in proc.stdout + proc.stderr:
        last = [line for line in proc.stderr.splitlines() if line.strip()][-1:] or [""]
        return f"FAIL traceback ({last[0][:160]})"
    if proc.returncode == 2:
        return "c" if one_error_line(proc) else "FAIL exit 2 without exactly one error: line"
    if proc.returncode != 0:
        return f"FAIL exit code {proc.returncode}"
    return None


def resume_outcome(proc, run: Path, reference: str) -> str:
    found = common_failure(proc)
    if found:
        return found
    broken = unloadable_exports(run)
    if broken:
        return f"FAIL exit 0 with an export transformers cannot load: {broken}"
    if not (run / "final" / "model.safetensors").is_file() or weights_digest(run / "final") != reference:
        return "FAIL exit 0, final/ is not the run never interrupted"
    text = proc.stdout + proc.stderr
    start = re.search(r"resumed from \S*step_(\d+) at step", text)
    if start and int(start.group(1)) == BUILT_STEPS:
        return "a"
    if any("warning" in line and NEWEST in line for line in text.splitlines()):
        return "b"
    return "FAIL resumed before the newest checkpoint without a warning naming it"


def model_outcome(command: str, proc, out: Path, model: Path, reference, own_model: bool) -> str:
    """The outcome of ``command`` on a damaged model folder; ``own_model``: the damage left valid files that make
    another model (any result goes)."""
    found = common_failure(proc)
    if found:
        return found
    broken = unloadable_exports(out) if command == "sft" else []
    if broken:
        return f"FAIL exit 0 with an export transformers cannot load: {broken}"
    try:
        same = result_of(command, proc, out, model) == reference
    except (AttributeError, OSError) as err:  # no loss printed, no final weights
        return f"FAIL exit 0 without a result ({type(err).__name__})"
    return "a" if same or own_model else "FAIL exit 0 with another result than the undamaged folder's"


def report(tmp_path_factory, command: str, kind: str, results: list[tuple[str, str]]) -> None:
    """Print the counts per outcome and the failures; keep them in the session's temporary folder."""
    counts = Counter("FAIL" if outcome.startswith("FAIL") else outcome for _, outcome in results)
    failures = [(path, outcome) for path, outcome in results if outcome.startswith("FAIL")]
    rows = [f"{command} / {kind}: {len(results)} cases"] + [f"  {o:>5} {counts[o]:4d}" for o in (*ALLOWED, "FAIL")]
    print("\n".join(rows + [f"  FAIL {path}: {outcome}" for path, outcome in failures]))
    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    (root / f"sweep-{command}-{kind}.json").write_text(json.dumps({"counts": counts, "cases": results}))
    assert sum(counts.values()) == len(results) > 0
    assert not failures, "\n".join(rows + [f"{path}: {outcome}" for path, outcome in failures])


@pytest.mark.parametrize("kind", RUN_DAMAGES)
def test_a_damaged_run_folder_resumes_exactly_or_stops_with_one_line(built, kind, tmp_path, tmp_path_factory,
                                                                      run_cli):
    reference = weights_digest(built / "straight" / "final")
    results = []
    for i, name in enumerate(run_targets(built / "run", kind)):
        run, user = tmp_path / f"run{i}", tmp_path / f"user{i}"
        shutil.copytree(built / "run", run, symlinks=True)
        user.mkdir()
        paths = sorted((run / name[:-1]).iterdir()) if name.endswith("/*") else [run / name.rstrip("/")]
        if [damage(path, kind, user) for path in paths].count(True):
            before = snapshot(user)
            proc = run_cli("train", *data_flags(built), f"--output_dir={run}", f"--max_steps={MORE_STEPS}", *RUN,
                           "--is_keep_training=True")
            outcome = resume_outcome(proc, run, reference)
            results.append((name, "FAIL a file outside the run folder changed" if snapshot(user) != before
                            else outcome))
        shutil.rmtree(run, ignore_errors=True)
    report(tmp_path_factory, "resume", kind, results)


def model_cases(run_cli, root: Path, source: Path, expected: tuple, kind: str, where: Path) -> list:
    """Each file of the model folder ``source`` damaged as ``kind`` in a copy under ``where``, then read by
    ``expected``'s command, whose undamaged result is ``expected``'s second item (its third, if any: the only files
    to damage): (file, outcome) each."""
    command, reference, *only = expected
    results = []
    for i, name in enumerate(entries(source)):
        if only and name not in only[0]:
            continue
        model, user, out = where / f"model{i}", where / f"user{i}", where / f"out{i}"
        shutil.copytree(source, model)
        user.mkdir()
        if not name.endswith("/") and damage(model / name, kind, user):
            before = snapshot(model), snapshot(user)
            proc = run_model_command(run_cli, command, root, model, out)
            own_model = kind == "flip" or (kind == "json_values" and name != "config.json")  # (config: its weights)
            outcome = model_outcome(command, proc, out, model, reference, own_model)
            if kind == "escape" and outcome == "a":
                outcome = "FAIL exit 0 reading weights an index names outside the model folder"
            if (snapshot(model), snapshot(user)) != before:
                outcome = "FAIL the model folder (or a file a link in it leads to) changed"
            results.append((name, outcome))
        for folder in (model, out, user):  # (~190 copies of a run and a model: 5 GB left in the temporary folder)
            shutil.rmtree(folder, ignore_errors=True)
    return results


@pytest.mark.parametrize("command, kind", [(c, k) for c, kinds in MODEL_DAMAGES.items() for k in kinds])
def test_a_damaged_model_folder_works_as_before_or_stops_with_one_line(built, command, kind, tmp_path,
                                                                        tmp_path_factory, run_cli):
    reference = json.loads((built / "reference.json").read_text())[command]
    results = model_cases(run_cli, built, built / "run" / "final", (command, reference), kind, tmp_path)
    report(tmp_path_factory, command, kind, results)


# Weights in the hub's other layouts: a legacy pytorch_model.bin (t5-v1_1's, with spiece.model alone) and shards
# with their index; the files an export does not hold
LAYOUT_DAMAGES = {("bin", "sft"): ("truncate", "zero", "pickle"),
                  ("bin", "evaluate"): ("zero", "swap", "pickle"),
                  ("sharded", "sft"): ("truncate", "swap", "escape"),
                  ("sharded", "evaluate"): ("zero", "flip", "escape")}


@pytest.mark.parametrize("layout, command", LAYOUT_DAMAGES)
def test_damaged_weights_in_other_layouts_work_as_before_or_stop_with_one_line(built, family_models, layout, command,
                                                                               tmp_path, tmp_path_factory, run_cli):
    source = family_models["v1_1"] if layout == "bin" else built / "sharded"
    done = run_model_command(run_cli, command, built, source, tmp_path / "reference")
    assert done.returncode == 0, done.stderr[-2000:]
    others = set(entries(source)) - set(entries(built / "run" / "final"))  # (the rest are the other test's)
    expected = (command, result_of(command, done, tmp_path / "reference", source), others)
    results = []
    for kind in LAYOUT_DAMAGES[layout, command]:
        results += [(f"{name} ({kind})", outcome)
                    for name, outcome in model_cases(run_cli, built, source, expected, kind, tmp_path / kind)]
    report(tmp_path_factory, command, layout, results)
