"""FP8-shipped checkpoints made from a bfloat16 one, and their dequantized copies, written plainly with numpy and
torch: the references the quantized-source tests judge qconvert's reading against.

The e4m3 codes and e8m0 scales are decoded here from their bit fields, the products taken exactly in float64,
rounded once to float32 (what a float32 multiply gives) and then to bfloat16 by round-to-nearest-even on the
bits: no part of qconvert and no float8 cast of a library is used to read the bytes back.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np

E4M3_MAX = 448.0


def e4m3_table() -> np.ndarray:
    """The value of each of the 256 float8_e4m3fn codes (float64): sign, 4 exponent bits (bias 7), 3 mantissa
    bits; exponent 0 is subnormal; S.1111.111 is NaN; no infinities."""
    code = np.arange(256)
    exponent, mantissa = (code >> 3) & 0xF, code & 0x7
    magnitude = np.where(exponent == 0, mantissa / 8 * 2.0 ** -6, (1 + mantissa / 8) * 2.0 ** (exponent - 7.0))
    magnitude[(exponent == 15) & (mantissa == 7)] = np.nan
    return np.where(code & 0x80, -magnitude, magnitude)


def e8m0_values(raw: np.ndarray) -> np.ndarray:
    """float8_e8m0fnu bytes as float64: 2^(byte - 127) (0xFF is NaN)."""
    raw = np.asarray(raw, np.uint8)
    return np.where(raw == 0xFF, np.nan, 2.0 ** (raw.astype(np.float64) - 127))


def bfloat16_bits(value32: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (nearest, ties to even) as uint16 bits (finite values)."""
    bits = np.asarray(value32, np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def dequantized_by_hand(codes: np.ndarray, scales: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """bfloat16 bits of fp8 codes (uint8 [out, in]) times their block's scale (float64 grid), partial edge blocks
    included: the float32 product rounded to bfloat16."""
    out, cols = codes.shape
    expanded = np.repeat(np.repeat(scales, block[0], axis=0), block[1], axis=1)[:out, :cols]
    return bfloat16_bits((e4m3_table()[codes] * expanded).astype(np.float32))


def quantize_blocks(weight: np.ndarray, block: tuple[int, int], *, power_of_two: bool = False,
                    scale_dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 e4m3 codes, scales) of a float weight: per block, scale = absmax / 448 (rounded to `scale_dtype`,
    or up to a power of two), codes = weight / scale rounded to e4m3 (the producer's side, as the FP8 releases
    make them)."""
    out, cols = weight.shape
    rows_b, cols_b = -(-out // block[0]), -(-cols // block[1])
    padded = np.zeros((rows_b * block[0], cols_b * block[1]), np.float32)
    padded[:out, :cols] = weight
    absmax = np.abs(padded.reshape(rows_b, block[0], cols_b, block[1])).max(axis=(1, 3))
    scale = np.maximum(absmax, 1e-12) / E4M3_MAX
    scale = 2.0 ** np.ceil(np.log2(scale)) if power_of_two else scale
    scale = scale.astype(scale_dtype).astype(np.float32)
    expanded = np.repeat(np.repeat(scale, block[0], axis=0), block[1], axis=1)[:out, :cols]
    codes = (weight / expanded).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return codes, scale.astype(scale_dtype)


def is_block_linear(name: str, shape) -> bool:
    """A decoder-layer linear the FP8 releases quantize: not embeddings, norms, lm_head or the MoE router
    (DeepSeek-V3's kv_a_proj_with_mqa included, as its release has it)."""
    return (name.startswith("model.layers.") and name.endswith(("_proj.weight", "_proj_with_mqa.weight"))
            and len(shape) == 2)


def _read(folder: Path) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def as_torch(array: np.ndarray, dtype):
    """A numpy array's bytes as a torch tensor of `dtype` (the same itemsize)."""
    import torch

    raw = np.ascontiguousarray(array)
    return torch.from_numpy(raw.view({1: np.uint8, 2: np.int16, 4: np.int32}[raw.dtype.itemsize])).view(dtype)


def _copy_folder(src: Path, dst: Path, config: dict) -> None:
    dst.mkdir(parents=True)
    for path in src.iterdir():
        if path.is_file() and not path.name.endswith(".safetensors") and path.name != "config.json":
            shutil.copy(path, dst / path.name)
    (dst / "config.json").write_text(json.dumps(config, indent=2))


def write_fp8_source(bf16_folder, dst, *, style: str = "deepseek", block: tuple[int, int] = (128, 128),
                     scale_dtype: str = "float32", ue8m0: bool = False) -> Path:
    """`bf16_folder` in block FP8: DeepSeek style (`weight_scale_inv`, quant_method "fp8") or compressed-tensors
    FP8_BLOCK (`weight_scale`, its own QuantizationConfig). `scale_dtype` float32, bfloat16 or float8_e8m0fnu."""
    import torch
    from safetensors.torch import save_file

    src, dst = Path(bf16_folder), Path(dst)
    config = json.loads((src / "config.json").read_text())
    tensors = {}
    for name, tensor in sorted(_read(src).items()):
        if not is_block_linear(name, tensor.shape):
            tensors[name] = tensor
            continue
        codes, scale = quantize_blocks(tensor.float().numpy(), block, power_of_two=ue8m0,
                                       scale_dtype=np.float32 if scale_dtype != "bfloat16" else ml_dtypes.bfloat16)
        tensors[name] = as_torch(codes, torch.float8_e4m3fn)
        if scale_dtype == "float8_e8m0fnu":
            scale_tensor = as_torch((np.log2(scale.astype(np.float64)) + 127).astype(np.uint8), torch.float8_e8m0fnu)
        else:
            scale_tensor = as_torch(scale, getattr(torch, scale_dtype))
        tensors[name[: -len("weight")] + ("weight_scale_inv" if style == "deepseek" else "weight_scale")] = scale_tensor
    if style == "deepseek":
        qconfig = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": list(block), **({"scale_fmt": "ue8m0"} if ue8m0 else {})}
    else:
        from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

        scheme = preset_name_to_scheme("FP8_BLOCK", ["Linear"])
        scheme.weights.block_structure = list(block)
        qconfig = QuantizationConfig(config_groups={"group_0": scheme}, quantization_status="compressed",
                                     format="float-quantized",
                                     ignore=["lm_head", "re:.*mlp.gate$"]).model_dump()
    _copy_folder(src, dst, {**config, "quantization_config": qconfig})
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def write_dequantized_copy(fp8_folder, dst, *, style: str = "deepseek", block: tuple[int, int] = (128, 128)) -> Path:
    """The bfloat16 checkpoint an FP8 folder stands for, read by hand from its bytes (dequantized_by_hand), its
    scales dropped and its config without the quantization_config; every other tensor as stored."""
    import torch
    from safetensors.torch import save_file

    src, dst = Path(fp8_folder), Path(dst)
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config")
    stored = _read(src)
    suffix = "weight_scale_inv" if style == "deepseek" else "weight_scale"
    tensors = {}
    for name, tensor in sorted(stored.items()):
        if name.endswith(suffix):
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            scale = stored[name[: -len("weight")] + suffix]
            if scale.dtype == torch.float8_e8m0fnu:
                scale = e8m0_values(scale.view(torch.uint8).numpy())
            else:
                scale = scale.float().numpy().astype(np.float64)
            bits = dequantized_by_hand(tensor.view(torch.uint8).numpy(), scale, block)
            tensors[name] = as_torch(bits, torch.bfloat16)
        else:
            tensors[name] = tensor
    _copy_folder(src, dst, config)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst
