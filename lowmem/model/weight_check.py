"""A model folder checked before anything heavy reads it: every weight file's header, then config.json against them.

The model config.json describes is built on the ``meta`` device (no memory), and every tensor it has is compared
with what the weight files' headers say (``lowmem.model.weight_headers``: no tensor data is read): name, shape and
that it is a floating-point tensor. What ``from_pretrained`` lets pass passes here too: a tied tensor stored once
(``shared.weight`` for the embeddings and a tied head), a distinct ``lm_head.weight`` (t5-v1_1, flan-t5, mT5),
and the keys its model class ignores (older T5 checkpoints' decoder cross-attention position table). Anything
else is one line naming the file, the tensor and both shapes, and the config value behind the difference.

Used wherever a model is read (``lowmem.model.source.check_weights``: train, plan, evaluate, generate) and on
every export before it is moved into place (``lowmem.runs.run_folder``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from lowmem.model.weight_files import weight_files
from lowmem.model.weight_headers import TensorHeader, file_headers
from lowmem.utils.errors import UserError

# Which config value each dimension of a tensor comes from, by the end of its name (inner: num_heads x d_kv)
DIMENSIONS = ((("shared.weight", "embed_tokens.weight", "lm_head.weight"), ("vocab_size", "d_model")),
              ((".wi.weight", ".wi_0.weight", ".wi_1.weight"), ("d_ff", "d_model")),
              ((".wo.weight",), ("d_model", "d_ff")),
              ((".q.weight", ".k.weight", ".v.weight"), ("inner", "d_model")),
              ((".o.weight",), ("d_model", "inner")),
              (("relative_attention_bias.weight",), ("relative_attention_num_buckets", "num_heads")),
              (("layer_norm.weight",), ("d_model",)))
STACKS = {"encoder": "num_layers", "decoder": "num_decoder_layers"}
REBUILD = ("the config and weights are not one model: restore the config.json that came with these weights (or "
           "download or copy the model folder whole again)")


def meta_model(folder, dropout_rate: float):
    """The folder's model, its parameters on the meta device (no memory), with its generation config."""
    from transformers import AutoConfig, AutoModelForSeq2SeqLM, GenerationConfig

    config = AutoConfig.from_pretrained(str(folder), dropout_rate=dropout_rate)
    with torch.device("meta"):
        model = AutoModelForSeq2SeqLM.from_config(config)
    try:
        model.generation_config = GenerationConfig.from_pretrained(str(folder))
    except OSError:  # no generation_config.json: the one from_config made from the model's config
        pass
    return model


def skeleton(folder: Path):
    """The model config.json builds, on the meta device, built by its class itself: ``from_config`` (which
    ``meta_model`` uses) builds it inside ``deepspeed.zero.Init`` when a ZeRO-3 run registered its settings with
    transformers, a collective of every process, and an export is checked by the main process alone (it waited for
    the others for ever)."""
    from transformers import MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING, AutoConfig

    config = AutoConfig.from_pretrained(str(folder))
    with torch.device("meta"):
        return MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING[type(config)](config)


def check_model_folder(folder: Path, label: str, fix: str = REBUILD) -> None:
    """Refuse a model folder whose weight files are damaged or are not the model its config.json builds.

    ``label``: how the folder is named to the user (``--init_from=X``); ``fix``: what the line says to do.

    Raises:
        UserError: one line naming the file, the tensor and what differs.
    """
    folder = Path(folder)
    stored = folder_headers(folder)
    try:
        model = skeleton(folder)
    except Exception as err:  # a user's config.json: wrong types or values make transformers raise anything
        detail = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        raise UserError(f"{label}: {folder / 'config.json'} does not describe a model transformers can build "
                        f"({detail}); restore the model's own config.json") from None
    check_generation_config(folder, label)
    config = model.config
    built = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    different = [name for name in built if name in stored and tuple(stored[name].shape) != built[name]]
    if different:
        name = different[0]
        more = f" (and {len(different) - 1} more tensor{'s differ' if len(different) > 2 else ' differs'})" \
            if len(different) > 1 else ""
        raise UserError(f"{label}: {config_clue(config, name, stored[name].shape, built[name])}"
                        f"{stored[name].file.name} holds {name} of shape {list(stored[name].shape)} where the config "
                        f"builds {list(built[name])}{more}; {fix}")
    not_float = [name for name in built if name in stored and not stored[name].floating]
    if not_float:
        name = not_float[0]
        raise UserError(f"{label}: {stored[name].file.name} holds {name} as {stored[name].dtype}, not a "
                        f"floating-point tensor; {fix}")
    missing = [name for name in built if name not in stored and not may_be_missing(model, name, stored)]
    unexpected = [name for name in stored if name not in built and not ignored_on_load(model, name)]
    for names, what in ((missing, "lacks"), (unexpected, "holds")):
        if names:
            where = sorted({stored[n].file.name for n in names} if what == "holds" else
                           {h.file.name for h in stored.values()})
            more = f" and {len(names) - 1} more" if len(names) > 1 else ""
            whose = "that the config builds" if what == "lacks" else "that the config does not build"
            raise UserError(f"{label}: {count_clue(config, names)}{', '.join(where)} {what} {names[0]}{more} "
                            f"{whose}; {fix}")


def check_generation_config(folder: Path, label: str) -> None:
    """Refuse a generation_config.json that transformers cannot read (wrong types, not an object): every command
    reads it with the model (``from_pretrained``, ``streamed_load.meta_model``), and it failed there in a traceback.

    Raises:
        UserError: one line naming the file.
    """
    from transformers import GenerationConfig

    if not (folder / "generation_config.json").exists():
        return  # (transformers derives one from config.json)
    try:
        GenerationConfig.from_pretrained(str(folder))
    except Exception as err:  # a user's file: transformers raises whatever its values make it raise
        detail = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        raise UserError(f"{label}: {folder / 'generation_config.json'} cannot be read as a generation config "
                        f"({detail}); restore the model's own generation_config.json, or remove it (transformers "
                        "then derives one from config.json)") from None


def folder_headers(folder: Path) -> dict[str, TensorHeader]:
    """{tensor name: header} of every tensor the folder's weights hold, as its index (if any) assigns them.

    Raises:
        UserError: no weights, a damaged file, or an index naming a tensor its file does not hold.
    """
    files = weight_files(folder)
    headers: dict[str, TensorHeader] = {}
    for path in dict.fromkeys(files.values()):
        found = file_headers(path)
        listed = [name for name, file in files.items() if file == path]
        absent = [name for name in listed if name not in found]
        if absent:
            more = f" and {len(absent) - 1} more" if len(absent) > 1 else ""
            raise UserError(f"{folder}: the index puts {absent[0]}{more} in {path.name}, which does not hold it; "
                            "download or copy the model folder whole")
        headers.update((name, found[name]) for name in listed)
    return headers


def may_be_missing(model, name: str, stored: dict) -> bool:
    """Whether ``from_pretrained`` fills ``name`` without the files holding it: a tied tensor whose source (or,
    for the source, another of its ties but the head) is stored, or a key its class ignores when missing."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    if tied.get(name) in stored:
        return True
    if any(source == name and target in stored and target != "lm_head.weight" for target, source in tied.items()):
        return True
    return any(re.search(pattern, name) for pattern in getattr(model, "_keys_to_ignore_on_load_missing", None) or ())


def ignored_on_load(model, name: str) -> bool:
    """Whether ``from_pretrained`` drops ``name`` from the files without a word (its class's unexpected keys)."""
    return any(re.search(pattern, name) for pattern in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())


def config_clue(config, name: str, stored: tuple, built: tuple) -> str:
    """"config.json says d_model 64, but " for the first dimension that differs, where a config value decides it."""
    for suffixes, fields in DIMENSIONS:
        if name.endswith(suffixes):
            for field, have, want in zip(fields, stored, built):
                if have != want:
                    if field == "inner":
                        return (f"config.json says num_heads {config.num_heads} x d_kv {config.d_kv} = {want}, "
                                "but ")
                    return f"config.json says {field} {getattr(config, field)}, but "
    return ""


def count_clue(config, names: list[str]) -> str:
    """"config.json says num_layers 2, but " when the tensors that differ are whole blocks, or the feed-forward's
    form (``feed_forward_proj``: ReLU's ``wi`` against gated-gelu's ``wi_0`` / ``wi_1``)."""
    for stack, field in STACKS.items():
        if any(name.startswith(f"{stack}.block.") and ".DenseReluDense." not in name for name in names):
            return f"config.json says {field} {getattr(config, field)}, but "
    if any(".DenseReluDense.wi" in name for name in names):
        return f"config.json says feed_forward_proj {config.feed_forward_proj}, but "
    return ""


def check_adapter_folder(folder: Path, label: str, weights: str, fix: str = REBUILD) -> None:
    """Refuse a LoRA adapter folder whose adapter weights are damaged or not of the rank its config says.

    Raises:
        UserError: one line naming the file and the tensor.
    """
    folder = Path(folder)
    try:
        rank = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))["r"]
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"{label}: {folder / 'adapter_config.json'} cannot be read (JSON with the LoRA rank r); "
                        "pass a complete adapter folder") from None
    headers = file_headers(folder / weights)
    if not headers:
        raise UserError(f"{label}: {weights} holds no tensors; {fix}")
    for name, header in headers.items():
        dim = 0 if ".lora_A." in name else 1 if ".lora_B." in name else None
        if dim is not None and (len(header.shape) != 2 or header.shape[dim] != rank):
            raise UserError(f"{label}: adapter_config.json says r {rank}, but {weights} holds {name} of shape "
                            f"{list(header.shape)}; {fix}")


def check_export(staged: Path, final: Path, adapter_weights: str | None = None) -> None:
    """Refuse an export whose written weights are not the model its written config builds (or, for an adapter
    folder, ``adapter_weights`` not of its rank), while it is still staged: raised inside
    ``checkpoint.atomic_folder``, the export is dropped and the one before it stays in place.

    Raises:
        UserError: one line naming the export, the file and the tensor.
    """
    fix = (f"it was not kept ({final} is as it was before): the run wrote weights that its own config does not "
           "describe, a bug in t5-lowmem; please report it with the command you ran")
    if adapter_weights is not None:
        check_adapter_folder(staged, f"the export {final}", adapter_weights, fix)
    else:
        check_model_folder(staged, f"the export {final}", fix)
