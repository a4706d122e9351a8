"""Adafactor at a fixed learning rate, nanoT5's AdamW with RMS-scaled steps (``AdamWScale``), and the warmup +
decay schedules, without ``transformers.optimization``.

Why not import them from transformers: ``transformers.optimization`` imports ``transformers.trainer_utils``,
which imports peft, bitsandbytes and parts of torch._dynamo whenever they are installed: about 55 MB of
host RSS and 1.4 s at start (measured on the 2-core CPU machine) for two small pieces of arithmetic.
Adafactor follows transformers' code operation for operation; a test checks it gives bit-identical weights
(``tests/test_training_math.py``), and checkpoints are interchangeable: same parameter-group options, same
state keys. The schedules give transformers' rates from the peak on, which both reach at step warmup + 1
(from 1); before it step k applies k / (warmup + 1) of the rate, where transformers applies
(k - 1) / warmup, so its first step has rate 0 and changes nothing (transformers issue 34754). The ramp
stays a straight line to the peak, and the peak rate is applied once, as in transformers.
"""

from __future__ import annotations

import math
from functools import partial

import torch

from config import TrainConfig
from lowmem.parallel.adafactor_slices import Layout, SliceAware, apply_update, summed, update_flat
from lowmem.parallel.sharding import plain, shard_group
from lowmem.utils.optional import optional_import


class Adafactor(torch.optim.Optimizer, SliceAware):
    """Adafactor (Shazeer & Stern, 2018) with the configured learning rate applied as given.

    transformers' ``Adafactor(relative_step=False, scale_parameter=False, warmup_init=False)``: factored
    second moments for matrices (a row and a column vector), full ones for vectors, update clipping at
    RMS ``clip_threshold``, optional first moment (``beta1``) and decoupled weight decay; its default ``eps`` and
    ``decay_rate`` (``EPS``, ``DECAY_RATE``), which nothing here changes.

    Shard-aware: a weight sharded along its first dimension (FSDP2's ``fully_shard``) keeps its local
    rows' statistics, and the statistics that span the rows (a matrix's column means and mean row
    statistic, every update's RMS) are summed over the processes, so each process applies its rows of
    the very update the whole tensor would get (up to float summation order). A flat DeepSpeed ZeRO
    partition holding slices of many weights carries its layout, and steps the same way
    (``lowmem.parallel.adafactor_slices``).
    """

    EPS = (1e-30, 1e-3)  # transformers' defaults, kept in every parameter group (checkpoints carry them)
    DECAY_RATE = -0.8

    def __init__(self, params, lr: float, clip_threshold: float = 1.0, beta1: float | None = None,
                 weight_decay: float = 0.0):
        defaults = dict(lr=lr, eps=self.EPS, clip_threshold=clip_threshold, decay_rate=self.DECAY_RATE, beta1=beta1,
                        weight_decay=weight_decay, scale_parameter=False, relative_step=False, warmup_init=False)
        super().__init__(params, defaults)
        # DeepSpeed's flat partitions and the slices of weights each holds (``describe``); kept here, not
        # on the tensors, which checkpoints would pickle with their attributes
        self.layouts: dict[torch.Tensor, Layout] = {}

    def describe(self, flat: torch.Tensor, layout: Layout) -> None:
        """``flat`` holds the slices of whole weights ``layout`` lists: step them as those weights."""
        self.layouts[flat] = layout

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        return loss

    def _update(self, p: torch.Tensor, group: dict) -> None:
        layout = self.layouts.get(p)
        if layout is not None:  # a DeepSpeed ZeRO partition: slices of many weights
            return update_flat(p, group, self.state[p], layout)
        means = _Means(p)  # the statistics that span a sharded weight's processes
        local, grad = plain(p), plain(p.grad)
        grad = grad.float() if grad.dtype in (torch.float16, torch.bfloat16) else grad
        state, shape = self.state[p], grad.shape  # this process's rows of a sharded weight
        factored, first_moment = len(shape) >= 2, group["beta1"] is not None
        if not state:
            state["step"] = 0
            if first_moment:
                state["exp_avg"] = torch.zeros_like(grad)
            if factored:
                state["exp_avg_sq_row"] = torch.zeros(shape[:-1]).to(grad)
                state["exp_avg_sq_col"] = torch.zeros(shape[:-2] + shape[-1:]).to(grad)
            else:
                state["exp_avg_sq"] = torch.zeros_like(grad)
        weights = local.float() if local.dtype in (torch.float16, torch.bfloat16) else local
        state["step"] += 1
        beta2t = 1.0 - math.pow(state["step"], group["decay_rate"])
        # one full-size temporary per parameter, reused in place (each new one would be a fresh block
        # of a size the heap may not have free: the base model's first step grew RSS by ~600 MiB)
        update = torch.square(grad).add_(group["eps"][0])
        if factored:
            row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
            row.mul_(beta2t).add_(update.mean(dim=-1), alpha=(1.0 - beta2t))
            col.mul_(beta2t).add_(means.columns(update), alpha=(1.0 - beta2t))
            r_factor = (row / means.rows(row)).rsqrt_().unsqueeze(-1)
            torch.mul(r_factor, col.unsqueeze(-2).rsqrt(), out=update).mul_(grad)
        else:
            state["exp_avg_sq"].mul_(beta2t).add_(update, alpha=(1.0 - beta2t))
            torch.rsqrt(state["exp_avg_sq"], out=update).mul_(grad)
        update.div_((means.rms(update) / group["clip_threshold"]).clamp_(min=1.0))
        apply_update(weights, update, state, group)
        if local.dtype in (torch.float16, torch.bfloat16):
            local.copy_(weights)


class AdamWScale(torch.optim.Optimizer):
    """AdamW whose step is scaled by each weight's RMS: nanoT5's ``AdamWScale`` (``--optimizer=adamw_scale``).

    nanoT5 found that what lets Adafactor pretrain T5 where plain AdamW diverges is its relative step: each
    weight moves by an amount proportional to its own root-mean-square size. Here, per weight ``p`` with
    gradient ``g`` at step ``t``: ``m = b1 m + (1 - b1) g``; ``v = b2 v + (1 - b2) g**2``;
    ``p -= lr * sqrt(1 - b2**t) / (1 - b1**t) * max(1e-3, RMS(p)) * m / (sqrt(v) + eps)``, RMS taken before
    the step; then decoupled weight decay ``p -= lr * weight_decay * p`` (not RMS-scaled). Its defaults are
    nanoT5's (transformers' old ``AdamW``): betas (0.9, 0.999), eps 1e-6 added outside the bias correction.

    State is AdamW's (``step``, ``exp_avg``, ``exp_avg_sq``). Shard-aware as ``Adafactor`` is: under FSDP2
    each process steps its rows, with the RMS of the whole weight summed over the processes (DeepSpeed's
    flat slices are refused by ``lowmem.parallel.deepspeed_engine.check_deepspeed``).
    """

    RMS_FLOOR = 1e-3  # a weight at (or near) zero still moves, by lr x 1e-3 (Adafactor's eps[1])

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            # every weight's RMS in one tensor, read back once: one wait for the GPU per group, not per weight
            rms = torch.stack([_Means(p).rms(plain(p)).float() for p in params])
            for p, scale in zip(params, rms.clamp_(min=self.RMS_FLOOR).tolist()):
                self._update(p, group, scale)
        return loss

    def _update(self, p: torch.Tensor, group: dict, scale: float) -> None:
        weights, grad, state = plain(p), plain(p.grad), self.state[p]  # this process's rows of a sharded weight
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(weights)
            state["exp_avg_sq"] = torch.zeros_like(weights)
        state["step"] += 1
        (beta1, beta2), step = group["betas"], state["step"]
        state["exp_avg"].mul_(beta1).add_(grad, alpha=1.0 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        denom = state["exp_avg_sq"].sqrt().add_(group["eps"])  # the step's one weight-sized temporary
        step_size = group["lr"] * math.sqrt(1.0 - beta2 ** step) / (1.0 - beta1 ** step)
        weights.addcdiv_(state["exp_avg"], denom, value=-step_size * scale)
        if group["weight_decay"]:
            weights.add_(weights, alpha=-group["lr"] * group["weight_decay"])


class _Means:
    """Adafactor's means over a weight's rows, and its update's RMS, for a whole weight (transformers'
    operations exactly) or for this process's rows of one sharded along its first dimension (local sums
    added up over the processes, divided by the whole weight's sizes)."""

    def __init__(self, p: torch.Tensor):
        self.shards = shard_group(p)  # the processes p's rows are spread over, or None
        self.shape, self.numel = p.shape, p.numel()
        # a matrix's column statistic and mean row statistic span its rows (the sharded dimension)
        self.spans = self.shards is not None and len(self.shape) == 2

    def _summed(self, tensor: torch.Tensor) -> torch.Tensor:
        return summed(tensor, self.shards)

    def columns(self, update: torch.Tensor) -> torch.Tensor:
        if not self.spans:
            return update.mean(dim=-2)
        return self._summed(update.sum(dim=-2)).div_(self.shape[-2])

    def rows(self, row: torch.Tensor) -> torch.Tensor:
        if not self.spans:
            return row.mean(dim=-1, keepdim=True)
        return self._summed(row.sum(dim=-1, keepdim=True)).div_(self.shape[0])

    def rms(self, update: torch.Tensor) -> torch.Tensor:
        if self.shards is None:
            return update.norm(2) / (update.numel() ** 0.5)
        return self._summed(update.square().sum()).sqrt_() / (self.numel ** 0.5)


def _warmup(step: int, warmup: int) -> float:
    """``step`` counts from 0 (LambdaLR's ``last_epoch`` when the step is taken) and is below
    ``warmup``: the first step applies 1 / (warmup + 1) of the rate, each next one 1 / (warmup + 1)
    more, up to the whole rate at step ``warmup`` (the decay's first)."""
    return float(step + 1) / float(warmup + 1)


def _last_planned(step: int, total: int) -> int:
    """Steps past ``total`` (an epoch of packed text holding more tokens than estimated) keep the last planned
    step's rate: linear decay would train them at 0, cosine would start a second cycle."""
    return min(step, max(total - 1, 0))


def _linear(step: int, warmup: int, total: int) -> float:
    step = _last_planned(step, total)
    if step < warmup:
        return _warmup(step, warmup)
    return max(0.0, float(total - step) / float(max(1, total - warmup)))


def _cosine(step: int, warmup: int, total: int) -> float:
    step = _last_planned(step, total)
    if step < warmup:
        return _warmup(step, warmup)
    progress = float(step - warmup) / float(max(1, total - warmup))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))


def _constant(step: int, warmup: int, total: int) -> float:
    return _warmup(step, warmup) if step < warmup else 1.0


SCHEDULES = {"linear": _linear, "cosine": _cosine, "constant": _constant}


def warmup_schedule(optimizer, name: str, warmup_steps: int, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over ``warmup_steps`` (the first step already at 1 / (warmup_steps + 1) of the rate),
    then ``name`` (linear or cosine decay to 0 at ``total_steps``, or constant) as transformers'
    ``get_scheduler`` computes it."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, partial(SCHEDULES[name], warmup=warmup_steps,
                                                                total=total_steps))


def parameter_groups(model, weight_decay: float) -> list[dict]:
    """The trainable tensors as the optimizer's parameter groups.

    With weight decay, the tensors that are not weight matrices are exempt, as in transformers' Trainer and
    nanoT5: layer-norm scales (decay would pull each towards 0, shrinking its layer's output), biases, and
    T5's relative-position biases (added to the attention scores). Without it, one group: the layout of
    every checkpoint written before the exemption. The layout is recorded and checked on resume
    (``parameter_group_sizes``).
    """
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not weight_decay:
        return [{"params": [p for _, p in trainable]}]

    def exempt(name: str, param) -> bool:  # under ZeRO-3 a partitioned weight's own shape is empty
        dims = len(getattr(param, "ds_shape", param.shape))
        return dims < 2 or name.endswith(".bias") or "relative_attention_bias" in name

    groups = [{"params": [p for name, p in trainable if not exempt(name, p)], "weight_decay": weight_decay},
              {"params": [p for name, p in trainable if exempt(name, p)], "weight_decay": 0.0, "decay_exempt": True}]
    return [group for group in groups if group["params"]]


def parameter_group_sizes(groups: list[dict]) -> list[int]:
    """How many tensors each group holds: the optimizer state's layout, which a resume must find again."""
    return [len(group["params"]) for group in groups]


def resume_schedule(optimizer, scheduler, lr: float, weight_decay: float) -> None:
    """After a resume, this command's peak rate and weight decay, and its schedule (``--max_steps``,
    ``--warmup_steps``, ``--lr_scheduler``, which ``scheduler`` was built with) from the restored step on.

    The restored optimizer and scheduler states hold the rate and decay the run was saved with: a
    changed ``--learn_rate`` would be ignored, and the next step would apply the old schedule's rate
    before the new one took over. With unchanged settings the numbers are the very same.
    """
    rates = [lr * fn(scheduler.last_epoch) for fn in scheduler.lr_lambdas]
    for group, rate in zip(optimizer.param_groups, rates):
        group.update(lr=rate, initial_lr=lr, weight_decay=0.0 if group.get("decay_exempt") else weight_decay)
    scheduler.load_state_dict({**scheduler.state_dict(), "base_lrs": [lr] * len(rates), "_last_lr": rates})


def build_optimizer(cfg: TrainConfig, params):
    """The optimizer of ``--optimizer`` over ``params`` (tensors, or ``lowmem.training.optim.parameter_groups``, whose
    weight decay wins over ``--weight_decay``), with the learning rate applied as given.

    Adafactor: no relative step, no parameter scaling (the reference's ``relative_step=True`` ignored
    the configured rate). adamw8bit keeps both moments in 8 bits (bitsandbytes, tensors of 4096+
    elements; smaller ones stay 32-bit). adamw_scale: nanoT5's AdamW with RMS-scaled steps (``AdamWScale``).
    """
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.learn_rate, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw8bit":
        bnb = optional_import("bitsandbytes", "--optimizer=adamw8bit")
        return bnb.optim.AdamW8bit(params, lr=cfg.learn_rate, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw_scale":
        return AdamWScale(params, lr=cfg.learn_rate, weight_decay=cfg.weight_decay)
    return Adafactor(params, lr=cfg.learn_rate, weight_decay=cfg.weight_decay)


def build_scheduler(cfg: TrainConfig, optimizer, total_steps: int):
    """Linear warmup, then linear / cosine decay to 0 at ``total_steps`` (or constant)."""
    # --warmup_steps as given, as transformers' schedules take it: the rate of each warmup step does not
    # depend on the run's length, and a run shorter than its warmup ends before the peak. (Squeezing the ramp
    # into a short run took a fresh model to the peak within a few steps: loss spikes, docs/correctness.md.)
    return warmup_schedule(optimizer, cfg.lr_scheduler, cfg.warmup_steps, total_steps)


def optimizer_for_run(cfg: TrainConfig, model, total_steps: int) -> tuple:
    """(optimizer, scheduler, its parameter groups' sizes): the optimizer of the trainable tensors and its
    schedule over ``total_steps``; the sizes are kept in run_config.json, checked on resume."""
    groups = parameter_groups(model, cfg.weight_decay)
    optimizer = build_optimizer(cfg, groups)
    return optimizer, build_scheduler(cfg, optimizer, total_steps), parameter_group_sizes(groups)
