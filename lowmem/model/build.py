"""Pure builders: the model (built, loaded, frozen, adapted, stored narrow) and its export state dict."""

from __future__ import annotations

import contextlib
import functools
import logging
from pathlib import Path

import torch

from config import TrainConfig
from lowmem.model.narrow_compute import compute_beside_narrow
from lowmem.model.source import adapter_base, check_weights, model_folder_config, resolve_model_dir
from lowmem.utils.errors import UserError
from lowmem.utils.frozen_forms import FROZEN_FORMS
from lowmem.utils.optional import hidden, import_accelerate, import_while_replaced, optional_import
from lowmem.utils.presets import preset_shape

# When installed, bitsandbytes is imported by peft, accelerate or transformers even if unused, and
# warns that it cannot fetch an optional 4-bit CPU kernel from the hub (nothing here uses it): one
# line of noise that would break the one-line error promise.
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


def import_transformers_models() -> None:
    """Import transformers' model stack without scipy (-40 MiB RSS and -0.3 s per process), and accelerate
    without boto3 (``lowmem.utils.optional.import_accelerate``).

    transformers imports ``scipy.optimize`` whenever scipy is installed, only for the Hungarian
    matching of its object-detection losses, which a T5 never calls. Those loss modules alone are
    imported while ``is_scipy_available`` answers False; the real answer is restored right after,
    so everything else in transformers still sees scipy.
    """
    import_accelerate()  # transformers imports it where installed: without boto3 (lowmem.utils.optional)
    import transformers.utils

    import_while_replaced("transformers.loss.loss_utils", transformers.utils, "is_scipy_available", lambda: False)


def build_model(cfg: TrainConfig, tokenizer):
    """A fresh T5 from a ``T5Config`` of the chosen preset (never a hub download)."""
    import_transformers_models()
    from transformers import GenerationConfig, T5Config, T5ForConditionalGeneration

    t5_config = T5Config(vocab_size=len(tokenizer), dropout_rate=cfg.dropout_rate,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         decoder_start_token_id=tokenizer.pad_token_id, tie_word_embeddings=cfg.tie_word_embeddings,
                         **preset_shape(cfg.model_preset, cfg.feed_forward_proj))
    model = T5ForConditionalGeneration(t5_config)
    if not cfg.tie_word_embeddings:
        untie_head(model)
    model.generation_config = GenerationConfig(
        decoder_start_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, max_new_tokens=cfg.max_target_len, num_beams=cfg.num_beams)
    return model


def untie_head(model) -> None:
    """Give a freshly built T5 an ``lm_head`` of its own, as T5 v1.1 and flan-t5 have (transformers 5's T5 ties
    it whatever the config says; ``tie_word_embeddings=False`` only turns off the tied head's d_model**-0.5 output
    scaling). Drawn with std d_model**-0.5 (fan-in), so the first logits have unit variance: transformers' std 1.0
    starts them d_model**0.5 times larger (tiny pretraining: eval loss 6.9 against 5.3, docs/benchmarks.md)."""
    weight = torch.empty_like(model.shared.weight).normal_(0.0, model.config.d_model ** -0.5)
    model.lm_head.weight = torch.nn.Parameter(weight)
    model.all_tied_weights_keys.pop("lm_head.weight", None)  # so a later tie_weights() leaves it untied


def load_model(init_from: str | Path, **config_overrides):
    """Load a T5-family model (a folder or a hub id) as saved: T5, T5 v1.1 / flan-t5, mT5, umT5, ByT5.

    ``from_pretrained`` reads the checkpoint as it is: an untied ``lm_head`` stays untied, a gated
    feed-forward stays gated (rebuilding from a config would tie the head in transformers 5).
    ``config_overrides`` such as ``dropout_rate`` replace values of its saved config.
    """
    import_transformers_models()
    import transformers
    from transformers import AutoModelForSeq2SeqLM

    model_folder_config(init_from)
    check_weights(init_from)
    verbosity = transformers.logging.get_verbosity()
    # transformers 5 warns on every untied checkpoint that its T5 config "specifies to tie" the head
    # (it always does): the checkpoint's distinct lm_head is what is loaded, which is right.
    transformers.logging.set_verbosity_error()
    try:
        return AutoModelForSeq2SeqLM.from_pretrained(str(resolve_model_dir(str(init_from))), **config_overrides)
    finally:
        transformers.logging.set_verbosity(verbosity)


def head_is_tied(model) -> bool:
    """Whether the output layer is the shared embedding itself (original T5) or its own matrix (v1.1 on)."""
    return model.lm_head.weight is model.shared.weight


def freeze_parts(model, freeze: str) -> None:
    """Freeze what ``--freeze`` names: ``encoder`` (encoder and shared embedding), ``embeddings`` (the
    shared embedding) or ``none``. A tied output layer is the embedding and freezes with it; an untied
    ``lm_head`` trains with the decoder."""
    modules = {"encoder": (model.shared, model.encoder), "embeddings": (model.shared,), "none": ()}[freeze]
    for module in modules:
        for param in module.parameters():
            param.requires_grad_(False)


def store_frozen_in_bf16(model) -> int:
    """Keep the frozen weight matrices in bfloat16 (half their memory); returns their element count.

    Inside bf16 autocast every matrix product reads its weights in bf16 anyway: the frozen ones are
    now rounded once, here, instead of at every use. Where bf16 products are slow on the device they compute
    in float32 a block at a time instead (``lowmem.model.narrow_compute``). Vectors (layer norms) and the small
    relative position tables stay float32, and the embedding lookups' outputs are turned back to float32, so
    the residual stream keeps the precision it has with float32 weights.
    """
    stored = 0
    for name, param in model.named_parameters():  # tied tensors are listed once
        if not param.requires_grad and param.dim() == 2 and "relative_attention_bias" not in name:
            param.data = param.data.to(torch.bfloat16)
            stored += param.numel()
        else:
            # from_pretrained maps the checkpoint file: while any tensor is a view of that mapping, every
            # page the cast read stays resident. Own copies let it go (the planner counts the moment).
            param.data = param.data.clone()
    compute_beside_narrow(model)
    return stored


def generation_cache():
    """An empty key/value cache for ``generate`` that grows a layer at a time.

    transformers 5.24 sizes the cache it makes from the config's ``num_layers``, the encoder's count:
    a model with more decoder than encoder layers (``num_decoder_layers``) fails in generation with an
    IndexError. Without a config, the cache adds each layer as the decoder reaches it.
    """
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    return EncoderDecoderCache(DynamicCache(), DynamicCache())


def count_parameters(model) -> tuple[int, int]:
    """(trainable, frozen) parameter counts; tied tensors are counted once. A weight DeepSpeed ZeRO-3 has
    partitioned holds an empty placeholder: its whole size is ``ds_numel``."""
    def size(p) -> int:
        return getattr(p, "ds_numel", p.numel())

    trainable = sum(size(p) for p in model.parameters() if p.requires_grad)
    return trainable, sum(size(p) for p in model.parameters()) - trainable


def lora_stacks(cfg: TrainConfig) -> tuple[str, ...]:
    """The stacks whose linear layers get adapters: those ``--freeze`` leaves trainable (a frozen
    encoder runs under no_grad, and its outputs may be cached)."""
    return ("decoder",) if cfg.frozen_encoder else ("encoder", "decoder")


def linear_layer_names(saved_config: dict) -> list[str]:
    """The names of a T5 block's linear layers, from a saved config.json (gated models: wi_0 and wi_1)."""
    gated = saved_config.get("is_gated_act") or str(saved_config.get("feed_forward_proj", "")).startswith("gated-")
    return ["q", "k", "v", "o", *(["wi_0", "wi_1"] if gated else ["wi"]), "wo"]


def check_lora_targets(cfg: TrainConfig, names) -> None:
    """Refuse a ``--lora_target_modules`` name that matches none of the linear layer ``names``.

    Raises:
        UserError: one line with the names that exist.
    """
    names = set(names)
    missing = [t for t in cfg.lora_targets if t not in names and not (t == "wi" and {"wi_0", "wi_1"} <= names)]
    if missing:
        listed = ", ".join(sorted(names, key=lambda n: ("qkvow".find(n[0]), n)))
        raise UserError(f"--lora_target_modules names {', '.join(missing)}, which this model does not have "
                        f"(its {' and '.join(lora_stacks(cfg))} linear layers are {listed}); list some of those")


def lora_module_names(model, cfg: TrainConfig) -> list[str]:
    """The module paths ``--lora_target_modules`` adapts (``wi``: ``wi_0`` and ``wi_1`` on gated models)."""
    found: dict[str, list[str]] = {}
    for path, module in model.named_modules():
        parts = path.split(".")
        if isinstance(module, torch.nn.Linear) and parts[0] in lora_stacks(cfg) and "block" in parts:
            found.setdefault(parts[-1], []).append(path)
    check_lora_targets(cfg, found)
    wanted = {n for t in cfg.lora_targets for n in ((t,) if t in found else ("wi_0", "wi_1"))}
    return sorted(p for name in wanted for p in found[name])


def add_lora(model, cfg: TrainConfig):
    """Inject LoRA adapters (peft) into the ``--lora_target_modules`` layers of the trainable stacks and
    freeze every other weight.

    The model stays a plain ``T5ForConditionalGeneration`` with LoRA layers inside, so the trainer
    calls it as before; :func:`export_state_dict` gives the plain weights for export.
    """
    paths = lora_module_names(model, cfg)
    # peft imports bitsandbytes whenever it is installed (44 MiB RSS and 1.9 s on the CPU), and asks for
    # it again while injecting, for its 8-bit layers, which a model here never has: it is hidden for both.
    with hidden("bitsandbytes"):
        peft = optional_import("peft", "--lora_r")
        # Exact module paths: peft matches a list entry against each module path's end, and a regex here
        # could not say which names matched nothing.
        config = peft.LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                                 target_modules=paths, bias="none")
        model = peft.inject_adapter_in_model(config, model)
    for name, param in model.named_parameters():
        param.requires_grad_("lora_" in name)
        if "lora_" in name and param.dtype != torch.float32:
            # peft gives adapters their base layer's dtype: an 8-bit layer reports its scales' (bf16 under
            # --mixed_precision=bf16), and adapters trained in bf16 lose most small updates to rounding
            param.data = param.data.float()
    return model


def apply_memory_modes(model, cfg: TrainConfig):
    """LoRA adapters (``--lora_r``) and activation checkpointing (``--gradient_checkpointing``)."""
    if cfg.lora_r:
        model = add_lora(model, cfg)
    if cfg.gradient_checkpointing:
        # transformers 5's name for it (gradient_checkpointing_enable is deprecated); non-reentrant,
        # and it keeps the dropout RNG state so the recomputed forward matches the first one.
        model.activation_checkpointing_enable()  # the training forwards ask for no KV cache (token_loss_sum);
        # the config's use_cache stays as it was, so that exports generate with one as before
    return model


def has_lora(model) -> bool:
    return any("lora_" in name for name, _ in model.named_parameters())


def export_state_dict(model, to_host: bool = False) -> dict | None:
    """The plain float32 weights to export, or None when the model's own state dict is that.

    LoRA layers are merged: W + (alpha / r) B A, adapter keys dropped, computed out of place (one
    layer at a time), so training goes on with the unmerged weights bit for bit. Each merged matrix
    is one allocation (a float32 copy of W, then ``addmm_``): peft's ``get_delta_weight`` made three
    W-sized temporaries per layer whose holes the heap could not reuse (a base export with 80
    adapted matrices rose by 270-290 MiB in 3 of 6 runs for 180 MiB of merged weights; with one
    allocation, 150-160 MiB in all 3). Our adapters are plain LoRA (no DoRA, no fan-in-fan-out),
    which is all peft's delta is then. With ``to_host``
    (a model on a GPU) every tensor is copied to host memory as float32 here, one at a time, so an
    export allocates nothing on the GPU beyond one layer's merged matrix; on the CPU, bf16-stored weights
    are turned float32 in place first (:func:`weights_in_float32`). Tied tensors stay shared.

    8-bit weights (``--frozen_dtype=int8|float8``) come back dequantized, as ``lowmem.model.quantize.Later``
    entries that ``save_in_shards`` makes one shard at a time (merged ones too).
    """
    from lowmem.model.quantize import QUANTO_STATE, Later, is_quantized, plain_weight

    lora = has_lora(model)
    quantized = {name: module for name, module in model.named_modules()
                 if is_quantized(getattr(module, "weight", None))}
    if not lora and not to_host and not quantized:
        return None
    plain = {}
    if lora:
        from peft.tuners.lora import LoraLayer

        for name, module in model.named_modules():
            if isinstance(module, LoraLayer):
                base = module.get_base_layer().weight
                plain[f"{name}.weight"] = (Later(base.numel(), functools.partial(merged_weight, module, to_host))
                                           if is_quantized(base) else merged_weight(module, to_host))
    skipped = {f"{name}.{entry}" for name in quantized for entry in QUANTO_STATE}
    for name, module in quantized.items():
        key = f"{name}.weight".replace(".base_layer.", ".")
        if key not in plain:
            plain[key] = Later(module.weight.numel(), functools.partial(
                plain_weight, module.weight, torch.float32, "cpu" if to_host else None))
    copies = {}  # storage -> its host copy
    for key, tensor in model.state_dict().items():
        if key in skipped:
            continue
        key = key.replace(".base_layer.", ".")
        if "lora_" in key or key in plain:
            continue
        if to_host:
            ptr = tensor.untyped_storage().data_ptr()
            tensor = copies[ptr] if ptr in copies else copies.setdefault(ptr, tensor.detach().to("cpu", torch.float32))
        plain[key] = tensor
    return plain


@torch.no_grad()
def merged_weight(module, to_host: bool) -> torch.Tensor:
    """A LoRA layer's base weight with its adapters merged in: one float32 allocation, then ``addmm_``.
    Float32 in every case: an 8-bit weight reports its scales' dtype (bf16 under --mixed_precision=bf16), and
    the merge cast to it rounded most of a small adapter update away."""
    from lowmem.model.quantize import is_quantized, plain_weight

    weight = module.get_base_layer().weight
    merged = plain_weight(weight) if is_quantized(weight) else weight.to(torch.float32, copy=True)
    for a in module.active_adapters:
        merged.addmm_(module.lora_B[a].weight.float(), module.lora_A[a].weight.float(), alpha=module.scaling[a])
    return merged.cpu() if to_host else merged


@contextlib.contextmanager
def weights_in_float32(model):
    """While inside, weights stored in bf16 (``--frozen_dtype``) are float32 again, so an export
    holds one dtype (``from_pretrained`` would otherwise load the whole model in bf16).

    One tensor at a time: the peak is what float32 storage would have cost all along. Back to bf16
    on exit, exactly (every bf16 value is a float32 value), so training goes on bit for bit.
    """
    from lowmem.model.quantize import is_quantized

    # tied tensors are listed once; 8-bit weights (with bf16 scales) are dequantized by the export itself
    halves = [p for p in model.parameters() if p.dtype == torch.bfloat16 and not is_quantized(p)]
    for param in halves:
        param.data = param.data.float()
    try:
        yield
    finally:
        for param in halves:
            param.data = param.data.to(torch.bfloat16)


def check_init_from(cfg: TrainConfig) -> None:
    """The --init_from model exists, and LoRA's targets are layers of it: checked before the planner and
    the model are built (a name the model lacks is a typo to fix first)."""
    if cfg.init_from:
        base = adapter_base(resolve_model_dir(str(cfg.init_from)))
        if base is not None:
            raise UserError(f"--init_from={cfg.init_from} is a LoRA adapter folder (of {base}), not a whole model; "
                            f"train from its base (--init_from={base}), or from a whole export of that run "
                            "(--merge_lora=True)")
        saved = model_folder_config(cfg.init_from)
        if cfg.lora_r:
            check_lora_targets(cfg, linear_layer_names(saved))


def fuse_gelu(model) -> int:
    """Compute gated-gelu's activation (T5 v1.1, flan-t5, mT5, ByT5 and the presets) with torch's fused
    tanh-GELU kernel, transformers' ``GELUTanh``; returns how many were replaced.

    transformers' ``gelu_new`` writes the same tanh approximation as six elementwise operations, and
    autograd keeps three of their intermediates for backward: 3 more values per feed-forward unit and token
    than the fused kernel, which keeps its input only (bf16 autocast on a GPU also runs its ``pow`` in
    float32). The two agree to rounding (4.8e-7 apart at most on inputs up to 15), so the config, and the
    exported model, still say gated-gelu.
    """
    from transformers.activations import GELUTanh, NewGELUActivation

    replaced = 0
    for module in model.modules():
        for name, child in module.named_children():
            if type(child) is NewGELUActivation:
                setattr(module, name, GELUTanh())
                replaced += 1
    return replaced


def ready_to_train(model, cfg: TrainConfig, stored: tuple[int, int] | None = None):
    """Fuse gated-gelu's activation, freeze what --freeze names, apply the memory modes (LoRA, gradient
    checkpointing, bf16 or 8-bit frozen weights). Returns the model and its trainable, frozen, bf16-stored
    and 8-bit frozen parameter counts.

    ``stored``: (bf16, 8-bit) elements of a model ``lowmem.model.streamed_load`` read in its training form already
    (frozen, narrowed and quantized as it was read); None for a model built or loaded whole.
    """
    form = FROZEN_FORMS[cfg.frozen_dtype]
    fuse_gelu(model)
    freeze_parts(model, cfg.freeze)
    model = apply_memory_modes(model, cfg)
    trainable, frozen = count_parameters(model)
    if stored is not None:
        frozen_bf16, frozen_8bit = stored
    else:
        frozen_bf16 = store_frozen_in_bf16(model) if form.narrow and not form.quantized else 0
        frozen_8bit = 0
        if form.quantized:
            from lowmem.model.quantize import quantize_frozen

            frozen_8bit = quantize_frozen(model, cfg)
    return model, {"trainable": trainable, "frozen": frozen, "frozen_bf16": frozen_bf16, "frozen_8bit": frozen_8bit}
