"""Each target token's log-probability under the LM head a chunk at a time (lowmem.model.chunked_logprobs): the same
values and gradients as the whole logits' log-softmax, and nothing of the logits' size kept for the backward."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lowmem.hardware import probe
from lowmem.hardware.capability import Capability
from lowmem.model.chunked_logprobs import ChunkedTokenLogprobs, logprobs_at_head, logprobs_from_logits, token_logprobs

TOKENS, WIDTH, VOCABULARY = 10, 8, 50


def head_case(dtype=torch.float32, seed: int = 0):
    """Hidden states, a head weight (both needing gradients), targets with two ignored, and an upstream gradient."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(TOKENS, WIDTH, generator=generator, dtype=dtype).requires_grad_()
    weight = torch.randn(VOCABULARY, WIDTH, generator=generator, dtype=dtype).requires_grad_()
    targets = torch.randint(0, VOCABULARY, (TOKENS,), generator=generator)
    targets[[2, 7]] = -100
    coeff = torch.randn(TOKENS, generator=generator, dtype=torch.float64).float()  # not uniform: each token its own
    return hidden, weight, targets, coeff


def plain(hidden, weight, targets, dtype=torch.float32) -> torch.Tensor:
    """The whole logits made in ``dtype``, their float32 log-softmax at the targets."""
    return logprobs_from_logits(hidden.to(dtype) @ weight.to(dtype).t(), targets)


def values_and_grads(compute, hidden, weight, coeff) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hidden.grad = weight.grad = None
    out = compute()
    (out * coeff).sum().backward()
    return out.detach(), hidden.grad.clone(), weight.grad.clone()


@pytest.mark.parametrize("chunk", [1, 3, TOKENS, TOKENS + 5])
def test_values_and_gradients_equal_the_whole_logits(chunk):
    hidden, weight, targets, coeff = head_case()
    whole = values_and_grads(lambda: plain(hidden, weight, targets), hidden, weight, coeff)
    chunked = values_and_grads(lambda: token_logprobs(hidden, weight, targets, chunk), hidden, weight, coeff)
    assert chunked[0].dtype == torch.float32 and chunked[0].shape == (TOKENS,)
    for mine, theirs in zip(chunked, whole):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)
    ignored = targets.eq(-100)
    assert chunked[0][ignored].eq(0).all() and chunked[1][ignored].eq(0).all()  # no value, no gradient
    assert chunked[0][~ignored].lt(0).all()


def test_a_frozen_weight_gets_no_gradient_and_costs_no_product():
    hidden, weight, targets, coeff = head_case()
    weight.requires_grad_(False)
    out = plain(hidden, weight, targets)
    (out * coeff).sum().backward()
    expected, hidden.grad = hidden.grad, None
    with FlopCounterMode(display=False) as flops:
        (token_logprobs(hidden, weight, targets, 3) * coeff).sum().backward()
    torch.testing.assert_close(hidden.grad, expected, rtol=0, atol=1e-6)
    assert weight.grad is None
    # the logits twice (forward, recomputed in the backward) and the input's gradient: no weight-gradient product
    assert flops.get_total_flops() == 3 * 2 * TOKENS * VOCABULARY * WIDTH


def test_bf16_logits_equal_the_whole_bf16_logits():
    hidden, weight, targets, coeff = head_case()
    whole = values_and_grads(lambda: plain(hidden, weight, targets, torch.bfloat16), hidden, weight, coeff)
    chunked = values_and_grads(lambda: token_logprobs(hidden, weight, targets, 3, torch.bfloat16), hidden, weight,
                               coeff)
    exact = plain(hidden, weight, targets).detach()
    # Same bf16 logits, same float32 softmax statistics: the values agree to float32 rounding. The gradients less
    # closely: the plain path rounds the logits' gradient to bf16 before its bf16 products (8 bits of mantissa:
    # 2**-8 relative), the chunked one keeps it in float32 and multiplies by the float32 weight.
    torch.testing.assert_close(chunked[0], whole[0], rtol=0, atol=1e-5)
    assert (chunked[0] - exact).abs().max() > 1e-4  # and the bf16 logits did show (not computed in float32)
    for mine, theirs in zip(chunked[1:], whole[1:]):
        assert (mine - theirs).norm() <= 1e-2 * theirs.norm()


FAST_BF16 = Capability("cpu", "a CPU with AMX", {"float32": 1e11, "bfloat16": 4e11, "float16": 1e9}, "measured")
SLOW_BF16 = Capability("cpu", "a CPU with AVX2 only", {"float32": 1e11, "bfloat16": 1e9, "float16": 1e9}, "measured")


@pytest.mark.parametrize(("found", "expected"), [(FAST_BF16, torch.bfloat16), (SLOW_BF16, torch.float32)])
def test_autocast_picks_the_logits_dtype_as_the_chunked_loss_does(found, expected, monkeypatch):
    monkeypatch.setattr(probe, "_KNOWN", {"cpu": found})  # what the probe would find on such a CPU
    hidden, weight, targets, _ = head_case()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        picked = token_logprobs(hidden, weight, targets, 3)
    assert picked.dtype == torch.float32
    assert torch.equal(picked, token_logprobs(hidden, weight, targets, 3, expected))
    other = torch.float32 if expected == torch.bfloat16 else torch.bfloat16
    assert not torch.equal(picked, token_logprobs(hidden, weight, targets, 3, other))


def test_gradcheck_in_float64():
    hidden, weight, targets, _ = head_case(torch.float64)
    hidden, weight = hidden[:5].detach().requires_grad_(), weight[:7].detach().requires_grad_()
    targets = torch.tensor([3, -100, 0, 6, 2])
    assert torch.autograd.gradcheck(lambda h, w: token_logprobs(h, w, targets, 2, torch.float64), (hidden, weight))


def test_the_forward_keeps_nothing_of_the_logits_size_for_the_backward():
    tokens, vocabulary, width = 4096, 32_000, 64
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, width, generator=generator).requires_grad_()
    weight = (torch.randn(vocabulary, width, generator=generator) * 0.1).requires_grad_()
    targets = torch.randint(0, vocabulary, (tokens,), generator=generator)
    kept = []

    def pack(tensor):
        kept.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = token_logprobs(hidden, weight, targets, 256)
    # the input, the weight, the targets and one log-sum-exp a token: nothing [tokens x vocabulary]
    assert sorted(kept) == sorted([tokens * width, vocabulary * width, tokens, tokens])
    assert sum(t.numel() for t in out.grad_fn.saved_tensors) == sum(kept) < tokens * vocabulary // 50
    assert not [k for k, v in vars(out.grad_fn).items() if isinstance(v, torch.Tensor)]  # nor beside them
    assert isinstance(out.grad_fn, ChunkedTokenLogprobs._backward_cls)


def tiny_t5(tied: bool):
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(vocab_size=100, d_model=32, d_ff=64, num_layers=2, num_heads=2, d_kv=16,
                      tie_word_embeddings=tied, decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0)
    return T5ForConditionalGeneration(config)


@pytest.mark.parametrize("tied", [True, False])  # T5 v1.0's tied head (its input scaled), flan / mT5's own
def test_logprobs_at_head_equal_the_models_own_logits(tied):
    model = tiny_t5(tied)
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randint(1, 100, (2, 9), generator=generator)
    labels = torch.randint(1, 100, (2, 7), generator=generator)
    labels[1, 4:] = -100  # padding
    index = labels.flatten().ne(-100).nonzero().squeeze(1)
    targets = labels.flatten().index_select(0, index)
    coeff = torch.randn(len(index), generator=generator)
    run = dict(input_ids=inputs, attention_mask=torch.ones_like(inputs), decoder_input_ids=model._shift_right(labels))

    def weighted(compute):
        model.zero_grad(set_to_none=True)
        out = compute()
        (out * coeff).sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    def chunked():
        with logprobs_at_head(model, index, targets, 3):
            return model(**run).logits

    whole = weighted(lambda: logprobs_from_logits(model(**run).logits.flatten(0, 1)[index], targets))
    mine = weighted(chunked)
    assert "forward" not in model.lm_head.__dict__  # the head's own forward back
    assert mine[0].shape == (len(index),)
    torch.testing.assert_close(mine[0], whole[0], rtol=0, atol=1e-5)
    assert mine[1].keys() == whole[1].keys()
    for name, grad in whole[1].items():
        torch.testing.assert_close(mine[1][name], grad, rtol=0, atol=1e-5, msg=name)
