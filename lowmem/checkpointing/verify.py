"""Whether a checkpoint folder can be resumed from, and if not, what is wrong with it, in words.

Three levels, each only when the one before passed: the sizes its manifest lists (what an interrupted write
leaves: cheap, every look); every file's checksum and the values of its JSON state (``contents``: one read of
each file, ``checksums``); the values of its torch state files (``states``: read with torch, so only where
torch is imported already). Manifests of earlier versions list sizes only: their checksums are not checked.

A folder's result is kept for the process, keyed by its files' sizes and modification times: a start looks
twice (the command line's early look, then the trainer's, ``lowmem.runs.run_start``) and reads the
files once, and a folder found damaged stays known as damaged when ``checkpoint.prune`` looks at sizes only.
"""

from __future__ import annotations

import json
import re
from pathlib import Path, PurePosixPath

from lowmem.checkpointing import checksums, state_values

MANIFEST = "manifest.json"
SIZES, CONTENTS, STATES = 0, 1, 2
_VERIFIED: dict[tuple, tuple[int, str | None]] = {}  # fingerprint -> (level checked, problem found)


def read_manifest(folder: Path) -> dict | str:
    """``folder``'s manifest, or what is wrong with it."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return "no manifest (write did not finish)"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return "unreadable manifest"
    if not isinstance(files, dict) or not all(state_values.is_count(size) for size in files.values()):
        return "unreadable manifest (its file list is not names and sizes)"
    outside = [n for n in files if PurePosixPath(n).is_absolute() or ".." in PurePosixPath(n).parts]
    if outside:
        return f"manifest names a file outside its folder ({outside[0]})"
    sums = manifest.get("checksums")
    if sums is not None and (not isinstance(sums, dict) or set(sums) != set(files)
                             or manifest.get("checksum") not in checksums.ALGORITHMS):
        return "unreadable manifest (its checksums do not cover its files, or name an unknown checksum)"
    return manifest


def validate(folder: Path, contents: bool = True, load=None) -> str | None:
    """Why ``folder`` is not a usable checkpoint, or None when it is.

    Args:
        contents: check checksums and JSON state values too (else sizes only, and damage found before).
        load: ``checkpoint.load_state``: the torch state files are read with it and their values checked too.
    """
    folder = Path(folder)
    manifest = read_manifest(folder)
    if isinstance(manifest, str):
        return manifest
    for name, size in manifest["files"].items():
        path = folder / name
        if not path.is_file():
            return f"missing {name}"
        if path.stat().st_size != size:
            return f"truncated {name}" if path.stat().st_size < size else f"{name} is larger than written"
    key = _fingerprint(folder, manifest["files"])
    done, problem = _VERIFIED.get(key, (SIZES, None))
    wanted = STATES if load is not None else CONTENTS if contents else SIZES
    if problem is not None or done >= wanted:
        return problem
    if done < CONTENTS:
        problem = _contents_problem(folder, manifest)
    if problem is None and wanted == STATES:
        problem = _states_problem(folder, manifest["files"], load)
    _VERIFIED[key] = (wanted, problem)
    return problem


def _fingerprint(folder: Path, files: dict) -> tuple:
    """The folder and each file's size and modification time: any write since changes it."""
    stats = [(name, (folder / name).stat()) for name in (MANIFEST, *sorted(files))]
    return (str(folder.resolve()), *((name, st.st_size, st.st_mtime_ns) for name, st in stats))


def _contents_problem(folder: Path, manifest: dict) -> str | None:
    sums = manifest.get("checksums")
    for name in sorted(sums or ()):
        if checksums.digest_file(folder / name, manifest["checksum"]) != sums[name]:
            return f"checksum mismatch in {name}"
    for name, check in (("trainer_state.json", lambda v: state_values.trainer_state_problem(v, step_of(folder))),
                        ("run_config.json", state_values.run_config_problem)):
        if name in manifest["files"]:
            try:
                value = json.loads((folder / name).read_text(encoding="utf-8"))
            except (OSError, ValueError) as err:
                return f"{name} is not readable JSON ({type(err).__name__})"
            problem = check(value)
            if problem:
                return problem
    return None


def _states_problem(folder: Path, files: dict, load) -> str | None:
    """What is wrong with the values of the torch state files (each process's, the scheduler's), or None."""
    from lowmem.utils.errors import UserError

    for name in sorted(files):
        is_process = re.fullmatch(r"process_\d+\.pt", name) is not None
        if not is_process and name != "scheduler.pt":
            continue
        try:
            value = load(folder / name)
        except UserError as err:
            return str(err)
        problem = (state_values.process_state_problem(value, name) if is_process
                   else state_values.scheduler_state_problem(value))
        if problem:
            return problem
    return None


def step_of(folder: Path) -> int:
    """The step a ``step_NNNNNN`` folder holds (-1 for a folder named otherwise: no step is below 0)."""
    found = re.fullmatch(r"step_([0-9]+)", Path(folder).name)
    return int(found[1]) if found else -1
