"""The planner's GPU activation bytes (``lowmem.memory.tensor_bytes.gpu_layer_bytes``) against a T5's saved tensors.

No GPU here, so the forward runs on the CPU with the two things a CUDA GPU does differently put in
(what the planner's docstring names): attention as a fused kernel that saves q, k, v, the bias mask
(cast to bf16 under autocast), its output and a log-sum-exp, never the softmax; dropout keeping a
bool mask (the CPU keeps a float one, counted here at a byte a value). The rest, autocast's casts and
every other saved tensor, is the CPU's own and the same as CUDA's (gated-gelu's activation is fused, as
the trainer runs it: no ``pow``, which CUDA's autocast would run in float32).
"""

import pytest
import torch
from transformers import T5Config, T5ForConditionalGeneration
from transformers.integrations import sdpa_attention

from config import TrainConfig
from lowmem.memory.tensor_bytes import gpu_layer_bytes
from lowmem.model.build import fuse_gelu

DROPOUT = 0.1
SHAPE = dict(d_model=128, d_ff=512, num_heads=4, d_kv=32)


class FusedAttention(torch.autograd.Function):
    """The memory-efficient kernel's saved tensors (its backward is not needed here)."""

    @staticmethod
    def forward(ctx, q, k, v, bias, scale):
        scores = (q.float() @ k.float().transpose(-1, -2)) * scale + bias.float()
        out = (scores.softmax(-1) @ v.float()).to(q.dtype)
        ctx.save_for_backward(q, k, v, bias, out, torch.logsumexp(scores, -1))
        return out

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError


def fused_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, scale=None, is_causal=False, **_):
    assert attn_mask is not None and not is_causal  # T5 always passes its position bias as the mask
    if torch.is_autocast_enabled("cpu"):  # autocast casts every floating input of SDPA
        dtype = torch.get_autocast_dtype("cpu")
        with torch.autocast("cpu", enabled=False):
            return FusedAttention.apply(q.to(dtype), k.to(dtype), v.to(dtype), attn_mask.to(dtype), scale)
    return FusedAttention.apply(q, k, v, attn_mask, scale)


def saved_bytes(layers: int, decoder_layers: int, bf16: bool, dropout: float, monkeypatch, gated: bool = False) -> int:
    """Bytes a padded micro-batch's forward saves for backward, weights and logits excluded."""
    torch.manual_seed(0)
    vocab = 500
    family = dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False) if gated else {}
    model = T5ForConditionalGeneration(T5Config(vocab_size=vocab, decoder_start_token_id=0, dropout_rate=dropout,
                                                num_layers=layers, num_decoder_layers=decoder_layers, **SHAPE,
                                                **family))
    fuse_gelu(model)
    model.train()
    rows, source, target = 4, 48, 24
    src, tgt = torch.randint(2, vocab, (rows, source)), torch.randint(2, vocab, (rows, target))
    src_mask, tgt_mask = torch.ones_like(src), torch.ones_like(tgt)
    src_mask[0, -5:] = 0  # padded rows, as in training: the bias mask is then one per row
    tgt_mask[0, -3:] = 0
    monkeypatch.setattr(sdpa_attention.torch.nn.functional, "scaled_dot_product_attention", fused_sdpa)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(x):
        storage = x.untyped_storage()
        if storage.data_ptr() in seen or storage.data_ptr() in weights:
            return x
        size = storage.nbytes()
        if x.grad_fn is not None and type(x.grad_fn).__name__ == "TBackward0":
            size = 0  # a weight's bf16 cast: the planner's bf16_weight_copies
        elif x.shape and x.shape[-1] == vocab:
            size = 0  # logits: planned apart
        elif dropout and x.is_floating_point() and x.grad_fn is None:
            values = x.flatten()[:4096].float()
            if bool(((values == 0) | ((values - 1 / (1 - dropout)).abs() < 1e-2)).all()):
                size = x.numel()  # the CPU's float dropout mask; CUDA's is bool
        seen[storage.data_ptr()] = size
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        model(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask)
    return sum(seen.values())


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "float32"])
@pytest.mark.parametrize("dropout", [DROPOUT, 0.0], ids=["dropout", "no-dropout"])
@pytest.mark.parametrize("gated", [False, True], ids=["relu", "gated-gelu"])
def test_a_gpu_layer_is_planned_at_the_bytes_its_saved_tensors_take(bf16, dropout, gated, monkeypatch):
    # A layer is the difference between models of 2 and 1 layers (the embeddings and final norms cancel).
    one = saved_bytes(1, 1, bf16, dropout, monkeypatch, gated)
    encoder_layer = saved_bytes(2, 1, bf16, dropout, monkeypatch, gated) - one
    decoder_layer = saved_bytes(1, 2, bf16, dropout, monkeypatch, gated) - one
    cfg = TrainConfig(mixed_precision="bf16" if bf16 else "no", dropout_rate=dropout)
    planned = gpu_layer_bytes(cfg, {**SHAPE, "gated": gated}, 4, 48, 24)
    for name, measured, plan in (("encoder", encoder_layer, planned[0]), ("decoder", decoder_layer, planned[1])):
        assert 0.98 <= plan / measured <= 1.03, (name, plan, measured)
