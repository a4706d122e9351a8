"""The optional packages (``pip install '.[gpu]'``, ``'.[quant]'``, ...): whether one is installed, checked without
importing it, the one line that says how to install a missing one, and imports that leave out what a dependency
would pull in for features this trainer never uses (``import_accelerate``: no boto3)."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import sys

from lowmem.utils.errors import UserError


def optional_package_missing(flag: str, module: str, extra: str = "gpu") -> str:
    return f"{flag} needs the optional package {module}: pip install '.[{extra}]' (or pip install {module})"


def installed(module: str) -> bool:
    """Whether an optional package can be imported (checked without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: a module blocked in sys.modules
        return False


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
    """Import the optional packages the run uses (``cfg.optional_modules()``: peft without bitsandbytes, as
    ``lowmem.model.build.add_lora`` imports it; bitsandbytes for adamw8bit; optimum-quanto for 8-bit frozen
    weights), where installed. A missing one is refused where it is used, in one line; --report_to's trackers
    are imported by ``lowmem.monitoring.trackers.import_trackers``.

    Raises:
        UserError: one is installed but fails to import (another version of its dependencies, say).
    """
    for module, flag in cfg.optional_modules():
        if not installed(module.split(".")[0]):
            continue
        try:
            with hidden("bitsandbytes") if module == "peft" else contextlib.nullcontext():
                import_quietly(module)
        except ImportError as err:
            package = {"optimum.quanto": "optimum-quanto"}.get(module, module)
            raise UserError(f"{flag} needs {package}, which is installed but fails to import ({err}); reinstall it "
                            f"for this environment: pip install --force-reinstall {package}") from None


# What a package reaches for at import time for a feature this trainer never uses: bitsandbytes (0.50), on a CPU
# with AVX512-BF16, fetches a 4-bit matrix kernel from the hub (``kernels.get_kernel``: code downloaded and run) and
# logs a warning when it cannot (offline, or a publisher it cannot verify). The trainer uses its 8-bit AdamW only:
# while it imports, the fetch fails at once, and its warning, the one line on stderr of a healthy run, is not shown.
IMPORTED_WITHOUT = {"bitsandbytes": ("kernels", "get_kernel")}


def _not_fetched(*_args, **_kwargs):
    raise ImportError("not fetched: t5-lowmem does not use this kernel")


def import_quietly(module: str):
    """Import ``module``; for a package in ``IMPORTED_WITHOUT``, without what it names, its warnings unshown."""
    package = module.split(".")[0]
    if package not in IMPORTED_WITHOUT or module in sys.modules:
        return importlib.import_module(module)
    reached, attribute = IMPORTED_WITHOUT[package]
    log = logging.getLogger(package)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        if reached in sys.modules:  # (transformers imports kernels)
            with replaced(sys.modules[reached], attribute, _not_fetched):
                return importlib.import_module(module)
        with hidden(reached):
            return importlib.import_module(module)
    finally:
        log.setLevel(level)


def optional_import(module: str, flag: str):
    """Import an optional extra, or say in one line how to install it."""
    try:
        return import_quietly(module)
    except ImportError:
        raise UserError(optional_package_missing(flag, module)) from None
