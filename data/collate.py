"""Tokenization and dynamic padding: a whole accumulation window in one tokenizer call per side,
rows of similar length paired into micro-batches, each padded to its own longest row; a preference objective's
micro-batches hold each prompt once and its two answers (``PreferenceCollator``)."""

from __future__ import annotations

import re

import torch

from data.sources.corpus import Example
from data.streams.file_stream import batched

# sentencepiece pieces are at most 16 characters, so cutting the text after 16 characters per allowed
# token never changes the truncated result, and a megabyte-long row costs no more than a short one.
# Whitespace is not counted: a whitespace-splitting pre-tokenizer (ours) makes no token of it, so a
# row indented by thousands of spaces would otherwise be cut before its first word.
_CHARS_PER_TOKEN_BOUND = 16
_SPACES = re.compile(r"\s+")


def text_head(text: str, content_chars: int) -> str:
    """The shortest prefix of ``text`` holding ``content_chars`` non-whitespace characters (all of
    it when it has fewer). Reads only as far as that prefix, however long the text."""
    end = content = 0
    while content < content_chars and end < len(text):
        piece = text[end:end + content_chars - content]
        content += len(piece) - sum(len(run) for run in _SPACES.findall(piece))
        end += len(piece)
    return text[:end]


Padding = int | tuple[int, ...]  # what lengths are rounded up to: a multiple, or length buckets (round_up)


def round_up(length: int, multiple: Padding) -> int:
    """``length`` rounded up to a multiple of ``multiple``; given length buckets (a tuple, ``length_buckets``),
    to the smallest bucket that holds it (past the largest, to a multiple of the largest)."""
    if isinstance(multiple, tuple):
        return next((bucket for bucket in multiple if bucket >= length), round_up(length, multiple[-1]))
    return -(-length // multiple) * multiple


def length_buckets(longest: tuple[int, int], multiple: int = 1, smallest: int = 16) -> tuple[int, ...]:
    """The lengths ``--torch_compile=True`` pads training micro-batches to: powers of two from ``smallest``, and
    each side's longest (``longest``: --max_source_len, --max_target_len), all multiples of ``multiple``.

    A compiled graph is specialised to its lengths: with dynamic padding every new longest row would compile
    again. Rounded up to these, a side has at most log2(longest / 16) + 2 lengths (5 for 128 tokens), each
    compiled once; a bucket pads at most half its length, and most rows of short pairs fall in the small ones.
    """
    tops = {round_up(n, multiple) for n in longest}
    powers = {round_up(2 ** k, multiple) for k in range(smallest.bit_length() - 1, max(tops).bit_length())}
    return tuple(sorted(tops | {n for n in powers if n < max(tops)}))


def train_padding(cfg, multiple: int) -> Padding:
    """What training micro-batches' lengths are rounded up to: ``multiple`` (the precision's ``shape_multiple``,
    ``lowmem.hardware.precision``), or with
    --torch_compile=True the ``length_buckets``."""
    return length_buckets((cfg.max_source_len, cfg.max_target_len), multiple) if cfg.torch_compile else multiple


def pad(rows: list[list[int]], value: int, multiple: Padding = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, longest], attention mask [B, longest]) with ``value`` at the padding positions;
    ``longest`` rounded up to a multiple of ``multiple``."""
    longest = round_up(max(len(r) for r in rows), multiple)  # (or to the length bucket that holds it)
    ids = torch.full((len(rows), longest), value, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, :len(r)] = 1
    return ids, mask


def micro_batches(sources: list[int], targets: list[int], batch_size: int, max_tokens: int = 0,
                  multiple: Padding = 1) -> list[list[int]]:
    """Row positions of one accumulation window grouped into micro-batches of similar length (stable:
    ties keep stream order): ``batch_size`` rows each, or with ``max_tokens`` as many rows as keep
    the padded tokens (rows x (longest source + longest target), rounded as the collator pads) within
    it (a longer row alone).

    Within one accumulation window the gradient is a sum over its rows, so how they are split into
    micro-batches does not change it; pairing similar lengths only removes padding (with micro-batch
    2 and rows of mixed length, a third or more of the padded tokens). Sorting never crosses a
    window, so the stream position at each optimizer step, and with it resume, is unchanged.
    """
    order = sorted(range(len(sources)), key=lambda i: sources[i] + targets[i])
    if not max_tokens:
        return list(batched(order, batch_size))
    groups, group, longest = [], [], (0, 0)
    for i in order:
        grown = (max(longest[0], sources[i]), max(longest[1], targets[i]))
        padded = (len(group) + 1) * (round_up(grown[0], multiple) + round_up(grown[1], multiple))
        if group and padded > max_tokens:
            groups.append(group)
            group, grown = [], (sources[i], targets[i])
        group.append(i)
        longest = grown
    return groups + [group] if group else groups


# Forwards that are bound by compute (the CPU's) cost their padded tokens plus about this many for the
# call itself and the slower small matrix products (see length_groups); a group holds at most
# GROUP_ROWS rows, which keeps the search linear in the rows and every matrix product large.
CALL_TOKENS = 64
GROUP_ROWS = 256


def length_groups(lengths: list[int], max_tokens: int, multiple: int = 1) -> list[list[int]]:
    """Row positions in groups of similar length for forwards without a gradient (evaluation), each cut
    to its own longest row: runs of the rows sorted by length, chosen to minimise the padded tokens of
    all groups plus CALL_TOKENS per group, each within ``max_tokens`` padded tokens (a longer row alone).

    Exact, by dynamic programming over the sorted lengths. Unlike ``micro_batches`` (one grouping for
    both sides of a training row), each side can be grouped by its own length here: the encoder by the
    sources, the decoder by the targets.
    """
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    padded = [round_up(lengths[i], multiple) for i in order]
    cost, cut = [0] + [None] * len(order), [0] * (len(order) + 1)  # best cost of the first k rows, its last cut
    for end in range(1, len(order) + 1):
        for begin in range(end - 1, max(end - 1 - GROUP_ROWS, -1), -1):
            rows = end - begin
            if rows > 1 and rows * padded[end - 1] > max_tokens:
                break
            total = cost[begin] + CALL_TOKENS + rows * padded[end - 1]
            if cost[end] is None or total < cost[end]:
                cost[end], cut[end] = total, begin
    groups, end = [], len(order)
    while end:
        groups.append(order[cut[end]:end])
        end = cut[end]
    return groups[::-1]


def by_source_length(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Evaluation batches: row positions in batches of similar source length (stable), so padding
    and the batch's generation, which runs until its last row ends, are spent on similar rows."""
    return list(batched(sorted(range(len(lengths)), key=lengths.__getitem__), batch_size))


class Seq2SeqCollator:
    """Turn examples into ``input_ids``, ``attention_mask`` and ``labels`` tensors.

    Each side is padded to the longest row of its micro-batch (not to a fixed length), rounded up to
    a multiple of ``pad_multiple`` (the precision's ``shape_multiple``), or to a length bucket (``train_padding``);
    label padding is -100 so it never counts in the loss.
    """

    def __init__(self, tokenizer, max_source_len: int, max_target_len: int,
                 pad_multiple: Padding = 1):
        self.tokenizer = tokenizer
        self.max_source_len = max_source_len
        self.max_target_len = max_target_len
        self.pad_multiple = pad_multiple

    def token_ids(self, texts: list, max_len: int) -> list[list[int]]:
        """One batched tokenizer call (the Rust tokenizer spreads a batch over threads).

        Rows of a prepared corpus are token ids already: they are only cut to ``max_len``, the way the
        tokenizer truncates (the last kept position holds the end-of-sequence token).
        """
        if texts and isinstance(texts[0], list):
            eos = self.tokenizer.eos_token_id
            return [ids if len(ids) <= max_len else ids[:max_len - 1] + [eos] for ids in texts]
        cut = max_len * _CHARS_PER_TOKEN_BOUND
        return self.tokenizer([text_head(t, cut) for t in texts], max_length=max_len, truncation=True)["input_ids"]

    def encode(self, texts: list[str], max_len: int) -> dict:
        ids, mask = pad(self.token_ids(texts, max_len), self.tokenizer.pad_token_id, self.pad_multiple)
        return {"input_ids": ids, "attention_mask": mask}

    def targets(self, examples: list[Example]) -> list[list[int]]:
        return self.token_ids([e.response for e in examples], self.max_target_len)

    def labels(self, targets: list[list[int]]) -> torch.Tensor:
        return pad(targets, -100, self.pad_multiple)[0]

    def __call__(self, examples: list[Example]) -> dict[str, torch.Tensor]:
        """One micro-batch, rows in the given order."""
        return self.window(examples, len(examples), group=False)[0]

    def grouped(self, sources: list[int], targets: list[int], batch_size: int, max_tokens: int,
                group: bool) -> list[list[int]]:
        if not group:
            return [list(range(len(sources)))]
        return micro_batches(sources, targets, batch_size, max_tokens, self.pad_multiple)

    def answer_sides(self, examples: list[Example]):
        """(each example's target length, as micro-batches are grouped by it; ``side(rows)``: the target side of a
        micro-batch of those examples' positions, its ``labels``). A preference objective's collator gives its
        two answers instead (``data.objectives.preference``)."""
        targets = self.targets(examples)
        return [len(t) for t in targets], lambda rows: {"labels": self.labels([targets[i] for i in rows])}

    def window(self, examples: list[Example], batch_size: int, max_tokens: int = 0, group: bool = True) -> list[dict]:
        """The micro-batches of one accumulation window (rows of similar length together; see
        ``micro_batches``)."""
        sources = self.token_ids([e.prompt for e in examples], self.max_source_len)
        lengths, side = self.answer_sides(examples)
        out = []
        for rows in self.grouped([len(s) for s in sources], lengths, batch_size, max_tokens, group):
            ids, mask = pad([sources[i] for i in rows], self.tokenizer.pad_token_id, self.pad_multiple)
            out.append({"input_ids": ids, "attention_mask": mask, **side(rows)})
        return out

    def empty(self) -> dict[str, torch.Tensor]:
        """A micro-batch with no target tokens (one source token): its backward adds zero gradient."""
        return {"input_ids": torch.tensor([[self.tokenizer.eos_token_id]]), "attention_mask": torch.tensor([[1]]),
                "labels": torch.tensor([[-100]])}


class CachedEncoderCollator:
    """Training batches for SFT with ``--encoder_cache``: the targets are tokenized as usual, the
    source side is the cached encoder output (no source tokenization, no encoder forward)."""

    def __init__(self, collator: Seq2SeqCollator, cache):
        self.collator = collator
        self.cache = cache

    def __call__(self, examples: list[Example]) -> dict[str, torch.Tensor]:
        return self.window(examples, len(examples), group=False)[0]

    def window(self, examples: list[Example], batch_size: int, max_tokens: int = 0, group: bool = True) -> list[dict]:
        """Like ``Seq2SeqCollator.window``, grouped by the same lengths (the cached source length is
        the tokenized one), so cached and uncached runs form identical micro-batches."""
        lengths, side = self.collator.answer_sides(examples)
        sources = [self.cache.entry(e.file_index, e.row)[1] for e in examples]
        out = []
        for rows in self.collator.grouped(sources, lengths, batch_size, max_tokens, group):
            hidden, mask = self.cache.hidden_states([examples[i] for i in rows], self.collator.pad_multiple)
            out.append({"encoder_hidden_states": hidden, "attention_mask": mask, **side(rows)})
        return out

    def empty(self) -> dict[str, torch.Tensor]:
        """A micro-batch with no target tokens (one zero encoder state): its backward adds zero gradient."""
        batch = self.collator.empty()
        del batch["input_ids"]
        return {**batch, "encoder_hidden_states": torch.zeros(1, 1, self.cache.d_model)}


class PreferenceCollator(Seq2SeqCollator):
    """Micro-batches of preference pairs: each prompt once (``input_ids``, ``attention_mask`` [B, S]) and its two
    answers as ``labels`` [2B, T] (chosen rows first), grouped by the longer answer. With a reference cache
    (``reference``: reads each pair's cached log-probabilities, ``lowmem.training.reference``) a batch carries them
    as ``reference`` [B, 2]."""

    reference = None  # set when the reference's log-probabilities come from the pre-pass's cache

    def answers(self, examples: list[Example]) -> tuple[list[list[int]], list[list[int]]]:
        """(chosen, rejected) token ids of ``examples``, in one tokenizer call."""
        ids = self.token_ids([e.response for e in examples] + [e.rejected for e in examples], self.max_target_len)
        return ids[:len(examples)], ids[len(examples):]

    def answer_sides(self, examples: list[Example]):
        """(each pair's decoder length for grouping: its longer answer twice, as two decoder rows hold it; ``side``:
        a micro-batch's labels, chosen rows first, and the cached reference's log-probabilities)."""
        chosen, rejected = self.answers(examples)

        def side(rows: list[int]) -> dict:
            out = {"labels": self.labels([chosen[i] for i in rows] + [rejected[i] for i in rows])}
            if self.reference is not None:
                out["reference"] = self.reference.pair_logprobs([examples[i] for i in rows])
            return out

        return [2 * max(len(c), len(r)) for c, r in zip(chosen, rejected)], side

    def empty(self) -> dict[str, torch.Tensor]:
        """A pair with no target tokens: its backward adds zero gradient."""
        batch = {"input_ids": torch.tensor([[self.tokenizer.eos_token_id]]), "attention_mask": torch.tensor([[1]]),
                 "labels": torch.tensor([[-100], [-100]])}
        if self.reference is not None:
            batch["reference"] = torch.zeros(1, 2)
        return batch
