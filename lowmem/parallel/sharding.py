"""Sharded training with FSDP2 (``torch.distributed.fsdp.fully_shard``), applied by the trainer itself.

Why not through accelerate: accelerate runs CPU processes as MULTI_CPU and silently applies no FSDP
there, and its FSDP plugin fails on T5 in transformers 5 (``encoder.embed_tokens`` and
``decoder.embed_tokens`` are two modules holding the one shared Parameter). So an ``accelerate launch``
with an FSDP config (``ACCELERATE_USE_FSDP``) is read by ``lowmem.parallel.engines.FSDPEngine``, accelerate
itself is started without it, and the model is sharded here with torch's own API: each block (``T5Block``,
``MT5Block``, ``UMT5Block``) is one unit, then the root, which keeps the shared embedding (and a head tied
to it) in one group.

Under sharding every forward is a collective (each unit's weights are all-gathered), so every process
must run the same number of forwards: ``equal_count`` gives the count to pad windows and eval passes to.

Checkpoints hold each process's shard as it is (``local_state``: the local tensors of the sharded
weights and optimizer state, written by that process); an export gathers the whole weights
(``full_state_dict``) into a plain ``save_pretrained`` folder.
"""

from __future__ import annotations

import contextlib
import warnings

import torch


def blocks(model) -> list:
    """The transformer blocks of a T5-family model: FSDP's units. Found by place (``encoder.block``,
    ``decoder.block``), not by class: ``MT5Block`` and ``UMT5Block`` are copies of ``T5Block``, not
    subclasses, and an ``isinstance`` test left an mT5 or umT5 model one unit, gathered whole."""
    return [block for stack in (model.encoder, model.decoder) for block in stack.block]


def shard_model(model, settings: dict, device: torch.device):
    """Shard ``model`` in place over all processes: each T5 block, then the root."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    # torch 2.13 warns, in every run, that a block returns a view (T5's hidden states): an in-place op on it
    # would skip FSDP's pre-backward hook. Nothing in T5 changes a block's output in place, and the gradients
    # are DDP's to float order (tests/test_sharding.py): nothing to act on.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    model.to(device)
    options = {"reshard_after_forward": settings["reshard_after_forward"],
               "offload_policy": CPUOffloadPolicy() if settings["offload_params"] and device.type == "cuda"
               else OffloadPolicy()}
    for block in blocks(model):
        fully_shard(block, **options)
    # the root keeps torch's default: not resharded after forward (backward, or generate's next
    # pass, needs its weights at once)
    fully_shard(model, **{**options, "reshard_after_forward": None})
    # FSDP sets its units up at the root's first forward; a frozen encoder, run outside it, would come
    # first and set itself up as a root. One forward of one token (no dropout, no gradient) does it now.
    training = model.training
    model.eval()
    with torch.no_grad():
        one = torch.ones(1, 1, dtype=torch.long, device=device)
        model(input_ids=one, attention_mask=one, decoder_input_ids=one)
    model.reshard()  # the root is not resharded after a forward (it expects a backward)
    model.train(training)
    return model


def is_sharded(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def runs_deepspeed(accelerator) -> bool:
    """Whether accelerate runs a DeepSpeed engine (ZeRO: forwards and backwards are collectives too)."""
    return accelerator.distributed_type == "DEEPSPEED"


def plain(tensor):
    """A sharded tensor's local part (a plain tensor as it is)."""
    return tensor.to_local() if type(tensor).__name__ == "DTensor" else tensor


def full_value(tensor) -> torch.Tensor:
    """The whole value of a (possibly sharded) scalar or tensor, e.g. a gradient norm."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def equal_count(count: int, world: int) -> int:
    """The largest ``count`` over the processes (every process calls this)."""
    return equal_counts([count], world)[0]


def equal_counts(counts: list[int], world: int) -> list[int]:
    """Each of ``counts``, the largest over the processes (every process calls this, with as many counts)."""
    if world == 1:
        return list(counts)
    import torch.distributed as dist

    values = torch.tensor(counts, dtype=torch.int64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values.tolist()


@contextlib.contextmanager
def whole_root(model):
    """While inside, the root's own weights (the shared embedding) are whole on every process, so parts
    of the model may run outside its forward (``generate``'s encoder pass, a frozen encoder under
    no_grad); a model not sharded is left as it is."""
    if not is_sharded(model):
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        model.reshard()


def full_state_dict(model) -> dict:
    """The whole weights on the host of the main process (empty elsewhere), each tied tensor once;
    every process calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # One entry per tensor: the gathered copies of a tied weight (the shared embedding under its other
    # names, a tied head) would be written apart, where save_pretrained stores it once.
    first = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(param), name)
    kept = set(first.values()) | {name for name, _ in model.named_buffers()}
    return {name: value for name, value in whole.items() if name in kept}


def weights_finite(model) -> bool:
    """Whether every weight is finite (sharded: every process's shard; the same answer on all)."""
    local = all(bool(torch.isfinite(plain(p)).all()) for p in model.parameters())
    if not is_sharded(model):
        return local
    return equal_count(int(not local), torch.distributed.get_world_size()) == 0


def padded_window(window: list, empty, world: int) -> list:
    """``window`` padded with ``empty()`` items (micro-batches with no target token: zero gradient; eval
    batches whose results are discarded) to the longest of any process: under sharding every forward is
    a collective."""
    return window + [empty() for _ in range(equal_count(len(window), world) - len(window))]


def local_state(model, optimizer) -> tuple[dict, dict]:
    """(this process's weight shards by name, its optimizer state with sharded tensors made local and the
    entries that were sharded listed under ``"sharded"``), to be written by this process."""
    from torch.distributed.tensor import DTensor

    weights = {name: plain(p).detach().contiguous() for name, p in model.named_parameters()}
    state = optimizer.state_dict()
    sharded, local = [], {}
    for index, entries in state["state"].items():
        local[index] = dict(entries)  # a copy: state_dict() holds the optimizer's own entries
        for key, value in entries.items():
            if isinstance(value, DTensor):
                local[index][key] = value.to_local()
                sharded.append([index, key])
    return weights, {**state, "state": local, "sharded": sharded}


def load_local_state(model, optimizer, weights: dict, optimizer_state: dict) -> None:
    """Restore what ``local_state`` gave, in place (the same number of processes, the same shards)."""
    from torch.distributed.tensor import DTensor

    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in weights.items():
            plain(params[name]).copy_(value)
    sharded = optimizer_state.pop("sharded", [])
    optimizer.load_state_dict(optimizer_state)
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds the torch optimizer
    by_index = [p for group in inner.param_groups for p in group["params"]]
    for index, key in sharded:
        param = by_index[int(index)]
        inner.state[param][key] = DTensor.from_local(inner.state[param][key], param.device_mesh,
                                                         param.placements, run_check=False, shape=param.shape,
                                                         stride=param.stride())


def shard_group(tensor):
    """The process group ``tensor`` is sharded over along its first dimension (FSDP2), or None for a
    whole tensor."""
    if type(tensor).__name__ != "DTensor":  # before importing torch.distributed.tensor: plain runs never do
        return None
    from torch.distributed.tensor import Shard

    if tuple(tensor.placements) != (Shard(0),):
        raise NotImplementedError(f"a tensor sharded as {tensor.placements}; only (Shard(0),) is handled")
    return tensor.device_mesh.get_group()
