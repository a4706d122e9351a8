"""``--init_from`` read straight into the form the run trains in, one T5 block at a time.

``from_pretrained`` builds the whole model in the checkpoint's dtype before anything can narrow it: the
hub's flan-t5-xxl is 45 GB in float32, 22.6 GB in bfloat16, more than the hosts this project is for. Here
the model is made on the meta device (no memory), and each block's tensors are read from the files
(``lowmem.model.weight_files``), converted to their training form and placed on their device as they come:

- trainable tensors: float32;
- frozen ones, by ``--frozen_dtype``: float32; bfloat16 matrices; or, for int8 / float8, the block's
  frozen linear layers quantized there and then (optimum-quanto, ``lowmem.model.quantize``), and the matrices
  kept as loaded (``wo`` unless ``--quantize_wo``, the embedding, a frozen untied head) in bfloat16
  (docs/large_models.md: the error that adds beside 8-bit layers, measured), computing in float32 where bf16
  products are slow on the device (``lowmem.model.narrow_compute``);
- layer norms and the relative position tables: float32.

So the host holds the training form plus one block's tensors as read. LoRA's adapters are added after
(``lowmem.model.build.add_lora``), as on a loaded model: they wrap the 8-bit layers.
"""

from __future__ import annotations

import torch

from config import TrainConfig
from lowmem.model.quantize import compute_dtype
from lowmem.model.weight_check import meta_model  # (the checks before a load build the same)
from lowmem.utils.errors import UserError
from lowmem.utils.frozen_forms import FROZEN_FORMS

# Checkpoint keys transformers drops on load (T5ForConditionalGeneration._keys_to_ignore_on_load_unexpected)
IGNORED_KEYS = ("decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight",)


def is_frozen_matrix(name: str, param) -> bool:
    """A frozen weight matrix (what narrower storage may hold): not a norm, not a relative position table."""
    return not param.requires_grad and param.dim() == 2 and "relative_attention_bias" not in name


def stored_dtype(cfg: TrainConfig, name: str, param) -> torch.dtype:
    """The dtype a tensor of the model is kept in (8-bit layers: the dtype they are quantized from)."""
    if not is_frozen_matrix(name, param) or not FROZEN_FORMS[cfg.frozen_dtype].narrow:
        return torch.float32
    if not quantized_later(cfg, name):  # (every frozen matrix, in bf16 storage)
        return torch.bfloat16
    return compute_dtype(cfg)  # the 8-bit layers'


def quantized_later(cfg: TrainConfig, name: str) -> bool:
    """Whether ``name`` (a frozen matrix) is a linear layer of a block that ``--frozen_dtype`` stores in 8 bits."""
    parts = name.split(".")
    return (FROZEN_FORMS[cfg.frozen_dtype].quantized and "block" in parts and parts[-2] != "relative_attention_bias"
            and (cfg.quantize_wo or parts[-2] != "wo"))


def untie_head_if_saved(model, files: dict) -> None:
    """Give ``lm_head`` its own weight when the checkpoint holds one that differs from the embedding (T5 v1.1,
    flan-t5, mT5, ByT5), as ``from_pretrained`` does: transformers 5's T5 ties the two whatever the config."""
    from lowmem.model.weight_files import read_tensors

    if "lm_head.weight" not in files or model.lm_head.weight is not model.shared.weight:
        return
    if "shared.weight" in files:
        pair = read_tensors(files, ["shared.weight", "lm_head.weight"])
        if torch.equal(pair["shared.weight"], pair["lm_head.weight"]):
            return
        del pair
    model.lm_head.weight = torch.nn.Parameter(torch.empty_like(model.lm_head.weight))
    model.all_tied_weights_keys.pop("lm_head.weight", None)  # so a later tie_weights() leaves it untied


def load_groups(model) -> list[tuple[str, torch.nn.Module]]:
    """(prefix, module) in reading order: the tensors outside the blocks, then each block of each stack."""
    blocks = [(f"{stack}.block.{i}.", block) for stack in ("encoder", "decoder")
              for i, block in enumerate(getattr(model, stack).block)]
    return [("", model), *blocks]


def group_parameters(model, prefix: str, module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters a group loads: a block's own, or (prefix "") every one outside the blocks; each tied
    tensor once, under the name the checkpoint stores it by (``shared.weight``)."""
    if prefix:
        return [(prefix + name, param) for name, param in module.named_parameters()]
    return [(name, param) for name, param in model.named_parameters() if ".block." not in name]


def holders_of(model) -> dict[int, list[tuple[torch.nn.Module, str]]]:
    """{id of a parameter: every (module, attribute) holding it}: a tied tensor has several holders."""
    holders: dict[int, list] = {}
    for module in model.modules():
        for attr, param in module._parameters.items():
            if param is not None:
                holders.setdefault(id(param), []).append((module, attr))
    return holders


def place(holders: dict, param: torch.nn.Parameter, value: torch.Tensor, dtype: torch.dtype, device) -> None:
    """Replace a meta parameter by ``value`` in ``dtype`` on ``device`` in every module holding it, so a tensor
    tied under several names (the shared embedding and each stack's ``embed_tokens``) stays one."""
    # Always a copy: a tensor read in the dtype it is kept in would otherwise stay a view of the file's mapping,
    # keeping the mapping, and every page read through it, resident for the run.
    new = torch.nn.Parameter(value.to(device=device, dtype=dtype, copy=True), requires_grad=param.requires_grad)
    for module, attr in holders[id(param)]:
        module._parameters[attr] = new


def base_model_identity(cfg: TrainConfig) -> dict:
    """{"base_model": the --init_from given and its weights' fingerprint} for run_config.json (checked on resume:
    a checkpoint holds only what trains, and the rest is read again from there); {} without --init_from."""
    if not cfg.init_from:
        return {}
    from lowmem.model.source import resolve_model_dir
    from lowmem.model.weight_files import fingerprint

    return {"base_model": {"init_from": cfg.init_from, "fingerprint": fingerprint(resolve_model_dir(cfg.init_from))}}


def model_for_run(cfg: TrainConfig, tokenizer, device, shards: bool = False, guard=None) -> tuple:
    """(model, (bf16, 8-bit) elements or None): --init_from read in its training form, or a new one of the preset.

    One process's model goes straight to its ``device`` as it is read; a sharded engine (``shards``) shards a
    host copy.
    """
    from lowmem.model.build import build_model
    from lowmem.model.source import resolve_model_dir

    if not cfg.init_from:
        return build_model(cfg, tokenizer), None
    device = torch.device("cpu") if shards else device
    model, *stored = load_for_training(cfg, resolve_model_dir(cfg.init_from), device, guard)
    return model, tuple(stored)


def load_for_training(cfg: TrainConfig, folder, device="cpu", guard=None):
    """The ``--init_from`` model in its training form (see the module docstring), frozen as ``--freeze`` and
    LoRA say, before adapters: returns (model, elements stored in bf16, elements stored in 8 bits).

    ``guard``: called with what is being loaded after each group (the memory guard).

    Raises:
        UserError: the checkpoint lacks a tensor the model needs.
    """
    from lowmem.hardware.memory_use import trim_heap
    from lowmem.model.build import freeze_parts, fuse_gelu
    from lowmem.model.weight_files import read_tensors, weight_files

    files = weight_files(folder)
    model = meta_model(folder, cfg.dropout_rate)
    untie_head_if_saved(model, files)
    fuse_gelu(model)
    freeze_parts(model, cfg.freeze)
    if cfg.lora_r:  # every base weight is frozen; the adapters (added after) train
        model.requires_grad_(False)
    quantize = quantizer(cfg)
    holders = holders_of(model)
    narrow = eight_bit = 0
    for prefix, module in load_groups(model):
        params = group_parameters(model, prefix, module)
        missing = [name for name, _ in params if name not in files]
        if missing:
            raise UserError(f"{folder} is not a complete checkpoint of its config's model: it lacks {missing[0]}"
                            f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}; pass a complete "
                            "model folder")
        values = read_tensors(files, [name for name, _ in params])
        for name, param in params:
            dtype = stored_dtype(cfg, name, param)
            place(holders, param, values.pop(name), dtype, device)
            narrow += param.numel() if dtype == torch.bfloat16 and not quantized_later(cfg, name) else 0
        del values
        if prefix and quantize is not None:
            eight_bit += quantize(module, [name[len(prefix):] for name, p in params
                                           if is_frozen_matrix(name, p) and quantized_later(cfg, name)])
        trim_heap()  # the block's file-dtype copies and quantizing's temporaries go back to the OS
        if guard is not None:
            guard(f"loading {folder} ({prefix.rstrip('.') or 'embeddings'})",
                  "a smaller form of the model fits: --lora_r with --frozen_dtype=int8 (python train_low_mem.py "
                  "plan --budget_gb=... says which)")
    model.eval()  # as from_pretrained leaves it (the trainer sets the modes it trains in)
    if narrow:
        from lowmem.model.narrow_compute import compute_beside_narrow

        compute_beside_narrow(model)
    return model, narrow, eight_bit


def quantizer(cfg: TrainConfig):
    """For 8-bit frozen weights, a function that quantizes the named weights of one block (returns their
    element count); else None."""
    if not FROZEN_FORMS[cfg.frozen_dtype].quantized:
        return None
    from lowmem.hardware.memory_use import map_large_blocks
    from lowmem.model.quantize import quantize_block

    map_large_blocks()  # each use of an 8-bit layer dequantizes into a temporary: mapped, not left on the heap

    def quantize(block, weight_names: list[str]) -> int:
        layers = [name.rsplit(".", 1)[0] for name in weight_names]
        return quantize_block(cfg, block, layers) if layers else 0

    return quantize
