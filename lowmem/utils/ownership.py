"""Which folders the commands may write into: new ones, empty ones, and their own.

Every folder a command writes is claimed first. A folder that does not exist or is empty is
created and marked with a marker file; one that holds its marker (or, written by an earlier
version, files only this program writes) is ours and is reused; anything else is refused with one
line naming the flag, before any file in it is created, changed or removed. Removing (a stale
staging folder, an old encoder cache) goes through ``remove_ours``, which removes only a folder
that passes the same test.

    --output_dir     .t5-lowmem-run; from earlier versions, a run's config.json beside metrics.jsonl, or
                     their .started (empty, or this marker text) among nothing but what a run writes
    --tokenizer_dir  .t5-lowmem-tokenizer
    --prepared_dir   .t5-lowmem-prepared
    --plot_dir       .t5-lowmem-plots, or the chart PNGs alone in a run folder's plots/
    encoder cache    .t5-lowmem-encoder-cache, or cache files alone (OUTPUT_DIR/encoder_cache/...)
    reference cache  .t5-lowmem-reference (OUTPUT_DIR/reference/...: --reference=cached)

A marker is a small file named for its kind; its existence is what counts, and it is created
before anything else in the folder (exclusively, O_EXCL): processes claiming one folder at once each
see it new, empty or marked.

A folder of ours is a closed room (``check_closed``): none of its own entries (``OWN_ENTRIES``: a run's best/,
final/, checkpoints/ and what it holds, metrics.jsonl, ...) may be a symbolic link, since reading, writing, moving
or removing one would reach what it leads to. A link there is refused in one line, its target untouched; the
user's own entries, under other names, may be links and are never touched. Files are opened without following
a link (``open_own``) and replaced by a rename (``write_atomic``), which replaces a link, not its target.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from itertools import islice
from pathlib import Path

from lowmem.utils.errors import UserError

STARTED_MARKER = ".t5-lowmem-run"  # left in an output folder as soon as a run begins there

MARKERS = {"run": STARTED_MARKER, "tokenizer": ".t5-lowmem-tokenizer", "prepared": ".t5-lowmem-prepared",
           "plots": ".t5-lowmem-plots", "encoder_cache": ".t5-lowmem-encoder-cache",
           "reference": ".t5-lowmem-reference"}
KIND_NAMES = {"run": "training run", "tokenizer": "tokenizer", "prepared": "prepared-data", "plots": "plots",
              "encoder_cache": "encoder-cache", "reference": "reference-cache"}
MARKER_TEXT = "written by t5-lowmem: this folder is its own, and its next run may replace the files it wrote here\n"
SHOWN = 3  # entries named in a refusal

Recogniser = Callable[[Path], bool]


def is_ours(path: str | Path, kind: str, recognise: Recogniser | None = None) -> bool:
    """Whether ``path`` is a folder of ``kind`` we wrote: its marker, or what ``recognise`` knows
    (folders of earlier versions, which wrote no marker)."""
    path = Path(path)
    return path.is_dir() and ((path / MARKERS[kind]).is_file() or (recognise is not None and recognise(path)))


def check_folder(path: str | Path, flag: str, kind: str, recognise: Recogniser | None = None,
                 hint: str = "choose a new or empty folder") -> Path:
    """Refuse ``path`` unless it is new, empty or ours (``is_ours``); touches nothing.

    Args:
        flag: how the user named the folder (``--tokenizer_dir``), shown as ``flag=path``; a label
            that is not a flag (``the encoder cache folder``) is shown before the path.
        hint: what to change, the end of the refusal.

    Raises:
        UserError: a file, an unreadable folder, or a folder of someone else's files.
    """
    path = Path(path)
    where = f"{flag}={path}" if flag.startswith("--") else f"{flag} {path}"
    if path.exists() and not path.is_dir():
        raise UserError(f"{where} is a file, not a folder; {hint}")
    if not path.is_dir() or is_ours(path, kind, recognise):
        return path
    try:
        with os.scandir(path) as entries:
            names = sorted(e.name + ("/" if e.is_dir() else "") for e in islice(entries, SHOWN + 1))
    except OSError as err:
        raise UserError(f"{where} cannot be read ({err.strerror}); {hint}") from None
    # Another process of the same launch may have marked it between the first look and the listing
    # (it claimed the folder new or empty): then it is ours.
    if not names or is_ours(path, kind, recognise):
        return path
    other = ours_as(path, kind)
    if other:
        raise UserError(f"{where} is {other}, not a {KIND_NAMES[kind]} folder (each command writes only into a "
                        f"new or empty folder or one of its own kind): {hint}")
    listed = ", ".join(names[:SHOWN]) + (", ..." if len(names) > SHOWN else "")
    raise UserError(f"{where} holds files t5-lowmem did not write ({listed}), and it writes only into a new or "
                    f"empty folder or one of its own: {hint}")


def ours_as(path: Path, kind: str) -> str | None:
    """What folder of ours ``path`` is, when not one of ``kind``: another kind's (its marker, or a run folder of
    an earlier version), or one inside a run folder (its checkpoints/, an export); so a refusal names it instead
    of calling our own files someone else's."""
    for other, marker in MARKERS.items():
        if other != kind and (path / marker).is_file():
            return f"a t5-lowmem {KIND_NAMES[other]} folder"
    if kind != "run" and is_run_folder(path):
        return f"a t5-lowmem {KIND_NAMES['run']} folder"
    if RUN_ENTRIES.fullmatch(path.name) and RUN_ENTRY_KINDS.get(path.name) != kind \
            and is_ours(path.parent, "run", is_run_folder):
        return f"the {path.name}/ of the t5-lowmem {KIND_NAMES['run']} folder {path.parent}"
    return None


def claim_folder(path: str | Path, flag: str, kind: str, recognise: Recogniser | None = None,
                 hint: str = "choose a new or empty folder") -> Path:
    """``check_folder``, then create the folder (and its parents) and leave its marker.

    Raises:
        UserError: as ``check_folder``, or the folder cannot be created or written.
    """
    path = check_folder(path, flag, kind, recognise, hint)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with open(path / MARKERS[kind], "x", encoding="utf-8") as marker:
            marker.write(MARKER_TEXT)
    except FileExistsError:
        pass  # marked already (by an earlier run, or by another process of this one)
    except OSError as err:
        where = f"{flag}={path}" if flag.startswith("--") else f"{flag} {path}"
        raise UserError(f"{where} is not writable ({err.strerror}); {hint}") from None
    return path


def remove_ours(path: str | Path, kind: str, recognise: Recogniser | None = None) -> bool:
    """Remove the folder ``path`` when it is ours (``is_ours``; a link is never followed).

    Returns:
        Whether it was removed.
    """
    path = Path(path)
    try:
        if path.is_symlink() or not is_ours(path, kind, recognise):
            return False
        shutil.rmtree(path)
    except FileNotFoundError:  # removed meanwhile by another process of the run
        return False
    return True


# a run's folders of a kind of their own
RUN_ENTRY_KINDS = {"plots": "plots", "encoder_cache": "encoder_cache", "reference": "reference"}
LEGACY_STARTED_MARKER = ".started"  # what versions before 2026-11-28 left instead (a name other tools use too)
# What a run writes in OUTPUT_DIR (staging folders and an export's set-aside copy included); the --report_to
# trackers add theirs as their classes are defined (``own_run_entries``)
RUN_ENTRIES = re.compile(r"config\.json|metrics\.jsonl|checkpoints|best|final|plots|encoder_cache|reference|\.lock|"
                         r"\.started|\.(old|tmp)-(best|final)|consumed-rank\d+\.tsv|\.?trackers\.json(\.tmp)?|"
                         r"\.?launchers\.json(\.tmp)?|\.write-test-\w+")  # (a probe: a process killed as it looked)


def is_run_folder(path: Path) -> bool:
    """A run folder an earlier version wrote without today's marker: a run's config.json (the flags: no
    model_type, which a saved model's config has) beside metrics.jsonl, or their marker ``.started``.

    ``.started`` is a name other tools use too: it vouches for the folder only when it is empty or holds
    our marker text, and everything beside it is a name a run writes.
    """
    config = saved_json(path / "config.json")
    if config and "model_preset" in config and not config.get("model_type") and (path / "metrics.jsonl").is_file():
        return True
    try:
        with open_own(path / LEGACY_STARTED_MARKER, "rb") as handle:
            text = handle.read(len(MARKER_TEXT) + 1)
        names = os.listdir(path)
    except (OSError, UserError):  # no marker, a link in its place, or an unreadable folder
        return False
    return text in (b"", MARKER_TEXT.encode()) and all(RUN_ENTRIES.fullmatch(name) for name in names)


# What each kind of folder holds of its own besides its marker (a run: in OUTPUT_DIR; a tokenizer: what save_pretrained
# writes; prepared data: shards and manifest; plots: the charts), with the staging folder each writes in first
OWN_ENTRIES = {"run": RUN_ENTRIES,
               "tokenizer": re.compile(r"\.saving|tokenizer\.json|spiece\.model|tokenizer_config\.json|"
                                       r"special_tokens_map\.json|added_tokens\.json"),
               "prepared": re.compile(r"\.partial|shard-\d+\.parquet|prepared\.manifest"),
               "plots": re.compile(r"\.?[\w-]+\.png(\.tmp)?")}
# Which of those are folders (the rest are files): an entry of the other kind in its place is no entry of ours
OWN_FOLDERS = {"run": re.compile(r"checkpoints|best|final|plots|encoder_cache|reference|\.(old|tmp)-(best|final)"),
               "tokenizer": re.compile(r"\.saving"), "prepared": re.compile(r"\.partial"), "plots": re.compile(r"(?!)")}
# What a run writes in OUTPUT_DIR/checkpoints: step folders (staged and set aside too), the latest pointer (and its
# temporary), the continuations a --resume_from set aside
CHECKPOINT_ENTRIES = re.compile(r"(\.(tmp|old)-)?step_\d+|latest|\.latest\.tmp|abandoned-[\d-]+")
CHECKPOINT_FOLDERS = re.compile(r"(\.(tmp|old)-)?step_\d+|abandoned-[\d-]+")


def own_run_entries(files: tuple[str, ...], folders: tuple[str, ...]) -> None:
    """Count ``files`` and ``folders`` (names in OUTPUT_DIR) among a run's own entries: what a kind defined above
    this floor writes there (each ``--report_to`` tracker, ``lowmem.monitoring.trackers``, as its class is defined)."""
    global RUN_ENTRIES
    if files or folders:
        RUN_ENTRIES = OWN_ENTRIES["run"] = re.compile("|".join([RUN_ENTRIES.pattern, *map(re.escape, files + folders)]))
    if folders:
        OWN_FOLDERS["run"] = re.compile("|".join([OWN_FOLDERS["run"].pattern, *map(re.escape, folders)]))


def refuse_link(path: Path, flag: str = "--output_dir", kind: str = "run") -> None:
    """Refuse ``path``, one of the folder's own entries, when it is a symbolic link: a command reads, writes, moves
    and removes its own files and folders, and through a link it would do so to what the link leads to (the
    closed room: nothing of ours is a link). Touches nothing.

    Raises:
        UserError: ``path`` is a symbolic link, named with where it leads.
    """
    if not Path(path).is_symlink():
        return
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    raise UserError(f"{path} is a symbolic link to {target}: a {KIND_NAMES[kind]} folder's own files and folders "
                    f"must be real ones, never links; remove the link (its target is untouched) or use another {flag}")


def refuse_misplaced(path: Path, is_folder: bool, flag: str = "--output_dir", kind: str = "run") -> None:
    """Refuse ``path``, one of the folder's own entries, when it is a folder where a file of ours belongs or the
    other way round (put there by hand, or by another program): reading or replacing it would fail half-way, and
    what is there is not ours to remove. Touches nothing.

    Raises:
        UserError: what is there, and what to do.
    """
    path = Path(path)
    if not path.exists() or path.is_dir() == is_folder:
        return
    found, wanted = ("a file", "a folder") if is_folder else ("a folder", "a file")
    raise UserError(f"{path} is {found} where a {KIND_NAMES[kind]} folder keeps {wanted} of its own; move it out of "
                    f"the way (t5-lowmem removes nothing it did not write) or use another {flag}")


def refuse_links_in(folder: Path, own: re.Pattern, flag: str, kind: str, folders: re.Pattern | None = None) -> None:
    """``refuse_link`` for each entry of ``folder`` named as ``own`` (the user's entries, named otherwise, may be
    links: they are never touched), and with ``folders`` (the names of those that are folders) ``refuse_misplaced``
    too. A folder that is missing, a link or unreadable has none to look at."""
    folder = Path(folder)
    if folder.is_symlink() or not folder.is_dir():
        return
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return
    for name in names:
        if own.fullmatch(name):
            refuse_link(folder / name, flag, kind)
            if folders is not None:
                refuse_misplaced(folder / name, folders.fullmatch(name) is not None, flag, kind)


def check_closed(folder: str | Path, flag: str = "--output_dir", kind: str = "run") -> None:
    """The closed room: refuse a folder of ``kind`` where one of its own entries (``OWN_ENTRIES``, its marker, and
    for a run what it writes in checkpoints/: ``CHECKPOINT_ENTRIES``) is a symbolic link, since reading, writing,
    moving or removing it would reach what the link leads to, or a file where a folder of ours belongs (or a folder
    where a file does), which no command could use or replace. Run before anything is read or written there (the
    command line's early checks, the trainer's own), and again by what replaces, moves or removes them.

    Raises:
        UserError: the first such link, with what to do.
    """
    folder = Path(folder)
    own = re.compile(f"{OWN_ENTRIES[kind].pattern}|{re.escape(MARKERS[kind])}")
    refuse_links_in(folder, own, flag, kind, OWN_FOLDERS[kind])
    if kind == "run":
        refuse_links_in(folder / "checkpoints", CHECKPOINT_ENTRIES, flag, kind, CHECKPOINT_FOLDERS)


def move_in(staging: Path, names: list[str], folder: Path) -> None:
    """Move the files ``names`` from ``staging`` into ``folder``, in that order (what makes the set complete
    last), each on disk before any moves and the folder's entries on disk after: a power cut leaves whole
    files under each name, never an empty one beside a manifest that vouches for it."""
    for name in names:
        fsync_path(staging / name)
    for name in names:
        os.replace(staging / name, folder / name)
    fsync_path(folder)


OPEN_FLAGS = {"w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "wb": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
              "ab": os.O_WRONLY | os.O_CREAT | os.O_APPEND, "a+": os.O_RDWR | os.O_CREAT | os.O_APPEND,
              "rb": os.O_RDONLY}


def open_own(path: Path, mode: str, encoding: str | None = None):
    """``open(path, mode)`` for a file of ours in a folder of ours, never through a symbolic link: a link
    found under the name (one a user put there, to a file of theirs) is refused, its target untouched.
    Files replaced by a rename need no such care: the rename replaces the link, not its target.

    Raises:
        UserError: ``path`` is a symbolic link.
    """
    try:
        fd = os.open(path, OPEN_FLAGS[mode] | getattr(os, "O_NOFOLLOW", 0), 0o666)
    except OSError as err:
        if not Path(path).is_symlink():
            raise
        raise UserError(f"{path} is a symbolic link, and t5-lowmem writes its own files, never through a link: "
                        "remove the link (what it points to stays as it is)") from err
    return os.fdopen(fd, mode, encoding=encoding)


def write_atomic(path: Path, content: str | bytes) -> None:
    """Replace ``path`` with ``content`` so readers see the old file or the new one whole, never a part: a failed
    write (a full disk) leaves the old file as it was, and its temporary is removed."""
    tmp = path.with_name(f".{path.name}.tmp")
    binary = isinstance(content, bytes)
    try:
        with open_own(tmp, "wb" if binary else "w", encoding=None if binary else "utf-8") as fh:
            fh.write(content)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if not tmp.is_symlink():
            tmp.unlink(missing_ok=True)  # ours: made just now under a name only we write
        raise
    fsync_path(path.parent)


def fsync_path(path: Path) -> None:
    """Put a file's content, or a folder's entries, on disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def saved_json(path: Path) -> dict | None:
    """The JSON object stored in ``path``; None when it is missing, unreadable or not an object."""
    try:
        saved = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return saved if isinstance(saved, dict) else None
