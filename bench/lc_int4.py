"""llm-compressor's int4 recipe on a float model folder, written back as a float folder of its dequantized weights.

Run with llm-compressor's own interpreter (its venv, never qconvert's), by bench/int4_defaults.py:

    /work/lc-venv/bin/python bench/lc_int4.py MODEL WINDOWS.npy OUT --group 64 [--recipe awq-gptq-asym]

WINDOWS.npy holds the calibration token windows [samples, seqlen] (int32) that bench/int4_defaults.py gives every
recipe, so llm-compressor calibrates on exactly the tokens qconvert does. Recipes:

- awq-gptq-asym: AWQModifier(duo_scaling="both") then GPTQModifier with W4A16_ASYM (asymmetric int4, zero points),
  the group size given (W4A16_ASYM's own is 128; llm-compressor refuses a group that does not divide a linear's
  input, so a model whose inputs 128 does not divide is run at 64), GPTQ's defaults (dampening 0.01, act order
  "static"), lm_head left float.
- gptq-asym / gptq-sym: GPTQModifier alone, W4A16_ASYM or W4A16 at that group size.

OUT gets model.safetensors with every tensor as llm-compressor leaves it, each quantized weight replaced by
fake_quantize(weight, its scale, its zero point) (what a deployment's dequantization of the compressed checkpoint
computes), plus the source's config.json and tokenizer files: bench/int4_defaults.py evaluates it with the same
evaluator as qconvert's folders. A JSON line with the seconds taken goes to stdout.
"""

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", type=Path)
    parser.add_argument("windows", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--recipe", default="awq-gptq-asym", choices=["awq-gptq-asym", "gptq-asym", "gptq-sym"])
    args = parser.parse_args()

    from compressed_tensors.quantization import QuantizationScheme, fake_quantize, preset_name_to_scheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    if not torch.cuda.is_available():
        # llm-compressor 0.14's AWQ pins its cached activations for faster host-to-device copies, which a CPU-only
        # torch refuses ("Cannot access accelerator device"); pinning changes no value, so it is skipped here.
        from llmcompressor.pipelines.cache import IntermediatesCache

        IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
    torch.manual_seed(0)
    windows = np.load(args.windows)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    preset = "W4A16" if args.recipe == "gptq-sym" else "W4A16_ASYM"
    scheme: QuantizationScheme = preset_name_to_scheme(preset, ["Linear"])
    scheme.weights.group_size = args.group
    gptq = GPTQModifier(config_groups={"group_0": scheme}, ignore=["lm_head"])
    recipe = [AWQModifier(duo_scaling="both"), gptq] if args.recipe.startswith("awq") else [gptq]
    data = Dataset.from_dict({"input_ids": windows.astype(np.int64).tolist(),
                              "attention_mask": np.ones_like(windows, np.int64).tolist()})
    started = time.perf_counter()
    oneshot(model=model, dataset=data, recipe=recipe, num_calibration_samples=len(windows),
            max_seq_length=windows.shape[1], shuffle_calibration_samples=False, pipeline="sequential")
    seconds = time.perf_counter() - started

    state = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            weights = getattr(getattr(module, "quantization_scheme", None), "weights", None)
            if weights is not None and hasattr(module, "weight_scale"):
                zero = getattr(module, "weight_zero_point", None)
                state[f"{name}.weight"] = fake_quantize(module.weight.data, module.weight_scale.data,
                                                        None if zero is None else zero.data, weights)
        for name, tensor in model.state_dict().items():
            if name.endswith(("weight_scale", "weight_zero_point", "weight_g_idx")) or name in state:
                continue
            state[name] = tensor
    if model.config.get_text_config().tie_word_embeddings:
        state.pop("lm_head.weight", None)
    args.out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to(torch.float32).contiguous() for k, v in state.items()},
              str(args.out / "model.safetensors"), metadata={"format": "pt"})
    for extra in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                  "generation_config.json"):
        if (args.model / extra).is_file():
            shutil.copy(args.model / extra, args.out / extra)
    print(json.dumps({"recipe": args.recipe, "group": args.group, "quantized": sum(
        1 for m in model.modules() if hasattr(m, "weight_scale")), "seconds": round(seconds, 1)}), flush=True)


if __name__ == "__main__":
    main()
