"""The capability probe (``lowmem.hardware``): what this machine computes fast, measured once and cached; and the
dtype choices that ask it (narrow-stored frozen weights computing in float32 where their dtype is slow here)."""

from __future__ import annotations

import json

import pytest
import torch

from lowmem.hardware import cpu_probe, probe
from lowmem.hardware.capability import DTYPES, SLOW_FACTOR, Capability
from lowmem.hardware.gpu_peaks import datasheet_peaks, fast_half
from lowmem.memory.plan_sizes import Placement

SLOW_BF16 = Capability("cpu", "a CPU with AVX2 only", {"float32": 1e11, "bfloat16": 1e9, "float16": 1e9}, "measured")
FAST_BF16 = Capability("cpu", "a CPU with AMX", {"float32": 1e11, "bfloat16": 4e11, "float16": 1e9}, "measured")


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    """The probe's cache in a folder of the test's own, and no capability remembered by this process."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(probe, "_KNOWN", {})
    return tmp_path / "t5-lowmem" / "hardware.json"


@pytest.fixture
def cpu_is(monkeypatch):
    """Make this process's CPU capability the one given (a fact about hardware, as the probe would find it)."""
    def set_to(found: Capability):
        monkeypatch.setattr(probe, "_KNOWN", {"cpu": found})
    return set_to


def test_the_probe_measures_every_dtype_once_and_reads_the_cache_after(cache_home, monkeypatch):
    found = probe.capability("cpu")
    assert set(found.flops) == {"float32", "bfloat16", "float16"} and found.flops["float32"] > 1e8
    assert found.source == "measured" and "threads" in found.name
    saved = json.loads(cache_home.read_text())
    assert list(saved["machines"].values()) == [{"flops": found.flops}]
    # a new process (nothing remembered) reads the cache and times float32's product only, to keep the highest rate
    timed = []

    def product_rate(dtype, shape, repeats=5):
        timed.append((dtype, shape))
        return found.flops["float32"] / 2  # slower now (a loaded machine): the cached peak stands

    monkeypatch.setattr(probe, "_KNOWN", {})
    monkeypatch.setattr(cpu_probe, "product_rate", product_rate)
    assert probe.capability("cpu") == found and timed == [(torch.float32, cpu_probe.LARGE)]


def test_a_peak_cached_under_load_rises_to_the_machines_own(cache_home):
    """The cache keeps the highest float32 rate seen; the narrow dtypes' keep their measured slowdown."""
    key = f"{cpu_probe.cpu_name()} | torch {torch.__version__}"
    cache_home.parent.mkdir(parents=True)
    low = {"float32": 1e6, "bfloat16": 1e4, "float16": 2e6}
    cache_home.write_text(json.dumps({"version": 1, "machines": {key: {"flops": low}}}))
    found = probe.capability("cpu")
    assert found.flops["float32"] > 1e8 and found.slowdown("bfloat16") == pytest.approx(100)
    assert found.slowdown("float16") == pytest.approx(0.5)
    assert json.loads(cache_home.read_text())["machines"][key]["flops"] == found.flops


@pytest.mark.parametrize("damage", ["", "{", '{"version": 1, "machines": []}', '{"version": 0, "machines": {}}',
                                    "[1, 2]"])
def test_a_damaged_cache_is_measured_again_and_rewritten(cache_home, damage):
    cache_home.parent.mkdir(parents=True)
    cache_home.write_text(damage)
    found = probe.capability("cpu")
    assert json.loads(cache_home.read_text())["machines"] and found.flops["float32"] > 0


def test_a_cache_entry_with_impossible_rates_is_measured_again(cache_home):
    key = f"{cpu_probe.cpu_name()} | torch {torch.__version__}"
    cache_home.parent.mkdir(parents=True)
    cache_home.write_text(json.dumps({"version": 1, "machines": {key: {"flops": {"float32": -1, "bfloat16": 1,
                                                                                 "float16": 1}}}}))
    assert probe.capability("cpu").flops["float32"] > 0


def test_a_cache_that_cannot_be_written_only_means_measuring_again(tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    monkeypatch.setattr(probe, "_KNOWN", {})
    assert probe.capability("cpu").flops["float32"] > 0
    assert blocked.read_text() == "not a folder"


def test_this_cpu_ranks_as_its_measured_rates_say():
    """Whatever this machine is: a dtype is fast exactly when its measured slowdown is within SLOW_FACTOR."""
    found = cpu_probe.cpu_capability()
    for name in ("bfloat16", "float16"):
        assert found.fast(name) == (found.slowdown(name) <= SLOW_FACTOR)
        assert found.compute_dtype(DTYPES[name]) == (DTYPES[name] if found.fast(name)
                                                               else torch.float32)
    assert found.fast(torch.float32) and found.compute_dtype(torch.float32) == torch.float32


def test_the_summary_line_gives_the_measured_factor_of_a_slow_dtype():
    line = SLOW_BF16.line()
    assert "bfloat16 1 GFLOP/s (100x slower)" in line and "float32 100 GFLOP/s" in line
    assert "slower" not in FAST_BF16.line().split("bfloat16")[1].split(",")[0]
    assert SLOW_BF16.record()["fast"] == ["float32"] and FAST_BF16.record()["fast"] == ["float32", "bfloat16"]


@pytest.mark.parametrize("name, peaks", [("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756),
                                         ("NVIDIA A100-SXM4-80GB", 312), ("Tesla T4", 65), ("NVIDIA L4", 121),
                                         ("NVIDIA L40S", 362), ("NVIDIA GeForce RTX 3090", None)])
def test_gpu_peaks_come_from_the_datasheet_by_name(name, peaks):
    found = datasheet_peaks(name)
    assert (found and found["half"]) == peaks


@pytest.mark.parametrize("cc, bf16, fp16", [((9, 0), True, True), ((8, 0), True, True), ((7, 5), False, True),
                                            ((7, 0), False, True), ((6, 0), False, True), ((6, 1), False, False)])
def test_which_half_dtypes_a_gpu_runs_fast_follows_its_compute_capability(cc, bf16, fp16):
    assert fast_half(*cc) == {"bfloat16": bf16, "float16": fp16}


# ---------------------------------------------------------------------------------------------- dtype choices
def frozen_bf16_layer(seed: int = 0) -> torch.nn.Linear:
    from lowmem.model.narrow_compute import compute_beside_narrow

    torch.manual_seed(seed)
    holder = torch.nn.Sequential(torch.nn.Linear(300, 517))
    holder.requires_grad_(False)
    holder.to(torch.bfloat16)
    compute_beside_narrow(holder)
    return holder[0]


def test_a_bf16_frozen_layer_computes_in_float32_blocks_where_bf16_is_slow(cpu_is, monkeypatch):
    """Output and input gradient equal float64 maths with the stored bf16 weight (float32 rounding, where bf16
    products would round the input and output to bf16), in blocks of rows, and float32 out."""
    from lowmem.model import narrow_compute

    cpu_is(SLOW_BF16)
    monkeypatch.setattr(narrow_compute, "BLOCK_BYTES", 4096)
    layer = frozen_bf16_layer()
    x = torch.randn(2, 7, 300, requires_grad=True)
    grad = torch.randn(2, 7, 517)
    out = layer(x)
    out.backward(grad)
    assert type(out.grad_fn).__name__ in ("AddBackward0", "BlockLinearBackward") and out.dtype == torch.float32
    weight, bias = layer.weight.double(), layer.bias.double()
    expected = x.detach().double() @ weight.t() + bias
    assert (out.double() - expected).abs().max() <= 2e-6 * expected.abs().max()
    expected_grad = grad.double() @ weight
    assert (x.grad.double() - expected_grad).abs().max() <= 2e-6 * expected_grad.abs().max()
    assert layer.weight.dtype == torch.bfloat16 and layer.weight.grad is None


def test_a_bf16_frozen_layer_computes_in_bf16_where_bf16_is_fast(cpu_is):
    cpu_is(FAST_BF16)
    layer = frozen_bf16_layer()
    x = torch.randn(3, 300)
    out = layer(x)
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.nn.functional.linear(x.to(torch.bfloat16), layer.weight, layer.bias).float())


def test_a_bf16_head_computes_its_logits_in_float32_where_bf16_is_slow(cpu_is):
    """The chunked loss of a bf16-stored head (a frozen untied lm_head beside 8-bit layers) equals float64 maths
    with that weight to float32 rounding on a CPU without fast bf16; with fast bf16 it rounds as bf16 does."""
    from lowmem.model.chunked_loss import chunked_head_loss

    torch.manual_seed(0)
    weight = torch.randn(97, 64).to(torch.bfloat16)
    hidden = torch.randn(10, 64)
    targets = torch.randint(0, 97, (10,))
    exact = torch.nn.functional.cross_entropy(hidden.double() @ weight.double().t(), targets, reduction="sum")
    cpu_is(SLOW_BF16)
    slow_machine = chunked_head_loss(hidden, weight, targets, 4)
    cpu_is(FAST_BF16)
    fast_machine = chunked_head_loss(hidden, weight, targets, 4)
    assert abs(float(slow_machine) - float(exact)) <= 1e-5 * float(exact)
    assert abs(float(fast_machine) - float(exact)) > 1e-5 * float(exact)  # bf16 logits: rounded


# ---------------------------------------------------------------------------------------------- the planner
def planned_run(tmp_path):
    from transformers import T5Config

    from lowmem.cli.flags import load_config
    from lowmem.utils.presets import preset_shape

    folder = tmp_path / "small"
    T5Config(**preset_shape("small", "gated-gelu"), vocab_size=8000).save_pretrained(folder)
    cfg, _ = load_config({"is_finetune": True, "init_from": str(folder), "lora_r": 8})
    lengths = {"max_source": 128, "max_target": 128, "mean_source": 60, "row_bytes": 500, "rows": 1000,
               "pairs": [(128, 128)] * 1000}
    return cfg, lengths


@pytest.mark.parametrize("half, expected", [({"bfloat16": 1e14, "float16": 1e14}, "bf16"),
                                            ({"bfloat16": 1e11, "float16": 1e14}, "fp16"),
                                            ({"bfloat16": 1e11, "float16": 1e11}, "no")])
def test_plan_never_recommends_computing_in_a_dtype_this_gpu_runs_slowly(tmp_path, monkeypatch, half, expected):
    """A roomy budget: autocast is the fastest choice where its dtype is fast, and never chosen where it is not;
    bf16 storage of the frozen weights goes with bf16 autocast only."""
    from lowmem.cli import plan_command

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    found = Capability("cuda", "a GPU", {"float32": 1e13, **half}, "datasheet")
    monkeypatch.setattr(probe, "_KNOWN", {"cuda": found})
    cfg, lengths = planned_run(tmp_path)
    flags = plan_command.recommend(cfg, 80, Placement("gpu"), 8000, lengths, plan_command.Baseline(300.0))["flags"]
    assert flags["mixed_precision"] == expected
    assert flags["frozen_dtype"] != "bfloat16" or expected == "bf16"


def test_the_planners_step_time_of_a_slow_dtype_is_its_measured_factor(tmp_path, cpu_is):
    from dataclasses import replace

    from lowmem.cli import plan_command

    cfg, _ = planned_run(tmp_path)
    cpu_is(SLOW_BF16)
    slow = plan_command.relative_time(replace(cfg, mixed_precision="bf16"), "cpu")
    cpu_is(FAST_BF16)
    fast = plan_command.relative_time(replace(cfg, mixed_precision="bf16"), "cpu")
    assert slow == pytest.approx(100 * plan_command.relative_time(replace(cfg, mixed_precision="no"), "cpu"))
    assert fast == pytest.approx(plan_command.SPEED["bf16_cpu"] * plan_command.relative_time(cfg, "cpu"))
    # on the CPU the search never takes autocast: every recommendation computes in float32
    lengths = {"max_source": 64, "max_target": 64, "mean_source": 40, "row_bytes": 300, "rows": 100,
               "pairs": [(64, 64)] * 100}
    rec = plan_command.recommend(cfg, 64, Placement("cpu"), 8000, lengths, plan_command.Baseline(300.0))
    assert rec["flags"]["mixed_precision"] == "no"


@pytest.mark.parametrize("precision", ["bf16", "fp16", "no"])
def test_an_explicit_precision_slow_here_runs_with_one_warning_giving_the_factor(cpu_is, precision):
    from lowmem.cli.flags import load_config
    from lowmem.monitoring.run_summary import compute_lines

    cfg, _ = load_config({"mixed_precision": precision})
    cpu_is(SLOW_BF16)
    slow = compute_lines(cfg, "cpu")
    cpu_is(FAST_BF16)
    fast = compute_lines(cfg, "cpu")
    assert slow[0] == SLOW_BF16.line() and fast[0] == FAST_BF16.line()
    warned = [line for line in slow + fast if line.startswith("warning:")]
    if precision == "no":
        assert not warned
    elif precision == "bf16":  # slow on the AVX2 CPU only
        assert warned == ["warning: --mixed_precision=bf16: bfloat16 matrix products take 100x float32's time on "
                          "this cpu (a CPU with AVX2 only, measured); the run computes in bfloat16 as asked, its "
                          "products ~100x slower than with --mixed_precision=no"]
    else:  # float16: slow on both
        assert len(warned) == 2 and all("float16 matrix products take 100x" in line for line in warned)
