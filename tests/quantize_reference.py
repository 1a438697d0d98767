"""Independent numpy statements of the FORMATS.md rules, used as references by the quantize/convert tests."""

import json

import ml_dtypes
import numpy as np

# The 16 NF4 levels typed out again from FORMATS.md, so tests do not lean on the code's table.
LEVELS = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
    0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0], dtype=np.float32)


def numpy_int8(w: np.ndarray, scale_dtype):
    """Per-row scale = absmax/127 (floored away from 0, rounded to scale_dtype), q = rint(w/scale) in [-127, 127]."""
    w32 = w.astype(np.float32)
    absmax = np.abs(w32).max(axis=1, keepdims=True)
    # Clamped away from 0 by a floor that the scale dtype can hold (fp16 cannot hold 1e-8).
    floor = max(1e-8, float(ml_dtypes.finfo(scale_dtype).smallest_subnormal))
    scale = np.maximum(absmax / np.float32(127), np.float32(floor)).astype(scale_dtype)
    q = np.clip(np.rint(w32 / scale.astype(np.float32)), -127, 127).astype(np.int8)
    return q, scale


def unpack_int32_words(packed: np.ndarray, cols: int) -> np.ndarray:
    """compressed-tensors 8-bit pack-quantized words -> int8 codes, by shifting bits out of each word."""
    words = packed.astype(np.int64) & 0xFFFFFFFF
    u = np.stack([(words >> (8 * j)) & 0xFF for j in range(4)], axis=-1).reshape(packed.shape[0], -1)
    return (u[:, :cols] - 128).astype(np.int8)


def numpy_nf4(w: np.ndarray, block: int = 64):
    """Packed NF4 bytes (earlier element high) and float32 absmax per block, thresholds at level midpoints.

    Scaled as bitsandbytes scales: a whole block times float32 1/absmax, a partial
    last block divided by its absmax raised to at least 1e-38; an odd count pads the code of 0.0.
    """
    flat = w.astype(np.float32).ravel()
    n = flat.size
    nblocks = -(-n // block)
    padded = np.zeros(nblocks * block, np.float32)
    padded[:n] = flat
    blocks = padded.reshape(nblocks, block)
    absmax = np.abs(blocks).max(axis=1)
    if n % block:
        absmax[-1] = max(absmax[-1], np.float32(1e-38))
    safe = np.where(absmax > 0, absmax, np.float32(1))
    norm = blocks * (np.float32(1) / safe)[:, None]
    if n % block:
        norm[-1] = blocks[-1] / safe[-1]
    norm = norm.ravel()[:n]
    midpoints = (LEVELS[:-1] + LEVELS[1:]) / np.float32(2)
    # A value strictly above k midpoints gets code k: a tie stays on the lower code.
    codes = (norm[:, None] > midpoints[None, :]).sum(axis=1).astype(np.uint8)
    if n % 2:
        codes = np.append(codes, np.uint8(7))
    return ((codes[0::2] << 4) | codes[1::2]).astype(np.uint8), absmax.astype(np.float32)


# The same 16 NF4 levels as float64 (the literals themselves, not LEVELS' float32 roundings).
NF4_FLOAT64 = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
    0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
])


def dequantize_file(tensors, module, scheme):
    """The float64 [out, in] weight a layout stores, decoded here with numpy from FORMATS.md."""
    if scheme == "int8":
        out_f, in_f = tensors[f"{module}.weight_shape"]
        words = tensors[f"{module}.weight_packed"].astype(np.int64) & 0xFFFFFFFF
        bytes_ = np.stack([(words >> (8 * j)) & 0xFF for j in range(4)], axis=-1).reshape(out_f, -1)
        codes = bytes_[:, :in_f] - 128
        return codes * tensors[f"{module}.weight_scale"].astype(np.float64)
    if scheme == "w8a8":
        return tensors[f"{module}.weight"].astype(np.float64) * tensors[f"{module}.weight_scale"].astype(np.float64)
    state = json.loads(tensors[f"{module}.weight.quant_state.bitsandbytes__nf4"].tobytes())
    packed = tensors[f"{module}.weight"].reshape(-1).astype(np.int64)
    codes = np.stack([packed >> 4, packed & 15], axis=-1).reshape(-1)
    n = int(np.prod(state["shape"]))
    absmax = np.repeat(tensors[f"{module}.weight.absmax"].astype(np.float64), 64)[:n]
    return (NF4_FLOAT64[codes[:n]] * absmax).reshape(state["shape"])


def per_token_fake_quant(x):
    scale = np.abs(x).max(axis=1, keepdims=True) / 127
    scale = np.where(scale > 0, scale, 1.0)
    return np.clip(np.rint(x.astype(np.float32) / scale.astype(np.float32)), -127, 127) * scale
