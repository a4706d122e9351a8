"""The elements of a ``.json`` file holding one JSON array, found one at a time (``ArrayElements``).

The standard ``json`` scanner (``raw_decode``) reads each element over a window of the file, never the
whole array; ``data.sources.readers`` indexes such a file (the byte offset of an element every ~MiB) and
reads any row range of it from those offsets.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from lowmem.utils.errors import UserError

_BLANK = re.compile(r"[ \t\n\r]*")  # JSON's whitespace
_NEAR_END = 16  # characters: a JSON token cut by the window's end is shorter than this
_LATIN1 = "latin-1"  # one character per byte: string positions are byte offsets, UTF-8's structure intact


class ArrayElements:
    """The elements of a JSON array file as (byte offset, raw bytes), from ``offset`` on.

    ``offset`` 0 is the file's start (a BOM, then ``[``); any other offset is an element's first
    byte, as recorded in the index. Holds a window of the file that grows only as far as the
    element being read (doubling), so memory is one element plus ``window`` bytes (the readers
    pass ``SEEK_EVERY``). The bytes are decoded as Latin-1 for scanning: UTF-8's multi-byte
    characters never contain JSON's structural characters, so ``raw_decode`` finds the same
    element ends as on the real text.
    """

    def __init__(self, path: Path, window: int, offset: int = 0):
        self.path, self.fh, self.window = path, open(path, "rb"), window
        at_file_start = offset == 0  # else at an element's first byte (an offset from the index)
        if at_file_start and self.fh.read(3) == b"\xef\xbb\xbf":  # a byte-order mark
            offset = 3
        self.fh.seek(offset)
        self.base, self.pos, self.text, self.eof = offset, 0, "", False
        self.decoder = json.JSONDecoder()
        self.expect_value = True
        if at_file_start:
            if self._next_char() != "[":
                self._fail(0, "no opening '['")
            self.pos += 1
            self.expect_value = None  # after "[": an element or "]"

    def _fill(self) -> bool:
        """Drop what was consumed and read more (at least as much as is held); False at the end."""
        if self.eof:
            return False
        self.base += self.pos
        chunk = self.fh.read(max(self.window, len(self.text) - self.pos))
        self.text, self.pos, self.eof = self.text[self.pos:] + chunk.decode(_LATIN1), 0, not chunk
        return bool(chunk)

    def _fail(self, row: int, what: str, at: int | None = None):
        """One error line naming the byte and the row (``row`` counts from 0; users count from 1)."""
        at = self.base + (self.pos if at is None else at)
        raise UserError(f"{self.path} is not a valid JSON array: {what} at byte {at} (row {row + 1}); "
                        "fix the file, or write one JSON object per line as .jsonl so bad rows can be skipped "
                        "one by one")

    def _next_char(self) -> str:
        """The next non-blank character (not consumed), "" at the end of the file."""
        while True:
            self.pos = _BLANK.match(self.text, self.pos).end()
            if self.pos < len(self.text) or not self._fill():
                return self.text[self.pos:self.pos + 1]

    def read(self, row: int) -> tuple[int, bytes] | None:
        """The next element's (byte offset, bytes), None after the closing ``]``; ``row`` names it in errors."""
        char = self._next_char()
        if self.expect_value is not True:  # after "[" or an element: "]" ends the array
            if char == "]":
                self.pos += 1
                if self._next_char():
                    self._fail(row, "text after the closing ']'")
                return None
            if self.expect_value is False:
                if char != ",":
                    self._fail(row, "expected ',' or the closing ']'")
                self.pos += 1
                self._next_char()
        while True:
            # An element near the window's end may go on past it (a number, or a longer element
            # that fails to parse there): read more and parse it again.
            near_end = len(self.text) - _NEAR_END
            try:
                value_end = self.decoder.raw_decode(self.text, self.pos)[1]
                if value_end <= near_end or self.eof:
                    break
            except json.JSONDecodeError as exc:
                if self.eof or (exc.pos <= near_end and not exc.msg.startswith("Unterminated string")):
                    self._fail(row, exc.msg.removesuffix(" at").lower(), exc.pos)
            self._fill()
        start = self.base + self.pos
        raw = self.text[self.pos:value_end].encode(_LATIN1)
        self.pos, self.expect_value = value_end, False
        return start, raw

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.fh.close()
