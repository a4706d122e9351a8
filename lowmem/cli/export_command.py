"""The ``export`` command: a LoRA adapter merged into its base, a run's checkpoint, or a model folder, written as a
plain transformers model folder in the dtype asked for, a shard at a time.

    python train_low_mem.py export --init_from=runs/sft/final --export_dir=merged              # adapter, merged
    python train_low_mem.py export --init_from=runs/sft/checkpoints/latest --export_dir=step   # newest checkpoint
    python train_low_mem.py export --init_from=google/flan-t5-small --export_dir=flan-bf16 --dtype=bfloat16

``--init_from`` is one of:

- a peft adapter folder (``adapter_config.json`` with ``base_model_name_or_path``: a LoRA run's best/ or final/, or
  any peft LoRA adapter of a T5): merged into that base, a local folder or a hub id resolved through the Hugging Face
  cache as ``from_pretrained`` resolves it (``lowmem.model.source``), or the model ``--base`` names;
- a run's checkpoint (``checkpoints/step_N``; ``checkpoints/latest`` or ``checkpoints/``: the newest complete one):
  its ``model.safetensors`` over the base its ``run_config.json`` names (a checkpoint of a run with frozen weights
  holds only what trains; LoRA's adapters are merged), or a preset run's whole model;
- a model folder or hub id: written again, in ``--dtype``.

Nothing is built in memory but the adapters (``lowmem.model.merge``): the output's tensors are those of the model
its config builds on the meta device (``lowmem.model.weight_check.meta_model``), each made only as its shard is
written by ``RunFolder.export`` (through ``quantize.save_in_shards``), which also writes the config, generation
config and tokenizer, marks the head's tying and checks the folder before renaming it into place. So the base is
never held twice, nor once whole: the peak is one shard (``quantize.SHARD_BYTES`` of float32) beside the adapters.
Measured (the process's peak RSS over its RSS after the imports, 2026-12, tests/test_export.py checks it): an r=8
adapter on q and v merged into a small-preset model of 198 MiB in float32: +98 MiB (peft's ``merge_and_unload`` on
the base loaded once, then ``save_pretrained``: +338 MiB).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from lowmem.utils.errors import UserError
from lowmem.utils.ownership import ours_as, saved_json

DTYPES = ("float32", "bfloat16", "float16")
RUN_CONFIG = "run_config.json"
# What an export folder holds (RunFolder.export): a staging folder of those names alone is an earlier export's
EXPORT_ENTRIES = re.compile(r"config\.json|generation_config\.json|model(-\d+-of-\d+)?\.safetensors|"
                            r"model\.safetensors\.index\.json|training_info\.json|manifest\.json|\.manifest\.json\.tmp|"
                            r"tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json|added_tokens\.json|"
                            r"spiece\.model|chat_template\.jinja")
@dataclass
class Source:
    """What ``--init_from`` is: ``kind`` (adapter, checkpoint or model), its folder, and the model folder the export
    starts from (None: a preset run's checkpoint, which holds every weight)."""

    kind: str
    folder: Path
    base: Path | None
    base_name: str | None = None  # the base as named (a hub id, a path), for training_info.json
    run_config: dict = field(default_factory=dict)  # a checkpoint's


def export_command(init_from: str | None, export_dir, dtype="float32", base=None, tokenizer_dir=None,
                   say=print) -> dict:
    """Write ``init_from`` into ``export_dir`` as a plain transformers model folder in ``dtype``.

    Returns:
        A summary: the folder, what it was made from, the dtype, tensors written, LoRA matrices merged.

    Raises:
        UserError: no --init_from or --export_dir, an unknown dtype, an --export_dir that is not new or empty, an
            --init_from that is no adapter, checkpoint or model, a base that cannot be found.
    """
    if not init_from:
        raise UserError("export needs --init_from: a LoRA adapter folder, a run's checkpoint or a model folder")
    dtype = check_dtype(dtype)
    folder = check_export_dir(export_dir)
    source = find_source(str(init_from), None if base is None else str(base), say)
    refuse_inside(folder, source)
    from lowmem.model.build import import_transformers_models

    import_transformers_models()
    import torch

    from lowmem.runs.run_folder import ExportFiles, RunFolder

    model = skeleton(source)
    tokenizer, tokenizer_folder = export_tokenizer(source, model, tokenizer_dir)
    adapted = adapters(source)
    weights = export_weights(model, source, adapted, getattr(torch, dtype))
    model.config.dtype = getattr(torch, dtype)  # what from_pretrained loads it as (its default dtype is "auto")
    RunFolder.export(folder, model, ExportFiles(tokenizer, export_info(source, init_from, dtype), tokenizer_folder),
                     state_dict=weights, then=lambda: "run the export again")
    return {"export_dir": str(folder), "from": f"{source.kind} {source.folder}", "dtype": dtype,
            "tensors": len(weights), "lora_merged": len(adapted[0])}


def check_dtype(dtype) -> str:
    """``--dtype`` as one of ``DTYPES`` (fire gives a bare ``--dtype`` as True)."""
    if not isinstance(dtype, str) or dtype.strip().lower() not in DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(DTYPES)} (got {dtype!r})")
    return dtype.strip().lower()


def check_export_dir(export_dir) -> Path:
    """``--export_dir`` when it is new or empty (an export never replaces or mixes with files already there);
    touches nothing.

    Raises:
        UserError: not given, a file, a link, a folder with entries, or a staging folder beside it of other files.
    """
    if export_dir is None or isinstance(export_dir, (bool, tuple, list, dict)) or not str(export_dir).strip():
        raise UserError("export needs --export_dir: a new or empty folder for the model")
    folder = Path(os.path.expanduser(str(export_dir)))
    fix = "choose a new or empty folder (an export never replaces what is there)"
    if folder.is_symlink():
        raise UserError(f"--export_dir={folder} is a symbolic link; {fix}")
    if folder.exists() and not folder.is_dir():
        raise UserError(f"--export_dir={folder} is a file, not a folder; {fix}")
    try:
        entries = sorted(os.listdir(folder)) if folder.is_dir() else []
    except OSError as err:
        raise UserError(f"--export_dir={folder} cannot be read ({err.strerror}); {fix}") from None
    if entries:
        what = ours_as(folder, "export") or f"a folder holding {', '.join(entries[:3])}{', ...' * (len(entries) > 3)}"
        raise UserError(f"--export_dir={folder} is {what}; {fix}")
    from lowmem.checkpointing.checkpoint import staging_path

    staging = staging_path(folder)  # atomic_folder writes there first and removes what a stopped export left
    if staging.is_symlink() or staging.exists() and (not staging.is_dir() or any(
            not EXPORT_ENTRIES.fullmatch(name) for name in os.listdir(staging))):
        raise UserError(f"{staging} is in the way: an export writes there before renaming it to --export_dir, and "
                        "it holds files an export does not write; move it, or choose another --export_dir")
    return folder


def find_source(init_from: str, base: str | None, say=print) -> Source:
    """What ``--init_from`` is (see the module docstring), checked from its files' headers before anything is read.

    Raises:
        UserError: it does not exist, or is no adapter, checkpoint or model; its base cannot be used.
    """
    from lowmem.model.source import (
        ADAPTER_CONFIG,
        ADAPTER_WEIGHTS,
        check_weights,
        model_folder_config,
        resolve_model_dir,
    )
    from lowmem.model.weight_check import check_adapter_folder

    step = checkpoint_folder(Path(init_from).expanduser(), say)
    if step is not None:
        run_config = saved_json(step / RUN_CONFIG)
        if not isinstance(run_config, dict):
            raise UserError(f"--init_from={step}: its {RUN_CONFIG} cannot be read; pass a complete checkpoint")
        named = base or run_config.get("init_from")
        folder = base_folder(named, f"the checkpoint {step}", run_config) if named else None
        return Source("checkpoint", step, folder, named, run_config)
    folder = resolve_model_dir(init_from)  # a hub id: its cached snapshot (downloaded when online)
    if not folder.exists():
        raise UserError(f"--init_from={init_from} does not exist; pass a LoRA adapter folder, a run's checkpoint "
                        "(RUN/checkpoints/latest) or a model folder")
    if (folder / ADAPTER_CONFIG).is_file() and not (folder / "config.json").is_file():
        adapter_config = saved_json(folder / ADAPTER_CONFIG)
        if adapter_config is None:
            raise UserError(f"--init_from={init_from}: its {ADAPTER_CONFIG} cannot be read as JSON; pass a complete "
                            "adapter folder")
        named = adapter_config.get("base_model_name_or_path")
        if not named and not base:
            raise UserError(f"--init_from={init_from}: its {ADAPTER_CONFIG} names no base_model_name_or_path; pass "
                            "--base=MODEL with the model it adapts")
        if not (folder / ADAPTER_WEIGHTS).is_file():
            raise UserError(f"--init_from={init_from} is an adapter folder without {ADAPTER_WEIGHTS}; pass a "
                            "complete one")
        check_adapter_folder(folder, f"--init_from={init_from}", ADAPTER_WEIGHTS)  # (its base: base_folder)
        return Source("adapter", folder, base_folder(base or named, f"the adapter {folder}"), base or named)
    model_folder_config(init_from)  # a T5-family model folder (a run's folder is told to pass its best/)
    check_weights(init_from)
    return Source("model", folder, folder, init_from)


def checkpoint_folder(path: Path, say=print) -> Path | None:
    """The checkpoint ``path`` names: a step folder, or the newest complete one of a checkpoints folder (its
    ``latest`` pointer, or the folder itself); None where ``path`` is none of those.

    Raises:
        UserError: no complete checkpoint there, one written by a sharded engine, or a damaged one.
    """
    from lowmem.checkpointing import checkpoint
    from lowmem.parallel.engines import PlainEngine, engine_that_wrote

    if path.name == checkpoint.LATEST and path.is_file() or path.is_dir() and (path / checkpoint.LATEST).is_file():
        root = path.parent if path.is_file() else path
        step = checkpoint.find_latest_valid(root, warn=say)
        if step is None:
            raise UserError(f"--init_from={path}: {root} holds no complete checkpoint; pass a step folder, or the "
                            "run's best/ or final/")
    elif path.is_dir() and ((path / RUN_CONFIG).is_file() or checkpoint.is_step_name(path.name)):
        step = path
    else:
        return None
    written = engine_that_wrote(step)
    if written is not PlainEngine:
        raise UserError(f"--init_from={step} was written by {written.title}, each process its own shard; export the "
                        "run's best/ or final/ (whole models), or resume it and let it export")
    problem = checkpoint.validate(step)
    if problem is not None:
        raise UserError(f"--init_from={step} is not a complete checkpoint ({problem}); pass another one")
    return step


def base_folder(named: str, whose: str, run_config: dict | None = None) -> Path:
    """The model folder of the base ``named`` (a folder or a hub id), checked; for a checkpoint, the very weights
    its run trained on (``run_config``'s fingerprint).

    Raises:
        UserError: not found, not a model (an adapter itself), or other weights than the run's.
    """
    from lowmem.model.source import adapter_base, check_weights, model_folder_config, resolve_model_dir
    from lowmem.model.weight_files import fingerprint

    fix = "pass --base=MODEL with the folder or hub id of the model it was trained from"
    try:
        folder = resolve_model_dir(named)
        if adapter_base(folder) is not None:
            raise UserError(f"{named} is an adapter folder itself")
        model_folder_config(named)
        check_weights(named)
    except UserError as err:
        raise UserError(f"{whose} adapts the base model {named}, which cannot be used ({err}); {fix}") from None
    recorded = ((run_config or {}).get("base_model") or {}).get("fingerprint")
    found = fingerprint(folder) if recorded else None
    if recorded and found != recorded:
        raise UserError(f"{whose} trained on weights with fingerprint {recorded}, and {named} holds other weights "
                        f"(fingerprint {found}); {fix}")
    return folder


def refuse_inside(export_dir: Path, source: Source) -> None:
    """Refuse an --export_dir inside the folder it is made from (a checkpoint's, an adapter's, a model's)."""
    target = export_dir.resolve()
    for folder in (source.folder, source.base):
        if folder is not None and (target == folder.resolve() or folder.resolve() in target.parents):
            raise UserError(f"--export_dir={export_dir} is inside {folder}, which the export reads; choose a folder "
                            "outside it")


def skeleton(source: Source):
    """The exported model on the meta device (no memory): the base's config and generation config, its head untied
    where its files hold a head of its own; a preset run's from its recorded shape."""
    import torch

    from lowmem.model.streamed_load import untie_head_if_saved
    from lowmem.model.weight_check import meta_model
    from lowmem.model.weight_files import weight_files

    if source.base is None:
        from config import TrainConfig
        from lowmem.model.build import build_model
        from lowmem.runs.run_folder import PRESET_SHAPE

        keys = (*PRESET_SHAPE, "dropout_rate", "max_target_len", "num_beams")
        cfg = replace(TrainConfig(), **{k: source.run_config[k] for k in keys if k in source.run_config})
        tokenizer = _load_tokenizer(_run_tokenizer_dir(source))
        with torch.device("meta"):
            return build_model(cfg, tokenizer)
    own = saved_json(source.base / "config.json") or {}
    dropout = source.run_config.get("dropout_rate", own.get("dropout_rate", 0.1))  # a run's exports carry its own
    model = meta_model(source.base, dropout)
    untie_head_if_saved(model, weight_files(source.base))
    return model


def _run_tokenizer_dir(source: Source) -> Path | None:
    """The tokenizer a checkpoint's run used: its --tokenizer_dir, else its base model's own."""
    named = source.run_config.get("tokenizer_dir")
    return Path(named) if named else source.base


def _load_tokenizer(folder: Path | None):
    from data.tokenization import has_tokenizer, load_tokenizer

    if folder is None or not has_tokenizer(folder):
        raise UserError(f"no tokenizer in {folder}, which the export takes its tokenizer from; pass --tokenizer_dir="
                        "FOLDER with the tokenizer the model was trained with")
    return load_tokenizer(folder)


def export_tokenizer(source: Source, model, tokenizer_dir=None) -> tuple[object, Path]:
    """(tokenizer, its folder): ``--tokenizer_dir``, else an adapter's or model's own (an adapter's base's where it
    has none), else a checkpoint's run's; checked against the model's embedding and a checkpoint's record.

    Raises:
        UserError: none found, more tokens than embedding rows, or not the tokenizer the checkpoint's run used.
    """
    from data.tokenization import has_tokenizer, tokenizer_sha1

    if tokenizer_dir is not None:
        folder = Path(tokenizer_dir)
    elif source.kind == "checkpoint":
        folder = _run_tokenizer_dir(source)
    else:
        folder = source.folder if has_tokenizer(source.folder) else source.base
    tokenizer = _load_tokenizer(folder)
    rows = model.config.vocab_size
    if len(tokenizer) > rows:
        raise UserError(f"the tokenizer in {folder} has {len(tokenizer):,} tokens, the model's embedding {rows:,} "
                        "rows; pass the --tokenizer_dir the model was trained with")
    recorded = source.run_config.get("tokenizer_sha1")
    if recorded and tokenizer_sha1(tokenizer) != recorded:
        raise UserError(f"the tokenizer in {folder} is not the one the run of {source.folder} trained with (other "
                        "words); pass --tokenizer_dir with that one")
    return tokenizer, folder


def adapters(source: Source) -> tuple[dict, dict, float]:
    """({layer path: (lora_A, lora_B)}, {name: whole weight peft saved beside them}, scaling) of an adapter folder or
    a LoRA run's checkpoint ({}, {} elsewhere)."""
    from safetensors.torch import load_file

    from lowmem.model.merge import adapter_scaling, lora_pairs
    from lowmem.model.source import ADAPTER_CONFIG, ADAPTER_WEIGHTS

    if source.kind == "adapter":
        config = json.loads((source.folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))
        where = source.folder / ADAPTER_WEIGHTS
        return *lora_pairs(load_file(str(where)), where), adapter_scaling(config, source.folder)
    if source.run_config.get("lora_r"):  # its checkpoint holds the adapters alone (lowmem.model.build.add_lora)
        where = source.folder / "model.safetensors"
        scaling = source.run_config["lora_alpha"] / source.run_config["lora_r"]
        return *lora_pairs(load_file(str(where)), where), scaling
    return {}, {}, 1.0


def export_weights(model, source: Source, adapted: tuple, dtype) -> dict:
    """{name: Later} of the export (``lowmem.model.merge.merged_tensors``): the whole weights an adapter holds, or a
    checkpoint's own tensors (but a LoRA run's, which are its adapters), then the base's files; ``adapted``: what
    ``adapters`` gives."""
    from lowmem.model.merge import checkpoint_tensors, file_tensors, held_tensors, merged_tensors
    from lowmem.model.weight_files import weight_files

    lora, whole, scaling = adapted
    sources = [held_tensors(whole)]
    if source.kind == "checkpoint" and not source.run_config.get("lora_r"):
        sources.append(checkpoint_tensors(source.folder / "model.safetensors"))
    if source.base is not None:
        sources.append(file_tensors(weight_files(source.base)))
    return merged_tensors(model, sources, lora, scaling, dtype, source.folder)


def export_info(source: Source, init_from, dtype: str) -> dict:
    """training_info.json of the export: the source's own (a run's: what evaluate and generate adopt), and what it
    was exported from."""
    from lowmem.cli.flags import TRAINED_WITH

    if source.kind == "checkpoint":
        state = saved_json(source.folder / "trainer_state.json") or {}
        run = source.run_config
        info = {"kind": run.get("kind"), "train_file": run.get("train_file"), "step": state.get("step"),
                "held_out_rows": run.get("held_out_rows"),
                "trained_with": {key: run[key] for key in TRAINED_WITH if key in run}}
    else:
        info = saved_json(source.folder / "training_info.json") or {}
        info.pop("base_form", None)  # the merged model is whole: no base to read in a training form
    return {**info, "exported_from": {"init_from": str(init_from), "kind": source.kind, "base": source.base_name,
                                      "dtype": dtype}}
