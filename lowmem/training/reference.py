"""DPO's reference policy (``--reference``), one class each, registered by its name: what gives each pair's
reference log-probabilities, the starting policy's.

- ``copy``: a frozen copy of the starting model, its matrices in ``--frozen_dtype`` (bf16, or 8 bits). One more
  model's memory.
- ``adapter``: with LoRA the starting policy is the base model itself: the policy with its adapters switched off.
  No second model; one more forward without a graph per micro-batch.
- ``cached``: a pre-pass over the training pairs (``lowmem.training.reference_cache``) stores every pair's
  reference log-probabilities in OUTPUT_DIR/reference; training reads them with the batch and holds no
  reference at all.
"""

from __future__ import annotations

import contextlib
import copy

import torch

from lowmem.model.answer_logprobs import answer_logprobs
from lowmem.utils.errors import UserError
from lowmem.utils.frozen_forms import FROZEN_FORMS
from lowmem.utils.registry import Registered


class Reference(Registered, family=True):
    """Gives the reference's (chosen, rejected) summed log-probabilities [B] of a preference micro-batch."""

    name = ""
    holds_model = True  # the run holds (or runs) a reference model beside the policy

    def __init__(self, ctx, model, core, data, say=print):
        self.ctx = ctx

    @classmethod
    def problem(cls, ctx) -> str | None:
        """Why this reference cannot run with the run's engine and flags (None: it can)."""
        return None

    def scores(self, model, core, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def eval_scores(self, model, core, batch: dict, examples: list) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's scores of an eval ``batch`` of ``examples`` (a model reference scores the batch)."""
        return self.scores(model, core, batch)

    def close(self) -> None:
        pass


def _split(sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = len(sums) // 2
    return sums[:half], sums[half:]


class CopyReference(Reference):
    """A frozen copy of the starting model in eval mode. The weights the policy keeps frozen (--freeze, LoRA's base)
    never change, so the copy shares them, as the policy stores them (--frozen_dtype: bf16 or 8 bits); it copies the
    trainable ones, their matrices in bf16 when --frozen_dtype is narrower than float32."""

    name = "copy"

    def __init__(self, ctx, model, core, data, say=print):
        super().__init__(ctx, model, core, data)
        shared = {id(p): p for p in core.parameters() if not p.requires_grad}  # (deepcopy's memo: not copied)
        self.model = copy.deepcopy(core, memo=shared).eval()
        copied = [(name, p) for name, p in self.model.named_parameters() if id(p) not in shared]
        for name, param in copied:
            param.requires_grad_(False)
            if FROZEN_FORMS[ctx.cfg.frozen_dtype].narrow and param.dim() == 2 and "relative_attention_bias" not in name:
                param.data = param.data.to(torch.bfloat16)
        if FROZEN_FORMS[ctx.cfg.frozen_dtype].narrow:
            from lowmem.model.narrow_compute import compute_beside_narrow

            compute_beside_narrow(self.model)  # (bf16 matrices in a float32 model, as the policy's frozen ones)

    @classmethod
    def problem(cls, ctx) -> str | None:
        if ctx.engine.shards:
            return ("--reference=copy keeps a whole copy of the model on every process, which a sharded engine "
                    "(FSDP, ZeRO) does not shard: use --reference=cached")
        return None

    @torch.no_grad()
    def scores(self, model, core, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        with self.ctx.precision.autocast(self.ctx.accelerator):
            sums, _ = answer_logprobs(self.model, self.model, batch, multiple=self.ctx.multiple,
                                      loss_chunk=self.ctx.cfg.loss_chunk_size)
        return _split(sums)

    def close(self) -> None:
        self.model = None


@contextlib.contextmanager
def adapters_off(core):
    """While inside, every LoRA layer of ``core`` computes its base layer alone (peft's own switch; its public
    ``enable_adapters`` would also change the adapters' requires_grad, which the optimizer and DDP were set up
    with)."""
    layers = [m for m in core.modules() if hasattr(m, "_disable_adapters")]
    before = [m._disable_adapters for m in layers]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer, was in zip(layers, before):
            layer._disable_adapters = was


class AdapterReference(Reference):
    """With LoRA: the policy itself with its adapters off (the starting policy: the adapters begin at zero)."""

    name = "adapter"
    holds_model = False

    @torch.no_grad()
    def scores(self, model, core, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.ctx.cfg
        with adapters_off(core), self.ctx.precision.autocast(self.ctx.accelerator):
            sums, _ = answer_logprobs(model, core, batch, cfg.frozen_encoder, self.ctx.multiple, cfg.loss_chunk_size)
        return _split(sums)


class CachedReference(Reference):
    """The pre-pass's log-probabilities, which the collator reads with each batch (``batch["reference"]``)."""

    name = "cached"
    holds_model = False

    def __init__(self, ctx, model, core, data, say=print):
        super().__init__(ctx, model, core, data)
        from data.tokenization import tokenizer_fingerprint
        from lowmem.training.reference_cache import open_reference_cache

        tokenizer_hash = tokenizer_fingerprint(data.collator.tokenizer)["tokenizer_json_sha1"]
        self.cache = open_reference_cache(ctx, model, core, data, tokenizer_hash, say)
        data.train_collator = copy.copy(data.collator)  # (the eval pairs' come from eval_scores)
        data.train_collator.reference = self.cache

    def scores(self, model, core, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        cached = batch["reference"].float()
        return cached[:, 0], cached[:, 1]

    def eval_scores(self, model, core, batch: dict, examples: list) -> tuple[torch.Tensor, torch.Tensor]:
        cached = self.cache.eval_logprobs(examples).to(self.ctx.device)
        return cached[:, 0], cached[:, 1]

    def close(self) -> None:
        self.cache.close()


REFERENCES = Reference.kinds


def reference_for(ctx, model, core, data, kind: str, say=print) -> Reference:
    """The run's reference of ``kind`` (the objective's resolved --reference); ``UserError`` when it cannot run."""
    made = REFERENCES[kind]
    problem = made.problem(ctx)
    if problem:
        raise UserError(problem)
    return made(ctx, model, core, data, say)
