"""T5's span-corruption pretraining objective, as numpy maths on one chunk of token ids.

This follows ``t5/data/preprocessors.py`` of google-research/text-to-text-transfer-transformer
(``span_corruption`` = ``random_spans_helper`` + ``split_tokens`` + ``denoise`` with
``random_spans_noise_mask``, ``noise_span_to_unique_sentinel`` for the inputs and
``nonnoise_span_to_unique_sentinel`` for the targets), written again without TensorFlow:

- ``corrupted_lengths(inputs_length)`` -> ``(tokens_length, targets_length)``: cut the token stream into
  chunks of ``tokens_length`` raw tokens; each full chunk then corrupts to exactly ``inputs_length``
  input ids and exactly ``targets_length`` target ids, EOS included on both sides (512 -> (568, 114);
  at ``noise_density=0.5`` both are upper bounds, see the function).
- ``noise_mask(length, rng)``: which tokens of a chunk are dropped (noise), in spans.
- ``corrupt(tokens, mask, sentinels, eos)`` -> ``(inputs, targets)``; ``restore`` undoes it.
- ``sentinel_ids(tokenizer, count)``: the ids of ``<extra_id_0>`` ... ``<extra_id_{count-1}>`` (ByT5: the top
  byte ids, counting down).
- ``example_rng(seed, epoch, position)``: the generator of one chunk's mask, so a resumed run draws
  the same masks as an uninterrupted one.

Example (a chunk of 20 tokens, sentinels s0, s1, ...)::

    mask    . . . . X X X . . . . . . . . . X X X .      (X = noise)
    inputs  t0 t1 t2 t3 s0 t7 ... t15 s1 t19 EOS
    targets s0 t4 t5 t6 s1 t16 t17 t18 EOS
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lowmem.utils.errors import UserError

NOISE_DENSITY = 0.15  # fraction of a chunk's tokens dropped from the inputs (T5's default)
MEAN_NOISE_SPAN_LENGTH = 3.0  # mean length of a dropped span (T5's default)


def span_counts(length: int, noise_density: float = NOISE_DENSITY,
                mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH) -> tuple[int, int]:
    """How many noise tokens and noise spans a chunk of ``length`` tokens gets (fixed, not random).

    T5's ``random_spans_noise_mask``: ``round(length * noise_density)`` noise tokens, kept in
    ``[1, length - 1]``, in ``round(num_noise_tokens / mean_noise_span_length)`` spans, at least one
    (``round`` is round-half-to-even in both ``tf.round`` and Python). A chunk shorter than 2 tokens
    counts as 2, as in T5, so the counts are those of a 2-token chunk.

    Args:
        length: tokens in the chunk.
        noise_density: fraction of tokens to drop.
        mean_noise_span_length: mean tokens per dropped span.

    Returns:
        ``(num_noise_tokens, num_noise_spans)``.
    """
    length = max(length, 2)
    num_noise_tokens = min(max(int(round(length * noise_density)), 1), length - 1)
    num_noise_spans = max(int(round(num_noise_tokens / mean_noise_span_length)), 1)
    return num_noise_tokens, num_noise_spans


def _corrupted_sizes(tokens_length: int, noise_density: float, mean_noise_span_length: float) -> tuple[int, int]:
    """Input and target lengths (EOS included) that a chunk of ``tokens_length`` tokens corrupts to."""
    num_noise_tokens, num_noise_spans = span_counts(tokens_length, noise_density, mean_noise_span_length)
    # inputs: every non-noise token, one sentinel per noise span, EOS;
    # targets: every noise token, one sentinel per noise span, EOS.
    return (tokens_length - num_noise_tokens + num_noise_spans + 1,
            num_noise_tokens + num_noise_spans + 1)


def corrupted_lengths(inputs_length: int, noise_density: float = NOISE_DENSITY,
                      mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH) -> tuple[int, int]:
    """T5's ``random_spans_helper`` with one sentinel per span on each side.

    Returns the raw chunk length to cut the token stream into and the targets length it gives.
    Like T5, it starts from ``inputs_length - 1`` raw tokens and grows the chunk while one more token
    still corrupts to at most ``inputs_length`` inputs. Lengths count EOS on both sides: the inputs are
    ``non-noise tokens + one sentinel per noise span + EOS`` and the targets ``noise tokens + one
    sentinel per noise span + EOS``. So (but for the 0.5 case below) a full chunk corrupts to exactly
    ``inputs_length`` inputs and exactly ``targets_length`` targets, EOS included: the model's source
    and target maxima must be these two numbers, with the EOS inside them, not added on top.

    One difference from T5's helper: the counts are those the mask really uses (``span_counts``: at
    least one noise token and one span), where T5's helper does not clip, so that short chunks corrupt
    to the length promised. At the default settings this changes nothing for ``inputs_length >= 10``
    (tests compare with a transcription of T5's loop).

    T5's special case is kept: with ``noise_density == 0.5``, when the targets would be longer than the
    inputs, the chunk is one token shorter and ``targets_length`` one less (so both sides get the same,
    presumably round, length). Both lengths are then upper bounds: real inputs and targets can be one
    shorter.

    Args:
        inputs_length: wanted length of the corrupted inputs, EOS included (at least 3).
        noise_density: fraction of tokens to drop.
        mean_noise_span_length: mean tokens per dropped span (at least 1).

    Returns:
        ``(tokens_length, targets_length)``, e.g. 512 -> (568, 114) and 128 -> (141, 29).

    Raises:
        ValueError: when ``inputs_length < 3`` or the noise settings are out of range.
    """
    if inputs_length < 3:
        raise ValueError(f"inputs_length must be at least 3 (a token, a sentinel and EOS), got {inputs_length}")
    if not 0.0 < noise_density < 1.0 or mean_noise_span_length < 1.0:
        raise ValueError(f"need 0 < noise_density < 1 and mean_noise_span_length >= 1, got {noise_density} and "
                         f"{mean_noise_span_length}")
    tokens_length = inputs_length - 1
    while _corrupted_sizes(tokens_length + 1, noise_density, mean_noise_span_length)[0] <= inputs_length:
        tokens_length += 1
    inputs_length, targets_length = _corrupted_sizes(tokens_length, noise_density, mean_noise_span_length)
    if noise_density == 0.5 and targets_length > inputs_length:
        tokens_length, targets_length = tokens_length - 1, targets_length - 1
    return tokens_length, targets_length


def _random_segmentation(num_items: int, num_segments: int, rng: np.random.Generator) -> np.ndarray:
    """Split ``num_items`` items into ``num_segments`` non-empty runs, every split equally likely.

    As T5's ``_random_segmentation``: shuffle ``num_segments - 1`` segment starts among the
    ``num_items - 1`` gaps between items; the item after each chosen gap opens a new segment.
    """
    if not 1 <= num_segments <= num_items:
        raise ValueError(f"cannot split {num_items} items into {num_segments} non-empty segments")
    starts = np.zeros(num_items - 1, dtype=np.int64)
    starts[:num_segments - 1] = 1
    rng.shuffle(starts)
    segment_id = np.cumsum(np.concatenate([[0], starts]))
    return np.bincount(segment_id, minlength=num_segments)


def noise_mask(length: int, rng: np.random.Generator, noise_density: float = NOISE_DENSITY,
               mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH) -> np.ndarray:
    """T5's ``random_spans_noise_mask`` (without ``random_roll``): which tokens of a chunk are noise.

    The numbers of noise tokens and spans are fixed by ``span_counts``; the noise tokens and the
    non-noise tokens are each split into that many non-empty spans (``_random_segmentation``, noise
    first, then non-noise, from ``rng``), and the spans alternate non-noise, noise, non-noise, ...
    So the mask starts with a non-noise token and ends with a noise token, and every such mask with
    these counts is equally likely. A chunk of one token is never noise (T5 masks it as if it were
    two tokens long and keeps the first).

    Args:
        length: tokens in the chunk.
        rng: the chunk's generator (``example_rng``).
        noise_density: fraction of tokens to drop.
        mean_noise_span_length: mean tokens per dropped span.

    Returns:
        a bool array of shape ``(length,)``, True where a token is noise.

    Raises:
        ValueError: when the settings ask for more noise spans than there are non-noise tokens.
    """
    if length <= 0 or noise_density == 0.0:
        return np.zeros(max(length, 0), dtype=bool)
    padded = max(length, 2)
    num_noise_tokens, num_noise_spans = span_counts(padded, noise_density, mean_noise_span_length)
    noise_lengths = _random_segmentation(num_noise_tokens, num_noise_spans, rng)
    nonnoise_lengths = _random_segmentation(padded - num_noise_tokens, num_noise_spans, rng)
    interleaved = np.stack([nonnoise_lengths, noise_lengths], axis=1).reshape(-1)
    is_noise = np.tile([False, True], num_noise_spans)
    return np.repeat(is_noise, interleaved)[:length]


def corrupt(tokens: Sequence[int] | np.ndarray, mask: np.ndarray, sentinel_ids: Sequence[int],
            eos_id: int) -> tuple[list[int], list[int]]:
    """Span-corrupt one chunk: the encoder's inputs and the decoder's targets.

    inputs = the non-noise tokens, each noise span replaced by the next sentinel, then EOS;
    targets = each noise span preceded by its sentinel, in order, then EOS. Sentinels are used in
    the order given (``<extra_id_0>`` first), as T5 does with its sentinels counted down from the top
    of the vocabulary. For a mask from ``noise_mask`` (starts with non-noise, ends with noise) this is
    exactly T5's ``noise_span_to_unique_sentinel`` / ``nonnoise_span_to_unique_sentinel`` pair.

    Args:
        tokens: the chunk's token ids (no EOS).
        mask: bool array as long as ``tokens``, True where a token is noise.
        sentinel_ids: sentinel ids, at least one per noise span.
        eos_id: the EOS id appended to both sides.

    Returns:
        ``(inputs, targets)`` as lists of ints.

    Raises:
        ValueError: when the mask's length differs from the chunk's or there are too few sentinels.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    mask = np.asarray(mask, dtype=bool)
    if tokens.shape != mask.shape or tokens.ndim != 1:
        raise ValueError(f"tokens {tokens.shape} and mask {mask.shape} must be 1-d and the same length")
    span_start = mask & ~np.concatenate([[False], mask[:-1]])
    num_spans = int(span_start.sum())
    if num_spans > len(sentinel_ids):
        raise ValueError(f"{num_spans} noise spans but only {len(sentinel_ids)} sentinels")
    sentinels = np.asarray(sentinel_ids[:num_spans], dtype=np.int64)

    marked = tokens.copy()
    marked[span_start] = sentinels  # the first token of each span becomes its sentinel ...
    inputs = marked[~mask | span_start]  # ... and the rest of the span is dropped
    noise_index = np.cumsum(mask) - 1  # where each noise token lands among the noise tokens
    targets = np.insert(tokens[mask], noise_index[span_start], sentinels)
    return inputs.tolist() + [eos_id], targets.tolist() + [eos_id]


def restore(inputs: Sequence[int], targets: Sequence[int], sentinel_ids: Sequence[int], eos_id: int) -> list[int]:
    """Rebuild the chunk ``corrupt`` was given from its ``(inputs, targets)``.

    Exact when the chunk itself holds no sentinel id (T5's pipeline has the same blind spot).

    Raises:
        ValueError: when either side does not end with EOS, or a sentinel in the inputs has no span in
            the targets.
    """
    if not inputs or inputs[-1] != eos_id or not targets or targets[-1] != eos_id:
        raise ValueError("inputs and targets must each end with the EOS id")
    sentinels = set(sentinel_ids)
    spans: dict[int, list[int]] = {}
    current: list[int] | None = None
    for token in targets[:-1]:
        if token in sentinels:
            current = spans.setdefault(token, [])
        elif current is None:
            raise ValueError("targets must start with a sentinel")
        else:
            current.append(token)
    restored: list[int] = []
    for token in inputs[:-1]:
        if token in sentinels:
            if token not in spans:
                raise ValueError(f"sentinel {token} in the inputs has no span in the targets")
            restored.extend(spans[token])
        else:
            restored.append(token)
    return restored


# ByT5 was pretrained with the vocabulary's last ids as sentinels, counting down (seqio's span corruption):
# byte 0xFF's id for the first span, 0xFE's for the second (transformers' ByT5 docs: "mask tokens count down
# from index 258"), not the <extra_id_N> its tokenizer appends above them (259 up), which that pretraining never
# used. Bytes 0xF5-0xFF never occur in UTF-8 text: 11 sentinels that no text byte shares.
BYT5_SENTINELS = 11


def is_byt5(tokenizer) -> bool:
    return type(tokenizer).__name__ == "ByT5Tokenizer"


def sentinel_ids(tokenizer, count: int) -> list[int]:
    """The ids of ``<extra_id_0>`` ... ``<extra_id_{count-1}>``, in that order (ByT5: the top byte ids,
    counting down, as it was pretrained).

    Raises:
        UserError: when the tokenizer lacks any of them (unknown, unk id or repeated ids).
    """
    if is_byt5(tokenizer) and count <= BYT5_SENTINELS:
        return [getattr(tokenizer, "offset", 3) + 255 - i for i in range(count)]
    names = [f"<extra_id_{i}>" for i in range(count)]
    ids = tokenizer.convert_tokens_to_ids(names)
    unk = tokenizer.unk_token_id
    missing = [name for name, i in zip(names, ids) if i is None or i == unk]
    if missing or len(set(ids)) != len(ids):
        first = missing[0] if missing else "some sentinel ids repeat"
        raise UserError(
            f"the tokenizer has no T5 sentinels <extra_id_0>..<extra_id_{count - 1}> (first problem: {first}), "
            "which span corruption needs: use a tokenizer trained by 'train_low_mem.py train_tokenizer', "
            "or the model's own T5 tokenizer")
    return list(ids)


def sentinels_in(tokenizer, count: int) -> int:
    """How many of ``<extra_id_0>`` ... ``<extra_id_{count-1}>`` the tokenizer has, counted from the first."""
    if is_byt5(tokenizer):
        return min(count, BYT5_SENTINELS)
    ids = tokenizer.convert_tokens_to_ids([f"<extra_id_{i}>" for i in range(count)])
    seen = set()
    for n, i in enumerate(ids):
        if i is None or i == tokenizer.unk_token_id or i in seen:
            return n
        seen.add(i)
    return count


def longest_source_for(sentinels: int, noise_density: float, mean_noise_span_length: float) -> int:
    """The longest ``--max_source_len`` whose chunks need at most ``sentinels`` noise spans."""
    length = 2
    while span_counts(corrupted_lengths(length + 1, noise_density, mean_noise_span_length)[0], noise_density,
                      mean_noise_span_length)[1] <= sentinels:
        length += 1
    return length


def example_rng(seed: int, epoch: int, position: int) -> np.random.Generator:
    """The generator of the chunk at ``position`` (chunks from the stream's start) in ``epoch``.

    Seeded from these three numbers only (all >= 0), so a chunk gets the same mask in every run and
    after a resume, whatever was drawn before it.
    """
    return np.random.default_rng([seed, epoch, position])
