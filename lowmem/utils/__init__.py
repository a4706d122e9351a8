"""The ground floor: what every other floor uses, importing nothing of the project's.

- ``errors``: ``UserError``, a mistake the user can fix (one ``error:`` line, exit code 2).
- ``ownership``: which folders the commands may write into (new, empty or ours), that none of their own entries is
  a symbolic link (the closed room), atomic writes, and reading back a JSON file of ours.
- ``optional``: the optional packages: installed or not, the line that says how to install one, and imports that
  leave out what a dependency would pull in for features this trainer never uses.
- ``presets``: named model shapes and memory profiles (data only: ``config`` validates against them).
- ``flag_roles``: the field helper of ``config`` and the roles a flag declares with its field (the commands that
  read it, what a resume does when it changed, ...), from which every list of flags is derived.
- ``registry``: ``Registered``, how every kind registers (precisions, frozen forms, engines, objectives, trackers,
  metrics): defining its class adds it to its family's ``kinds`` by name.
- ``precision_names``: the ``--mixed_precision`` names and the dtype each computes in (``config`` validates with them;
  the classes are ``lowmem.hardware.precision``'s).
- ``frozen_forms``: ``--frozen_dtype``'s forms (float32, bfloat16, int8, float8), one class each: what code asks of
  the frozen weights' storage.
- ``memory_modes``: the memory modes' choices (optimizer, LoRA's layers, --freeze, the encoder cache) and their
  validation (``config`` calls it).
- ``eval_metrics``: the scores of ``--eval_metrics`` (one ``Metric`` class each), pure functions of texts.
"""
