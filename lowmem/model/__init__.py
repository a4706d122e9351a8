"""The model a run trains, from its source to the folder it is exported as.

- ``source``: ``--init_from`` as a folder or hub id, its family, its tokenizer.
- ``streamed_load``: a checkpoint read one block at a time straight into the form the run trains in.
- ``weight_headers``: each weight file checked from its header alone (safetensors, torch zips; pickles
  refused), and an index's files kept inside its folder.
- ``weight_files``: a model folder's weight files read a few tensors at a time, and their fingerprint.
- ``weight_check``: a model folder's config.json against its weights' headers (names, shapes, dtypes),
  before anything heavy reads it and before an export is moved into place.
- ``build``: the model built, loaded, frozen, adapted and stored narrow, and its export state dict.
- ``quantize``: frozen linear layers in 8 bits (optimum-quanto), and back to float for exports.
- ``narrow_compute``: products with frozen weights stored narrower than they compute (8-bit, bf16): in float32 a
  block of rows at a time where the narrow dtype is slow on the device (``lowmem.hardware``).
- ``adapters``: LoRA runs exported as peft adapter folders, and loaded back onto their base model.
- ``merge``: a whole model's tensors for the ``export`` command, each made as its shard is written: read from the
  files, a checkpoint's tensor in place, LoRA merged in, cast.
- ``loss``: the loss a step trains on (LM head at the target tokens only, summed token losses).
- ``packed_attention``: the attention masks and decoder inputs of packed rows (``--packing``).
- ``chunked_loss``: the LM head and cross-entropy a chunk of target tokens at a time (``--loss_chunk_size``).
- ``chunked_logprobs``: each target token's log-probability under the LM head a chunk at a time (preference tuning).
- ``answer_logprobs``: each answer's summed log-probability for preference pairs, each prompt encoded once.
- ``compiled``: the encoder and decoder stacks compiled for training, once per length bucket (``--torch_compile``).
"""
