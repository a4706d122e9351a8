"""Each answer's summed token log-probability under the model, for preference pairs: the prompts encoded once, both
answers decoded against the same encoder output.

A preference micro-batch (``data.collate.PreferenceCollator``) holds B prompts and 2B answer rows
(chosen, then rejected). The model is called once through its wrapper (DDP, FSDP and DeepSpeed see one ordinary
forward) with the prompts' rows given twice; a pre-hook on the encoder keeps only the first B rows and a hook on
its output repeats the B results, so the encoder runs once per prompt and its gradient is the sum of both
answers'. A frozen encoder (or the encoder cache's states) runs outside, once per prompt, as in SFT. The LM head
gives each target token's log-probability, a chunk of tokens at a time (``lowmem.model.chunked_logprobs``).
"""

from __future__ import annotations

import contextlib

import torch

from lowmem.model.chunked_logprobs import logprobs_at_head, logprobs_from_logits
from lowmem.model.chunked_loss import chunk_rows
from lowmem.model.loss import encoder_states_given, logits_only_at, target_index
from lowmem.utils.presets import AUTO


def answer_logprobs(model, core, batch: dict, frozen_encoder: bool = False, multiple: int = 1,
                    loss_chunk: int | str = AUTO) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probability of each answer row [2B], float32; target tokens of each row [2B]) of a preference
    micro-batch placed on its device (``lowmem.model.loss.batch_to_device``). ``model``: what to call (possibly
    wrapped); ``core``: the plain T5 inside. Rows without targets (padding pairs) sum to 0."""
    labels = batch["labels"]
    prompts, rows = len(batch["attention_mask"]), len(labels)
    index = batch["target_index"] if "target_index" in batch else target_index(labels, multiple)
    mask = batch["attention_mask"].repeat(rows // prompts, 1)
    decoder = dict(attention_mask=mask, decoder_input_ids=core._shift_right(labels), use_cache=False)
    encoded = encoder_states_given(model, core, batch, frozen_encoder, multiple)  # (None: the forward runs it)
    targets = labels.flatten().index_select(0, index)
    chunk = chunk_rows(core.lm_head, loss_chunk)
    with contextlib.ExitStack() as inside:
        inside.enter_context(logprobs_at_head(core, index, targets, chunk) if chunk is not None
                             else logits_only_at(core, index))
        if encoded is None:
            inside.enter_context(_encoder_once(core, prompts, rows))
            out = model(input_ids=batch["input_ids"].repeat(rows // prompts, 1), **decoder)
        else:
            from transformers.modeling_outputs import BaseModelOutput

            repeated = torch.cat([encoded] * (rows // prompts))
            out = model(encoder_outputs=BaseModelOutput(last_hidden_state=repeated), **decoder)
    token_logprobs = out.logits if chunk is not None else logprobs_from_logits(out.logits, targets)
    sums = torch.zeros(rows, dtype=torch.float32, device=labels.device)
    sums = sums.index_add(0, torch.div(index, labels.shape[1], rounding_mode="floor"), token_logprobs.float())
    return sums, labels.ne(-100).sum(dim=1)


@contextlib.contextmanager
def _encoder_once(core, prompts: int, rows: int):
    """While inside, the encoder computes only the first ``prompts`` rows it is given and returns each result
    ``rows // prompts`` times (each prompt's answers read its one encoder output; its gradient sums theirs)."""
    times = rows // prompts

    def first_rows(_module, args, kwargs):
        kwargs = {k: (v[:prompts] if torch.is_tensor(v) and v.dim() and len(v) == rows else v)
                  for k, v in kwargs.items()}
        return tuple(a[:prompts] if torch.is_tensor(a) and a.dim() and len(a) == rows else a for a in args), kwargs

    def repeated(_module, _args, output):
        if isinstance(output, tuple):
            return (torch.cat([output[0]] * times), *output[1:])
        output.last_hidden_state = torch.cat([output.last_hidden_state] * times)
        return output

    handles = [core.encoder.register_forward_pre_hook(first_rows, with_kwargs=True),
               core.encoder.register_forward_hook(repeated)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
