"""Run vLLM's own loading check (../shared/vllm/vllm_accept.py) on an nvfp4a16, nvfp4 or mxfp4a16 folder.

    VLLM_TARGET_DEVICE=cpu VLLM_VENV/bin/python bench/vllm_fp4.py OUT [--ref FLOAT_MODEL]
        [--accept ../shared/vllm/vllm_accept.py]

vLLM 0.33 builds its NVFP4 and MXFP4 linear schemes (CompressedTensorsW4A4Fp4 with use_a16, and
CompressedTensorsW4A4Mxfp4) by first choosing a GPU kernel, which a CPU has none of: vllm_accept.py alone stops
there ("Forced NVFP4 kernel MarlinNvFp4LinearKernel is not supported", "Failed to find a kernel that can implement
the MXFP4 linear layer"). This runs the same check (config parsing and vLLM's own scheme match, the model built
under the quantization config, DefaultModelLoader twice with different fills, every tensor consumed, parameters
equal to the checkpoint's, dequantization against compressed-tensors', --ref) with these things changed:

- the kernel choice answers with a stub kernel (the scheme's parameters are allocated by the scheme itself, and
  its process_weights_after_loading is what is read below); the NVFP4 MoE backend choice, which finds none on a
  CPU, falls back to Marlin (a W4A16 GPU's; the method's create_weights runs as it is);
- vLLM's reading of the loaded parameters for the dequantization check, as each scheme's
  process_weights_after_loading and kernel take them: NVFP4, E2M1[nibble] x float(weight_scale) x (1 / the
  largest weight_global_scale of the layer's fused shards, one value for the whole layer); MXFP4, E2M1[nibble]
  x 2^(weight_scale - 127), the product in float32 rounded to bf16 (compressed-tensors' FP4 decompressor
  gives bf16). The nibbles are the low one first, as compressed-tensors packs them.

The fused-MoE methods (CompressedTensorsW4A4Nvfp4MoEMethod, CompressedTensorsW4A4Mxfp4MoEMethod) are read the same
way per expert, NVFP4's w13 with its gate's global scale for both halves (vLLM's process_weights_after_loading).
No kernel runs; --ref is checked against the E2M1 grid (fp4_ref_check), experts not included.

NVFP4 W4A4 folders (`--scheme nvfp4`, CompressedTensorsW4A4Fp4 without use_a16): each layer's input_global_scale,
as vLLM loads it, must be one positive finite float32 per fused layer (vLLM keeps the largest of its shards' for
the whole layer: a shard quantized with another would be read wrong), and each expert's w13 pair the same (its
MoE backends take the gate's or the pair's largest); how far the experts' values spread is reported (vLLM's
FlashInfer and emulation MoE backends share the smallest one over all experts).
"""

from __future__ import annotations

import os

import vllm_harness as harness

harness.leave_import_path()
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_values(packed):
    """float32 [out, 2 * cols] of uint8 packed E2M1 codes [out, cols], the low nibble first."""
    import torch

    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1).long()
    magnitude = torch.tensor(E2M1, dtype=torch.float32)[codes & 7]
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


def patch_vllm(accept) -> None:
    """The changes of the module docstring."""
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import \
        compressed_tensors_w4a4_mxfp4 as mxfp4
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import \
        compressed_tensors_w4a4_nvfp4 as nvfp4

    def stub(name):
        def choose(*args, **kwargs):
            accept.emit("INFO", "kernel", f"{name}: the GPU kernel choice answered with a stub on this CPU")
            return accept._StubMPKernel()
        return choose

    nvfp4.init_nvfp4_linear_kernel = stub("NVFP4")
    mxfp4.init_mxfp4_linear_kernel = stub("MXFP4")
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import \
        compressed_tensors_moe_w4a4_nvfp4 as moe_nvfp4

    select = moe_nvfp4.select_nvfp4_moe_backend

    def select_backend(*args, **kwargs):
        try:
            return select(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the CPU has no NVFP4 MoE backend: a W4A16 GPU's is Marlin
            accept.KERNEL_NOTES.setdefault("moe-nvfp4-cpu", accept.short_exc(exc, 400))
            return moe_nvfp4.NvFp4MoeBackend.MARLIN, None

    moe_nvfp4.select_nvfp4_moe_backend = select_backend
    dequant_linear = accept._vllm_dequant_linear

    def fp4_linear(mod, scheme):
        import torch

        name = type(scheme).__name__
        if name not in ("CompressedTensorsW4A4Fp4", "CompressedTensorsW4A4Mxfp4"):
            return dequant_linear(mod, scheme)
        out_f, in_f = mod.output_size_per_partition, mod.input_size_per_partition
        values = e2m1_values(mod.weight_packed.detach())[:, :in_f]
        raw = mod.weight_scale.detach()
        if name == "CompressedTensorsW4A4Fp4":
            # process_weights_after_loading: one global scale for the layer, the largest of its shards'.
            scale = raw.float() / mod.weight_global_scale.detach().max().float()
        else:
            scale = torch.exp2(raw.float() - 127)
        scale = accept._expand_scale(scale, out_f, in_f, group=in_f // raw.shape[1])
        # In bf16, as compressed-tensors' FP4 decompressor gives the weight (and a bf16 model's kernel takes it).
        return (values * scale).to(torch.bfloat16).float(), None, scale

    accept._vllm_dequant_linear = fp4_linear
    dequant_expert = accept._vllm_dequant_expert

    def fp4_expert(mod, wn: str, e: int, rows: int, cols: int):
        import torch

        method = type(mod.quant_method).__name__
        if method not in ("CompressedTensorsW4A4Nvfp4MoEMethod", "CompressedTensorsW4A4Mxfp4MoEMethod"):
            return dequant_expert(mod, wn, e, rows, cols)
        values = e2m1_values(getattr(mod, f"{wn}_weight_packed").detach()[e])[:, :cols]
        raw = getattr(mod, f"{wn}_weight_scale").detach()[e]
        if method == "CompressedTensorsW4A4Nvfp4MoEMethod":
            # process_weights_after_loading: w13 takes its gate's global scale for both halves.
            global_scale = getattr(mod, f"{wn}_weight_global_scale").detach()[e].reshape(-1)[0]
            scale = raw.float() / global_scale.float()
        else:
            scale = torch.exp2(raw.float() - 127)
        scale = accept._expand_scale(scale, rows, cols, group=cols // raw.shape[1])
        return (values * scale).to(torch.bfloat16).float(), scale

    accept._vllm_dequant_expert = fp4_expert
    dequant_check = accept.dequant_check

    def dequant_and_input_scales(model, *args, **kwargs):
        dequant_check(model, *args, **kwargs)
        input_global_scale_check(accept, model)

    accept.dequant_check = dequant_and_input_scales
    accept.ref_check = lambda model, ref, qc, packed_map, expert_names=None: fp4_ref_check(accept, model, ref,
                                                                                           packed_map)


def input_global_scale_check(accept, model) -> None:
    """The NVFP4 W4A4 input global scales as vLLM holds them after loading (the module docstring)."""
    import torch

    dense, experts, bad, spread = 0, 0, [], []
    for name, mod in model.named_modules():
        scheme = getattr(mod, "scheme", None)
        method = type(getattr(mod, "quant_method", None)).__name__
        if type(scheme).__name__ == "CompressedTensorsW4A4Fp4" and not scheme.use_a16:
            shards = [mod.input_global_scale.detach().float().reshape(-1)]
            dense += 1
        elif method == "CompressedTensorsW4A4Nvfp4MoEMethod" and not mod.quant_method.use_a16:
            w13 = mod.w13_input_global_scale.detach().float()
            w2 = mod.w2_input_global_scale.detach().float()
            shards = [*w13.unbind(0), *w2.reshape(-1, 1).unbind(0)]  # each expert's gate/up pair, its down alone
            spread.append(f"{name}: w13 {float(w13.min()):.4g}..{float(w13.max()):.4g}, "
                          f"w2 {float(w2.min()):.4g}..{float(w2.max()):.4g} over {w2.numel()} experts")
            experts += 1
        else:
            continue
        for values in shards:
            if not (torch.isfinite(values).all() and (values > 0).all()) or values.unique().numel() != 1:
                bad.append(f"{name}: {[float(v) for v in values[:4]]}")
                break
    if not dense and not experts:
        return
    if bad:
        accept.emit("FAIL-WRONG", "input_global_scale.fused", f"{len(bad)} layer(s) whose shards' input global scales "
                    "differ or are not positive finite (vLLM applies one per fused layer): " + "; ".join(bad[:4]))
    else:
        accept.emit("OK", "input_global_scale.fused", f"{dense} dense layer(s) and {experts} MoE layer(s): one "
                    "positive finite input global scale per fused layer and per expert's w13")
    for line in spread:
        accept.emit("INFO", "input_global_scale.experts", line)


def fp4_ref_check(accept, model, ref: str, packed_map) -> None:
    """--ref (a round-to-nearest folder): each FP4 weight as vLLM reads it, v, is the E2M1 value nearest to the
    float model's W / s clamped to +-6, s the effective scale vLLM applies: |x - v / s| is no more than x's distance
    to the nearest E2M1 value (a tie either way), plus bf16's rounding of the read. A changed scale or a wrong
    global scale breaks it."""
    import glob

    import torch
    from safetensors import safe_open

    files = {}
    for path in glob.glob(os.path.join(ref, "*.safetensors")):
        with safe_open(path, framework="pt") as handle:
            files.update({key[:-len(".weight")]: (path, key) for key in handle.keys() if key.endswith(".weight")})
    worst, count = (0.0, ""), 0
    for name, mod in model.named_modules():
        scheme = getattr(mod, "scheme", None)
        if type(scheme).__name__ not in ("CompressedTensorsW4A4Fp4", "CompressedTensorsW4A4Mxfp4"):
            continue
        parent, _, leaf = name.rpartition(".")
        sources = [name] if name in files else [f"{parent}.{part}" for part in packed_map.get(leaf, [])]
        if not sources or not all(s in files for s in sources):
            continue
        weights = []
        for source in sources:
            with safe_open(files[source][0], framework="pt") as handle:
                weights.append(handle.get_tensor(files[source][1]).double())
        w, _, scale = accept._vllm_dequant_linear(mod, scheme)
        x, v = torch.cat(weights, 0) / scale.double(), w.double() / scale.double()
        x = x.clamp(-6, 6)
        grid = torch.tensor(E2M1, dtype=torch.float64)
        nearest = (x.abs()[..., None] - grid).abs().min(dim=-1).values
        err = ((x - v).abs() - nearest - v.abs() * 2.0 ** -8).max().item()
        count += 1
        worst = max(worst, (err, name))
    if count:
        status = "OK" if worst[0] <= 1e-6 else "FAIL-WRONG"
        accept.emit(status, "ref.fp4_vs_float", f"{count} weights: the largest excess over the nearest E2M1 value's "
                    f"distance (and bf16's rounding) is {max(worst[0], 0.0):.3f} x scale (worst {worst[1]})")


def main() -> None:
    harness.run_accept(__doc__, patch_vllm)


if __name__ == "__main__":
    main()
