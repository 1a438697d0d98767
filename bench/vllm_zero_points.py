"""vLLM's own loading of int4 folders with zero points (int4-asym, compressed-tensors W4A16_ASYM), dense and MoE.

../shared/vllm/vllm_accept.py runs vLLM 0.33's own code on CPU (config parsing, the model class built under the
quantization config, DefaultModelLoader.load_weights twice with different fills, every parameter against the
tensors it comes from, each CUDA kernel's can_implement on a simulated H100) and compares the weight vLLM's
scheme implies with compressed-tensors' decompression. Its reading of a WNA16 weight is (field - type bias) *
scale: it does not read `weight_zero_point`, so on a folder with zero points it reports a mismatch that is its
own. This script runs that same check with the zero points read as vLLM reads them:

  dense (CompressedTensorsWNA16, symmetric false, type uint4): the weight is (field - zero field) * scale, the
      zero fields unpacked from weight_zero_point [out/8, groups] along the output dimension; the second reading
      is the scheme's own batch-invariant apply_weights (unpack_from_int32 of weight_packed, less
      unpack_from_int32(weight_zero_point, packed_dim=0), times weight_scale);
  MoE (CompressedTensorsWNA16MoEMethod): expert e's w13 / w2 weight is (field - zero field) * scale with the zero
      fields of w13_weight_zero_point / w2_weight_zero_point [E, rows/8, groups].

Both are compared, bit for bit, with compressed-tensors' own decompression of the checkpoint (its pack-quantized
compressor unpacks the zero points along dim 0 and computes (q - z) * s), and with --ref against the float model.
There the bound is not the symmetric one (0.55 steps): compressed-tensors' min-max rounding with zero points, in
bf16, reaches 0.5 + 15 * 2**-9 (the scale rounded to bf16 moves the range's end by up to 15 of its relative
errors) + 2**-5 (w / s rounded to bf16 where |w / s| >= 8) + 2 * 2**-6 (the sum w / s + z and the zero point,
each rounded to bf16) = 0.592 steps; the check's int4 ref line is judged against that. Every other check is
vllm_accept.py's, unchanged.

Run it with the vLLM venv's python (it needs vllm, torch and compressed-tensors, not qconvert):

    VLLM_TARGET_DEVICE=cpu .vllm-venv/bin/python bench/vllm_zero_points.py OUT [--ref FLOAT_MODEL] [--no-h100]
        [--check ../shared/vllm/vllm_accept.py]

The last line is vllm_accept.py's `VERDICT OK|REFUSE|WRONG`; exit 1 unless OK.
"""

from __future__ import annotations

import argparse
import re

import vllm_harness as harness

harness.leave_import_path()
# The largest |W_vllm - W_float| / scale of compressed-tensors' round-to-nearest with zero points in bf16 (above).
ZERO_POINT_REF_BOUND = 0.5 + 15 * 2 ** -9 + 2 ** -5 + 2 * 2 ** -6


def _zero_fields(check, packed, bits: int, rows: int, groups: int):
    """The unsigned zero point fields [rows, groups] of a zero point tensor packed along its rows."""
    return check._unpack_uint(packed.t().contiguous(), bits, groups, rows).t()


def _with_zero_points(check) -> None:
    """Replace the check's two WNA16 readings by ones that subtract the zero points where vLLM holds them."""
    plain_linear, plain_expert = check._vllm_dequant_linear, check._vllm_dequant_expert

    def dequant_linear(mod, scheme):
        if type(scheme).__name__ != "CompressedTensorsWNA16" or not hasattr(mod, "weight_zero_point"):
            return plain_linear(mod, scheme)
        import torch  # imported once vLLM has set up the environment, as the check's own readings do
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        out_f, in_f = mod.output_size_per_partition, mod.input_size_per_partition
        group = getattr(scheme, "group_size", None)
        raw, zraw = mod.weight_packed.detach(), mod.weight_zero_point.detach()
        scale = mod.weight_scale.detach()
        sc = check._expand_scale(scale, out_f, in_f, group=group)
        fields = check._unpack_uint(raw, scheme.num_bits, out_f, in_f).float()
        zeros = _zero_fields(check, zraw, scheme.num_bits, out_f, scale.shape[1]).float()
        w = (fields - check._expand_scale(zeros, out_f, in_f, group=group)) * sc
        # the scheme's own batch-invariant reading (compressed_tensors_wNa16.py apply_weights)
        codes = unpack_from_int32(raw, scheme.num_bits, torch.Size((out_f, in_f))).float()
        zero = unpack_from_int32(zraw, scheme.num_bits, scale.shape, packed_dim=0).float()
        w2 = (codes - check._expand_scale(zero, out_f, in_f, group=group)) * sc
        return w, w2, sc

    def dequant_expert(mod, wn: str, e: int, rows: int, cols: int):
        if not hasattr(mod, f"{wn}_weight_zero_point") or not hasattr(mod, f"{wn}_weight_packed"):
            return plain_expert(mod, wn, e, rows, cols)
        qm = mod.quant_method
        group = getattr(qm, "group_size", None)
        bits = getattr(qm, "num_bits", 4)
        scale = getattr(mod, f"{wn}_weight_scale").detach()[e]
        sc = check._expand_scale(scale, rows, cols, group=group)
        raw = getattr(mod, f"{wn}_weight_packed").detach()[e]
        fields = check._unpack_uint(raw, bits, raw.shape[0], cols).float()
        zraw = getattr(mod, f"{wn}_weight_zero_point").detach()[e]
        groups = scale.shape[-1] if scale.ndim > 1 else 1
        zeros = _zero_fields(check, zraw, bits, rows, groups).float()
        return (fields - check._expand_scale(zeros, rows, cols, group=group)) * sc, sc

    check._vllm_dequant_linear = dequant_linear
    check._vllm_dequant_expert = dequant_expert
    plain_emit = check.emit

    def emit(status: str, name: str, detail: str = "") -> None:
        found = re.search(r"= ([0-9.]+) x scale", detail)
        if name == "ref.int4_vs_float" and found:
            err = float(found.group(1))
            status = "OK" if err <= ZERO_POINT_REF_BOUND + 1e-6 else "FAIL-WRONG"
            detail = (f"{detail.split(' (')[0]} (zero points: round-to-nearest in bf16 reaches "
                      f"{ZERO_POINT_REF_BOUND:.3f}; {detail.rpartition('; ')[2]}")
        plain_emit(status, name, detail)

    check.emit = emit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--ref", help="the float model the folder was made from (every code within half a step)")
    parser.add_argument("--no-h100", action="store_true", help="skip the simulated sm90 kernel choice")
    harness.add_check_argument(parser, harness.VLLM_ACCEPT)
    args = parser.parse_args()
    check, out, ref = harness.start_given_check("vllm_zero_points", args, "vLLM check", "vllm_accept")
    _with_zero_points(check)
    harness.run_check_main(check, args.check, out, ref, args.no_h100)


if __name__ == "__main__":
    main()
