"""What the processes of a run agree on, and how: the accelerator, the training files' indexes read
once by the main process, and the one small all-reduce per accumulation window that carries every
count a step needs to be the same on all processes (target tokens, examples, bad rows, the memory
guard, whether any process has rows left in the epoch)."""

from __future__ import annotations

import os

import torch

from config import TrainConfig
from data.packing import examples_in
from data.sources.readers import index_file
from lowmem.hardware.memory_use import map_large_blocks, peak_rss_bytes
from lowmem.hardware.precision import PRECISIONS
from lowmem.parallel import peer_watch
from lowmem.parallel.engines import engine_for_launch
from lowmem.utils.errors import UserError
from lowmem.utils.optional import import_accelerate


def start_accelerator(cfg: TrainConfig):
    """The run's ``Accelerator``: device, mixed precision, DDP settings, tracker; seeds every RNG. Also the
    engine the launch config asks for (``lowmem.parallel.engines``): FSDP (the trainer shards the model
    itself: accelerate runs as plain data parallelism then), DeepSpeed (accelerate starts it), or the plain
    engine (one process, or plain data parallelism).

    Returns:
        (accelerator, engine)

    Raises:
        UserError: bf16 on a GPU without it; options the sharded engine does not run with.
    """
    import_accelerate()
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, set_seed

    if torch.cuda.is_available() and not cfg.cpu and PRECISIONS[cfg.mixed_precision].missing_on_gpu():
        raise UserError("--mixed_precision=bf16: this GPU has no bf16 support; use --mixed_precision=fp16 (or no)")
    engine = engine_for_launch()
    engine.check(cfg)
    if engine.shards:
        map_large_blocks()  # gathered weights and gradients, freed at every block, go back to the OS
    # DDP all-reduces through buckets that, by default, are a second copy of every gradient; as
    # views the gradients live in the buckets themselves (one copy fewer per process).
    ddp = DistributedDataParallelKwargs(gradient_as_bucket_view=True)
    options = engine.accelerator_options(cfg.cpu or launched_without_gpu())  # FSDP's read before accelerate starts
    watch = peer_watch.active()
    if watch is not None and watch.launch.max_restarts:  # an attempt's own keys (PeerWatch.init_process_group)
        watch.init_process_group()
    accelerator = Accelerator(cpu=options["cpu"], mixed_precision=PRECISIONS[cfg.mixed_precision].accelerate_name,
                              gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                              kwargs_handlers=[ddp] + options["kwargs_handlers"])
    engine.configure(accelerator, cfg)
    if accelerator.num_processes > 1 and peer_watch.active() is None and cfg.peer_timeout_s:
        peer_watch.PeerWatch.start(cfg.peer_timeout_s)  # a store the process group made (its rank 0 hosts it)
    if accelerator.device.type == "cuda":
        attention_without_shape_plans()
    set_seed(cfg.seed)
    return accelerator, engine


def attention_without_shape_plans() -> None:
    """Keep scaled-dot-product attention off cuDNN's backend, unless ``TORCH_CUDNN_SDPA_PREFERRED=1``.

    On Hopper and Blackwell GPUs recent torch tries cuDNN's attention first for bf16 and fp16, and cuDNN
    builds an execution plan for every new shape (batch, heads, query and key lengths). A seq2seq run
    with dynamic padding meets new shapes at almost every step: source and target lengths vary
    independently, and a frozen encoder runs one row at a time. On an H100 (torch 2.11) each bf16
    fine-tuning step of the base preset took 0.65 s against float32's 0.17 s, where the same model at
    fixed shapes ran bf16 at 61 ms a step and float32 at 80 (docs/benchmarks.md; bench/sdpa_shapes.py
    measures both backends side by side). T5 always passes its position bias as the mask, which flash
    attention does not take, so attention runs on the memory-efficient kernel: no plans, any shape.
    """
    if os.environ.get("TORCH_CUDNN_SDPA_PREFERRED") != "1":
        torch.backends.cuda.enable_cudnn_sdp(False)


def launched_without_gpu() -> bool:
    """Whether a launcher started this process as one of several on a machine without a GPU.

    accelerate starts such processes (``accelerate launch`` with a MULTI_GPU or FSDP config) as CPU
    processes over gloo only when told so (``ACCELERATE_USE_CPU=true`` or ``--cpu=True``); otherwise each
    one would run alone, the whole run on every process. With no GPU to run on, CPU processes are what
    the launch can only mean."""
    return "LOCAL_RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available()


def indexes_from_main(accelerator, files: list) -> list:
    """Row counts and seek points of the training files, read once by the main process and sent to all."""
    return decided_on_main(accelerator, lambda: [index_file(f) for f in files])


def decided_on_main(accelerator, decide):
    """``decide()``'s result on the main process, sent to every process; a ``UserError`` it raised is raised on every
    process alike (none is left waiting for the others)."""
    if accelerator.num_processes == 1:
        return decide()
    from accelerate.utils import broadcast_object_list

    box = [None]
    if accelerator.is_main_process:
        try:
            box = [("ok", decide())]
        except UserError as err:
            box = [("refused", str(err))]
    broadcast_object_list(box)
    outcome, value = box[0]
    if outcome == "refused":
        raise UserError(value)
    return value


def summed(accelerator, values: torch.Tensor) -> torch.Tensor:
    """``values`` summed over processes (a host tensor; itself with one process)."""
    if accelerator.num_processes == 1:
        return values
    return accelerator.reduce(values.to(accelerator.device), "sum").cpu()


def window_counts(accelerator, window: list[dict], stream, epoch: int, over_budget: bool = False) -> dict:
    """Target tokens and examples of one accumulation window: local, and summed over processes.

    Counted on host tensors (no device sync); one small all-reduce when there are several
    processes, which is also how every process learns whether any of them has rows left in this
    epoch after this window, how many bad rows all have met, and whether any is over the memory guard
    (``over_budget``: this process's reading of it).
    """
    local = torch.tensor([sum(int(mb["labels"].ne(-100).sum()) for mb in window),
                          sum(examples_in(mb) for mb in window),
                          stream.problems.counted, int(over_budget),
                          int(not stream.finished_epoch(epoch)), stream.problems.total,
                          sum(int(mb["labels"][:len(mb["attention_mask"])].ne(-100).sum()) for mb in window)])
    total = summed(accelerator, local)
    source_tokens = sum(int(mb["attention_mask"].sum()) for mb in window)
    padded = sum(mb["labels"].numel() + mb["attention_mask"].numel() for mb in window)  # pads included
    return {"local_tokens": int(local[0]), "local_all_tokens": int(local[0]) + source_tokens,
            "local_padded_tokens": padded, "local_rows": sum(len(mb["attention_mask"]) for mb in window),
            "local_examples": int(local[1]),
            "tokens": int(total[0]), "examples": int(total[1]), "bad_rows": int(total[2]),
            "memory": int(total[3]) > 0, "rows_left": int(total[4]) > 0,
            "rows_not_read": int(total[5]),  # the bad rows and the blank lines (bad_rows: those held against the limit)
            "chosen_tokens": int(total[6])}  # a preference pair's chosen answers' (else every target token)


def smallest(accelerator, values: list[int]) -> list[int]:
    """Each of ``values``' smallest over processes (the same answer on all)."""
    if accelerator.num_processes == 1:
        return values
    gathered = accelerator.gather(torch.tensor([values], device=accelerator.device)).cpu()
    return [int(v) for v in gathered.min(dim=0).values]


def any_process(accelerator, flag: bool) -> bool:
    """Whether ``flag`` holds on any process (the same answer on all)."""
    return int(summed(accelerator, torch.tensor([int(flag)]))[0]) > 0


def first_tripped(accelerator, guard) -> tuple[int, str, float]:
    """(process, where its guard tripped, its peak RSS in GiB) of the first process whose memory guard
    (``lowmem.memory.guard.MemoryGuard``) has
    tripped, the same on all; every process calls it once they agree one has (a collective)."""
    from accelerate.utils import gather_object

    mine = (accelerator.process_index, guard.tripped, peak_rss_bytes() / 2**30)
    every = gather_object([mine]) if accelerator.num_processes > 1 else [mine]
    return next(report for report in every if report[1] is not None)
