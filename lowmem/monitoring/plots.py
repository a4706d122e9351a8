"""PNG charts of a run's ``metrics.jsonl``.

    python train_low_mem.py plot --output_dir=runs/pretrain                  # -> runs/pretrain/plots/*.png
    python train_low_mem.py plot --output_dir=runs/sft --plot_dir=/tmp/sft_charts

One chart per file, against the optimizer step: loss (train and eval), each metric of --eval_metrics (bleu.png,
chrf.png, rouge.png with rouge1 ... rougeLsum, exact_match.png), learning rate, tokens/s, and RSS with the
planner's predicted host peak and the measured peak as reference lines. A chart whose numbers the run has not
logged (no evaluation yet, no answers generated) is skipped and named in the summary.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

from lowmem.monitoring import trackers  # noqa: F401  (importing it adds the trackers' entries to a run's own)
from lowmem.monitoring.metrics_log import read_metrics
from lowmem.utils.errors import UserError
from lowmem.utils.eval_metrics import DEFAULT_METRICS, METRICS, metrics_of
from lowmem.utils.ownership import check_closed, claim_folder, is_ours, is_run_folder, saved_json, write_atomic

CHART_SIZE = (8, 4.5)  # inches at 100 dpi: 800 x 450 pixels
DPI = 100
CHARTS = {  # name (the file: NAME.png): title, y label, lines as (label, event, field); the scores after the loss
    "loss": ("loss", "mean token loss", [("train", "train", "loss"), ("eval", "eval", "eval_loss")]),
    "learning_rate": ("learning rate", "lr", [("train", "train", "lr")]),
    "tokens_per_s": ("throughput", "tokens / s (all processes)", [("train", "train", "tokens_per_s")]),
    "rss": ("host memory (main process)", "RSS (MiB)", [("train steps", "train", "rss_mb")]),
}


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> dict:
    """Draw the charts of ``run_dir/metrics.jsonl`` into ``out_dir`` (default ``run_dir/plots``).

    Returns:
        ``{"plot_dir": ..., "written": [png paths], "skipped": {chart: why}}``.

    Raises:
        UserError: no run folder, no metrics.jsonl, or no train records in it yet; ``out_dir`` holds
            files not ours (``lowmem.utils.ownership``) or cannot be written; one of the run's own entries
            (metrics.jsonl, plots/) is a symbolic link.
    """
    run = Path(run_dir)
    check_closed(run)  # metrics.jsonl, config.json and plots/ read and written: none through a link
    records = _load(run)
    out = Path(out_dir) if out_dir else run / "plots"
    check_closed(out, "--plot_dir", "plots")  # its charts replaced: none through a link
    out = claim_folder(out, "--plot_dir", "plots", _unmarked_plots)

    # Figures without pyplot: no global state, no display; savefig renders PNGs with the Agg backend.
    from matplotlib.figure import Figure

    written, skipped = [], {}
    scores = score_charts(run, records)
    charts = {"loss": CHARTS["loss"], **scores, **{k: v for k, v in CHARTS.items() if k != "loss"}}
    for name, (title, ylabel, wanted) in charts.items():
        lines = [(label, series(records, event, field)) for label, event, field in wanted]
        lines = [(label, points) for label, points in lines if points]
        if not lines:
            skipped[name] = " and ".join(f"no {event} records with {field}" for _, event, field in wanted)
            continue
        fig = Figure(figsize=CHART_SIZE)
        ax = fig.subplots()
        for label, points in lines:
            steps, values = zip(*points)
            ax.plot(steps, values, marker="o" if len(points) < 30 else None, markersize=3, label=label)
        if name == "rss":
            _memory_references(ax, records)
        if name in scores:  # 0..100: a young model's flat 0 shows as 0, not centred in a +-0.05 window
            ax.set_ylim(-1, max(5.0, 1.1 * max(v for _, points in lines for _, v in points)))
        ax.set(title=f"{title} — {run.name}", xlabel="optimizer step", ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend(loc="best")
        fig.tight_layout()
        path = out / f"{name}.png"
        png = io.BytesIO()  # rendered whole first: a failed write leaves the chart before it, not half of this one
        fig.savefig(png, dpi=DPI, format="png")
        try:
            write_atomic(path, png.getvalue())
        except OSError as err:
            raise UserError(f"--plot_dir={out}: {path.name} could not be written ({err.strerror}); free space or "
                            "choose another --plot_dir (the charts already there are kept whole)") from None
        written.append(str(path))
    return {"plot_dir": str(out), "written": written, "skipped": skipped}


def score_charts(run: Path, records: list[dict]) -> dict:
    """The charts of the scores of generated answers: one per metric of the run's --eval_metrics (its config.json;
    bleu for a run from before the option) and per other metric its eval records hold, each metric's values as
    its lines (``lowmem.utils.eval_metrics``)."""
    asked = metrics_of((saved_json(run / "config.json") or {}).get("eval_metrics") or DEFAULT_METRICS)
    logged = [m for m in METRICS.values() if any(series(records, "eval", n) for n in m.names)]
    return {m.name: (f"eval {m.title}", f"{m.title} (0-100)", [(n if len(m.names) > 1 else "eval", "eval", n)
                                                                for n in m.names])
            for m in dict.fromkeys([*asked, *logged])}


def _unmarked_plots(folder: Path) -> bool:
    """A run's plots/ from before plot folders were marked: the chart PNGs alone, in a run folder of ours."""
    names = {f"{name}.png" for name in [*CHARTS, *METRICS]}
    return folder.name == "plots" and is_ours(folder.parent, "run", is_run_folder) \
        and all(p.name in names for p in folder.iterdir())


def _load(run: Path) -> list[dict]:
    """The records of ``run/metrics.jsonl``, or a UserError that says what to do."""
    hint = f"train a run there first (python train_low_mem.py train --output_dir={run})"
    if not run.is_dir():
        raise UserError(f"--output_dir={run} is not a folder; {hint}")
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"--output_dir={run} holds no metrics.jsonl; {hint}")
    try:
        records = read_metrics(path)
    except ValueError as err:  # json.JSONDecodeError
        raise UserError(f"{path} holds a line that is not JSON ({getattr(err, 'msg', err)}); "
                        "plot reads the metrics.jsonl that train writes") from None
    if not all(isinstance(r, dict) for r in records):
        raise UserError(f"{path} holds a line that is not a JSON object; plot reads the metrics.jsonl that train "
                        "writes")
    if not all(isinstance(r.get("step"), int) and not isinstance(r.get("step"), bool) for r in records):
        raise UserError(f"{path} holds a record without a whole-number step; plot reads the metrics.jsonl that "
                        "train writes")
    if not any(r.get("event") == "train" for r in records):
        raise UserError(f"{path} has no train records yet (one is written every --logging_steps optimizer "
                        "steps); plot again once the run has logged a step")
    return records


def _memory_references(ax, records: list[dict]) -> None:
    """RSS at the memory probes, and the planner's predicted and the measured peak as horizontal lines."""
    probes = [(r["step"], r["rss_mb"]) for r in records if r.get("event") == "memory" and _number(r.get("rss_mb"))]
    if probes:
        ax.scatter(*zip(*probes), s=12, color="gray", label="memory probes (setup, eval, end)")
    plan = _last(records, "memory_plan")
    if plan and _number(plan.get("host_peak_mb")):
        ax.axhline(plan["host_peak_mb"], color="tab:orange", linestyle="--", label="predicted peak (plan)")
    # Each process of a resumed run measures its own peak (its records carry it so far): the run's is the highest
    peaks = [r[key] for r in records for key in ("measured_host_peak_mb", "peak_rss_mb") if _number(r.get(key))]
    if peaks and any(r.get("event") == "memory_peak" for r in records):
        ax.axhline(max(peaks), color="tab:red", linestyle=":", label="measured peak")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def series(records: list[dict], event: str, name: str) -> list[tuple[int, float]]:
    """(step, value) of field ``name`` in ``event`` records, by step; a repeated step keeps its last value."""
    by_step = {r["step"]: r[name] for r in records if r.get("event") == event and _number(r.get(name))}
    return sorted(by_step.items())


def _last(records: list[dict], event: str) -> dict | None:
    return next((r for r in reversed(records) if r.get("event") == event), None)
