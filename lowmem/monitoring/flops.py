"""Model FLOPs of one training micro-batch of a T5 (forward + backward), counted from the model's shapes and from
which of its weights train, for the model FLOPs utilisation (docs/mfu.md).

Only matrix products count, 2 FLOPs per multiply-add, as ``torch.utils.flop_counter.FlopCounterMode`` counts them:
the linear layers (LoRA adapters included), the two products of each attention (scores Q K^T and probabilities x V)
and the LM head at the target tokens the trainer computes logits for (``lowmem.model.loss``). Embedding lookups,
layer norms, softmax, activations and the relative position bias are not products and count nothing.

A product's backward costs its input's gradient when that input carries gradient (anything upstream of it trains)
and its weight's gradient when the weight trains; which tensors carry gradient is read off the model's parameters
(``requires_grad``, peft's LoRA layers) by walking T5's structure once (``StepFlops.of``). The count is then a
polynomial in the batch's shapes (``TERMS``) whose coefficients are computed once: a micro-batch costs a dot product.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

# The monomials of a micro-batch's shapes, with B rows, S source and T target positions (as padded):
TERMS = (
    "encoder_tokens",  # B*S, or run by a frozen encoder (one row, or packed example, at a time, each at its own
    "encoder_pairs",   # length L rounded up to the multiple) the sum of L; its attention: B*S*S, or the sum of L*L
    "memory_tokens",   # B*S: the cross-attention's keys and values over the encoder's output
    "decoder_tokens",  # B*T: the decoder's linear layers
    "decoder_pairs",   # B*T*T: its self-attention
    "cross_pairs",     # B*T*S: its cross-attention
    "head_tokens",     # target tokens (rounded up to the multiple, as ``target_index`` pads them): the LM head
)


@dataclass(frozen=True)
class Coefficients:
    """FLOPs per unit of each of TERMS: model FLOPs, and the forward gradient checkpointing runs again."""

    model: tuple[int, ...]
    recompute: tuple[int, ...]


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of a training micro-batch of one T5: ``micro_batch`` (model FLOPs) and ``recomputed`` (the forward
    that gradient checkpointing runs again in the backward, which model FLOPs leave out).

    ``batched``: the encoder runs on the whole batch with autograd on; ``apart``: it runs under ``no_grad`` a row at
    a time (a frozen encoder) or not at all (the encoder cache), and its output carries no gradient.
    """

    batched: Coefficients
    apart: Coefficients

    @classmethod
    def of(cls, core, gradient_checkpointing: bool = False) -> StepFlops:
        """The coefficients of ``core`` (the plain ``T5ForConditionalGeneration`` after freezing, LoRA and
        quantization; on any device, the meta device included): shapes from each weight's ``.shape``.
        ``gradient_checkpointing``: the run checkpoints its blocks (``activation_checkpointing_enable``)."""
        checkpointed = checkpointed_blocks(core, gradient_checkpointing)
        # with checkpointing transformers makes the embeddings' outputs require grad (enable_input_require_grads)
        inputs_carry = gradient_checkpointing or bool(getattr(core, "_require_grads_hooks", None))
        return cls(coefficients(core, checkpointed, inputs_carry, True),
                   coefficients(core, checkpointed, inputs_carry, False))

    def micro_batch(self, batch: dict, frozen_encoder: bool, multiple: int = 1) -> int:
        """Model FLOPs of one collated micro-batch as ``lowmem.model.loss.token_loss_sum`` runs it (``multiple``:
        what the trainer rounds frozen encoder rows and target counts up to, the precision's ``shape_multiple``)."""
        return dot(self.chosen(batch, frozen_encoder).model, self.terms(batch, frozen_encoder, multiple))

    def recomputed(self, batch: dict, frozen_encoder: bool, multiple: int = 1) -> int:
        """FLOPs gradient checkpointing spends recomputing the forward of ``batch`` (not model FLOPs)."""
        return dot(self.chosen(batch, frozen_encoder).recompute, self.terms(batch, frozen_encoder, multiple))

    def chosen(self, batch: dict, frozen_encoder: bool) -> Coefficients:
        """The coefficients for how ``batch``'s encoder runs."""
        return self.apart if frozen_encoder or "encoder_hidden_states" in batch else self.batched

    @staticmethod
    def terms(batch: dict, frozen_encoder: bool, multiple: int = 1) -> tuple[int, ...]:
        """The values of TERMS for ``batch``: from its shapes, plus its target count and, with a frozen encoder, its
        rows' lengths (read on the host before ``batch_to_device``, they cost no device synchronisation).

        The extra one-token encoder calls a sharded engine makes to keep processes in step (``encoder_calls``) do
        no model work and count nothing."""
        labels = batch["labels"]
        rows, target_len = labels.shape
        cached = "encoder_hidden_states" in batch  # the encoder cache: the encoder does not run
        source_len = (batch["encoder_hidden_states"] if cached else batch["input_ids"]).shape[1]
        if "target_index" in batch:
            head = len(batch["target_index"])
        else:
            head = round_up(int(labels.ne(-100).sum()), multiple)
        if cached:
            encoder = (0, 0)
        elif frozen_encoder:
            lengths = [round_up(n, multiple) for n in encoder_run_lengths(batch).tolist()]
            encoder = (sum(lengths), sum(n * n for n in lengths))
        else:
            encoder = (rows * source_len, rows * source_len * source_len)
        return (*encoder, rows * source_len, rows * target_len, rows * target_len * target_len,
                rows * target_len * source_len, head)


def coefficients(core, checkpointed: set[int], inputs_carry: bool, encoder_grad: bool) -> Coefficients:
    """Walk the encoder (with autograd on or off), the decoder and the LM head."""
    total = Walk(checkpointed)
    encoder = Walk(checkpointed, grad_enabled=encoder_grad)
    memory = encoder.stack(core.encoder, "encoder", inputs_carry)
    total.add(encoder)
    decoded = total.stack(core.decoder, "decoder", inputs_carry, memory=memory)
    total.linear(core.lm_head, "head_tokens", decoded)
    return Coefficients(tuple(total.forward[t] + total.backward[t] for t in TERMS),
                        tuple(total.recompute[t] for t in TERMS))


def dot(coefficients: tuple[int, ...], terms: tuple[int, ...]) -> int:
    return sum(c * t for c, t in zip(coefficients, terms))


def round_up(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def encoder_run_lengths(batch: dict) -> torch.Tensor:
    """The lengths a frozen encoder runs at, one call each (``lowmem.model.loss.frozen_encoder_states``): each
    row's tokens, or with packing each source segment's (a run of one nonzero segment id)."""
    if "source_segments" not in batch:
        return batch["attention_mask"].sum(dim=1)
    segments = batch["source_segments"]
    span = int(segments.max()) + 1
    # a key per (row, segment), so that a run never joins the end of a row to the start of the next
    keys = segments + torch.arange(len(segments), device=segments.device)[:, None] * span
    runs, counts = torch.unique_consecutive(keys.flatten(), return_counts=True)
    return counts[(runs % span).ne(0)]  # (segment 0: padding)


def checkpointed_blocks(core, gradient_checkpointing: bool) -> set[int]:
    """ids of the blocks whose forward is recomputed: those transformers flagged (``every_n_layers``), or every
    block when checkpointing is asked for a model it was not enabled on yet (a model on the meta device)."""
    if not gradient_checkpointing:
        return set()
    blocks = [*core.encoder.block, *core.decoder.block]
    flagged = {id(b) for b in blocks if getattr(b, "gradient_checkpointing", False)}
    return flagged or {id(b) for b in blocks}


class Walk:
    """FLOPs per unit of each term, forward and backward, accumulated over T5's structure.

    ``carry`` flags say whether a tensor carries gradient (requires grad); ``grad_enabled=False`` walks a stack run
    under ``no_grad``: forward only, nothing carries gradient.
    """

    def __init__(self, checkpointed: set[int], grad_enabled: bool = True):
        self.checkpointed, self.grad_enabled = checkpointed, grad_enabled
        self.forward, self.backward, self.recompute = Counter(), Counter(), Counter()
        self.last = 0  # forward FLOPs per token of the last product walked

    def trains(self, param) -> bool:
        return self.grad_enabled and param.requires_grad

    def linear(self, module, term: str, carry: bool) -> bool:
        """y = x W^T (+ LoRA's B A x) per token of ``term``; returns whether y carries gradient."""
        base = getattr(module, "base_layer", module)  # a peft LoRA layer wraps the original
        d_out, d_in = shape(base.weight)
        product = 2 * d_in * d_out
        self.forward[term] += product
        self.backward[term] += product * (carry + self.trains(base.weight))
        out = carry or self.trains(base.weight)
        self.last = product
        for name in lora_adapters(module):
            a, b = module.lora_A[name].weight, module.lora_B[name].weight
            rank = shape(a)[0]
            self.forward[term] += 2 * rank * (d_in + d_out)
            middle = carry or self.trains(a)  # A x
            self.backward[term] += 2 * d_in * rank * (carry + self.trains(a))
            self.backward[term] += 2 * rank * d_out * (middle + self.trains(b))
            out = out or middle or self.trains(b)
            self.last = 2 * rank * d_out  # B (A x) runs last
        return out

    def attention(self, attention, pairs: str, query: bool, key: bool, value: bool, bias: bool) -> bool:
        """Scores Q K^T and probabilities x V, all heads, per (query, key) pair of ``pairs``; ``bias``: the
        position bias added to the scores carries gradient. Returns whether the output carries gradient."""
        inner = attention.n_heads * attention.key_value_proj_dim
        probabilities = query or key or bias
        self.forward[pairs] += 2 * 2 * inner
        self.backward[pairs] += 2 * inner * (query + key + probabilities + value)
        return probabilities or value

    def add(self, other: Walk) -> None:
        self.forward.update(other.forward)
        self.backward.update(other.backward)
        self.recompute.update(other.recompute)

    def stack(self, stack, name: str, inputs_carry: bool, memory: bool | None = None) -> bool:
        """The blocks of ``stack`` (``name``: encoder or decoder), from its embedding to its final norm;
        ``memory``: whether the encoder output carries gradient (decoder). Returns whether its output does."""
        carry = self.trains(stack.embed_tokens.weight) or (inputs_carry and self.grad_enabled)
        first = stack.block[0].layer[0].SelfAttention  # holds the position bias every layer shares (umT5: each
        # layer holds its own, all frozen or trained alike)
        self_bias = self.trains(first.relative_attention_bias.weight)
        # cross-attention has no relative bias: its zero bias requires grad under checkpointing (transformers' T5)
        cross_bias = self.grad_enabled and bool(self.checkpointed)
        tokens, pairs = f"{name}_tokens", f"{name}_pairs"
        for block in stack.block:
            part = Walk(self.checkpointed, self.grad_enabled)
            carry = part.block(block, tokens, pairs, carry, self_bias, None if memory is None else (memory, cross_bias))
            self.add(part)
            if id(block) in self.checkpointed and carry:  # (a block with no graph saves nothing to recompute)
                self.recompute.update(part.forward)
                if not block.layer[-1].dropout.p:
                    # torch's non-reentrant checkpoint stops recomputing once the last tensor the block saved is
                    # saved again: the inputs of its last product, saved before that product runs. Dropout after
                    # it (T5's 0.1) saves its mask after it, and then the whole forward runs again.
                    self.recompute[tokens] -= part.last
        return carry or self.trains(stack.final_layer_norm.weight)

    def block(self, block, tokens: str, pairs: str, carry: bool, self_bias: bool, cross) -> bool:
        """One T5 block (self-attention, cross-attention when ``cross`` = (memory carries, bias carries), feed
        forward), each sublayer added to the residual stream. Returns whether the stream carries gradient after."""
        layer = block.layer[0]
        normed = carry or self.trains(layer.layer_norm.weight)
        # (each sublayer walked before the ``or``: a short circuit would skip counting it)
        attended = self.attention_layer(layer.SelfAttention, (tokens, tokens, pairs), normed, normed, self_bias)
        carry = carry or attended
        if cross is not None:
            layer = block.layer[1]
            normed = carry or self.trains(layer.layer_norm.weight)
            attended = self.attention_layer(layer.EncDecAttention, (tokens, "memory_tokens", "cross_pairs"), normed,
                                            cross[0], cross[1])
            carry = carry or attended
        layer = block.layer[-1]
        normed = carry or self.trains(layer.layer_norm.weight)
        dense = layer.DenseReluDense
        inner = [self.linear(getattr(dense, n), tokens, normed) for n in ("wi", "wi_0", "wi_1") if hasattr(dense, n)]
        fed = self.linear(dense.wo, tokens, any(inner))
        return carry or fed

    def attention_layer(self, attention, terms: tuple[str, str, str], query_in: bool, key_in: bool,
                        bias: bool) -> bool:
        """Projections, attention and output projection of one T5Attention; ``terms``: (queries, keys, pairs), the
        terms of the tokens its queries and its keys and values are computed from, and of their pairs; ``query_in``
        / ``key_in``: whether those tokens carry gradient; ``bias``: whether its position bias does."""
        queries, keys, pairs = terms
        query = self.linear(attention.q, queries, query_in)
        key = self.linear(attention.k, keys, key_in)
        value = self.linear(attention.v, keys, key_in)
        return self.linear(attention.o, queries, self.attention(attention, pairs, query, key, value, bias))


def shape(weight) -> torch.Size:
    """A weight's whole shape: an 8-bit quanto weight has its float shape; a weight DeepSpeed ZeRO-3 partitioned
    holds an empty placeholder and its shape in ``ds_shape``."""
    return getattr(weight, "ds_shape", weight.shape)


def lora_adapters(module) -> list[str]:
    """The LoRA adapters a peft layer adds in its forward (none when merged or disabled)."""
    if not hasattr(module, "lora_A") or getattr(module, "merged", False) or getattr(module, "disable_adapters", False):
        return []
    return [name for name in module.active_adapters if name in module.lora_A]
