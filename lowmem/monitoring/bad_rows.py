"""Bad rows reported: the count checked against ``--max_bad_rows_fraction`` as training reads, an epoch
that yielded no example refused in one line, and every bad row met named at the end.
"""

from __future__ import annotations

from config import TrainConfig
from data.sources.corpus import bad_rows_report, too_many_bad_rows
from lowmem.monitoring.telemetry import Telemetry
from lowmem.utils.errors import UserError


def report_data_errors(telemetry: Telemetry, data) -> dict:
    """Sum the bad rows of the first epoch over processes; log them and write a ``data_errors`` record.

    Collective: called at points every process reaches together. ``data``: the run's ``TrainData``.
    """
    from accelerate.utils import gather_object

    stream = data.stream
    train = stream.problems.merge(gather_object([stream.problems.state_dict()]))
    rows_read = sum(gather_object([stream.rows_read]))
    event, line = bad_rows_report(train, rows_read, stream.total_rows, data.eval_problems, data.files.prepared)
    telemetry.record("data_errors", **event)
    if line:
        telemetry.say(line)
    return event


def check_no_examples(telemetry: Telemetry, data, cfg: TrainConfig, bad_rows: int, run_over: bool) -> None:
    """After an epoch, with no training example yet: stop with one line when every row was bad (``bad_rows``:
    summed over processes), or when the run is over. Raw text shorter than one chunk in an epoch carries its
    tokens over to the next epoch, so the run goes on while epochs remain."""
    stream = data.stream
    if bad_rows >= stream.total_rows:
        report_data_errors(telemetry, data)
        raise UserError(f"--train_file={cfg.train_file} yields no usable rows ({stream.total_rows} rows, all bad); see "
                        "the data_errors line in metrics.jsonl")
    if run_over:
        chunk = getattr(stream, "chunk_length", None)
        raise UserError(f"--train_file={cfg.train_file} gave no training example in {cfg.epochs} epoch(s): its "
                        f"text is shorter than one chunk of {chunk} tokens; raise --epochs (each adds the text "
                        "again), add text, or lower --max_source_len")


def check_bad_rows(telemetry: Telemetry, data, bad_rows: int, max_fraction: float) -> None:
    """Abort (on every process alike: ``bad_rows`` is summed over them) once more training rows are bad
    than ``max_fraction`` (--max_bad_rows_fraction) allows for the whole corpus."""
    total_rows = data.stream.total_rows
    if bad_rows > max_fraction * total_rows:
        errors = report_data_errors(telemetry, data)
        raise too_many_bad_rows(bad_rows, total_rows, max_fraction, errors["by_reason"])
