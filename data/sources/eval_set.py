"""The eval set: the first ``--max_eval_samples`` usable rows of ``--eval_file``, or, given only
``--train_file``, its last rows held out of training (never trained on, the same rows in every run
and in ``evaluate`` / ``generate``). A Hugging Face dataset (``data.sources.hf_datasets``) gives its
``validation`` (else ``test``) split, or else its first rows, held out (``dataset_eval_split``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from data.objectives.base import objective_class
from data.sources.corpus import DataProblems, Example, check_columns, iter_rows, resolve_files
from data.sources.hf_datasets import EVAL_SPLITS, DatasetRef, dataset_of, eval_split_name, row_count, with_split
from data.sources.readers import FileIndex, index_file, manifest_of
from lowmem.utils.errors import UserError


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
            for item in iter_rows(files[n], n, columns, (start, end), indexes[n], problems) if item is not None]


def eval_files_of(cfg, train_files: list[Path]) -> list[Path]:
    """The files of ``cfg.eval_file``, checked; none when the eval set is held out of ``train_files``."""
    if cfg.eval_file is None:
        if manifest_of(train_files):
            raise UserError("--train_file holds prepared shards (token ids), so no eval rows can be held out of "
                            "it: pass --eval_file with text rows (BLEU compares decoded answers)")
        return []
    objective = objective_class(cfg.objective)
    files = resolve_files(cfg.eval_file, "--eval_file", cfg.output_dir, objective.formats, cfg.dataset_config)
    files = [with_split(f, (*EVAL_SPLITS, "train")) if isinstance(f, DatasetRef) else f for f in files]
    if manifest_of(files):
        raise UserError("--eval_file must be text (BLEU compares decoded answers): pass the original corpus, "
                        "not prepared shards")
    check_columns(files, objective.text_columns(cfg), "--eval_file")
    return files


def eval_split(cfg, eval_files: list[Path], train_files: list[Path], indexes: list[FileIndex] | None = None,
               problems: DataProblems | None = None) -> tuple[list[Example], list[FileIndex] | None, int]:
    """The eval set and what it leaves for training: (eval examples, training indexes, rows held out).

    With ``eval_files``, their first ``--max_eval_samples`` usable rows (``indexes`` come back as
    given); without (no ``--eval_file`` beside your own ``--train_file``), the last rows of the
    training files (``hold_out``; the files are indexed here when ``indexes`` is None), which the
    returned indexes then leave out.
    """
    columns = objective_class(cfg.objective).text_columns(cfg)
    if dataset_of(train_files) is not None:
        return dataset_eval_split(cfg, eval_files, dataset_of(train_files), problems)
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


def dataset_eval_split(cfg, eval_files: list[Path], source: DatasetRef,
                       problems: DataProblems | None = None) -> tuple[list[Example], list[FileIndex], int]:
    """``eval_split`` for a dataset ``--train_file``: the first ``--max_eval_samples`` usable rows of
    ``eval_files`` when given, else of the dataset's ``validation`` (else ``test``) split, else of its
    training split, whose first ``min(--max_eval_samples, 10 % of its rows)`` rows (``--max_eval_samples``
    when its row count is unknown) are then held out: training starts after them. The returned index
    holds the training rows (0 when the dataset does not say how many)."""
    rows, columns = row_count(source), objective_class(cfg.objective).text_columns(cfg)
    held, split = 0, eval_split_name(source)
    if not eval_files and split is None:
        held = cfg.max_eval_samples if rows is None else min(cfg.max_eval_samples, int(rows * HOLD_OUT_AT_MOST))
    index = FileIndex(0 if rows is None else rows - held, kind="dataset")
    if eval_files or split is not None:
        examples = take_examples(eval_files or [with_split(source, (split,))], columns,
                                 cfg.max_eval_samples, problems)
        if not examples:
            raise UserError(f"{cfg.eval_file or f'the {split} split of --train_file={cfg.train_file}'} holds no "
                            "usable rows; pass --eval_file")
        return examples, [index], 0
    examples = [e for e in iter_rows(source, 0, columns, (0, held), None, problems) if e is not None]
    if not examples:
        raise UserError(f"--train_file={cfg.train_file}: the {held} row(s) it would hold out for evaluation (its "
                        f"first, {HOLD_OUT_AT_MOST:.0%} of its rows at most) are none or all bad; pass --eval_file")
    return examples, [index], held


def eval_source(cfg, train_files: list, held: int) -> str:
    """Where the eval set comes from, for the log."""
    source = dataset_of(train_files)
    if cfg.eval_file:
        return cfg.eval_file
    if source is None:
        return (f"the last {held:,} rows of --train_file, held out of training (pass --eval_file to evaluate on "
                "another set)")
    if held:
        return f"the first {held:,} rows of --train_file, held out of training (the dataset has no validation split)"
    return f"the '{eval_split_name(source)}' split of --train_file"
