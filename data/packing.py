"""``--packing=True``: the examples of an accumulation window placed several to a row, as T5's own pipelines pack
(seqio ``pack=True``), so that short pairs no longer train mostly padding.

A packed row holds whole examples one after another on each side (at most ``--max_source_len`` source and
``--max_target_len`` target tokens; an example is never split), with segment ids numbering them 1, 2, ... on
both sides (0: padding). The model sees each example alone: ``lowmem.model.packed_attention`` turns the segment
ids into block-diagonal masks (the encoder attends within a segment, the decoder causally within its segment,
cross-attention to its own segment's source) and starts each segment's decoder input from the decoder start
token. T5's relative position bias depends only on key - query offsets, so every example gets exactly the loss
it has alone (tests/test_packing.py).

Packing never crosses a window: a packed run trains the same examples at each step as an unpacked one (the same
gradient, up to float summation order), and resume is unchanged.
"""

from __future__ import annotations

import torch

from data.collate import Padding, Seq2SeqCollator, micro_batches, round_up


def packed_rows(sizes: list[tuple[int, int]], capacity: tuple[int, int]) -> list[list[int]]:
    """Example positions grouped into as few rows as ``best_fit`` finds, the examples spread over them so that their
    lengths are even (``balanced``, then ``evened``): rows of a micro-batch are padded to the longest, so even rows
    pad little."""
    rows = best_fit(sizes, capacity)
    return evened(sizes, balanced(sizes, capacity, len(rows)) or rows, capacity)


def row_sizes(sizes: list[tuple[int, int]], rows: list[list[int]]) -> list[tuple[int, int]]:
    """(source, target) tokens of each packed row: its examples' ``sizes`` added."""
    return [(sum(sizes[i][0] for i in row), sum(sizes[i][1] for i in row)) for row in rows]


def balanced(sizes: list[tuple[int, int]], capacity: tuple[int, int], count: int) -> list[list[int]] | None:
    """Example positions spread over ``count`` rows, longest first, each into the row with room for it where the
    rows' longest (each side as a share of its capacity, added) grows least, among those the row holding least so
    far; None when one finds no room."""
    order = sorted(range(len(sizes)), key=lambda i: -(sizes[i][0] + sizes[i][1]))
    rows: list[list[int]] = [[] for _ in range(count)]
    held = [(0, 0)] * count
    for i in order:
        size = sizes[i]
        fits = [r for r in range(count) if all(held[r][k] + size[k] <= capacity[k] for k in (0, 1))]
        if not fits:
            return None
        longest = [max(h[k] for h in held) for k in (0, 1)]
        r = min(fits, key=lambda r: (sum(max(longest[k], held[r][k] + size[k]) / capacity[k] for k in (0, 1)),  # noqa: B023
                                     sum(held[r][k] / capacity[k] for k in (0, 1))))
        rows[r].append(i)
        held[r] = (held[r][0] + size[0], held[r][1] + size[1])
    return [sorted(row) for row in rows]


# Windows packed into more rows than this are left as ``balanced`` spreads them: their micro-batches are many, each
# padded to its own longest row (rows sorted by length), and pricing every change would cost seconds a window.
EVENED_ROWS = 64


def evened(sizes: list[tuple[int, int]], rows: list[list[int]], capacity: tuple[int, int],
           rounds: int = 64) -> list[list[int]]:
    """``rows`` changed one move of an example to another row, or one swap of two examples, at a time, each the
    change that lowers most the widest source + the widest target of the rows (what a micro-batch of them pads
    to), then the sum of the rows' squared lengths (evener rows); at most ``rounds`` changes, none past
    ``capacity``; windows of up to ``EVENED_ROWS`` rows.

    ``balanced`` spreads the examples by their two sides' shares added, so one side can come out uneven (short
    pairs of long targets: rows' sources 14-71 tokens); exchanging examples of like targets evens it. All
    candidate changes (of an example of a widest row) are priced at once (numpy): a round costs about (examples
    of the widest rows x (rows + examples)).
    """
    import numpy as np

    if not 2 <= len(rows) <= EVENED_ROWS:
        return rows
    size = np.array(sizes, dtype=np.int64).reshape(-1, 2)
    where = np.empty(len(sizes), dtype=np.int64)
    for r, row in enumerate(rows):
        where[row] = r
    room = np.array(capacity, dtype=np.int64)
    for _ in range(rounds):
        change = best_change(size, where, len(rows), room)
        if change is None:
            break
        i, j, row = change
        if j is None:
            where[i] = row
        else:
            where[i], where[j] = where[j], where[i]
    out = [[] for _ in rows]
    for i, r in enumerate(where.tolist()):
        out[r].append(i)
    return [row for row in out if row]


def best_change(size, where, count: int, room):
    """``evened``'s next change: (example, None, its new row) for a move, (example, example, None) for a swap, or
    None when no change lowers the rows' (widest source + widest target, sum of squares)."""
    import numpy as np

    loads = np.zeros((count, 2), dtype=np.int64)
    np.add.at(loads, where, size)
    price = ChangePrice(loads)
    widest = np.flatnonzero((loads == loads.max(0)).any(1))  # only a change to these can lower the widths
    mine = np.flatnonzero(np.isin(where, widest))  # their examples: the i of every move and swap
    own, a = size[mine][:, None, :], where[mine][:, None]
    q = np.arange(count)[None, :]  # moves: example i to row q
    moved_to = loads[None, :, :] + own
    moves = price(a, q, loads[a[:, 0]][:, None, :] - own, moved_to)
    moves = np.where((a != q) & (moved_to <= room).all(-1), moves, np.iinfo(np.int64).max)
    b = where[None, :]  # swaps: example i with example j
    swap_a, swap_b = loads[a[:, 0]][:, None, :] - own + size[None, :, :], loads[where][None, :, :] - size + own
    swaps = price(a, b, swap_a, swap_b)
    swaps = np.where((a != b) & (swap_a <= room).all(-1) & (swap_b <= room).all(-1), swaps, np.iinfo(np.int64).max)
    move, swap = (np.unravel_index(found.argmin(), found.shape) for found in (moves, swaps))
    if min(moves[move], swaps[swap]) >= price.now:
        return None
    if moves[move] <= swaps[swap]:
        return int(mine[move[0]]), None, int(move[1])
    return int(mine[swap[0]]), int(swap[1]), None


class ChangePrice:
    """The rows' (widest source + widest target) x 10^12 + (sum of squared lengths) after rows ``a`` and ``b`` take
    the loads ``new_a`` and ``new_b`` (arrays of candidates), from each side's three longest rows."""

    def __init__(self, loads):
        import numpy as np

        self.loads = loads
        top = np.argsort(-loads, axis=0, kind="stable")[:3]
        self.top_rows = np.full((3, 2), -1, dtype=np.int64)
        self.top_rows[:len(top)] = top
        self.top_loads = np.where(self.top_rows >= 0, loads[np.maximum(self.top_rows, 0), [0, 1]], 0)
        self.squares = int((loads ** 2).sum())
        self.now = int(loads.max(0).sum()) * 10**12 + self.squares

    def __call__(self, a, b, new_a, new_b):
        import numpy as np

        a, b = np.broadcast_arrays(a, b)
        rest = np.zeros(a.shape + (2,), dtype=np.int64)
        found = np.zeros_like(rest, dtype=bool)
        for t in range(3):  # the longest row on each side that is neither a nor b
            other = (self.top_rows[t] != a[..., None]) & (self.top_rows[t] != b[..., None]) & ~found
            rest = np.where(other, self.top_loads[t], rest)
            found |= other
        widest = np.maximum(rest, np.maximum(new_a, new_b)).sum(-1)
        squares = self.squares - (self.loads[a] ** 2).sum(-1) - (self.loads[b] ** 2).sum(-1) \
            + (new_a ** 2).sum(-1) + (new_b ** 2).sum(-1)
        return widest * 10**12 + squares


def best_fit(sizes: list[tuple[int, int]], capacity: tuple[int, int]) -> list[list[int]]:
    """Example positions grouped into rows of at most ``capacity`` (source, target) tokens: best fit decreasing.

    Examples are placed longest first (source + target tokens, ties in stream order), each into the open row it
    leaves the least room in (the two sides' room as shares of their capacity, added), or into a new row. Each
    row lists its examples in stream order.
    """
    order = sorted(range(len(sizes)), key=lambda i: -(sizes[i][0] + sizes[i][1]))
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []
    for i in order:
        source, target = sizes[i]
        best, least = None, None
        for r, (source_room, target_room) in enumerate(room):
            if source <= source_room and target <= target_room:
                left = (source_room - source) / capacity[0] + (target_room - target) / capacity[1]
                if least is None or left < least:
                    best, least = r, left
        if best is None:
            rows.append([i])
            room.append((capacity[0] - source, capacity[1] - target))
        else:
            rows[best].append(i)
            room[best] = (room[best][0] - source, room[best][1] - target)
    return [sorted(row) for row in rows]


def concatenated(pieces: list[list[list[int]]], value: int, multiple: Padding) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``pieces`` (each a row's token lists) laid end to end: (ids [rows, width], segment ids), padded
    with ``value`` / segment 0 to the longest row rounded up to ``multiple``."""
    width = round_up(max(sum(len(piece) for piece in row) for row in pieces), multiple)
    ids = torch.full((len(pieces), width), value, dtype=torch.long)
    segments = torch.zeros((len(pieces), width), dtype=torch.long)
    for r, row in enumerate(pieces):
        at = 0
        for k, piece in enumerate(row, start=1):
            ids[r, at:at + len(piece)] = torch.tensor(piece, dtype=torch.long)
            segments[r, at:at + len(piece)] = k
            at += len(piece)
    return ids, segments


class PackingCollator(Seq2SeqCollator):
    """A ``Seq2SeqCollator`` whose training windows are packed (``packed_window``); single micro-batches
    (evaluation, probes) stay one example per row."""

    def window(self, examples, batch_size: int, max_tokens: int = 0, group: bool = True) -> list[dict]:
        if not group:
            return super().window(examples, batch_size, max_tokens, group)
        sources = self.token_ids([e.prompt for e in examples], self.max_source_len)
        return self.packed_window(sources, self.targets(examples), batch_size, max_tokens)

    def packed_window(self, sources: list[list[int]], targets: list[list[int]], batch_size: int,
                      max_tokens: int = 0) -> list[dict]:
        """The micro-batches of one window's examples (token ids) packed into rows of at most --max_source_len
        source and --max_target_len target tokens (``packed_rows``): ``batch_size`` rows each, or with
        ``max_tokens`` as many rows as keep the padded tokens within it (``data.collate.micro_batches``: rows of
        similar length together, so the last, part-filled rows of a window pad among themselves).

        Each holds ``input_ids``, ``attention_mask`` (1 at tokens), ``labels`` (-100 at padding), and the segment
        ids ``source_segments`` and ``target_segments``.
        """
        sizes = [(len(s), len(t)) for s, t in zip(sources, targets)]
        rows = packed_rows(sizes, (self.max_source_len, self.max_target_len))
        lengths = row_sizes(sizes, rows)
        multiple, out = self.pad_multiple, []
        for group in micro_batches([s for s, _ in lengths], [t for _, t in lengths], batch_size, max_tokens, multiple):
            ids, source_segments = concatenated([[sources[i] for i in rows[r]] for r in group],
                                                self.tokenizer.pad_token_id, multiple)
            labels, target_segments = concatenated([[targets[i] for i in rows[r]] for r in group], -100, multiple)
            out.append({"input_ids": ids, "attention_mask": source_segments.gt(0).long(), "labels": labels,
                        "source_segments": source_segments, "target_segments": target_segments})
        return out


def examples_in(micro_batch: dict) -> int:
    """How many examples a micro-batch holds: its rows (its prompts: a preference pair's two answers are one
    example), or with packing its segments."""
    if "target_segments" in micro_batch:
        return int(micro_batch["target_segments"].amax(dim=1).sum())
    return len(micro_batch["attention_mask"])
