"""The LM head and the cross-entropy over the target tokens, a chunk of tokens at a time (``--loss_chunk_size``):
never the whole [tokens x vocabulary] logits, nor their gradient.

mT5 / umT5 have 250,112 output rows: 1,024 target tokens make 1.0 GB of float32 logits, and the unchunked loss
keeps their log-softmax and makes their gradient beside them (2.9 GB at the loss's backward, bench/loss_chunks.py).
Here each chunk's logits become its softmax and then its logits' gradient in place, and the head's input and weight
gradients are made in the forward, chunk by chunk (the weight's accumulated in one float32 buffer, the gradient the
weight gets anyway); the backward only scales them by the loss's incoming gradient. So the forward + backward hold
one chunk's logits beside the gradients, and cost the same three matrix products as the unchunked head.

Not torch's ``F.linear_cross_entropy`` (torch 2.13): on the CPU its chunked path keeps a weight-sized scratch buffer
besides the weight's gradient (1.06 GiB against 0.61 here on mT5's head, 1,024 tokens), and its automatic chunk size
ran 7x slower than the unchunked loss there (bench/loss_chunks.py).
"""

from __future__ import annotations

import torch

from lowmem.hardware.probe import capability
from lowmem.utils.presets import loss_chunk_rows

IGNORED = -100


def chunk_rows(head, loss_chunk: int | str) -> int | None:
    """Target tokens per chunk for ``head`` (None: logits + cross-entropy whole, as transformers computes them):
    ``loss_chunk_rows`` of its shape, for a plain linear layer (an 8-bit head, or one with an adapter, runs whole)."""
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return None  # (the declared shape: under ZeRO-3 the weight is a partition outside the forward)
    return loss_chunk_rows(head.out_features, head.in_features, loss_chunk)


class ChunkedHeadLoss(torch.autograd.Function):
    """sum over tokens of cross_entropy(hidden @ weight.T, targets), ``chunk`` tokens at a time (targets equal to
    -100 count nothing). The logits are computed in ``dtype`` (the autocast dtype, as autocast runs the head), the
    softmax and both gradients in float32."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int, dtype):
        with torch.autocast(hidden.device.type, enabled=False):
            low = weight.to(dtype)  # (itself in float32)
            grads = HeadGradients(hidden, weight, low, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            for start in range(0, len(hidden), chunk):
                rows, wanted = hidden[start:start + chunk], targets[start:start + chunk]
                logits = (rows.to(dtype) @ low.t()).float()
                counted = wanted.ne(IGNORED)
                picked = wanted.clamp(min=0).unsqueeze(1)
                target_logit = logits.gather(1, picked).squeeze(1)
                # log-sum-exp and softmax in the logits' own memory (torch.logsumexp would make a copy of them)
                top = logits.amax(dim=1, keepdim=True)
                sums = logits.sub_(top).exp_().sum(dim=1, keepdim=True)
                total += ((top + sums.log()).squeeze(1) - target_logit).mul_(counted).sum()
                if grads.wanted:
                    grads.add(logits, sums, picked, counted, rows, start)
                del logits  # before the next chunk's are made: one chunk's logits alive at a time
        ctx.hidden_dtype, ctx.weight_dtype = hidden.dtype, weight.dtype
        ctx.save_for_backward(grads.hidden, grads.weight)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden.mul_(grad_total).to(ctx.hidden_dtype)
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(grad_total).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None


class HeadGradients:
    """The input's and the weight's gradients of the summed loss (float32; None where not wanted), filled in chunk
    by chunk in the forward (``add``)."""

    def __init__(self, hidden, weight, low, want_hidden: bool, want_weight: bool):
        """``low``: the weight in the logits' dtype."""
        self.wanted = want_hidden or want_weight
        # the input gradient's weight in float32: the logits' own where they compute in float32 (converted once)
        self.wide = (low if low.dtype == torch.float32 else weight.float()) if want_hidden else None
        self.hidden = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) if want_hidden else None
        self.weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None

    def add(self, exp_logits, sums, picked, counted, rows, start: int) -> None:
        """One chunk's share (its tokens from ``start`` on: ``rows`` of the input), from its logits already
        exponentiated (``exp_logits``, turned into their gradient in place), their row ``sums``, the targets'
        columns (``picked``) and which tokens count (``counted``)."""
        grad = exp_logits.div_(sums)  # the softmax
        grad.scatter_add_(1, picked, -torch.ones_like(picked, dtype=grad.dtype))  # minus the one-hot target
        grad.mul_(counted.unsqueeze(1))  # ignored positions: no gradient
        if self.hidden is not None:
            torch.mm(grad, self.wide, out=self.hidden[start:start + len(grad)])
        if self.weight is not None:
            # addmm into itself, not addmm_: the same product, and one torch's FlopCounterMode counts (docs/mfu.md)
            torch.addmm(self.weight, grad.t(), rows.float(), out=self.weight)


def chunked_head_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
    """The summed cross-entropy of the head ``weight`` at ``hidden`` (tokens x d_model), ``chunk`` tokens at a time;
    the logits in autocast's dtype (else the weight's), or in float32 where that dtype's products are slow on this
    device (``lowmem.hardware.capability``: a bf16-stored head on a CPU without native bf16)."""
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    if dtype != torch.float32:  # (float32 needs no probe: none runs inside a float32 forward)
        dtype = capability(device).compute_dtype(dtype)
    return ChunkedHeadLoss.apply(hidden, weight, targets, chunk, dtype)
