"""llm-compressor's FP4 round-to-nearest (QuantizationModifier with a compressed-tensors FP4 preset) on a float model
folder, written back as a float folder of its fake-quantized weights, or as llm-compressor's own compressed folder.

Run with llm-compressor's own interpreter (its venv, never qconvert's), by bench/int4_defaults.py (--lc nvfp4a16-rtn,
nvfp4-rtn, mxfp4a16-rtn) or by tests/schemes/test_fp4_ct019.py (--compressed):

    /work/lc-venv/bin/python -P bench/lc_fp4.py MODEL OUT --preset NVFP4A16
    /work/lc-venv/bin/python -P bench/lc_fp4.py MODEL OUT --preset NVFP4 --windows WINDOWS.npy
    /work/lc-venv/bin/python -P bench/lc_fp4.py MODEL OUT --preset MXFP4A16 --compressed

QuantizationModifier(targets="Linear", scheme=PRESET, ignore=["lm_head"]) in oneshot, the model loaded in its own
dtype (config.json's), as llm-compressor's NVFP4 examples run it: the weight observers' min/max, one NVFP4 global
scale per fused layer (q/k/v, gate/up: llm-compressor's own fusing), each group's scale. The weight-only presets
read no data; NVFP4 (W4A4) calibrates its input_global_scale on WINDOWS.npy, the token windows [samples, seqlen]
bench/int4_defaults.py gives every recipe.

OUT gets model.safetensors with every tensor as llm-compressor leaves it, each quantized weight replaced by
fake_quantize(weight, its scale, its global scale) in float32 (what a deployment's dequantization of the compressed
checkpoint computes), plus the source's config.json and tokenizer files, so bench/int4_defaults.py evaluates it
with the same evaluator as qconvert's folders. For NVFP4, input_global_scales.json maps each quantized linear to
its calibrated input_global_scale, which the evaluator applies to the activations (NVFP4's groups of 16 with E4M3
scales, computed per token at run time). With --compressed, OUT is llm-compressor's own save_pretrained
(save_compressed=True) folder instead: weight_packed, weight_scale, weight_global_scale as it writes them.
A JSON line with the seconds taken goes to stdout.
"""

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch

PRESETS = ("NVFP4A16", "NVFP4", "MXFP4A16")
EXTRAS = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
          "generation_config.json")


def quantized(args):
    """The model after llm-compressor's QuantizationModifier, and the seconds oneshot took."""
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype="auto")
    recipe = QuantizationModifier(targets="Linear", scheme=args.preset, ignore=["lm_head"])
    data = {}
    if args.windows is not None:
        from datasets import Dataset

        windows = np.load(args.windows)
        data = dict(dataset=Dataset.from_dict({"input_ids": windows.astype(np.int64).tolist(),
                                               "attention_mask": np.ones_like(windows, np.int64).tolist()}),
                    num_calibration_samples=len(windows), max_seq_length=windows.shape[1],
                    shuffle_calibration_samples=False, pipeline="sequential")
    started = time.perf_counter()
    oneshot(model=model, recipe=recipe, **data)
    return model, time.perf_counter() - started


def fake_quantized_state(model) -> tuple[dict, dict]:
    """Every tensor of the model with each quantized weight fake-quantized (float32), and the input global scales."""
    from compressed_tensors.quantization import fake_quantize

    state, inputs = {}, {}
    with torch.no_grad():
        for name, module in model.named_modules():
            weights = getattr(getattr(module, "quantization_scheme", None), "weights", None)
            if weights is None or not hasattr(module, "weight_scale"):
                continue
            zero = getattr(module, "weight_zero_point", None)
            glob = getattr(module, "weight_global_scale", None)
            state[f"{name}.weight"] = fake_quantize(module.weight.data, module.weight_scale.data,
                                                    None if zero is None else zero.data, weights,
                                                    global_scale=None if glob is None else glob.data)
            if hasattr(module, "input_global_scale"):
                inputs[name] = float(module.input_global_scale.data.float().reshape(-1)[0])
        for name, tensor in model.state_dict().items():
            leaf = name.rsplit(".", 1)[-1]
            if leaf.startswith(("weight_", "input_")) or name in state:
                continue
            state[name] = tensor
    if model.config.get_text_config().tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return {k: v.detach().to(torch.float32).contiguous() for k, v in state.items()}, inputs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--preset", required=True, choices=PRESETS)
    parser.add_argument("--windows", type=Path, default=None, help="calibration token windows (NVFP4 needs them)")
    parser.add_argument("--compressed", action="store_true", help="write llm-compressor's compressed folder")
    args = parser.parse_args(argv)
    if args.preset == "NVFP4" and args.windows is None:
        parser.error("--preset NVFP4 calibrates its input_global_scale: pass --windows")

    from safetensors.torch import save_file

    model, seconds = quantized(args)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.compressed:
        model.save_pretrained(args.out, save_compressed=True)
        count = sum(1 for m in model.modules() if hasattr(m, "weight_scale"))
    else:
        state, inputs = fake_quantized_state(model)
        save_file(state, str(args.out / "model.safetensors"), metadata={"format": "pt"})
        if inputs:
            (args.out / "input_global_scales.json").write_text(json.dumps(inputs, indent=1))
        for extra in EXTRAS:
            if (args.model / extra).is_file():
                shutil.copy(args.model / extra, args.out / extra)
        count = sum(1 for m in model.modules() if hasattr(m, "weight_scale"))
    print(json.dumps({"preset": args.preset, "quantized": count, "seconds": round(seconds, 1)}), flush=True)


if __name__ == "__main__":
    main()
