"""The ``--mixed_precision`` names and the dtype each computes in, for the floors below ``lowmem.hardware``.

``config`` validates the flag with them, and ``lowmem.utils.frozen_forms`` tells from them which precisions a frozen
form runs under. The precisions themselves (one class each, registered under these names, asked everywhere else) are
``lowmem.hardware.precision``'s; tests/test_precision.py checks that the two agree.
"""

from __future__ import annotations

# --mixed_precision -> the dtype its matrix products compute in (float32: no autocast)
PRECISION_DTYPES = {"no": "float32", "bf16": "bfloat16", "fp16": "float16"}


def precision_choices() -> str:
    """``no, bf16 or fp16``: the names, as a message lists them."""
    names = list(PRECISION_DTYPES)
    return f"{', '.join(names[:-1])} or {names[-1]}"


def computes_in_half(name: str) -> bool:
    """Whether --mixed_precision=``name`` computes its products in 16 bits (``Precision.half``, without torch)."""
    return PRECISION_DTYPES[name] != "float32"
