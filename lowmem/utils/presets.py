"""Named presets: model shapes (``--model_preset``, ``--feed_forward_proj``) and memory budgets
(``--memory_profile``), with the reference's batch caps that one of them keeps. ``config`` validates the
names; ``lowmem.model.build`` and the planner read the shapes."""

from __future__ import annotations

# The reference's caps, kept by --memory_profile=host16g (a 16 GB host with nothing to spare): a request
# above a cap is lowered with a log line (a training batch then becomes more accumulation steps of
# micro-batches within the cap: the same batch per step). Elsewhere --batch_size and --eval_batch_size
# are budgets the planner checks (lowmem.memory.batch_budget).
LOW_MEMORY_CAPS = {"batch_size": 2, "eval_batch_size": 4}
CAPPED_PROFILES = ("host16g",)
AUTO = "auto"  # --batch_size / --eval_batch_size: the largest that fits the memory budget

MODEL_PRESETS = {
    # d_model, heads, d_kv, encoder layers, decoder layers. Smaller saves memory.
    "tiny": dict(d_model=128, num_heads=4, d_kv=32, num_layers=2, num_decoder_layers=2),
    "small": dict(d_model=512, num_heads=8, d_kv=64, num_layers=6, num_decoder_layers=6),
    "base": dict(d_model=768, num_heads=12, d_kv=64, num_layers=10, num_decoder_layers=10),
    # google/t5-v1_1-base's shape, which nanoT5 pretrains from random weights (recipes/nanot5.yaml)
    "t5-v1_1-base": dict(d_model=768, num_heads=12, d_kv=64, num_layers=12, num_decoder_layers=12),
}
# A preset's feed-forward width (d_ff) per --feed_forward_proj: gated-gelu's three matrices (wi_0, wi_1, wo) are
# 2/3 as wide as ReLU's two (wi, wo), to the nearest multiple of 64, so both hold about the same weights.
# t5-v1_1-base's are its own d_ff (2048) and, ReLU, the original t5-base's (3072).
FEED_FORWARD_WIDTHS = {"gated-gelu": {"tiny": 320, "small": 1344, "base": 2048, "t5-v1_1-base": 2048},
                       "relu": {"tiny": 512, "small": 2048, "base": 3072, "t5-v1_1-base": 3072}}


def preset_shape(preset: str, feed_forward_proj: str) -> dict:
    """The ``T5Config`` arguments of a preset's shape."""
    return {**MODEL_PRESETS[preset], "d_ff": FEED_FORWARD_WIDTHS[feed_forward_proj][preset],
            "feed_forward_proj": feed_forward_proj}


# Named budgets: each is a set of flags (explicit flags win). Expected memory and speed per preset:
# docs/memory.md, 'Memory modes, profiles and the planner' (python -m bench.profile_table).
MEMORY_PROFILES = {
    # A 16 GB host, no GPU: fp32 on the CPU, the smallest optimizer state, and the memory guard
    # checkpoints and stops before the OOM killer would.
    "host16g": dict(cpu=True, mixed_precision="no", optimizer="adafactor", gradient_checkpointing=False,
                    batch_size=2, gradient_accumulation_steps=16, max_rss_gb=14.0),
    # Consumer GPUs: bf16 autocast everywhere, checkpointing where memory is tightest, and the largest
    # micro-batches the GPU holds for an effective batch of 32 (accumulation follows).
    "gpu8g": dict(mixed_precision="bf16", optimizer="adafactor", gradient_checkpointing=True,
                  batch_size=AUTO, eval_batch_size=AUTO, effective_batch_size=32),
    "gpu12g": dict(mixed_precision="bf16", optimizer="adafactor", gradient_checkpointing=True,
                   batch_size=AUTO, eval_batch_size=AUTO, effective_batch_size=32),
    "gpu16g": dict(mixed_precision="bf16", optimizer="adafactor", gradient_checkpointing=False,
                   batch_size=AUTO, eval_batch_size=AUTO, effective_batch_size=32),
    # Enough memory for full AdamW state: the fastest settings.
    "gpu24g": dict(mixed_precision="bf16", optimizer="adamw", gradient_checkpointing=False,
                   batch_size=AUTO, eval_batch_size=AUTO, effective_batch_size=32),
    "gpu80g": dict(mixed_precision="bf16", optimizer="adamw", gradient_checkpointing=False,
                   batch_size=AUTO, eval_batch_size=AUTO, effective_batch_size=32),
}


def gpu_profile_gib(name: str) -> float:
    """The GPU memory a GPU profile is named for (gpu8g: 8 GiB)."""
    return float(name.removeprefix("gpu").removesuffix("g"))


# --loss_chunk_size=auto: each chunk of the LM head + loss holds float32 logits of at most this size
# (lowmem.model.chunked_loss; on mT5's head 128 target tokens: 0.21x the unchunked peak, bench/loss_chunks.py)
LOSS_CHUNK_LOGITS_BYTES = 128 * 2**20


def loss_chunk_rows(vocabulary: int, width: int, loss_chunk: int | str) -> int | None:
    """Target tokens per chunk of an LM head of ``vocabulary`` x ``width`` under ``--loss_chunk_size=loss_chunk``, or
    None: the logits whole. Chunked wherever the flag is not 0 and the head has more outputs than inputs (the logits
    outweigh the hidden states: every T5); ``auto`` is the power of two in [16, 4096] whose float32 logits fit
    ``LOSS_CHUNK_LOGITS_BYTES`` (128 tokens for mT5's 250,112, 1,024 for T5's 32,128)."""
    if not loss_chunk or vocabulary <= width:
        return None
    if loss_chunk != AUTO:
        return int(loss_chunk)
    rows = max(LOSS_CHUNK_LOGITS_BYTES // (4 * vocabulary), 1)
    return min(max(1 << (rows.bit_length() - 1), 16), 4096)
