"""The trainer's machinery, one subpackage per concern (``trainer_low_mem`` drives them; each ``__init__`` is its
package's map). The packages are floors: each imports only the floors below it (``tests/test_code_layout.py``
checks it), listed here bottom first, with ``config`` and ``data`` in their places.

- ``lowmem.utils``: the ground floor, importing nothing of ours: ``UserError``, folder ownership and atomic
  writes, optional imports, model presets and metric names (what ``config`` validates against).
- (``config``: the flags; ``data``: streamed rows, tokenizers, objectives.)
- ``lowmem.hardware``: the machine: which dtypes its device computes fast, its peak rate (for MFU), the
  precision a run computes in, and how much memory this process holds.
- ``lowmem.model``: the model a run trains: where it comes from, how it is built, frozen, adapted, stored
  narrow or quantised, and its loss.
- ``lowmem.checkpointing``: checkpoint files: crash-safe folders, checksums, the checks before a resume.
- ``lowmem.monitoring``: what a run tells: log lines, metrics.jsonl, the trackers of --report_to, plots.
- ``lowmem.parallel``: how processes run together: the accelerator, DDP, FSDP and DeepSpeed ZeRO engines.
- ``lowmem.memory``: memory predicted (the planner), sized (micro-batches from a budget) and guarded.
- ``lowmem.training``: the optimisation itself: the accumulation window's backward, the optimizer and its
  schedules, clean stops, the frozen encoder's cache, evaluation and what it costs.
- ``lowmem.runs``: a run's folder: start checks, checkpoints written and resumed, exports.
- ``lowmem.cli``: the command line: flags into a config, one ``error:`` line per mistake, the ``plan`` command.
"""
