"""Finding corpus files and streaming their rows with bounded memory.

Every file is read through ``datasets.load_dataset(<format>, streaming=True)``: rows come out of
Arrow record batches of a few MB, so host memory does not depend on the size of the file.
"""

from __future__ import annotations

import glob
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from config import UserError

# File ending -> datasets' packaged builder.
FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass(frozen=True)
class Example:
    """One prompt/response pair and where it came from (file index in the run's file list, row)."""

    prompt: str
    response: str
    file_index: int
    row: int


def resolve_files(spec: str, flag: str = "--train_file") -> list[Path]:
    """Expand a file, a glob, a folder, or a comma-separated list of those, into sorted data files.

    Raises:
        UserError: when nothing matches or a matched file has an unsupported ending.
    """
    files: list[Path] = []
    for part in [p.strip() for p in str(spec).split(",") if p.strip()]:
        path = Path(part).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.suffix.lower() in FORMATS and p.is_file())
            if not found:
                raise UserError(f"{flag}={part} is a folder with no {'/'.join(FORMATS)} files")
        elif any(ch in part for ch in "*?["):
            found = sorted(Path(p) for p in glob.glob(os.path.expanduser(part), recursive=True) if Path(p).is_file())
            if not found:
                raise UserError(f"{flag}={part} matches no file")
        elif path.is_file():
            found = [path]
        else:
            raise UserError(f"{flag}={part} does not exist")
        for p in found:
            if p.suffix.lower() not in FORMATS:
                raise UserError(f"{flag}: {p} has an unsupported ending; use one of {', '.join(FORMATS)}")
            if not os.access(p, os.R_OK):
                raise UserError(f"{flag}: {p} is not readable")
        files.extend(found)
    if not files:
        raise UserError(f"{flag} is empty")
    return files


def count_rows(path: Path) -> int:
    """Rows in one file, without holding it in memory (used for the schedule and progress totals)."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    if suffix == ".jsonl":
        rows = 0
        with open(path, "rb") as fh:
            last = b"\n"
            while chunk := fh.read(1 << 22):
                rows += chunk.count(b"\n")
                last = chunk[-1:]
            rows += last != b"\n"  # a final line without a newline
        return rows
    return sum(1 for _ in _open_stream(path))


def _open_stream(path: Path):
    from datasets import load_dataset

    return load_dataset(FORMATS[path.suffix.lower()], data_files=[str(path)], streaming=True, split="train")


def iter_rows(path: Path, file_index: int, columns: tuple[str, str], start_row: int = 0,
              skipped: Counter | None = None) -> Iterator[Example | None]:
    """Stream the rows of one file from ``start_row``.

    Yields an ``Example`` per usable row and ``None`` for a row that was skipped (the reason is
    counted in ``skipped``), so the caller can keep an exact row position either way.
    """
    stream = _open_stream(path)
    if start_row:
        stream = stream.skip(start_row)  # reads and drops Arrow rows: no tokenizer, no model
    prompt_col, response_col = columns
    for row, record in enumerate(stream, start=start_row):
        prompt, response = record.get(prompt_col), record.get(response_col)
        reason = _problem(prompt, prompt_col) or _problem(response, response_col)
        if reason:
            if skipped is not None:
                skipped[reason] += 1
            yield None
            continue
        yield Example(prompt, response, file_index, row)


def _problem(value, column: str) -> str | None:
    if value is None:
        return f"missing or null {column}"
    if not isinstance(value, str):
        return f"non-text {column}"
    if not value.strip():
        return f"empty {column}"
    return None


def first_record_columns(path: Path) -> list[str]:
    """Column names of the first row of a file (empty list for an empty file)."""
    for record in _open_stream(path):
        return list(record)
    return []


def check_columns(files: list[Path], columns: tuple[str, str], flag: str) -> None:
    """Fail early, before any model is built, when the first file lacks the configured columns."""
    present = first_record_columns(files[0])
    missing = [c for c in columns if c not in present] if present else []
    if missing:
        which = " and ".join(f"'{c}'" for c in missing)
        raise UserError(f"{flag}: {files[0]} has no column {which} (columns: {', '.join(present)}); "
                        "set --prompt_column / --response_column")
