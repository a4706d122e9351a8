"""Memory probes and hygiene, and the ``--max_rss_gb`` guard read from them (``MemoryGuard``: light to
import, for the trainer's loop and for long loops elsewhere, loading and exporting models).

Figures are MiB. ``rss_mb`` counts this process and its children (tokenizer threads live in the
process; loader or launcher children would not), ``peak_rss_mb`` is the kernel's high-water mark of
this process (see :func:`peak_rss_bytes`) or of a finished child, whichever is higher.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import resource
import sys
import time

import psutil
import torch


def memory_snapshot() -> dict:
    """Current host (and CUDA, when present) memory in MiB."""
    proc = psutil.Process()
    rss = proc.memory_info().rss
    for child in proc.children(recursive=True):
        try:
            rss += child.memory_info().rss
        except psutil.Error:  # a child may exit between listing and reading
            pass
    # Children's peaks in KiB (Linux); a child's includes our RSS when it started, never above our own peak.
    peak = max(peak_rss_bytes(), resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024) / 2**20
    snap = {"rss_mb": round(rss / 2**20, 1), "peak_rss_mb": round(peak, 1),
            "sys_available_mb": round(psutil.virtual_memory().available / 2**20, 1)}
    if torch.cuda.is_available():
        snap.update(cuda_allocated_mb=round(torch.cuda.memory_allocated() / 2**20, 1),
                    cuda_reserved_mb=round(torch.cuda.memory_reserved() / 2**20, 1),
                    cuda_peak_mb=round(torch.cuda.max_memory_allocated() / 2**20, 1),
                    cuda_reserved_peak_mb=round(torch.cuda.max_memory_reserved() / 2**20, 1))
    return snap


_SELF = psutil.Process()


def peak_rss_bytes() -> int:
    """This process's peak resident memory since it started: the kernel's high-water mark (VmHWM).

    Not ``getrusage(RUSAGE_SELF).ru_maxrss``: on Linux that keeps the peak of the process image an
    ``exec`` replaced, i.e. the RSS of whoever spawned us (Python's subprocess forks the parent, then
    execs). A run started from a 700 MiB pytest, or by a launcher, reported the parent's peak as its
    own. VmHWM belongs to the running program alone; ru_maxrss stays the fallback where /proc is missing.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def process_rss_bytes() -> int:
    """This process's resident memory (cheap enough to read at every optimizer step)."""
    return _SELF.memory_info().rss


def rss_and_peak_bytes() -> tuple[int, int]:
    """(this process's resident memory now, its high-water mark: ``peak_rss_bytes``), in one read of
    /proc/self/status (~50 us) where there is one."""
    try:
        with open("/proc/self/status", "rb") as status:
            text = status.read()
        return tuple(int(text[text.index(key) + len(key):text.index(b"kB", text.index(key))]) * 1024
                     for key in (b"VmRSS:", b"VmHWM:"))
    except (OSError, ValueError):
        return process_rss_bytes(), peak_rss_bytes()


MEMORY_GUARD_AT = 0.9  # --max_rss_gb's guard stops once RSS reaches this fraction of it: what comes next may need more


class StoppedForMemory(Exception):
    """The memory guard (--max_rss_gb) tripped. The CLI prints the message as one line and exits with
    code 3; in training, after the checkpoint of the last step (when one was completed)."""


class MemoryGuard:
    """``--max_rss_gb``'s guard: whether this process's resident memory has reached ``MEMORY_GUARD_AT`` of it.

    Each reading takes the RSS and the kernel's high-water mark of it: when the mark rose since the
    reading before, RSS went that high in between, so a peak already freed (a micro-batch's activations,
    gone by the end of its backward) trips the guard as memory still held does. Once tripped it stays
    so, with where it tripped; a guard of ``max_rss_gb=0`` is off and never trips.

        guard = MemoryGuard(cfg.max_rss_gb)
        for name, tensor in tensors:                  # a long loop of one process (loading, exporting):
            guard.check(f"loading {name} from {file}")  # raises StoppedForMemory once over
        if guard.over("micro-batch 3 of 8"):          # where the processes must stop together: note it,
            ...                                       # agree at the next collective, then stop (the trainer)
    """

    CHECK_EVERY_S = 0.005  # check() reads at most this often (the high-water mark keeps a peak in between)

    def __init__(self, max_rss_gb: float):
        self.max_rss_gb = max_rss_gb
        self.limit = int(MEMORY_GUARD_AT * max_rss_gb * 2**30)  # bytes; 0: off
        self.tripped: str | None = None  # where the first reading at or over the limit was taken
        self.tripped_bytes = 0  # what that reading saw: the RSS, or the peak reached since the reading before
        self.peak = rss_and_peak_bytes()[1] if self.limit else 0  # the high-water mark at the last reading
        self.read_at = 0.0  # time.monotonic() of the last reading

    @property
    def active(self) -> bool:
        return self.limit > 0

    def over(self, where: str) -> bool:
        """Read RSS now (unless tripped already); True once it has reached the limit, here or at an earlier
        reading (``tripped`` keeps that one's ``where``)."""
        if not self.limit or self.tripped is not None:
            return self.tripped is not None
        rss, peak = rss_and_peak_bytes()
        self.read_at = time.monotonic()
        seen = max(rss, peak if peak > self.peak else 0)
        self.peak = max(self.peak, peak)
        if seen >= self.limit:
            self.tripped, self.tripped_bytes = where, seen
        return self.tripped is not None

    def check(self, where: str, change: str = "") -> None:
        """Raise ``StoppedForMemory`` once RSS has reached the limit. For long loops of one process where
        stopping at once loses nothing (loading a model, exporting one): it reads at most every
        ``CHECK_EVERY_S``, so calling it once per tensor costs next to nothing. Under ``accelerate launch``
        the process that raises exits with code 3 and the launcher stops the others.

        Args:
            where: what is being done, for the message ("loading decoder.block.5.layer.1.DenseReluDense.wo.weight
                from model-00002-of-00002.safetensors").
            change: what to change so that it fits (default: ``plan`` and a larger --max_rss_gb).
        """
        if self.limit and self.tripped is None and time.monotonic() - self.read_at < self.CHECK_EVERY_S:
            return
        if self.over(where):
            change = change or ("`python train_low_mem.py plan --budget_gb=...` lists memory modes that fit, or "
                                "raise --max_rss_gb")
            raise StoppedForMemory(f"memory guard: RSS {self.tripped_bytes / 2**30:.2f} GiB reached "
                                   f"{MEMORY_GUARD_AT:.0%} of --max_rss_gb={self.max_rss_gb:g} while {self.tripped}; "
                                   f"nothing was saved. {change}")


def free_memory() -> None:
    """Return freed Python objects, the heap they and freed tensors leave, and cached CUDA blocks
    (reference design: every N steps, each epoch, before and after evaluation)."""
    gc.collect()
    trim_heap()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def trim_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc ``malloc_trim``; elsewhere nothing).

    glibc keeps freed blocks resident for reuse, so after an evaluation (whose key/value cache grows
    a token at a time) or a training step the process held hundreds of MiB it no longer used (small,
    512-token rows, 4 beams: 1,072 MiB at the next evaluation's start, 668 trimmed). Trimming does
    not lower the peak within a phase; it keeps the RSS between phases what is live.
    """
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


SHARDED_MMAP_THRESHOLD = 2**20  # a small preset's attention matrix (512 x 512 float32) and up
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def map_large_blocks(threshold: int = SHARDED_MMAP_THRESHOLD) -> None:
    """Serve every C-heap block of ``threshold`` bytes or more with its own mapping, given back to the OS
    when freed (glibc ``mallopt(M_MMAP_THRESHOLD)``; elsewhere nothing).

    By default glibc raises that threshold to the size of each large block freed (up to 32 MiB), so
    blocks of that size come from the heap afterwards and stay resident once freed. A sharded process
    gathers and frees block-sized weights and gradients in every forward and backward: small preset,
    AdamW, FSDP on 2 CPU processes, 3 steps, peak RSS per process 1,538 MiB by default, 1,171 with a
    4 MiB threshold fixed, 1,158 with 1 MiB (the DDP run of the same steps: 1,710, and 1,665 with 1 MiB).
    Over 8 steps (bench/memory_modes.py's data) 1 MiB against 4 MiB: FSDP 1,233 against 1,310 MiB, ZeRO-3
    1,340 against 1,428 MiB, step time within 6 %.
    """
    if _LIBC is not None and hasattr(_LIBC, "mallopt"):
        _LIBC.mallopt(_M_MMAP_THRESHOLD, threshold)


def _glibc():
    import ctypes
    import ctypes.util
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


_LIBC = _glibc()


@contextlib.contextmanager
def replaced(owner, attribute: str, stand_in):
    """While inside, ``owner.attribute`` is ``stand_in``; the original is put back on the way out."""
    original = getattr(owner, attribute)
    setattr(owner, attribute, stand_in)
    try:
        yield
    finally:
        setattr(owner, attribute, original)


def import_while_replaced(name: str, owner, attribute: str, stand_in) -> None:
    """Import module ``name`` (once) while ``owner.attribute`` is ``stand_in``, then put the original back.

    For dependencies that import costly modules they need only for features this trainer never uses:
    the stand-in answers the question that import hangs on. If the module is not where it was (another
    library layout), nothing is replaced further and the library imports as it would.
    """
    if name in sys.modules:
        return
    with replaced(owner, attribute, stand_in):
        try:
            importlib.import_module(name)
        except ImportError:
            pass


@contextlib.contextmanager
def hidden(package: str):
    """While inside, the package ``package`` looks not installed; it shows again on the way out.

    For dependencies that import an optional package whenever it is installed, for features this
    trainer never uses: while hidden, ``importlib.util.find_spec(package)`` answers None and importing
    it fails. A package imported already stays as it is (hiding it then would change nothing).
    """
    if package in sys.modules:
        yield
        return
    sys.modules[package] = None  # what the import system reads as "not importable"
    try:
        yield
    finally:
        if sys.modules.get(package, ...) is None:
            del sys.modules[package]


def import_while_hidden(name: str, package: str) -> None:
    """Import module ``name`` (once) while the package ``package`` looks not installed (:func:`hidden`)."""
    if name in sys.modules:
        return
    with hidden(package):
        importlib.import_module(name)


def import_accelerate() -> None:
    """Import accelerate without boto3: -0.4 s and -9 MiB RSS per process where boto3 is installed.

    accelerate imports its ``accelerate config`` wizard's SageMaker questions at import time, and those
    import boto3 (with botocore) whenever it is installed; a training process never asks them.
    """
    import_while_hidden("accelerate", "boto3")


def import_extras(cfg) -> None:
    """Import the optional packages the run uses, where installed (peft without bitsandbytes, as
    ``lowmem.model.build.add_lora`` imports it; bitsandbytes for adamw8bit; optimum-quanto for 8-bit frozen
    weights; the libraries of --report_to's trackers). A missing one is refused where it is used, in one line.

    Raises:
        UserError: one is installed but fails to import (another version of its dependencies, say).
    """
    from config import QUANTIZED_DTYPES, UserError
    from lowmem.extras import installed
    from lowmem.monitoring.trackers import import_trackers

    import_trackers(cfg.report_to)
    for module, flag, used in (
            ("peft", "--lora_r", cfg.lora_r > 0),
            ("bitsandbytes", "--optimizer=adamw8bit", cfg.optimizer == "adamw8bit"),
            ("optimum.quanto", "--frozen_dtype", cfg.frozen_dtype in QUANTIZED_DTYPES)):
        if not used or not installed(module.split(".")[0]):
            continue
        try:
            with hidden("bitsandbytes") if module == "peft" else contextlib.nullcontext():
                importlib.import_module(module)
        except ImportError as err:
            package = {"optimum.quanto": "optimum-quanto"}.get(module, module)
            raise UserError(f"{flag} needs {package}, which is installed but fails to import ({err}); reinstall it "
                            f"for this environment: pip install --force-reinstall {package}") from None


def optional_import(module: str, flag: str):
    """Import an optional extra, or say in one line how to install it."""
    from config import UserError
    from lowmem.extras import optional_package_missing

    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(optional_package_missing(flag, module)) from None
