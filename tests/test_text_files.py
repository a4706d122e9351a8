"""Plain-text corpora: documents separated by blank lines, or one per line; any document one seek away."""

from __future__ import annotations

from data.sources.readers import index_file
from data.sources.text_files import LINES, PARAGRAPHS, SEEK_EVERY, txt_range


def test_blank_lines_separate_documents_and_a_file_without_them_is_one_per_line(tmp_path):
    paragraphs = tmp_path / "p.txt"
    paragraphs.write_text("first line\nsame document\n\n\nsecond\r\n\nthird\n\n", encoding="utf-8")
    index = index_file(paragraphs)
    assert (index.kind, index.rows) == (PARAGRAPHS, 3)
    docs = [r["text"] for _, r in txt_range(paragraphs, index, 0, None, "text")]
    assert docs == ["first line\nsame document", "second", "third"]
    lines = tmp_path / "l.txt"
    lines.write_text("one\ntwo\nthree\n\n", encoding="utf-8")  # a trailing blank line does not make paragraphs
    index = index_file(lines)
    assert (index.kind, index.rows) == (LINES, 3)
    assert [r["doc"] for _, r in txt_range(lines, None, 1, None, "doc")] == ["two", "three"]


def test_any_document_is_reached_by_a_seek_and_bad_utf8_is_a_reason(tmp_path):
    path = tmp_path / "big.txt"
    docs = [f"document {i} " + "word " * (i % 50) for i in range(12_000)]
    with open(path, "wb") as fh:
        fh.write("\n\n".join(docs).encode() + b"\n\n\xff\xfe broken\n")
    index = index_file(path)
    assert index.rows == 12_001 and len(index.seeks) >= path.stat().st_size // SEEK_EVERY
    start = index.seeks[-1][0] + 3  # past the last seek point: read from there, not from the file's start
    got = list(txt_range(path, index, start, start + 2, "text"))
    assert [r for r, _ in got] == [start, start + 1] and got[0][1]["text"] == docs[start]
    assert list(txt_range(path, index, 12_000, None, "text")) == [(12_000, "invalid_utf8")]


def test_a_byte_order_mark_is_not_text_and_any_text_column_name_is_accepted(tmp_path):
    from data.sources.corpus import check_columns

    plain, marked = tmp_path / "plain.txt", tmp_path / "marked.txt"
    plain.write_text("stone river\nlight day\n", encoding="utf-8")
    marked.write_text("\ufeffstone river\nlight day\n", encoding="utf-8")
    read = {path.name: [r for _, r in txt_range(path, index_file(path), 0, None, "body")] for path in (plain, marked)}
    assert read["marked.txt"] == read["plain.txt"] == [{"body": "stone river"}, {"body": "light day"}]
    check_columns([marked], ("body",), "--train_file")  # a .txt file's one column takes the name asked for
