"""The loss a step trains on: a micro-batch placed on its device, the LM head run at the target tokens only,
the token losses summed (the trainer divides by the accumulation window's target tokens), and a frozen
encoder's outputs computed a row at a time without a graph."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from lowmem.model.chunked_loss import chunk_rows, chunked_head_loss
from lowmem.model.packed_attention import cross_attention_mask, decoder_inputs, segment_masks, segment_spans
from lowmem.utils.presets import AUTO


def target_index(labels: torch.Tensor, multiple: int = 1) -> torch.Tensor:
    """Flat positions of the target tokens (labels != -100). Found on the host, before the batch moves
    to the GPU, this costs no device synchronisation (``nonzero`` on a CUDA tensor waits for it).

    With ``multiple`` > 1 the count is rounded up to a multiple of it with padding positions (label
    -100: the loss ignores them), which the padded ``labels`` (a multiple of it in size) always hold.
    """
    is_target = labels.flatten().ne(-100)
    index = is_target.nonzero().squeeze(1)
    extra = -len(index) % multiple
    if extra:
        index = torch.cat([index, is_target.logical_not().nonzero().squeeze(1)[:extra]])
    return index


def batch_to_device(batch: dict, device, multiple: int = 1, pin: bool = False) -> dict:
    """The batch on ``device``, with its target positions found here on the host (``target_index``);
    ``pin``: through pinned memory, copied without blocking (CUDA)."""
    if "labels" in batch:
        batch = {**batch, "target_index": target_index(batch["labels"], multiple)}
    return {k: (v.pin_memory() if pin else v).to(device, non_blocking=pin) for k, v in batch.items()}


@contextlib.contextmanager
def logits_only_at(core, index: torch.Tensor):
    """While inside, the LM head computes logits only at the flat positions ``index`` of its input.

    The head (d_model x vocabulary per position) is the largest matrix product of a small T5, and
    padded target positions contribute nothing to the loss: skipping them saves their share of the
    forward and the backward, and of the logits' memory. The loss and gradients are unchanged up to
    float summation order. Returned logits are then (len(index), vocabulary).
    """
    handle = core.lm_head.register_forward_pre_hook(
        lambda _module, args: (args[0].flatten(0, -2).index_select(0, index), *args[1:]))
    try:
        yield
    finally:
        handle.remove()


def token_loss_sum(model, core, batch: dict, frozen_encoder: bool = False, multiple: int = 1,
                   loss_chunk: int | str = AUTO) -> torch.Tensor:
    """Sum of the cross-entropy over the batch's target tokens (labels == -100 are ignored).

    ``model`` is what to call (possibly wrapped for DDP), ``core`` the plain T5 inside it. With a
    frozen encoder it runs under ``no_grad`` so none of its activations are kept; a batch from the
    encoder cache carries ``encoder_hidden_states`` instead of ``input_ids``. Logits are computed
    only at target positions (``batch["target_index"]`` when the caller found them on the host),
    and in chunks of target tokens (``loss_chunk``: --loss_chunk_size; ``lowmem.model.chunked_loss``).
    ``batch["encoder_calls"]``, where the accumulation window set it (a sharded engine): how many times a frozen
    encoder must run (at least once per row; see ``frozen_encoder_states``).
    """
    labels = batch["labels"]
    index = batch["target_index"] if "target_index" in batch else target_index(labels, multiple)
    packed = "target_segments" in batch  # --packing: several examples to a row (lowmem.model.packed_attention)
    if packed:
        encoder_mask, decoder_mask, cross_mask = segment_masks(batch["source_segments"], batch["target_segments"])
        decoder = dict(attention_mask=encoder_mask, decoder_attention_mask=decoder_mask, use_cache=False,
                       decoder_input_ids=decoder_inputs(core, labels, batch["target_segments"]))
    else:
        decoder = dict(attention_mask=batch["attention_mask"], decoder_input_ids=core._shift_right(labels),
                       use_cache=False)
    encoded = encoder_states_given(model, core, batch, frozen_encoder, multiple,
                                   segment_spans(batch["source_segments"]) if packed else None)
    targets = labels.flatten().index_select(0, index)
    chunk = chunk_rows(core.lm_head, loss_chunk)
    with contextlib.ExitStack() as inside:
        inside.enter_context(loss_at_head(core, index, targets, chunk) if chunk is not None
                             else logits_only_at(core, index))
        if packed:
            inside.enter_context(cross_attention_mask(core, cross_mask))
        if encoded is None:
            out = model(input_ids=batch["input_ids"], **decoder)
        else:
            from transformers.modeling_outputs import BaseModelOutput

            out = model(encoder_outputs=BaseModelOutput(last_hidden_state=encoded), **decoder)
    if chunk is not None:  # the head gave the loss itself
        return out.logits.float()
    return F.cross_entropy(out.logits.float(), targets, reduction="sum")


def encoder_states_given(model, core, batch: dict, frozen_encoder: bool, multiple: int = 1,
                         spans: list[tuple[int, int, int]] | None = None) -> torch.Tensor | None:
    """The encoder's outputs when the model's forward is not to run it: the encoder cache's (in the batch), or a
    frozen encoder's, computed here without a graph (``spans``: packed rows' examples); None: the forward runs it."""
    if "encoder_hidden_states" in batch:  # from the encoder cache: the encoder does not run
        return batch["encoder_hidden_states"]
    if not frozen_encoder:
        return None
    if hasattr(model, "unshard"):  # FSDP: the shared embedding (the root's) whole, the encoder runs outside
        model.unshard()            # the root's forward; the forward after it reshards it as usual
    return frozen_encoder_states(core.encoder, batch["input_ids"], batch["attention_mask"], multiple,
                                 batch.get("encoder_calls", 0), spans)


@contextlib.contextmanager
def loss_at_head(core, index: torch.Tensor, targets: torch.Tensor, chunk: int):
    """While inside, the LM head returns the summed cross-entropy of ``targets`` at the flat positions ``index`` of
    its input instead of logits, ``chunk`` target tokens at a time (``lowmem.model.chunked_loss``)."""
    head = core.lm_head

    def loss(hidden: torch.Tensor) -> torch.Tensor:
        return chunked_head_loss(hidden.flatten(0, -2).index_select(0, index), head.weight, targets, chunk)

    with forward_replaced(head, loss):
        yield


@contextlib.contextmanager
def forward_replaced(module: torch.nn.Module, forward):
    """While inside, ``module`` runs ``forward`` instead of its own (its hooks still run around it)."""
    own = module.__dict__.get("forward")  # (a forward set on the instance before: put back after)
    module.forward = forward
    try:
        yield
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own


@torch.no_grad()
def frozen_encoder_states(encoder, input_ids: torch.Tensor, attention_mask: torch.Tensor, multiple: int = 1,
                          calls: int = 0, spans: list[tuple[int, int, int]] | None = None) -> torch.Tensor:
    """The frozen encoder's outputs, each row computed alone at its own length (zeros at padding); with ``spans``
    ((row, start, length): the examples of packed rows, ``lowmem.model.packed_attention.segment_spans``), each
    example alone, as unpacked.

    A row's result then never depends on the rows it is batched with. Batched, it would: padding
    to a longer row, and even the number of rows (the CPU matmul kernels differ for small shapes),
    change the floating-point reductions by ~1e-7, and training amplifies that. Computed alone, the
    encoder cache (built once per row) gives the decoder the very same bits as an uncached run.
    With micro-batches of 1-2 rows the extra encoder calls cost little (docs/memory.md, 'Memory modes').
    With ``multiple`` > 1 each row runs padded to a multiple of it (still alone: the result depends
    on the row only). ``calls`` beyond the rows (spans) run the encoder on one token, result unused: under a
    sharded engine every call is a collective, so every process must make as many.
    """
    from data.collate import round_up

    if spans is None:
        spans = [(row, 0, length) for row, length in enumerate(attention_mask.sum(dim=1).tolist())]
    pad = encoder.config.pad_token_id or 0
    hidden = None
    for row, start, length in spans:
        ids = input_ids.new_full((1, round_up(length, multiple)), pad)
        ids[0, :length] = input_ids[row, start:start + length]
        mask = ids.new_zeros(ids.shape)
        mask[0, :length] = 1
        states = encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        if hidden is None:
            hidden = states.new_zeros(input_ids.shape[0], input_ids.shape[1], states.shape[-1])
        hidden[row, start:start + length] = states[0, :length]
    for _ in range(calls - len(spans)):
        encoder(input_ids=input_ids[:1, :1], attention_mask=attention_mask[:1, :1])
    return hidden
