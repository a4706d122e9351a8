"""Streaming sources, the resumable shuffled stream, truncation and dynamic padding."""

from __future__ import annotations

import json
import random
import re
from collections import Counter

import pytest
from conftest import synthetic_rows, write_rows

from data.collate import Seq2SeqCollator
from data.sources.corpus import DataProblems, Example, check_columns, iter_rows, repeated_files, resolve_files
from data.sources.eval_set import hold_out, read_ranges, take_examples
from data.sources.readers import index_file, read_range
from data.streams.file_stream import ExampleStream, StreamSpec, example_bytes, largest_share
from lowmem.utils.errors import UserError

COLS = ("prompt", "response")


@pytest.mark.parametrize("ending", [".jsonl", ".json", ".parquet", ".csv"])
def test_every_format_streams_all_rows_in_order(tmp_path, ending):
    rows = synthetic_rows(150, seed=3)
    path = write_rows(tmp_path / f"c{ending}", rows)
    got = [e for e in iter_rows(path, 0, COLS) if e is not None]
    assert [(e.prompt, e.response) for e in got] == [(r["prompt"], r["response"]) for r in rows]
    assert [e.row for e in got] == list(range(150))
    assert index_file(path).rows == 150


def test_resolve_files_globs_folders_and_errors(tmp_path):
    a = write_rows(tmp_path / "d" / "a.jsonl", synthetic_rows(3))
    b = write_rows(tmp_path / "d" / "sub" / "b.parquet", synthetic_rows(3))
    assert resolve_files(str(tmp_path / "d")) == [a, b]
    assert resolve_files(str(tmp_path / "d" / "*.jsonl")) == [a]
    assert resolve_files(f"{a},{b}") == [a, b]
    # A file reached twice is read once, where it is first reached, and named for the log
    assert resolve_files(f"{tmp_path / 'd'},{b},{a}") == [a, b] and resolve_files(f"{b},{tmp_path / 'd'}") == [b, a]
    assert repeated_files(f"{tmp_path / 'd'},{b},{b}") == [b] and repeated_files(f"{a},{b}") == []
    with pytest.raises(UserError, match="does not exist"):
        resolve_files(str(tmp_path / "missing.jsonl"))
    with pytest.raises(UserError, match="matches no file"):
        resolve_files(str(tmp_path / "*.csv"))
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(UserError, match="unsupported ending"):
        resolve_files(str(tmp_path / "notes.txt"))


def test_null_and_empty_rows_are_skipped_and_counted(tmp_path):
    rows = synthetic_rows(10) + [{"prompt": None, "response": "x"}, {"prompt": "y", "response": ""}]
    path = write_rows(tmp_path / "c.jsonl", rows)
    problems = DataProblems()
    got = [e for e in iter_rows(path, 0, COLS, problems=problems) if e is not None]
    assert len(got) == 10
    assert problems.by_reason == Counter({"null_value": 1, "empty_value": 1})
    assert problems.first == [f"{path} line 11: null value 'prompt'", f"{path} line 12: empty text 'response'"]


@pytest.mark.parametrize("ending", [".jsonl", ".json", ".parquet", ".csv"])
def test_any_row_range_is_read_by_seeking(tmp_path, ending):
    """Files of several MiB (several index entries): every range gives exactly its rows."""
    rows = [{"prompt": f"{i} " + "x" * 300, "response": f"r{i}, \"quoted\"\nnewline"} for i in range(12_000)]
    path = write_rows(tmp_path / f"big{ending}", rows)
    index = index_file(path)
    assert index.rows == 12_000 and len(index.seeks) > 2
    for start, end in [(0, 5), (4_321, 4_330), (index.seeks[2][0] - 1, index.seeks[2][0] + 2), (11_998, 12_000)]:
        got = [e for e in iter_rows(path, 0, COLS, (start, end), index) if e is not None]
        assert [(e.row, e.prompt, e.response) for e in got] == \
            [(i, rows[i]["prompt"], rows[i]["response"]) for i in range(start, end)]


def test_a_json_array_is_streamed_in_bounded_memory(tmp_path):
    """A 30+ MiB JSON array (byte-order mark, indented, brackets / quotes / escapes / emoji inside
    strings, a 2 MB row, rows that are not objects) is indexed and read row by row with the memory
    of a few rows, not of the file; a broken array is one error naming the byte to fix."""
    import tracemalloc

    rows = [{"prompt": f"{i} [\"x\"] {{,}} \\ é中😀", "response": "r" * (i % 900 + 1)} for i in range(60_000)]
    rows[30_000] = {"prompt": "p" * 2_000_000, "response": "long"}
    rows[40_000:40_000] = [[1, 2], 12345678, None]
    path = tmp_path / "c.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(rows, ensure_ascii=False, indent=1).encode())
    assert path.stat().st_size > 30 << 20
    tracemalloc.start()
    try:
        index = index_file(path)
        read = [(row, record) for row, record in read_range(path, index) if row % 997 == 0 or isinstance(record, str)]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak  # parsed whole, the file alone would take more than 30 MiB
    assert index.rows == len(rows) and len(index.seeks) > 20
    assert read == [(i, r if isinstance(r, dict) else "not_an_object") for i, r in enumerate(rows)
                    if i % 997 == 0 or not isinstance(r, dict)]
    assert list(read_range(path, index, 29_999, 30_002)) == [(i, rows[i]) for i in range(29_999, 30_002)]

    for text, problem in [('[{"a": 1}, {"a": tru}]', "expecting value at byte 17 (row 2)"),
                          ('[{"a": 1} {"a": 2}]', "expected ',' or the closing ']' at byte 10 (row 2)"),
                          ('[{"a": 1},', "expecting value at byte 10 (row 2)"),
                          ('[{"a": 1}] {}', "text after the closing ']' at byte 11 (row 2)")]:
        path.write_text(text)
        with pytest.raises(UserError, match=re.escape(f"{path} is not a valid JSON array: {problem}; fix the file")):
            index_file(path)


def test_a_json_array_cut_anywhere_by_the_reading_window(tmp_path, monkeypatch):
    """A window of a few bytes cuts every element somewhere (inside numbers, strings, escapes,
    nested arrays): every row still reads whole, from the start or from any index entry, and a file
    cut short anywhere before its closing ']' is an error, never a shorter corpus."""
    import data.sources.readers

    monkeypatch.setattr(data.sources.readers, "SEEK_EVERY", 5)
    rows = [{"prompt": 'a "[x]" \\', "response": "中😀"}, -1.5e-300, 12345678901234, [1, [2, {"k": "}"}]], True,
            None, "s,]", {}, {"prompt": "p", "response": "r", "n": 1e20}]
    path = tmp_path / "c.json"
    raw = b"\xef\xbb\xbf" + json.dumps(rows, ensure_ascii=False, indent=1).encode()
    path.write_bytes(raw)
    index = index_file(path)
    expected = [(i, r if isinstance(r, dict) else "not_an_object") for i, r in enumerate(rows)]
    assert index.rows == len(rows) and len(index.seeks) == len(rows)
    assert list(read_range(path, index)) == expected
    assert all(list(read_range(path, index, i, i + 2)) == expected[i:i + 2] for i in range(len(rows)))
    for cut in range(raw.index(b"[") + 1, raw.rindex(b"]")):
        path.write_bytes(raw[:cut])
        with pytest.raises(UserError, match="is not a valid JSON array"):
            index_file(path)


def test_a_parquet_file_of_one_row_group_is_read_page_by_page(tmp_path):
    """pyarrow writes 1Mi rows per row group by default: a whole corpus in one group. Reading it
    takes Arrow memory for a few pages of the two text columns, not for the group (44 MB here),
    and other columns are never decoded."""
    import os

    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = 20_000
    table = pa.table({"prompt": [os.urandom(500).hex() for _ in range(rows)],
                      "response": [os.urandom(100).hex() for _ in range(rows)],
                      "extra": [os.urandom(500).hex() for _ in range(rows)]})
    path = tmp_path / "one_group.parquet"
    pq.write_table(table, path, row_group_size=rows)
    expected = table.slice(rows - 3).select(["prompt", "response"]).to_pylist()
    del table
    assert pq.ParquetFile(path).metadata.num_row_groups == 1 and path.stat().st_size > 40 << 20
    before, peak, got = pa.total_allocated_bytes(), 0, []
    for example in iter_rows(path, 0, COLS):
        peak = max(peak, pa.total_allocated_bytes() - before)
        got.append(example)
    assert len(got) == rows and [{"prompt": e.prompt, "response": e.response} for e in got[-3:]] == expected
    assert peak < 16 << 20, peak  # the whole group, pre-buffered: more than 40 MiB


@pytest.mark.parametrize("ending", [".jsonl", ".csv"])
def test_a_byte_order_mark_loses_no_row_and_no_column(tmp_path, ending):
    """Windows editors and Excel's "CSV UTF-8" start the file with a byte-order mark."""
    rows = synthetic_rows(5, seed=4)
    path = write_rows(tmp_path / f"c{ending}", rows)
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    problems = DataProblems()
    got = [(e.prompt, e.response) for e in iter_rows(path, 0, COLS, problems=problems) if e is not None]
    assert got == [(r["prompt"], r["response"]) for r in rows] and not problems.by_reason


def test_a_csv_field_longer_than_the_csv_modules_limit_is_read(tmp_path):
    """Python's csv stops at 128 KiB per field by default, which made the whole file unreadable."""
    rows = synthetic_rows(3) + [{"prompt": "y" * 300_000, "response": "ok"}] + synthetic_rows(3, seed=1)
    got = [e for e in iter_rows(write_rows(tmp_path / "c.csv", rows), 0, COLS)]
    assert [(e.prompt, e.response) for e in got] == [(r["prompt"], r["response"]) for r in rows]


@pytest.mark.parametrize("world", [2, 3])
def test_processes_split_every_file_and_read_only_their_share(tmp_path, world):
    """2 files over 3 processes (does not divide) and over 2: each row once, each process reads
    about 1/world of the rows rather than the whole corpus."""
    files = [write_rows(tmp_path / f"f{i}.jsonl", synthetic_rows(101 + 50 * i, seed=i)) for i in range(2)]
    shares = []
    for rank in range(world):
        stream = ExampleStream(files, StreamSpec(COLS, seed=7, buffer_size=20), rank=rank, world_size=world)
        shares.append(_drain(stream))
        assert stream.rows_read <= (101 + 151) // world + 2
    everything = sorted((f, r) for f, n in enumerate([101, 151]) for r in range(n))
    assert sorted(sum(shares, [])) == everything
    assert max(map(len, shares)) - min(map(len, shares)) <= 2


@pytest.mark.parametrize("buffer_size", [0, 5, 64])
def test_the_stream_knows_its_epoch_is_over_without_reading_on(tmp_path, buffer_size):
    """``finished_epoch`` turns true with the last example of this process's share, before the
    generator is asked for more, and ``largest_share`` is the biggest share any process gets."""
    files = [write_rows(tmp_path / f"f{i}.jsonl", synthetic_rows(3, seed=i)) for i in range(7)]
    indexes = [index_file(f) for f in files]
    assert largest_share(indexes, 1) == 21 and largest_share(indexes, 2) == 14 and largest_share(indexes, 4) == 7
    for rank in range(2):
        stream = ExampleStream(files, StreamSpec(COLS, seed=7, buffer_size=buffer_size), rank=rank, world_size=2)
        share = 7 if rank == 0 else 14
        seen = []
        for example in stream.iter_epoch():
            seen.append(example)
            assert stream.finished_epoch(0) == (len(seen) == share)
            if len(seen) == share:
                break  # the generator is left unfinished, as after a window that ends the share
        assert len(seen) == share and stream.epoch == 0
        stream.close_epoch(0)
        assert (stream.epoch, stream.file_pos, stream.row_pos) == (1, 0, 0) and not stream.finished_epoch(1)
        assert stream.finished_epoch(0) and len(list(stream.iter_epoch())) == share


@pytest.mark.parametrize("buffer_size", [0, 1, 5])
def test_the_epoch_ends_with_its_last_usable_row_when_bad_rows_follow_it(tmp_path, buffer_size):
    """Bad rows after a share's last usable one (at a file's end, or a whole file of them) do not
    hide the epoch's end: ``finished_epoch`` turns true with the last usable example, in file order
    too, and a stream saved and restored mid-epoch hands out the same rows."""
    bad = [{"prompt": " ", "response": "r"}] * 3
    files = [write_rows(tmp_path / "a.jsonl", synthetic_rows(5, seed=1) + bad),
             write_rows(tmp_path / "b.jsonl", bad + synthetic_rows(4, seed=2) + bad),
             write_rows(tmp_path / "c.jsonl", bad)]
    for rank, world in [(0, 1), (0, 2), (1, 2)]:
        def stream(rank=rank, world=world):
            return ExampleStream(files, StreamSpec(COLS, seed=3, buffer_size=buffer_size), rank=rank, world_size=world)

        whole = _drain(stream())
        share = len(whole)
        assert share == {(0, 1): 9, (0, 2): 6, (1, 2): 3}[rank, world]
        first = stream()
        seen = []
        for example in first.iter_epoch():
            seen.append((example.file_index, example.row))
            assert first.finished_epoch(0) == (len(seen) == share)
            if len(seen) == share:
                break
        assert seen == whole
        if buffer_size == 0:
            assert [f for f, _ in seen] == sorted(f for f, _ in seen)  # no shuffling: file order
        part = stream()
        head = _drain(part, limit=2)
        resumed = stream()
        resumed.load_state_dict(part.state_dict())
        assert head + _drain(resumed) == whole


def test_bad_rows_of_every_kind_are_counted_per_reason(tmp_path):
    good = [json.dumps(r).encode() for r in synthetic_rows(40)]
    bad = {
        b"{not json": "malformed_json", b"": "blank_line", b"\xff\xfe{\"prompt\": 1}": "invalid_utf8",
        b"[1, 2]": "not_an_object", b'{"response": "r"}': "missing_column", b'{"prompt": null, "response": "r"}':
        "null_value", b'{"prompt": "p", "response": 7}': "non_string_value", b'{"prompt": " ", "response": "r"}':
        "empty_value",
    }
    lines = good[:20] + list(bad) + good[20:]
    huge = json.dumps({"prompt": "y" * 3_000_000, "response": "ok"}).encode()  # kept: truncated at collation
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\n".join(lines + [huge]) + b"\n")
    problems = DataProblems()
    got = [e for e in iter_rows(path, 0, COLS, problems=problems) if e is not None]
    assert len(got) == 41 and len(got[-1].prompt) == 3_000_000
    assert problems.by_reason == Counter(bad.values())
    assert problems.first[0] == f"{path} line 21: malformed JSON"
    assert problems.by_file == {str(path): len(bad)}


def _drain(stream, limit=None):
    out = []
    for example in stream.iter_epoch():
        out.append((example.file_index, example.row))
        if limit is not None and len(out) == limit:
            break
    return out


def test_shuffle_covers_every_row_once_per_epoch_and_changes_order(tmp_path):
    files = [write_rows(tmp_path / f"f{i}.jsonl", synthetic_rows(97, seed=i)) for i in range(3)]
    stream = ExampleStream(files, StreamSpec(COLS, seed=7, buffer_size=50))
    first, second = _drain(stream), _drain(stream)
    everything = sorted((f, r) for f in range(3) for r in range(97))
    assert sorted(first) == everything and sorted(second) == everything
    assert first != second and first != everything
    assert stream.epoch == 2


@pytest.mark.parametrize("cut", [1, 49, 50, 150, 290])
def test_stream_state_resumes_exactly_including_the_shuffle_buffer(tmp_path, cut):
    files = [write_rows(tmp_path / f"f{i}.jsonl", synthetic_rows(97, seed=i)) for i in range(3)]
    straight = _drain(ExampleStream(files, StreamSpec(COLS, seed=7, buffer_size=50)))
    stream = ExampleStream(files, StreamSpec(COLS, seed=7, buffer_size=50))
    head = _drain(stream, limit=cut)
    state = stream.state_dict()
    resumed = ExampleStream(files, StreamSpec(COLS, seed=7, buffer_size=50))
    resumed.load_state_dict(state)
    assert head + _drain(resumed) == straight


@pytest.mark.parametrize("cut", [1, 60, 200])
def test_a_byte_bounded_shuffle_buffer_holds_long_rows_few_at_a_time_and_resumes_exactly(tmp_path, cut):
    """Rows of 1 to 30 KB through a 50-row buffer bounded at 64 KB: it never holds more than the bound and the
    row that came in over it, every row comes out once, and a stream restored mid-epoch continues exactly."""
    rng = random.Random(5)
    rows = [{"prompt": "x" * rng.randint(1_000, 30_000), "response": "y"} for _ in range(120)]
    files = [write_rows(tmp_path / "long.jsonl", rows), write_rows(tmp_path / "short.jsonl", synthetic_rows(97))]
    bound, most = 64_000, max(example_bytes(Example(r["prompt"], "y", 0, 0)) for r in rows)

    def stream():
        return ExampleStream(files, StreamSpec(COLS, seed=7, buffer_size=50, buffer_bytes=bound))

    watched, held = stream(), []
    for _ in watched.iter_epoch():
        held.append((len(watched.buffer), sum(map(example_bytes, watched.buffer))))
    straight = _drain(stream())
    assert sorted(straight) == sorted((f, r) for f, n in ((0, 120), (1, 97)) for r in range(n))
    assert max(b for _, b in held) <= bound + most and min(n for n, _ in held[:150]) < 10  # long rows: a few
    assert max(n for n, _ in held) == 50  # short rows: the rows' bound
    assert _drain(ExampleStream(files, StreamSpec(COLS, seed=7, buffer_size=50))) != straight
    first = stream()
    head = _drain(first, limit=cut)
    resumed = stream()
    resumed.load_state_dict(first.state_dict())
    assert head + _drain(resumed) == straight


def test_a_byte_bounded_buffer_of_token_ids_resumes_exactly_through_a_saved_checkpoint(tmp_path):
    """Token ids (a prepared corpus) restored by torch.load are lists of another capacity than as read: the
    bound counts their content, so a resumed stream hands them out in the same order."""
    import torch

    from data.sources.readers import TOKEN_COLUMNS
    from lowmem.checkpointing.checkpoint import load_state

    rng = random.Random(3)
    rows = [{"input_ids": [rng.randrange(300, 8000) for _ in range(rng.randint(50, 2000))], "labels": [5, 6]}
            for _ in range(150)]
    files = [write_rows(tmp_path / "prepared.parquet", rows)]

    def stream():
        return ExampleStream(files, StreamSpec(TOKEN_COLUMNS, seed=7, buffer_size=50, buffer_bytes=400_000))

    straight = _drain(stream())
    assert straight != _drain(ExampleStream(files, StreamSpec(TOKEN_COLUMNS, 7, 50)))  # the bound binds
    for cut in (1, 40, 90):
        first = stream()
        head = _drain(first, limit=cut)
        torch.save(first.state_dict(), tmp_path / "process_0.pt")
        resumed = stream()
        resumed.load_state_dict(load_state(tmp_path / "process_0.pt"))  # as a resume reads it
        assert head + _drain(resumed) == straight, cut
    grown = []
    for token in rows[0]["input_ids"]:
        grown.append(token)  # a list grown by appends holds spare capacity
    assert example_bytes(Example(grown, [5, 6], 0, 0)) == example_bytes(Example(list(rows[0]["input_ids"]), [5, 6],
                                                                                 0, 0))
    emoji = "a" * 1000 + "\U0001f600"  # one emoji makes Python store every character in 4 bytes
    assert example_bytes(Example(emoji, "", 0, 0)) >= 4 * 1001 > example_bytes(Example("a" * 1001, "", 0, 0))


def test_a_raw_text_document_counts_once_against_the_bound(tmp_path):
    """Raw text is one column, read as prompt and response alike: the bound holds as many documents as it
    holds pairs of the same text and a one-word answer."""
    docs = [{"text": f"{i} " + "x" * 10_000, "answer": "y"} for i in range(60)]
    path = write_rows(tmp_path / "docs.jsonl", docs)

    def most_held(columns):
        stream, held = ExampleStream([path], StreamSpec(columns, seed=7, buffer_size=50, buffer_bytes=100_000)), []
        for _ in stream.iter_epoch():
            held.append(len(stream.buffer))
        return max(held)

    assert most_held(("text",)) == most_held(("text", "answer")) == 9  # 100 KB of 10 KB rows (twice each: 4)


def test_a_byte_bound_that_never_binds_keeps_the_rows_bounds_order(tmp_path):
    """Short rows under the default bound shuffle exactly as before the bound existed (runs resume alike)."""
    files = [write_rows(tmp_path / f"f{i}.jsonl", synthetic_rows(97, seed=i)) for i in range(3)]
    plain = ExampleStream(files, StreamSpec(COLS, seed=7, buffer_size=50))
    bounded = ExampleStream(files, StreamSpec(COLS, seed=7, buffer_size=50, buffer_bytes=64 * 2**20))
    assert _drain(bounded) == _drain(plain) and _drain(bounded) == _drain(plain)  # two epochs


def test_collator_truncates_pads_dynamically_and_masks_labels(tokenizer):

    collate = Seq2SeqCollator(tokenizer, max_source_len=8, max_target_len=6)
    long_text = "the quick brown fox jumps over the lazy dog " * 50
    batch = collate([Example("a b", "c", 0, 0), Example(long_text, long_text, 0, 1)])
    assert batch["input_ids"].shape == (2, 8) and batch["labels"].shape == (2, 6)
    assert batch["input_ids"][1, -1].item() == tokenizer.eos_token_id  # truncation keeps the eos
    short = collate([Example("a b", "c", 0, 0), Example("a", "d", 0, 1)])
    assert short["input_ids"].shape[1] < 8  # padded to the longest row, not to max length
    assert (short["labels"] == -100).sum() == (short["labels"].shape[1] * 2 - (short["labels"] != -100).sum())
    pad_positions = short["labels"] == -100
    assert pad_positions.any() or short["labels"].shape[1] == 2
    assert not (short["labels"] == tokenizer.pad_token_id).any()


def test_eval_examples_are_bounded(tmp_path):
    path = write_rows(tmp_path / "e.jsonl", synthetic_rows(500))
    assert len(take_examples([path], COLS, 37)) == 37


def test_held_out_eval_rows_are_cut_from_the_end_and_never_streamed(tmp_path):
    """Without --eval_file the last rows of the training files are the eval set: at most 10 % of the
    rows, counted back from the last file, and no process's stream ever reads them."""
    sizes = {"a.parquet": 97, "b.csv": 40, "c.jsonl": 5}
    files = [write_rows(tmp_path / name, synthetic_rows(n, seed=i)) for i, (name, n) in enumerate(sizes.items())]
    indexes = [index_file(f) for f in files]
    kept, ranges = hold_out(indexes, 20)
    assert ranges == [(1, 31, 40), (2, 0, 5)]  # 10 % of 142 rows: 14, from the end
    assert [i.rows for i in kept] == [97, 31, 0] and [i.rows for i in indexes] == [97, 40, 5]
    assert hold_out(indexes, 3)[1] == [(2, 2, 5)] and hold_out(indexes, 20) == (kept, ranges)
    held = {(n, row) for n, start, end in ranges for row in range(start, end)}
    evals = read_ranges(files, ranges, COLS, indexes)
    assert {(e.file_index, e.row) for e in evals} == held
    rows_b = synthetic_rows(40, seed=1)
    assert [(e.prompt, e.response) for e in evals[:9]] == [(r["prompt"], r["response"]) for r in rows_b[31:]]
    for world in (1, 2):
        streamed = []
        for rank in range(world):
            stream = ExampleStream(files, StreamSpec(COLS, seed=3, buffer_size=16), rank, world, indexes=kept)
            streamed += _drain(stream)
        assert len(streamed) == len(set(streamed)) == 142 - 14
        assert set(streamed) | held == {(n, r) for n, size in enumerate(sizes.values()) for r in range(size)}


def test_whitespace_runs_do_not_count_against_the_pre_tokenization_cut(tokenizer):
    """The text is cut before tokenizing (16 characters per allowed token); whitespace makes no
    token, so it must not use up that allowance: the cut result equals tokenizing the whole text."""
    import random

    from data.collate import text_head

    collate = Seq2SeqCollator(tokenizer, max_source_len=32, max_target_len=32)
    rng = random.Random(0)
    words = ["标题", "这是正文内容", "hello", "world", "ni hao", "模型应该看到这些字。"]
    texts = ["标题" + " " * 3000 + "这是正文内容，模型应该看到这些字。" * 5,
             "\n" * 600 + "hello world " * 200]
    texts += ["".join(rng.choice(words) + " " * rng.choice([1, 1, 40, 900]) for _ in range(60)) for _ in range(20)]
    for text in texts:
        assert collate.token_ids([text], 32) == tokenizer([text], max_length=32, truncation=True)["input_ids"]
    assert text_head("ab" + " " * 10 + "cd", 3) == "ab" + " " * 10 + "c" and text_head("abc", 10) == "abc"


def test_rows_no_tokenizer_takes_are_counted_not_fatal(tmp_path):
    """A JSON escape holding half of a UTF-16 pair (an emoji cut in two), an integer beyond Python's
    4300 digits and deep nesting are bad rows like any other, not a crash mid-run."""
    path = tmp_path / "odd.jsonl"
    good = [json.dumps(r) for r in synthetic_rows(6)]
    path.write_text("\n".join(good[:3] + ['{"prompt": "emoji cut \\ud83d", "response": "x"}',
                                          '{"prompt": "p", "response": "r", "id": ' + "7" * 5000 + "}",
                                          "[" * 100_000] + good[3:]) + "\n")
    problems = DataProblems()
    got = [e for e in iter_rows(path, 0, COLS, problems=problems) if e is not None]
    assert len(got) == 6
    assert problems.by_reason == Counter({"invalid_utf8": 1, "malformed_json": 2})


def test_a_csv_quote_that_never_closes_is_an_error_naming_its_row(tmp_path):
    rows = "".join(f"p{i},r{i}\n" for i in range(50))
    (tmp_path / "bad.csv").write_text("prompt,response\n" + rows + '"open,r\n' + rows)
    with pytest.raises(UserError, match=r"opens in row 51 never closes"):
        index_file(tmp_path / "bad.csv")
    # Quotes that close (a quoted newline; a bare quote inside an unquoted value) are fine
    (tmp_path / "ok.csv").write_text('prompt,response\n"a\nb",c\nd"e,f')
    assert index_file(tmp_path / "ok.csv").rows == 2
    # In the first record, the column check leaves it to that error: the header has both columns
    (tmp_path / "first.csv").write_text('prompt,response\n"a,b\nc,d\n')
    check_columns([tmp_path / "first.csv"], COLS, "--train_file")
    with pytest.raises(UserError, match=r"opens in row 1 never closes"):
        index_file(tmp_path / "first.csv")


def test_folders_skip_hidden_entries_follow_links_and_refuse_the_run_inside(tmp_path):
    a = write_rows(tmp_path / "d" / "a.jsonl", synthetic_rows(3))
    write_rows(tmp_path / "d" / ".ipynb_checkpoints" / "a-checkpoint.jsonl", synthetic_rows(3))
    write_rows(tmp_path / "d" / ".hidden.jsonl", synthetic_rows(3))
    linked = write_rows(tmp_path / "other" / "b.jsonl", synthetic_rows(3))
    (tmp_path / "d" / "link").symlink_to(tmp_path / "other")
    (tmp_path / "d" / "loop").symlink_to(tmp_path / "d")
    (tmp_path / "d" / "c.jsonl.gz").write_bytes(b"")
    assert resolve_files(str(tmp_path / "d")) == [a, tmp_path / "d" / "link" / linked.name]
    from data.sources.corpus import ignored_in_folders

    assert ignored_in_folders(str(tmp_path / "d")) == [tmp_path / "d" / "c.jsonl.gz"]
    with pytest.raises(UserError, match="is inside --train_file"):
        resolve_files(str(tmp_path / "d"), "--train_file", output_dir=str(tmp_path / "d" / "runs" / "sft"))


def test_a_stream_refuses_a_position_taken_on_other_files_and_a_file_that_shrank(tmp_path):
    files = [write_rows(tmp_path / f"f{i}.jsonl", synthetic_rows(30, seed=i)) for i in range(2)]
    stream = ExampleStream(files, StreamSpec(COLS, seed=7, buffer_size=5))
    _drain(stream, limit=10)
    state = stream.state_dict()
    added = files + [write_rows(tmp_path / "f2.jsonl", synthetic_rows(5))]
    with pytest.raises(UserError, match=r"changed since the checkpoint \(added f2.jsonl\)"):
        ExampleStream(added, StreamSpec(COLS, seed=7, buffer_size=5)).load_state_dict(state)
    write_rows(files[0], synthetic_rows(31))
    with pytest.raises(UserError, match=r"f0.jsonl has 31 training rows, had 30"):
        ExampleStream(files, StreamSpec(COLS, seed=7, buffer_size=5)).load_state_dict(state)
    moved = [write_rows(tmp_path / "moved" / f"f{i}.jsonl", synthetic_rows(30, seed=i)) for i in range(2)]
    ExampleStream(moved, StreamSpec(COLS, seed=7, buffer_size=5)).load_state_dict(state)  # same names and rows: resumes

    stream = ExampleStream(files[1:], StreamSpec(COLS, seed=7, buffer_size=0))
    write_rows(files[1], synthetic_rows(12))  # rewritten shorter after the run indexed it
    with pytest.raises(UserError, match=r"f1.jsonl ended at row 12 of the 30 .* changed during training"):
        _drain(stream)


def test_a_file_is_found_by_its_name_even_when_it_looks_like_a_pattern_or_a_list(tmp_path, monkeypatch):
    from pathlib import Path

    from data.sources.corpus import resolve_files

    rows = synthetic_rows(3)
    bracket = write_rows(tmp_path / "c[1].jsonl", rows)
    comma = write_rows(tmp_path / "my file, v2.jsonl", rows)
    other = write_rows(tmp_path / "b.jsonl", rows)
    assert resolve_files(str(bracket), "--train_file") == [bracket]  # a name, not the pattern "c1.jsonl"
    assert resolve_files(str(comma), "--train_file") == [comma]  # a name, not a list of two
    write_rows(tmp_path / "d" / "squad,v2.jsonl", rows)  # d/squad alone would be a hub dataset's id
    monkeypatch.chdir(tmp_path)
    assert resolve_files("d/squad,v2.jsonl", "--train_file") == [Path("d/squad,v2.jsonl")]
    assert resolve_files(f"{other},{bracket}", "--train_file") == [other, bracket]
    assert len(resolve_files(str(tmp_path / "*.jsonl"), "--train_file")) == 3
    with pytest.raises(UserError, match="commas separate files"):
        resolve_files(f"{other},{tmp_path / 'nothing.jsonl'}", "--train_file")


def test_a_blank_line_is_one_reason_in_every_text_format(tmp_path):
    from pathlib import Path

    from data.sources.readers import read_range

    (tmp_path / "a.csv").write_text("prompt,response\na,b\n\nc,d\n")
    (tmp_path / "a.jsonl").write_text('{"prompt": "a", "response": "b"}\n\n{"prompt": "c", "response": "d"}\n')
    for name in ("a.csv", "a.jsonl"):
        records = [record for _, record in read_range(Path(tmp_path / name), None, 0, None)]
        assert records[1] == "blank_line" and records[2] == {"prompt": "c", "response": "d"}, name
