"""The optional packages (``pip install '.[gpu]'``, ``'.[quant]'``, ...): whether one is installed, checked without
importing it, and the one line that says how to install a missing one."""

from __future__ import annotations

import importlib.util


def optional_package_missing(flag: str, module: str, extra: str = "gpu") -> str:
    return f"{flag} needs the optional package {module}: pip install '.[{extra}]' (or pip install {module})"


def installed(module: str) -> bool:
    """Whether an optional package can be imported (checked without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: a module blocked in sys.modules
        return False
