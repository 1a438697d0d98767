"""`--double-quant` writes, tensor for tensor, what bitsandbytes' own quantize_4bit(..., compress_statistics=True)
gives for the same weight: packed codes, absmax codes, nested absmax, both maps and the quant_state fields."""

import json

import numpy as np
import pytest
import torch
from checkpoints import make_llama_checkpoint
from safetensors.torch import load_file, save_file

from qconvert.cli.main import main

STATE = "quant_state.bitsandbytes__nf4"


def bitsandbytes_tensors(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """bitsandbytes' serialization of its own nested NF4 quantization of `weight` (torch on one thread:
    from 32768 blocks on, torch splits the absmax mean between its threads)."""
    import bitsandbytes.functional as bnb_functional

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        packed, state = bnb_functional.quantize_4bit(weight, blocksize=64, quant_type="nf4",
                                                     compress_statistics=True)
    finally:
        torch.set_num_threads(threads)
    return {"": packed, **state.as_dict(packed=True)}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("dq")
    source = make_llama_checkpoint(root / "src", hidden=96, layers=1, heads=4, kv_heads=2, intermediate=203,
                                   vocab=128, dtype="bfloat16", seed=3)
    tensors = load_file(str(source / "model.safetensors"))
    up = tensors["model.layers.0.mlp.up_proj.weight"]
    up[5] = 0.0  # an all-zero row
    up[7, 11] = 3e4  # a huge value
    tensors["model.layers.0.mlp.down_proj.weight"][:, -40:] = 0.0
    save_file(tensors, str(source / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(SystemExit) as exc:
        main(["quantize", str(source), "-o", str(root / "nf4"), "--scheme", "nf4", "--double-quant", "--quiet"])
    assert exc.value.code == 0
    return source, root / "nf4"


def test_every_tensor_of_a_double_quant_folder_equals_bitsandbytes(folders):
    source, out = folders
    floats = load_file(str(source / "model.safetensors"))
    stored = load_file(str(out / "model.safetensors"))
    modules = sorted(name[:-len(".weight." + STATE)] for name in stored if name.endswith(STATE))
    assert len(modules) == 7
    blocks = {-(-floats[f"{m}.weight"].numel() // 64) for m in modules}
    assert any(b % 256 for b in blocks) and any(b > 256 for b in blocks)
    for module in modules:
        theirs = bitsandbytes_tensors(floats[f"{module}.weight"])
        for part, tensor in theirs.items():
            name = f"{module}.weight" + (f".{part}" if part else "")
            ours = stored[name]
            if part == STATE:
                # The same fields and values; the offset's decimal spelling differs (README: nf4 and bitsandbytes).
                mine, their_state = (json.loads(bytes(t.numpy()).decode()) for t in (ours, tensor))
                offset, their_offset = mine.pop("nested_offset"), their_state.pop("nested_offset")
                assert mine == their_state and np.float32(offset) == np.float32(their_offset), name
                continue
            assert ours.dtype == tensor.dtype and ours.shape == tensor.shape, name
            assert ours.numpy().tobytes() == tensor.numpy().tobytes(), name
        assert set(theirs) == {part[len(f"{module}.weight") + 1:] if part != f"{module}.weight" else ""
                               for part in stored if part.startswith(f"{module}.weight")}
