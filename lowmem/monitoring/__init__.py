"""What a run tells, and where.

- ``telemetry``: log lines, memory probes in the log, the interval meter, and the records of metrics.jsonl.
- ``run_summary``: the start-up summary, and the note when the steps trained differ from the schedule's.
- ``bad_rows``: bad rows checked against --max_bad_rows_fraction, an epoch with no example refused, the report.
- ``metrics_log``: the append-only logs (metrics.jsonl, consumed examples).
- ``trackers``: the trackers of ``--report_to``, one ``Tracker`` class per library; a server of theirs is reached
  before the run starts.
- ``tracker_feed``: metrics.jsonl fed to those trackers, once per step across kills, resumes and their own outages.
- ``plots``: PNG charts of a run's metrics.jsonl.
- ``flops``: the model FLOPs of a training micro-batch, counted from the model's shapes (for MFU, docs/mfu.md).
"""
