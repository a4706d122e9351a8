"""Reading any row range of a corpus file, one row at a time, with every bad row named.

Why not ``datasets.load_dataset(..., streaming=True)`` here: it cannot start in the middle of a
file (resuming and splitting a file between processes would read and discard everything before
the start), and one malformed JSON line or one value of the wrong type fails the whole file.
These readers seek instead, and turn each bad row into a reason the caller counts:

- ``.jsonl`` (and ``.json`` holding JSON lines): one line per row. A sparse index of line-start
  byte offsets (one per MiB) lets any row be reached with one seek.
- ``.parquet``: pyarrow record batches of at most ``BATCH_ROWS`` rows, pages read as needed (not
  whole row groups), only the requested columns decoded; rows reached by row group.
- ``.csv``: a header line, then one record per row (quoted newlines allowed); the index holds the
  byte offset of a record every ~MiB, found with the csv module while counting rows.
- ``.json`` holding one JSON array: its elements are found one at a time by the standard ``json``
  scanner (``raw_decode`` over a window of the file, never the whole array: ``data.sources.json_array``)
  and the index holds the byte offset of an element every ~MiB, as for jsonl.

Host memory: one batch or one row at a time, plus the index (a few KB per GB of data).
"""

from __future__ import annotations

import bisect
import csv
import io
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from data.sources.hf_datasets import DatasetRef, read_rows, row_count
from data.sources.json_array import ArrayElements
from data.sources.text_files import index_txt, txt_range
from lowmem.utils.errors import UserError

SEEK_EVERY = 1 << 20  # bytes between index entries: at most this much is read and dropped per seek
BATCH_ROWS = 256  # parquet rows decoded at once
# A csv field may be as long as a jsonl line (texts are truncated at tokenization), not only the
# csv module's default 128 KiB, past which one long row made the whole file unreadable.
csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
TOKEN_COLUMNS = ("input_ids", "labels")  # the columns of a corpus prepared by ``data.prepare`` (token ids)
MANIFEST = "prepared.manifest"  # what ``data.prepare`` wrote (JSON): not a data-file ending, never read as rows

# Reason keys for bad rows (they appear in the log and in metrics.jsonl).
REASONS = {
    "invalid_utf8": "not valid UTF-8",
    "blank_line": "blank line",
    "malformed_json": "malformed JSON",
    "not_an_object": "not a JSON object",
    "missing_column": "missing column",
    "null_value": "null value",
    "empty_value": "empty text",
    "non_string_value": "value is not text",
}


@dataclass
class FileIndex:
    """How many rows a file has and where to seek to reach any of them.

    ``seeks`` holds ascending (row, position) pairs; position is a byte offset for jsonl / csv and
    a row-group number for parquet.
    """

    rows: int
    seeks: list[tuple[int, int]] = field(default_factory=lambda: [(0, 0)])
    kind: str = "jsonl"

    def seek_point(self, row: int) -> tuple[int, int]:
        """The last index entry at or before ``row``."""
        at = bisect.bisect_right([r for r, _ in self.seeks], row) - 1
        return self.seeks[max(at, 0)]


def file_kind(path: Path) -> str:
    """jsonl, parquet, csv or json-array (a .json file whose first character is '['); dataset for a dataset."""
    if isinstance(path, DatasetRef):
        return "dataset"
    suffix = path.suffix.lower()
    if suffix == ".json":
        with open(path, "rb") as fh:
            head = fh.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
        return "json-array" if head.startswith(b"[") else "jsonl"
    return "txt" if suffix == ".txt" else suffix.lstrip(".")


def manifest_of(files: list[Path]) -> dict | None:
    """The manifest when ``files`` are the shards of one prepared folder, else None."""
    if any(isinstance(f, DatasetRef) for f in files):
        return None
    folders = {f.parent for f in files}
    if len(folders) != 1 or not (next(iter(folders)) / MANIFEST).is_file():
        return None
    return json.loads((next(iter(folders)) / MANIFEST).read_text(encoding="utf-8"))


def index_file(path: Path) -> FileIndex:
    """Count the rows of one file and record seek points; streams the file once, never holds it.
    A dataset (``DatasetRef``) is counted from its metadata (0 when that has no count)."""
    if isinstance(path, DatasetRef):
        return FileIndex(row_count(path) or 0, kind="dataset")
    kind = file_kind(path)
    try:
        if kind == "parquet":
            import pyarrow.parquet as pq

            meta = pq.ParquetFile(path).metadata
            seeks, start = [], 0
            for group in range(meta.num_row_groups):
                seeks.append((start, group))
                start += meta.row_group(group).num_rows
            return FileIndex(meta.num_rows, seeks or [(0, 0)], kind)
        if kind == "csv":
            return _index_csv(path)
        if kind == "json-array":
            return _index_array(path)
        if kind == "txt":
            return FileIndex(*index_txt(path))
        return _index_lines(path)
    except UserError:
        raise
    except Exception as exc:  # pyarrow / csv / OS errors: name the file, say what to do
        raise unreadable(path, exc) from exc


def _index_lines(path: Path) -> FileIndex:
    seeks, rows, offset = [(0, 0)], 0, 0
    with open(path, "rb") as fh:
        last = b"\n"
        while chunk := fh.read(SEEK_EVERY):
            cut = chunk.find(b"\n")
            if offset and cut >= 0:  # the first line that starts inside this chunk
                seeks.append((rows + 1, offset + cut + 1))
            rows += chunk.count(b"\n")
            offset += len(chunk)
            last = chunk[-1:]
        rows += last != b"\n"  # a final line without a newline
    if len(seeks) > 1 and seeks[-1][0] >= rows:  # an entry pointing past the last line (the first stays)
        seeks.pop()
    return FileIndex(rows, seeks, "jsonl")


class _Lines:
    """Binary lines of a file decoded for the csv module, with the byte offset after each line."""

    def __init__(self, fh):
        self.fh, self.offset, self.bad = fh, fh.tell(), False
        self.end = fh.seek(0, io.SEEK_END)
        fh.seek(self.offset)

    def __iter__(self):
        return self

    def __next__(self) -> str:
        line = self.fh.readline()
        if not line:
            raise StopIteration
        self.offset += len(line)
        try:
            return line.decode("utf-8")
        except UnicodeDecodeError:
            self.bad = True
            return line.decode("utf-8", errors="replace")


def _index_csv(path: Path) -> FileIndex:
    with open(path, "rb") as fh:
        lines = _Lines(fh)
        reader = csv.reader(lines)
        next(reader, None)  # header
        seeks, rows, mark, last = [(0, lines.offset)], 0, lines.offset, lines.offset
        for _ in reader:
            rows += 1
            if lines.offset - mark >= SEEK_EVERY:
                seeks.append((rows, lines.offset))
                mark = lines.offset
            if lines.offset < lines.end:
                last = lines.offset  # where the next record, possibly the last, starts
    if rows:
        _check_last_record_closes(path, last, rows)
    return FileIndex(rows, seeks, "csv")


def _check_last_record_closes(path: Path, start: int, row: int) -> None:
    """A quote opened and never closed makes the csv module read the rest of the file as one
    value (it ends that record at the end of the file instead of failing): re-read the last
    record strictly, which fails exactly then."""
    with open(path, "rb") as fh:
        fh.seek(start)
        text = fh.read().decode("utf-8", errors="replace")
    try:
        for _ in csv.reader(io.StringIO(text, newline=""), strict=True):
            pass
    except csv.Error as exc:
        if "unexpected end of data" in str(exc):
            raise UserError(f"{path}: the quoted value that opens in row {row} never closes, so the rest of the "
                            "file would be read as that one value; add the closing quote (\") or remove the "
                            "opening one") from None


def _index_array(path: Path) -> FileIndex:
    seeks, rows, mark = [], 0, -SEEK_EVERY
    with ArrayElements(path, SEEK_EVERY) as elements:
        while (element := elements.read(rows)) is not None:
            if element[0] - mark >= SEEK_EVERY:
                seeks.append((rows, element[0]))
                mark = element[0]
            rows += 1
    return FileIndex(rows, seeks or [(0, 0)], "json-array")


def _array_range(path: Path, index: FileIndex | None, start: int, end: int | None):
    row, offset = _seek_point(index, start)
    with ArrayElements(path, SEEK_EVERY, offset or 0) as elements:
        while end is None or row < end:
            element = elements.read(row)
            if element is None:
                return
            if row >= start:
                yield row, _parse_line(element[1])
            row += 1


def read_range(path: Path, index: FileIndex | None, start: int = 0, end: int | None = None,
               columns: tuple[str, ...] | None = None) -> Iterator[tuple[int, dict | str]]:
    """Rows ``start`` ≤ row < ``end`` (None: to the end) of one file as (row, record), or
    (row, reason key) for a bad row. Reading from the first row needs no index (``index=None``):
    no pass over the file is made first. ``columns``: parquet decodes only these (the records of
    other formats hold every field)."""
    if isinstance(path, DatasetRef):  # a dataset reads any range itself (data.sources.hf_datasets)
        yield from read_rows(path, start, end, columns)
        return
    if index is None and start:
        raise ValueError("reading from a row other than the first needs the file's index")
    if end is not None and start >= end:
        return
    kind = index.kind if index is not None else file_kind(path)
    try:
        if kind == "parquet":
            yield from _parquet_range(path, index, start, end, columns)
        elif kind == "csv":
            yield from _csv_range(path, index, start, end)
        elif kind == "json-array":
            yield from _array_range(path, index, start, end)
        elif kind.startswith("txt"):
            yield from txt_range(path, index, start, end, columns[0] if columns else "text")
        else:
            yield from _jsonl_range(path, index, start, end)
    except UserError:
        raise
    except Exception as exc:  # OS errors, and pyarrow's for a file that is not parquet or is cut short
        raise unreadable(path, exc) from exc


def unreadable(path: Path, exc: Exception) -> UserError:
    """The one-line error for a data file the reader failed on: the file, the reader's words, the fix."""
    return UserError(f"cannot read {path}: {type(exc).__name__}: {str(exc).rstrip('. ')}; fix or remove the file")


def _seek_point(index: FileIndex | None, start: int) -> tuple[int, int | None]:
    return index.seek_point(start) if index is not None else (0, None)


def _jsonl_range(path: Path, index: FileIndex | None, start: int, end: int | None):
    row, offset = _seek_point(index, start)
    with open(path, "rb") as fh:
        fh.seek(offset or 0)
        while end is None or row < end:
            line = fh.readline()  # one row in memory at a time, however long it is
            if not line:
                return
            if row >= start:
                yield row, _parse_line(line)
            row += 1


def _parse_line(line: bytes) -> dict | str:
    try:
        text = line.decode("utf-8").removeprefix("\ufeff")  # a file's byte-order mark (Windows editors write one)
    except UnicodeDecodeError:
        return "invalid_utf8"
    if not text.strip():
        return "blank_line"
    try:
        record = json.loads(text)
    except (ValueError, RecursionError):  # JSONDecodeError, an integer past Python's 4300 digits, deep nesting
        return "malformed_json"
    return record if isinstance(record, dict) else "not_an_object"


def _parquet_range(path: Path, index: FileIndex | None, start: int, end: int | None,
                   columns: tuple[str, ...] | None = None):
    import pyarrow as pa
    import pyarrow.parquet as pq

    first_row, group = _seek_point(index, start)
    # Pages are read as the batches need them, not a whole row group at once: pyarrow writes 1Mi
    # rows per row group by default, so a corpus from ``df.to_parquet()`` is often one group.
    pf = pq.ParquetFile(path, pre_buffer=False, buffer_size=SEEK_EVERY)
    groups = list(range(group or 0, pf.metadata.num_row_groups))
    wanted = None if columns is None else [c for c in columns if c in pf.schema_arrow.names]
    row = first_row
    try:
        for batch in pf.iter_batches(batch_size=BATCH_ROWS, row_groups=groups, columns=wanted):
            if row + batch.num_rows <= start:
                row += batch.num_rows
                continue
            for record in batch.to_pylist():
                if end is not None and row >= end:
                    return
                if row >= start:
                    yield row, record
                row += 1
    finally:
        # Arrow's allocator (mimalloc) keeps freed pages: reaching the last rows of a 1M-row
        # group left ~60 MiB of RSS behind that nothing used again.
        pa.default_memory_pool().release_unused()


def _csv_range(path: Path, index: FileIndex | None, start: int, end: int | None):
    row, offset = _seek_point(index, start)
    with open(path, "rb") as fh:
        header = _csv_header(fh)
        if offset is not None:  # without an index: the first record follows the header
            fh.seek(offset)
        lines = _Lines(fh)
        for values in csv.reader(lines):
            if end is not None and row >= end:
                return
            if row >= start:
                yield row, "invalid_utf8" if lines.bad else dict(zip(header, values)) if values else "blank_line"
            lines.bad = False
            row += 1


def csv_header(path: Path) -> list[str]:
    """A csv file's column names."""
    with open(path, "rb") as fh:
        return _csv_header(fh)


def _csv_header(fh) -> list[str]:
    return next(csv.reader(io.TextIOWrapper(io.BytesIO(fh.readline()), encoding="utf-8-sig", errors="replace")), [])


def row_problem(record: dict | str, columns: tuple[str, str]) -> tuple[str, str] | None:
    """(reason key, column) when a record cannot be used as a training pair, else None.

    Values are text, except in a prepared corpus (``TOKEN_COLUMNS``), whose values are token ids.
    """
    if isinstance(record, str):
        return record, ""
    kind = list if columns == TOKEN_COLUMNS else str
    for column in columns:
        if column not in record:
            return "missing_column", column
        value = record[column]
        if value is None:
            return "null_value", column
        if not isinstance(value, kind):
            return "non_string_value", column
        if not (value if kind is list else value.strip()):
            return "empty_value", column
        if kind is str and not value.isascii():
            try:  # a JSON escape can hold half of a UTF-16 pair (an emoji cut in two), which no tokenizer takes
                value.encode("utf-8")
            except UnicodeEncodeError:
                return "invalid_utf8", column
    return None
