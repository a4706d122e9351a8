"""Benchmarks: each module measures one thing side by side in one run and prints the ratios.

Run one from the repository root: ``python -m bench.<name>`` (``--help`` lists its flags; its docstring gives
its commands and what it measures, docs/benchmarks.md its latest figures). The modules import each other as
``bench.x`` and the project as ``lowmem`` / ``data`` / ``config``, found from the root.

Shared pieces:
    harness             run a child process and read its rusage, time a block, print a side-by-side table
    make_corpus         jsonl training corpora of any size, made from the shipped data
    hub_checkpoint      hub-shaped flan-t5 checkpoints with random weights, written a tensor at a time
    peer_trainers       transformers' Seq2SeqTrainer (map, streaming) and the reference loop, as peers runs them

Against other trainers:
    peers               this trainer beside Seq2SeqTrainer and the reference approach, 10 MB to 1 GB corpora
    seq2seq_loss_check  whether the Seq2SeqTrainer's loss in peers is the per-token mean
    plain_loop          peak host RAM beside a plain PyTorch loop of the same model and batch
    mfu                 model FLOPs utilisation beside a plain loop and the CPU's matrix-product peak
    span_corruption     span-corruption pretraining beside the pairs objective and a nanoT5-style loop
    default_job         the README's default job as a new user runs it, and what it teaches

Memory:
    memory_modes        predicted against measured peak RSS, and step time, of the memory modes
    planner_sweep       the planner's blind test: random combinations of flags
    profile_table       the memory-profile table of docs/memory.md (the planner alone, no training)
    span_rss            span corruption's peak RSS on 1 MB against 500 MB of raw text
    loss_chunks         the LM head and loss: whole logits against chunked
    real_sizes          flan-t5-large / -xl / -xxl shapes: planned and measured peaks, folder sizes
    checksum_cost       verifying a checkpoint's checksums beside loading it

Speed:
    micro_batch         micro-batch size against throughput, and evaluation batches
    packing             --packing=True against unpacked micro-batches on length-skewed pairs
    compile             --torch_compile=True against eager: steps/s, graphs, losses
    encoder_cache_speed SFT step time with the encoder cache and without, interleaved in one process
    int8_step           8-bit frozen weights against float32 ones: step time, one layer and a whole run
    fp16                --mixed_precision=fp16 against float32: eval loss, and a T5 built to overflow
    profile_run         where a run's time goes: phases (py-spy) and operators (torch.profiler)

Numerics:
    order_noise         the float noise floor: the same training with its additions in another order
    engine_gradients    the sharded engines' gradients against DDP's, on 2 CPU processes

On a GPU (gpu_check.sh, gpu_nanot5.sh and gpu_sharding.sh are the scripts a session with a lent GPU runs):
    gpu_profiles        tokens/s and GPU peak per memory profile and preset, and frozen 8-bit weights
    sdpa_shapes         bf16 step time with cuDNN's attention backend on and off
"""
