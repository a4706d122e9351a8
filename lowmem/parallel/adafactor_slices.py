"""Adafactor's step on a flat partition holding slices of many weights: what DeepSpeed ZeRO hands the
optimizer (one flat float32 tensor per group, this process's share of every weight in it).

Adafactor's maths needs whole weights: a matrix's second moment is factored into a row and a column
statistic (means over the whole columns and rows), and every update is clipped by its whole weight's
RMS. On a flat slice a plain Adafactor would treat the slice as one long vector: no factorisation, a
clip by the slice's RMS, a different optimizer. Here each process knows which elements of which weight
its partition holds (a ``Layout``, read from DeepSpeed's own records by ``lowmem.parallel.deepspeed_engine``),
adds up its elements' contributions to every row and column statistic and to every weight's squared
update, and sums those over the processes (two all-reduces per step, of the statistics' size, not the
weights'), so each process applies its slice of the very update the whole weight would get, up to
float summation order. The row and column statistics are small and kept whole on every process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


class SliceAware:
    """An optimizer that steps a flat partition as the whole weights whose slices it holds: DeepSpeed's engine
    asks this of its optimizer and hands it each partition's ``Layout`` (``lowmem.training.optim.Adafactor``)."""

    def describe(self, flat: torch.Tensor, layout: Layout) -> None:
        """``flat`` holds the slices of whole weights ``layout`` lists: step them as those weights."""
        raise NotImplementedError


@dataclass(frozen=True)
class Slice:
    """The elements of one weight a flat partition holds: the weight's ``shape``, the first element held
    (``start``, in the weight's row-major order), how many (``count``, 0 when all are on other processes)
    and where they lie in the partition (``offset``)."""

    shape: tuple
    start: int
    count: int
    offset: int

    @property
    def factored(self) -> bool:
        return len(self.shape) >= 2

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def matrices(self) -> int:  # leading dimensions of a factored weight, as one
        return math.prod(self.shape[:-2])

    @property
    def rows(self) -> int:  # rows of all its matrices, stacked
        return self.numel // self.shape[-1]

    @property
    def columns(self) -> int:  # columns of all its matrices, side by side (its column statistics)
        return self.matrices * self.shape[-1]


@dataclass(frozen=True)
class Layout:
    """Every weight of a flat partition's group, in the same order on every process (so the summed
    statistics line up), and the process group the weights are partitioned over."""

    slices: tuple
    group: object = None

    def statistics(self) -> list[tuple[int, int, int]]:
        """Where each weight's statistics lie: (first row, first column) in the concatenated row and
        column vectors of the factored weights, first element in the full second moments of the others."""
        where, rows, columns, vector = [], 0, 0, 0
        for piece in self.slices:
            where.append((rows, columns, vector))
            if piece.factored:
                rows, columns = rows + piece.rows, columns + piece.columns
            else:
                vector += piece.count
        return where + [(rows, columns, vector)]  # and the sizes


class _Block:
    """A slice of a factored weight widened to whole rows: rows ``first`` .. ``first + n_rows - 1`` of
    the weight's stacked (rows, columns) view, the slice starting ``skip`` elements in."""

    def __init__(self, piece: Slice, device: torch.device):
        columns = piece.shape[-1]
        self.first = piece.start // columns
        last = (piece.start + piece.count - 1) // columns
        self.n_rows, self.columns, self.skip = last - self.first + 1, columns, piece.start - self.first * columns
        # the matrix (leading index) each of these rows belongs to, for the column statistics
        self.matrix = torch.arange(self.first, last + 1, device=device) // (piece.rows // piece.matrices)

    def widen(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (the slice's elements) in a zero (n_rows, columns) block."""
        block = values.new_zeros(self.n_rows * self.columns)
        block[self.skip:self.skip + values.numel()] = values
        return block.view(self.n_rows, self.columns)

    def narrow(self, block: torch.Tensor, count: int) -> torch.Tensor:
        return block.reshape(-1)[self.skip:self.skip + count]


def summed(tensor: torch.Tensor, group) -> torch.Tensor:
    """``tensor`` summed over ``group`` in place (Adafactor's statistics of a sharded weight); through the
    GPU where the backend reduces CUDA tensors only (NCCL) and the shard is on the host (an offload
    config)."""
    import torch.distributed as dist

    if tensor.device.type == "cpu" and "gloo" not in str(dist.get_backend(group)):
        on_device = tensor.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(on_device, group=group)
        return tensor.copy_(on_device)
    dist.all_reduce(tensor, group=group)
    return tensor


def update_flat(p: torch.Tensor, group: dict, state: dict, layout: Layout) -> None:
    """One Adafactor step (``lowmem.training.optim.Adafactor``'s options in ``group``) on the flat float32
    partition ``p`` laid out as ``layout``; every process of ``layout.group`` calls it together."""
    grad = p.grad.float()
    slices, where = layout.slices, layout.statistics()
    n_rows, n_columns, n_vector = where[-1]
    first_moment = group["beta1"] is not None
    if not state:
        state["step"] = 0
        if first_moment:
            state["exp_avg"] = torch.zeros_like(grad)
        state["exp_avg_sq_row"] = grad.new_zeros(n_rows)
        state["exp_avg_sq_col"] = grad.new_zeros(n_columns)
        state["exp_avg_sq"] = grad.new_zeros(n_vector)
    state["step"] += 1
    beta2t, eps = 1.0 - math.pow(state["step"], group["decay_rate"]), group["eps"][0]
    factored = [(i, piece) for i, piece in enumerate(slices) if piece.factored]
    blocks = {i: _Block(piece, grad.device) for i, piece in factored if piece.count}

    # 1. every matrix's row and column sums of grad^2 + eps over the elements held here, then over all
    row_sums, column_sums = _square_sums(grad, layout, where, blocks, eps)

    # 2. the moving averages (whole row and column vectors: the same on every process) and the update
    update = torch.zeros_like(grad)
    squares = grad.new_zeros(len(slices))  # each weight's squared update, summed over the processes next
    for i, piece in enumerate(slices):
        row_at, column_at, vector_at = where[i]
        g, u = _held(grad, piece), _held(update, piece)
        if not piece.factored:
            v = state["exp_avg_sq"][vector_at:vector_at + piece.count]
            v.mul_(beta2t).add_(g.square().add_(eps), alpha=(1.0 - beta2t))
            torch.rsqrt(v, out=u).mul_(g)
            squares[i] = u.square().sum()
            continue
        rows = state["exp_avg_sq_row"][row_at:row_at + piece.rows].view(piece.matrices, -1)
        columns = state["exp_avg_sq_col"][column_at:column_at + piece.columns]
        columns = columns.view(piece.matrices, -1)
        rows.mul_(beta2t).add_(row_sums[row_at:row_at + piece.rows].view_as(rows) / piece.shape[-1],
                               alpha=(1.0 - beta2t))
        columns.mul_(beta2t).add_(column_sums[column_at:column_at + columns.numel()].view_as(columns)
                                  / rows.shape[-1], alpha=(1.0 - beta2t))
        if i in blocks:
            block = blocks[i]
            r_factor = (rows / rows.mean(dim=-1, keepdim=True)).rsqrt_().reshape(-1)
            r_factor = r_factor[block.first:block.first + block.n_rows].unsqueeze(-1)
            torch.mul(block.narrow(r_factor * columns.rsqrt()[block.matrix], piece.count), g, out=u)
            squares[i] = u.square().sum()
    summed(squares, layout.group)

    # 3. each weight's update clipped at its whole RMS, then the elementwise rest of Adafactor
    for i, piece in enumerate(slices):
        rms = squares[i].sqrt() / (piece.numel ** 0.5)
        _held(update, piece).div_((rms / group["clip_threshold"]).clamp_(min=1.0))
    apply_update(p, update, state, group)


def _square_sums(grad: torch.Tensor, layout: Layout, where: list, blocks: dict,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Every factored weight's row and column sums of grad^2 + ``eps``, from the elements held here (the
    ``blocks``), summed over ``layout.group``: the concatenated row and column vectors."""
    n_rows, n_columns, _ = where[-1]
    sums = grad.new_zeros(n_rows + n_columns)
    row_sums, column_sums = sums[:n_rows], sums[n_rows:]
    for i, block in blocks.items():
        piece, (row_at, column_at, _) = layout.slices[i], where[i]
        squared = block.widen(_held(grad, piece).square().add_(eps))
        row_sums[row_at + block.first:row_at + block.first + block.n_rows] += squared.sum(dim=-1)
        columns = column_sums[column_at:column_at + piece.columns]
        columns.view(piece.matrices, -1).index_add_(0, block.matrix, squared)
    summed(sums, layout.group)
    return row_sums, column_sums


def apply_update(weights: torch.Tensor, update: torch.Tensor, state: dict, group: dict) -> None:
    """The elementwise end of an Adafactor step, whole weights or slices alike: the learning rate, the
    first moment (``beta1``), decoupled weight decay, then the update subtracted from ``weights``."""
    lr = group["lr"]
    update.mul_(lr)
    if group["beta1"] is not None:
        update = state["exp_avg"].mul_(group["beta1"]).add_(update, alpha=(1 - group["beta1"]))
    if group["weight_decay"] != 0:
        weights.add_(weights, alpha=(-group["weight_decay"] * lr))
    weights.sub_(update)


def _held(flat: torch.Tensor, piece: Slice) -> torch.Tensor:
    return flat[piece.offset:piece.offset + piece.count]
