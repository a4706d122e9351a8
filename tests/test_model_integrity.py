"""Every model source is checked before anything heavy (issue 82, behaviours 1 and 2): a model folder whose weight
files are damaged, pickled or outside its folder, or whose config.json is not the model its weights hold, is one
``error:`` line and exit 2 in train (SFT and continued pretraining), evaluate, generate and plan, never a traceback;
the hub's layouts still pass; an export whose weights disagree with its config is never left in place.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import synthetic_rows, write_rows
from safetensors import safe_open
from safetensors.torch import save_file

from lowmem.model.weight_check import check_model_folder
from lowmem.utils.errors import UserError

FAST = ["--max_steps=2", "--eval_steps=2", "--save_steps=2", "--batch_size=2", "--gradient_accumulation_steps=1",
        "--max_eval_samples=4", "--max_source_len=16", "--max_target_len=16", "--warmup_steps=0", "--logging_steps=1"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("integrity_corpus")
    return write_rows(root / "train.jsonl", synthetic_rows(32, seed=3)), write_rows(root / "eval.jsonl",
                                                                                    synthetic_rows(8, seed=4))


def header(path: Path) -> tuple[dict, int, bytes]:
    """(header, its length, the data) of a safetensors file."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + length]), length, raw[8 + length:]


def write_header(path: Path, head: dict, data: bytes) -> None:
    text = json.dumps(head).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)


def set_config(**values):
    def edit(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        config.update(values)
        (folder / "config.json").write_text(json.dumps(config))
    return edit


def truncate(folder: Path) -> None:
    path = folder / "model.safetensors"
    os.truncate(path, path.stat().st_size // 2)


def zero_bytes(folder: Path) -> None:
    os.truncate(folder / "model.safetensors", 0)


def garbage_header(folder: Path) -> None:
    path = folder / "model.safetensors"
    raw = bytearray(path.read_bytes())
    raw[8:24] = b"\x00\xff" * 8  # the header's first bytes: not JSON any more
    path.write_bytes(bytes(raw))


def offsets_past_end(folder: Path) -> None:
    path = folder / "model.safetensors"
    head, _, data = header(path)
    last = max((k for k in head if k != "__metadata__"), key=lambda k: head[k]["data_offsets"][1])
    head[last]["data_offsets"] = [o + 4096 for o in head[last]["data_offsets"]]
    write_header(path, head, data)


def shard_in_two(folder: Path, outside: bool = False) -> None:
    """model.safetensors as two shards and an index (``outside``: the index names the second by a ../ path)."""
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    (folder / "model.safetensors").unlink()
    names = list(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for name, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(folder / name), metadata={"format": "pt"})
    second = f"../{folder.name}/model-00002-of-00002.safetensors" if outside else "model-00002-of-00002.safetensors"
    weight_map = {k: "model-00001-of-00002.safetensors" for k in shards["model-00001-of-00002.safetensors"]}
    weight_map.update({k: second for k in shards["model-00002-of-00002.safetensors"]})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


class Payload:
    """An object torch.save pickles beside the tensors: loading it would need its class (code)."""


def bin_by_pickle(folder: Path) -> None:
    path = folder / "pytorch_model.bin"
    state = torch.load(path, weights_only=True)
    with open(path, "wb") as f:
        pickle.dump(state, f)


def bin_with_object(folder: Path) -> None:
    path = folder / "pytorch_model.bin"
    torch.save({**torch.load(path, weights_only=True), "payload": Payload()}, path)


def bin_foreign_zip(folder: Path) -> None:
    with zipfile.ZipFile(folder / "pytorch_model.bin", "w") as archive:
        archive.writestr("weights/readme.txt", "not torch's")


def bin_truncated(folder: Path) -> None:
    path = folder / "pytorch_model.bin"
    os.truncate(path, path.stat().st_size // 2)


# (family, damage, what the line says)
DAMAGES = {
    "truncated": ("flan", truncate, "model.safetensors is not a readable safetensors file"),
    "zero_bytes": ("flan", zero_bytes, "model.safetensors is empty (0 bytes)"),
    "garbage_header": ("flan", garbage_header, "model.safetensors is not a readable safetensors file"),
    "offsets_past_end": ("flan", offsets_past_end, "past its end"),
    "index_outside": ("flan", lambda f: shard_in_two(f, outside=True), "which is not inside"),
    "bin_by_pickle": ("v1_1", bin_by_pickle, "unpickling can run code"),
    "bin_with_object": ("v1_1", bin_with_object, "holds objects other than tensors"),
    "bin_foreign_zip": ("v1_1", bin_foreign_zip, "not one torch.save wrote"),
    "bin_truncated": ("v1_1", bin_truncated, "pytorch_model.bin is a damaged zip"),
    "d_model": ("flan", set_config(d_model=128), "config.json says d_model 128, but model.safetensors holds "
                "shared.weight of shape [640, 64] where the config builds [640, 128]"),
    "d_ff": ("flan", set_config(d_ff=96), "config.json says d_ff 96, but model.safetensors holds "
             "encoder.block.0.layer.1.DenseReluDense.wi_0.weight of shape [128, 64] where the config builds [96, 64]"),
    "vocab_size": ("t5", set_config(vocab_size=1024), "config.json says vocab_size 1024"),
    "num_heads": ("flan", set_config(num_heads=4), "config.json says num_heads 4 x d_kv 32 = 128"),
    "num_layers": ("flan", set_config(num_layers=3), "config.json says num_layers 3, but model.safetensors lacks "
                   "encoder.block.2.layer.0.SelfAttention.q.weight and 8 more that the config builds"),
    "num_decoder_layers": ("umt5", set_config(num_decoder_layers=2), "model.safetensors holds decoder.block.2."),
}
# The damages each other command is tried on (train SFT is tried on every one)
SOME = ("truncated", "bin_by_pickle", "bin_with_object", "d_model", "num_heads", "index_outside")


def damaged(family_models, tmp_path: Path, case: str) -> tuple[Path, str]:
    family, damage, says = DAMAGES[case]
    folder = tmp_path / f"{family}-{case}"
    shutil.copytree(family_models[family], folder)
    damage(folder)
    return folder, says


def command(name: str, folder: Path, corpus, out: Path) -> list[str]:
    data = [f"--train_file={corpus[0]}", f"--eval_file={corpus[1]}"]
    return {"sft": ["train", "--is_finetune=True", f"--init_from={folder}", *data, f"--output_dir={out}", *FAST],
            "pretrain": ["train", f"--init_from={folder}", *data, f"--output_dir={out}", *FAST],
            "evaluate": ["evaluate", "--is_finetune=True", f"--init_from={folder}", f"--eval_file={corpus[1]}"],
            "generate": ["generate", f"--init_from={folder}", "--prompt=the quick brown fox"],
            "plan": ["plan", "--is_finetune=True", f"--init_from={folder}", *data]}[name]


def assert_one_line(proc, says: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and says in errors[0], proc.stderr[-3000:]


@pytest.mark.parametrize("case", sorted(DAMAGES))
def test_a_damaged_or_mismatched_model_folder_is_one_line_in_sft(case, family_models, corpus, tmp_path,
                                                                  cli_in_process):
    folder, says = damaged(family_models, tmp_path, case)
    proc = cli_in_process(*command("sft", folder, corpus, tmp_path / "run"))
    assert_one_line(proc, says)
    assert not (tmp_path / "run").exists()  # refused before the run folder is made


@pytest.mark.parametrize("name", ["pretrain", "evaluate", "generate", "plan"])
@pytest.mark.parametrize("case", SOME)
def test_every_command_that_reads_a_model_refuses_it_in_one_line(case, name, family_models, corpus, tmp_path,
                                                                 cli_in_process):
    folder, says = damaged(family_models, tmp_path, case)
    proc = cli_in_process(*command(name, folder, corpus, tmp_path / "run"))
    assert_one_line(proc, says)
    assert "Traceback" not in proc.stdout


def test_a_pickle_is_refused_with_a_conversion_command_that_works(family_models, tmp_path):
    """The command the line gives, run on a legacy torch file (torch's weights-only unpickler: no code runs),
    leaves a folder that passes."""
    folder = tmp_path / "legacy"
    shutil.copytree(family_models["v1_1"], folder)
    state = torch.load(folder / "pytorch_model.bin", weights_only=True)
    torch.save(state, folder / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    with pytest.raises(UserError, match="unpickling can run code") as refused:
        check_model_folder(folder, "--init_from=legacy")
    code = str(refused.value).split('python -c "', 1)[1].split('"', 1)[0]
    exec(code)  # what the user would run: torch.load(..., weights_only=True) and safetensors' save_file
    check_model_folder(folder, "--init_from=legacy")  # model.safetensors now, which is read first
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("lm_head.weight"), state["lm_head.weight"])


@pytest.mark.parametrize("family", ["t5", "flan", "v1_1", "mt5", "umt5", "byt5"])
def test_the_hubs_layouts_pass(family, family_models, tmp_path):
    """Tied (t5) and untied (flan) heads, .bin (v1_1, mt5), a position table in every layer (umt5), sharded
    safetensors, and an older checkpoint's cross-attention position table that from_pretrained ignores."""
    check_model_folder(family_models[family], family)
    if family in ("t5", "flan"):
        folder = tmp_path / family
        shutil.copytree(family_models[family], folder)
        shard_in_two(folder)
        check_model_folder(folder, family)
        first = folder / "model-00001-of-00002.safetensors"
        with safe_open(str(first), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        ignored = "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight"
        save_file({**tensors, ignored: torch.zeros(32, 2)}, str(first), metadata={"format": "pt"})
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        index["weight_map"][ignored] = first.name
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        check_model_folder(folder, family)


def test_a_sharded_index_naming_a_tensor_its_shard_lacks_is_one_line(family_models, tmp_path):
    folder = tmp_path / "flan"
    shutil.copytree(family_models["flan"], folder)
    shard_in_two(folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    moved = next(k for k, v in index["weight_map"].items() if v == "model-00001-of-00002.safetensors")
    index["weight_map"][moved] = "model-00002-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(UserError, match=f"the index puts {moved} in model-00002-of-00002.safetensors, which "
                                        "does not hold it"):
        check_model_folder(folder, "flan")


def test_a_resume_checks_its_base_model_again(family_models, corpus, tmp_path, run_cli):
    """--is_keep_training reads --init_from again (a checkpoint holds only what trains): a base whose config was
    edited since is one line, and the run's files stay as they were."""
    folder = tmp_path / "flan"
    shutil.copytree(family_models["flan"], folder)
    args = command("sft", folder, corpus, tmp_path / "run")
    first = run_cli(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    before = sorted((p.name, p.stat().st_size) for p in (tmp_path / "run" / "final").iterdir())
    set_config(d_model=128)(folder)
    again = run_cli(*[a if not a.startswith("--max_steps") else "--max_steps=4" for a in args],
                    "--is_keep_training=True")
    assert_one_line(again, "config.json says d_model 128")
    assert sorted((p.name, p.stat().st_size) for p in (tmp_path / "run" / "final").iterdir()) == before


def test_an_export_whose_weights_disagree_with_its_config_is_not_kept(tokenizer, tmp_path):
    """RunFolder.export checks what it wrote against the config it wrote before the rename: an export lacking a
    tensor is refused, and the previous export stays as it was."""
    from transformers import T5Config, T5ForConditionalGeneration

    from lowmem.runs.run_folder import ExportFiles, RunFolder

    model = T5ForConditionalGeneration(T5Config(vocab_size=len(tokenizer), d_model=32, d_ff=64, num_heads=2, d_kv=16,
                                                num_layers=1, decoder_start_token_id=0, pad_token_id=0))
    final = tmp_path / "final"
    RunFolder.export(final, model, ExportFiles(tokenizer, {"step": 1}))
    check_model_folder(final, "final")
    before = {p.name: p.read_bytes() for p in final.iterdir()}
    state = {k: v for k, v in model.state_dict().items() if k != "decoder.final_layer_norm.weight"}
    with pytest.raises(UserError, match=f"the export {final}: model.safetensors lacks decoder.final_layer_norm.weight "
                                        "that the config builds; it was not kept"):
        RunFolder.export(final, model, ExportFiles(tokenizer, {"step": 2}), state_dict=state)
    assert {p.name: p.read_bytes() for p in final.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]  # no staging folder left behind
