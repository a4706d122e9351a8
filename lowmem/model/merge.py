"""A whole model's tensors for an export, each made only when its shard is written (``quantize.Later``, written by
``quantize.save_in_shards``): read from the files that hold it, LoRA's pair merged in, cast to the dtype asked for.

The ``export`` command (``lowmem.cli.export_command``) uses it for an adapter folder over its base, a run's checkpoint
over its base, and a model folder alone. Nothing is built in memory but the adapters: the model names its tensors
from the meta device, and a tensor exists only while its shard is written. A LoRA matrix is merged as
W + (B @ A) * scaling in float32, one allocation then ``addmm_`` (as ``lowmem.model.build.merged_weight`` merges a
loaded model's; peft's ``merge_and_unload`` would need the base loaded whole).
"""

from __future__ import annotations

import functools
import math
import re
from pathlib import Path

from lowmem.utils.errors import UserError

# The LoRA settings a merge here would get wrong (plain LoRA on linear layers is merged): refused in one line
UNMERGED = {"use_dora": "DoRA", "fan_in_fan_out": "fan-in-fan-out layers", "rank_pattern": "per-layer ranks",
            "alpha_pattern": "per-layer alphas", "modules_to_save": "modules saved whole", "lora_bias": "LoRA biases",
            "layer_replication": "replicated layers", "alora_invocation_tokens": "activated LoRA (aLoRA)",
            "use_qalora": "QALoRA", "arrow_config": "Arrow routing"}
# peft's adapter tensor names (base_model.model. ... .lora_A.weight) and a LoRA run's own (... .lora_A.default.weight)
LORA_KEY = re.compile(r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.default)?\.weight")
# A whole weight peft saves beside the adapters (save_embedding_layers: the head or an embedding among the targets),
# which it loads over the base's
WHOLE_KEY = re.compile(r"(?:base_model\.model\.)?(.+?)(?:\.base_layer)?\.weight")


def adapter_scaling(config: dict, where: Path) -> float:
    """LoRA's scaling of an ``adapter_config.json``: alpha / r, or alpha / sqrt(r) with rsLoRA, as peft scales.

    Raises:
        UserError: a kind of adapter this merge does not do (``UNMERGED``).
    """
    odd = [what for key, what in UNMERGED.items() if config.get(key)]
    if config.get("peft_type", "LORA") != "LORA":
        odd.insert(0, f"peft_type {config['peft_type']}")
    if odd:
        raise UserError(f"{where} uses {odd[0]}, which export does not merge (plain LoRA only); merge it with peft's "
                        "merge_and_unload")
    r = config["r"]
    alpha = config.get("lora_alpha", r)
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def lora_pairs(tensors: dict, where: Path) -> tuple[dict, dict]:
    """({layer path: (lora_A, lora_B)}, {name: whole weight}) of an adapter file's (or a LoRA run's checkpoint's)
    tensors: the whole weights are those peft saves beside the adapters (``WHOLE_KEY``).

    Raises:
        UserError: a tensor that is neither, or a matrix without its pair.
    """
    pairs: dict[str, dict] = {}
    whole = {}
    for key, value in tensors.items():
        found = LORA_KEY.fullmatch(key)
        if found is None and WHOLE_KEY.fullmatch(key) and ".lora_" not in key:
            whole[f"{WHOLE_KEY.fullmatch(key)[1]}.weight"] = value
            continue
        if found is None:
            raise UserError(f"{where} holds {key}, which is no LoRA matrix of a linear layer; export merges plain "
                            "LoRA only")
        pairs.setdefault(found[1], {})[found[2]] = value
    unpaired = sorted(path for path, pair in pairs.items() if len(pair) != 2)
    if unpaired:
        raise UserError(f"{where} holds only one of lora_A and lora_B for {unpaired[0]}; pass a complete adapter")
    return {path: (pair["A"], pair["B"]) for path, pair in pairs.items()}, whole


def held_tensors(tensors: dict) -> dict:
    """{name: reader} of tensors in memory (``lora_pairs``' whole weights)."""
    return {name: functools.partial(_itself, value) for name, value in tensors.items()}


def file_tensors(files: dict) -> dict:
    """{name: reader} of a model folder's ``weight_files``."""
    return {name: functools.partial(_read, path, name) for name, path in files.items()}


def checkpoint_tensors(path: Path) -> dict:
    """{name: reader} of a checkpoint's model.safetensors: a whole model's tied tensors are stored
    once, each dropped name recorded in the metadata beside the one kept (``checkpoint.save_trained``)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        names, metadata = list(f.keys()), f.metadata() or {}
    held = {name: functools.partial(_read, path, name) for name in names}
    held.update({dropped: functools.partial(_read, path, kept) for dropped, kept in metadata.items()
                 if kept in names and dropped not in held})
    return held


def merged_tensors(model, sources: list[dict], lora: dict, scaling: float, dtype, where: Path) -> dict:
    """{name: Later} for every tensor of ``model`` (a meta model: names and shapes), each tied tensor once under its
    first name: read from the first of ``sources`` (``held_tensors``, ``checkpoint_tensors``, ``file_tensors``) that
    holds it under any of its tied names, merged with its ``lora`` pair, cast to ``dtype``. ``where``: the folder
    named in a refusal.

    Raises:
        UserError: a tensor none of the sources holds, or an adapter on a layer the model lacks.
    """
    from lowmem.model.quantize import Later

    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    weights, left = {}, set(lora)
    for name, param in model.named_parameters():
        found = next((held[alias] for held in sources for alias in aliases[id(param)] if alias in held), None)
        if found is None:
            raise UserError(f"{where} and its base hold no {name}, which the model needs; pass a complete checkpoint "
                            "or model")
        layer = name.removesuffix(".weight")
        pair = lora.get(layer) if name.endswith(".weight") else None
        left.discard(layer)
        weights[name] = Later(param.numel(), functools.partial(made, found, pair, scaling, dtype))
    if left:
        raise UserError(f"{where} adapts {sorted(left)[0]}, which the base model has no linear layer of; pass "
                        "--base=MODEL with the model it was trained on")
    return weights


def made(read, pair: tuple | None, scaling: float, dtype):
    """One exported tensor, made as its shard is written: read, merged in float32 with its LoRA pair (one
    allocation, then ``addmm_``), cast."""
    import torch

    value = read()
    if pair is not None:
        a, b = pair
        value = value.to(torch.float32, copy=True)
        value.addmm_(b.float(), a.float(), alpha=scaling)
    return value.to(dtype, copy=True)  # a copy: no view keeps the file's mapping (and the pages read) alive


def _read(path: Path, stored: str):
    from lowmem.model.weight_files import read_tensors

    return read_tensors({stored: path}, [stored])[stored]


def _itself(value):
    return value
