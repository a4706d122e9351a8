"""What a flag does besides holding its value, declared once in its ``TrainConfig`` field (``config.py``): the
field helpers ``option`` (``_f`` there) and ``training_option`` (``_t``) put the flag's roles in the field's
metadata, and every list of flags is derived from them (``config.flags_with``): none is written by hand.

    is_keep_training: bool = _t(False, "Resume from the latest valid checkpoint ...", resume="run")
    flags_with("resume", "fixed")      # the flags a resume may not change: seed, objective, ...
    flags_with("reads", "generate")    # the options the generate command reads

Roles (keywords of ``option``; each optional):

- ``reads``: the commands that read the flag (``option``: ``RUN_COMMANDS``; ``training_option``: ``TRAINING``).
  Given on the line of another command it gets a note; ``COMMAND --help`` lists the options its command reads.
- ``resume``: what a resume does when the flag changed: ``"free"`` (the default: the new value is used, and the
  change logged), ``"fixed"`` (refused: the checkpoint's data position or its best model depend on it),
  ``"shape"`` (refused: the shape of the weights or of the optimizer state), ``"preset"`` (``"shape"`` for a
  ``--model_preset`` model; a model of ``--init_from`` has its own) or ``"run"`` (how this run starts: not compared).
- ``before``: the value in effect before the flag existed (a checkpoint that lacks it had that value).
- ``trained_with``: recorded in an export's training_info.json; ``evaluate`` and ``generate`` adopt it unless given.
- ``planned_for``: the eval plan depends on it (a resume with another value plans its evaluations again).
- ``scores``: a best/ chosen under another value is not comparable: ``"eval"`` (every eval number) or
  ``"answers"`` (the scores of generated answers).
- ``answers_only``: read only where answers are generated (a note says so when an evaluation generates none).
- ``path``: names files or folders (``~`` expanded; an empty value refused).
- ``section``: the flag opens a section of ``--help`` and docs/options.md, titled so.
"""

from __future__ import annotations

from dataclasses import field

# The commands of train_low_mem.py. Most options describe a run (its data, model and evaluation), and the commands
# that build one read them; plan predicts a training run and preview shows its stream, so both read what train does.
RUN_COMMANDS = ("train", "plan", "preview", "evaluate", "generate", "prepare")
TRAINING = ("train", "plan", "preview")
COMMANDS = (*RUN_COMMANDS, "train_tokenizer", "plot", "export")
TOKENIZER_TOO = (*RUN_COMMANDS, "train_tokenizer")  # the data and column options, which train_tokenizer reads too

RESUME = ("free", "fixed", "shape", "preset", "run")
SCORES = ("eval", "answers")
ROLES = ("reads", "resume", "before", "trained_with", "planned_for", "scores", "answers_only", "path", "section")


def option(default, help_text: str, **roles):
    """A ``TrainConfig`` field: its default, its help (all of it in ``--help``, its first sentence in
    docs/options.md) and its roles (this module's docstring). Raises ValueError on an unknown role or value, at
    import: a misspelt role would otherwise leave the flag out of a list silently."""
    roles = {"reads": RUN_COMMANDS, "resume": "free", **roles}
    unknown = [k for k in roles if k not in ROLES] + [c for c in roles["reads"] if c not in COMMANDS]
    if unknown or roles["resume"] not in RESUME or roles.get("scores", "eval") not in SCORES:
        raise ValueError(f"unknown roles in {roles}: {unknown or 'resume or scores'}")
    return field(default=default, metadata={"help": help_text, **roles})


def training_option(default, help_text: str, **roles):
    """``option`` for a flag that only training reads (the optimizer, what trains, checkpoints, logs)."""
    return option(default, help_text, reads=TRAINING, **roles)


def names_with(fields, role: str, *values) -> tuple[str, ...]:
    """The names of ``fields`` (dataclass fields made by ``option``) that have ``role``, or, with ``values``, whose
    ``role`` is one of them (``reads``: names one of them), in field order."""
    found = []
    for f in fields:
        if role not in f.metadata:
            continue
        value = f.metadata[role]
        if not values or (any(v in value for v in values) if isinstance(value, tuple) else value in values):
            found.append(f.name)
    return tuple(found)
