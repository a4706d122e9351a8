"""Peak memory and time of the LM head + cross-entropy, whole logits against chunked (``--loss_chunk_size``).

    python -m bench.loss_chunks                          # mT5-small's head (512 x 250,112), 1,024 target tokens
    python -m bench.loss_chunks --tokens=2048 --repeats=5

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

from bench.harness import Column, Table, Timer, module, run_child


def child(chunk: str, tokens: int, width: int, vocabulary: int, repeats: int) -> dict:
    import torch
    import torch.nn.functional as F

    from lowmem.hardware.memory_use import peak_rss_bytes, process_rss_bytes
    from lowmem.model.chunked_loss import chunk_rows, chunked_head_loss

    torch.manual_seed(0)
    head = torch.nn.Linear(width, vocabulary, bias=False)
    weight = head.weight
    hidden = torch.randn(tokens, width, requires_grad=True)
    targets = torch.randint(0, vocabulary, (tokens,))
    before = process_rss_bytes()
    seconds = []
    for _ in range(repeats):
        with Timer() as timer:
            if chunk == "0":
                loss = F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction="sum")
            elif chunk.startswith("torch:"):  # torch's own chunked op, for comparison
                options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=int(chunk[6:]), chunking_method=None)
                loss = F.linear_cross_entropy(hidden, weight, targets, reduction="sum", options=options)
            else:
                loss = chunked_head_loss(hidden, weight, targets, chunk_rows(head, chunk))
            loss.backward()
        seconds.append(timer.seconds)
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
    chunks = args.chunks.split(",")
    table = Table([Column("loss_chunk_size", "name"), Column("peak MiB", "peak_mb", ".0f"),
                   Column("x whole", "peak_mb", ".2f", ratio=True), Column("step s", "step_s", ".3f"),
                   Column("x whole", "step_s", ".2f", ratio=True), Column("loss", "loss", ".4f")], baseline=chunks[0])
    for chunk in chunks:
        done = run_child(module("bench.loss_chunks", child=chunk, tokens=args.tokens, width=args.width,
                                vocabulary=args.vocabulary, repeats=args.repeats))
        if done.rc:
            raise SystemExit(f"--loss_chunk_size={chunk} failed:\n{done.output[-3000:]}")
        table.add(chunk, done.last_json())
    print(f"head {args.width} x {args.vocabulary:,}, {args.tokens:,} target tokens, float32, CPU")
    table.show()


if __name__ == "__main__":
    main()
