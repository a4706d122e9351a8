"""T5's span corruption (data/objectives/span_noise.py): lengths, masks, sentinels and their order, checked
against transcriptions of T5's own definitions and against an independent drawing of the same masks."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from config import SHIPPED_TOKENIZER_DIR
from data.objectives.span_noise import (
    corrupt,
    corrupted_lengths,
    example_rng,
    noise_mask,
    restore,
    sentinel_ids,
    span_counts,
)
from lowmem.utils.errors import UserError

SENTINELS = list(range(9000, 9100))  # stand-ins for <extra_id_0>.. <extra_id_99>
EOS = 1


def t5_random_spans_helper(inputs_length: int, noise_density: float = 0.15, mean_noise_span_length: float = 3.0):
    """T5's random_spans_helper (extra tokens per span 1 on each side), transcribed step by step."""
    def lengths(tokens_length):
        num_noise_tokens = int(round(tokens_length * noise_density))
        num_noise_spans = int(round(num_noise_tokens / mean_noise_span_length))
        return (tokens_length - num_noise_tokens + num_noise_spans + 1, num_noise_tokens + num_noise_spans + 1)

    tokens_length = inputs_length - 1
    while lengths(tokens_length + 1)[0] <= inputs_length:
        tokens_length += 1
    inputs_length, targets_length = lengths(tokens_length)
    if noise_density == 0.5 and targets_length > inputs_length:
        tokens_length -= 1
        targets_length -= 1
    return tokens_length, targets_length


def t5_unique_sentinel(tokens: np.ndarray, mask: np.ndarray) -> list[int]:
    """T5's noise_span_to_unique_sentinel, transcribed: the first token of each run of True becomes the
    next sentinel, the rest of the run is dropped (sentinel k = SENTINELS[k], as vocab.size - 1 - k)."""
    prev_is_noise = np.concatenate([[False], mask[:-1]])
    first = mask & ~prev_is_noise
    subsequent = mask & prev_is_noise
    sentinel = np.asarray(SENTINELS)[np.maximum(np.cumsum(first) - 1, 0)]
    return np.where(first, sentinel, tokens)[~subsequent].tolist()


def reference_mask(length: int, rng: np.random.Generator, noise_density=0.15, mean_noise_span_length=3.0):
    """From the paper's description, drawn another way: pick how many tokens and spans to corrupt, cut
    the noise and the kept tokens each into that many non-empty spans at distinct random cut points
    (a uniform composition), and lay them out kept, noise, kept, noise, ..."""
    num_noise = min(max(round(length * noise_density), 1), length - 1)
    num_spans = max(round(num_noise / mean_noise_span_length), 1)

    def composition(total, parts):
        cuts = np.sort(rng.choice(np.arange(1, total), size=parts - 1, replace=False))
        return np.diff(np.concatenate([[0], cuts, [total]]))

    noise, kept = composition(num_noise, num_spans), composition(length - num_noise, num_spans)
    mask = []
    for k, n in zip(kept, noise):
        mask += [False] * int(k) + [True] * int(n)
    return np.array(mask)


def spans_of(mask: np.ndarray) -> list[int]:
    """Lengths of the runs of True, in order."""
    runs, current = [], 0
    for noisy in mask:
        if noisy:
            current += 1
        elif current:
            runs.append(current)
            current = 0
    return runs + ([current] if current else [])


def test_known_lengths_match_t5():
    assert corrupted_lengths(512) == (568, 114)
    assert corrupted_lengths(128) == (141, 29)
    assert t5_random_spans_helper(512) == (568, 114)
    assert t5_random_spans_helper(128) == (141, 29)


@pytest.mark.parametrize("density, span", [(0.15, 3.0), (0.5, 3.0), (0.3, 2.0), (0.15, 1.0)])
def test_lengths_equal_t5s_helper(density, span):
    for inputs_length in range(10, 1200):
        assert corrupted_lengths(inputs_length, density, span) == t5_random_spans_helper(inputs_length, density, span)


def test_short_inputs_corrupt_to_the_promised_length_where_t5s_helper_would_not():
    # T5's helper counts zero spans for one noise token, the mask at least one: below 10 they differ.
    assert t5_random_spans_helper(5) != corrupted_lengths(5)
    for inputs_length in range(3, 16):
        tokens_length, targets_length = corrupted_lengths(inputs_length)
        mask = noise_mask(tokens_length, np.random.default_rng(inputs_length))
        inputs, targets = corrupt(np.arange(10, 10 + tokens_length), mask, SENTINELS, EOS)
        assert (len(inputs), len(targets)) == (inputs_length, targets_length)
    with pytest.raises(ValueError):
        corrupted_lengths(2)


def test_a_full_chunk_corrupts_to_exactly_both_lengths_and_a_shorter_one_to_at_most():
    for inputs_length in range(16, 601):
        tokens_length, targets_length = corrupted_lengths(inputs_length)
        tokens = np.arange(10, 10 + tokens_length)
        for seed in range(5):
            inputs, targets = corrupt(tokens, noise_mask(tokens_length, example_rng(seed, 0, inputs_length)),
                                      SENTINELS, EOS)
            # T5's targets length is exact too: the noise count and the span count are fixed per length.
            assert (len(inputs), len(targets)) == (inputs_length, targets_length)
        # the stream's last chunk may be short: it must still fit
        short = tokens_length - 1 - inputs_length % 7
        inputs, targets = corrupt(tokens[:short], noise_mask(short, example_rng(0, 0, inputs_length)), SENTINELS, EOS)
        assert len(inputs) <= inputs_length and len(targets) <= targets_length


def test_density_one_half_keeps_t5s_special_case_and_stays_within_both_lengths():
    one_short = 0
    for inputs_length in range(10, 300):
        tokens_length, targets_length = corrupted_lengths(inputs_length, noise_density=0.5)
        assert targets_length <= inputs_length
        mask = noise_mask(tokens_length, np.random.default_rng(inputs_length), noise_density=0.5)
        inputs, targets = corrupt(np.arange(10, 10 + tokens_length), mask, SENTINELS, EOS)
        assert len(inputs) <= inputs_length and len(targets) <= targets_length
        one_short += len(inputs) < inputs_length
    assert one_short > 0  # the special case took a token off somewhere


def test_mask_has_the_fixed_counts_starts_kept_and_ends_noise():
    for length in range(2, 700, 3):
        num_noise, num_spans = span_counts(length)
        for seed in range(3):
            mask = noise_mask(length, example_rng(seed, 1, length))
            assert mask.dtype == bool and mask.shape == (length,)
            assert int(mask.sum()) == num_noise
            assert len(spans_of(mask)) == num_spans
            assert not mask[0] and mask[-1]
    assert noise_mask(1, np.random.default_rng(0)).tolist() == [False]
    assert noise_mask(0, np.random.default_rng(0)).shape == (0,)
    assert span_counts(568) == (85, 28)


def test_mask_statistics_over_200_chunks():
    masks = [noise_mask(568, example_rng(0, 0, position)) for position in range(200)]
    spans = [n for mask in masks for n in spans_of(mask)]
    assert abs(np.mean([m.mean() for m in masks]) - 0.15) <= 0.01
    assert abs(np.mean(spans) - 3.0) <= 0.3
    # 85 noise tokens in 28 spans, all splits equally likely: P(a span has length 1) = 27 / 84
    assert abs(np.mean(np.array(spans) == 1) - 27 / 84) < 0.03
    assert len({m.tobytes() for m in masks}) == 200


def test_every_mask_with_the_counts_is_equally_likely():
    # 40 tokens: 6 noise tokens in 2 spans (5 ways) among 34 kept tokens in 2 spans (33 ways) -> 165 masks
    rng = np.random.default_rng(7)
    draws = 165 * 40
    counts = Counter(noise_mask(40, rng).tobytes() for _ in range(draws))
    assert len(counts) == 165
    expected = draws / 165
    chi2 = sum((c - expected) ** 2 / expected for c in counts.values())
    assert chi2 < 240  # 164 degrees of freedom: mean 164, sd 18


def test_mask_agrees_with_an_independent_reference():
    ours = [noise_mask(568, example_rng(3, 0, p)) for p in range(200)]
    theirs = [reference_mask(568, np.random.default_rng([3, p])) for p in range(200)]
    for masks in (ours, theirs):
        spans = [n for m in masks for n in spans_of(m)]
        assert abs(np.mean([m.mean() for m in masks]) - 0.15) <= 0.01
        assert abs(np.mean(spans) - 3.0) <= 0.3
    ours_spans = np.array([n for m in ours for n in spans_of(m)])
    theirs_spans = np.array([n for m in theirs for n in spans_of(m)])
    for n in (1, 2, 3, 4):
        assert abs(np.mean(ours_spans == n) - np.mean(theirs_spans == n)) < 0.04
    # where the noise falls: mean position of a noise token, and of the first span
    ours_pos = np.mean([np.flatnonzero(m).mean() for m in ours])
    theirs_pos = np.mean([np.flatnonzero(m).mean() for m in theirs])
    assert abs(ours_pos - theirs_pos) < 10
    first_ours = np.mean([np.flatnonzero(m)[0] for m in ours])
    first_theirs = np.mean([np.flatnonzero(m)[0] for m in theirs])
    assert abs(first_ours - first_theirs) < 6  # about 483 / 28 = 17 either way


def test_corrupt_on_a_worked_example():
    tokens = list(range(100, 120))
    mask = np.zeros(20, dtype=bool)
    mask[[4, 5, 6, 16, 17, 18]] = True
    inputs, targets = corrupt(tokens, mask, SENTINELS, EOS)
    assert inputs == [100, 101, 102, 103, 9000, *range(107, 116), 9001, 119, EOS]
    assert targets == [9000, 104, 105, 106, 9001, 116, 117, 118, EOS]
    assert restore(inputs, targets, SENTINELS, EOS) == tokens


def test_corrupt_equals_t5s_two_functions_and_restore_undoes_it():
    rng = np.random.default_rng(11)
    for position in range(200):
        length = int(rng.integers(2, 700))
        tokens = rng.integers(2, 8000, size=length)
        mask = noise_mask(length, example_rng(5, 2, position))
        inputs, targets = corrupt(tokens, mask, SENTINELS, EOS)
        assert inputs == t5_unique_sentinel(tokens, mask) + [EOS]  # noise_span_to_unique_sentinel
        assert targets == t5_unique_sentinel(tokens, ~mask) + [EOS]  # nonnoise_span_to_unique_sentinel
        assert restore(inputs, targets, SENTINELS, EOS) == tokens.tolist()
        num_spans = len(spans_of(mask))
        assert [t for t in inputs if t in SENTINELS] == SENTINELS[:num_spans]
        assert [t for t in targets if t in SENTINELS] == SENTINELS[:num_spans]
        assert targets[0] == SENTINELS[0]


def test_corrupt_and_restore_refuse_what_they_cannot_do():
    mask = np.array([False, True, False, True, False, True])
    with pytest.raises(ValueError, match="sentinels"):
        corrupt(list(range(6)), mask, SENTINELS[:2], EOS)
    with pytest.raises(ValueError):
        corrupt(list(range(5)), mask, SENTINELS, EOS)
    with pytest.raises(ValueError):
        restore([5, 9000], [9000, 6, EOS], SENTINELS, EOS)
    with pytest.raises(ValueError):
        restore([5, 9001, EOS], [9000, 6, EOS], SENTINELS, EOS)


def test_example_rng_depends_on_seed_epoch_and_position_only():
    def mask(seed, epoch, position):
        return noise_mask(568, example_rng(seed, epoch, position))

    first = mask(0, 0, 42)
    np.random.default_rng(0).random(1000)  # other draws in between change nothing
    assert np.array_equal(first, mask(0, 0, 42))
    assert len({mask(0, 0, p).tobytes() for p in range(50)}) == 50
    assert not np.array_equal(first, mask(0, 1, 42))
    assert not np.array_equal(first, mask(1, 0, 42))


def test_sentinel_ids_of_the_shipped_tokenizer():
    from data.tokenization import load_tokenizer

    tokenizer = load_tokenizer(SHIPPED_TOKENIZER_DIR)
    ids = sentinel_ids(tokenizer, 100)
    assert len(set(ids)) == 100 and tokenizer.unk_token_id not in ids
    assert tokenizer.convert_ids_to_tokens([ids[0], ids[99]]) == ["<extra_id_0>", "<extra_id_99>"]
    with pytest.raises(UserError, match="extra_id"):
        sentinel_ids(tokenizer, 101)  # there is no <extra_id_100>


def test_a_tokenizer_without_sentinels_is_a_user_error():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    model = Tokenizer(WordLevel({"[UNK]": 0, "</s>": 1, "a": 2, "b": 3}, unk_token="[UNK]"))
    model.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, unk_token="[UNK]", eos_token="</s>")
    with pytest.raises(UserError, match="no T5 sentinels") as err:
        sentinel_ids(tokenizer, 100)
    message = str(err.value)
    assert "\n" not in message and "train_tokenizer" in message

    class SameIdForAll:  # a tokenizer that answers one id for every sentinel
        unk_token_id = 0

        def convert_tokens_to_ids(self, tokens):
            return [5 for _ in tokens]

    with pytest.raises(UserError, match="repeat"):
        sentinel_ids(SameIdForAll(), 3)


def test_answer_text_keeps_sentinels_and_drops_padding_and_eos(tokenizer):
    from lowmem.training.evaluation import answer_text

    s0, s1 = sentinel_ids(tokenizer, 2)
    cat, park = (tokenizer("cute dog", add_special_tokens=False)["input_ids"],
                 tokenizer("the", add_special_tokens=False)["input_ids"])
    ids = [tokenizer.pad_token_id, s0, *cat, s1, *park, tokenizer.eos_token_id, tokenizer.pad_token_id]
    text = answer_text(tokenizer, ids)
    assert text.startswith("<extra_id_0>") and text.index("<extra_id_0>") < text.index("<extra_id_1>")
    assert "cute dog" in text and text.rstrip().endswith("the")
    assert "</s>" not in text and "<pad>" not in text


def test_settings_no_chunk_can_follow_are_refused_with_what_to_change():
    from config import TrainConfig
    from data.objectives.base import objective_for
    from data.tokenization import load_tokenizer

    def objective(**flags):
        return objective_for(TrainConfig(objective="span_corruption", **flags))

    # More spans than kept tokens to put between them (a traceback in the mask before)
    with pytest.raises(UserError, match="more than the 51 tokens kept to separate them"):
        objective(noise_density=0.6, mean_noise_span_length=1, max_target_len=512)
    objective(noise_density=0.5, mean_noise_span_length=1, max_target_len=512)  # one kept token between spans
    for too_short in (1, 2):  # no room for a kept token, a sentinel and EOS (a ValueError traceback before)
        with pytest.raises(UserError, match=f"needs --max_source_len of at least 3 .*got {too_short}"):
            objective(max_source_len=too_short, max_target_len=8)
    # More spans than the tokenizer has sentinels: the longest source that fits is named, and fits
    tokenizer = load_tokenizer(SHIPPED_TOKENIZER_DIR)
    with pytest.raises(UserError, match="gets 114 noise spans.* has 100 .* set --max_source_len=1809 or less"):
        objective(max_source_len=2048, max_target_len=512).transform(tokenizer)
    objective(max_source_len=1809, max_target_len=512).transform(tokenizer)
    with pytest.raises(UserError, match="set --max_source_len=1809"):
        objective(max_source_len=1810, max_target_len=512).transform(tokenizer)


def test_byt5_sentinels_are_the_top_byte_ids_counting_down():
    """ByT5 was pretrained with byte 0xFF's id (258) for the first span, then 257... (transformers' ByT5 docs);
    its tokenizer's <extra_id_N> (259 up) were never trained: continued pretraining used them."""
    from transformers import ByT5Tokenizer

    from data.objectives.base import objective_for
    from data.objectives.span_noise import BYT5_SENTINELS, sentinel_ids, sentinels_in
    from lowmem.cli.flags import load_config

    tokenizer = ByT5Tokenizer()
    assert sentinel_ids(tokenizer, 3) == [258, 257, 256]
    assert sentinels_in(tokenizer, 100) == BYT5_SENTINELS == 11  # bytes 0xF5-0xFF: never in UTF-8 text
    assert not set(sentinel_ids(tokenizer, 11)) & set(tokenizer("dΩ€𝄞 \xf4\U0010ffff")["input_ids"])
    cfg, _ = load_config({"objective": "span_corruption", "max_source_len": 512})
    with pytest.raises(UserError, match="tokenizer has 11 .*ByT5 .* --mean_noise_span_length=20"):
        objective_for(cfg).transform(tokenizer)
