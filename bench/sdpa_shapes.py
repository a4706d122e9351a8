"""On a GPU: training step time of a T5 in bf16 with cuDNN's attention backend on and off, at fixed shapes
and at the varying shapes of dynamic padding, beside float32.

    python -m bench.sdpa_shapes                          # base preset, micro-batch 8
    python -m bench.sdpa_shapes --preset=small --batch=32 --steps=20

Why: recent torch tries cuDNN's attention first on Hopper and Blackwell GPUs for bf16, and cuDNN builds
an execution plan for each new shape. The trainer turns that backend off on CUDA
(``lowmem.parallel.distributed.attention_without_shape_plans``). This script measures what that choice is worth:
plain torch, outside the trainer, forward + backward + AdamW step under bf16 autocast (float32 without),
``--steps`` timed steps after two warm-up steps. "varying" draws every step's source and target lengths
anew (8-128 and 4-64 tokens, the micro-batch 1 to --batch rows), as dynamic padding does; "fixed" keeps
128 and 64 tokens and --batch rows. The three modes of a row run the same shapes, each in a fresh model;
cuDNN keeps its plans for the process, so only one mode of a row has the backend on.
"""

from __future__ import annotations

import argparse
import random

from bench.harness import Column, Table, Timer
from lowmem.utils.presets import preset_shape


def shapes(varying: bool, steps: int, batch: int, seed: int) -> list[tuple[int, int, int]]:
    """(rows, source length, target length) of each step, warm-up steps included."""
    draw = random.Random(seed)
    if not varying:
        return [(batch, 128, 64)] * steps
    return [(draw.randint(1, batch), draw.randint(8, 128), draw.randint(4, 64)) for _ in range(steps)]


def step_ms(preset: str, plan: list[tuple[int, int, int]], bf16: bool, cudnn: bool) -> float:
    """Mean wall time of the steps after the first two, in ms."""
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    torch.backends.cuda.enable_cudnn_sdp(cudnn)
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(vocab_size=32128, decoder_start_token_id=0, dropout_rate=0.0,
                                                **preset_shape(preset, "gated-gelu"))).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step(rows: int, source: int, target: int) -> None:
        ids = torch.randint(2, 32000, (rows, source), device="cuda")
        labels = torch.randint(2, 32000, (rows, target), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for shape in plan[:2]:  # two warm-up steps
        step(*shape)
    with Timer(sync=torch.cuda.synchronize) as timer:
        for shape in plan[2:]:
            step(*shape)
    return timer.seconds / (len(plan) - 2) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="base")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12, help="timed steps per mode (two more warm up)")
    options = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("error: bench/sdpa_shapes.py measures a GPU; torch sees none here")
    print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, cuDNN "
          f"{torch.backends.cudnn.version()}; {options.preset}, micro-batch up to {options.batch}")
    table = Table([Column("shapes", "name"), Column("float32 ms", "fp32", ".1f"),
                   Column("bf16, cuDNN attention on, ms", "on", ".1f"),
                   Column("bf16, cuDNN attention off, ms", "off", ".1f"), Column("on / off", "ratio", ".2f")],
                  markdown=True, stream=True)
    for varying in (False, True):
        plan = shapes(varying, options.steps + 2, options.batch, seed=0)
        fp32 = step_ms(options.preset, plan, bf16=False, cudnn=False)
        on = step_ms(options.preset, plan, bf16=True, cudnn=True)
        off = step_ms(options.preset, plan, bf16=True, cudnn=False)
        table.add("varying" if varying else "fixed", {"fp32": fp32, "on": on, "off": off, "ratio": on / off})


if __name__ == "__main__":
    main()
