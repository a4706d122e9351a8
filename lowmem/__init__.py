"""The trainer's machinery, one subpackage per concern (``trainer_low_mem`` drives them; each ``__init__`` is its
package's map), and ``extras``: which optional packages are installed.

- ``lowmem.model``: the model a run trains: where it comes from, how it is built, frozen, adapted, stored
  narrow or quantised, its loss, and the standard folder it is exported as.
- ``lowmem.training``: the optimisation itself: the accumulation window's backward, the optimizer and its
  schedules, clean stops, the frozen encoder's cache, evaluation and its metrics.
- ``lowmem.parallel``: how processes run together: the accelerator, DDP, FSDP and DeepSpeed ZeRO engines.
- ``lowmem.memory``: memory predicted (the planner), sized (micro-batches from a budget), probed and guarded.
- ``lowmem.checkpointing``: the run folder: start checks, crash-safe checkpoints, resume, exports, ownership.
- ``lowmem.hardware``: the machine: which dtypes its device computes fast, and its peak rate (for MFU).
- ``lowmem.monitoring``: what a run tells: log lines, metrics.jsonl, the trackers of --report_to, plots.
- ``lowmem.cli``: the command line: flags into a config, one ``error:`` line per mistake, the ``plan`` command.
"""
