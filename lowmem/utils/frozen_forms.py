"""How ``--frozen_dtype`` holds the frozen weight matrices: one class per form, registered by its name.

- ``FrozenForm`` (float32): as loaded.
- ``BFloat16Form`` (bfloat16): every frozen matrix in bf16, used inside bf16 autocast only.
- ``Int8Form`` / ``Float8Form`` (int8, float8): the frozen blocks' linear layers in 8 bits with optimum-quanto
  (``lowmem.model.quantize``), their scales in the compute dtype; the other frozen matrices in bf16.

Code elsewhere asks the run's form, ``FROZEN_FORMS[cfg.frozen_dtype]`` (the model's builders, the planner, the
encoder cache, the engines, the plan's search, the checks of a resumed run), and never compares its name
(tests/test_code_layout.py). Adding a form: one subclass here with its ``name`` (``lowmem.utils.registry``).
On the ground floor because ``config`` validates the flag with it (``frozen_form_problems``).
"""

from __future__ import annotations

from lowmem.utils.optional import installed, optional_package_missing
from lowmem.utils.precision_names import PRECISION_DTYPES
from lowmem.utils.registry import Registered


class FrozenForm(Registered, family=True):
    """Float32 (``--frozen_dtype=float32``, the default): the frozen weights stay as loaded."""

    name = "float32"
    narrow = False  # holds frozen matrices below float32: bf16, or 8 bits for the blocks' linear layers
    quantized = False  # stores the frozen blocks' linear layers in 8 bits (``lowmem.model.quantize``)
    qtype: str | None = None  # optimum.quanto's weight type (a quantized form's)
    module: str | None = None  # the optional package it imports
    compute_dtypes: tuple[str, ...] | None = None  # the dtypes of the precisions it runs under (None: any)
    recommended = True  # ``plan --budget_gb`` tries it

    @classmethod
    def runs_under(cls, mixed_precision: str) -> bool:
        """Whether it runs under ``--mixed_precision`` (by the dtype that precision computes in)."""
        return cls.compute_dtypes is None or PRECISION_DTYPES.get(mixed_precision) in cls.compute_dtypes

    @classmethod
    def problem(cls, cfg) -> str | None:
        """The first of ``cfg``'s flags it does not run with, in one line; None when it runs."""
        return None


class BFloat16Form(FrozenForm):
    """bf16 storage of every frozen matrix (the shared embedding, the encoder; with LoRA the base decoder too)."""

    name = "bfloat16"
    narrow = True
    compute_dtypes = ("bfloat16",)  # bf16 weights are only used inside bf16 autocast

    @classmethod
    def problem(cls, cfg) -> str | None:
        if (cfg.freeze != "none" or cfg.lora_r) and cls.runs_under(cfg.mixed_precision):
            return None
        return ("--frozen_dtype=bfloat16 needs frozen weights (--is_finetune=True, --freeze=encoder or embeddings, or "
                "--lora_r) and --mixed_precision=bf16 (bf16 weights are only used inside bf16 autocast)")


class QuantizedForm(FrozenForm):
    """8-bit frozen linear layers (optimum-quanto) in the frozen blocks; the other frozen matrices in bf16."""

    narrow = quantized = True
    module = "optimum.quanto"
    compute_dtypes = ("float32", "bfloat16")  # the scales' dtype, so their products' (float16 is not one)

    @classmethod
    def problem(cls, cfg) -> str | None:
        if not cls.runs_under(cfg.mixed_precision):
            return f"--frozen_dtype={cls.name} does not run with --mixed_precision={cfg.mixed_precision}: use bf16"
        if cfg.freeze != "encoder" and not cfg.lora_r:
            return (f"--frozen_dtype={cls.name} quantizes frozen linear layers and this run has none: use it with "
                    "--is_finetune=True and --freeze=encoder, or with --lora_r")
        if not installed(cls.module):
            return optional_package_missing(f"--frozen_dtype={cls.name}", "optimum-quanto", "quant")
        return None


class Int8Form(QuantizedForm):
    """int8 weights with a scale per output row."""

    name, qtype = "int8", "qint8"


class Float8Form(QuantizedForm):
    """float8 (e4m3) weights with a scale per output row."""

    name, qtype = "float8", "qfloat8"
    recommended = False  # the same bytes as int8's: the plan tries int8 only


FROZEN_FORMS: dict[str, type[FrozenForm]] = FrozenForm.kinds  # --frozen_dtype -> its class


def frozen_form_problems(cfg) -> list[str]:
    """What is wrong with ``--frozen_dtype`` and ``--quantize_wo`` (``config``'s validation collects them)."""
    form = FROZEN_FORMS.get(cfg.frozen_dtype)
    if form is None:
        return [f"--frozen_dtype must be one of {', '.join(FROZEN_FORMS)} (got {cfg.frozen_dtype!r})"]
    problem = form.problem(cfg)
    problems = [problem] if problem else []
    if cfg.quantize_wo and not form.quantized:
        quantized = [name for name, kind in FROZEN_FORMS.items() if kind.quantized]
        problems.append(f"--quantize_wo=True needs --frozen_dtype={' or '.join(quantized)}")
    return problems
