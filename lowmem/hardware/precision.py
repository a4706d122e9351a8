"""How a run computes (``--mixed_precision``): float32, bf16 autocast, or fp16 autocast with a loss scaler.

One class per kind, registered by its name (``lowmem.utils.registry``: ``PRECISIONS``); the trainer, the evaluation
and the encoder cache ask the run's kind for their autocast context, and the trainer asks it to scale the loss,
unscale the gradients and keep the scaler's state in checkpoints. What holds only the config (the planner, the
checks of the flags, the padding of shapes) asks the class ``PRECISIONS[cfg.mixed_precision]``: its ``dtype``,
its ``width`` and ``half``, whether T5's ``wo`` runs on a float32 cast (``float32_wo``). No module but this one
compares a precision's name (tests/test_code_layout.py). Adding a precision: one subclass here with its ``name``
(and the name with its dtype in ``lowmem.utils.precision_names``, for ``config``).

fp16 (for GPUs without fast bf16: T4, V100, RTX 20xx) is float16 autocast with ``torch.amp.GradScaler``, which also
runs on the CPU. T5 overflows float16 in one place under autocast, measured on a tiny T5 whose feed-forward output
weights were scaled to push their outputs past 65,504 (docs/memory.md, 'fp16'): the feed-forward output projection
``wo`` (its float16 output is the first non-finite tensor; the residual addition after it is float32 under autocast,
since the residual stream starts from float32 embeddings). So ``wo`` runs in float32 there, as transformers keeps it
in float32 for float16 weights (``_keep_in_fp32_modules``), which autocast alone would not honour.
"""

from __future__ import annotations

import functools

import torch

from lowmem.utils.registry import Registered


class Precision(Registered, family=True):
    """Float32 (``--mixed_precision=no``): no autocast, no loss scaling."""

    name = "no"
    accelerate_name = "no"  # what accelerate is told (fp16's autocast and scaler are this class's own)
    dtype = torch.float32  # what matrix products compute in
    width = 4  # bytes of each value its products make and of the casts of their inputs (the planner's activations)
    half = False  # computes in 16 bits
    float32_wo = False  # T5's feed-forward output projections run on a float32 cast of their input (fp16's guard)
    scales_loss = False  # its own loss scaler (DeepSpeed, which would run it with float16 weights, refuses it)

    def __init__(self, device_type: str):
        """``device_type``: the accelerator's ("cpu", "cuda"), where a loss scaler would work."""

    @staticmethod
    def autocast(accelerator):
        """The context every forward of the run (training, evaluation, the encoder cache) runs in."""
        return accelerator.autocast()

    def prepare(self, core) -> None:
        """Make the plain model (before wrapping) fit to compute in this precision."""

    @classmethod
    def shape_multiple(cls, on_cpu: bool) -> int:
        """What lengths and target counts are rounded up to: 16 for a half precision on the CPU, else 1.

        oneDNN's bf16 kernels on the CPU keep a primitive, with a packed copy of the weight, per matrix
        shape: dynamic padding makes hundreds of shapes, and host RSS grew by ~0.7 GB in 24 steps (tiny,
        16k vocabulary). Multiples of 16 keep a few dozen shapes and RSS flat. fp32 and CUDA kernels keep
        no such state: no rounding.
        """
        return 16 if cls.half and on_cpu else 1

    @classmethod
    def missing_on_gpu(cls) -> bool:
        """Whether this machine's GPU lacks this precision's dtype (bf16 before Ampere)."""
        return cls.dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported()

    # ------------------------------------------------------------------ loss scaling (fp16's)
    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def unscale(self, optimizer) -> None:
        """Gradients back to their true size, before they are measured and clipped."""

    def step(self, engine, optimizer) -> None:
        """The optimizer step of a window whose gradient norm is finite (then fp16's scale may grow)."""
        engine.step(optimizer)
        self.update()

    def update(self) -> None:
        """After the window's gradients were unscaled and looked at: the scale follows them."""

    def overflowed(self, loss_finite) -> bool:
        """The window's gradient norm was not finite: whether that was the loss scale's overflow (the step is
        skipped and the scale lowered; counted here, never fatal) rather than a non-finite loss or gradient for
        the non-finite guard to count. ``loss_finite()``: whether the loss was finite on every process."""
        return False

    def state_dict(self) -> dict | None:
        return None

    def load_state_dict(self, state: dict | None) -> None:
        pass

    def log_fields(self) -> dict:
        return {}


class BFloat16(Precision):
    """bf16 autocast, as accelerate runs it (float32 weights; float32's range: no scaling)."""

    name = accelerate_name = "bf16"
    dtype = torch.bfloat16
    width, half = 2, True


class Float16(Precision):
    """fp16 autocast with a loss scaler; T5's feed-forward output projections in float32."""

    name = "fp16"
    dtype = torch.float16
    width, half = 2, True
    float32_wo = scales_loss = True  # (``prepare``, ``scale``)

    def __init__(self, device_type: str):
        self.scaler = torch.amp.GradScaler(device_type)
        self.skipped = 0  # windows whose scaled gradients overflowed (their step skipped, the scale lowered)

    @staticmethod
    def autocast(accelerator):
        return torch.autocast(accelerator.device.type, dtype=torch.float16)

    def prepare(self, core) -> None:
        float32_feed_forward_outputs(core)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def unscale(self, optimizer) -> None:
        self.scaler.unscale_(optimizer)

    def update(self) -> None:
        self.scaler.update()

    def overflowed(self, loss_finite) -> bool:
        # At a scale of 1 or less the gradients overflow unscaled: no lower scale helps, the guard counts it.
        # (loss_finite is a collective: asked on every process alike, as the norm is the same on all.)
        overflow = self.scaler.get_scale() > 1 and loss_finite()
        self.scaler.update()  # lowers the scale (unscale_ found the overflow)
        self.skipped += overflow
        return overflow

    def state_dict(self) -> dict:
        return {"scaler": self.scaler.state_dict(), "skipped": self.skipped}

    def load_state_dict(self, state: dict | None) -> None:
        if state:  # (a checkpoint of a run started before fp16 existed holds none)
            self.scaler.load_state_dict(state["scaler"])
            self.skipped = state["skipped"]

    def log_fields(self) -> dict:
        return {"loss_scale": self.scaler.get_scale(), "scaler_skipped_steps": self.skipped}


PRECISIONS: dict[str, type[Precision]] = Precision.kinds  # --mixed_precision -> its class


def precision_for(mixed_precision: str, device_type: str) -> Precision:
    """The run's precision object (``device_type``: the accelerator's)."""
    return PRECISIONS[mixed_precision](device_type)


def fast_half_precision(found) -> str:
    """The ``--mixed_precision`` of the first half precision whose products ``found`` (``lowmem.hardware.capability``)
    measured fast: bf16 where they are (Ampere on), else fp16 with its loss scaler (T4, V100, RTX 20xx), else
    float32's ``no``."""
    return next((kind.name for kind in PRECISIONS.values() if kind.half and found.fast(kind.dtype)), Precision.name)


def slow_here(precision: Precision, found) -> str | None:
    """The warning for a ``--mixed_precision`` whose products ``found`` (``lowmem.hardware.capability``) measured
    slow on the run's device, with the measured factor; None where it is fast. The run goes on as asked."""
    if found.fast(precision.dtype):
        return None
    dtype = str(precision.dtype).removeprefix("torch.")
    factor = found.slowdown(precision.dtype)
    return (f"--mixed_precision={precision.name}: {dtype} matrix products take {factor:,.0f}x float32's time on this "
            f"{found.device} ({found.name}, {found.source}); the run computes in {dtype} as asked, its products "
            f"~{factor:,.0f}x slower than with --mixed_precision=no")


def compute_context(accelerator, mixed_precision: str):
    """The autocast context of ``--mixed_precision`` on the accelerator's device."""
    return PRECISIONS[mixed_precision].autocast(accelerator)


def float32_feed_forward_outputs(core) -> int:
    """Run every T5 feed-forward block's output projection ``wo`` in float32, outside autocast; returns how many.

    Its input (the activation, d_ff wide) is cast up, so its output can exceed float16's 65,504 and still be
    added to the float32 residual stream. The weights and state-dict names stay as they are (only the module's
    forward is wrapped), so checkpoints and exports do not change.
    """
    count = 0
    for module in core.modules():
        wo = getattr(module, "wo", None)
        feed_forward = hasattr(module, "wi") or hasattr(module, "wi_0")  # T5DenseActDense, T5DenseGatedActDense
        if feed_forward and isinstance(wo, torch.nn.Module) and not getattr(wo, "_lowmem_float32", False):
            wo.forward = functools.partial(_float32_forward, wo.forward)
            wo._lowmem_float32 = True
            count += 1
    return count


def _float32_forward(forward, hidden_states: torch.Tensor, *args, **kwargs):
    with torch.autocast(hidden_states.device.type, enabled=False):
        return forward(hidden_states.float(), *args, **kwargs)
