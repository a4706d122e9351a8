"""Bytes of a T5's tensors in training and evaluation, from its shapes: weights, gradients,
optimizer state, the activations a micro-batch saves for backward, and what evaluation allocates.

Pure functions of the config and the model's dimensions; ``lowmem.memory.planner`` adds them up into a
peak by component and checks them against measured RSS (``bench/memory_modes.py``). The shapes
follow the model the trainer builds, for every family ``--init_from`` takes (T5, T5 v1.1 / flan-t5,
mT5, umT5, ByT5): a gated feed-forward, an untied ``lm_head``, a relative position table in every
layer (umT5), an embedding padded past the tokenizer.
"""

from __future__ import annotations

import functools

from config import TrainConfig
from lowmem.hardware.precision import PRECISIONS
from lowmem.model.source import model_folder_config
from lowmem.utils.frozen_forms import FROZEN_FORMS
from lowmem.utils.presets import loss_chunk_rows, preset_shape

ATTENTION_GRADS = 2  # attention-sized gradients alive at once in one layer's backward
# Values a token's feed-forward saves for backward, in units of d_ff (saved-tensor hooks on T5LayerFF):
# ReLU 3 (its output, the CPU dropout's float mask, wo's input; 3.25 as calibrated on the whole model),
# and what a gated one adds, its activation fused (lowmem.model.build.fuse_gelu; silu is): 2 (wi_0's and
# wi_1's outputs and the activation's output, less ReLU's output), 3 without dropout (their product, wo's
# input, is then kept too).
FF_SAVED = 3.25
GATED_FF_SAVED = 2.0
GATED_FF_SAVED_NO_DROPOUT = 3.0
# Without dropout (--dropout_rate=0) no masks or dropout outputs are saved (hooks on tiny and small):
# the feed-forward keeps ReLU's output only (wo reads it), a block 2 fewer d_model-wide values per token
# (the masks after attention and feed-forward), and attention 1 value per pair instead of 3 (the
# softmax output, which the batched matmul reads too). Measured: small 16 x 128 saved 962 MiB
# without dropout, 1,817 with (the dropout model: 1,860).
FF_SAVED_NO_DROPOUT = 1.0
PARTS = ("shared", "encoder", "decoder", "lm_head")


FILE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # a checkpoint's dtype (config.json) -> bytes per element
OPTIMIZER_STATE = {"adamw": ("moments", 2), "adamw_scale": ("moments", 1),  # --optimizer: (its state's layout,
                   "adamw8bit": ("8bit", 2), "adafactor": ("factored", 1)}  # weight-sized temporaries of its step)


def model_dims(cfg: TrainConfig, vocab_size: int) -> dict:
    """The shape of the model the run trains: d_model, d_ff, num_heads, d_kv, num_layers,
    num_decoder_layers, vocab_size (the embedding's rows), gated (wi_0 and wi_1 instead of wi), tied
    (the output layer is the embedding), buckets (relative position buckets) and table_every_layer
    (umT5: each layer's self-attention has its own position table, not only the first layer's).

    From the ``--init_from`` model's config.json (whose embedding may have more rows than the
    tokenizer: Google pads it), else the preset's, tied as ``--tie_word_embeddings`` says.
    """
    if cfg.init_from:
        return dict(folder_dims(str(cfg.init_from)))
    shape = preset_shape(cfg.model_preset, cfg.feed_forward_proj)
    gated = shape.pop("feed_forward_proj").startswith("gated-")
    return {**shape, "vocab_size": vocab_size, "gated": gated, "tied": cfg.tie_word_embeddings, "buckets": 32,
            "table_every_layer": False}


@functools.cache
def folder_dims(init_from: str) -> dict:
    """``model_dims`` of a model folder (or hub id), read once per process.

    transformers' own config class fills what config.json leaves out as ``from_pretrained`` does (mT5
    and umT5 default to gated-gelu; a saved ``is_gated_act`` overrides ``feed_forward_proj``). The head
    is tied unless config.json says ``tie_word_embeddings: false`` (transformers 5 always sets it true
    in the loaded config and unties only a checkpoint with its own ``lm_head.weight``, which such
    releases and our exports of them have).
    """
    from transformers import AutoConfig

    saved = model_folder_config(init_from)
    config = AutoConfig.for_model(**saved)
    dims = {k: getattr(config, k) for k in ("d_model", "d_ff", "num_heads", "d_kv", "num_layers")}
    return {**dims, "num_decoder_layers": config.num_decoder_layers or config.num_layers,
            "vocab_size": config.vocab_size, "gated": bool(config.is_gated_act),
            "tied": saved.get("tie_word_embeddings") is not False, "buckets": config.relative_attention_num_buckets,
            "table_every_layer": saved["model_type"] == "umt5",
            "file_bytes": FILE_BYTES.get(str(saved.get("dtype") or saved.get("torch_dtype")), 4)}


def parameter_shapes(dims: dict) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """(name, shape) of every parameter by part: the shared embedding, the encoder and decoder stacks,
    and the ``lm_head`` (empty when tied: the embedding is the output layer). Each tensor once, as
    ``lowmem.model.build.count_parameters`` counts them; names are the modules' own (q, wi_0, layer_norm)."""
    d, f, h, i = dims["d_model"], dims["d_ff"], dims["num_heads"], dims["num_heads"] * dims["d_kv"]
    table = [("relative_attention_bias", (dims["buckets"], h))]
    attention = [("q", (i, d)), ("k", (i, d)), ("v", (i, d)), ("o", (d, i)), ("layer_norm", (d,))]
    ff = [("wi_0", (f, d)), ("wi_1", (f, d))] if dims["gated"] else [("wi", (f, d))]
    ff += [("wo", (d, f)), ("layer_norm", (d,))]

    def stack(layers: int, cross_attention: bool) -> list:
        out = []
        for layer in range(layers):  # the first layer's self-attention holds the stack's position table
            out += table if layer == 0 or dims["table_every_layer"] else []
            out += attention + (attention if cross_attention else []) + ff
        return out + [("final_layer_norm", (d,))]

    rows = dims["vocab_size"]
    return {"shared": [("embedding", (rows, d))], "encoder": stack(dims["num_layers"], False),
            "decoder": stack(dims["num_decoder_layers"], True),
            "lm_head": [] if dims["tied"] else [("lm_head", (rows, d))]}


def largest_read_bytes(dims: dict, shapes: dict) -> int:
    """Host bytes of the largest group of tensors ``lowmem.model.streamed_load`` reads at once, as the checkpoint
    stores them (config.json's dtype; float32 when it names none): the tensors outside the blocks (the
    embedding and an untied head), or one decoder block (the largest)."""
    block = part_elements(shapes, "decoder") / dims["num_decoder_layers"]
    return int(dims.get("file_bytes", 4) * max(part_elements(shapes, "shared", "lm_head"), 1.1 * block))


def numel(shape: tuple[int, ...]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def part_elements(shapes: dict, *parts: str) -> int:
    """Elements of the parameters of these parts of ``parameter_shapes``."""
    return sum(numel(shape) for part in parts for _, shape in shapes[part])


def frozen_parts(cfg: TrainConfig) -> tuple[str, ...]:
    """The parts whose weights stay fixed: every base weight with LoRA, else what ``--freeze`` names (a
    tied output layer is the embedding and freezes with it; an untied ``lm_head`` always trains)."""
    if cfg.lora_r:
        return PARTS
    return {"encoder": ("shared", "encoder"), "embeddings": ("shared",), "none": ()}[cfg.freeze]


def lora_weights(cfg: TrainConfig, dims: dict) -> list[tuple[int, ...]]:
    """Shapes of the base weights that carry LoRA adapters: the ``--lora_target_modules`` linear layers
    of the stacks ``lowmem.model.build.lora_stacks`` names (``wi``: wi_0 and wi_1 on a gated model).

    Raises:
        UserError: a name that matches no linear layer of those stacks (as building the model would).
    """
    from lowmem.model.build import check_lora_targets, lora_stacks

    if not cfg.lora_r:
        return []
    shapes = parameter_shapes(dims)
    stacks = lora_stacks(cfg)
    linear = {"q", "k", "v", "o", "wi", "wi_0", "wi_1", "wo"}
    check_lora_targets(cfg, {name for stack in stacks for name, _ in shapes[stack] if name in linear})
    wanted = {name: {"wi_0", "wi_1"} if name == "wi" and dims["gated"] else {name} for name in cfg.lora_targets}
    names = set().union(*wanted.values())
    return [shape for stack in stacks for name, shape in shapes[stack] if name in names]


def trainable_shapes(cfg: TrainConfig, dims: dict) -> list[tuple[int, ...]]:
    """Shapes of the tensors that train: LoRA's A (r x in) and B (out x r) of each adapted weight, else
    every parameter of the parts ``--freeze`` leaves trainable."""
    if cfg.lora_r:
        return [adapter for out_f, in_f in lora_weights(cfg, dims)
                for adapter in ((cfg.lora_r, in_f), (out_f, cfg.lora_r))]
    frozen, shapes = frozen_parts(cfg), parameter_shapes(dims)
    return [shape for part in PARTS if part not in frozen for _, shape in shapes[part]]


def lora_merged_elements(cfg: TrainConfig, dims: dict) -> int:
    """Elements of the base weights that carry LoRA adapters (an export holds their merged copies)."""
    return sum(numel(shape) for shape in lora_weights(cfg, dims))


def matrix_elements(entries: list[tuple[str, tuple[int, ...]]]) -> int:
    """Elements of the weight matrices among ``entries``: not the norms nor the relative position
    tables, which ``--frozen_dtype=bfloat16`` keeps float32 (``store_frozen_in_bf16``)."""
    return sum(numel(shape) for name, shape in entries if len(shape) == 2 and name != "relative_attention_bias")


def frozen_matrix_elements(cfg: TrainConfig, shapes: dict) -> int:
    """Elements of the frozen weight matrices (what ``--frozen_dtype=bfloat16`` stores in bf16): those of
    the parts ``frozen_parts`` names."""
    return sum(matrix_elements(shapes[part]) for part in frozen_parts(cfg))


QUANTIZED_LAYERS = ("q", "k", "v", "o", "wi", "wi_0", "wi_1")  # what --frozen_dtype=int8|float8 stores in 8 bits


def quantized_shapes(cfg: TrainConfig, shapes: dict) -> list[tuple[int, ...]]:
    """Shapes of the weights ``--frozen_dtype=int8|float8`` stores in 8 bits (``lowmem.model.quantize``): the
    frozen stacks' linear layers, ``wo`` only with ``--quantize_wo``; never embeddings or the head."""
    if not FROZEN_FORMS[cfg.frozen_dtype].quantized:
        return []
    names = QUANTIZED_LAYERS + (("wo",) if cfg.quantize_wo else ())
    return [shape for part in ("encoder", "decoder") if part in frozen_parts(cfg)
            for name, shape in shapes[part] if name in names]


def quantized_saving(cfg: TrainConfig, quantized: list[tuple[int, ...]]) -> int:
    """Bytes 8-bit storage saves against float32: 3 of each element's 4, less one scale per output row
    (in the compute dtype) and quanto's two unused activation scales per layer."""
    scale = PRECISIONS[cfg.mixed_precision].width
    return sum(3 * numel(shape) - scale * shape[0] - 8 for shape in quantized)


def optimizer_bytes(cfg: TrainConfig, shapes: list[tuple[int, ...]]) -> tuple[int, int]:
    """(state bytes, largest per-step temporary) of --optimizer for these trainable shapes (test_memory_modes)."""
    (layout, temporaries), state, temp = OPTIMIZER_STATE[cfg.optimizer], 0, 0
    for shape in shapes:
        n = numel(shape)
        temp = max(temp, 4 * n * temporaries)
        if layout == "moments":  # two float32 moments a weight
            state += 8 * n
        elif layout == "8bit":
            state += (2 * n + 8 * (n // 256 + 1)) if n >= 4096 else 8 * n
            if n >= 4096:  # bitsandbytes' CPU step dequantizes both moments and works in float32
                temp = max(temp, 20 * n)  # measured: 5.0 x 4n for 1M-16M elements (bitsandbytes 0.50)
        else:  # Adafactor: factored second moment for matrices, full for vectors
            state += 4 * (shape[0] + shape[1]) if len(shape) == 2 else 4 * n
    return state, temp


def lora_layer_delta(cfg: TrainConfig, dims: dict, source_len: int, target_len: int, rows: int | None = None) -> float:
    """What LoRA changes in a decoder layer's saved tensors, in values (one micro-batch; 0 without LoRA).

    The frozen base layers no longer keep their inputs for a weight gradient (the feed-forward's,
    attention's and the norms' outputs: ``f + 7 d + 2 i`` values a target token); each adapter keeps
    its input instead, for ``lora_A``'s gradient. With ``--lora_dropout`` that is a dropped copy of
    the input and the dropout's scaled mask (two values per input value, each adapter its own);
    without, the input itself, shared by the adapters that read it (self-attention's q, k and v read
    one norm output; cross-attention's k and v read the encoder output, counted once already).
    Measured with saved-tensor hooks on ``small``, every single target and q,v / all six, with and
    without dropout, at 60-117 target and 64-128 source tokens: within -10 % / +30 % (the model
    errs high where a lone adapter lets the first block skip its backward).
    """
    if not cfg.lora_r:
        return 0.0
    b, s, t = rows or cfg.batch_size, source_len, target_len
    d, f, i = dims["d_model"], dims["d_ff"], dims["num_heads"] * dims["d_kv"]
    reads = {  # weight: the (input, tokens, width) of its self- and cross-attention / feed-forward layers
        "q": [("self_norm", t, d), ("cross_norm", t, d)], "k": [("self_norm", t, d), ("encoder", s, d)],
        "v": [("self_norm", t, d), ("encoder", s, d)], "o": [("self_o", t, i), ("cross_o", t, i)],
        "wi": [("ff_norm", t, d)], "wi_0": [("ff_norm", t, d)], "wi_1": [("ff_norm", t, d)], "wo": [("ff_act", t, f)]}
    gated = dims["gated"]
    names = {n for name in cfg.lora_targets for n in (("wi_0", "wi_1") if name == "wi" and gated else (name,))}
    if cfg.lora_dropout:
        kept = sum(2 * tokens * width for name in names for _, tokens, width in reads[name])
    else:
        inputs = {key: tokens * width for name in names for key, tokens, width in reads[name]}
        inputs.pop("encoder", None)  # the encoder output: already counted once (activation_bytes' encoder_out)
        kept = sum(inputs.values())
    return b * kept - b * t * (f + 7 * d + 2 * i)


def cpu_layer_bytes(cfg: TrainConfig, dims: dict, rows: int, source_len: int, target_len: int) -> tuple[float, float]:
    """Bytes one encoder layer and one decoder layer save for backward on the CPU (micro-batch of ``rows``
    rows padded to these lengths), all float32: counted with saved-tensor hooks."""
    b, s, t = rows, source_len, target_len
    d, f, h, i = dims["d_model"], dims["d_ff"], dims["num_heads"], dims["num_heads"] * dims["d_kv"]
    dropout = cfg.dropout_rate > 0
    gated = (GATED_FF_SAVED if dropout else GATED_FF_SAVED_NO_DROPOUT) if dims["gated"] else 0
    ff = ((FF_SAVED if dropout else FF_SAVED_NO_DROPOUT) + gated) * f
    block = (8 if dropout else 6) * d + 4 * i + ff  # per token: norms, q k v o, feed-forward, dropout masks
    # Attention keeps 3 values per head and (query, key) pair (softmax output, dropout output and its
    # batched-matmul copy; 1 without dropout), and the backward of one layer holds ATTENTION_GRADS more
    # of them at a time (activation_bytes).
    pair = 3 if dropout else 1
    encoder = b * s * (block + pair * h * s) * 4
    decoder = (b * t * (block + (4 if dropout else 3) * d + 2 * i + pair * h * (t + s)) + b * s * 2 * i) * 4
    return encoder, decoder


def gpu_layer_bytes(cfg: TrainConfig, dims: dict, rows: int, source_len: int, target_len: int) -> tuple[float, float]:
    """Bytes one encoder layer and one decoder layer save for backward on a CUDA GPU (micro-batch of
    ``rows`` rows padded to these lengths), dtype by dtype.

    A GPU's layer differs from ``cpu_layer_bytes`` in three ways. Attention runs in a fused kernel
    (transformers' T5 uses SDPA; with T5's position-bias mask that is the memory-efficient kernel), which
    keeps q, k, v, its output, a log-sum-exp per query and head, and the bias mask it was given (per head
    and pair: in bf16 autocast the mask's bf16 cast), never the softmax. Dropout keeps a bool mask, not a
    float one. Under bf16 autocast every linear layer keeps its own bf16 cast of its input, while the norms
    keep their float32 input and normalised value; in float32 the linear layers reading one norm share its
    output. tests/test_gpu_activations.py checks every layer kind within 0.1 % against a T5's saved tensors
    on the CPU with the first two put in (CPU autocast casts the same way); docs/benchmarks.md has the
    GPU's measured peaks against the plan.
    """
    d, f, h, i = dims["d_model"], dims["d_ff"], dims["num_heads"], dims["num_heads"] * dims["d_kv"]
    precision = PRECISIONS[cfg.mixed_precision]
    half, w = precision.half, precision.width  # w: matmul outputs and the casts of their inputs
    mask = 1 if cfg.dropout_rate > 0 else 0  # a bool per dropped value

    def norm(readers: int) -> int:  # a norm's saved values and what the linear layers reading it keep
        return 8 * d + (2 * d * readers if half else 4 * d)

    def attention(readers: int, keys: int) -> int:  # per query: q (k, v), output, o's input, bias row
        return norm(readers) + (readers + 2) * w * i + 4 * h + mask * d + w * h * keys

    # feed-forward per token
    if dims["gated"]:  # the fused activation's input (wi_0's output), its output, wi_1's output, the mask,
        # wo's input (its bf16 cast, the dropout's output, or the product)
        ff = norm(2) + (4 * w + mask) * f + mask * d
    else:  # ReLU's output, the dropout's mask, wo's input (a bf16 cast, or the dropout's float output;
        # without either, ReLU's output itself)
        ff = norm(1) + w * f + mask * f + (w * f if half or mask else 0) + mask * d
    ff += 2 * f if precision.float32_wo else 0  # fp16's wo runs on a float32 cast (4 bytes; bf16's: 2)
    encoder = rows * source_len * (attention(3, source_len) + ff)
    # cross-attention: q from the target, k and v (and their bf16 casts) from each source token
    decoder = (rows * target_len * (attention(3, target_len) + attention(1, source_len) + ff)
               + rows * source_len * (2 * w * i + (4 * d if half else 0)))
    return encoder, decoder


def activation_bytes(cfg: TrainConfig, dims: dict, batch: tuple[int, ...], device: str = "cpu") -> dict:
    """Bytes saved for backward (and live at the backward peak) for one micro-batch ``batch``: (source length,
    target length[, target tokens[, rows]]), its ``rows`` rows (default: --batch_size) padded to these lengths;
    logits exist only at its ``target tokens`` real target positions (default: all).
    ``decoder_block``: one decoder block's activations (what its backward, or recomputation, holds);
    ``logits_grad``: the logits' float gradient, what is left of them when the output layer's weight
    gradient is made."""
    source_len, target_len, target_tokens, rows = (*batch, None, None)[:4]
    b, s, t = rows or cfg.batch_size, source_len, target_len
    d, f, h = dims["d_model"], dims["d_ff"], dims["num_heads"]
    gated = dims["gated"]
    if device == "gpu":
        width = PRECISIONS[cfg.mixed_precision].width
        enc_layer, dec_layer = gpu_layer_bytes(cfg, dims, b, s, t)
    else:
        width = 4  # CPU autocast measured no saving
        enc_layer, dec_layer = cpu_layer_bytes(cfg, dims, b, s, t)
    dec_layer += lora_layer_delta(cfg, dims, s, t, b) * width
    n_enc, n_dec = dims["num_layers"], dims["num_decoder_layers"]
    frozen_encoder = cfg.frozen_encoder
    attention_grads = ATTENTION_GRADS * b * h * max(t * (t + s), 0 if frozen_encoder else s * s) * 4
    encoder_saved = 0 if frozen_encoder else enc_layer * n_enc
    # A frozen encoder runs under no_grad, one row at a time (frozen_encoder_states): only one layer's
    # scores and softmax, feed-forward (a gated one: wi_0's output, the activation's temporaries, wi_1's
    # output and their product) and a few hidden states of one row are alive at once.
    frozen_pass = s * (2 * h * s + (4 if gated else 2) * f + 6 * d) * width
    encoder_peak = frozen_pass if frozen_encoder and cfg.encoder_cache == "off" else 0
    if cfg.gradient_checkpointing and device == "gpu":
        # Each block keeps its input; one block is recomputed at a time, a decoder block's or later an
        # encoder block's, and torch's caching allocator reuses the first's memory for the second.
        encoder_saved = 0 if frozen_encoder else b * s * d * 4 * n_enc
        decoder_saved = b * t * d * 4 * n_dec + max(dec_layer, 0 if frozen_encoder else enc_layer)
    elif cfg.gradient_checkpointing:  # on the CPU both recomputed blocks count: the heap rarely fits
        encoder_saved = 0 if frozen_encoder else b * s * d * 4 * n_enc + enc_layer  # one in the other's place
        decoder_saved = b * t * d * 4 * n_dec + dec_layer
    else:
        decoder_saved = dec_layer * n_dec
    positions = b * t if target_tokens is None else target_tokens
    vocab, chunk = dims["vocab_size"], loss_chunk_rows(dims["vocab_size"], d, cfg.loss_chunk_size)
    if chunk:  # lowmem.model.chunked_loss: one chunk's float32 logits (and their half product) at a time, and the
        # gradient of the head's input, made in the forward (the head weight's too: ``backward_peak`` counts it)
        logits = min(positions, chunk) * vocab * (6 if PRECISIONS[cfg.mixed_precision].half else 4) + positions * d * 4
        logits_grad = positions * d * 4
    else:  # fp32: the log-softmax output (saved), its gradient and the logits' gradient at the loss's backward
        # (3.05 copies measured at 8,192 x 8,100); bf16 adds the bf16 logits and their float copy
        logits = positions * vocab * (2 + 3 * 4 if PRECISIONS[cfg.mixed_precision].half else 3 * 4)
        logits_grad = positions * vocab * 4
    encoder_out = b * s * d * 4
    return {"activations": encoder_saved + decoder_saved + encoder_peak + encoder_out + attention_grads,
            "logits": logits, "logits_grad": logits_grad, "encoder_saved": encoder_saved,
            "decoder_saved": decoder_saved, "decoder_block": dec_layer, "head_grad_in_forward": bool(chunk)}


def batch_cost(cfg: TrainConfig, dims: dict, device: str):
    """Bytes a micro-batch of (source, target[, target tokens]) lengths holds at its backward peak."""

    def cost(batch: tuple[int, ...]) -> float:
        act = activation_bytes(cfg, dims, batch, device)
        return act["activations"] + act["logits"]

    return cost


def kv_cache_bytes(dims: dict, sequences: int, positions: int, width: int) -> int:
    """A decoder's key/value cache: a key and a value per layer, head and position of each sequence."""
    return sequences * 2 * dims["num_heads"] * dims["d_kv"] * dims["num_decoder_layers"] * width * positions


def evaluation_bytes(cfg: TrainConfig, dims: dict, batches: list[tuple[int, int, int, int]]) -> float:
    """Bytes the costliest evaluation batch allocates (no_grad): the eval loss's forward, then
    ``generate``, each batch of (rows, longest source, longest target, target tokens).

    Generation (none with ``--eval_generate=False``) is planned to run to ``--max_target_len`` (an
    untrained model never stops early). Its cache holds a key and a value per decoder layer and position
    for every beam (self-attention over the generated tokens, cross-attention over the source); the
    self-attention ones grow by concatenation a token at a time, so the heap holds about two of them, and
    beam search copies every layer's cache (cross-attention's too) when it reorders the beams at each step.
    Measured on the CPU (small, 512 tokens): 101 MiB predicted 119 (greedy), 511 predicted 572 (4 beams).
    """
    d, h, vocab, beams = dims["d_model"], dims["num_heads"], dims["vocab_size"], cfg.num_beams
    half, chunk = PRECISIONS[cfg.mixed_precision].half, loss_chunk_rows(vocab, d, cfg.loss_chunk_size)
    width = PRECISIONS[cfg.mixed_precision].width
    worst = 0.0
    for rows, source, target, tokens in batches:
        n = rows * beams
        positions = 2 * cfg.max_target_len + (2 if beams > 1 else 1) * source
        generate = (kv_cache_bytes(dims, n, positions, width) + n * source * d * 4 + 3 * n * vocab * 4
                    if cfg.eval_generate else 0)
        # logits at the targets and their log-softmax (or one chunk's), one layer's attention scores and softmax
        logits = (min(tokens, chunk) * vocab * (6 if half else 4) if chunk else tokens * vocab * (10 if half else 8))
        loss = logits + 2 * rows * h * max(target * (target + source), source * source) * 4
        worst = max(worst, generate, loss)
    return worst
