"""W4A8-FP8 (compressed-tensors preset W4AFP8): int4 weights as `int4` stores them, FP8 activations per token.

    <m>.weight_packed  int32 [out, ceil(in/8)]        u = q + 8, column 8k+j in bits 4j..4j+3 of word k
    <m>.weight_scale   model float dtype [out, in/group]
    <m>.weight_shape   int64 [2] = (out, in)

The tensors are int4's, byte for byte (layout_int4); the config adds `input_activations`: 8-bit float,
symmetric, per token, dynamic (the server rounds each token to E4M3 at run time, as for `fp8`). The format
is `pack-quantized`, which vLLM's and vLLM TPU's W4A8-FP8 methods read (they register `weight_packed`).
"""

from __future__ import annotations

from typing import Any

from qconvert.formats import compressed_tensors as ct
from qconvert.formats.layout_base import LayoutFlags
from qconvert.formats.layout_fp8 import ACT_SETTING, float_args
from qconvert.formats.layout_int4 import FORMAT, PackQuantizedInt4, float_activations


def _fp8_token_activations(args: Any) -> bool:
    return (isinstance(args, dict) and args.get("num_bits") == 8 and args.get("type") == "float"
            and args.get("symmetric", True) is True and (args.get("strategy"), args.get("dynamic")) == ACT_SETTING)


class PackQuantizedW4A8FP8(PackQuantizedInt4):
    """`--scheme w4a8-fp8`: int4's packed codes and group scales, activations rounded to E4M3 per token."""

    scheme = "w4a8-fp8"

    def kernel_act(self, flags: LayoutFlags) -> str | None:
        return "dynamic"

    def quantization_config(self, flags: LayoutFlags, ignore: tuple[str, ...], compute_dtype: str) -> dict:
        config = super().quantization_config(flags, ignore, compute_dtype)
        group = config["config_groups"]["group_0"]
        # Dynamic activations have no observer, as llm-compressor records them.
        group["input_activations"] = float_args(*ACT_SETTING, None)
        # The group names its format too: compressed-tensors infers a module's format from its scheme when the
        # group does not, and for int weights with activations it infers int-quantized (a plain int8 `weight`),
        # which is not what these tensors are; vLLM reads the group's format the same way.
        group["format"] = FORMAT
        return config

    def claims(self, qconfig: dict[str, Any]) -> bool:
        return ct.claims(qconfig, FORMAT) and ct.weight_bits(qconfig) == {4} and float_activations(qconfig)

    def flags_of(self, qconfig: dict[str, Any]) -> LayoutFlags:
        for name, group in qconfig["config_groups"].items():
            acts = group.get("input_activations")
            if not _fp8_token_activations(acts):
                shown = {k: acts.get(k) for k in ("num_bits", "type", "strategy", "dynamic")} \
                    if isinstance(acts, dict) else acts
                raise ValueError(f"compressed-tensors {FORMAT} group {name} input activations are {shown}; "
                                 "qconvert's w4a8-fp8 layout quantizes them to fp8 per token at run time")
            weights = group.get("weights") or {}
            if weights.get("strategy") != "group":
                raise ValueError(f"compressed-tensors {FORMAT} group {name} W4A8 weights are per "
                                 f"{weights.get('strategy')!r}; vLLM's W4A8-FP8 methods read group scales only")
        # The weights are int4's: its reader checks them, once the activations are set aside.
        weights_only = {**qconfig, "config_groups": {
            name: {**group, "input_activations": None} for name, group in qconfig["config_groups"].items()}}
        return super().flags_of(weights_only)
