"""Peak memory and time of the LM head + cross-entropy, whole logits against chunked (``--loss_chunk_size``).

    python bench/loss_chunks.py                          # mT5-small's head (512 x 250,112), 1,024 target tokens
    python bench/loss_chunks.py --tokens=2048 --repeats=5

Each variant runs in a process of its own (a fresh heap), side by side in one run: the head's input (tokens x
d_model, float32) and weight (vocabulary x d_model, trainable) are made, then the forward and backward of
``lowmem.model.loss``'s two paths run ``--repeats`` times: ``F.cross_entropy(F.linear(h, W))`` over all target
tokens at once (``--loss_chunk_size=0``), ``lowmem.model.chunked_loss`` in chunks (``auto`` and a fixed chunk), and
torch's own ``F.linear_cross_entropy`` with the same fixed chunk (``torch:N``) for comparison.
Peak: the process's high-water RSS (VmHWM) above its RSS before the first forward, the weight's gradient
included in both (it is the same 0.5 GB either way). Time: the median of the repeats after the first.

Targets (issue "fp16 and a chunked loss"): chunked peak <= 0.25x whole, time <= 1.1x.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child(chunk: str, tokens: int, width: int, vocabulary: int, repeats: int) -> dict:
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(REPO))
    from lowmem.memory.probes import peak_rss_bytes, process_rss_bytes
    from lowmem.model.chunked_loss import chunk_rows, chunked_head_loss

    torch.manual_seed(0)
    head = torch.nn.Linear(width, vocabulary, bias=False)
    weight = head.weight
    hidden = torch.randn(tokens, width, requires_grad=True)
    targets = torch.randint(0, vocabulary, (tokens,))
    before = process_rss_bytes()
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        if chunk == "0":
            loss = F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction="sum")
        elif chunk.startswith("torch:"):  # torch's own chunked op, for comparison
            options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=int(chunk[6:]), chunking_method=None)
            loss = F.linear_cross_entropy(hidden, weight, targets, reduction="sum", options=options)
        else:
            loss = chunked_head_loss(hidden, weight, targets, chunk_rows(head, chunk))
        loss.backward()
        seconds.append(time.perf_counter() - started)
        weight.grad = hidden.grad = None
    return {"chunk": chunk, "loss": loss.item(), "peak_mb": (peak_rss_bytes() - before) / 2**20,
            "step_s": statistics.median(seconds[1:] or seconds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--vocabulary", type=int, default=250_112)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--chunks", default="0,auto,256,torch:256")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.tokens, args.width, args.vocabulary, args.repeats)))
        return
    rows = []
    for chunk in args.chunks.split(","):
        done = subprocess.run([sys.executable, __file__, f"--child={chunk}", f"--tokens={args.tokens}",
                               f"--width={args.width}", f"--vocabulary={args.vocabulary}",
                               f"--repeats={args.repeats}"], capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    whole = rows[0]
    print(f"head {args.width} x {args.vocabulary:,}, {args.tokens:,} target tokens, float32, CPU")
    print(f"{'loss_chunk_size':>16} {'peak MiB':>9} {'x whole':>8} {'step s':>8} {'x whole':>8} {'loss':>14}")
    for row in rows:
        print(f"{row['chunk']:>16} {row['peak_mb']:9.0f} {row['peak_mb'] / whole['peak_mb']:8.2f} "
              f"{row['step_s']:8.3f} {row['step_s'] / whole['step_s']:8.2f} {row['loss']:14.4f}")


if __name__ == "__main__":
    main()
