"""Finding corpus files and streaming their rows with bounded memory.

Rows are read one at a time (``data.sources.readers``), so host memory does not depend on the size of a
file; bad rows are counted by reason in ``DataProblems`` instead of failing the run.
"""

from __future__ import annotations

import glob
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from data.sources.hf_datasets import DatasetRef, dataset_of, dataset_ref
from data.sources.readers import (
    MANIFEST,
    REASONS,
    TOKEN_COLUMNS,
    FileIndex,
    csv_header,
    file_kind,
    index_file,
    read_range,
    row_problem,
)
from lowmem.utils.errors import UserError
from lowmem.utils.ownership import is_ours

FORMATS = (".jsonl", ".json", ".parquet", ".csv")  # file endings read by data.sources.readers
TEXT_FORMATS = (*FORMATS, ".txt")  # raw-text objectives also read plain text (data.sources.text_files)


@dataclass(frozen=True)
class Example:
    """One prompt/response pair and where it came from (file index in the run's file list, row).

    Text, or token ids when the corpus was prepared (``python train_low_mem.py prepare``). A chunk
    packed from raw text names the document it starts in, and in ``also`` the others it holds.
    """

    prompt: str | list[int]
    response: str | list[int]
    file_index: int
    row: int
    also: tuple[tuple[int, int], ...] = ()  # (file index, row) of further documents in a packed chunk
    rejected: str | None = None  # a preference pair's rejected answer (its chosen one is the response)

    @classmethod
    def of(cls, record: dict, columns: tuple[str, ...], file_index: int, row: int) -> Example:
        """The example of a usable record: (prompt, response), (prompt, chosen, rejected) of a preference pair, or
        a raw-text row's one column (read as both)."""
        rejected = record[columns[2]] if len(columns) == 3 else None
        return cls(record[columns[0]], record[columns[1 if rejected is not None else -1]], file_index, row,
                   rejected=rejected)

    def saved(self) -> tuple:
        """The example as a stream's checkpoint keeps it (``Example(*saved)`` makes it again)."""
        head = (self.prompt, self.response, self.file_index, self.row)
        return head if self.rejected is None else (*head, self.also, self.rejected)

    def sources(self) -> list[tuple[int, int]]:
        """(file index, row) of every row this example was made from."""
        return [(self.file_index, self.row), *self.also]


def resolve_files(spec: str, flag: str = "--train_file", output_dir: str | None = None,
                  formats: tuple[str, ...] = FORMATS, dataset_config: str | None = None) -> list[Path]:
    """Expand a file, a glob, a folder, or a comma-separated list of those, into sorted data files.

    A Hugging Face dataset (a save_to_disk folder, a hub id, a local copy of a hub dataset repository:
    ``data.sources.hf_datasets``) is one ``DatasetRef`` instead, read with ``dataset_config``; it must be named alone.

    A folder gives its data files at any depth (through linked folders too), leaving out hidden
    files and folders (``.ipynb_checkpoints``, ``.git``) as a glob's ``*`` does. A file reached
    twice (a folder and one of its files, a name listed twice, a link) is read once, where it is
    first reached: read twice, its rows would train twice per epoch, and a copy outside the eval
    hold-out would train on the held-out rows (``repeated_files`` names them for the log).

    Raises:
        UserError: when nothing matches, a matched file has an unsupported ending, or the run's
            ``output_dir`` lies inside a data folder (its own files would become training rows).
    """
    source = _dataset(spec, flag, output_dir, dataset_config)
    if source is not None:
        return [source]
    files, seen = [], set()
    for path in _expand(spec, flag, output_dir, formats):
        real = os.path.realpath(path)
        if real not in seen:
            seen.add(real)
            files.append(path)
    return files


def spec_parts(spec: str) -> list[str]:
    """The paths (or patterns, or a dataset) a --train_file / --eval_file names: comma-separated, unless the whole
    text names an existing file or folder (``my file, v2.jsonl``), which is then taken as it is."""
    if Path(str(spec).strip()).expanduser().exists():
        return [str(spec).strip()]
    return [part.strip() for part in str(spec).split(",") if part.strip()]


def _dataset(spec: str, flag: str, output_dir: str | None, config: str | None) -> DatasetRef | None:
    """The dataset ``spec`` names, if it names one (alone)."""
    parts = spec_parts(spec)
    found = [ref for ref in (dataset_ref(p, flag, config) for p in parts) if ref is not None]
    if not found:
        return None
    if len(parts) > 1:
        raise UserError(f"{flag}={spec}: {found[0].spec} is a dataset; name it alone, not in a list of files")
    folder = Path(found[0].spec).expanduser()
    if output_dir is not None and folder.is_dir() and folder.resolve() in [*Path(output_dir).resolve().parents,
                                                                          Path(output_dir).resolve()]:
        raise UserError(f"--output_dir={output_dir} is inside {flag}={spec}: choose an --output_dir outside it")
    return found[0]


def repeated_files(spec: str, formats: tuple[str, ...] = FORMATS) -> list[Path]:
    """The files ``spec`` reaches more than once (each named once), which ``resolve_files`` reads once."""
    if _dataset(spec, "--train_file", None, None) is not None:
        return []
    reached = [os.path.realpath(p) for p in _expand(spec, "--train_file", None, formats)]
    return [Path(p) for p in dict.fromkeys(p for p in reached if reached.count(p) > 1)]


def _expand(spec: str, flag: str, output_dir: str | None = None, formats: tuple[str, ...] = FORMATS) -> list[Path]:
    files: list[Path] = []
    parts = spec_parts(spec)
    for part in parts:
        path = Path(part).expanduser()
        if path.is_dir():
            if output_dir is not None and path.resolve() in [*Path(output_dir).resolve().parents,
                                                              Path(output_dir).resolve()]:
                raise UserError(f"--output_dir={output_dir} is inside {flag}={part}: the run's own files "
                                "(metrics.jsonl, ...) would be read as data; choose an --output_dir outside it")
            if is_ours(path, "prepared") and not (path / MANIFEST).is_file():
                raise UserError(f"{flag}={part} holds an unfinished prepare (stopped before its "
                                f"{MANIFEST} was written): run prepare into it again")
            inside = folder_files(path)
            found = [p for p in inside if p.suffix.lower() in formats]
            if not found:
                text = ".txt" not in formats and any(p.suffix.lower() == ".txt" for p in inside)
                raise UserError(f"{flag}={part} is a folder with no {'/'.join(formats)} files" + (
                    " (its .txt files are raw text, read by --objective=span_corruption or prefix_lm)" if text else ""))
        elif path.is_file():  # before the pattern test: c[1].jsonl is a file's name
            found = [path]
        elif any(ch in part for ch in "*?["):
            found = sorted(Path(p) for p in glob.glob(os.path.expanduser(part), recursive=True) if Path(p).is_file())
            if not found:
                raise UserError(f"{flag}={part} matches no file")
        else:
            commas = " (commas separate files: pass a file whose name has one by its folder)" if len(parts) > 1 else ""
            raise UserError(f"{flag}={part} does not exist{commas}")
        for p in found:
            if p.suffix.lower() not in formats:
                raw = " (.txt: raw text, read by --objective=span_corruption or prefix_lm)" \
                    if p.suffix.lower() == ".txt" and ".txt" not in formats else ""
                raise UserError(f"{flag}: {p} has an unsupported ending; use one of {', '.join(formats)}{raw}")
            if not os.access(p, os.R_OK):
                raise UserError(f"{flag}: {p} is not readable")
        files.extend(found)
    if not files:
        raise UserError(f"{flag} is empty")
    return files


def folder_files(folder: Path) -> list[Path]:
    """Every visible file under ``folder``, sorted; linked folders are followed (each real folder once)."""
    out, seen = [], set()
    for root, dirs, names in os.walk(folder, followlinks=True):
        real = os.path.realpath(root)
        if real in seen:  # a link back up the tree, or two links to one folder
            dirs[:] = []
            continue
        seen.add(real)
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        out.extend(Path(root) / n for n in names if not n.startswith("."))
    return sorted(p for p in out if p.is_file())


def ignored_in_folders(spec: str, formats: tuple[str, ...] = FORMATS) -> list[Path]:
    """The visible files of ``spec``'s folders that are not data files (told to the user, not read)."""
    if _dataset(spec, "--train_file", None, None) is not None:
        return []
    folders = [Path(p).expanduser() for p in spec_parts(spec)]
    return [p for folder in folders if folder.is_dir() for p in folder_files(folder)
            if p.suffix.lower() not in formats and p.name != MANIFEST]


NOT_ROWS = ("blank_line",)


class DataProblems:
    """Bad rows counted by reason and by file; the first few are kept (and reported) with their place.

    Args:
        report: called with a one-line description of each of the first ``REPORT_FIRST`` bad rows.
    """

    REPORT_FIRST = 5

    def __init__(self, report=None):
        self.report = report
        self.by_reason: Counter = Counter()
        self.by_file: Counter = Counter()
        self.first: list[str] = []

    @property
    def total(self) -> int:
        return sum(self.by_reason.values())

    @property
    def counted(self) -> int:
        """The bad rows --max_bad_rows_fraction is taken against: not a JSONL file's blank lines (a trailing one
        is common), which are shown in the counts but hold no row that was lost."""
        return self.total - sum(self.by_reason[reason] for reason in NOT_ROWS)

    def add(self, path: Path, kind: str, row: int, reason: str, column: str) -> None:
        self.by_reason[reason] += 1
        self.by_file[str(path)] += 1
        if len(self.first) < self.REPORT_FIRST:
            text = f"{path} {row_place(kind, row)}: {REASONS[reason]}" + (f" '{column}'" if column else "")
            self.first.append(text)
            if self.report is not None:
                self.report(f"skipping bad row: {text}")

    def state_dict(self) -> dict:
        return {"by_reason": dict(self.by_reason), "by_file": dict(self.by_file), "first": list(self.first)}

    def load_state_dict(self, state: dict) -> None:
        self.by_reason, self.by_file = Counter(state["by_reason"]), Counter(state["by_file"])
        self.first = list(state["first"])

    @classmethod
    def merge(cls, states: list[dict]) -> dict:
        """The sum of several processes' ``state_dict()``s."""
        total = cls()
        for state in states:
            total.by_reason.update(state["by_reason"])
            total.by_file.update(state["by_file"])
            total.first.extend(state["first"][: cls.REPORT_FIRST - len(total.first)])
        return total.state_dict()


def too_many_bad_rows(bad: int, rows: int, fraction: float, by_reason: dict, what: str = "training rows") -> UserError:
    """The error that stops a run (or ``prepare``) with more bad rows than --max_bad_rows_fraction allows."""
    fix = "fix the data" if bad >= rows else "fix the data, or raise --max_bad_rows_fraction to skip them"
    reasons = ", ".join(f"{k}: {v}" for k, v in by_reason.items() if k not in NOT_ROWS)
    return UserError(f"{bad} of {rows} {what} are bad, more than --max_bad_rows_fraction={fraction} allows "
                     f"({reasons}); {fix}")


def bad_rows_report(train: dict, rows_read: int, train_rows: int, eval_problems: DataProblems,
                    prepared: dict | None) -> tuple[dict, str | None]:
    """The ``data_errors`` event and its log line (None when no row was bad).

    Args:
        train: the training bad rows summed over processes (``DataProblems.merge``).
        prepared: the manifest of a corpus tokenized by ``prepare``, which skipped its own bad rows.
    """
    bad, eval_bad = sum(train["by_reason"].values()), eval_problems.total
    event = {"bad_rows": bad, "rows_read": rows_read, "train_rows": train_rows,
             "by_reason": train["by_reason"], "by_file": train["by_file"], "first": train["first"],
             "eval_bad_rows": eval_bad, "eval_by_reason": dict(eval_problems.by_reason)}
    prepared_bad = prepared["bad_rows"] if prepared else 0  # skipped by `prepare`, before the shards
    if prepared:
        event.update(prepared_bad_rows=prepared_bad, prepared_by_reason=prepared["bad_rows_by_reason"])
    if not (bad or eval_bad or prepared_bad):
        return event, None
    line = (f"bad rows skipped: {bad} of {rows_read} training rows read "
            f"({', '.join(f'{k} {v}' for k, v in train['by_reason'].items()) or 'none'})"
            + (f"; {prepared_bad} when the corpus was prepared" if prepared_bad else "")
            + (f"; {eval_bad} in the eval file" if eval_bad else ""))
    return event, line


def file_notes(train_spec: str, train_files: list[Path], eval_files: list[Path], eval_given: bool,
               formats: tuple[str, ...] = FORMATS) -> list[str]:
    """What the log says about the files: those not read, those reached twice, an eval set trained on
    (``eval_given``: the eval files are --eval_file's, not rows held out of --train_file)."""
    notes = []
    if dataset_of(train_files) is not None:
        return notes  # one dataset: no files left out or reached twice

    def some(paths: list) -> str:
        return ", ".join(str(p) for p in paths[:3]) + (" ..." if len(paths) > 3 else "")

    ignored = ignored_in_folders(train_spec, formats)
    if ignored:
        notes.append(f"not read: {len(ignored)} file(s) in the --train_file folder(s) without a data ending "
                     f"({'/'.join(formats)}): {some(ignored)}")
    repeated = repeated_files(train_spec, formats)
    if repeated:
        notes.append(f"read once: {len(repeated)} file(s) that --train_file reaches more than once: {some(repeated)}")
    trained = {os.path.realpath(p) for p in train_files}
    shared = [p for p in eval_files if isinstance(p, Path) and os.path.realpath(p) in trained] if eval_given else []
    if shared:
        notes.append(f"--eval_file shares {len(shared)} file(s) with --train_file ({some(shared)}): the eval "
                     "loss and BLEU measure rows the model trains on")
    return notes


def row_place(kind: str, row: int) -> str:
    """Where a row is, as a user finds it: the line of a jsonl file, the row of any other (1-based)."""
    return f"line {row + 1}" if kind == "jsonl" else f"row {row + 1}"


def iter_rows(path: Path, file_index: int, columns: tuple[str, str], rows: tuple[int, int | None] = (0, None),
              index: FileIndex | None = None, problems: DataProblems | None = None) -> Iterator[Example | None]:
    """Stream rows ``start`` ≤ row < ``end`` (``rows``; an end of None: to the end) of one file (seeking, not
    reading, to the start).

    Yields an ``Example`` per usable row and ``None`` for a bad row (counted in ``problems``), so
    the caller keeps an exact row position either way. Only a start past the first row needs the
    file's index (built here when not given); reading from the start makes no pass over it first.
    """
    start_row, end_row = rows
    if index is None and start_row:
        index = index_file(path)
    kind = index.kind if index is not None else file_kind(path)
    for row, record in read_range(path, index, start_row, end_row, columns):
        problem = row_problem(record, columns)
        if problem:
            if problems is not None:
                problems.add(path, kind, row, *problem)
            yield None
            continue
        yield Example.of(record, columns, file_index, row)


def check_columns(files: list[Path], columns: tuple[str, str], flag: str, sample: int = 100) -> None:
    """Fail early, before any model is built (or a run folder made), when no row among the first rows of a
    file (``sample`` of the first, 10 of each other) has the configured columns, or a column holds no text
    there, only numbers or booleans (single bad rows are counted later, not fatal), or no file has a row."""
    read = sum(_check_file_columns(path, columns, flag, sample if i == 0 else 10) for i, path in enumerate(files))
    if not read:
        raise UserError(f"{flag} is empty (no rows in {len(files)} file(s))")


def _check_file_columns(path: Path, columns: tuple[str, str], flag: str, sample: int) -> int:
    """``check_columns`` for one file; returns the rows read."""
    kind = file_kind(path)
    # A csv file's columns are its header's: a broken first record (a quote never closed) is not a missing column
    seen: dict[str, None] = dict.fromkeys(csv_header(path)) if kind == "csv" else {}
    found: dict[str, set[str]] = {c: set() for c in columns}  # the value types met in each column
    read = 0
    plain_text = kind == "txt"  # its one column is the one asked for
    first = None  # the first row's record (or its problem)
    for _, record in read_range(path, None, 0, sample, columns if plain_text else None):
        read += record != "blank_line"  # a file of blank lines holds no row
        first = record if first is None else first
        if isinstance(record, dict):
            seen.update(dict.fromkeys(record))
            for c in columns:
                if record.get(c) is not None:
                    found[c].add(type(record[c]).__name__)
    if kind == "jsonl" and first == "malformed_json" and not seen:
        with open(path, "rb") as fh:
            first_line = fh.readline().strip(b"\xef\xbb\xbf \t\r\n")
        if first_line == b"{":  # a pretty-printed JSON object: nothing in it is a row
            raise UserError(f"{flag}: {path} holds one JSON object spread over lines, not rows: save the rows as a "
                            "JSON array ([{...}, {...}]) or as JSON lines (one object per line)")
    missing = [c for c in columns if c not in seen]
    if len(seen) == 1 and missing and isinstance(wrapped := first, dict) and isinstance(
            next(iter(wrapped.values())), list):  # {"data": [rows]}: one row holding the rows
        raise UserError(f"{flag}: {path} holds one JSON object whose '{next(iter(seen))}' holds a list: save those "
                        "rows as a JSON array ([{...}, {...}]) or as JSON lines (one object per line)")
    if seen and missing:
        which = " and ".join(f"'{c}'" for c in missing)
        separator = next((s for s in ";\t|" if len(seen) == 1 and s in next(iter(seen))), None)
        flags = {1: "--text_column", 2: "--prompt_column / --response_column",
                 3: "--prompt_column / --chosen_column / --rejected_column"}
        fix = (f"it looks separated by {separator!r}, not commas: save it comma-separated" if separator and
               path.suffix.lower() == ".csv" else f"set {flags[len(columns)]}")
        raise UserError(f"{flag}: {path} has no column {which} (columns: {', '.join(seen)}); {fix}")
    text = "list" if columns == TOKEN_COLUMNS else "str"  # a prepared corpus holds token ids
    for column, types in found.items():
        if types and text not in types:
            kinds = ", ".join(VALUE_KINDS.get(t, t) for t in sorted(types))
            raise UserError(f"{flag}: column '{column}' of {path} holds {kinds}, not text, in all of the "
                            f"{read} rows read; store it as text (strings), or point --prompt_column / "
                            "--response_column (--text_column) at the text columns")
    return read


VALUE_KINDS = {"int": "numbers (int)", "float": "numbers (float)", "bool": "booleans", "list": "lists",
               "dict": "objects", "bytes": "bytes", "Decimal": "numbers (decimal)"}
