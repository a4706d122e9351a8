"""Products with frozen weights stored narrower than they compute: 8-bit layers (``lowmem.model.quantize``) and
bf16-stored matrices (``--frozen_dtype``, and what stays bf16 beside 8-bit layers: ``wo``, the embeddings, a frozen
untied head).

Where the hardware multiplies the narrow dtype fast (``lowmem.hardware.capability``: a GPU from Ampere on, a CPU with
AMX or AVX-512 BF16), a bf16 matrix computes in bf16 as stored. Where it does not (a CPU with AVX2 only: ~100x slower
than float32), it computes in float32 a block of rows at a time: ``BLOCK_BYTES`` of the weight converted into one
reused buffer, multiplied, then the next block, forward and backward, so storage stays narrow and the product runs at
float32's rate. 8-bit weights always compute this way on the CPU, in their scales' dtype.
"""

from __future__ import annotations

import functools
import threading

import torch

from lowmem.hardware.probe import computes_fast

# Float bytes of a narrow weight that one product holds at a time (a block of its rows), in one buffer every product
# of the thread reuses (``scratch``). Smaller blocks measured slower (forward + input gradient of a 1024 x 2816 layer
# over 20 tokens: 6.1 ms at 4 MiB, 7.6 at 512 KiB, 18.5 at 64 KiB; float32's own 4.9).
BLOCK_BYTES = 2**22
_SCRATCH = threading.local()  # per thread: {(dtype, device, elements): buffer}


def scratch(elements: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A buffer of ``elements`` reused from product to product. A fresh 4 MiB allocation per product would be a new
    mapping under ``map_large_blocks``' 1 MiB threshold (8-bit runs set it), its 1,024 pages faulted in at every
    use: at flan-t5-large's shape that was most of the 8-bit layers' cost over float32 ones."""
    buffers = _SCRATCH.__dict__.setdefault("buffers", {})
    key = (dtype, str(device), elements)
    if key not in buffers:
        buffers[key] = torch.empty(elements, dtype=dtype, device=device)
    return buffers[key]


def float_blocks(data: torch.Tensor, dtype: torch.dtype):
    """(row slice, those rows of ``data`` converted to ``dtype``) over ``data``, in one reused buffer of at
    most ``BLOCK_BYTES`` (or one row): the next block overwrites the last."""
    columns = data.shape[1]
    step = max(1, BLOCK_BYTES // (columns * dtype.itemsize))
    buffer = scratch(step * columns, dtype, data.device)
    for start in range(0, data.shape[0], step):
        part = slice(start, min(start + step, data.shape[0]))
        block = buffer[: (part.stop - start) * columns].view(part.stop - start, columns)
        block.copy_(data[part])
        yield part, block


class BlockLinear(torch.autograd.Function):
    """``x W^T`` and its input gradient ``dy W`` for a frozen ``W = scale * data`` (a scale per row; no scale for a
    narrow float weight), computed in ``dtype`` converting ``BLOCK_BYTES`` of rows at a time; the scales multiply
    the product's columns. Saves no activation: the weight gets no gradient, so backward needs only the weight."""

    @staticmethod
    def forward(ctx, x, data, scale, dtype):
        ctx.save_for_backward(data, scale)
        ctx.input_dtype, ctx.dtype = x.dtype, dtype
        with torch.autocast(x.device.type, enabled=False):  # in ``dtype``, whatever autocast says
            rows = x.reshape(-1, x.shape[-1]).to(dtype)
            # each block's product made anew, then joined: torch.mm(..., out=) into a slice took ~200 us more a
            # product (1024 x 1024 over 20 tokens: 863 against 666 us), more than joining the small outputs
            parts = [torch.mm(rows, block.t()) for _, block in float_blocks(data, dtype)]
            out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
            if scale is not None:
                out.mul_(scale.reshape(1, -1))
        return out.reshape(*x.shape[:-1], data.shape[0])

    @staticmethod
    def backward(ctx, grad):
        data, scale = ctx.saved_tensors
        dtype = ctx.dtype
        with torch.autocast(grad.device.type, enabled=False):
            scaled = grad.reshape(-1, data.shape[0]).to(dtype)
            if scale is not None:
                scaled = scaled * scale.reshape(1, -1)
            # summed over the blocks in float32: a bf16 sum would round at every block (the error grows with
            # their number; with 86 blocks, 3 % of the largest element)
            grad_x = None
            for part, block in float_blocks(data, dtype):
                if grad_x is None:  # the first block's product is the sum so far (no out=: slower, see forward)
                    grad_x = torch.mm(scaled[:, part], block).float()
                elif dtype == torch.float32:  # (addmm_ would do the same; FlopCounterMode counts only this)
                    torch.addmm(grad_x, scaled[:, part], block, out=grad_x)
                else:
                    grad_x.add_(torch.mm(scaled[:, part], block))
        return grad_x.reshape(*grad.shape[:-1], data.shape[1]).to(ctx.input_dtype), None, None, None


def compute_beside_narrow(model) -> None:
    """Let bf16-stored frozen weights work in a float32 model: embedding lookups come out float32, and a bf16
    linear layer computes as ``narrow_linear_forward`` says and gives float32 back. ``wo`` casts its own input to its
    weight's dtype (transformers' T5), and the residual stream adding its output stays float32. So the residual
    stream keeps the precision it has with float32 weights."""
    # Each stack looks its tokens up through its own embed_tokens module (holding the shared weight):
    # model.shared itself never runs in a forward, so the hook goes on every bf16 lookup table.
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding) and module.weight.dtype == torch.bfloat16:
            module.register_forward_hook(lambda _module, _args, out: out.float())
        elif type(module) is torch.nn.Linear and module.weight.dtype == torch.bfloat16:
            # as accelerate's hooks do: the instance's forward, so peft's adapters and the state dict see the layer
            module.forward = functools.partial(narrow_linear_forward, module)


def narrow_linear_forward(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A bf16-stored frozen linear layer's forward, float32 out: in bf16 where bf16 products are fast on ``x``'s
    device (outside autocast its input cast to bf16), else in float32 a block of rows at a time."""
    weight = layer.weight
    if computes_fast(weight.dtype, x.device.type) or type(x) is not torch.Tensor:
        if not torch.is_autocast_enabled(x.device.type):
            x = x.to(weight.dtype)
        return torch.nn.Linear.forward(layer, x).float()
    out = BlockLinear.apply(x, weight, None, torch.float32)
    return out if layer.bias is None else out + layer.bias.float()
