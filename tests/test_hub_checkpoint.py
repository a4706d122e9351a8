"""bench/hub_checkpoint.py writes folders transformers loads as a hub flan-t5: every tensor as written, no
missing or unexpected keys, the head untied, the same tensor names ``save_pretrained`` writes."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from conftest import REPO
from safetensors import safe_open
from transformers import AutoTokenizer, T5ForConditionalGeneration

from bench.hub_checkpoint import build_checkpoint

SHARD_BYTES = 300_000  # the tiny shape is 5 MB in float32: five shards (four in bfloat16)


def read_safetensors(folder) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's shards, as the safetensors library reads them."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    tensors = {}
    for name in sorted(set(index["weight_map"].values())):
        with safe_open(folder / name, framework="pt") as file:
            assert file.metadata() == {"format": "pt"}
            tensors.update({key: file.get_tensor(key) for key in file.keys()})
    assert set(tensors) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    return tensors


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sharded_safetensors_load_as_written_with_an_untied_head(tmp_path, dtype):
    summary = build_checkpoint(tmp_path / "hub", "tiny", dtype, SHARD_BYTES)
    folder = tmp_path / "hub"
    assert len(summary["files"]) == (5 if dtype == "float32" else 4)
    assert summary["files"][0] == f"model-00001-of-{len(summary['files']):05d}.safetensors"
    written = read_safetensors(folder)
    assert {t.dtype for t in written.values()} == {getattr(torch, dtype)}
    assert summary["params"] == sum(t.numel() for t in written.values())

    model, info = T5ForConditionalGeneration.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    state = model.state_dict()
    for name, tensor in written.items():
        assert torch.equal(state[name], tensor), name
    assert "encoder.embed_tokens.weight" not in written  # an alias: loading ties it to shared
    assert model.encoder.embed_tokens.weight is model.shared.weight
    assert model.lm_head.weight is not model.shared.weight
    assert not torch.equal(model.lm_head.weight, model.shared.weight)
    assert model.config.scale_decoder_outputs is False  # read from tie_word_embeddings: false, as flan-t5's

    # the tensor names are those transformers itself writes for this model
    model.save_pretrained(tmp_path / "saved")
    with safe_open(tmp_path / "saved" / "model.safetensors", framework="pt") as file:
        assert set(file.keys()) == set(written)


def test_a_random_model_trains_and_generates_without_nan(tmp_path):
    build_checkpoint(tmp_path / "hub", "tiny", "bfloat16", SHARD_BYTES)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hub")
    model = T5ForConditionalGeneration.from_pretrained(tmp_path / "hub", dtype=torch.float32)
    batch = tokenizer(["the cat runs over the river"], return_tensors="pt")
    loss = model(**batch, labels=batch["input_ids"]).loss
    loss.backward()
    assert torch.isfinite(loss) and 3.0 < loss.item() < 3 * torch.log(torch.tensor(8192.0)).item()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    generated = model.generate(**batch, max_new_tokens=5, do_sample=False)
    assert generated.shape[1] > 1 and generated[0, 0].item() == 0  # decoder_start_token_id


def test_bin_shards_hold_the_same_values_and_load(tmp_path):
    build_checkpoint(tmp_path / "st", "tiny", "float32", SHARD_BYTES)
    summary = build_checkpoint(tmp_path / "bin", "tiny", "float32", SHARD_BYTES, fmt="bin")
    index = json.loads((tmp_path / "bin" / "pytorch_model.bin.index.json").read_text())
    assert summary["files"] == sorted(set(index["weight_map"].values())) and len(summary["files"]) == 5
    loaded = {}
    for name in summary["files"]:
        loaded.update(torch.load(tmp_path / "bin" / name, weights_only=True))
    written = read_safetensors(tmp_path / "st")
    assert set(loaded) == set(written) == set(index["weight_map"])
    assert all(torch.equal(loaded[name], tensor) for name, tensor in written.items())
    _, info = T5ForConditionalGeneration.from_pretrained(tmp_path / "bin", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_values_follow_the_seed_and_one_shard_is_model_safetensors(tmp_path):
    one = build_checkpoint(tmp_path / "a", "tiny", "float16", 10**9)
    assert one["files"] == ["model.safetensors"] and not (tmp_path / "a" / "model.safetensors.index.json").exists()
    build_checkpoint(tmp_path / "b", "tiny", "float16", 10**9)
    build_checkpoint(tmp_path / "c", "tiny", "float16", 10**9, seed=1)
    data = {k: (tmp_path / k / "model.safetensors").read_bytes() for k in "abc"}
    assert data["a"] == data["b"] and data["a"] != data["c"]
    assert not (tmp_path / "a" / ".t5-lowmem-tokenizer").exists()  # the shipped tokenizer's ownership marker
    with pytest.raises(FileExistsError):
        build_checkpoint(tmp_path / "a", "tiny")


def test_cli_builds_and_reports(tmp_path, processes):
    done = processes.run([sys.executable, "-m", "bench.hub_checkpoint", str(tmp_path / "hub"), "--shape=tiny",
                          "--dtype=bfloat16", "--max_shard_gb=0.0003"], cwd=REPO, capture_output=True, text=True,
                         check=True)
    assert "1,246,208 params" in done.stdout and "peak RSS" in done.stdout
    config = json.loads((tmp_path / "hub" / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["tie_word_embeddings"] is False
    assert config["architectures"] == ["T5ForConditionalGeneration"] and config["feed_forward_proj"] == "gated-gelu"
    assert json.loads((tmp_path / "hub" / "generation_config.json").read_text())["decoder_start_token_id"] == 0
