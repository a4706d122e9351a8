"""Memory probes and hygiene.

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
    ``lowmem.modeling.add_lora`` imports it; bitsandbytes for adamw8bit; optimum-quanto for 8-bit frozen
    weights; tensorboard for --report_to). A missing one is refused where it is used, in one line.

    Raises:
        UserError: one is installed but fails to import (another version of its dependencies, say).
    """
    from config import QUANTIZED_DTYPES, UserError, installed

    for module, flag, used in (
            ("peft", "--lora_r", cfg.lora_r > 0),
            ("bitsandbytes", "--optimizer=adamw8bit", cfg.optimizer == "adamw8bit"),
            ("optimum.quanto", "--frozen_dtype", cfg.frozen_dtype in QUANTIZED_DTYPES),
            ("torch.utils.tensorboard", "--report_to=tensorboard", cfg.report_to == "tensorboard")):
        if not used or not installed(module.split(".")[0]):
            continue
        try:
            with hidden("bitsandbytes") if module == "peft" else contextlib.nullcontext():
                importlib.import_module(module)
        except ImportError as err:
            package = {"optimum.quanto": "optimum-quanto", "torch.utils.tensorboard": "tensorboard"}.get(module, module)
            raise UserError(f"{flag} needs {package}, which is installed but fails to import ({err}); reinstall it "
                            f"for this environment: pip install --force-reinstall {package}") from None


def optional_import(module: str, flag: str):
    """Import an optional extra, or say in one line how to install it."""
    from config import UserError, optional_package_missing

    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(optional_package_missing(flag, module)) from None
