"""The chunked LM head + loss (``--loss_chunk_size``, lowmem.model.chunked_loss): the same loss and gradients as the
whole logits, without ever holding them."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import metrics, synthetic_rows, write_rows
from torch.utils._python_dispatch import TorchDispatchMode

from lowmem.model.loss import token_loss_sum


def tiny_t5(tied: bool, vocabulary: int = 3000):
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(vocab_size=vocabulary, d_model=64, d_ff=128, num_layers=2, num_heads=2, d_kv=32,
                      tie_word_embeddings=tied, feed_forward_proj="relu" if tied else "gated-gelu",
                      decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0)
    return T5ForConditionalGeneration(config)


def a_batch(vocabulary: int = 3000) -> dict:
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randint(1, vocabulary, (4, 40), generator=generator)
    labels = torch.randint(1, vocabulary, (4, 50), generator=generator)
    labels[0, 30:] = -100  # padding
    return {"input_ids": inputs, "attention_mask": torch.ones_like(inputs), "labels": labels}


def loss_and_grads(model, batch: dict, chunk, **kwargs) -> tuple[float, dict]:
    model.zero_grad(set_to_none=True)
    loss = token_loss_sum(model, model, batch, loss_chunk=chunk, **kwargs)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(whole: tuple, chunked: tuple, loss_rel: float = 1e-5, grad_rel: float = 1e-4) -> None:
    assert chunked[0] == pytest.approx(whole[0], rel=loss_rel)
    assert whole[1].keys() == chunked[1].keys()
    for name, grad in whole[1].items():
        assert (chunked[1][name] - grad).norm() <= grad_rel * grad.norm() + 1e-12, name


@pytest.mark.parametrize("tied", [True, False])  # T5 v1.0's tied head (scaled by d_model**-0.5), flan / mT5's own
@pytest.mark.parametrize("chunk", ["auto", 16, 7])
def test_chunked_loss_and_gradients_equal_the_whole_logits(tied, chunk):
    model, batch = tiny_t5(tied), a_batch()
    assert_same(loss_and_grads(model, batch, 0), loss_and_grads(model, batch, chunk))
    # target positions padded to a multiple (bf16 on the CPU): the padding ignored alike
    assert_same(loss_and_grads(model, batch, 0, multiple=16), loss_and_grads(model, batch, chunk, multiple=16))


def test_chunked_loss_with_lora_and_a_frozen_head():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_t5(False), LoraConfig(r=4, lora_alpha=8, target_modules=["q", "v"]))
    core = model.base_model.model
    batch = a_batch()

    def run(chunk):
        model.zero_grad(set_to_none=True)
        loss = token_loss_sum(model, core, batch, loss_chunk=chunk)
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    whole, chunked = run(0), run(16)
    assert all("lora_" in name for name in whole[1]) and core.lm_head.weight.grad is None
    assert_same(whole, chunked)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_chunked_loss_under_autocast_computes_the_logits_in_its_dtype(dtype):
    model, batch = tiny_t5(False), a_batch()
    with torch.autocast("cpu", dtype=dtype):
        whole = loss_and_grads(model, batch, 0)
        chunked = loss_and_grads(model, batch, 16)
    exact = loss_and_grads(model, batch, 0)  # float32
    assert chunked[0] == pytest.approx(whole[0], rel=1e-3) and chunked[0] != exact[0]
    assert_same(whole, chunked, loss_rel=1e-3, grad_rel=2e-2)


class LargestTensor(TorchDispatchMode):
    """Records the most elements any op's output had."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor):
                self.most = max(self.most, tensor.numel())
        return out


def test_the_chunked_loss_never_makes_a_tensor_of_all_target_logits():
    vocabulary = 20_000
    model, batch = tiny_t5(False, vocabulary), a_batch(vocabulary)
    tokens = int(batch["labels"].ne(-100).sum())
    sizes = {}
    for chunk in (0, 32):
        with LargestTensor() as seen:
            token_loss_sum(model, model, batch, loss_chunk=chunk).backward()
        sizes[chunk] = seen.most
    assert sizes[0] >= tokens * vocabulary  # the whole logits (and their gradient)
    head = vocabulary * 64  # the head weight's gradient, the largest tensor left
    assert sizes[32] <= max(32 * vocabulary, head) < tokens * vocabulary


def test_plan_and_run_an_mt5_shaped_sft_with_and_without_chunks(tmp_path, family_models, run_cli):
    """mT5's 250,112-row head (on a tiny body): long targets peak lower chunked, with the same weights."""
    from safetensors.torch import load_file
    from transformers import AutoModelForSeq2SeqLM

    model = tmp_path / "mt5"
    shutil.copytree(family_models["mt5"], model)
    grown = AutoModelForSeq2SeqLM.from_pretrained(model)
    grown.resize_token_embeddings(250_112)  # mT5's head and embedding rows, on the tiny body
    for name in ("pytorch_model.bin", "model.safetensors"):
        (model / name).unlink(missing_ok=True)
    grown.save_pretrained(model)
    del grown
    rows = [{"prompt": r["prompt"], "response": " ".join([r["response"]] * 12)} for r in synthetic_rows(64)]
    data = write_rows(tmp_path / "long.jsonl", rows)
    args = ["--is_finetune=True", f"--init_from={model}", f"--train_file={data}", f"--eval_file={data}",
            "--max_target_len=256", "--batch_size=4", "--gradient_accumulation_steps=1", "--max_steps=2",
            "--eval_steps=0", "--save_steps=0", "--max_eval_samples=4", "--eval_generate=False", "--dropout_rate=0",
            "--eval_batch_size=4"]
    peaks, finals = {}, {}
    for chunk in ("0", "auto"):
        out = tmp_path / f"run-{chunk}"
        done = run_cli("train", f"--output_dir={out}", f"--loss_chunk_size={chunk}", *args)
        assert done.returncode == 0, done.stderr[-3000:]
        peak = next(r for r in metrics(out) if r["event"] == "memory_peak")
        peaks[chunk] = peak
        finals[chunk] = load_file(out / "final" / "model.safetensors")
    assert peaks["auto"]["measured_host_peak_mb"] <= 0.75 * peaks["0"]["measured_host_peak_mb"], peaks
    for peak in peaks.values():  # the plan follows the chunks
        assert 0.75 <= peak["host_ratio"] <= 1.3, peaks
    for name, tensor in finals["0"].items():
        assert torch.allclose(finals["auto"][name], tensor, rtol=1e-5, atol=1e-6), name
