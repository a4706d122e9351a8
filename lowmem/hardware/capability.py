"""What the machine a run is on computes fast: its matrix-product rate in float32, bfloat16 and float16.

Machines differ from run to run, and so does what is fast on them. A CPU with AVX2 only (no AVX-512 BF16, no AMX:
most laptops, older Xeons, AMD before Zen 4) multiplies bfloat16 matrices ~100x slower than float32 ones, in torch's
fallback kernels; a Sapphire Rapids Xeon multiplies them faster. So on a CPU the rates are measured: a small matrix
product per dtype, best of a few (well under a second), cached per machine (CPU model, torch's kernel level, torch's
version, the process's threads) in ``$XDG_CACHE_HOME/t5-lowmem/hardware.json``. On a GPU they come from its compute
capability and its datasheet (``lowmem.hardware.gpu_peaks``).

Every dtype choice asks ``lowmem.hardware.probe.capability(device_type)``: what narrow-stored frozen weights compute
in, the planner's speed ranking and recommendation, the memory profiles, the warning on an explicit choice that is
slow here, and the peak that MFU is measured against.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# A narrow dtype whose products take more than this many times float32's is slow here: frozen weights stored in it
# compute in float32, and the planner never recommends computing in it.
SLOW_FACTOR = 1.5


@dataclass(frozen=True)
class Capability:
    """The matrix-product rates of one device. ``flops``: FLOP/s by dtype name (a CPU's measured with this
    process's threads; a GPU's dense datasheet peak); ``source``: "measured" or "datasheet"."""

    device: str
    name: str
    flops: dict
    source: str

    def slowdown(self, dtype: torch.dtype | str) -> float:
        """How many times float32's time a product in ``dtype`` takes here (below 1: faster)."""
        rate = self.flops.get(dtype_name(dtype), 0.0)
        return self.flops["float32"] / rate if rate > 0 else float("inf")

    def fast(self, dtype: torch.dtype | str) -> bool:
        return dtype_name(dtype) == "float32" or self.slowdown(dtype) <= SLOW_FACTOR

    def compute_dtype(self, stored: torch.dtype) -> torch.dtype:
        """The dtype a weight stored in ``stored`` computes in here: its own where that is fast, else float32
        (converted a block at a time: ``lowmem.model.narrow_compute``)."""
        return stored if not stored.is_floating_point or self.fast(stored) else torch.float32

    def peak(self, dtype: torch.dtype | str) -> float:
        """FLOP/s of a matrix product in ``dtype``: what MFU divides by."""
        return self.flops.get(dtype_name(dtype), 0.0)

    def line(self) -> str:
        """The start-up summary's words for it."""
        parts = []
        for name in DTYPES:
            rate = f"{name} {self.flops.get(name, 0.0) / 1e9:,.0f} GFLOP/s"
            if name != "float32" and not self.fast(name):
                rate += f" ({self.slowdown(name):,.0f}x slower)"
            parts.append(rate)
        return f"compute on {self.name} ({self.source}): " + ", ".join(parts)

    def record(self) -> dict:
        return {**asdict(self), "fast": [name for name in DTYPES if self.fast(name)]}


def dtype_name(dtype: torch.dtype | str) -> str:
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
