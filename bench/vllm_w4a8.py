"""Run vLLM's own loading check (../shared/vllm/vllm_accept.py) on a w4a8-fp8 folder as an H100 would take it.

    VLLM_TARGET_DEVICE=cpu VLLM_VENV/bin/python bench/vllm_w4a8.py OUT [--ref FLOAT_MODEL]
        [--accept ../shared/vllm/vllm_accept.py]

vLLM 0.33 matches W4A8-FP8 (CompressedTensorsW4A8Fp8, and its fused-MoE method) only where the platform
reports compute capability 9.0 exactly (`_is_fp8_w4a8_sm90`), which a CPU never does: vllm_accept.py alone
says REFUSE ("No compressed-tensors compatible scheme was found"). This runs the same check (config parsing,
the model built under the quantization config, DefaultModelLoader twice with different fills, every tensor
consumed, parameters equal to the checkpoint's, dequantization against compressed-tensors', --ref) with
four things changed, each vLLM's own code where it can run on a CPU (and the dense scheme's bit width, which
it keeps in `quant_type`, given to the check as `num_bits`):

- the capability gate answered as an H100; the match itself is vLLM's `_is_fp8_w4a8` (group, symmetric int4
  weights; dynamic per-token symmetric 8-bit float activations) and the scheme's own __init__ checks
  (group size 128) run as they are;
- the dense scheme's CUDA kernel (Cutlass W4A8) is a stub recording its MPLinearLayerConfig, whose shapes
  are then checked against Cutlass' own `can_implement` rules (K and N multiples of 128, bf16 output);
- the W4A8 MoE backend selection falls back to Cutlass where the CPU has none (its create_weights, with its
  hidden and intermediate multiples of 256, runs as it is);
- vLLM's reading of the loaded parameters for the dequantization check: the kernels' first step,
  `convert_packed_uint4b8_to_signed_int4`, is u - 8 on each stored nibble, times the group scale.

No kernel runs: the Cutlass path further rounds the group scales to FP8 with a per-channel factor
(convert_bf16_scales_to_fp8), which is the server's own lossy step and not the folder's meaning.
"""

from __future__ import annotations

import vllm_harness as harness

harness.leave_import_path()


def patch_vllm(accept) -> None:
    """The four changes of the module docstring."""
    from vllm.model_executor.layers.quantization.compressed_tensors import compressed_tensors as ct_config
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import \
        compressed_tensors_moe_w4a8_fp8 as moe_w4a8
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import \
        compressed_tensors_w4a8_fp8 as dense_w4a8

    config_class = ct_config.CompressedTensorsConfig
    config_class._is_fp8_w4a8_sm90 = classmethod(lambda cls, w, i: cls._is_fp8_w4a8(w, i))

    def choose(config, *args, **kwargs):
        accept.MP_CONFIGS.append(config)
        k, n = config.partition_weight_shape
        refusals = [why for bad, why in ((k % 128 or n % 128, f"K, N = {k}, {n}: Cutlass needs multiples of 128"),
                                         (str(config.out_type) != "torch.bfloat16", f"output {config.out_type}"))
                    if bad]
        accept.emit("INFO" if not refusals else "WARN", "h100.w4a8_linear_kernel",
                    f"CutlassW4A8 for (K, N) ({k}, {n}), group {config.group_size}"
                    + (f": would refuse, {'; '.join(refusals)}" if refusals else ""))
        return accept._StubMPKernel

    dense_w4a8.choose_mp_linear_kernel = choose
    # The dense scheme keeps its bit width in quant_type (int4) only; the --ref check reads `num_bits` (else 8,
    # and int8's half-step tolerance).
    dense_w4a8.CompressedTensorsW4A8Fp8.num_bits = property(lambda self: self.quant_type.size_bits)
    select = moe_w4a8.select_w4a8_moe_backend

    def select_backend(*args, **kwargs):
        accept.MOE_SELECTIONS.append(("w4a8", args, kwargs))
        try:
            return select(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the CPU has no W4A8 MoE backend: Hopper's is Cutlass
            accept.KERNEL_NOTES.setdefault("moe-w4a8-cpu", accept.short_exc(exc, 400))
            from vllm.model_executor.layers.fused_moe.oracle.w4a8 import W4A8MoeBackend

            return W4A8MoeBackend.CUTLASS, None

    moe_w4a8.select_w4a8_moe_backend = select_backend
    dequant_linear, dequant_expert = accept._vllm_dequant_linear, accept._vllm_dequant_expert

    def w4a8_linear(mod, scheme):
        if type(scheme).__name__ != "CompressedTensorsW4A8Fp8":
            return dequant_linear(mod, scheme)
        out_f, in_f = mod.output_size_per_partition, mod.input_size_per_partition
        scale = accept._expand_scale(mod.weight_scale.detach(), out_f, in_f, group=scheme.group_size)
        u = accept._unpack_uint(mod.weight_packed.detach(), 4, out_f, in_f)
        return (u.float() - 8) * scale, None, scale

    def w4a8_expert(mod, wn: str, e: int, rows: int, cols: int):
        method = mod.quant_method
        if type(method).__name__ != "CompressedTensorsW4A8Fp8MoEMethod":
            return dequant_expert(mod, wn, e, rows, cols)
        raw = getattr(mod, f"{wn}_weight_packed").detach()[e]
        scale = accept._expand_scale(getattr(mod, f"{wn}_weight_scale").detach()[e], rows, cols,
                                     group=method.group_size)
        return (accept._unpack_uint(raw, 4, raw.shape[0], cols).float() - 8) * scale, scale

    accept._vllm_dequant_linear, accept._vllm_dequant_expert = w4a8_linear, w4a8_expert


def main() -> None:
    harness.run_accept(__doc__, patch_vllm)


if __name__ == "__main__":
    main()
