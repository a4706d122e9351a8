"""Hugging Face ``datasets`` as a source of rows, for every objective: a folder written by ``save_to_disk``
(a ``Dataset``, or a ``DatasetDict`` whose ``train`` split is read), a dataset id on the hub, or a local copy
of a hub dataset repository (a folder whose README.md dataset card declares ``configs`` or ``dataset_info``).

    python train_low_mem.py train --train_file=my_saved_dataset                    # save_to_disk folder
    python train_low_mem.py train --is_finetune=True --train_file=BelleGroup/train_0.5M_CN \\
        --prompt_column=instruction --response_column=output
    python train_low_mem.py train --objective=span_corruption --train_file=allenai/c4 --dataset_config=en \\
        --max_steps=100000

Rows are always read through a ``datasets.IterableDataset``, never loaded whole: a saved dataset is
memory-mapped and turned into one (``to_iterable_dataset``); a hub id, or a local repository copy, goes
through ``load_dataset_builder(...).as_streaming_dataset(split)``, which is what ``load_dataset(...,
streaming=True)`` does (the hub's metadata through the Hugging Face cache, the rows streamed).

This module finds and opens a source and reads row ranges of it, as ``data.sources.readers.read_range`` does for
files (which hands a ``DatasetRef`` over to ``read_rows``): the eval set, the column check, and the
tokenizer's and the planner's samples read it that way. ``data.streams.dataset_stream.DatasetStream`` is the
training stream; ``process_share`` is how it splits the rows between processes. See
docs/datasets_sources.md.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from lowmem.utils.errors import UserError

SAVED_DATASET = ("state.json", "dataset_info.json")  # what save_to_disk writes beside its data-*.arrow files
SAVED_DICT = "dataset_dict.json"  # ... and for a DatasetDict, one such folder per split beside this file
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")  # name, or owner/name
# A missing path with one of these endings is a file that does not exist, never a hub id.
FILE_ENDINGS = (".jsonl", ".json", ".parquet", ".csv", ".txt", ".tsv", ".arrow", ".gz", ".zst", ".bz2", ".xz")
TRAIN_SPLITS = ("train",)
EVAL_SPLITS = ("validation", "test")  # an eval set taken from a dataset: its first split among these


@dataclass(frozen=True)
class DatasetRef:
    """A dataset named by ``--train_file`` / ``--eval_file``: what a file path is for the file readers.

    Attributes:
        spec: the folder or hub id as given.
        kind: ``saved`` (a save_to_disk ``Dataset``), ``saved_dict`` (a ``DatasetDict``) or ``hub`` (a hub
            id, or a local copy of a hub dataset repository, opened the same way).
        config: ``--dataset_config`` (hub datasets with several configurations).
        split: the split read; None: the training split (``train``, or the only one).
        flag: the flag that named it, for error lines.
    """

    spec: str
    kind: str
    config: str | None = None
    split: str | None = None
    flag: str = field(default="--train_file", compare=False)

    def __str__(self) -> str:
        return self.spec


def dataset_ref(spec: str, flag: str = "--train_file", config: str | None = None) -> DatasetRef | None:
    """The dataset ``spec`` names (one entry of a flag), or None when it names files."""
    path = Path(spec).expanduser()
    if path.is_dir():
        kind = folder_kind(path)
        return DatasetRef(spec, kind, config, flag=flag) if kind else None
    if path.exists() or spec.lower().endswith(FILE_ENDINGS) or not HUB_ID.fullmatch(spec):
        return None
    if path.suffix and path.parent != Path(".") and path.parent.is_dir():  # data/trans.cvs: a local file's typo,
        return None  # not a hub id (which the hub was asked for, retrying for half a minute)
    return DatasetRef(spec, "hub", config, flag=flag)


def folder_kind(folder: Path) -> str | None:
    """``saved`` / ``saved_dict`` for a save_to_disk folder, ``hub`` for a local copy of a hub dataset
    repository (its README.md opens with a dataset card that declares configs or dataset_info), else None."""
    if all((folder / name).is_file() for name in SAVED_DATASET):
        return "saved"
    if (folder / SAVED_DICT).is_file():
        return "saved_dict"
    readme = folder / "README.md"
    if readme.is_file():
        with open(readme, encoding="utf-8", errors="replace") as fh:
            head = fh.read(65536)
        card = head.split("\n---", 1)[0] if head.startswith("---") else ""
        if re.search(r"^(configs|dataset_info):", card, re.MULTILINE):
            return "hub"
    return None


def dataset_of(files: list) -> DatasetRef | None:
    """The dataset when ``files`` (what ``resolve_files`` gave) name one, else None."""
    return files[0] if len(files) == 1 and isinstance(files[0], DatasetRef) else None


# ------------------------------------------------------------------ opening
@functools.lru_cache(maxsize=8)
def _saved(spec: str):
    from datasets import load_from_disk

    try:
        return load_from_disk(str(Path(spec).expanduser()))  # memory-mapped Arrow files, not read into RAM
    except Exception as exc:  # damaged or foreign files
        state = Path(spec).expanduser() / SAVED_DATASET[0]
        if state.is_file() and '"_data_files": []' in state.read_text(encoding="utf-8", errors="replace"):
            raise UserError(f"the datasets folder {spec} is empty (save_to_disk wrote no rows)") from None
        raise UserError(f"cannot read the datasets folder {spec}: {type(exc).__name__}: {first_line(exc)}") from None


@functools.lru_cache(maxsize=8)
def _builder(spec: str, config: str | None, flag: str):
    """The dataset builder of a hub id or a local repository copy (metadata only: no row is read)."""
    from datasets import load_dataset_builder

    local = Path(spec).expanduser().is_dir()
    try:
        return load_dataset_builder(str(Path(spec).expanduser()) if local else spec, config)
    except ConnectionError as exc:  # offline (HF_HUB_OFFLINE=1) or no network
        raise UserError(f"{flag}={spec} is not a local path, and the hub cannot be reached for that dataset id "
                        f"({first_line(exc)}); it is streamed from the hub, so train where the hub is reachable, or "
                        "save it with save_to_disk where it is and pass that folder") from None
    except FileNotFoundError as exc:  # DatasetNotFoundError, data files missing
        where = "" if local else "is not a local path, and "
        raise UserError(f"{flag}={spec} {where}no such dataset was found ({first_line(exc)}); check the name, "
                        "or pass a file, a folder or a save_to_disk folder") from None
    except ValueError as exc:  # a configuration missing or unknown, data files it cannot read
        text = " ".join(str(exc).split("\n")[:2]).strip()
        hint = "; pass --dataset_config=NAME" if "config" in text.lower() else ""
        raise UserError(f"{flag}={spec}: {text}{hint}") from None


def first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0].rstrip(". ")


def split_rows(ref: DatasetRef) -> dict[str, int | None]:
    """The dataset's splits and their row counts (None where its metadata has none); one unnamed split
    (``""``) for a saved ``Dataset``."""
    if ref.kind == "saved":
        return {"": len(_saved(ref.spec))}
    if ref.kind == "saved_dict":
        return {name: len(part) for name, part in _saved(ref.spec).items()}
    builder = _builder(ref.spec, ref.config, ref.flag)
    if builder.info.splits:
        return {name: (info.num_examples or None) for name, info in builder.info.splits.items()}
    return {str(name): None for name in (builder.config.data_files or {})}


def split_name(ref: DatasetRef, prefer: tuple[str, ...] = TRAIN_SPLITS) -> str:
    """The split ``ref`` reads: its own, else the first of ``prefer`` the dataset has, else its only one.

    Raises:
        UserError: the dataset has several splits and none of ``prefer`` (the line names them).
    """
    if ref.split is not None or ref.kind == "saved":
        return ref.split or ""
    names = list(split_rows(ref))
    found = [name for name in prefer if name in names]
    if found or len(names) <= 1:
        return (found or names or ["train"])[0]
    folder = f", or pass one split's folder ({ref.spec}/NAME)" if ref.kind == "saved_dict" else ""
    raise UserError(f"{ref.flag}={ref.spec} has the splits {', '.join(names)} and none named "
                    f"{' or '.join(prefer)}: save the training rows as a 'train' split{folder}")


def with_split(ref: DatasetRef, prefer: tuple[str, ...]) -> DatasetRef:
    """``ref`` reading the first of the ``prefer`` splits it has (its only split when it has one)."""
    return replace(ref, split=split_name(ref, prefer))


def eval_split_name(ref: DatasetRef) -> str | None:
    """The split held apart for evaluation (``validation``, else ``test``) beside the training split, if any."""
    if ref.kind == "saved":
        return None
    train, names = split_name(ref), split_rows(ref)
    return next((name for name in EVAL_SPLITS if name in names and name != train), None)


def row_count(ref: DatasetRef) -> int | None:
    """Rows of the split ``ref`` reads; None when the dataset's metadata does not say."""
    return split_rows(ref).get(split_name(ref))


def describe(ref: DatasetRef) -> str:
    """How the log names a dataset: what it is, its configuration and split."""
    what = {"saved": "the datasets folder (save_to_disk)", "saved_dict": "the datasets folder (save_to_disk)",
            "hub": "the local dataset repository" if Path(ref.spec).expanduser().is_dir() else "the hub dataset"}
    split = split_name(ref)
    details = [f"config {ref.config}"] if ref.config else []
    details += [f"split {split}"] if split else []
    return f"{what[ref.kind]} {ref.spec}" + (f" ({', '.join(details)})" if details else "")


def _map_style(ref: DatasetRef):
    """The memory-mapped ``Dataset`` of a saved source (its split, for a ``DatasetDict``)."""
    saved = _saved(ref.spec)
    return saved if ref.kind == "saved" else saved[split_name(ref)]


def iterable(ref: DatasetRef, start: int = 0, end: int | None = None, num_shards: int = 1):
    """An ``IterableDataset`` of rows ``start`` <= row < ``end`` of ``ref``'s split (a fresh one on each
    call: a loaded state applies to one iteration only). A saved dataset's rows are sliced, not skipped."""
    if ref.kind == "hub":
        dataset = _builder(ref.spec, ref.config, ref.flag).as_streaming_dataset(split=split_name(ref))
        dataset = dataset.skip(start) if start else dataset
        return dataset.take(end - start) if end is not None else dataset
    table = _map_style(ref)
    stop = len(table) if end is None else min(end, len(table))
    if start or stop < len(table):
        table = table.select(range(start, stop))  # a contiguous slice of the mapped files: nothing copied
    return table.to_iterable_dataset(num_shards=max(1, min(num_shards, len(table))))


def read_rows(ref: DatasetRef, start: int = 0, end: int | None = None,
              columns: tuple[str, ...] | None = None) -> Iterator[tuple[int, dict]]:
    """(row, record) for rows ``start`` <= row < ``end`` of ``ref``: ``read_range``'s contract for files.
    Only ``columns`` are decoded when the dataset has them all (else every column, so a check can name them)."""
    if end is not None and start >= end:
        return
    dataset = iterable(ref, start, end)
    names = dataset.column_names
    if columns and names and all(c in names for c in columns):
        dataset = dataset.select_columns(list(columns))
    try:
        yield from enumerate(dataset, start)
    except (ConnectionError, FileNotFoundError) as exc:  # a streamed file out of reach (offline, gone)
        fix = "train where the hub is reachable, or pass a save_to_disk folder of it" if ref.kind == "hub" else \
            "save it again"
        raise UserError(f"{ref.flag}={ref.spec}: its rows cannot be read ({type(exc).__name__}: {first_line(exc)}); "
                        f"{fix}") from None


def has_rows(ref: DatasetRef) -> bool:
    """Whether ``ref``'s split holds a row (the count when known, else the first row read)."""
    rows = row_count(ref)
    return bool(rows) if rows is not None else next(read_rows(ref, 0, 1), None) is not None


# ----------------------------------------------------------- process shares
@dataclass
class Share:
    """How one process reads its rows of a dataset each epoch.

    Attributes:
        open: a fresh ``IterableDataset`` of this process's rows (its ``state_dict()`` is the position).
        rows: rows this process reads per epoch; None when unknown.
        strategy: ``shards`` (whole shards per process) or ``examples`` (one row in world_size per process).
        row_of: the k-th row this process reads -> its row in the split (a number unique within the epoch
            where datasets cannot tell the row: whole hub shards of unknown lengths).
        span: this process's contiguous [start, end) rows of the split, when they are contiguous.
    """

    open: Callable
    rows: int | None
    strategy: str
    row_of: Callable[[int], int]
    span: tuple[int, int] | None = None


def process_share(ref: DatasetRef, start: int, rank: int, world: int) -> Share:
    """Process ``rank``'s disjoint share of ``ref``'s rows from ``start`` on, through
    ``datasets.distributed.split_dataset_by_node``.

    A saved dataset becomes ``world`` contiguous shards (``to_iterable_dataset(num_shards=world)``), one per
    process. A streamed one is split by shards when their number divides by ``world`` and no rows are skipped
    at its start, else each process keeps one row in ``world`` (``split_dataset_by_node`` skips the others:
    every process reads the whole stream, but the split is exact and the rows held out stay held out).
    """
    from datasets.distributed import split_dataset_by_node

    total = row_count(ref)
    rows = None if total is None else max(total - start, 0)
    every = Share(lambda: _split(iterable(ref, start), rank, world, "examples"),
                  None if rows is None else len(range(rank, rows, world)), "examples",
                  lambda k: start + rank + k * world)
    if world == 1:
        return Share(lambda: iterable(ref, start), rows, "shards", lambda k: start + k,
                     None if rows is None else (start, start + rows))
    if ref.kind != "hub":
        if rows < world:
            return every
        div, mod = divmod(rows, world)  # Dataset.shard(contiguous=True): the first `mod` shards hold one more
        first = start + div * rank + min(rank, mod)
        size = div + (rank < mod)
        return Share(lambda: split_dataset_by_node(iterable(ref, start, num_shards=world), rank, world),
                     size, "shards", lambda k: first + k, (first, first + size))
    if start or iterable(ref).num_shards % world:
        return every
    return Share(lambda: _split(iterable(ref), rank, world, "shards"), None, "shards", lambda k: k * world + rank)


def _split(dataset, rank: int, world: int, strategy: str):
    from datasets.distributed import split_dataset_by_node

    return split_dataset_by_node(dataset, rank, world, strategy=strategy) if world > 1 else dataset
