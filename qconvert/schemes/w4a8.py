"""`--scheme w4a8-fp8`: int4 weights exactly as `int4`, FP8 E4M3 activations per token at run time (W4AFP8).

The weights are int4's, byte for byte (compressed-tensors' round-to-nearest, group scales, GPTQ on the same
grid); the folder's config adds dynamic per-token FP8 input activations, which vLLM serves on Hopper
(CompressedTensorsW4A8Fp8, its Cutlass kernel) and vLLM TPU on its torchax path, dense and MoE.

What the servers take, from their own code: vLLM's dense method and fused-MoE method need group 128 (its
kernel also K and N multiples of 128, and for experts hidden and intermediate multiples of 256); vLLM TPU's
takes any group that divides the input width; neither reads one scale per output channel (their W4A8 match
needs strategy "group"). So a group size is required (exit 2 otherwise), and a group other than 128, or
widths vLLM's GPU kernel refuses, are said in one line.
"""

from __future__ import annotations

from collections.abc import Mapping

from qconvert.formats.errors import UsageError
from qconvert.formats.layout_base import LayoutFlags
from qconvert.formats.layout_w4a8 import PackQuantizedW4A8FP8
from qconvert.schemes.base import Thresholds
from qconvert.schemes.fp8 import FP8
from qconvert.schemes.int4 import DEFAULT_GROUP_SIZE, Int4, resolve_group_size

GPU_DENSE_MULTIPLE = 128  # vLLM's Cutlass W4A8: K and N of each linear
GPU_EXPERT_MULTIPLE = 256  # vLLM's W4A8 fused MoE: hidden and intermediate (Cutlass reorder)
EXPERT_MARK = ".experts."


def gpu_refusal(group: int | None, shapes: Mapping[str, tuple[int, int]]) -> str:
    """Why vLLM on GPU would refuse these linears at this group size ('' when it takes them)."""
    if group != DEFAULT_GROUP_SIZE:
        return f"group size {group} (vLLM on GPU takes group 128 only)"
    # Input widths only: an output width counts for the layer vLLM fuses (q/k/v, gate/up), not for each
    # part, and an expert's input widths are the hidden and the intermediate size both.
    for module, (_, inp) in sorted(shapes.items()):
        multiple = GPU_EXPERT_MULTIPLE if EXPERT_MARK in module else GPU_DENSE_MULTIPLE
        if inp % multiple:
            return f"{module}'s input width {inp} (vLLM on GPU needs a multiple of {multiple})"
    return ""


class W4A8FP8(Int4):
    """int4 codes with group scales; activations quantized to FP8 per token at run time."""

    name = "w4a8-fp8"
    layout = PackQuantizedW4A8FP8()
    act_modes = ("dynamic",)
    # AWQ then GPTQ, as int4: with E4M3 activations it beat GPTQ alone on SmolLM2-135M and Gemma 3 270M
    # (docs/ACCURACY.md, "FP4 (nvfp4a16, mxfp4a16) and w4a8-fp8's AWQ default"); --no-awq for GPTQ alone.
    default_awq = True
    # int4's floors: the E4M3 activations cost next to nothing beside int4's weights. Measured on SmolLM2-135M
    # (round-to-nearest, group 64, verify's held-out text): worst linear 11.75 dB against int4's 11.78 dB on the
    # same weights, KL 0.467 against 0.458, top-1 0.574 against 0.598, perplexity x1.246 against x1.243; with one
    # down_proj's scales doubled the folder's layer falls to -0.2 dB (KL 0.584, x1.351). Fidelity >= 126 dB on
    # CPU: the kernel and the float64 reference see the same E4M3 activations; 40 dB as int4's (the weight's
    # code times its scale rounds in float32 on a TPU's bf16 passes).
    thresholds = Thresholds(
        min_layer_sqnr_db=12.0, min_layer_cosine=0.97, max_mean_kl=0.15,
        min_top1_agreement=0.65, max_perplexity_ratio=1.35, min_pooled_cosine=0.91,
        min_fidelity_sqnr_db=40.0,
    )

    def check_modules(self, modules: list[str], flags: LayoutFlags) -> None:
        if modules and flags.group_size is None:
            raise UsageError("--scheme w4a8-fp8 needs group scales: vLLM's and vLLM TPU's W4A8-FP8 methods do not "
                             "read one scale per output channel (--group-size channel, or no group of 128, 64 or 32 "
                             "divides every input width); use --scheme int4 or fp8 for this model")

    def group_note(self, group_size: int | str | None, shapes: Mapping[str, tuple[int, int]]) -> str:
        """One line when vLLM on GPU would refuse the folder (vLLM TPU takes any group)."""
        group, _ = resolve_group_size(group_size, shapes)
        why = gpu_refusal(group, shapes) if group is not None else ""
        return f"w4a8-fp8: {why}: vLLM TPU loads it, vLLM on GPU does not" if why else ""

    folder_activations = FP8.folder_activations  # E4M3 per token, as fp8's
