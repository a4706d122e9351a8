"""Plain-text corpora (``.txt``): one document per row, for objectives that read raw text.

A file with blank lines between its lines holds documents separated by blank lines (a paragraph,
lines joined with ``\\n``); a file without any is one document per line. Which one a file is is
decided while it is indexed (``index_txt``: one pass, the file never held) and kept in the index's
``kind`` (``txt-paragraphs`` or ``txt-lines``), so the log can say it and every reader agrees.
The index holds a document's byte offset every ~MiB, as for jsonl, so any document is one seek away.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

PARAGRAPHS, LINES = "txt-paragraphs", "txt-lines"
SEEK_EVERY = 1 << 20  # bytes between index entries


def _documents(fh: BinaryIO, paragraphs: bool) -> Iterator[tuple[int, bytes]]:
    """(byte offset, raw bytes) of each document from the file's position on."""
    offset, start, parts = fh.tell(), 0, []
    for line in iter(fh.readline, b""):
        if not line.strip():
            if parts:
                yield start, b"".join(parts).rstrip(b"\r\n")
                parts = []
        elif paragraphs:
            if not parts:
                start = offset
            parts.append(line)
        else:
            yield offset, line.rstrip(b"\r\n")
        offset += len(line)
    if parts:
        yield start, b"".join(parts).rstrip(b"\r\n")


def _has_inner_blank_line(path: Path) -> bool:
    """Whether a blank line stands between two lines with text (trailing blank lines do not count)."""
    text_seen = blank_after_text = False
    with open(path, "rb") as fh:
        for line in fh:
            if not line.strip():
                blank_after_text = text_seen
            elif blank_after_text:
                return True
            else:
                text_seen = True
    return False


def index_txt(path: Path) -> tuple[int, list[tuple[int, int]], str]:
    """The documents of a .txt file counted, with a seek point every ~MiB: (rows, seeks, kind), the
    fields of ``data.sources.readers.FileIndex``."""
    kind = PARAGRAPHS if _has_inner_blank_line(path) else LINES
    seeks, rows, next_seek = [(0, 0)], 0, SEEK_EVERY
    with open(path, "rb") as fh:
        for offset, _ in _documents(fh, kind == PARAGRAPHS):
            if offset >= next_seek:
                seeks.append((rows, offset))
                next_seek = offset + SEEK_EVERY
            rows += 1
    return rows, seeks, kind


def txt_range(path: Path, index, start: int, end: int | None, column: str) -> Iterator[tuple[int, dict | str]]:
    """Documents ``start`` ≤ row < ``end`` as (row, {column: text}), or (row, "invalid_utf8")."""
    kind = index.kind if index is not None else (PARAGRAPHS if _has_inner_blank_line(path) else LINES)
    row, offset = index.seek_point(start) if index is not None else (0, 0)
    with open(path, "rb") as fh:
        fh.seek(offset)
        for _, raw in _documents(fh, kind == PARAGRAPHS):
            if end is not None and row >= end:
                return
            if row >= start:
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    yield row, "invalid_utf8"
                else:  # a byte-order mark (Windows editors) is not text: stripped, as the other formats do
                    yield row, {column: text.removeprefix("\ufeff") if row == 0 else text}
            row += 1


def layout_note(path: Path, kind: str) -> str:
    """How a .txt file is read, for the log."""
    how = "documents separated by blank lines" if kind == PARAGRAPHS else "one document per line (no blank lines)"
    return f"{path}: plain text, {how}"
