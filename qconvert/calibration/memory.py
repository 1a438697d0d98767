"""How much memory layer-by-layer calibration needs: a bound from the model's shapes and the sample count.

Calibration holds, at its peak, the float32 hidden states of every sample
(the layer's input, its output and the concatenation of the batches' outputs:
3 x N x T x H x 4 bytes), one layer's weights as stored plus the float32 copy
the compiled layer computes with, and one batch's work inside the layer: the
linears' outputs (B x T x the sum of the layer's output features, and the
inputs again, in float32) and the attention scores with their softmax
(2 x B x heads x T x T x 4 bytes), for two batches (dispatch runs one batch
ahead of the device, no further). Before the layers, the embedding table is
read and converted to float32; after them, the head's tensors. The host holds
the tensors read from disk (one layer's, or the embedding or head) and the rows
sampled for the alpha and scale searches. On a CPU the device is the host: the
two add up. XLA's compiler and runtime take a fixed amount on top
(RUNTIME_BYTES, measured on this project's CPU runs).

With GPTQ, each linear's input Hessian (in x in float32) is summed on the device
over the layer's batches (each batch's product and the running sum: two per
linear, counted without the sharing of q/k/v and gate/up, an upper bound), the
rounding of one linear holds a few [in, in] and [out, in] matrices, and the
sequential mode keeps the layer's input beside its two outputs (float and
quantized weights): a fourth N x T x H copy.

With a MoE layer's experts split over D devices (calibration/expert_parallel.py),
a device holds ceil(E / D) of every projection's E experts and their Hessians
(the sum and one batch's product), the rows every device's batch routes (each
token's top_k rows, in and out of each projection, D batches) and the other
linears and Hessians as in data parallel; the host also holds the experts
stacked for placing.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np

# XLA compilation, runtime buffers and allocator slack beside the arrays counted here: up to about
# 0.7 GB more than the arrays were measured on a loaded 2-core machine (about 0.1 GB on a quiet one).
RUNTIME_BYTES = 768 * 2**20
F32 = 4


@dataclasses.dataclass(frozen=True)
class ModelShapes:
    """What the estimate needs to know of a model: sizes in elements and bytes."""

    hidden: int
    heads: int
    layer_bytes: int        # the largest layer's tensors as stored
    layer_elements: int     # ... in elements
    layer_width: int        # sum over the layer's linears of out + in features (per token, float32)
    embed_bytes: int
    embed_elements: int
    head_bytes: int
    layer_inputs: int       # sum of the layer's linear input widths (rows kept per linear)
    hessian_elements: int = 0   # sum over the layer's linears of in * in
    largest_linear: int = 0     # the largest in * (in + out) of the layer's linears
    experts: int = 0            # E: experts a projection of the layer has (0: no MoE layer)
    expert_bytes: int = 0       # of layer_bytes, the experts' weights
    expert_elements: int = 0    # ... in elements
    expert_hessian_elements: int = 0  # of hessian_elements, the experts'
    routed_width: int = 0       # per token: top_k x the sum over one expert's projections of out + in

    @classmethod
    def of(cls, model, shape: Callable[[str], tuple[int, ...]], itemsize: Callable[[str], int]) -> "ModelShapes":
        """Read the sizes from `shape(name)` / `itemsize(name)` of the checkpoint's tensors (no tensor is read)."""
        def size(names):
            names = [n for n in names if _has(shape, n)]
            return (sum(math.prod(shape(n)) * itemsize(n) for n in names), sum(math.prod(shape(n)) for n in names))

        from qconvert.calibration.expert_parallel import expert_stacks

        layers = [size(model.layer_tensor_names(i)) for i in range(model.num_layers)] or [(0, 0)]
        big = max(range(len(layers)), key=lambda i: layers[i][0])
        linears = [shape(f"{m}.weight") for m in model.layer_linears(big) if _has(shape, f"{m}.weight")]
        stacks = [[n for n in names if _has(shape, n)]
                  for names in expert_stacks(model.layer_tensor_names(big)).values()]
        stacks = [names for names in stacks if names]
        expert_bytes, expert_elements = size([n for names in stacks for n in names])
        top_k = int(getattr(getattr(model, "moe", None), "num_experts_per_tok", 0) or 1)
        embed_bytes, embed_elements = size(model.embed_tensor_names())
        head_bytes, _ = size(model.head_tensor_names())
        args = model.args
        return cls(hidden=int(args.hidden_size), heads=int(args.num_attention_heads),
                   layer_bytes=layers[big][0], layer_elements=layers[big][1],
                   layer_width=sum(o + i for o, i in linears), embed_bytes=embed_bytes,
                   embed_elements=embed_elements, head_bytes=head_bytes,
                   layer_inputs=sum(i for _, i in linears), hessian_elements=sum(i * i for _, i in linears),
                   largest_linear=max((i * (i + o) for o, i in linears), default=0),
                   experts=max((len(names) for names in stacks), default=0), expert_bytes=expert_bytes,
                   expert_elements=expert_elements,
                   expert_hessian_elements=sum(shape(n)[-1] ** 2 for names in stacks for n in names),
                   routed_width=top_k * sum(sum(shape(names[0])[-2:]) for names in stacks))


def _has(shape, name: str) -> bool:
    try:
        shape(name)
    except (KeyError, ValueError):
        return False
    return True


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Peak bytes of a calibration run: on the (first) device, and on the host beside it."""

    device_bytes: int
    host_bytes: int        # host memory beside the device's (on a CPU: add device_bytes)
    batch_bytes: int       # of device_bytes, the part one batch adds (what --batch-size scales)

    def total_on_cpu(self) -> int:
        """The process's growth when the device is the host (plus XLA's runtime)."""
        return self.device_bytes + self.host_bytes + RUNTIME_BYTES


def estimate(shapes: ModelShapes, samples: int, seqlen: int, batch_size: int,
             sample_rows: int = 512, *, hessians: bool = False, sequential: bool = False,
             devices: int = 1, experts_split: bool = False) -> MemoryEstimate:
    """The peak memory of calibrating on `samples` x `seqlen` tokens, `batch_size` samples per batch and device;
    `hessians`: with GPTQ's Hessians, `sequential`: with each layer run again on its quantized weights;
    `devices`: how many the batches are split over (each then also holds the blocks of every device's Hessians
    it adds, and its block of the running sum, old and new: runner._ordered_fold); `experts_split`: a MoE
    layer's experts split over them too (each holds its own experts and their Hessians, and every device's
    routed rows)."""
    n, t, b = samples, seqlen, min(batch_size, samples)
    split = _splits(shapes, experts_split, devices)
    # Of the experts, the share a device holds: all of them, or ceil(E / devices) whole ones.
    share = -(-shapes.experts // devices) / shapes.experts if split else 1.0
    hidden = n * t * shapes.hidden * F32
    # Two batches in flight at most (the runner waits for the one before the last).
    batch = 2 * (b * t * F32 * (shapes.layer_width + 2 * shapes.hidden) + 2 * b * shapes.heads * t * t * F32)
    if split:  # every device's batch's routed rows, in and out of each projection
        batch += 2 * devices * b * t * shapes.routed_width * F32
    embed_phase = 2 * hidden + shapes.embed_bytes + shapes.embed_elements * F32
    weights = shapes.layer_bytes - (1 - share) * shapes.expert_bytes
    elements = shapes.layer_elements - (1 - share) * shapes.expert_elements
    layer_phase = (4 if sequential else 3) * hidden + weights + elements * F32 + batch
    if hessians:
        copies = 2 if devices <= 1 else 2 + 2 / devices  # one batch's product, and the sum (or, split: its blocks)
        dense = shapes.hessian_elements - (shapes.expert_hessian_elements if split else 0)
        layer_phase += copies * dense * F32 + 4 * shapes.largest_linear * F32
        if split:  # an expert's owner holds its sum and one batch's product
            layer_phase += 2 * share * shapes.expert_hessian_elements * F32
    head_phase = hidden + shapes.head_bytes
    device = max(embed_phase, layer_phase, head_phase)
    rows = min(sample_rows, n * t) * shapes.layer_inputs * F32
    host = max(shapes.layer_bytes + (shapes.expert_bytes if split else 0), shapes.embed_bytes,
               shapes.head_bytes) + rows
    return MemoryEstimate(int(device), int(host), int(batch))


def _splits(shapes: ModelShapes, experts_split: bool, devices: int) -> bool:
    """Whether `experts_split` splits anything: a MoE layer, and more than one device to split it over."""
    return experts_split and devices > 1 and shapes.experts > 0


def split_experts(shapes: ModelShapes, samples: int, seqlen: int, device_limit: int | None, *, devices: int,
                  hessians: bool = False, sequential: bool = False) -> bool:
    """Whether calibration splits a MoE layer's experts over the devices (--shard-experts auto): with more
    than one device that states its memory, when the layer with every expert on each device does not fit it
    even a window a batch."""
    if not _splits(shapes, True, devices) or device_limit is None:
        return False
    return estimate(shapes, samples, seqlen, 1, hessians=hessians, sequential=sequential,
                    devices=devices).device_bytes > device_limit


def device_budget(device) -> int | None:
    """Bytes the device can hold (its allocator's limit), or None where jax does not say (CPU)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def fit_batch_size(shapes: ModelShapes, samples: int, seqlen: int, batch_size: int, budget: int, *,
                   hessians: bool = False, sequential: bool = False, devices: int = 1,
                   experts_split: bool = False) -> int:
    """The largest batch size up to `batch_size` whose estimate fits `budget` bytes (at least 1)."""
    for b in range(max(1, batch_size), 0, -1):
        if estimate(shapes, samples, seqlen, b, hessians=hessians, sequential=sequential,
                    devices=devices, experts_split=experts_split).device_bytes <= budget:
            return b
    return 1


def checkpoint_shapes(model, params) -> ModelShapes:
    """ModelShapes of a model over a CheckpointParams-like Mapping (shapes from its index, else the arrays)."""
    checkpoint = getattr(params, "checkpoint", None)
    if checkpoint is not None:
        def shape(name):
            if name not in checkpoint:
                raise KeyError(name)
            return tuple(checkpoint.shape(name))

        return ModelShapes.of(model, shape, lambda name: np.dtype(checkpoint.dtype(name)).itemsize)
    return ModelShapes.of(model, lambda name: tuple(np.shape(params[name])),
                          lambda name: np.asarray(params[name]).dtype.itemsize)


def check_fits(shapes: ModelShapes, samples: int, seqlen: int, device_limit: int | None, *, hessians: bool = False,
               sequential: bool = False, what: str = "calibrating", flags: str = "--calib-samples or a shorter "
               "--calib-seqlen", devices: int = 1, experts_split: bool = False) -> None:
    """UsageError (exit 2, one line naming the estimate) when `samples` x `seqlen` tokens cannot fit even one
    window a batch: on a device that states its memory (`device_limit`), its limit; on a CPU (None), the
    memory this machine has available. Checked before the windows are made, so nothing is allocated first."""
    from qconvert.formats.errors import UsageError

    need = estimate(shapes, samples, seqlen, 1, hessians=hessians, sequential=sequential, devices=devices,
                    experts_split=experts_split)
    if device_limit is not None:
        have, bytes_needed, where = device_limit, need.device_bytes, "on each device"
        if _splits(shapes, experts_split, devices):
            where += f" with the experts split over {devices} devices"
        source = ""
    else:
        from qconvert.calibration.memory_limits import available

        headroom, bytes_needed = available(), need.total_on_cpu()
        have = None if headroom is None else headroom.bytes
        machine = headroom is not None and headroom.source == "this machine's available memory"
        where = "of this machine's memory" if machine else "of host memory"
        source = "" if headroom is None or machine else f" under {headroom.source}"
    if have is None or bytes_needed <= have:
        return
    raise UsageError(f"{what} on {samples:,} x {seqlen:,} tokens needs about {bytes_needed / 2**30:,.1f} GiB "
                     f"{where} even one window at a time (every window's hidden states, one layer's weights"
                     f"{' and Hessians' if hessians else ''}), and {have / 2**30:,.1f} GiB is there{source}; "
                     f"fewer {flags}")
