"""compressed-tensors' own FP4 round-to-nearest and compression, as llm-compressor's QuantizationModifier drives
them (the tests that hold qconvert's NVFP4 and MXFP4 bytes to them): min/max of the weight in its dtype,
generate_gparam for NVFP4's global scale, calculate_qparams per group, the scale kept in the weight's dtype (the
module parameter compressed-tensors registers), then the format's compressor. torch and compressed-tensors are
imported on first use."""

from __future__ import annotations

import ml_dtypes
import numpy as np


def torch_weight(w: np.ndarray):
    import torch

    dtypes = {np.dtype(ml_dtypes.bfloat16): torch.bfloat16, np.dtype(np.float16): torch.float16,
              np.dtype(np.float32): torch.float32}
    return torch.from_numpy(np.asarray(w, np.float32)).to(dtypes[np.dtype(w.dtype)])


def compressed_tensors_fp4(w: np.ndarray, preset: str, global_scale=None) -> dict[str, np.ndarray]:
    """The compressed tensors (weight_packed, weight_scale, weight_global_scale for NVFP4) of one [out, in] weight
    under compressed-tensors preset `preset` (NVFP4A16, NVFP4 or MXFP4A16), as numpy arrays (float8 scales as
    ml_dtypes, bytes unchanged). NVFP4's `global_scale` (a torch float32 [1]) is the weight's own unless given
    (the fused observers' joint one)."""
    import torch
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationStrategy, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    t = torch_weight(w)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    args = scheme.weights
    state = {"weight": t}
    if args.strategy == QuantizationStrategy.TENSOR_GROUP:
        if global_scale is None:
            low, high = torch.aminmax(t)
            global_scale = generate_gparam(low.reshape(1), high.reshape(1))
        state["weight_global_scale"] = global_scale
    groups = t.reshape(t.shape[0], -1, args.group_size)
    scale, _ = calculate_qparams(groups.amin(dim=2), groups.amax(dim=2), args, global_scale=global_scale)
    state["weight_scale"] = scale.to(t.dtype)
    fmt = "nvfp4-pack-quantized" if preset.startswith("NVFP4") else "mxfp4-pack-quantized"
    compressed = BaseCompressor.get_value_from_registry(fmt).compress(state, scheme)
    out = {}
    for name, value in compressed.items():
        if value.dtype == torch.float8_e4m3fn:
            out[name] = value.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
        else:
            out[name] = value.numpy()
    return out


def compressed_tensors_fp4_decompressed(tensors: dict[str, np.ndarray], preset: str):
    """compressed-tensors' decompression of a folder's tensors of one linear: the float weight it stands for
    (torch, in the decompressor's dtype)."""
    import torch
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    state = {}
    for name, value in tensors.items():
        if value.dtype == ml_dtypes.float8_e4m3fn:
            state[name] = torch.from_numpy(value.view(np.uint8)).view(torch.float8_e4m3fn)
        else:
            state[name] = torch.from_numpy(np.ascontiguousarray(value))
    fmt = "nvfp4-pack-quantized" if preset.startswith("NVFP4") else "mxfp4-pack-quantized"
    scheme = preset_name_to_scheme(preset, ["Linear"])
    return BaseCompressor.get_value_from_registry(fmt).decompress(state, scheme)["weight"]
