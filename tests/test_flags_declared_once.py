"""Each flag is declared once, in its ``TrainConfig`` field with its roles (``lowmem.utils.flag_roles``): the lists of
flags, ``--help``, ``COMMAND --help`` and docs/options.md all come from the fields."""

from __future__ import annotations

import ast
import dataclasses
import re

import pytest
from conftest import REPO

from config import TrainConfig, flags_with
from lowmem.utils.flag_roles import COMMANDS, RESUME, ROLES, SCORES, names_with, option, training_option

FIELDS = dataclasses.fields(TrainConfig)


def test_every_field_declares_known_roles_and_a_misspelt_one_is_refused():
    for f in FIELDS:
        assert f.metadata["help"].strip(), f.name
        assert set(f.metadata) - {"help"} <= set(ROLES), f.name
        assert f.metadata["reads"] and set(f.metadata["reads"]) <= set(COMMANDS), f.name
        assert f.metadata["resume"] in RESUME and f.metadata.get("scores", "eval") in SCORES, f.name
    for wrong in ({"resum": "fixed"}, {"resume": "fixd"}, {"reads": ("trian",)}, {"scores": "loss"}):
        with pytest.raises(ValueError, match="unknown roles"):
            option(1, "A flag.", **wrong)


def test_the_roles_name_the_commands_of_the_command_line():
    from train_low_mem import COMMANDS as CLI_COMMANDS

    assert set(COMMANDS) == set(CLI_COMMANDS)
    for command in COMMANDS:  # each command reads --debug at least
        assert "debug" in flags_with("reads", command), command


def test_a_made_up_flag_needs_its_field_only():
    # What adding a flag takes (docs/architecture.md, "Adding a flag"): its roles go into the lists by themselves
    @dataclasses.dataclass
    class Made:
        old: int = option(1, "An old flag.")
        new_thing: int = training_option(0, "A new flag.", resume="fixed", trained_with=True, before=0)

    fields = dataclasses.fields(Made)
    assert names_with(fields, "resume", "fixed") == names_with(fields, "trained_with") == ("new_thing",)
    assert names_with(fields, "reads", "train") == ("old", "new_thing")
    assert names_with(fields, "reads", "evaluate") == ("old",)
    assert names_with(fields, "before") == ("new_thing",)


def test_the_lists_of_flags_are_derived_from_the_roles_not_written_by_hand():
    from lowmem.cli import flags
    from lowmem.runs import run_folder
    from lowmem.training import eval_cost

    assert flags.TRAINED_WITH == flags_with("trained_with")
    assert set(flags.TRAINED_WITH) >= {"objective", "seed", "noise_density", "mean_noise_span_length"}
    assert set(run_folder.FIXED_ON_RESUME) == {"seed", "shuffle_buffer_size", "shuffle_buffer_mb", "objective",
                                               "metric_for_best", "reference"}
    assert set(run_folder.PRESET_SHAPE) < set(run_folder.SHAPE_SETTINGS)
    assert run_folder.BEFORE_IT_EXISTED == {"shuffle_buffer_mb": 0, "feed_forward_proj": "relu",
                                            "tie_word_embeddings": True, "reference": "auto"}
    assert set(eval_cost.PLANNED_FOR) == set(flags_with("planned_for")) >= {"eval_budget_s", "num_beams"}
    assert "learn_rate" in flags_with("reads", "train") and "learn_rate" not in flags_with("reads", "evaluate")
    only_generate = set(flags_with("reads", "generate")) - set(flags_with("reads", "train"))
    assert only_generate == {"prompt", "max_new_tokens"}
    # No module that held a hand-written list of flags holds one again (at module level: a tuple, list or set
    # literal of two or more option names; messages keyed by a flag, as FIXED_WHY, are not lists)
    names = {f.name for f in FIELDS}
    for path in ("lowmem/cli/flags.py", "lowmem/runs/run_folder.py", "lowmem/training/eval_cost.py",
                 "lowmem/cli/help_pages.py", "lowmem/cli/options_page.py"):
        for node in ast.parse((REPO / path).read_text(encoding="utf-8")).body:
            value = getattr(node, "value", None)
            if isinstance(value, (ast.Tuple, ast.List, ast.Set)):
                listed = [e.value for e in value.elts if isinstance(e, ast.Constant) and e.value in names]
                assert len(listed) < 2, f"{path}:{node.lineno} lists flags by hand: {listed}"


def test_options_page_is_the_one_the_fields_make():
    from lowmem.cli.options_page import REGENERATE, options_markdown

    page = (REPO / "docs" / "options.md").read_text(encoding="utf-8")
    assert page == options_markdown(), f"docs/options.md is stale: regenerate it with `{REGENERATE}`"
    cells = [c for line in page.splitlines() if line.startswith("| `--") for c in line.split(" | ")]
    assert len(cells) == 4 * len(FIELDS) and max(map(len, cells)) < 250  # a row per option, short cells
    for f in FIELDS:
        assert f"| `--{f.name}` |" in page


def test_options_page_and_its_notes_name_only_real_flags_and_sections():
    from lowmem.cli.flags import COMMAND_FLAGS
    from lowmem.cli.help_pages import sections
    from lowmem.cli.options_page import NOTES, options_markdown

    known = {f.name for f in FIELDS} | set(COMMAND_FLAGS) | {"config", "help", "name"}  # (--name=value)
    named = set(re.findall(r"--(\w+)", options_markdown()))
    assert named <= known, named - known  # a renamed flag's old name left in the notes
    assert set(NOTES) <= {title for title, _ in sections()}


def test_each_command_has_its_own_help_through_the_command_line(run_cli):
    everything = run_cli("--help")
    train = run_cli("train", "--help")
    generate = run_cli("generate", "--help")
    plot = run_cli("plot", "-h")
    for proc in (everything, train, generate, plot):
        assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr
    assert "--prompt (" in everything.stdout and "--learn_rate (" in everything.stdout
    assert "commands:" in everything.stdout and all(f"\n  {c}\n" in everything.stdout for c in COMMANDS)
    # train's: its docstring and examples, the options train reads and none that only generate reads
    assert train.stdout.startswith("usage: python train_low_mem.py train ")
    assert "Pretrain (default) or fine-tune" in train.stdout and "examples:" in train.stdout
    assert "python train_low_mem.py train --is_finetune=True" in train.stdout
    assert "--learn_rate (" in train.stdout and "--prompt (" not in train.stdout
    assert "--max_new_tokens" not in train.stdout and "train_tokenizer --" not in train.stdout
    assert len(train.stdout) < len(everything.stdout)
    assert "--prompt (" in generate.stdout and "--learn_rate" not in generate.stdout
    shown = set(re.findall(r"^  --(\w+) \(", plot.stdout, flags=re.M))
    assert shown == set(flags_with("reads", "plot")) | {"config"} == {"output_dir", "is_finetune", "debug", "config"}
