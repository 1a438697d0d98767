"""What the peer libraries themselves compute, for the tests that hold qconvert's output to them: compressed-tensors'
int4 round-to-nearest, transformers' logits with every quantized linear's input rounded to fp8 per token; and the
two measures the logit comparisons use. torch, transformers and compressed-tensors are imported on first use."""

from __future__ import annotations

import numpy as np


def compressed_tensors_int4(w: np.ndarray, group: int | None):
    """compressed-tensors' own round-to-nearest: min/max observer per group, calculate_qparams, quantize."""
    import ml_dtypes
    import torch
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    torch_dtypes = {np.dtype(ml_dtypes.bfloat16): torch.bfloat16, np.dtype(np.float16): torch.float16,
                    np.dtype(np.float32): torch.float32}
    t = torch.from_numpy(w.astype(np.float32)).to(torch_dtypes[w.dtype])
    if group:
        args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group)
        g = t.reshape(t.shape[0], -1, group)
        low, high = g.amin(dim=2), g.amax(dim=2)
    else:
        args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="channel")
        low, high = t.amin(dim=1, keepdim=True), t.amax(dim=1, keepdim=True)
    scale, zero_point = calculate_qparams(low, high, args)
    return quantize(t, scale, zero_point, args, dtype=torch.int8).numpy(), scale.float().numpy()


def fp8_per_token(x):
    """x with each token's (last-axis row's) values rounded to E4M3 on the scale absmax / 448."""
    import torch

    scale = x.abs().amax(dim=-1, keepdim=True) / 448.0
    scale = torch.where(scale == 0, torch.finfo(x.dtype).eps, scale)
    return (x / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(x.dtype) * scale


def meant_logits(folder, modules, ids, mask) -> tuple[np.ndarray, int]:
    """Logits of the float folder with every quantized linear's input rounded to fp8 per token, and how many
    linears took the rounding (the rest are fused expert tensors with no Linear module of their own)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    named = dict(model.named_modules())
    hooked = [named[m] for m in modules if isinstance(named.get(m), torch.nn.Linear)]
    for linear in hooked:
        linear.register_forward_pre_hook(lambda _, args: (fp8_per_token(args[0]), *args[1:]))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(np.asarray(ids), dtype=torch.long),
                       attention_mask=torch.tensor(np.asarray(mask), dtype=torch.long)).logits.numpy()
    return logits, len(hooked)


def max_rel(got, want, mask) -> float:
    valid = mask.astype(bool)
    return float(np.abs(got[valid] - want[valid]).max() / np.abs(want[valid]).max())


def cosine(a, b, mask) -> float:
    valid = mask.astype(bool)
    a, b = a[valid].ravel().astype(np.float64), b[valid].ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
