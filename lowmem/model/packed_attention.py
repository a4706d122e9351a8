"""T5 over packed rows (``data.packing``): the segment ids of a row turned into the three attention masks and the
decoder inputs that give each example of the row exactly what it has alone.

transformers' T5 takes a ready 4D mask as it is (``masking_utils``: "already prepared, returned as-is") and adds it
to the attention scores, with the eager and the SDPA attention alike; its relative position bias depends only on key
- query offsets, which are the same within a segment wherever the segment starts. So with

- the encoder attending within its segment,
- the decoder attending causally within its segment,
- cross-attention from a target segment to its own source segment only,
- each target segment's decoder input starting from the decoder start token,

a masked score adds ``finfo.min`` and its softmax weight is exactly 0: every example's loss and gradient are those of
the example alone, up to float summation order (tests/test_packing.py). Padding (segment 0) attends to padding, and
padded decoder positions to every source token, so that no row of a softmax is all masked (no NaN to leak into
gradients); nothing real attends to padding, and padding has no target.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


def segment_masks(source_segments: torch.Tensor, target_segments: torch.Tensor,
                  dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Additive masks [rows, 1, queries, keys] (0: attend, ``finfo.min``: not) for the encoder's self-attention, the
    decoder's self-attention and the decoder's cross-attention."""
    def additive(allowed: torch.Tensor) -> torch.Tensor:
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
            allowed.logical_not(), torch.finfo(dtype).min).unsqueeze(1)

    source, target = source_segments, target_segments
    length = target.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=target.device).tril()
    encoder = additive(source[:, :, None] == source[:, None, :])
    decoder = additive((target[:, :, None] == target[:, None, :]) & causal)
    cross = additive((target[:, :, None] == source[:, None, :]) | (target[:, :, None] == 0))
    return encoder, decoder, cross


def decoder_inputs(core, labels: torch.Tensor, target_segments: torch.Tensor) -> torch.Tensor:
    """The decoder's inputs: the labels shifted right within each segment, each segment starting from the decoder
    start token (T5's ``_shift_right`` of a row holding one example, segment by segment)."""
    shifted = core._shift_right(labels)
    before = F.pad(target_segments, (1, 0))[:, :-1]
    starts = target_segments.ne(0) & target_segments.ne(before)
    return shifted.masked_fill(starts, core.config.decoder_start_token_id)


@contextlib.contextmanager
def cross_attention_mask(core, mask: torch.Tensor):
    """While inside, T5's decoder takes ``mask`` for its cross-attention. (``T5ForConditionalGeneration`` hands the
    decoder the encoder's own mask; a packed row's differs: queries are target tokens.)"""
    def replace(_module, args, kwargs):
        return args, {**kwargs, "encoder_attention_mask": mask}

    handle = core.decoder.register_forward_pre_hook(replace, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def segment_spans(source_segments: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row, start, length) of each source segment, in order (a frozen encoder runs each alone)."""
    spans = []
    for row, segments in enumerate(source_segments.tolist()):
        start = 0
        for at in range(1, len(segments) + 1):
            if at == len(segments) or segments[at] != segments[start]:
                if segments[start]:
                    spans.append((row, start, at - start))
                start = at
    return spans
