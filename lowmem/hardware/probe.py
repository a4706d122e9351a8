"""This process's ``Capability`` per device type: probed once (a CPU's from ``cpu_probe``'s cache or a measurement,
a GPU's from ``gpu_peaks``), then remembered for the run."""

from __future__ import annotations

import torch

from lowmem.hardware.capability import Capability
from lowmem.hardware.cpu_probe import cpu_capability
from lowmem.hardware.gpu_peaks import gpu_capability

_KNOWN: dict[str, Capability] = {}  # by device type, for this process (the threads do not change in a run)


def capability(device_type: str = "cpu") -> Capability:
    """The capability of this process's ``device_type`` ("cpu", "cuda"): from the cache, or probed once."""
    known = _KNOWN.get(device_type)
    if known is None:
        if device_type == "cuda":
            known = gpu_capability(torch.cuda.current_device())
        else:
            known = cpu_capability()
        _KNOWN[device_type] = known
    return known


def computes_fast(dtype: torch.dtype, device_type: str) -> bool:
    """Whether products in ``dtype`` are fast on ``device_type`` here (asked inside forwards: a dict lookup)."""
    return capability(device_type).fast(dtype)
