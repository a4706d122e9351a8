"""Command-line and YAML values into a ``TrainConfig``: type conversion, unknown flags with a
suggestion, the YAML file, the profile's flags, then the config's own resolution and validation;
the notes for options a command does not read. Which flags play which part comes from their fields' roles
(``config.flags_with``).

    from lowmem.cli.flags import load_config
    cfg, notes = load_config({"epochs": "3"}, "run.yaml")   # flags win over the YAML file
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from pathlib import Path

from config import SHIPPED_TOKENIZER_DIR, TrainConfig, flags_with
from data.objectives.base import objective_class, objective_problems, registry
from lowmem.memory.profiles import apply_caps, profile_flags
from lowmem.utils.errors import UserError
from lowmem.utils.ownership import saved_json
from lowmem.utils.presets import AUTO

FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
_HINTS = typing.get_type_hints(TrainConfig)


BOOL_WORDS = ("true", "false", "1", "0", "yes", "no")


def to_bool(name: str, value) -> bool:
    """A CLI/YAML value of the boolean flag ``name`` (True/False, true/false, 1/0, yes/no)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in BOOL_WORDS:
        return value.lower() in ("true", "1", "yes")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise UserError(f"--{name} expects True or False (got {value!r})")


def text_flags() -> set[str]:
    """The flags whose values are text: the command line passes them on verbatim (fire would read
    "hello, world" as a tuple and "1e3" as a number)."""
    return {name for name, hint in _HINTS.items() if str in (hint, *typing.get_args(hint))
            and bool not in typing.get_args(hint)}  # (True, False or auto: fire reads each as it is; a bare flag)


def _convert(name: str, value):
    """Convert a CLI/YAML value to the declared type of field ``name``; raise UserError if it cannot."""
    hint = _HINTS[name]
    optional = type(None) in typing.get_args(hint)
    base = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null")):
        if optional:
            return None
        raise UserError(f"--{name} needs a value")
    if str in typing.get_args(hint) and isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO  # --batch_size=auto, --eval_batch_size=auto, --eval_generate=auto
    if base is bool:
        if str in typing.get_args(hint) and not isinstance(value, bool) and str(value).lower() not in BOOL_WORDS:
            raise UserError(f"--{name} expects True, False or auto (got {value!r})")
        return to_bool(name, value)
    if base is int:
        expects = "an integer or auto" if str in typing.get_args(hint) else "an integer"
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise UserError(f"--{name} expects {expects} (got {value!r})")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise UserError(f"--{name} expects {expects} (got {value!r})") from None
    if base is float:
        if isinstance(value, bool):
            raise UserError(f"--{name} expects a number (got {value!r})")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise UserError(f"--{name} expects a number (got {value!r})") from None
    if isinstance(value, (list, tuple)):  # fire reads "a,b" as a tuple; text options keep the commas
        return ",".join(str(v) for v in value)
    if isinstance(value, dict):
        raise UserError(f"--{name} expects text (got {value!r})")
    if name in PATH_FLAGS:
        return _path(name, str(value))
    return str(value)


# Options naming files or folders (train and eval files: comma lists of them)
PATH_FLAGS = flags_with("path")


def _path(name: str, value: str) -> str:
    """A path option as given, with a leading ``~`` expanded (the shell leaves ``--flag=~/x`` alone, and a
    folder named ``~`` would appear). Empty, it is refused: it would name the current folder."""
    if not value.strip():
        raise UserError(f"--{name} is empty: give a path, or leave the flag out for its default")
    if name in ("train_file", "eval_file"):
        return ",".join(os.path.expanduser(part) for part in value.split(","))
    return os.path.expanduser(value)


# Flags that one command reads besides the options (train_low_mem.py pops them before load_config): a near miss
# of one of them is suggested too (`preview --num_example=3` was asked whether it meant --num_beams).
COMMAND_FLAGS = {**dict.fromkeys(("json", "budget_gb", "device", "num_processes", "num_machines", "sharding"), "plan"),
                 "num_examples": "preview", "decode": "preview", "prepared_dir": "prepare", "plot_dir": "plot",
                 **dict.fromkeys(("export_dir", "dtype", "base"), "export")}


def unknown_flag_message(name: str, where: str = "flag") -> str:
    if name in COMMAND_FLAGS:  # given to another command (or in a YAML file, which holds the options only)
        return (f"--{name} is read by the {COMMAND_FLAGS[name]} command only, on its command line: "
                f"python train_low_mem.py {COMMAND_FLAGS[name]} --{name}=...")
    close = difflib.get_close_matches(name, [*FIELDS, *COMMAND_FLAGS], n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join('--' + c for c in close)}?" if close else "; see --help"
    return f"unknown {where} --{name}{hint}"


def load_config(flags: dict, yaml_path: str | None = None) -> tuple[TrainConfig, list[str]]:
    """Build the resolved config from a YAML file and CLI flags.

    Returns:
        The validated config and the notes to log (caps applied).

    Raises:
        UserError: listing every problem found.
    """
    values: dict = {}
    problems: list[str] = []
    if yaml_path:
        values.update(_read_yaml(yaml_path))
    values.update({k.replace("-", "_"): v for k, v in flags.items()})
    converted = {}
    for name, value in values.items():
        if name not in FIELDS:
            problems.append(unknown_flag_message(name))
            continue
        try:
            converted[name] = _convert(name, value)
        except UserError as err:
            problems.append(str(err))
    if problems:
        raise UserError("; ".join(problems))
    notes = profile_flags(converted)
    cfg = TrainConfig(**converted)
    cfg.resolve_defaults()
    notes += apply_caps(cfg)
    problems = cfg.problems() + objective_problems(cfg)  # one error naming every mistake
    if cfg.torch_compile:  # (dynamo takes seconds to import: only when asked for)
        from lowmem.model.compiled import backend_problems

        problems += backend_problems(cfg.torch_compile_backend)
    if problems:
        raise UserError("; ".join(problems))
    notes += [f"note: --{name} has no effect {why}" for name, why in unused_flags(cfg) if name in converted]
    return cfg, notes


def unused_flags(cfg: TrainConfig) -> list[tuple[str, str]]:
    """(flag, why) for the settings this configuration does not read (the objective's: its class says)."""
    unused = []
    if not cfg.lora_r:
        unused += [(name, "without --lora_r") for name in ("lora_alpha", "lora_dropout", "lora_target_modules")]
    if cfg.encoder_cache == "off":
        unused.append(("encoder_cache_dtype", "with --encoder_cache=off"))
    if not cfg.eval_generate:
        unused += [(n, "with --eval_generate=False (no answers are generated)") for n in ("eval_generate_samples",
                                                                                           "eval_metrics")]
    if cfg.init_from:
        unused += [(name, "with --init_from (that model's shape is trained)")
                   for name in flags_with("resume", "preset")]  # (a preset's shape)
    if cfg.effective_batch_size:
        unused.append(("gradient_accumulation_steps", "with --effective_batch_size (accumulation follows)"))
    if cfg.is_keep_training:
        unused.append(("overwrite_output_dir", "with --is_keep_training=True (the run is continued)"))
    objective = objective_class(cfg.objective)
    return unused + [(name, f"with --objective={cfg.objective}") for name in objective.unused_flags]


def unread_flag_notes(command: str, flags: dict) -> list[str]:
    """Notes for the options on ``command``'s command line that it never reads (each field's ``reads`` role: given
    to another command they change nothing). A YAML file holds a whole run's options, shared by the commands, so
    its keys are not noted."""
    notes = []
    for name in (name.replace("-", "_") for name in flags):
        reads = FIELDS[name].metadata["reads"] if name in FIELDS else (command,)
        if command not in reads:  # (a generate-only option is generate's; any other, train's)
            notes.append(f"note: --{name} has no effect on {command} (it is read by "
                         f"{'train' if 'train' in reads else reads[0]})")
    return notes


# Read only where answers are generated (--num_beams, also in the exports' generation_config.json, is not one)
ANSWER_OPTIONS = flags_with("answers_only")


def unused_answer_notes(cfg: TrainConfig, flags: dict) -> list[str]:
    """Notes for generation options given to an evaluation that generates nothing (train and evaluate read
    --eval_generate; the generate command always generates, so it does not ask)."""
    return [] if cfg.eval_generate else [f"note: --{name} has no effect with --eval_generate=False (no answers "
                                         "are generated)" for name in ANSWER_OPTIONS if name in flags]


# What a model's eval numbers depend on besides its weights and the eval rows, recorded in its exports'
# training_info.json: evaluate and generate take them from there unless given (a span-corruption model was
# scored as prompt/response pairs, its masks drawn with another seed, its chunks of other lengths). Of these,
# the ones its objective reads are taken (``Objective.trained_with``).
TRAINED_WITH = flags_with("trained_with")


def load_saved_model_config(flags: dict, yaml_path: str | None = None) -> tuple[TrainConfig, list[str]]:
    """``load_config`` for the commands that read a trained model (evaluate, generate): without --init_from
    they read OUTPUT_DIR/best, not the model an SFT run would start from (runs/pretrain/best); the settings
    of ``TRAINED_WITH`` not given are the model's own (a note says which)."""
    cfg, notes = _saved_model_config(flags, yaml_path)
    given = _given_names(flags, yaml_path)
    info = saved_json(Path(cfg.init_from or Path(cfg.output_dir) / "best") / "training_info.json") or {}
    trained = info.get("trained_with") or {}
    objective = registry().get(trained.get("objective", FIELDS["objective"].default))  # None: unknown here
    reads = TRAINED_WITH if objective is None else ("objective", *objective.trained_with)  # (validation says so)
    adopt = {key: value for key, value in trained.items() if key in TRAINED_WITH and key in reads and key not in given
             and getattr(cfg, key) != value}
    if not adopt:
        return cfg, notes
    cfg, notes = _saved_model_config({**adopt, **flags}, yaml_path)
    said = " ".join(f"--{key}={value}" for key, value in adopt.items())
    return cfg, notes + [f"as the model was trained (its training_info.json): {said}; pass them to change"]


def _saved_model_config(flags: dict, yaml_path: str | None) -> tuple[TrainConfig, list[str]]:
    cfg, notes = load_config(flags, yaml_path)
    given = _given_names(flags, yaml_path)
    if "init_from" in given:
        return cfg, notes
    tokenizer_dir = cfg.tokenizer_dir or str(SHIPPED_TOKENIZER_DIR)  # as resolve_defaults gives it without --init_from
    return dataclasses.replace(cfg, init_from=None, tokenizer_dir=tokenizer_dir), notes


def _given_names(flags: dict, yaml_path: str | None) -> set[str]:
    """The options the user set: on the command line or in the --config file."""
    return {name.replace("-", "_") for name in flags} | (set(_read_yaml(yaml_path)) if yaml_path else set())


def _read_yaml(path: str) -> dict:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise UserError(f"--config file {path} does not exist")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        raise UserError(f"--config file {path} is not valid YAML: {str(err).splitlines()[0]}") from None
    except UnicodeDecodeError:
        raise UserError(f"--config file {path} is not UTF-8 text; save it as UTF-8 YAML") from None
    if not isinstance(data, dict):
        raise UserError(f"--config file {path} must hold a mapping of option: value")
    return data
