"""lowmem.monitoring.flops: the FLOPs counted from a T5's shapes equal what torch's ``FlopCounterMode`` counts while
the trainer's own loss (``token_loss_sum``) and its backward run one micro-batch, in every memory mode.

The models attend with transformers' eager attention, whose products are plain matrix products that
``FlopCounterMode`` sees one by one, gradient by gradient; the last tests take the trainer's default (SDPA), whose
fused CPU kernel torch 2.13's counter does not know (docs/mfu.md).
"""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from data.collate import pad
from data.packing import PackingCollator
from lowmem.cli.flags import load_config
from lowmem.model.build import ready_to_train, untie_head
from lowmem.model.loss import batch_to_device, token_loss_sum
from lowmem.monitoring.flops import StepFlops

VOCABULARY = 384
ALL_LINEAR = "q,k,v,o,wi,wo"


def tiny_t5(feed_forward: str = "gated-gelu", tied: bool = False, attention: str = "eager", dropout: float = 0.0):
    """d_model 32 and heads x d_kv 24 differ, as do the 2 encoder and 3 decoder layers: a count that mixed them
    up would be off."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(vocab_size=VOCABULARY, d_model=32, d_ff=48, d_kv=8, num_heads=3, num_layers=2,
                      num_decoder_layers=3, feed_forward_proj=feed_forward, dropout_rate=dropout, pad_token_id=0,
                      eos_token_id=1, decoder_start_token_id=0, attn_implementation=attention)
    model = T5ForConditionalGeneration(config)
    if not tied:
        untie_head(model)
    return model


def ready(model, **flags):
    """The model in the trainer's training form for ``flags`` (``ready_to_train``: freezing, LoRA, checkpointing,
    8-bit weights), in its training modes; returns it and whether its encoder is frozen."""
    cfg, problems = load_config({"is_finetune": True, "init_from": "unused", "freeze": "none", **flags})
    assert not problems
    model, _ = ready_to_train(model, cfg)
    model.train()
    if cfg.frozen_encoder:
        model.encoder.eval()  # as the trainer runs it
    return model, cfg.frozen_encoder


def token_rows(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCABULARY) for _ in range(n)] for n in lengths]


def a_batch(sources: list[int], targets: list[int], multiple: int = 1) -> dict:
    """A collated micro-batch of rows of these lengths, padded as the collator pads (``data.collate.pad``)."""
    ids, mask = pad(token_rows(sources, 1), 0, multiple)
    return {"input_ids": ids, "attention_mask": mask, "labels": pad(token_rows(targets, 2), -100, multiple)[0]}


UNEVEN = ([9, 23, 4], [17, 5, 11])  # rows of different lengths, sources and targets unlike each other


def counted(model, batch: dict, frozen_encoder: bool, multiple: int = 1, loss_chunk=0, mapping=None) -> int:
    """FlopCounterMode's total over the trainer's forward (``token_loss_sum``) and backward of ``batch``."""
    model.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False, custom_mapping=mapping or {}) as counter:
        loss = token_loss_sum(model, model, batch_to_device(batch, "cpu", multiple), frozen_encoder=frozen_encoder,
                              multiple=multiple, loss_chunk=loss_chunk)
        loss.backward()
    return counter.get_total_flops()


def relative_error(model, batch: dict, frozen_encoder: bool, gradient_checkpointing: bool = False,
                   multiple: int = 1, loss_chunk=0) -> float:
    flops = StepFlops.of(model, gradient_checkpointing)
    predicted = flops.micro_batch(batch, frozen_encoder, multiple) + flops.recomputed(batch, frozen_encoder, multiple)
    measured = counted(model, batch, frozen_encoder, multiple, loss_chunk)
    error = abs(predicted - measured) / measured
    print(f"counted {measured:,} predicted {predicted:,} relative error {error:.2e}")
    return error


MODES = {  # name: (feed-forward, tied head, --flags)
    "full gated-gelu untied": ("gated-gelu", False, {}),
    "full relu tied": ("relu", True, {}),
    "freeze=encoder": ("gated-gelu", False, {"freeze": "encoder"}),
    "freeze=encoder relu tied": ("relu", True, {"freeze": "encoder"}),
    "freeze=embeddings": ("gated-gelu", False, {"freeze": "embeddings"}),
    "freeze=embeddings tied": ("relu", True, {"freeze": "embeddings"}),
    "lora q,v freeze=encoder": ("gated-gelu", False, {"freeze": "encoder", "lora_r": 4}),
    "lora all freeze=encoder": ("gated-gelu", False, {"freeze": "encoder", "lora_r": 4,
                                                      "lora_target_modules": ALL_LINEAR}),
    "lora q,v freeze=none": ("gated-gelu", False, {"lora_r": 4}),
    "lora all freeze=none": ("relu", True, {"lora_r": 4, "lora_target_modules": ALL_LINEAR}),
}


@pytest.mark.parametrize("loss_chunk", [0, 7], ids=["whole logits", "chunked loss"])
@pytest.mark.parametrize("mode", MODES)
def test_counted_from_shapes_equals_flop_counter(mode, loss_chunk):
    feed_forward, tied, flags = MODES[mode]
    model, frozen = ready(tiny_t5(feed_forward, tied), **flags)
    assert relative_error(model, a_batch(*UNEVEN), frozen, loss_chunk=loss_chunk) < 1e-9


@pytest.mark.parametrize("mode", ["full gated-gelu untied", "freeze=encoder", "lora q,v freeze=encoder"])
def test_lengths_and_targets_rounded_up_to_a_multiple(mode):
    # bf16 on the CPU: lengths padded to 16 by the collator, target positions (and a frozen encoder's rows) by
    # the trainer; the source here is longer than the target and the other way round
    feed_forward, tied, flags = MODES[mode]
    model, frozen = ready(tiny_t5(feed_forward, tied), **flags)
    for sources, targets in (UNEVEN, ([30, 3], [2, 7])):
        assert relative_error(model, a_batch(sources, targets, 16), frozen, multiple=16) < 1e-9
    if frozen:  # each row alone, at its length rounded up: 9, 23, 4 -> 16, 32, 16
        assert StepFlops.terms(a_batch(*UNEVEN, 16), frozen, 16)[:2] == (64, 16 * 16 + 32 * 32 + 16 * 16)


@pytest.mark.parametrize("mode", ["freeze=encoder", "lora all freeze=encoder"])
def test_a_batch_from_the_encoder_cache_runs_no_encoder(mode):
    feed_forward, tied, flags = MODES[mode]
    model, frozen = ready(tiny_t5(feed_forward, tied), **flags)
    batch = a_batch(*UNEVEN)
    torch.manual_seed(3)
    cached = {"encoder_hidden_states": torch.randn(*batch["input_ids"].shape, 32),
              "attention_mask": batch["attention_mask"], "labels": batch["labels"]}
    assert relative_error(model, cached, frozen) < 1e-9
    flops = StepFlops.of(model)
    assert flops.terms(cached, frozen)[:2] == (0, 0)  # no encoder tokens
    assert flops.micro_batch(cached, frozen) < flops.micro_batch(batch, frozen)


@pytest.mark.parametrize("mode", ["full gated-gelu untied", "freeze=encoder", "lora q,v freeze=none"])
def test_packed_rows(mode, tokenizer):
    feed_forward, tied, flags = MODES[mode]
    model, frozen = ready(tiny_t5(feed_forward, tied), **flags)
    sources, targets = token_rows([5, 9, 3, 12, 7, 4], 4), token_rows([6, 2, 8, 3, 5, 9], 5)
    batch = PackingCollator(tokenizer, 24, 20).packed_window(sources, targets, batch_size=4)[0]
    assert batch["source_segments"].amax(dim=1).gt(1).any()  # several examples to a row
    assert relative_error(model, batch, frozen) < 1e-9
    if frozen:  # the frozen encoder runs each example alone: its terms are the examples' lengths
        assert StepFlops.of(model).terms(batch, frozen)[:2] == (40, sum(n * n for n in [5, 9, 3, 12, 7, 4]))


@pytest.mark.parametrize("dropout", [0.0, 0.1])  # with dropout after a block's last product it is recomputed too
@pytest.mark.parametrize("mode", ["full gated-gelu untied", "freeze=encoder", "freeze=embeddings",
                                  "lora q,v freeze=encoder", "lora all freeze=none"])
def test_gradient_checkpointing_counts_the_recomputed_forward_apart(mode, dropout):
    feed_forward, tied, flags = MODES[mode]
    model, frozen = ready(tiny_t5(feed_forward, tied, dropout=dropout), **flags, gradient_checkpointing=True)
    batch = a_batch(*UNEVEN)
    assert relative_error(model, batch, frozen, gradient_checkpointing=True) < 1e-9  # counted = model + recomputed
    flops = StepFlops.of(model, gradient_checkpointing=True)
    recomputed = flops.recomputed(batch, frozen)
    plain, _ = ready(tiny_t5(feed_forward, tied), **flags)
    without = StepFlops.of(plain)
    assert without.recomputed(batch, frozen) == 0
    # the recompute is the forward of the blocks that keep a graph: at most a forward, so under the model FLOPs
    assert 0 < recomputed < flops.micro_batch(batch, frozen) / 2
    if "lora" not in mode:  # everything upstream trains anyway: the model FLOPs are those of the plain run
        assert flops.micro_batch(batch, frozen) == without.micro_batch(batch, frozen)


@pytest.mark.parametrize("family", ["mt5", "umt5"])  # umT5: a relative position table in every layer
def test_other_t5_families(family):
    from transformers import MT5Config, MT5ForConditionalGeneration, UMT5Config, UMT5ForConditionalGeneration

    config, model_class = {"mt5": (MT5Config, MT5ForConditionalGeneration),
                           "umt5": (UMT5Config, UMT5ForConditionalGeneration)}[family]
    for flags in ({}, {"freeze": "encoder", "lora_r": 4, "gradient_checkpointing": True}):
        torch.manual_seed(0)
        model = model_class(config(vocab_size=VOCABULARY, d_model=32, d_ff=48, d_kv=8, num_heads=3, num_layers=2,
                                   num_decoder_layers=3, dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
                                   decoder_start_token_id=0, attn_implementation="eager"))
        model, frozen = ready(model, **flags)
        assert relative_error(model, a_batch(*UNEVEN), frozen, bool(flags)) < 1e-9


def test_frozen_weights_in_8_bits(tmp_path):
    tiny_t5().save_pretrained(tmp_path)  # (quantization reads the frozen weights from the model's files)
    model, frozen = ready(tiny_t5(), init_from=str(tmp_path), freeze="encoder", lora_r=4, frozen_dtype="int8")
    assert type(model.encoder.block[0].layer[0].SelfAttention.k).__name__ == "QLinear"
    assert relative_error(model, a_batch(*UNEVEN), frozen) < 1e-9


def test_a_model_on_the_meta_device_gives_the_same_coefficients():
    for flags in ({}, {"freeze": "encoder", "lora_r": 4, "lora_target_modules": ALL_LINEAR}):
        with torch.device("meta"):
            on_meta, _ = ready(tiny_t5(), **flags)
        assert on_meta.shared.weight.is_meta
        real, _ = ready(tiny_t5(), **flags)
        assert StepFlops.of(on_meta, True) == StepFlops.of(real, True)


def cpu_flash_attention() -> dict:
    """FlopCounterMode formulas for SDPA's fused CPU kernel, as torch counts its CUDA kernels (the backward counts the
    scores computed again: five products)."""
    from torch.utils.flop_counter import flop_registry

    aten = torch.ops.aten
    return {aten._scaled_dot_product_flash_attention_for_cpu:
                flop_registry[aten._scaled_dot_product_flash_attention].__wrapped__,
            aten._scaled_dot_product_flash_attention_for_cpu_backward:
                flop_registry[aten._scaled_dot_product_flash_attention_backward].__wrapped__}


@pytest.mark.parametrize("mode", ["full gated-gelu untied", "lora q,v freeze=encoder"])
def test_sdpa_attention_as_the_trainer_runs_it(mode):
    # SDPA takes its fused CPU kernel where the mask (the position bias) needs no gradient: cross-attention always,
    # self-attention with a frozen bias. Its backward computes the scores again and every operand's gradient,
    # which model FLOPs leave out; torch 2.13's counter does not know the kernel at all.
    feed_forward, tied, flags = MODES[mode]
    model, frozen = ready(tiny_t5(feed_forward, tied, attention="sdpa"), **flags)
    batch = a_batch(*UNEVEN)
    predicted = StepFlops.of(model).micro_batch(batch, frozen)
    eager, _ = ready(tiny_t5(feed_forward, tied), **flags)
    assert StepFlops.of(eager).micro_batch(batch, frozen) == predicted  # the kernel is no part of the model
    with_kernel = counted(model, batch, frozen, mapping=cpu_flash_attention())
    without_kernel = counted(model, batch, frozen)
    print(f"predicted {predicted:,}: counted with the CPU kernel {with_kernel:,} ({predicted / with_kernel - 1:+.2%}), "
          f"without it {without_kernel:,} ({predicted / without_kernel - 1:+.2%})")
    assert without_kernel < predicted < with_kernel
    assert abs(predicted - with_kernel) / with_kernel < 0.05
    if not frozen:  # only cross-attention takes the kernel (3 layers, 3 heads x 8): its scores once more
        assert with_kernel - predicted == 2 * 24 * 3 * batch["labels"].numel() * batch["input_ids"].shape[1]
