"""Frozen linear layers in 8 bits (``--frozen_dtype=int8|float8``) with optimum-quanto, and back to
plain float weights for exports.

The pattern of the low-VRAM recipes: ``quantize`` then ``freeze`` one T5 block at a time, so at most
one block's linear layers exist in full precision beside their 8-bit copies while quantizing. Only
frozen ``nn.Linear`` weights are quantized (one scale per output row, in the weight's dtype); what stays as
loaded, and why:

- ``wo``, the feed-forward output layer: T5's activations there are large and lose accuracy in
  8 bits (transformers keeps it in float32 for the same reason: ``_keep_in_fp32_modules``), unless
  ``--quantize_wo=True``;
- the embeddings (the shared one, the relative position tables): quanto has no quantized lookup;
- an untied ``lm_head``: frozen only under LoRA, and kept in full precision as transformers'
  quantizers keep it;
- layer norms and anything trainable.
"""

from __future__ import annotations

import functools

import torch

from config import TrainConfig
from lowmem.hardware.precision import PRECISIONS
from lowmem.model.narrow_compute import BlockLinear
from lowmem.utils.errors import UserError
from lowmem.utils.frozen_forms import FROZEN_FORMS
from lowmem.utils.optional import optional_package_missing

# The state dict entries of a quantized layer (its 8-bit weight and scales; the activation scales are unused)
QUANTO_STATE = ("weight._data", "weight._scale", "input_scale", "output_scale")


def import_quanto(cfg: TrainConfig):
    """optimum.quanto, or one line saying how to install it."""
    try:
        import optimum.quanto as quanto
    except ImportError:
        raise UserError(optional_package_missing(f"--frozen_dtype={cfg.frozen_dtype}", "optimum-quanto",
                                                 extra="quant")) from None
    return quanto


def is_quantized(tensor) -> bool:
    """Whether ``tensor`` is an optimum-quanto weight (its bytes in ``_data``, its scales in ``_scale``)."""
    return hasattr(tensor, "_data") and hasattr(tensor, "_scale") and hasattr(tensor, "dequantize")


def own_aligned_bytes(model) -> None:
    """Give each 8-bit weight's bytes a fresh allocation (after a checkpoint is loaded into them).

    Loading leaves the bytes where the file's layout put them, which need not be 16-byte aligned, and
    torch's int8 matrix product on the CPU (``_weight_int8pack_mm``, optimum-quanto's path under bf16)
    crashes the process on an unaligned weight: a segmentation fault at the resume's first forward.
    A copy is aligned (torch's allocator aligns every block to 64 bytes); its values are the same bits.
    """
    for param in model.parameters():
        if is_quantized(param):
            param._data = param._data.clone()


def quantizable_layers(block, quantize_wo: bool) -> list[str]:
    """Names (inside ``block``) of the frozen linear layers to quantize: not trainable, not LoRA's
    adapters (trainable), not ``wo`` unless asked."""
    return [name for name, module in block.named_modules()
            if isinstance(module, torch.nn.Linear) and not is_quantized(module.weight)
            and not module.weight.requires_grad and (quantize_wo or "wo" not in name.split("."))]


def quantize_frozen(model, cfg: TrainConfig) -> int:
    """Store the frozen linear layers of every T5 block in ``--frozen_dtype`` (8 bits), block by block.
    Returns the number of weight elements quantized.

    Runs after freezing and LoRA (peft's ``base_layer`` of an adapted layer is one of the frozen
    layers). Each block's weights are read again from the ``--init_from`` checkpoint file, through a
    mapping that closes once the block is quantized: ``from_pretrained``'s parameters are views of a
    mapping of that file which stays open, so reading the weights through them would leave every
    page read resident (the whole float32 model, for LoRA) until the run ends. So the peak holds one
    block in full precision, and the pages of the quantized weights are never read through the model's
    mapping. Quantizing is deterministic: a resume rebuilds the very same bytes (a checkpoint holds
    them too: the ``weight._data`` / ``weight._scale`` entries of the state dict).
    """
    from lowmem.hardware.memory_use import map_large_blocks

    compute = compute_dtype(cfg)
    files = checkpoint_files(cfg.init_from)
    quantized = 0
    # Every use of a quantized layer dequantizes its weight into a float temporary of a few MiB (base: up to
    # 9 MiB), freed right after; mapped blocks go back to the OS instead of fragmenting the heap.
    map_large_blocks()
    for stack_name in ("encoder", "decoder"):
        for index, block in enumerate(getattr(model, stack_name).block):
            names = quantizable_layers(block, cfg.quantize_wo)
            if not names:
                continue
            prefix = f"{stack_name}.block.{index}."
            fresh = read_weights(files, [(prefix + name).replace(".base_layer", "") + ".weight" for name in names])
            for name, weight in zip(names, fresh):
                layer = block.get_submodule(name)
                if weight is not None and weight.shape == layer.weight.shape:
                    layer.weight = torch.nn.Parameter(weight.to(layer.weight.dtype).to(compute), requires_grad=False)
                else:  # not in a safetensors file: from the loaded weight
                    layer.to(compute)
            del fresh
            quantized += quantize_block(cfg, block, names)
    return quantized


def compute_dtype(cfg: TrainConfig) -> torch.dtype:
    """The dtype of the 8-bit layers' scales, and so of their products: the run's precision's (float32 or bf16;
    fp16 is refused with 8-bit weights).

    bf16 in bf16 runs, so that the quantized layers compute and pass gradients back in bf16 like the rest
    under autocast (with float32 scales, quanto's backward multiplies a bf16 gradient by float32 weights and
    fails, and so does its CPU int8 kernel forward)."""
    return PRECISIONS[cfg.mixed_precision].dtype


def quantize_block(cfg: TrainConfig, block, names: list[str]) -> int:
    """Quantize the linear layers ``names`` of one T5 block (their weights in ``compute_dtype`` already) to
    ``--frozen_dtype``, frozen; returns the number of weight elements quantized."""
    from lowmem.hardware.memory_use import trim_heap

    quanto = import_quanto(cfg)
    quanto.quantize(block, weights=getattr(quanto, FROZEN_FORMS[cfg.frozen_dtype].qtype), include=names)
    quanto.freeze(block)  # the 8-bit weights replace the float ones here: one block at a time
    # The block's float weights and quantizing's temporaries are freed now, but the 8-bit results sit
    # between them on the C heap, which keeps them resident: a LoRA base model rose by 1 GiB.
    trim_heap()
    quantized = 0
    for name in names:
        layer = block.get_submodule(name)
        keep_frozen(layer)
        # quanto makes its weights trainable again when it loads them (a resume)
        layer.register_load_state_dict_post_hook(lambda module, _incompatible: keep_frozen(module))
        if has_row_scales(layer.weight):
            # as accelerate's hooks do: the instance's forward, so peft's adapters and the state dict see quanto's layer
            layer.forward = functools.partial(row_block_forward, layer)
        quantized += layer.weight.numel()
    return quantized


def has_row_scales(weight) -> bool:
    """Whether ``weight`` is quanto's plain 8-bit layout that ``BlockLinear`` computes with: the bytes
    as a matrix of the weight's shape, one scale per output row."""
    return (is_quantized(weight) and getattr(weight, "activation_qtype", None) is None
            and weight._data.dtype in (torch.int8, torch.float8_e4m3fn) and weight._data.shape == weight.shape
            and weight._scale.numel() == weight.shape[0] and weight.dim() == 2)


def row_block_forward(layer, x: torch.Tensor) -> torch.Tensor:
    """A quantized linear layer's forward: on the CPU ``BlockLinear`` in its scales' dtype, a block of rows at a time
    (``lowmem.model.narrow_compute``); quanto's own elsewhere.

    optimum-quanto's CPU path for float activations dequantizes the whole weight at every use, forward and backward,
    with a multiplication by the scales that casts each int8 element on its own (5-6x a plain conversion) into a
    fresh float matrix; under bf16 it takes torch's ``_weight_int8pack_mm``, several times slower here than
    converting and multiplying in bf16. Computes in the scales' dtype, as quanto does."""
    weight = layer.weight
    if x.device.type != "cpu" or type(x) is not torch.Tensor or not has_row_scales(weight):
        return type(layer).forward(layer, x)
    out = BlockLinear.apply(x, weight._data, weight._scale, weight._scale.dtype)
    return out if layer.bias is None else out + layer.bias


def checkpoint_files(init_from) -> dict:
    """{tensor name: safetensors file} of the ``--init_from`` model ({} when it has no safetensors)."""
    import json

    from lowmem.model.source import resolve_model_dir

    if not init_from:
        return {}
    folder = resolve_model_dir(str(init_from))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {key: folder / name for key, name in json.loads(index.read_text())["weight_map"].items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        return {}
    from safetensors import safe_open

    with safe_open(str(single), "pt") as f:
        return dict.fromkeys(f.keys(), single)


def read_weights(files: dict, keys: list[str]) -> list:
    """The tensors ``keys`` (None for one not in ``files``), each file mapped only while it is read."""
    from safetensors import safe_open

    found = [None] * len(keys)
    for path in {files[key] for key in keys if key in files}:
        with safe_open(str(path), "pt") as f:
            for i, key in enumerate(keys):
                if files.get(key) == path:
                    found[i] = f.get_tensor(key)
    return found


def keep_frozen(layer) -> None:
    """No gradients for a quantized layer's weights (quanto makes them trainable)."""
    for param in layer.parameters():
        param.requires_grad_(False)


def plain_weight(tensor, dtype: torch.dtype = torch.float32, device: str | None = None) -> torch.Tensor:
    """``tensor`` as a plain tensor of ``dtype``: dequantized when it is an 8-bit weight (a new
    tensor, the size of the float weight: made one at a time by the export)."""
    if is_quantized(tensor):
        tensor = tensor.dequantize()
    return tensor.detach().to(device or tensor.device, dtype)


class Later:
    """A float32 export tensor made only when its shard is written (a dequantized or merged weight)."""

    def __init__(self, numel: int, make):
        self.numel, self.make = numel, make


SHARD_BYTES = 64 * 2**20  # float32 bytes an export of a quantized model writes (and holds) per file


def save_in_shards(folder, model, weights: dict) -> None:
    """``save_pretrained``'s sharded layout for a model with 8-bit weights: ``weights`` (plain tensors
    and ``Later``) written a shard at a time, so the export holds one shard's float32 copies, not the
    whole model's (``save_pretrained`` needs every tensor at once). ``from_pretrained`` reads it as any
    checkpoint: one ``model.safetensors``, or shards plus ``model.safetensors.index.json``; tied tensors
    are stored once."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    seen, shards, size, total = set(), [[]], 0, 0
    for key, value in weights.items():
        if isinstance(value, torch.Tensor):
            if value.untyped_storage().data_ptr() in seen:  # a tied tensor: the first key holds it
                continue
            seen.add(value.untyped_storage().data_ptr())
        nbytes = 4 * value.numel if isinstance(value, Later) else value.numel() * value.element_size()
        if size and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size, total = size + nbytes, total + nbytes
    weight_map = {}
    for number, keys in enumerate(shards, start=1):
        name = "model.safetensors" if len(shards) == 1 else f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        shard = {key: (weights[key].make() if isinstance(weights[key], Later) else weights[key]).contiguous()
                 for key in keys}
        save_file(shard, str(Path(folder) / name), metadata={"format": "pt"})
        del shard  # free this shard's float32 copies before the next
        weight_map.update(dict.fromkeys(keys, name))
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (Path(folder) / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    model.config.architectures = [type(model).__name__]  # what save_pretrained writes beside the weights
    model.config.save_pretrained(folder)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(folder)
