"""Run vLLM TPU's own loading of a w4a8-fp8 folder on CPU and compare what it holds with the checkpoint.

    TPU_VENV/bin/python bench/vllm_tpu_w4a8.py OUT [--impl vllm|auto] [--accept ../shared/vllm-tpu/tpu_accept.py]

tpu_accept.py loads W4A8-FP8 folders through tpu-inference 0.32 (its VllmCompressedTensorsW4A8Fp8 linears
and VllmCompressedTensorsW4A8MoEMethod experts) but does not map their arrays, so it reports their values as
mismatches. This uses its loading as it is (tpu_accept.load_once: EngineArgs, get_model on a 1x1 CPU mesh,
the parameters pre-filled, each checkpoint tensor tracked to a weight_loader) and then compares, written
here from the format:

- consumed: every checkpoint tensor reached a weight_loader;
- written: every array equal across two loads pre-filled with 7 and -3;
- dense W4A8 linears: `weight` [in, out] int4 equals the codes unpacked from the checkpoint's weight_packed
  (fused q/k/v and gate/up concatenated), transposed; `weight_scale` [in/group, out] equals the checkpoint's
  group scales, transposed; weight.T times its group's scale equals compressed-tensors' decompression, bit
  for bit;
- experts: tpu-inference requantizes them after loading (process_quantized_moe_weights: the int4 groups
  dequantized and stored again with one scale per expert output channel); their dequantization is compared
  with compressed-tensors' in steps of that new grid, saying whether the codes are compressed-tensors'
  values rounded to nearest or toward zero onto it (WARN: the server's lossy re-rounding, not a misreading);
  beyond one step FAIL.

Last line: VERDICT OK|REFUSE|WRONG, as tpu_accept.py.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np

import vllm_harness as harness

harness.leave_import_path()


def dense_checks(ta, model, state, ck, decompressed) -> None:
    from tpu_inference.layers.vllm.quantization.compressed_tensors.schemes.compressed_tensors_w4a8_fp8 import \
        VllmCompressedTensorsW4A8Fp8

    packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
    values, exact, bad = 0, 0, []
    for name, mod in model.named_modules():
        if not isinstance(getattr(mod, "scheme", None), VllmCompressedTensorsW4A8Fp8):
            continue
        base, _, leaf = name.rpartition(".")
        parts = [f"{base}.{p}" for p in packed.get(leaf, [])] or [name]
        parts = [p for p in parts if f"{p}.weight_packed" in ck] or [name]
        w, s = state.get(f"vllm_model.{name}.weight"), state.get(f"vllm_model.{name}.weight_scale")
        if w is None or s is None:
            bad.append(f"{name}: no weight / weight_scale array")
            continue
        codes = np.concatenate([ta.unpack_int4(ck.get(f"{p}.weight_packed"), ck.meta[f"{p}.weight_packed"][0][1] * 8)
                                [:, : int(ck.get(f"{p}.weight_shape")[1])] for p in parts], 0)
        scales = np.concatenate([ta.tnp(ck.get(f"{p}.weight_scale").float()) for p in parts], 0)
        if w.shape != codes.T.shape or not np.array_equal(w.astype(np.int64), codes.T.astype(np.int64)):
            bad.append(f"{name}.weight {w.shape} != unpacked codes.T {codes.T.shape}")
        elif s.shape != scales.T.shape or not np.array_equal(s.astype(np.float32), scales.T.astype(np.float32)):
            bad.append(f"{name}.weight_scale {s.shape} != checkpoint scales.T {scales.T.shape}")
        else:
            values += 1
        group = codes.shape[1] // scales.shape[1]
        tpu = (w.T.astype(np.float32) * np.repeat(s.T.astype(np.float32), group, axis=1))
        ref = np.concatenate([decompressed[p].float().numpy() for p in parts], 0)
        if tpu.shape == ref.shape and np.array_equal(tpu, ref):
            exact += 1
        else:
            bad.append(f"{name}: weight.T x group scale != compressed-tensors decompression")
    if bad:
        ta.emit("FAIL-WRONG", "w4a8.dense", "; ".join(bad[:4]))
    else:
        ta.emit("OK", "w4a8.dense", f"{values} W4A8 linears: int4 weight [in, out] and group scales [in/group, out] "
                f"equal the checkpoint's; {exact} dequantized bit for bit equal to compressed-tensors'")


def expert_checks(ta, model, state, ck, decompressed) -> None:
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    worst, count, bad, rules = 0.0, 0, [], {}
    for name, mod in model.named_modules():
        if not isinstance(mod, RoutedExperts):
            continue
        names = ta.expert_ckpt_names(model, mod, name, ck)
        if names is None:
            bad.append(f"{name}: experts not mapped to checkpoint names")
            continue
        prefix, gate, up, down = names
        for wn, projs in (("w13", (gate, up)), ("w2", (down,))):
            w, s = state.get(f"vllm_model.{name}.{wn}_weight"), state.get(f"vllm_model.{name}.{wn}_weight_scale")
            for e in range(w.shape[0]):
                ref = np.concatenate([decompressed[f"{prefix}.{e}.{p}"].float().numpy() for p in projs], 0)
                scale = s[e].reshape(1, -1).astype(np.float32)
                tpu = (w[e].astype(np.float32) * scale).T
                if tpu.shape != ref.shape:
                    bad.append(f"{name}[{e}].{wn}: {tpu.shape} != {ref.shape}")
                    continue
                err = float(np.max(np.abs(tpu - ref) / scale.T))  # in steps of the new per-channel grid
                worst, count = max(worst, err), count + 1
                # Which re-rounding onto the new grid the stored codes are: to nearest, or toward zero.
                steps = ref / scale.T
                for rule, codes in (("nearest", np.rint(steps)), ("toward zero", np.trunc(steps))):
                    if np.array_equal(w[e].T.astype(np.float64), codes.astype(np.float64)):
                        rules[rule] = rules.get(rule, 0) + 1
    if bad or worst > 1 + 1e-3:
        ta.emit("FAIL-WRONG", "w4a8.experts", "; ".join(bad[:4]) or f"max error {worst:.3f} steps of the new grid")
    elif count:
        how = ", ".join(f"{n} rounded {rule}" for rule, n in rules.items()) or "by neither rule"
        ta.emit("WARN" if worst > 0 else "OK", "w4a8.experts",
                f"{count} expert weights requantized by tpu-inference after loading to codes "
                f"{int(w.min())}..{int(w.max())} "
                f"with one scale per output channel ({how} from compressed-tensors' decompression): within "
                f"{worst:.3f} of a step of that grid (the server's lossy re-rounding, not a misreading)")


def compare(ta, out: str, impl: str) -> int:
    """tpu_accept's loading of OUT twice (fills 7 and -3) on MODEL_IMPL_TYPE=impl, then the module docstring's
    comparisons; the check's exit code (SystemExit where it stops early)."""
    qc = json.loads(Path(out, "config.json").read_text())["quantization_config"]
    ck = ta.Checkpoint(out)
    ta.make_config(out)
    ta.install_load_tracking()
    try:
        _, resolved, first = ta.load_once(out, impl, 7)
    except Exception as exc:  # noqa: BLE001 - the server's refusal, reported as the tool reports it
        ta.emit("FAIL-REFUSE", "get_model", f"{ta.short_exc(exc)} at {ta.where(exc)}")
        raise SystemExit(ta.finish()) from None
    if not isinstance(first.state, dict) or ta.TRACK["model"] is None:
        ta.emit("INFO", "get_model", f"resolved to {resolved}: not the vllm path; nothing compared here")
        raise SystemExit(ta.finish())
    model, consumed = ta.TRACK["model"], set(ta.TRACK["consumed"])
    state = {k: ta.to_np(v) for k, v in first.state.items()}
    ta.emit("OK", "get_model", f"resolved to {resolved}: built, loaded, processed, sharded ({len(state)} arrays)")
    missing = sorted(set(ck.meta) - consumed)
    ta.emit("FAIL-WRONG" if missing else "OK", "consumed",
            f"{len(missing)} not taken: {missing[:4]}" if missing else f"all {len(ck.meta)} checkpoint tensors")
    _, _, second = ta.load_once(out, impl, -3)
    again = {k: ta.to_np(v) for k, v in second.state.items()}
    scales = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")
    unwritten = [k for k in state if not k.endswith(scales) and not np.array_equal(state[k], again.get(k))]
    ta.emit("FAIL-WRONG" if unwritten else "OK", "written",
            f"{len(unwritten)} arrays depend on the pre-fill: {unwritten[:4]}" if unwritten
            else "every array equal across fills 7 / -3")
    decompressed = ta.ct_decompress(ck, qc)
    dense_checks(ta, model, state, ck, decompressed)
    expert_checks(ta, model, state, ck, decompressed)
    return ta.finish()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--impl", default="vllm", help="MODEL_IMPL_TYPE (auto: what a plain vllm serve takes)")
    parser.add_argument("--accept", type=Path, default=harness.TPU_ACCEPT, help="tpu_accept.py of the shared tools")
    args = parser.parse_args()
    out = os.path.abspath(args.out)
    ta = harness.open_check(args.accept, "tpu_accept")
    try:
        code = compare(ta, out, args.impl)
    except SystemExit as done:
        code = done.code
    harness.exit_now(code)


if __name__ == "__main__":
    main()
