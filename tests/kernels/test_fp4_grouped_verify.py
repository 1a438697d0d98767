"""`qconvert verify` of an nvfp4a16 and an mxfp4a16 Qwen3-MoE folder runs its experts through the FP4 grouped
kernel (E2M1 decoded in the Mosaic kernel, interpreted on a CPU), not a dequantized copy through the float one,
and passes: each expert's kernel output matches the folder's own dequantized layer."""

import json

import jax
import pytest

from cli_helpers import quantize_quietly, run as run_cli
from qconvert.kernels import tpu_grouped

pytestmark = pytest.mark.slow  # a quantize and an interpreted verify of a two-layer MoE per scheme


@pytest.fixture(scope="module")
def moe_source(tmp_path_factory):
    from hf_checkpoints import make_fp4_moe_checkpoint

    return make_fp4_moe_checkpoint(tmp_path_factory.mktemp("moe") / "src")


@pytest.mark.parametrize("scheme", ["nvfp4a16", "mxfp4a16"])
def test_verify_runs_the_experts_through_the_fp4_grouped_kernel_and_passes(moe_source, tmp_path, capsys,
                                                                           monkeypatch, scheme):
    out = quantize_quietly(moe_source, tmp_path / scheme, "--scheme", scheme, "--no-gptq")
    decoded = []
    tile_dot = tpu_grouped.fp4_tile_dot
    monkeypatch.setattr(tpu_grouped, "fp4_tile_dot", lambda *a, **kw: decoded.append(1) or tile_dot(*a, **kw))
    jax.clear_caches()  # every kernel traced anew, through the spy
    code, report, err = run_cli(["verify", str(out), "--quick", "--backend", "cpu", "--json"], capsys)
    jax.clear_caches()
    assert code == 0, err
    record = json.loads(report)
    assert record["passed"] and record["scheme"] == scheme
    experts = [layer for layer in record["layers"] if ".mlp.experts." in layer["name"]]
    assert len(experts) == 2 * 4 * 3  # two layers of four experts, gate, up and down each
    for layer in experts:
        kernel = layer["kernel"]
        assert (kernel["name"], kernel["pallas"], kernel["interpret"]) == ("grouped_matmul_mosaic", True, True)
        assert kernel["fallback_reason"] is None and kernel["tiling"]["tk"] % 256 == 0  # int4's packed K tiles
        # The kernel computes the folder's layer, in the model's bf16 as a W4A16 server does: MXFP4's E2M1 x 2^k is
        # exact in bf16; NVFP4's scale / global scale is not, which bounds its fidelity near bf16's 8 bits.
        floor = 100 if scheme == "mxfp4a16" else 45
        assert layer["passed"] and layer["fidelity_sqnr_db"] >= floor
    assert decoded  # the grouped kernel decoded the E2M1 codes itself
