"""``--help``, from the commands' docstrings and the fields of ``TrainConfig`` (their help and roles):

    python train_low_mem.py --help          # every command, every option
    python train_low_mem.py train --help    # train's docstring, its examples, only the options train reads
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import textwrap
import typing

from config import TrainConfig
from data.objectives.base import registry
from lowmem.utils.flag_roles import COMMANDS, RUN_COMMANDS

USAGE = "usage: python train_low_mem.py {command} [--option=value ...] [--config=FILE.yaml]"
CONFIG_OPTION = ["  --config (str)", "      YAML file of option: value pairs; CLI flags override it."]


def sections(command: str | None = None) -> list[tuple[str, list[dataclasses.Field]]]:
    """The fields in their sections (a field's ``section`` role opens one), in field order; with ``command``, only
    the fields that command reads, and only the sections left with some."""
    found: list[tuple[str, list]] = []
    for f in dataclasses.fields(TrainConfig):
        if "section" in f.metadata or not found:
            found.append((f.metadata.get("section", "options"), []))
        if command is None or command in f.metadata["reads"]:
            found[-1][1].append(f)
    return [(title, fields) for title, fields in found if fields]


def option_kind(f: dataclasses.Field) -> str:
    """The type an option takes, as help shows it: ``int``, ``int or auto``, ``str``, ..."""
    hint = typing.get_type_hints(TrainConfig)[f.name]
    kinds = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    return f"{kinds[0].__name__} or auto" if str in kinds[1:] else kinds[0].__name__  # (lowmem.memory.batch_budget)


def readers(f: dataclasses.Field) -> str:
    """Which commands read an option, in short: ``run`` (the commands that build a run), ``run, plot``, ``all``,
    or the commands by name."""
    reads = f.metadata["reads"]
    if set(reads) == set(COMMANDS):
        return "all"
    if set(RUN_COMMANDS) <= set(reads):
        return ", ".join(["run", *(c for c in reads if c not in RUN_COMMANDS)])
    return ", ".join(reads)


def _option_lines(f: dataclasses.Field, with_readers: bool) -> list[str]:
    where = f"; {readers(f)}" if with_readers and readers(f) != "run" else ""
    lines = [f"  --{f.name} ({option_kind(f)}, default {f.default!r}{where})", _paragraph(f.metadata["help"], " " * 6)]
    if f.name == "objective":  # the registry's (data.objectives): one line each
        lines += [f"        {name}: {found.summary}" for name, found in registry().items()]
    return lines


def _options(command: str | None) -> list[str]:
    lines = []
    for title, fields in sections(command):
        lines.append(f"  [{title}]")
        for f in fields:
            lines += _option_lines(f, with_readers=command is None)
    return lines + CONFIG_OPTION


def _paragraph(text: str, indent: str) -> str:
    return textwrap.fill(" ".join(text.split()), 118, initial_indent=indent, subsequent_indent=indent)


def help_text(commands: dict) -> str:
    """The whole ``--help``: the commands (each with its docstring) and every option with its type, default, the
    commands that read it (``run``: all but train_tokenizer, plot and export) and its help."""
    lines = ["t5-lowmem: low-memory T5 pretraining and SFT.", "", USAGE.format(command="COMMAND"),
             "       python train_low_mem.py COMMAND --help   (that command's options and examples)", "", "commands:"]
    for name, function in commands.items():
        lines += [f"  {name}", _paragraph(inspect.getdoc(function) or "", "      ")]
    lines += ["", f"options (read by: run = {', '.join(RUN_COMMANDS)}; others as named):"]
    return "\n".join(lines + _options(None))


def examples(name: str, function) -> list[str]:
    """The lines of the command module's docstring that run command ``name`` (its examples)."""
    doc = getattr(sys.modules.get(function.__module__), "__doc__", None) or ""
    return [line.rstrip() for line in doc.splitlines() if re.search(rf"train_low_mem\.py {name}(\s|$)", line)]


def command_help(name: str, commands: dict) -> str:
    """``COMMAND --help``: the command's docstring and examples, and only the options it reads."""
    function = commands[name]
    lines = [USAGE.format(command=name), "", inspect.getdoc(function) or ""]
    shown = examples(name, function)
    if shown:
        lines += ["", "examples:", *shown]
    count = sum(len(fields) for _, fields in sections(name))
    lines += ["", f"options {name} reads ({count} of {len(dataclasses.fields(TrainConfig))}; python train_low_mem.py "
                  "--help lists every command's):"]
    return "\n".join(lines + _options(name))
