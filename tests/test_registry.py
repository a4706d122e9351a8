"""Every kind registers one way (``lowmem.utils.registry``), and what the floors below a family know of it agrees with
its classes: the precisions' names and dtypes (``config``'s), the trackers' files (a run folder's own entries)."""

from __future__ import annotations

import pytest

from config import TrainConfig
from data.objectives.base import Objective, registry
from lowmem.hardware.precision import PRECISIONS, Precision
from lowmem.monitoring.trackers import TRACKERS, Tracker, tracker_entries
from lowmem.parallel.engines import ENGINES, Engine, PlainEngine
from lowmem.utils import ownership
from lowmem.utils.eval_metrics import METRICS, Metric
from lowmem.utils.frozen_forms import FROZEN_FORMS, FrozenForm, frozen_form_problems
from lowmem.utils.precision_names import PRECISION_DTYPES, computes_in_half
from lowmem.utils.registry import Registered


def test_defining_a_named_subclass_registers_it_and_a_second_class_of_that_name_is_refused():
    class Kind(Registered, family=True):
        name = "root"

    class Shared(Kind):  # no name of its own: a base, not a kind
        pass

    class First(Shared):
        name = "first"

    assert Kind.kinds == {"root": Kind, "first": First} and Shared.kinds is Kind.kinds
    with pytest.raises(TypeError, match="two kinds are named 'first'"):
        type("Other", (Kind,), {"name": "first"})

    class Apart(Registered, family=True):  # another family keeps its own
        pass

    assert Apart.kinds == {}


def test_every_family_registers_through_the_one_hook_and_its_registry_is_the_roots():
    for root, kinds in ((Precision, PRECISIONS), (FrozenForm, FROZEN_FORMS), (Engine, ENGINES), (Tracker, TRACKERS),
                        (Metric, METRICS), (Objective, registry())):
        assert issubclass(root, Registered) and kinds == root.kinds, root
        assert kinds and all(kind.name == name and issubclass(kind, root) for name, kind in kinds.items()), root
    assert list(PRECISIONS) == ["no", "bf16", "fp16"]
    assert list(FROZEN_FORMS) == ["float32", "bfloat16", "int8", "float8"]
    assert list(ENGINES)[0] == "plain" and ENGINES["plain"] is PlainEngine  # recognised last: what is left
    assert "eval_loss" not in METRICS  # measured by every evaluation, no --eval_metrics choice


def test_the_precision_names_config_validates_with_are_the_precision_classes():
    assert {name: str(kind.dtype).removeprefix("torch.") for name, kind in PRECISIONS.items()} == PRECISION_DTYPES
    assert {name: kind.half for name, kind in PRECISIONS.items()} == {n: computes_in_half(n) for n in PRECISIONS}
    assert [kind.width for kind in PRECISIONS.values()] == [4, 2, 2]
    assert [kind.name for kind in PRECISIONS.values() if kind.scales_loss or kind.float32_wo] == ["fp16"]


def test_a_run_folder_owns_what_every_tracker_writes_there():
    entries = tracker_entries()
    assert {"tensorboard", "wandb", "mlflow.db"} <= set(entries)
    assert all(ownership.RUN_ENTRIES.fullmatch(name) for name in entries)
    assert ownership.OWN_ENTRIES["run"] is ownership.RUN_ENTRIES
    folders = [name for kind in TRACKERS.values() for name in kind.folders]
    assert folders and all(ownership.OWN_FOLDERS["run"].fullmatch(name) for name in folders)
    assert not ownership.RUN_ENTRIES.fullmatch("tensorboard2")  # names, not prefixes


def test_the_frozen_forms_answer_what_the_flags_ask():
    quantized = {name: kind.qtype for name, kind in FROZEN_FORMS.items() if kind.quantized}
    assert quantized == {"int8": "qint8", "float8": "qfloat8"}
    assert [name for name, kind in FROZEN_FORMS.items() if kind.narrow] == ["bfloat16", "int8", "float8"]
    assert [name for name, kind in FROZEN_FORMS.items() if kind.runs_under("fp16")] == ["float32"]
    lora = dict(is_finetune=True, lora_r=4, freeze="none")
    assert not frozen_form_problems(TrainConfig(frozen_dtype="bfloat16", mixed_precision="bf16", **lora))
    assert "needs frozen weights" in frozen_form_problems(TrainConfig(frozen_dtype="bfloat16", **lora))[0]
    assert frozen_form_problems(TrainConfig(frozen_dtype="int8", mixed_precision="fp16", **lora))[0] == \
        "--frozen_dtype=int8 does not run with --mixed_precision=fp16: use bf16"
    assert frozen_form_problems(TrainConfig(quantize_wo=True)) == ["--quantize_wo=True needs --frozen_dtype=int8 or "
                                                                   "float8"]
    assert frozen_form_problems(TrainConfig(frozen_dtype="float16"))[0].startswith("--frozen_dtype must be one of "
                                                                                  "float32, bfloat16, int8, float8")
