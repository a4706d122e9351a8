"""The eval set: the first ``--max_eval_samples`` usable rows of ``--eval_file``, or, given only
``--train_file``, its last rows held out of training (never trained on, the same rows in every run
and in ``evaluate`` / ``generate``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from config import UserError
from data.readers import FileIndex, index_file, manifest_of
from data.sources import DataProblems, Example, check_columns, formats_for, iter_rows, resolve_files


def take_examples(files: list[Path], columns: tuple[str, str], limit: int,
                  problems: DataProblems | None = None) -> list[Example]:
    """The first ``limit`` usable examples of ``files`` in order (the eval set; bounded by ``limit``)."""
    out: list[Example] = []
    for index, path in enumerate(files):
        for item in iter_rows(path, index, columns, problems=problems):
            if item is not None:
                out.append(item)
                if len(out) >= limit:
                    return out
    return out


HOLD_OUT_AT_MOST = 0.1  # of the training rows, so a small corpus keeps most of its rows for training


def hold_out(indexes: list[FileIndex], limit: int) -> tuple[list[FileIndex], list[tuple[int, int, int]]]:
    """Split an eval set off the end of the training files, for a run given no ``--eval_file``.

    The last ``min(limit, 10 % of the rows)`` rows, counting back from the last file in the files'
    canonical (sorted) order, are held out. Returns the indexes the training stream reads (those rows
    cut off, so no process ever trains on them) and the held-out ``(file, start row, end row)``
    ranges. A pure function of the indexes: every process and every resume gets the same split.
    """
    count = min(limit, int(sum(i.rows for i in indexes) * HOLD_OUT_AT_MOST))
    kept, ranges = list(indexes), []
    for n in reversed(range(len(kept))):
        take = min(count, kept[n].rows)
        if take:
            ranges.append((n, kept[n].rows - take, kept[n].rows))
            kept[n] = dataclasses.replace(kept[n], rows=kept[n].rows - take)
            count -= take
    return kept, ranges[::-1]


def read_ranges(files: list[Path], ranges: list[tuple[int, int, int]], columns: tuple[str, str],
                indexes: list[FileIndex], problems: DataProblems | None = None) -> list[Example]:
    """The usable examples of ``(file, start row, end row)`` ranges (bad rows counted in ``problems``)."""
    return [item for n, start, end in ranges
            for item in iter_rows(files[n], n, columns, start, end, indexes[n], problems) if item is not None]


def eval_files_of(cfg, train_files: list[Path]) -> list[Path]:
    """The files of ``cfg.eval_file``, checked; none when the eval set is held out of ``train_files``."""
    if cfg.eval_file is None:
        if manifest_of(train_files):
            raise UserError("--train_file holds prepared shards (token ids), so no eval rows can be held out of "
                            "it: pass --eval_file with text rows (BLEU compares decoded answers)")
        return []
    files = resolve_files(cfg.eval_file, "--eval_file", cfg.output_dir, formats_for(cfg))
    if manifest_of(files):
        raise UserError("--eval_file must be text (BLEU compares decoded answers): pass the original corpus, "
                        "not prepared shards")
    check_columns(files, cfg.text_columns, "--eval_file")
    return files


def eval_split(cfg, eval_files: list[Path], train_files: list[Path], indexes: list[FileIndex] | None = None,
               problems: DataProblems | None = None) -> tuple[list[Example], list[FileIndex] | None, int]:
    """The eval set and what it leaves for training: (eval examples, training indexes, rows held out).

    With ``eval_files``, their first ``--max_eval_samples`` usable rows (``indexes`` come back as
    given); without (no ``--eval_file`` beside your own ``--train_file``), the last rows of the
    training files (``hold_out``; the files are indexed here when ``indexes`` is None), which the
    returned indexes then leave out.
    """
    columns = cfg.text_columns
    if indexes is None and not eval_files:
        indexes = [index_file(f) for f in train_files]
    if indexes is not None and not sum(i.rows for i in indexes):
        raise UserError(f"--train_file={cfg.train_file} is empty (no rows in {len(indexes)} file(s))")
    if eval_files:
        examples = take_examples(eval_files, columns, cfg.max_eval_samples, problems)
        if not examples:
            raise UserError(f"--eval_file={cfg.eval_file} holds no usable rows")
        return examples, indexes, 0
    indexes, ranges = hold_out(indexes, cfg.max_eval_samples)
    examples = read_ranges(train_files, ranges, columns, indexes, problems)
    held = sum(end - start for _, start, end in ranges)
    if not examples and held:
        raise UserError(f"--train_file={cfg.train_file}: the {held} row(s) it would hold out for evaluation (its last, "
                        f"{HOLD_OUT_AT_MOST:.0%} of its rows at most) are all bad; fix the data, or pass --eval_file")
    if not examples:
        raise UserError(f"--train_file={cfg.train_file} has too few rows to hold out an eval set "
                        f"({HOLD_OUT_AT_MOST:.0%} of its rows at most): pass --eval_file")
    return examples, indexes, held
