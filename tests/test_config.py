"""Config resolution, type conversion, caps, validation and the CLI's error contract."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from config import TrainConfig
from lowmem.cli.flags import load_config, unused_answer_notes
from lowmem.cli.help_pages import help_text
from lowmem.utils.errors import UserError
from lowmem.utils.presets import LOW_MEMORY_CAPS


def test_values_are_converted_to_declared_types():
    cfg, _ = load_config({"learn_rate": 1, "epochs": "3", "is_finetune": "true", "output_dir": 123,
                          "train_file": ("a.jsonl", "b.jsonl")})
    assert isinstance(cfg.learn_rate, float) and cfg.learn_rate == 1.0
    assert cfg.epochs == 3 and cfg.is_finetune is True
    assert cfg.output_dir == "123"
    assert cfg.train_file == "a.jsonl,b.jsonl"  # fire reads a,b as a tuple; text options keep it whole
    # The shell leaves ~ after "=" alone: a folder named ~ would appear in the working folder
    cfg, _ = load_config({"output_dir": "~/runs/x", "train_file": "~/a.jsonl,b/~c.jsonl"})
    home = str(Path.home())
    assert cfg.output_dir == f"{home}/runs/x" and cfg.train_file == f"{home}/a.jsonl,b/~c.jsonl"
    with pytest.raises(UserError, match="--output_dir is empty: give a path"):
        load_config({"output_dir": " "})


def test_wrong_types_and_unknown_flags_are_all_reported_at_once():
    with pytest.raises(UserError) as err:
        load_config({"batch_size": "two", "learnrate": 0.1, "is_finetune": "maybe"})
    message = str(err.value)
    assert "--batch_size expects an integer or auto" in message
    assert "unknown flag --learnrate; did you mean --learn_rate" in message
    assert "--is_finetune expects True or False" in message
    with pytest.raises(UserError, match="--budget_gb is read by the plan command only"):  # was told: did you
        load_config({"budget_gb": 3})  # mean --budget_gb?


def test_host16g_caps_lower_requests_and_say_so():
    # Elsewhere a request is a budget the planner checks at setup (tests/test_batch_budget.py).
    assert load_config({"batch_size": 16, "eval_batch_size": "auto"})[0].batch_size == 16
    cfg, notes = load_config({"batch_size": 16, "eval_batch_size": 64, "gradient_accumulation_steps": 3,
                              "memory_profile": "host16g"})
    assert cfg.batch_size == LOW_MEMORY_CAPS["batch_size"] == 2
    assert cfg.eval_batch_size == LOW_MEMORY_CAPS["eval_batch_size"] == 4
    assert any("--batch_size=16" in n for n in notes) and any("--eval_batch_size=64" in n for n in notes)
    # The batch per optimizer step stays the one asked for: 16 x 3 = 2 x 24.
    assert cfg.gradient_accumulation_steps == 24 and any("batch of 48 examples" in n for n in notes)
    for batch, accumulation, micro in [(5, 2, 1), (6, 1, 2), (2, 4, 2), (1, 4, 1), ("auto", 4, 2)]:
        cfg, _ = load_config({"batch_size": batch, "gradient_accumulation_steps": accumulation,
                              "memory_profile": "host16g"})
        batch = micro if batch == "auto" else batch
        assert (cfg.batch_size, cfg.batch_size * cfg.gradient_accumulation_steps) == (micro, batch * accumulation)


def test_a_gpu_profiles_effective_batch_given_way_to_an_explicit_accumulation_is_said():
    cfg, notes = load_config({"memory_profile": "gpu8g", "gradient_accumulation_steps": 2})
    assert (cfg.batch_size, cfg.gradient_accumulation_steps, cfg.effective_batch_size) == ("auto", 2, 0)
    assert any("--gradient_accumulation_steps=2 given explicitly replaces the profile's --effective_batch_size=32"
               in n for n in notes), notes
    cfg, notes = load_config({"memory_profile": "gpu8g"})
    assert cfg.effective_batch_size == 32 and not notes


def test_low_memory_defaults():
    cfg = TrainConfig()
    assert (cfg.batch_size, cfg.eval_batch_size, cfg.gradient_accumulation_steps) == (2, 4, 16)
    assert cfg.num_workers == 0 and cfg.pin_memory is False and cfg.gc_every_steps == 100


@pytest.mark.parametrize("flags, fragment", [
    ({"mixed_precision": "fp8"}, "--mixed_precision must be no, bf16 or fp16"),
    ({"model_preset": "huge"}, "--model_preset must be one of tiny, small, base"),
    ({"gradient_accumulation_steps": 0}, "--gradient_accumulation_steps must be at least 1"),
    ({"num_workers": 2}, "--num_workers must be 0"),
    ({"max_steps": 0}, "--max_steps must be -1"),
    ({"is_finetune": True, "lora_r": 4, "lora_target_modules": "q,v,q"}, "names q more than once"),
])
def test_invalid_values_are_refused(flags, fragment):
    with pytest.raises(UserError, match=fragment):
        load_config(flags)


def test_generation_options_are_off_by_default_and_validated():
    cfg, _ = load_config({})
    assert (cfg.no_repeat_ngram_size, cfg.repetition_penalty) == (0, 1.0)
    cfg, _ = load_config({"no_repeat_ngram_size": "3", "repetition_penalty": "1.2"})
    assert (cfg.no_repeat_ngram_size, cfg.repetition_penalty) == (3, 1.2)
    with pytest.raises(UserError) as err:
        load_config({"no_repeat_ngram_size": -1, "repetition_penalty": 0})
    message = str(err.value)  # both problems in one error
    assert "--no_repeat_ngram_size must not be negative (got -1)" in message
    assert "--repetition_penalty must be positive (got 0.0)" in message
    with pytest.raises(UserError, match="--repetition_penalty must be positive"):
        load_config({"repetition_penalty": -1.5})


def test_sft_and_pretraining_default_to_different_folders():
    pre, _ = load_config({})
    sft, _ = load_config({"is_finetune": True})
    assert pre.output_dir != sft.output_dir
    assert sft.init_from.startswith(pre.output_dir)
    assert pre.train_file != sft.train_file


def test_yaml_file_then_flags(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("learn_rate: 0.005\nepochs: 4\nmodel_preset: small\n")
    cfg, _ = load_config({"epochs": 2}, str(path))
    assert (cfg.learn_rate, cfg.epochs, cfg.model_preset) == (0.005, 2, "small")
    path.write_text("learn_rat: 0.1\n")
    with pytest.raises(UserError, match="did you mean --learn_rate"):
        load_config({}, str(path))


def test_help_lists_every_option_with_default():
    from train_low_mem import COMMANDS

    text = help_text(COMMANDS)
    for f in dataclasses.fields(TrainConfig):
        assert f"--{f.name} (" in text and f.metadata["help"] in " ".join(text.split())  # (its help wrapped)


def test_cli_user_errors_are_one_line_with_exit_code_2(run_cli):
    # End to end, as a shell sees it: the process's exit code and its standard error. The other refusals run
    # in-process (the cli_in_process fixture) through the same lowmem.cli.runner.run_cli.
    for args in (["train", "--learnrate=0.1"], ["train", "--mixed_precision=fp32"],
                 ["train", "--train_file=/nonexistent/x.jsonl"], ["nosuchcommand"]):
        proc = run_cli(*args)
        assert proc.returncode == 2, (args, proc.stderr)
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:"), (args, proc.stderr)
        assert "Traceback" not in proc.stderr


def test_cli_help_exits_zero_and_lists_options(cli_in_process):
    proc = cli_in_process("train", "--help")
    assert proc.returncode == 0
    assert "--learn_rate (float, default 0.003)" in proc.stdout


def test_flags_that_the_configuration_does_not_read_are_named():
    _, notes = load_config({"lora_alpha": 32.0, "encoder_cache_dtype": "bfloat16"})
    assert "note: --lora_alpha has no effect without --lora_r" in notes
    assert "note: --encoder_cache_dtype has no effect with --encoder_cache=off" in notes
    _, notes = load_config({"is_finetune": True, "lora_r": 4, "lora_alpha": 32.0, "encoder_cache": "memory",
                            "encoder_cache_dtype": "bfloat16"})
    assert not [n for n in notes if "has no effect" in n]
    _, notes = load_config({"is_finetune": True, "model_preset": "small"})  # SFT trains --init_from's shape
    assert notes == ["note: --model_preset has no effect with --init_from (that model's shape is trained)"]
    _, notes = load_config({})  # defaults are never named
    assert not [n for n in notes if "has no effect" in n]
    text = {"text_column": "body", "noise_density": 0.3, "mean_noise_span_length": 5.0}  # raw text's flags
    _, notes = load_config(text)
    assert [n for n in notes if "has no effect" in n] == [
        f"note: --{k} has no effect with --objective=pairs" for k in text]
    _, notes = load_config({**text, "objective": "prefix_lm"})  # reads the text column, masks no spans
    assert [n for n in notes if "has no effect" in n] == [
        f"note: --{k} has no effect with --objective=prefix_lm" for k in ("noise_density", "mean_noise_span_length")]
    _, notes = load_config({**text, "objective": "span_corruption"})
    assert not [n for n in notes if "has no effect" in n]
    answers = {"no_repeat_ngram_size": 3, "repetition_penalty": 1.2}  # read by the evaluation's generation only
    assert unused_answer_notes(load_config(answers)[0], answers) == []
    quiet = {**answers, "eval_generate": False}
    assert unused_answer_notes(load_config(quiet)[0], quiet) == [
        f"note: --{k} has no effect with --eval_generate=False (no answers are generated)" for k in answers]


def test_text_flags_reach_the_config_verbatim():
    """fire reads "hello, world" as a tuple and "1e3" as a number; the CLI passes text flags as literals."""
    import fire

    from lowmem.cli.runner import verbatim_text

    seen = {}
    for argv in (["--prompt=hello, world", "--output_dir=1e3"], ["--prompt", "hello, world", "--output_dir", "1e3"]):
        fire.Fire(lambda **flags: seen.update(flags), command=verbatim_text(argv))
        cfg, _ = load_config(seen)
        assert cfg.prompt == "hello, world" and cfg.output_dir == "1e3"


def test_each_distinct_error_line_is_printed_once_per_launch(tmp_path, monkeypatch, capsys):
    from lowmem.cli.runner import print_error

    # the layout torch's elastic agent gives each worker: <launch folder>/attempt_0/<local rank>/error.json
    (tmp_path / "launch" / "attempt_0").mkdir(parents=True)
    for rank, message in [(0, "bad flag"), (1, "bad flag"), (1, "only rank 1's shard\nhas this"), (0, "bad flag")]:
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "launch" / "attempt_0" / str(rank) / "error.json"))
        print_error(message)
    assert capsys.readouterr().err == "error: bad flag\nerror: only rank 1's shard\nhas this\n"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "gone" / "attempt_0" / "0" / "error.json"))
    print_error("bad flag")  # no folder to share: the line is printed all the same
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")
    print_error("bad flag")  # not launched: always printed
    assert capsys.readouterr().err == "error: bad flag\nerror: bad flag\n"


def test_evaluate_and_generate_read_output_dir_best_unless_init_from_is_given(tmp_path):
    """SFT training starts from runs/pretrain/best by default; the commands that read a trained model read
    OUTPUT_DIR/best (they read the pretrained model, named in the SFT run's place, before)."""
    from lowmem.cli.flags import load_saved_model_config

    cfg, _ = load_saved_model_config({"is_finetune": True, "output_dir": "runs/sft"})
    assert cfg.init_from is None and cfg.output_dir == "runs/sft" and cfg.tokenizer_dir
    cfg, _ = load_saved_model_config({"is_finetune": True, "init_from": "runs/pretrain/best"})
    assert cfg.init_from == "runs/pretrain/best"
    (tmp_path / "run.yaml").write_text("is_finetune: true\ninit_from: elsewhere/best\n")
    cfg, _ = load_saved_model_config({}, str(tmp_path / "run.yaml"))
    assert cfg.init_from == "elsewhere/best"


def test_evaluate_and_generate_take_the_objective_and_lengths_the_model_was_trained_with(tmp_path):
    """A span-corruption model's eval loss was computed as prompt/response pairs, or with another --seed's
    masks (6.59 against the run's 6.28) and other chunk lengths, unless the flags were repeated."""
    import json

    from lowmem.cli.flags import load_saved_model_config

    model = tmp_path / "best"
    model.mkdir()
    trained = {"objective": "span_corruption", "seed": 7, "max_source_len": 64, "max_target_len": 32,
               "noise_density": 0.15, "mean_noise_span_length": 3.0, "text_column": "text"}
    (model / "training_info.json").write_text(json.dumps({"step": 40, "trained_with": trained}))
    cfg, notes = load_saved_model_config({"init_from": str(model)})
    assert (cfg.objective, cfg.seed, cfg.max_source_len, cfg.max_target_len) == ("span_corruption", 7, 64, 32)
    assert notes[-1].startswith("as the model was trained (its training_info.json): --objective=span_corruption")
    cfg, _ = load_saved_model_config({"init_from": str(model), "seed": 3})  # given: the flag wins
    assert (cfg.seed, cfg.max_source_len) == (3, 64)
    (model / "training_info.json").write_text(json.dumps({"trained_with": {**trained, "objective": "pairs"}}))
    cfg, notes = load_saved_model_config({"init_from": str(model)})  # pairs: no masks, the lengths alone
    assert cfg.objective == "pairs" and cfg.seed != 7 and cfg.max_source_len == 64
    # ... and the columns it read (evaluate on the rows training held out blamed the data for missing 'prompt')
    columns = {"objective": "pairs", "prompt_column": "question", "response_column": "answer"}
    (model / "training_info.json").write_text(json.dumps({"trained_with": columns}))
    cfg, notes = load_saved_model_config({"init_from": str(model)})
    assert (cfg.prompt_column, cfg.response_column) == ("question", "answer")
    assert "--prompt_column=question --response_column=answer" in notes[-1]


def test_each_command_notes_the_options_it_does_not_read():
    from config import flags_with
    from lowmem.cli.flags import unread_flag_notes

    training_only = set(flags_with("reads", "train")) - set(flags_with("reads", "evaluate"))
    assert {"learn_rate", "optimizer", "save_steps", "resume_from"} <= training_only

    assert unread_flag_notes("train", {"learn_rate": 1, "max-new-tokens": 4}) == [
        "note: --max_new_tokens has no effect on train (it is read by generate)"]
    assert unread_flag_notes("plan", {"optimizer": "adamw", "prompt": "x"}) == [
        "note: --prompt has no effect on plan (it is read by generate)"]
    assert unread_flag_notes("preview", {"gradient_accumulation_steps": 4}) == []  # its windows are sorted per step
    for command in ("evaluate", "generate", "prepare"):
        assert len(unread_flag_notes(command, dict.fromkeys(training_only))) == len(training_only), command
        assert unread_flag_notes(command, {"max_source_len": 8, "tokenizer_dir": "t", "num_beams": 2}) == []
    assert unread_flag_notes("generate", {"prompt": "x", "max_new_tokens": 4}) == []
    assert unread_flag_notes("plot", {"output_dir": "r", "init_from": "m"}) == [
        "note: --init_from has no effect on plot (it is read by train)"]
    assert unread_flag_notes("train_tokenizer", dict.fromkeys(flags_with("reads", "train_tokenizer"))) == []
    assert unread_flag_notes("export", {"init_from": "m", "tokenizer_dir": "t", "epochs": 2}) == [
        "note: --epochs has no effect on export (it is read by train)"]


def test_objectives_come_from_the_registry_and_their_problems_join_the_config_error():
    import pkgutil
    import sys

    import data.objectives
    from data.objectives.base import Objective, objective_class, registry

    # Discovery: asking the registry imports every module of data/objectives/, each subclass named registered
    names = list(registry())
    modules = [m.name for m in pkgutil.iter_modules(data.objectives.__path__) if not m.name.startswith("_")]
    assert {"base", "pairs", "packed_text", "span_corruption", "prefix_lm"} <= set(modules)
    assert all(f"data.objectives.{m}" in sys.modules for m in modules)
    assert {"pairs", "span_corruption", "prefix_lm"} <= set(names)
    names = list(registry())
    assert all(issubclass(registry()[name], Objective) and registry()[name].name == name for name in names)
    with pytest.raises(UserError) as err:  # an unknown name lists the registry's, in the one error
        load_config({"objective": "nope", "learn_rate": -1})
    assert str(err.value) == f"--learn_rate must be positive (got -1.0); --objective must be one of " \
                             f"{', '.join(names)} (got 'nope')"
    with pytest.raises(UserError) as err:  # the objective's own problems come after the config's
        load_config({"objective": "span_corruption", "noise_density": 2, "mean_noise_span_length": 0.5,
                     "learn_rate": -1})
    assert str(err.value).split("; ") == ["--learn_rate must be positive (got -1.0)",
                                          "--noise_density must be in (0, 1) (got 2.0)",
                                          "--mean_noise_span_length must be at least 1 (got 0.5)"]
    with pytest.raises(UserError, match="--objective=prefix_lm makes new inputs every epoch"):
        load_config({"objective": "prefix_lm", "is_finetune": True, "encoder_cache": "memory"})
    load_config({"objective": "pairs", "noise_density": 2})  # pairs reads no noise: nothing to refuse
    assert ".txt" in objective_class("prefix_lm").formats and ".txt" not in objective_class("pairs").formats
    assert objective_class("pairs").prepared_data and not objective_class("span_corruption").prepared_data
    from train_low_mem import COMMANDS

    text = help_text(COMMANDS)  # --help lists each objective with its summary
    assert all(f"{name}: {registry()[name].summary}" in text for name in names)
