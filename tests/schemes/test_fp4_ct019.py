"""nvfp4a16 and mxfp4a16 folders byte-identical to what llm-compressor 0.14's QuantizationModifier writes with the
compressed-tensors it pins (0.19): the same real-shaped Llama in bf16, fp16 and fp32 quantized by both, every tensor
of the two folders compared byte for byte (weight_packed, weight_scale, weight_global_scale, and the float ones).
llm-compressor runs in its own venv (bench/lc_fp4.py --compressed), so these tests run only where it was built:

    python3 -m venv /work/lc-venv && /work/lc-venv/bin/pip install torch==2.13.0 llmcompressor==0.14.0.1

(the checkout's parent's lc-venv, where bench/int4_defaults.py looks for it too). The compressed-tensors of the
test extra (0.20) is held to the same bytes by tests/schemes/test_fp4.py."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from cli_helpers import run as run_cli
from hf_checkpoints import make_hf_checkpoint

ROOT = Path(__file__).resolve().parents[2]
LC_PYTHON = ROOT.parent / "lc-venv" / "bin" / "python"
LC_FP4 = ROOT / "bench" / "lc_fp4.py"
PRESETS = {"nvfp4a16": "NVFP4A16", "mxfp4a16": "MXFP4A16"}
DTYPES = ("bfloat16", "float16", "float32")

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not LC_PYTHON.exists(), reason=f"llm-compressor 0.14's venv is not built at {LC_PYTHON.parent.parent}")]


def awkward_source(folder: Path, dtype: str) -> Path:
    """A one-layer Llama at real widths (hidden 256, intermediate 1536) whose weights hold the cases the rounding
    rules single out: quotients on every E2M1 tie, an all-zero group and row, -0.0, an outlier, tiny groups, and
    an o_proj small enough that fp16's NVFP4 global scale (2688 / absmax) overflows."""
    import ml_dtypes
    from safetensors.numpy import load_file, save_file

    source = make_hf_checkpoint(folder, "llama", dtype=dtype, hidden=256, intermediate=1536, layers=1, heads=4,
                                kv_heads=2, vocab=128)
    [shard] = sorted(source.glob("*.safetensors"))
    np_dtype = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}[dtype]
    tensors = {k: v for k, v in load_file(str(shard)).items()}
    layer = "model.layers.0."
    down = tensors[layer + "mlp.down_proj.weight"].astype(np.float32)
    down[3, 5] = 2.0
    down[4, :64] = 0.0
    down[5, :] = 0.0
    ties = np.array([6, 0.25, -0.25, 0.75, -1.25, 1.75, 2.5, -3.5, 5.0, -5.0, 0.1, -0.1, -0.0, 0.5, 1.0, 1.5,
                     6, 0.125, -0.375, 0.625, 2.25, -2.75, 3.25, 4.5, 5.5, -6, 0.0, -0.0, 1.0, 2.0, 3.0, 4.0])
    down[6, :32] = ties / 12.0
    down[7, :] *= 1e-4
    down[8, 16:48] = -1e-7
    tensors[layer + "mlp.down_proj.weight"] = down.astype(np_dtype)
    tensors[layer + "self_attn.o_proj.weight"] = (tensors[layer + "self_attn.o_proj.weight"].astype(np.float32)
                                                  * 1e-2).astype(np_dtype)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return source


@pytest.fixture(scope="module")
def llm_compressor_folders(tmp_path_factory):
    """{(scheme, dtype): (source, llm-compressor's compressed folder)}, all written by one llm-compressor process."""
    root = tmp_path_factory.mktemp("ct019")
    folders, calls = {}, []
    for dtype in DTYPES:
        source = awkward_source(root / f"src-{dtype}", dtype)
        for scheme, preset in PRESETS.items():
            out = root / f"lc-{scheme}-{dtype}"
            folders[scheme, dtype] = (source, out)
            calls.append([str(source), str(out), "--preset", preset, "--compressed"])
    # Loaded from its file, not with bench/ on sys.path: bench/kernels.py would shadow the `kernels` package
    # transformers probes for.
    driver = ("import importlib.util\n"
              f"spec = importlib.util.spec_from_file_location('lc_fp4', {str(LC_FP4)!r})\n"
              "lc_fp4 = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(lc_fp4)\n"
              f"for argv in {calls!r}:\n    lc_fp4.main(argv)\n")
    done = subprocess.run([str(LC_PYTHON), "-P", "-c", driver], capture_output=True, text=True, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    return folders


def folder_tensors(folder: Path) -> dict[str, tuple[str, tuple, bytes]]:
    """Every tensor of a folder: (dtype, shape, its bytes)."""
    import torch
    from safetensors import safe_open

    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():
                t = f.get_tensor(name).contiguous()
                out[name] = (str(t.dtype), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scheme", sorted(PRESETS))
def test_every_tensor_is_the_bytes_llm_compressor_writes(llm_compressor_folders, scheme, dtype, tmp_path, capsys):
    source, theirs = llm_compressor_folders[scheme, dtype]
    ours = tmp_path / scheme
    # Round-to-nearest, what QuantizationModifier computes, whatever the scheme's default recipe.
    code, _, err = run_cli(["quantize", str(source), "-o", str(ours), "--scheme", scheme, "--no-gptq", "--no-awq",
                            "-q"], capsys)
    assert code == 0, err
    a, b = folder_tensors(ours), folder_tensors(theirs)
    assert sorted(a) == sorted(b)
    quantized = [n for n in a if n.endswith(".weight_packed")]
    assert len(quantized) == 7  # q, k, v, o, gate, up, down; lm_head left float by both
    different = [(n, a[n][:2], b[n][:2]) for n in a if a[n] != b[n]]
    assert not different, different
    if scheme == "nvfp4a16":
        fused = {n.split(".")[-2]: np.frombuffer(b[n][2], np.float32)[0] for n in b if n.endswith("_global_scale")}
        assert fused["q_proj"] == fused["k_proj"] == fused["v_proj"] and fused["gate_proj"] == fused["up_proj"]
        # fp16's o_proj: 2688 / absmax overflows float16, and compressed-tensors takes 1.
        assert (fused["o_proj"] == 1.0) == (dtype == "float16")
    # Both folders say the same format to a loader. The metadata beside it differs and no loader reads it:
    # qconvert names the observer "minmax" and MXFP4's zp_dtype "torch.uint8" (compressed-tensors 0.20's preset),
    # llm-compressor 0.14 "memoryless_minmax" and zp_dtype null.
    config = {k: json.loads((f / "config.json").read_text())["quantization_config"] for k, f in (("a", ours),
                                                                                            ("b", theirs))}
    assert config["a"]["format"] == config["b"]["format"]
    fields = ("num_bits", "type", "symmetric", "group_size", "strategy", "dynamic", "actorder", "scale_dtype")
    weights = [{k: config[x]["config_groups"]["group_0"]["weights"].get(k) for k in fields} for x in "ab"]
    assert weights[0] == weights[1]
