"""Run vLLM's own loading check (../shared/vllm/vllm_accept.py) on a gpt-oss folder (GptOssForCausalLM).

    VLLM_TARGET_DEVICE=cpu VLLM_VENV/bin/python bench/vllm_gpt_oss.py OUT [--ref FLOAT_MODEL]
        [--accept ../shared/vllm/vllm_accept.py] [--sabotage experts]

vllm_accept.py alone says WRONG on every gpt-oss folder, for two reasons that are its own, not vLLM's:

- it looks up each vLLM parameter's checkpoint tensors under vLLM's module names, and vLLM's gpt-oss renames the
  checkpoint's (its hf_to_vllm_mapper: `.self_attn.` -> `.attn.`, `embed_tokens` -> `embedding`), so the
  attention projections are "unmapped" and their dequantization "has no compressed-tensors decompression";
- vLLM's gpt-oss loader (GptOssModel._load_weights_other) copies the fused float experts (gate_up_proj,
  down_proj and their biases) into its MoE parameters with `param.copy_`, not through a weight_loader, so the
  check, which counts a tensor as consumed when a weight_loader takes it, calls them "silently dropped".

This runs the same check (vLLM's config parsing and scheme match, the model built under the quantization config,
DefaultModelLoader twice with different fills, every tensor consumed, parameters equal to the checkpoint's,
dequantization against compressed-tensors', --ref) with these things changed:

- the checkpoint, compressed-tensors' decompression of it and the --ref model answer under vLLM's names too, as
  the model's own hf_to_vllm_mapper renames them (the experts aside);
- a fused float expert tensor that reaches the direct copy is counted as consumed, and each layer's MoE
  parameters are compared with it exactly: w13_weight = gate_up_proj transposed per expert (gate and up stay
  interleaved, rows 2j and 2j + 1, as vLLM's swigluoai activation reads them: gate x[..., ::2], up
  x[..., 1::2]), w13_bias = gate_up_proj_bias, w2_weight = down_proj transposed, w2_bias = down_proj_bias;
- an nvfp4a16 or mxfp4a16 folder gets bench/vllm_fp4.py's changes (the CPU-missing kernel choice, vLLM's FP4
  reading for the dequantization check, the E2M1 --ref check).

`--sabotage experts` is a negative control of the expert check: vLLM's direct copy of gate_up_proj is made to
swap each gate row with its up row, which must say WRONG.
"""

from __future__ import annotations

import re
from pathlib import Path

import vllm_fp4 as fp4
import vllm_harness as harness

harness.leave_import_path()
FP4_FORMATS = ("nvfp4-pack-quantized", "mxfp4-pack-quantized")
# The fused float experts as the loader's direct copy sees them (after the model's mapper, before routed_experts).
FUSED_FLOAT = re.compile(r"\.mlp\.experts\.(w13_weight|w2_weight|w13_bias|w2_bias)$")
EXPERT_TENSORS = {"w13_weight": "gate_up_proj", "w13_bias": "gate_up_proj_bias", "w2_weight": "down_proj",
                  "w2_bias": "down_proj_bias"}


def vllm_name(mapper, name: str) -> str:
    """`name` as vLLM's gpt-oss mapper renames it; the experts keep their checkpoint names (the mapper would turn
    gate_up_proj into w13_weight, whose layout differs: they are compared by check_fused_experts)."""
    if ".mlp.experts." in name:
        return name
    return mapper.map_name(name) or name


def alias_checkpoint(accept, mapper) -> None:
    """accept.Checkpoint and its compressed-tensors decompression answer under vLLM's names as well."""

    class GptOssCheckpoint(accept.Checkpoint):
        def __init__(self, folder: str):
            super().__init__(folder)
            self.alias = {vllm_name(mapper, k): k for k in self.meta if vllm_name(mapper, k) != k}

        def __contains__(self, key: str) -> bool:
            return key in self.where or key in self.alias

        def get(self, key: str):
            return super().get(self.alias.get(key, key))

    decompress = accept._ct_decompress

    def ct_decompress(ck, qc):
        out = decompress(ck, qc)
        return {**out, **{vllm_name(mapper, k): v for k, v in out.items()}}

    accept.Checkpoint, accept._ct_decompress = GptOssCheckpoint, ct_decompress


def aliasing_safe_open(real, mapper):
    """safetensors.safe_open whose handles also list and read each tensor under its vLLM name (for --ref)."""

    class Handle:
        def __init__(self, path, framework="pt", **kwargs):
            self.handle = real(path, framework=framework, **kwargs)
            self.back = {}

        def __enter__(self):
            self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def keys(self):
            keys = list(self.handle.keys())
            self.back = {vllm_name(mapper, k): k for k in keys if vllm_name(mapper, k) != k}
            return keys + list(self.back)

        def get_tensor(self, key):
            if not self.back:
                self.keys()
            return self.handle.get_tensor(self.back.get(key, key))

    return Handle


def alias_ref(accept, mapper) -> None:
    """The --ref check (accept.ref_check as it stands, FP4's included) reads the float model under vLLM's names."""
    import safetensors

    ref_check = accept.ref_check

    def aliased(*args, **kwargs):
        real = safetensors.safe_open
        safetensors.safe_open = aliasing_safe_open(real, mapper)
        try:
            return ref_check(*args, **kwargs)
        finally:
            safetensors.safe_open = real

    accept.ref_check = aliased


def checker_state(model):
    """The check's own `consumed` set and `current` tensor name, read from a weight_loader it wrapped."""
    for _, param in model.named_parameters():
        loader = getattr(param, "weight_loader", None)
        if getattr(loader, "_qc_wrapped", False):
            cells = dict(zip(loader.__code__.co_freevars, (c.cell_contents for c in loader.__closure__)))
            return cells["consumed"], cells["current"]
    return None


def count_direct_copies(sabotage: bool) -> None:
    """vLLM's gpt-oss loader: a fused float expert tensor it copies directly counts as consumed (its value is
    judged by check_fused_experts); with `sabotage`, gate_up_proj reaches it with gate and up swapped."""
    from vllm.model_executor.models import gpt_oss

    load = gpt_oss.GptOssModel._load_weights_other

    def load_other(self, ep_rank_end, ep_rank_start, weights, mapping):
        state = checker_state(self)

        def marked():
            for name, weight in weights:
                if FUSED_FLOAT.search(name):
                    if state is not None and state[1]["name"] is not None:
                        state[0].add(state[1]["name"])
                    if sabotage and name.endswith(".w13_weight"):
                        weight = weight.reshape(*weight.shape[:-1], -1, 2).flip(-1).reshape(weight.shape)
                yield name, weight

        return load(self, ep_rank_end, ep_rank_start, marked(), mapping)

    gpt_oss.GptOssModel._load_weights_other = load_other


def check_fused_experts(accept, model, ck) -> None:
    """Each layer's float MoE parameters against the fused checkpoint tensors, exactly (the module docstring)."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    checked, bad = 0, []
    for name, module in model.named_modules():
        if not isinstance(module, RoutedExperts):
            continue
        prefix = name.split(".mlp.experts", 1)[0] + ".mlp.experts"
        fused = {p: f"{prefix}.{t}" for p, t in EXPERT_TENSORS.items() if f"{prefix}.{t}" in ck}
        if not fused:
            continue
        method = type(module.quant_method).__name__
        if method != "UnquantizedFusedMoEMethod":
            bad.append(f"{name}: float fused experts in the checkpoint, but vLLM builds {method}")
            continue
        for param, source in fused.items():
            expected = ck.get(source)
            expected = expected.transpose(1, 2) if param.endswith("_weight") else expected
            got = getattr(module, param).detach()
            if got.shape != expected.shape or got.dtype != expected.dtype or not got.equal(expected):
                bad.append(f"{name}.{param} differs from {source}{' transposed' if param.endswith('_weight') else ''}")
            checked += 1
    if bad:
        accept.emit("FAIL-WRONG", "experts.fused_float", f"{len(bad)} mismatch(es): " + "; ".join(bad[:4]))
    elif checked:
        accept.emit("OK", "experts.fused_float", f"{checked} MoE parameters equal the fused float experts "
                    "(w13 = gate_up_proj^T, gate and up interleaved; w2 = down_proj^T; biases as stored)")


def patch_accept(accept, out: str, sabotage: bool) -> None:
    """The changes of the module docstring, installed where vllm_accept.py installs its own patches."""
    import json

    from vllm.model_executor.models.gpt_oss import GptOssForCausalLM

    mapper = GptOssForCausalLM.hf_to_vllm_mapper
    quantization = json.loads((Path(out) / "config.json").read_text()).get("quantization_config") or {}
    alias_checkpoint(accept, mapper)
    install = accept.install_patches

    def install_all():
        install()
        if quantization.get("format") in FP4_FORMATS:
            fp4.patch_vllm(accept)
        alias_ref(accept, mapper)
        count_direct_copies(sabotage)

    accept.install_patches = install_all
    dequant_check = accept.dequant_check

    def dequant_and_experts(model, ck, *args, **kwargs):
        check_fused_experts(accept, model, ck)
        return dequant_check(model, ck, *args, **kwargs)

    accept.dequant_check = dequant_and_experts


def main() -> None:
    parser = harness.accept_parser(__doc__)
    parser.add_argument("--sabotage", choices=["experts"], help="a negative control: must say WRONG")
    args, accept, out, ref = harness.start_on_cpu(parser)
    patch_accept(accept, out, args.sabotage == "experts")
    harness.exit_reporting(accept, lambda: accept.run(out, ref, False))


if __name__ == "__main__":
    main()
