"""What a run tells, and where.

- ``telemetry``: log lines, the start-up summary, the interval meter, and the records of metrics.jsonl.
- ``metrics_log``: the append-only logs (metrics.jsonl, consumed examples).
- ``trackers``: the trackers of ``--report_to``, one ``Tracker`` class per library.
- ``tracker_feed``: metrics.jsonl fed to those trackers, once per step across kills and resumes.
- ``plots``: PNG charts of a run's metrics.jsonl.
"""
