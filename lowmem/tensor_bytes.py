"""Bytes of a T5's tensors in training and evaluation, from its shapes: weights, gradients,
optimizer state, the activations a micro-batch saves for backward, and what evaluation allocates.

Pure functions of the config and the model's dimensions; ``lowmem.planner`` adds them up into a
peak by component and checks them against measured RSS (``bench/memory_modes.py``).
"""

from __future__ import annotations

from config import MODEL_PRESETS, TrainConfig
from lowmem.model_source import model_folder_config

ATTENTION_GRADS = 2  # attention-sized gradients alive at once in one layer's backward


def model_dims(cfg: TrainConfig, vocab_size: int) -> dict:
    """d_model, d_ff, heads, d_kv, layers and vocabulary of the model the run trains."""
    if cfg.init_from:
        saved = model_folder_config(cfg.init_from)
        dims = {k: saved[k] for k in ("d_model", "d_ff", "num_heads", "d_kv", "num_layers")}
        dims["num_decoder_layers"] = saved.get("num_decoder_layers") or saved["num_layers"]
        dims["vocab_size"] = saved["vocab_size"]
        return dims
    return {**MODEL_PRESETS[cfg.model_preset], "vocab_size": vocab_size}


def parameter_shapes(dims: dict) -> dict[str, list[tuple[int, ...]]]:
    """Parameter shapes of a tied T5 by part: shared embedding, encoder, decoder."""
    d, f, h, i = dims["d_model"], dims["d_ff"], dims["num_heads"], dims["num_heads"] * dims["d_kv"]
    attention = [(i, d), (i, d), (i, d), (d, i), (d,)]  # q k v o, layer norm
    ff = [(f, d), (d, f), (d,)]
    encoder = [(32, h)] + (attention + ff) * dims["num_layers"] + [(d,)]
    decoder = [(32, h)] + (attention * 2 + ff) * dims["num_decoder_layers"] + [(d,)]
    return {"shared": [(dims["vocab_size"], d)], "encoder": encoder, "decoder": decoder}


def numel(shape: tuple[int, ...]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def trainable_shapes(cfg: TrainConfig, dims: dict) -> list[tuple[int, ...]]:
    shapes = parameter_shapes(dims)
    if cfg.lora_r:
        d, f, i = dims["d_model"], dims["d_ff"], dims["num_heads"] * dims["d_kv"]
        per_target = {"q": (d, i), "k": (d, i), "v": (d, i), "o": (i, d), "wi": (d, f), "wo": (f, d)}
        out = []
        for name in cfg.lora_targets:
            fan_in, fan_out = per_target[name]
            blocks = 2 if name in ("q", "k", "v", "o") else 1  # self- and cross-attention
            out += [(cfg.lora_r, fan_in), (fan_out, cfg.lora_r)] * blocks * dims["num_decoder_layers"]
        return out
    if cfg.is_finetune:
        return shapes["decoder"]
    return shapes["shared"] + shapes["encoder"] + shapes["decoder"]


def frozen_cast_bytes(n_params: int, half: int) -> int:
    """Host bytes while ``--frozen_dtype=bfloat16`` converts a loaded float32 checkpoint: the mapped
    file's pages (all read), the bf16 copies and float32 copies of the rest, until the file is let go."""
    return 4 * n_params + 2 * half + 4 * (n_params - half) if half else 0


def lora_merged_elements(cfg: TrainConfig, dims: dict) -> int:
    """Elements of the base weights that carry LoRA adapters (an export holds their merged copies)."""
    if not cfg.lora_r:
        return 0
    d, f, i = dims["d_model"], dims["d_ff"], dims["num_heads"] * dims["d_kv"]
    per_layer = {"q": 2 * d * i, "k": 2 * d * i, "v": 2 * d * i, "o": 2 * d * i, "wi": d * f, "wo": d * f}
    return sum(per_layer[name] for name in cfg.lora_targets) * dims["num_decoder_layers"]


def stack_matrix_elements(stack: list[tuple[int, ...]]) -> int:
    """Elements of a stack's weight matrices: not its norms nor its relative position table (its first
    shape), which ``--frozen_dtype=bfloat16`` keeps float32."""
    return sum(numel(x) for x in stack[1:] if len(x) == 2)


def frozen_matrix_elements(cfg: TrainConfig, shapes: dict) -> int:
    """Elements of the frozen weight matrices (what ``--frozen_dtype=bfloat16`` stores in bf16): in
    SFT the shared embedding and the encoder's, with LoRA the decoder's too."""
    if not cfg.is_finetune:
        return 0
    stacks = ["encoder"] + (["decoder"] if cfg.lora_r else [])
    return numel(shapes["shared"][0]) + sum(stack_matrix_elements(shapes[name]) for name in stacks)


def optimizer_bytes(cfg: TrainConfig, shapes: list[tuple[int, ...]]) -> tuple[int, int]:
    """(state bytes, largest per-step temporary) of --optimizer for these trainable shapes."""
    state, temp = 0, 0
    for shape in shapes:
        n = numel(shape)
        step_temp = 8 * n  # two update-sized tensors live at once inside step()
        if cfg.optimizer == "adamw":
            state += 8 * n
        elif cfg.optimizer == "adamw8bit":
            state += (2 * n + 8 * (n // 256 + 1)) if n >= 4096 else 8 * n
            if n >= 4096:  # bitsandbytes' CPU step dequantizes both moments and works in float32
                step_temp = 20 * n  # measured: 5.0 x 4n for 1M-16M elements (bitsandbytes 0.50)
        else:  # Adafactor: factored second moment for matrices, full for vectors
            state += 4 * (shape[0] + shape[1]) if len(shape) == 2 else 4 * n
            step_temp = 4 * n  # lowmem.optim.Adafactor builds the update in one tensor (measured: 1.0 x 4n)
        temp = max(temp, step_temp)
    return state, temp


def lora_layer_delta(cfg: TrainConfig, dims: dict, source_len: int, target_len: int) -> float:
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
    b, s, t = cfg.batch_size, source_len, target_len
    d, f, i = dims["d_model"], dims["d_ff"], dims["num_heads"] * dims["d_kv"]
    reads = {  # target: the (input, tokens, width) of its self- and cross-attention / feed-forward layers
        "q": [("self_norm", t, d), ("cross_norm", t, d)], "k": [("self_norm", t, d), ("encoder", s, d)],
        "v": [("self_norm", t, d), ("encoder", s, d)], "o": [("self_o", t, i), ("cross_o", t, i)],
        "wi": [("ff_norm", t, d)], "wo": [("ff_act", t, f)]}
    if cfg.lora_dropout:
        kept = sum(2 * tokens * width for name in cfg.lora_targets for _, tokens, width in reads[name])
    else:
        inputs = {key: tokens * width for name in cfg.lora_targets for key, tokens, width in reads[name]}
        inputs.pop("encoder", None)  # the encoder output: already counted once (activation_bytes' encoder_out)
        kept = sum(inputs.values())
    return b * kept - b * t * (f + 7 * d + 2 * i)


def activation_bytes(cfg: TrainConfig, dims: dict, source_len: int, target_len: int, device: str = "cpu",
                     target_tokens: int | None = None) -> dict:
    """Bytes saved for backward (and live at the backward peak) for one micro-batch padded to these
    lengths; logits exist only at its ``target_tokens`` real target positions (default: all).
    ``decoder_block``: one decoder block's activations (what its backward, or recomputation, holds)."""
    b, s, t = cfg.batch_size, source_len, target_len
    d, f, h, i = dims["d_model"], dims["d_ff"], dims["num_heads"], dims["num_heads"] * dims["d_kv"]
    # On a GPU bf16 halves the matmul outputs (not norms / softmax); CPU autocast measured no saving.
    width = 2.4 if cfg.mixed_precision == "bf16" and device == "gpu" else 4
    block = 8 * d + 4 * i + 3.25 * f  # per token: norms, q k v o, feed-forward, dropout masks
    # Attention keeps 3 values per head and (query, key) pair (softmax output, dropout output and its
    # batched-matmul copy; counted with saved-tensor hooks), and the backward of one layer holds
    # ATTENTION_GRADS more of them at a time.
    enc_layer = b * s * (block + 3 * h * s) * width
    dec_layer = b * t * (block + 4 * d + 2 * i + 3 * h * (t + s)) * width + b * s * 2 * i * width
    dec_layer += lora_layer_delta(cfg, dims, s, t) * width
    n_enc, n_dec = dims["num_layers"], dims["num_decoder_layers"]
    frozen_encoder = cfg.frozen_encoder
    attention_grads = ATTENTION_GRADS * b * h * max(t * (t + s), 0 if frozen_encoder else s * s) * 4
    encoder_saved = 0 if frozen_encoder else enc_layer * n_enc
    # A frozen encoder runs under no_grad, one row at a time (frozen_encoder_states): only one layer's
    # scores and softmax, feed-forward and a few hidden states of one row are alive at once.
    frozen_pass = s * (2 * h * s + 2 * f + 6 * d) * width
    encoder_peak = frozen_pass if frozen_encoder and cfg.encoder_cache == "off" else 0
    if cfg.gradient_checkpointing:  # each block keeps its input; one block is recomputed at a time
        encoder_saved = 0 if frozen_encoder else b * s * d * 4 * n_enc + enc_layer
        decoder_saved = b * t * d * 4 * n_dec + dec_layer
    else:
        decoder_saved = dec_layer * n_dec
    positions = b * t if target_tokens is None else target_tokens
    logits = positions * dims["vocab_size"] * (4 * 4 if cfg.mixed_precision == "no" else 2 + 3 * 4)
    encoder_out = b * s * d * 4
    return {"activations": encoder_saved + decoder_saved + encoder_peak + encoder_out + attention_grads,
            "logits": logits, "encoder_saved": encoder_saved, "decoder_saved": decoder_saved,
            "decoder_block": dec_layer}


def batch_cost(cfg: TrainConfig, dims: dict, device: str):
    """Bytes a micro-batch of (source, target[, target tokens]) lengths holds at its backward peak."""

    def cost(batch: tuple[int, ...]) -> float:
        act = activation_bytes(cfg, dims, *batch[:2], device, *batch[2:])
        return act["activations"] + act["logits"]

    return cost


def kv_cache_bytes(dims: dict, sequences: int, positions: int, width: int) -> int:
    """A decoder's key/value cache: a key and a value per layer, head and position of each sequence."""
    return sequences * 2 * dims["num_heads"] * dims["d_kv"] * dims["num_decoder_layers"] * width * positions


def evaluation_bytes(cfg: TrainConfig, dims: dict, batches: list[tuple[int, int, int, int]]) -> float:
    """Bytes the costliest evaluation batch allocates (no_grad): the eval loss's forward, then
    ``generate``, each batch of (rows, longest source, longest target, target tokens).

    Generation is planned to run to ``--max_target_len`` (an untrained model never stops early). Its
    cache holds a key and a value per decoder layer and position for every beam (self-attention over
    the generated tokens, cross-attention over the source); the self-attention ones grow by
    concatenation a token at a time, so the heap holds about two of them, and beam search copies
    every layer's cache (cross-attention's too) when it reorders the beams at each step.
    Measured on the CPU (small, 512 tokens): 101 MiB predicted 119 (greedy), 511 predicted 572 (4 beams).
    """
    d, h, vocab, beams = dims["d_model"], dims["num_heads"], dims["vocab_size"], cfg.num_beams
    width = 2 if cfg.mixed_precision == "bf16" else 4
    worst = 0.0
    for rows, source, target, tokens in batches:
        n = rows * beams
        positions = 2 * cfg.max_target_len + (2 if beams > 1 else 1) * source
        generate = kv_cache_bytes(dims, n, positions, width) + n * source * d * 4 + 3 * n * vocab * 4
        # logits at the target tokens and their log-softmax, and one layer's attention scores and softmax
        loss = (tokens * vocab * (8 if cfg.mixed_precision == "no" else 10)
                + 2 * rows * h * max(target * (target + source), source * source) * 4)
        worst = max(worst, generate, loss)
    return worst
