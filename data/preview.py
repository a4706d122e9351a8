"""``python train_low_mem.py preview``: the first training examples as the model will see them, one
JSON object per line: ``input_ids``, ``labels`` and, for objectives that rewrite raw text,
``original_ids`` (the chunk before corruption); with ``decode`` the texts too, sentinels shown. With
``--packing=True``: the packed rows of the first optimizer step, with their segment ids and examples."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import replace

from config import TrainConfig
from data.objectives.base import objective_for
from data.pipeline import DataProcess, build_data, check_data
from data.sources.eval_set import eval_files_of
from data.streams.packed_text import PackedStream
from lowmem.utils.errors import UserError


def preview_examples(cfg: TrainConfig, tokenizer, count: int, decode: bool = False, report=print) -> Iterator[dict]:
    """The first ``count`` examples of the run's training stream (process 0 of 1), nothing heavy built."""
    objective = objective_for(cfg)
    files = check_data(cfg, objective, eval_set=False)
    # train holds the eval set out of a text corpus given no --eval_file (and so does the preview); never out of
    # prepared shards, which train reads beside an --eval_file
    files = files if files.prepared else replace(files, eval=eval_files_of(cfg, files.train))
    data = build_data(cfg, files, tokenizer, DataProcess(report=report, warn=report), eval_set=not files.prepared)
    shape = objective.describe()
    report(f"--objective={objective.name}" + (f": {shape}" if shape else ": each row one example"))
    if data.held_out_rows:
        report(f"{data.held_out_rows} row(s) at the end of --train_file are held out as the eval set, as train holds "
               "them out, so none of them is shown: pass --eval_file to train (and preview) every row")
    if cfg.packing:
        records = packed_preview(cfg, data, tokenizer, count, decode)
    else:
        records = example_records(cfg, data, tokenizer, count, decode)
    shown = 0
    for record in records:
        shown += 1
        yield record
    problems = getattr(data.stream, "problems", None)
    bad = problems.total if problems is not None else 0
    reasons = ", ".join(f"{k} {v}" for k, v in problems.by_reason.items()) if bad else ""
    if not shown:
        detail = f" ({bad} bad: {reasons})" if bad else ""
        raise UserError(f"--train_file has no usable row{detail}: fix the rows named above, or point --prompt_column "
                        "/ --response_column (--text_column) at the text")
    if bad:
        report(f"{bad} bad row(s) among the rows read so far (the shuffle buffer reads ahead): {reasons}; train "
               "counts and reports them too")


def example_records(cfg: TrainConfig, data, tokenizer, count: int, decode: bool) -> Iterator[dict]:
    """The first ``count`` examples, each one record."""
    examples = itertools.islice(data.stream.iter_epoch(), count)
    originals = None
    if isinstance(data.stream, PackedStream):  # the same documents packed again, the chunks kept as they are
        plain = data.fresh_stream()
        plain.make_example = lambda chunk, *_: chunk
        originals = plain.iter_epoch()
    for example in examples:
        sides = {"input_ids": (example.prompt, cfg.max_source_len), "labels": (example.response, cfg.max_target_len)}
        if example.rejected is not None:  # a preference pair: both answers decode against the one input
            sides["rejected_labels"] = (example.rejected, cfg.max_target_len)
        record = {key: data.collator.token_ids([text], limit)[0] for key, (text, limit) in sides.items()}
        if originals is not None:
            record["original_ids"] = next(originals)
        if decode:
            record.update({f"{key}_text": tokenizer.decode(record[key]) for key in list(record)})
        record.update(file=str(data.files.train[example.file_index]), row=example.row)
        yield record


def packed_preview(cfg: TrainConfig, data, tokenizer, count: int, decode: bool) -> Iterator[dict]:
    """With --packing: the first ``count`` packed rows of the first optimizer step's examples, each with its
    segment ids (1, 2, ... per example; 0: padding), and the examples it holds in order."""
    from data.packing import packed_rows

    rows = cfg.batch_size if isinstance(cfg.batch_size, int) else 2  # (auto: train sizes it; the default's window)
    window = list(itertools.islice(data.stream.iter_epoch(), rows * cfg.gradient_accumulation_steps))
    sources = data.collator.token_ids([e.prompt for e in window], cfg.max_source_len)
    targets = data.collator.targets(window)
    for row in packed_rows([(len(s), len(t)) for s, t in zip(sources, targets)],
                           (cfg.max_source_len, cfg.max_target_len))[:count]:
        record = {"input_ids": [i for k in row for i in sources[k]], "labels": [i for k in row for i in targets[k]],
                  "source_segments": [n for n, k in enumerate(row, 1) for _ in sources[k]],
                  "target_segments": [n for n, k in enumerate(row, 1) for _ in targets[k]]}
        if decode:
            record["segments_text"] = [{"input": tokenizer.decode(sources[k]), "labels": tokenizer.decode(targets[k])}
                                       for k in row]
        record["examples"] = [{"file": str(data.files.train[window[k].file_index]), "row": window[k].row} for k in row]
        yield record
