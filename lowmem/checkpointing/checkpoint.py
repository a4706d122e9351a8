"""Crash-safe checkpoint folders.

A checkpoint is written into a temporary sibling folder, every file is fsynced, a ``manifest.json``
listing the files and their sizes is written last, and the folder is renamed into place; the
``latest`` pointer is then replaced atomically. A folder whose manifest is missing or whose files do
not match it is skipped on resume in favour of the previous one.
"""

from __future__ import annotations

import errno
import json
import random
import re
import shutil
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from lowmem.checkpointing import checksums, verify
from lowmem.utils.errors import UserError
from lowmem.utils.ownership import CHECKPOINT_ENTRIES, fsync_path, refuse_link, refuse_links_in, write_atomic

# torch is imported where tensors are read or drawn: the folder checks (validate, find_latest_valid) run
# before the command line imports it (lowmem/runs/run_start.py)

MANIFEST = verify.MANIFEST
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)
# Write failures the user can fix: (errnos, what happened, what to do). Rust libraries (safetensors,
# tokenizers) raise their own exceptions, naming the errno as "(os error N)".
WRITE_FAILURES = ((DISK_FULL, "no space left on the device", "free space"),
                  ((errno.EFBIG,), "a file grew past the size limit (ulimit -f, or the file system's largest file)",
                   "raise the limit or write to another file system"),
                  (NOT_WRITABLE, "the folder cannot be written (permission denied, or read-only)",
                   "make it writable"))
CONTINUE = "continue with --is_keep_training=True"
LATEST = "latest"
PREFIX = "step_"


def staging_path(final: Path) -> Path:
    """The folder ``final`` is written in before it is renamed into place."""
    return Path(final).with_name(f".tmp-{Path(final).name}")


def new_staging(final: Path) -> Path:
    """An empty staging folder for ``final`` (what a stopped write left there removed: it is ours)."""
    final = Path(final)
    refuse_swap_links(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = staging_path(final)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def restore_cut_swap(final: Path) -> Path:
    """Put back the previous ``final`` that a swap cut between its two renames left at ``.old-<name>``
    (a SIGKILL, or a second Ctrl-C, between them); returns that aside path.

    Raises:
        UserError: ``final``, its staging or its aside name is a symbolic link (``refuse_swap_links``).
    """
    refuse_swap_links(final)
    old = final.with_name(f".old-{final.name}")
    if old.is_dir() and not final.exists():
        old.rename(final)
    return old


def refuse_swap_links(final: Path) -> None:
    """The closed room (``ownership.check_closed``) where a folder is replaced: the swap renames, fills and removes
    ``final``, its staging folder and its aside name, so none may be a link (through one it would move the user's
    files into the run's folder, or remove them)."""
    final = Path(final)
    for path in (final, staging_path(final), final.with_name(f".old-{final.name}")):
        refuse_link(path)


@contextmanager
def atomic_folder(final: Path, staged: bool = False, then=None, sums: dict | None = None):
    """Yield a temporary folder; on success make it ``final`` in one rename (replacing an old one).
    ``staged``: other processes have written their parts into ``new_staging(final)`` already. ``sums``: a
    checkpoint's, filled by its writers (``checksums``) within the block: the manifest then holds every file's
    checksum too (a file not in it is read once for it); None (exports): sizes only.

    On an exception the temporary folder is removed and ``final`` is left as it was; a write the user can
    make possible (``WRITE_FAILURES``) becomes a ``UserError`` saying what to do, then what ``then()`` says
    (default: ``CONTINUE``).
    """
    final = Path(final)
    old = restore_cut_swap(final)
    tmp = staging_path(final)
    try:
        if not staged:
            new_staging(final)  # inside: a folder made unwritable mid-run fails here first
        yield tmp
        files = {}
        for f in sorted(tmp.rglob("*")):
            if f.is_file():
                fsync_path(f)
                files[str(f.relative_to(tmp))] = f.stat().st_size
        manifest = {"files": files} if sums is None else checksums.record(tmp, sums)
        write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1))
        if final.exists():
            if old.is_dir():  # a swap cut after its renames: the user's files there go into the export first
                carry_foreign(old, final)
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            carry_foreign(old, final)  # the user's files move only once the new export is in place
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        fsync_path(final.parent)
    except BaseException as exc:
        failure = write_failure(exc, tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        restore_cut_swap(final)  # interrupted between the two renames (a second Ctrl-C): the previous one back
        if failure:
            raise UserError(f"{failure[0]} while writing {final}; it was not written and what was there before is "
                            f"intact: {failure[1]}, then {then() if then else CONTINUE}") from exc
        raise


def manifest_files(folder: Path) -> dict | None:
    """The files (path: size) ``folder``'s manifest lists; None without a readable manifest."""
    try:
        return json.loads((folder / MANIFEST).read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def foreign_entries(folder: Path) -> list[Path]:
    """The entries of a folder of ours with a manifest that we did not write there (a model card a user put in
    best/): neither in its manifest nor the manifest itself. None without a manifest (nothing to tell them by)."""
    listed = manifest_files(folder)
    if listed is None:
        return []
    ours = {MANIFEST, *(Path(name).parts[0] for name in listed)}
    return [entry for entry in sorted(folder.iterdir()) if entry.name not in ours]


def carry_foreign(old: Path, new: Path) -> None:
    """Move the user's entries of ``old`` into ``new`` (which replaces it), under their names, or beside ours
    with ``.yours`` added where a new file of ours took the name: a folder we replace never takes them along."""
    for entry in foreign_entries(old):
        target = new / entry.name
        while target.exists() or target.is_symlink():
            target = target.with_name(target.name + ".yours")
        entry.rename(target)


def only_foreign(folder: Path) -> bool:
    """Whether ``folder`` is an export a start-over emptied of ours (``remove_ours_in``): what is left is the
    user's, so it is no model of the run's and nothing a later start-over would remove."""
    return manifest_files(folder) == {}


def remove_ours_in(folder: Path) -> None:
    """Remove ``folder`` (starting a run over), or where the user put entries of their own in it only what we
    wrote there, the folder and their entries left.

    Raises:
        UserError: ``folder`` is a symbolic link (what it leads to is not the run's to remove).
    """
    refuse_link(folder)
    foreign = foreign_entries(folder)
    if not foreign:
        shutil.rmtree(folder)
        return
    for entry in list(folder.iterdir()):  # (listed before any is removed)
        if entry not in foreign:
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    write_atomic(folder / MANIFEST, json.dumps({"files": {}}))  # what is left is theirs: the next export keeps it


def write_failure(exc: BaseException, folder: Path | None) -> tuple[str, str] | None:
    """(what happened, what to do) when a write failed in a way the user can fix, else None.

    ``folder``: the one being written (``atomic_folder``'s), where a permission error counts on a path in it
    (not on a file read into it) or from a Rust library (which writes there and names no path), and a failure
    without an errno counts when its disk is full. None (anywhere else): errnos alone, permissions never."""
    if isinstance(exc, OSError):
        code, ours = exc.errno, folder is not None and str(exc.filename or "").startswith(str(folder))
    else:
        found = re.search(r"\(os error (\d+)\)", str(exc))
        code, ours = (int(found[1]) if found else None), folder is not None
    for codes, what, fix in WRITE_FAILURES:
        if code in codes and (ours or codes is not NOT_WRITABLE):
            return what, fix
    return WRITE_FAILURES[0][1:] if folder is not None and disk_full(exc, folder) else None


def disk_full(exc: BaseException, path: Path) -> bool:
    """Whether a failed write without an errno (``write_failure`` reads those) ran out of space. torch.save
    reports a full disk as a RuntimeError without one, so the free space is checked too (before the partial
    files are removed)."""
    if "No space left" in str(exc):
        return True
    try:
        return isinstance(exc, (OSError, RuntimeError)) and shutil.disk_usage(path).free < 4 * 2**20
    except OSError:
        return False


def validate(folder: Path, contents: bool = True, states: bool = False) -> str | None:
    """Why ``folder`` is not a usable checkpoint, or None when it is (``verify.validate``): the sizes its manifest
    lists; with ``contents`` each file's checksum and the JSON state's values; with ``states`` the values of its
    torch state files too (read with torch). Each folder is read once per process."""
    return verify.validate(folder, contents, load_state if states else None)


# Earlier versions pickled numpy's RNG key as a uint32 array in process_*.pt: rebuilding one takes these
# (under either module name numpy has used); an array of objects still needs a type no list here holds.
_RECONSTRUCT = np.zeros(0).__reduce__()[0]  # numpy._core.multiarray._reconstruct (numpy.core before numpy 2)
OLD_NUMPY_STATE = [(_RECONSTRUCT, "numpy._core.multiarray._reconstruct"),
                   (_RECONSTRUCT, "numpy.core.multiarray._reconstruct"), np.ndarray, np.dtype,
                   type(np.dtype(np.uint32))]


def load_state(path: Path, allowed: list | None = None):
    """The tensors and plain values (dicts, lists, tuples, numbers, strings) of a checkpoint file, and
    instances of the ``allowed`` classes (records of plain values another library writes).

    torch's ``weights_only`` unpickler builds nothing else: an object of any other type (a pickled
    callable, ``os.system`` in ``__reduce__``) would run its code as it is unpickled, so a file
    holding one is refused before anything of it is built.

    Raises:
        UserError: the file holds other objects, or is not a torch file torch can read (damaged).
    """
    import pickle
    import re

    import torch

    try:
        with torch.serialization.safe_globals(OLD_NUMPY_STATE + list(allowed or [])):
            return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL ([\w.]+)|got <class '([\w.]+)'>", str(err))
        if found is None:  # no object refused: bytes that are no pickle (a file cut or overwritten)
            raise _unreadable(path, err) from None
        what = found.group(1) or found.group(2)
        raise UserError(f"checkpoint file {path} holds objects other than tensors and plain values ({what}), which "
                        "t5-lowmem never writes; it was not loaded, since building them could run any code. Resume "
                        "only from checkpoints t5-lowmem wrote, or start over with --overwrite_output_dir=True "
                        "(or another --output_dir)") from None
    except (RuntimeError, EOFError, ValueError, OSError) as err:  # a cut or damaged zip, bytes that are no torch file
        raise _unreadable(path, err) from None


def _unreadable(path: Path, err: Exception) -> UserError:
    reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
    return UserError(f"checkpoint file {path} cannot be read ({reason}): it is damaged; resume from an earlier "
                     "checkpoint (--resume_from), or start over with --overwrite_output_dir=True")


def step_folders(root: Path) -> list[Path]:
    """Checkpoint folders under ``root``, newest step first. A folder named otherwise (``step_000004.bak``,
    a user's copy) is not one of them: never read, pruned or resumed from."""
    if not Path(root).is_dir():
        return []
    found = [p for p in Path(root).iterdir() if p.is_dir() and is_step_name(p.name)]
    return sorted(found, key=step_number, reverse=True)


def is_step_name(name: str) -> bool:
    """Whether ``name`` is a checkpoint folder's (``step_NNNNNN``)."""
    return re.fullmatch(PREFIX + "[0-9]+", name) is not None


def step_number(folder: Path) -> int:
    """The optimizer step a checkpoint folder (``step_NNNNNN``) holds."""
    return int(Path(folder).name[len(PREFIX):])


def find_latest_valid(root: Path, warn=print, contents: bool = True, states: bool = False) -> Path | None:
    """The newest complete checkpoint; incomplete or damaged ones are skipped with a warning (``validate``
    checks ``contents`` and ``states``: sizes only without them).

    A folder is renamed into place only once complete, so the newest valid one is at least as new
    as the one ``latest`` names (which lags when a run is killed between the rename and the pointer).
    """
    for folder in step_folders(root):
        problem = validate(folder, contents, states)
        if problem is None:
            return folder
        warn(f"warning: skipping checkpoint {folder}: {problem}")
    return None


def prune(root: Path, keep: int, protect: Path | None = None) -> None:
    """Delete all but the ``keep`` newest complete checkpoints (never ``protect``), and the damaged ones
    older than those (a resume warned of each): damaged ones do not count, so the run keeps ``keep`` it can
    resume from.

    Raises:
        UserError: checkpoints/, a checkpoint or ``latest`` is a symbolic link: what it leads to is not the run's
            to remove.
    """
    refuse_link(root)
    refuse_links_in(root, CHECKPOINT_ENTRIES, "--output_dir", "run")
    folders = step_folders(root)  # newest first
    # Sizes, and the damage a resume found (verify keeps it): reading every kept checkpoint's files again at each
    # save would cost more than the save
    complete = [f for f in folders if validate(f, contents=False) is None]
    oldest_kept = step_number(complete[keep - 1]) if 0 < keep <= len(complete) else -1
    for folder in complete[keep:] + [f for f in folders if f not in complete and step_number(f) < oldest_kept]:
        if protect is None or folder.resolve() != Path(protect).resolve():
            shutil.rmtree(folder, ignore_errors=True)


TRAINED_ONLY = "trained"  # the metadata "contents" of a checkpoint's model.safetensors holding trained tensors only


def save_trained(model, path: Path, sums: dict | None = None) -> None:
    """The model's weights into a checkpoint: where some are frozen, the trained ones only (LoRA's adapters,
    a decoder): the frozen rest is the base model's, read again from --init_from on resume (its fingerprint
    is in run_config.json), so a LoRA checkpoint of flan-t5-xl is megabytes, not 11 GB. Written as
    safetensors' ``save_model`` / ``save_file`` would, tensor by tensor, its checksum into ``sums[path.name]``
    (``checksums.save_safetensors``)."""
    from safetensors.torch import _remove_duplicate_names

    sums = {} if sums is None else sums
    if all(p.requires_grad for p in model.parameters()):
        # save_model's way: tied tensors stored once, each dropped name recorded beside the one kept
        weights, metadata = model.state_dict(), None
        for kept, dropped in _remove_duplicate_names(weights).items():
            for name in dropped:
                metadata = {**(metadata or {}), name: kept}
                del weights[name]
        checksums.save_safetensors(weights, path.parent, path.name, sums, metadata)
        return
    trained = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}
    checksums.save_safetensors(trained, path.parent, path.name, sums, {"format": "pt", "contents": TRAINED_ONLY})


def load_trained(model, path: Path) -> None:
    """Load what ``save_trained`` wrote into ``model`` (a checkpoint of the whole model too: earlier versions
    wrote those).

    Raises:
        UserError: the checkpoint's trained tensors are not this model's.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file, load_model

    from lowmem.model.quantize import own_aligned_bytes

    with safe_open(str(path), "pt") as f:
        contents = (f.metadata() or {}).get("contents")
    if contents != TRAINED_ONLY:
        load_model(model, str(path))
        own_aligned_bytes(model)
        return
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    saved = load_file(str(path))
    if set(saved) != set(params):
        odd = sorted(set(saved) ^ set(params))
        raise UserError(f"checkpoint {path.parent} holds other trained tensors than this run trains ({odd[0]}"
                        f"{f' and {len(odd) - 1} more' if len(odd) > 1 else ''}); resume with the --freeze and "
                        "LoRA flags the run began with, or use a new --output_dir")
    import torch

    with torch.no_grad():
        for name, value in saved.items():
            params[name].copy_(value)


def rng_state() -> dict:
    """Every RNG this process draws from (python, numpy, torch CPU, CUDA), as tensors and plain values
    (numpy's key as a list of ints, not an array), which ``load_state`` reads without unpickling objects."""
    import torch

    kind, key, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "numpy": (kind, key.tolist(), pos, has_gauss, gauss),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    import torch

    random.setstate(state["python"])
    kind, key, *rest = state["numpy"]  # a list of ints, or the array checkpoints of earlier versions hold
    np.random.set_state((kind, np.asarray(key, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
