"""Where the sharded engines' gradients part from DDP's: the same step's gradients under DDP, FSDP2 and
DeepSpeed ZeRO-2 / ZeRO-3 on 2 CPU processes over gloo, against a plain model summed in each engine's order.

    python -m bench.engine_gradients            # starts its own 2 processes (torch.distributed.run)
    python -m bench.engine_gradients --layers=6 --d_model=256

One forward and backward of a T5 (tied embeddings, ReLU feed-forward, dropout 0) on each process's own
rows; the gradients are averaged over the processes (all-reduce for the plain model, the engine's own
reduce otherwise) and gathered whole. Printed per engine: the largest difference from the plain model's
gradient and how many tensors differ at all, then the same against the plain model with the engine's
autograd functions reproduced:
- FSDP (``fully_shard`` on each block, then the root, as ``lowmem/parallel/sharding.py`` does) passes each block's
  inputs that need a gradient through one autograd function, so that it knows when they are done. The
  gradients several blocks send to one tensor (the encoder output, which every decoder block's
  cross-attention reads twice) are then summed per block before they meet.
- ZeRO-3 wraps every module's inputs and outputs in identity functions (its pre- and post-backward hooks).
- ZeRO-2 adds none.
A zero in the second column means the engine computes the plain model's gradient exactly, summed in another
order. Figures: docs/distributed.md ("Where the engines' differences come from").
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from bench.harness import run_child


class InputsDone(torch.autograd.Function):
    """FSDP2's post-backward function: identity over all of a module's inputs at once."""

    @staticmethod
    def forward(ctx, *tensors):
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        return grads


class Each(torch.autograd.Function):
    """DeepSpeed ZeRO-3's pre-/post-backward functions: identity over one tensor."""

    @staticmethod
    def forward(tensor):
        return tensor.detach()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad


def fsdp_order(model) -> None:
    from torch.utils._pytree import tree_flatten, tree_unflatten
    from transformers.models.t5.modeling_t5 import T5Block

    def hook(_module, args, kwargs):
        flat, spec = tree_flatten((args, kwargs))
        needing = [i for i, x in enumerate(flat) if torch.is_tensor(x) and x.requires_grad]
        if not needing:
            return None
        for i, out in zip(needing, InputsDone.apply(*[flat[i] for i in needing])):
            flat[i] = out
        return tree_unflatten(flat, spec)

    for module in model.modules():
        if isinstance(module, T5Block):
            module.register_forward_pre_hook(hook, with_kwargs=True)


def zero3_order(model) -> None:
    from torch.utils._pytree import tree_map

    def each(value):
        return tree_map(lambda x: Each.apply(x) if torch.is_tensor(x) else x, value)

    for module in model.modules():
        module.register_forward_pre_hook(lambda _m, inputs: each(inputs))
        module.register_forward_hook(lambda _m, _inputs, output: each(output))


def worker(args) -> None:
    import torch.distributed as dist
    from transformers import T5Config, T5ForConditionalGeneration

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = T5Config(vocab_size=args.vocab, d_model=args.d_model, d_kv=args.d_model // 4, d_ff=4 * args.d_model,
                      num_layers=args.layers, num_decoder_layers=args.layers, num_heads=4, dropout_rate=0.0,
                      decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in T5ForConditionalGeneration(config).state_dict().items()}
    rows = torch.Generator().manual_seed(1)
    source = torch.randint(2, args.vocab, (args.rows * world, args.source_len), generator=rows)
    target = torch.randint(2, args.vocab, (args.rows * world, args.target_len), generator=rows)
    mine = slice(args.rows * rank, args.rows * (rank + 1))

    def fresh():
        model = T5ForConditionalGeneration(config)
        model.load_state_dict(state)
        return model

    def plain(order=None) -> dict:
        model = fresh()
        if order is not None:
            order(model)
        model(input_ids=source[mine], labels=target[mine]).loss.backward()
        grads = {}
        for name, param in model.named_parameters():
            grad = param.grad.clone()
            dist.all_reduce(grad)
            grads[name] = grad / world
        return grads

    def fsdp() -> dict:
        from lowmem.parallel.sharding import shard_model

        model = shard_model(fresh(), {"reshard_after_forward": True, "offload_params": False}, torch.device("cpu"))
        model.train()
        model(input_ids=source[mine], labels=target[mine]).loss.backward()
        return {name: param.grad.full_tensor() for name, param in model.named_parameters()}

    def zero(stage: int) -> dict:
        import deepspeed
        from deepspeed.utils import safe_get_full_grad

        model = fresh()
        ds_config = {"train_micro_batch_size_per_gpu": args.rows, "gradient_accumulation_steps": 1,
                     "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
                     "zero_allow_untested_optimizer": True}
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                                          config=ds_config)
        engine.backward(engine(input_ids=source[mine], labels=target[mine]).loss)
        return {name: safe_get_full_grad(param).clone() for name, param in engine.module.named_parameters()}

    reference = plain()
    rows_out = [("FSDP", fsdp, fsdp_order)]
    try:
        import deepspeed  # noqa: F401

        rows_out += [("ZeRO-2", lambda: zero(2), None), ("ZeRO-3", lambda: zero(3), zero3_order)]
    except ImportError:
        if rank == 0:
            print("DeepSpeed is not installed (pip install '.[deepspeed]'): FSDP only")
    report = []
    for name, run, order in rows_out:
        grads = run()
        report.append((name, grads, plain(order) if order is not None else reference))
    if rank == 0:
        print(f"T5: d_model {args.d_model}, {args.layers}+{args.layers} layers, vocabulary {args.vocab}; "
              f"{world} processes x {args.rows} rows")
        print(f"{'engine':8} | {'against plain':>26} | {'against plain in its order':>28}")
        for name, grads, ordered in report:
            print(f"{name:8} | {difference(grads, reference):>26} | {difference(grads, ordered):>28}")
    dist.destroy_process_group()


def difference(a: dict, b: dict) -> str:
    gaps = {k: float((a[k] - b[k]).abs().max()) for k in a}
    return f"{max(gaps.values()):.1e} ({sum(g > 0 for g in gaps.values())}/{len(gaps)} tensors)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d_model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--rows", type=int, default=4, help="rows per process")
    parser.add_argument("--source_len", type=int, default=20)
    parser.add_argument("--target_len", type=int, default=12)
    parser.add_argument("--processes", type=int, default=2)
    args = parser.parse_args()
    if "RANK" in os.environ:
        worker(args)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.processes}",
               "--master_port=29531", "-m", "bench.engine_gradients", *sys.argv[1:]]
    done = run_child(command, env=env)
    print(done.output, end="")
    sys.exit(done.rc)


if __name__ == "__main__":
    main()
