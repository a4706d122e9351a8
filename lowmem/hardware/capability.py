"""What the machine a run is on computes fast: its matrix-product rate in float32, bfloat16 and float16.

Machines differ from run to run, and so does what is fast on them. A CPU with AVX2 only (no AVX-512 BF16, no AMX:
most laptops, older Xeons, AMD before Zen 4) multiplies bfloat16 matrices ~100x slower than float32 ones, in torch's
fallback kernels; a Sapphire Rapids Xeon multiplies them faster. So on a CPU the rates are measured: a small matrix
product per dtype, best of a few (well under a second), cached per machine (CPU model, torch's kernel level, torch's
version, the process's threads) in ``$XDG_CACHE_HOME/t5-lowmem/hardware.json``. On a GPU they come from its compute
capability and its datasheet (``lowmem.hardware.gpu_peaks``).

Every dtype choice asks ``capability(device_type)``: what narrow-stored frozen weights compute in, the planner's
speed ranking and recommendation, the memory profiles, the warning on an explicit choice that is slow here, and the
peak that MFU is measured against.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# A narrow dtype whose products take more than this many times float32's is slow here: frozen weights stored in it
# compute in float32, and the planner never recommends computing in it.
SLOW_FACTOR = 1.5
# The products timed on a CPU: the small one for every dtype (a slow kernel's ~6 ms at ~100x), the larger one for the
# rates of the fast ones (a product this size reaches the kernels' rate: 256 x 1024 x 1024 measured 2x the small one's).
SMALL, LARGE = (64, 256, 256), (256, 1024, 1024)
CACHE_VERSION = 1


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


_KNOWN: dict[str, Capability] = {}  # by device type, for this process (the threads do not change in a run)


def capability(device_type: str = "cpu") -> Capability:
    """The capability of this process's ``device_type`` ("cpu", "cuda"): from the cache, or probed once."""
    known = _KNOWN.get(device_type)
    if known is None:
        if device_type == "cuda":
            from lowmem.hardware.gpu_peaks import gpu_capability

            known = gpu_capability(torch.cuda.current_device())
        else:
            known = cpu_capability()
        _KNOWN[device_type] = known
    return known


def computes_fast(dtype: torch.dtype, device_type: str) -> bool:
    """Whether products in ``dtype`` are fast on ``device_type`` here (asked inside forwards: a dict lookup)."""
    return capability(device_type).fast(dtype)


# ---------------------------------------------------------------------------------------------- the CPU's probe
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
    """This CPU's rates, from the cache when this machine (and thread count) was probed before."""
    name = cpu_name()
    key = f"{name} | torch {torch.__version__}"
    cached = read_cache().get(key)
    if isinstance(cached, dict) and valid_rates(cached.get("flops")):
        return Capability("cpu", name, cached["flops"], "measured")
    found = Capability("cpu", name, measure_cpu(), "measured")
    write_cache(key, {"flops": found.flops})
    return found


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
