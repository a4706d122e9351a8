"""A CPU's matrix-product rates per dtype: a small product per dtype, best of a few (about 0.1 s), cached per machine
(CPU model, torch's kernel level, torch's version, the process's threads) in
``$XDG_CACHE_HOME/t5-lowmem/hardware.json``.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
from pathlib import Path

import torch

from lowmem.hardware.capability import DTYPES, SLOW_FACTOR, Capability

# The products timed: the small one for every dtype (a slow kernel's ~6 ms at ~100x), the larger one for the rates
# of the fast ones (a product this size reaches the kernels' rate: 512 x 1024 x 1024 measured 146 GFLOP/s on 2 AVX2
# cores, 2x the small one's; 2048-wide products no more).
SMALL, LARGE = (64, 256, 256), (512, 1024, 1024)
CACHE_VERSION = 1


def cpu_name() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads"


def cpu_capability() -> Capability:
    """This CPU's rates, from the cache when this machine (and thread count) was probed before.

    A rate measured while other processes shared the cores is low, and MFU divided by it would be high (above 1,
    seen here). So every start times float32's product again (~50 ms) and the cache keeps the highest rate seen,
    the narrow dtypes' rising with it (measured beside it, under the same load): the peak only rises, to the
    machine's own."""
    name = cpu_name()
    key = f"{name} | torch {torch.__version__}"
    cached = read_cache().get(key)
    if isinstance(cached, dict) and valid_rates(cached.get("flops")):
        flops, now = cached["flops"], product_rate(torch.float32, LARGE)
        if now <= flops["float32"]:
            return Capability("cpu", name, flops, "measured")
        flops = {dtype: rate * now / flops["float32"] for dtype, rate in flops.items()}
    else:
        flops = measure_cpu()
    write_cache(key, {"flops": flops})
    return Capability("cpu", name, flops, "measured")


def valid_rates(flops) -> bool:
    return (isinstance(flops, dict) and set(flops) == set(DTYPES)
            and all(isinstance(v, (int, float)) and v >= 0 for v in flops.values()) and flops["float32"] > 0)


def measure_cpu() -> dict:
    """FLOP/s per dtype: float32 at the larger product; a narrow dtype at the larger one where it is not slow at the
    small one, else float32's rate divided by its slowdown at the small one (a slow kernel is not timed at length)."""
    rates = {"float32": product_rate(torch.float32, LARGE)}
    small32 = product_rate(torch.float32, SMALL)
    for name, dtype in DTYPES.items():
        if name == "float32":
            continue
        small = product_rate(dtype, SMALL)
        slowdown = small32 / small if small > 0 else float("inf")
        if slowdown <= 2 * SLOW_FACTOR:
            rates[name] = product_rate(dtype, LARGE)
        else:
            rates[name] = rates["float32"] / slowdown
    return rates


def product_rate(dtype: torch.dtype, shape: tuple[int, int, int], repeats: int = 5) -> float:
    """FLOP/s of one ``shape`` = (m, k, n) product in ``dtype`` on the CPU, the best of ``repeats`` after one warm-up;
    0 where torch has no such kernel."""
    m, k, n = shape
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=generator).to(dtype)
    b = torch.randn(k, n, generator=generator).to(dtype)
    try:
        torch.mm(a, b)
    except RuntimeError:
        return 0.0
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * m * k * n / max(best, 1e-9)


# ---------------------------------------------------------------------------------------------- the cache
def cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "t5-lowmem" / "hardware.json"


def read_cache() -> dict:
    """The cache's entries ({} when missing, unreadable or of another version: probed again)."""
    try:
        saved = json.loads(cache_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(saved, dict) or saved.get("version") != CACHE_VERSION or not isinstance(saved.get("machines"),
                                                                                               dict):
        return {}
    return saved["machines"]


def write_cache(key: str, entry: dict) -> None:
    """Add one machine's entry, atomically (processes starting together each write a whole file); a cache that
    cannot be written (a read-only home) only means probing again next time."""
    path = cache_path()
    machines = {**read_cache(), key: entry}
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_text(json.dumps({"version": CACHE_VERSION, "machines": machines}, indent=1), encoding="utf-8")
        os.replace(temporary, path)
    except OSError:
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)
