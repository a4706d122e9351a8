"""The ``Objective`` interface, and the registry that finds every objective of this package.

An objective is one subclass of ``Objective`` with a ``name``, in a module of its own in ``data/objectives/``:
defining the class registers it (``lowmem.utils.registry``), and ``registry()`` imports every module of
the package before answering, so a new file is all a new objective takes. Code elsewhere asks the objective
(``objective_for(cfg)``, or before one can be made ``objective_class(name)``): what it reads, whether it takes
prepared shards, which flags it leaves unread, what its flags must satisfy, how its examples look.

    from data.objectives.base import objective_for
    objective = objective_for(cfg)                       # the --objective of cfg
    files = check_data(cfg, objective)                   # reads objective.columns(...), .formats
    collator = objective.collator(tokenizer)             # its micro-batches
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from config import TrainConfig
from data.sources.corpus import FORMATS, Example
from lowmem.utils.errors import UserError
from lowmem.utils.eval_metrics import metric_named
from lowmem.utils.registry import Registered

if TYPE_CHECKING:  # imported where a collator is made: it needs torch
    from data.collate import Seq2SeqCollator

class Objective(Registered, family=True):
    """What turns the rows a stream reads into ``(input_ids, labels)`` examples, and what a run must know of it.

    Class attributes are read before an objective is made (validation, the flags' notes, the files to list);
    an instance is made from a validated config (``objective_for``) and may raise ``UserError`` for what
    only its derived lengths show.
    """

    name: ClassVar[str] = ""  # --objective=NAME; a class without one (a shared base) is not registered
    summary: ClassVar[str] = ""  # one line for --help
    formats: ClassVar[tuple[str, ...]] = FORMATS  # the file endings it reads (data.sources.corpus)
    prepared_data: ClassVar[bool] = False  # whether it reads the token-id shards of `prepare`
    unused_flags: ClassVar[tuple[str, ...]] = ()  # flags it never reads: given, a note says so
    trained_with: ClassVar[tuple[str, ...]] = ()  # flags its eval examples depend on (evaluate adopts a model's)
    # What the planner and the start-up log read:
    chunk_length = 0  # tokens per packed chunk (0: rows are examples, nothing is packed)
    fixed_lengths: tuple[int, int] | None = None  # (input, target) tokens of every example, when fixed
    packs: ClassVar[bool] = False  # whether --packing=True packs its examples several to a row (data.packing)
    reference_models = 0  # models it holds beside the one it trains (the planner prices them)
    preference: ClassVar[bool] = False  # rows of preference pairs, trained by a pair loss (objectives.preference)
    noun = "rows"  # what a training row is in the log: rows, or documents packed into chunks
    example_noun = "rows"  # what an eval example is: a row, or a chunk

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.max_source_len, self.max_target_len = cfg.max_source_len, cfg.max_target_len

    @classmethod
    def problems(cls, cfg: TrainConfig) -> list[str]:
        """One line per mistake in the flags this objective reads (added to the config's validation)."""
        return []

    @classmethod
    def text_columns(cls, cfg: TrainConfig) -> tuple[str, ...]:
        """The text columns its rows are read from (the eval set's, the tokenizer's training text)."""
        raise NotImplementedError

    @property
    def longest(self) -> tuple[int, int] | None:
        """(input, target) tokens of the longest example when it bounds them (None: the flags' limits)."""
        return self.fixed_lengths

    def describe(self) -> str:
        """The examples' shape for the start-up log ("" when the rows say it all)."""
        return ""

    def columns(self, prepared: dict | None) -> tuple[str, ...]:
        """The columns a training stream reads (``prepared``: the manifest of prepared shards, or None)."""
        return self.text_columns(self.cfg)

    def collator(self, tokenizer, pad_multiple: int = 1) -> Seq2SeqCollator:
        """Its micro-batches: each side padded to its micro-batch's longest row; with --packing=True, several
        examples to a row (``data.packing``)."""
        from data.collate import Seq2SeqCollator
        from data.packing import PackingCollator

        made = PackingCollator if self.cfg.packing else Seq2SeqCollator
        return made(tokenizer, self.max_source_len, self.max_target_len, pad_multiple)

    def stream(self, documents, tokenizer):
        """The training stream of examples made from this process's stream of rows (``data.streams``)."""
        raise NotImplementedError

    def eval_examples(self, rows: list[Example], tokenizer, limit: int) -> list[Example]:
        """The eval examples made from the eval rows (at most ``limit``)."""
        raise NotImplementedError


def registry() -> dict[str, type[Objective]]:
    """Every objective by name, sorted by name (not by definition: which module a process imported first would
    change that order, and with it --help and docs/options.md). Every module of this package is imported first (a
    module whose name starts with ``_`` is private: skipped)."""
    _import_package_modules()
    return {name: Objective.kinds[name] for name in sorted(Objective.kinds)}


@cache
def _import_package_modules() -> None:
    """Once per process: defining their classes registers them."""
    package = __name__.rpartition(".")[0]
    for module in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if not module.name.startswith("_"):
            importlib.import_module(f"{package}.{module.name}")


def unknown_objective(name) -> str:
    return f"--objective must be one of {', '.join(registry())} (got {name!r})"


def objective_class(name: str) -> type[Objective]:
    """The objective class named ``name`` (``--objective``); ``UserError`` for an unknown one."""
    found = registry().get(name)
    if found is None:
        raise UserError(unknown_objective(name))
    return found


def objective_problems(cfg: TrainConfig) -> list[str]:
    """The objective's share of the config's validation: an unknown name, or its flags' mistakes."""
    found = registry().get(cfg.objective)
    if found is None:
        return [unknown_objective(cfg.objective)]
    packing = []
    if cfg.packing and not found.packs:
        packing.append(f"--packing=True packs {', '.join(n for n, c in registry().items() if c.packs)} examples; "
                       f"--objective={cfg.objective}'s rows are whole chunks already: leave --packing out")
    if cfg.packing and cfg.encoder_cache != "off":
        packing.append("--packing=True does not run with --encoder_cache (its micro-batches are one example per row): "
                       "leave one of them out")
    best = metric_named(cfg.metric_for_best)
    if best is not None and best.preference_only and not found.preference:
        packing.append(f"--metric_for_best={cfg.metric_for_best} is measured on preference pairs: it needs "
                       "--objective=dpo, orpo or simpo")
    return packing + found.problems(cfg)


def objective_for(cfg: TrainConfig) -> Objective:
    """The objective a run trains with (``--objective``)."""
    return objective_class(cfg.objective)(cfg)
