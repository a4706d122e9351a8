"""A GPU's matrix-product peaks: from its datasheet where the table below knows it, else measured on it.

Which narrow dtypes are fast follows the compute capability: bfloat16 has tensor cores from Ampere (8.0) on, float16
from Volta (7.0) on and runs at twice float32's rate on the P100 (6.0); elsewhere (a T4 or V100 asked for bfloat16,
a GTX 10xx for float16) torch emulates them or runs them at a fraction of float32's rate.
"""

from __future__ import annotations

import time

import torch

from lowmem.hardware.capability import DTYPES, SLOW_FACTOR, Capability

TERA = 1e12
# Dense peaks (no sparsity) in FLOP/s: float32 (without TF32), TF32, and the 16-bit tensor-core rate (bf16 = fp16 on
# these parts), from NVIDIA's datasheets. Matched on the device name's words, the more specific entry first.
DATASHEET = [
    ("H100 PCIe", {"float32": 51.2, "tf32": 378, "half": 756}),
    ("H100 NVL", {"float32": 60, "tf32": 418, "half": 835}),
    ("H100", {"float32": 67, "tf32": 495, "half": 989}),  # SXM
    ("H200", {"float32": 67, "tf32": 495, "half": 989}),
    ("A100", {"float32": 19.5, "tf32": 156, "half": 312}),
    ("L40S", {"float32": 91.6, "tf32": 183, "half": 362}),
    ("L4", {"float32": 30.3, "tf32": 60, "half": 121}),
    ("V100", {"float32": 15.7, "tf32": 15.7, "half": 125}),
    ("T4", {"float32": 8.1, "tf32": 8.1, "half": 65}),
]


def fast_half(major: int, minor: int) -> dict:
    """{dtype name: fast} of the 16-bit dtypes at compute capability ``major.minor``."""
    return {"bfloat16": major >= 8, "float16": major >= 7 or (major, minor) == (6, 0)}


def datasheet_peaks(name: str) -> dict | None:
    words = f" {name} "
    for model, peaks in DATASHEET:
        if f" {model} " in words or f" {model}-" in words:
            return peaks
    return None


def gpu_capability(index: int) -> Capability:
    """The GPU ``index``'s capability: datasheet peaks for the dtypes its compute capability runs fast (float32's as
    TF32 where torch is allowed to use it); a dtype it runs slowly is charged SLOW_FACTOR squared (never chosen)."""
    props = torch.cuda.get_device_properties(index)
    name = f"{props.name} (sm_{props.major}{props.minor})"
    peaks = datasheet_peaks(props.name)
    if peaks is None:
        return Capability("cuda", name, measured_rates(index), "measured")
    tf32 = torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
    float32 = (peaks["tf32"] if tf32 and props.major >= 8 else peaks["float32"]) * TERA
    fast = fast_half(props.major, props.minor)
    flops = {"float32": float32}
    for dtype in ("bfloat16", "float16"):
        flops[dtype] = peaks["half"] * TERA if fast[dtype] else float32 / SLOW_FACTOR**2
    return Capability("cuda", name, flops, "datasheet")


def measured_rates(index: int, size: int = 4096, repeats: int = 5) -> dict:
    """FLOP/s per dtype of a ``size``-cubed product on the GPU, the best of ``repeats`` (a GPU the table lacks)."""
    device = torch.device("cuda", index)
    rates = {}
    for dtype_name, dtype in DTYPES.items():
        try:
            a = torch.randn(size, size, device=device).to(dtype)
            b = torch.randn(size, size, device=device).to(dtype)
            torch.mm(a, b)
            torch.cuda.synchronize(device)
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                torch.mm(a, b)
                torch.cuda.synchronize(device)
                best = min(best, time.perf_counter() - start)
            rates[dtype_name] = 2 * size**3 / best
        except RuntimeError:  # no kernel for it on this GPU
            rates[dtype_name] = 0.0
    return rates
