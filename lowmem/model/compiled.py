"""``--torch_compile=True``: T5's encoder and decoder stacks compiled for training (regional compilation), each
graph specialised to one length bucket.

- **What is compiled**: the two ``T5Stack`` forwards, through two functions of our own (``_encoder_stack``,
  ``_decoder_stack``: dynamo keeps its compiled graphs per function, so each stack's count is its own). The LM head
  and the loss stay eager: they run at the target tokens only (``lowmem.model.loss``), whose number changes with
  every micro-batch, and the head is one large matrix product that compiling does not speed up. Evaluation,
  generation and a frozen encoder (no gradient) run eager as before.
- **Shapes**: the collator pads training micro-batches to length buckets (``data.collate.length_buckets``: 16,
  32, 64, ... and the longest). The encoder's graphs are specialised to the source bucket, the decoder's to the
  (source, target) pair of buckets; the number of rows is dynamic (one graph serves them all, a single row
  included: ``backed_size_oblivious``). So each stack compiles once per bucket it meets, and never again. (A
  decoder dynamic in its source length too, one graph per target bucket, fails inductor's stride checks in
  torch 2.13 when the source bucket changes.)
- **Exact**: random ops run as in eager mode (inductor's ``fallback_random``), so dropout draws the masks an
  eager run draws and resume stays exact; the loss matches eager's within float rounding
  (tests/test_compile.py).

The dynamo and inductor settings are process-wide; the trainer owns its process.
"""

from __future__ import annotations

import torch


def _encoder_stack(forward, kwargs: dict):
    return forward(**kwargs)


def _decoder_stack(forward, kwargs: dict):
    return forward(**kwargs)


RUNNERS = {"encoder": _encoder_stack, "decoder": _decoder_stack}


def backend_problems(backend: str) -> list[str]:
    """--torch_compile_backend's problem, if it names no torch.compile backend (checked only with --torch_compile:
    dynamo takes seconds to import)."""
    import torch._dynamo

    if backend in torch._dynamo.list_backends(exclude_tags=()):
        return []
    return [f"--torch_compile_backend must be a torch.compile backend: {', '.join(torch._dynamo.list_backends())} "
            f"or aot_eager (got {backend!r})"]


def configure_dynamo(buckets: int) -> None:
    """Process-wide settings for graphs that are static in their length bucket and dynamic in the rest."""
    import torch._dynamo
    import torch._inductor.config
    import torch.fx.experimental._config

    torch._dynamo.config.automatic_dynamic_shapes = False  # a new bucket gets a graph of its own, not a dynamic one
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, buckets ** 2)  # decoder's pairs
    torch.fx.experimental._config.backed_size_oblivious = True  # one row is no special case (no graph of its own)
    torch._inductor.config.fallback_random = True  # dropout draws eager's masks from the same generator


class CompiledStacks:
    """The compiled stacks of one model, and what they have compiled so far (for the train records)."""

    def __init__(self, wanted: bool, backend: str = "inductor"):
        self.wanted, self.backend = wanted, backend  # --torch_compile, --torch_compile_backend
        self.buckets: set[tuple] = set()  # (stack, source length[, target length]) met
        self.installed = False
        self.say = print

    def install(self, core, buckets: tuple[int, ...], say=print) -> None:
        """With --torch_compile, compile ``core``'s encoder and decoder stacks for training (``buckets``: the
        collator's length buckets). After accelerate's wrapping, which keeps the plain model's stacks."""
        if not self.wanted:
            return
        configure_dynamo(len(buckets))
        self.say = say
        for name, runner in RUNNERS.items():
            stack = getattr(core, name)
            stack.forward = StackRunner(name, stack, stack.forward, torch.compile(runner, backend=self.backend), self)
        self.installed = True

    def met(self, bucket: tuple) -> None:
        if bucket not in self.buckets:
            self.buckets.add(bucket)
            lengths = " and ".join(f"{side} length {n}" for side, n in zip(("source", "target"), bucket[1:]))
            self.say(f"torch.compile: compiling the {bucket[0]} for {lengths} (once per length bucket)")

    def graphs(self) -> int:
        """Graphs dynamo has compiled for the two stacks (each function keeps its own; dynamo's count of all graphs in
        the process where torch lacks the per-function listing)."""
        from torch._dynamo import eval_frame, utils

        entries = getattr(eval_frame, "_debug_get_cache_entry_list", None)
        if entries is None:
            return int(utils.counters["stats"]["unique_graphs"])
        return sum(len(entries(runner.__code__)) for runner in RUNNERS.values())

    def log_fields(self) -> dict:
        """For each train record: the length buckets met and the graphs compiled (equal when nothing recompiled)."""
        if not self.installed:
            return {}
        return {"compiled_buckets": len(self.buckets), "compiled_graphs": self.graphs()}


class StackRunner:
    """A stack's ``forward`` while compiled: training forwards with a gradient go through the compiled function,
    everything else (evaluation, generation, a frozen encoder) through the stack's own forward."""

    def __init__(self, name: str, stack, forward, compiled, owner: CompiledStacks):
        self.name, self.stack, self.forward, self.compiled, self.owner = name, stack, forward, compiled, owner

    def __call__(self, **kwargs):
        if not (self.stack.training and torch.is_grad_enabled()):
            return self.forward(**kwargs)
        from torch._dynamo import maybe_mark_dynamic

        for value in kwargs.values():
            if isinstance(value, torch.Tensor) and value.dim() >= 2:
                maybe_mark_dynamic(value, 0)  # rows (left static where a frame specialises them)
        states = kwargs.get("encoder_hidden_states")  # (the decoder's)
        lengths = (states.shape[1],) if states is not None else ()
        self.owner.met((self.name, *lengths, kwargs["input_ids"].shape[1]))
        return self.compiled(self.forward, kwargs)
