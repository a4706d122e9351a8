"""Each target token's log-probability under the LM head, a chunk of tokens at a time: what preference tuning (DPO,
ORPO, SimPO) scores a response by, without ever holding the whole [tokens x vocabulary] logits, their log-softmax or
their gradient.

mT5 / umT5 have 250,112 output rows: 1,024 target tokens make 1.0 GB of float32 logits. The plain
``log_softmax(logits).gather`` keeps its 1.0 GB log-softmax from the forward to the backward, for the chosen and for
the rejected response alike, and its backward makes two more tensors of that size (the log-softmax's gradient and
the logits'). Here the forward keeps the head's input and weight (kept anyway) and one float32 log-sum-exp per
token (4 KB); the backward holds one chunk's logits at a time (128 tokens: 128 MB, ``--loss_chunk_size=auto``),
turned into their gradient in place, beside the weight's float32 gradient.

Unlike ``lowmem.model.chunked_loss`` (one summed loss, whose gradients the forward makes outright), each token's
output gets its own incoming gradient, known only in the backward: so the backward computes each chunk's logits
again, and the head costs four matrix products instead of three.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from lowmem.hardware.probe import capability
from lowmem.model.chunked_loss import IGNORED
from lowmem.model.loss import forward_replaced


class ChunkedTokenLogprobs(torch.autograd.Function):
    """log p(target | hidden) for each token (float32 [tokens]; 0.0 where the target is -100), from the logits
    ``hidden @ weight.T`` made ``chunk`` tokens at a time in ``dtype`` (the autocast dtype, as autocast runs the
    head), their softmax statistics and both gradients in float32 (float64 for float64 logits: gradcheck)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int, dtype):
        wide = torch.promote_types(dtype, torch.float32)
        out = torch.empty(len(hidden), dtype=wide, device=hidden.device)
        normalisers = torch.empty(len(hidden), dtype=wide, device=hidden.device)  # log-sum-exp per token
        with torch.autocast(hidden.device.type, enabled=False):
            low = weight.to(dtype)  # (no copy where the weight is stored in it)
            for start in range(0, len(hidden), chunk):
                rows, wanted = hidden[start:start + chunk], targets[start:start + chunk]
                logits = (rows.to(dtype) @ low.t()).to(wide)
                target_logit = logits.gather(1, wanted.clamp(min=0).unsqueeze(1)).squeeze(1)
                # log-sum-exp in the logits' own memory (torch.logsumexp would make a copy of them)
                top = logits.amax(dim=1, keepdim=True)
                sums = logits.sub_(top).exp_().sum(dim=1, keepdim=True)
                lse = normalisers[start:start + chunk]
                torch.add(top, sums.log_(), out=lse.unsqueeze(1))
                torch.sub(target_logit, lse, out=out[start:start + chunk])
                del logits  # before the next chunk's are made: one chunk's logits alive at a time
        out.masked_fill_(targets.eq(IGNORED), 0.0)
        ctx.chunk, ctx.logits_dtype = chunk, dtype
        ctx.save_for_backward(hidden, weight, targets, normalisers)  # nothing of the logits' size
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        hidden, weight, targets, normalisers = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        if not (want_hidden or want_weight):
            return None, None, None, None, None
        wide = normalisers.dtype
        with torch.autocast(hidden.device.type, enabled=False):
            low = weight.to(ctx.logits_dtype)
            # the input gradient's weight in float32 (no copy where it is stored so; converted once, not per chunk)
            wide_weight = weight.to(wide) if want_hidden else None
            grad_hidden = torch.empty(hidden.shape, dtype=wide, device=hidden.device) if want_hidden else None
            grad_weight = torch.zeros(weight.shape, dtype=wide, device=weight.device) if want_weight else None
            # each token's incoming gradient, nothing for ignored ones (their output is a constant 0)
            scales = grad_out.to(wide).masked_fill(targets.eq(IGNORED), 0.0).unsqueeze(1)
            for start in range(0, len(hidden), ctx.chunk):
                end = start + ctx.chunk
                rows, picked = hidden[start:end], targets[start:end].clamp(min=0).unsqueeze(1)
                logits = (rows.to(ctx.logits_dtype) @ low.t()).to(wide)
                grad = logits.sub_(normalisers[start:end].unsqueeze(1)).exp_()  # the softmax, in place
                grad.scatter_add_(1, picked, -torch.ones_like(picked, dtype=grad.dtype))  # minus the one-hot target
                grad.mul_(scales[start:end].neg())  # g * (onehot - softmax)
                if want_hidden:
                    torch.mm(grad, wide_weight, out=grad_hidden[start:end])
                if want_weight:
                    # addmm into itself, not addmm_: the same product, and one torch's FlopCounterMode counts
                    torch.addmm(grad_weight, grad.t(), rows.to(wide), out=grad_weight)
                del logits, grad  # before the next chunk's are made
        return (grad_hidden.to(hidden.dtype) if want_hidden else None,
                grad_weight.to(weight.dtype) if want_weight else None, None, None, None)


def head_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the head's logits compute in, as ``lowmem.model.chunked_loss.chunked_head_loss`` decides it:
    autocast's where it is on (else the weight's), or float32 where that dtype's products are slow on this device."""
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    if dtype != torch.float32:  # (float32 needs no probe: none runs inside a float32 forward)
        dtype = capability(device).compute_dtype(dtype)
    return dtype


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """Each token's log-probability of its target under the head ``weight`` (vocabulary x d_model) at ``hidden``
    (tokens x d_model), ``chunk`` tokens at a time: float32 [tokens], 0.0 (and no gradient) where the target is -100.

    Args:
        hidden: the head's input at the target tokens.
        weight: the head's weight (a plain linear layer's, no bias).
        targets: the target token ids (long [tokens]; -100: ignored).
        chunk: tokens whose logits are made at a time (``lowmem.model.chunked_loss.chunk_rows``).
        dtype: what the logits compute in; None: as the loss's chunked head (``head_dtype``).
    """
    if dtype is None:
        dtype = head_dtype(hidden, weight)
    return ChunkedTokenLogprobs.apply(hidden, weight, targets, chunk, dtype)


def logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each token's log-probability of its target from the whole logits ([tokens, vocabulary], any dtype): float32
    [tokens], 0.0 where the target is -100. For heads ``chunk_rows`` runs whole (8-bit, or with an adapter)."""
    picked = torch.log_softmax(logits.float(), dim=-1).gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1)
    return picked.masked_fill(targets.eq(IGNORED), 0.0)


def logprobs_at_head(core, index: torch.Tensor, targets: torch.Tensor, chunk: int):
    """While inside, the LM head returns the log-probabilities of ``targets`` (float32 [len(index)]) at the flat
    positions ``index`` of its input instead of logits, ``chunk`` target tokens at a time: the model's ``.logits``
    are then that vector. The log-probability counterpart of ``lowmem.model.loss.loss_at_head``."""
    head = core.lm_head

    def logprobs(hidden: torch.Tensor) -> torch.Tensor:
        return token_logprobs(hidden.flatten(0, -2).index_select(0, index), head.weight, targets, chunk)

    return forward_replaced(head, logprobs)
