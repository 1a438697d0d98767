"""Convert the test checkpoints with every scheme and the flag sets that change bytes, for byte comparisons.

    python bench/convert_matrix.py OUT                 # build the sources (once) and convert them into OUT
    git stash; python bench/convert_matrix.py /tmp/before; git stash pop
    python bench/convert_matrix.py /tmp/after
    python bench/convert_matrix.py --compare /tmp/before /tmp/after

The sources are the tests' own tiny checkpoints (tests/checkpoints.py,
tests/hf_checkpoints.py, tests/gemma_checkpoints.py: Llama in bfloat16 with
outlier channels and two shards, Llama bfloat16 with tied embeddings, Mixtral,
Qwen3, Phi-3, Qwen3-MoE, Gemma 3 and BERT), built under OUT/../sources
once and reused, so both sides convert the same bytes; with them, the Llama
written in compressed-tensors int4, NVFP4 and MXFP4 (DERIVED), read again as
4-bit sources. Calibration uses random
ids (no tokenizer needed). `--compare` lists, per conversion, every file whose
bytes differ; qconvert.json and the model card (README.md) are compared apart,
since new fields there are expected.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

CALIB = ["--calib", "random", "--calib-samples", "8", "--calib-seqlen", "32"]
FLAG_SETS = {
    "int8": ["--scheme", "int8"],
    "int8-scale-search": ["--scheme", "int8", "--scale-search"],
    "int8-gptq": ["--scheme", "int8", "--gptq", *CALIB],
    "int4": ["--scheme", "int4", "--no-gptq", "--no-awq"],
    "int4-gptq": ["--scheme", "int4", "--no-awq", *CALIB],
    "int4-awq-gptq": ["--scheme", "int4", *CALIB],  # int4's default
    "nf4": ["--scheme", "nf4"],
    "nf4-double-quant": ["--scheme", "nf4", "--double-quant"],
    "fp8": ["--scheme", "fp8"],
    "w8a8": ["--scheme", "w8a8", *CALIB],
    "w8a8-scale-search": ["--scheme", "w8a8", "--scale-search", *CALIB],
    "w8a8-static": ["--scheme", "w8a8", "--act", "static", *CALIB],
    "w8a8-family-gptq": ["--scheme", "w8a8", "--alpha", "family", "--gptq", *CALIB],
    "w8a8-no-smooth": ["--scheme", "w8a8", "--no-smooth", *CALIB],
    "int4-asym": ["--scheme", "int4-asym", "--no-gptq", "--no-awq"],
    "int4-asym-default": ["--scheme", "int4-asym", *CALIB],
    "w4a8-fp8": ["--scheme", "w4a8-fp8", *CALIB],  # AWQ then GPTQ, its default
    "w4a8-fp8-gptq": ["--scheme", "w4a8-fp8", "--no-awq", *CALIB],
    "nvfp4a16": ["--scheme", "nvfp4a16", "--no-gptq", "--no-awq"],
    "nvfp4a16-gptq": ["--scheme", "nvfp4a16", "--gptq", "--no-awq", *CALIB],
    "nvfp4a16-awq": ["--scheme", "nvfp4a16", "--awq", "--no-gptq", *CALIB],
    "mxfp4a16": ["--scheme", "mxfp4a16", "--no-gptq", "--no-awq"],
    "mxfp4a16-gptq": ["--scheme", "mxfp4a16", "--gptq", "--no-awq", *CALIB],
    "nvfp4": ["--scheme", "nvfp4", "--no-gptq", "--no-awq", *CALIB],
    "nvfp4-gptq": ["--scheme", "nvfp4", "--gptq", "--no-awq", *CALIB],
}
# Folders in the 4-bit source formats (a conversion of the llama source), converted again: the streaming reads.
DERIVED = {"llama-ct-int4": ("llama", ["--scheme", "int4", "--no-gptq", "--no-awq"]),
           "llama-ct-nvfp4": ("llama", ["--scheme", "nvfp4a16", "--no-gptq", "--no-awq"]),
           "llama-ct-mxfp4": ("llama", ["--scheme", "mxfp4a16", "--no-gptq", "--no-awq"])}
DERIVED_FLAG_SETS = ("int8", "fp8", "int4-gptq", "w8a8")
SKIP = {("bert", "int4-gptq"), ("bert", "int4-awq-gptq"), ("bert", "int8-gptq"), ("bert", "w8a8-family-gptq"), ("mixtral", "nf4"),
        ("mixtral", "nf4-double-quant"), ("qwen3_moe", "nf4"), ("qwen3_moe", "nf4-double-quant")}


def sources(root: Path) -> dict[str, Path]:
    """The test checkpoints, built once under root."""
    from checkpoints import make_bert_checkpoint, make_llama_checkpoint
    from gemma_checkpoints import GEMMA3, make_gemma_checkpoint
    from hf_checkpoints import make_hf_checkpoint

    makers = {
        "llama": lambda p: make_llama_checkpoint(p, dtype="bfloat16", outlier_channels=(3, 17), shards=2),
        "llama-tied": lambda p: make_llama_checkpoint(p, dtype="bfloat16", tie=True),
        "mixtral": lambda p: make_hf_checkpoint(p, "mixtral"),
        "qwen3": lambda p: make_hf_checkpoint(p, "qwen3"),
        "phi3": lambda p: make_hf_checkpoint(p, "phi3"),
        "qwen3_moe": lambda p: make_hf_checkpoint(p, "qwen3_moe"),
        # Experts whose widths the FP4 groups divide (the tests' default expert width, 24, they do not).
        "qwen3_moe-64": lambda p: make_hf_checkpoint(p, "qwen3_moe", hidden=128, intermediate=128,
                                                     moe_intermediate_size=64),
        "gemma3": lambda p: make_gemma_checkpoint(p, GEMMA3),
        "bert": lambda p: make_bert_checkpoint(p),
    }
    found = {}
    for name, make in makers.items():
        folder = root / name
        if not (folder / "config.json").is_file():
            make(folder)
        found[name] = folder
    return found


def derived_sources(root: Path, found: dict[str, Path]) -> dict[str, Path]:
    """DERIVED's 4-bit folders, written by qconvert under root once."""
    from qconvert.cli.main import main

    derived = {}
    for name, (base, flags) in DERIVED.items():
        folder = root / name
        if not (folder / "config.json").is_file():
            try:
                main(["quantize", str(found[base]), "-o", str(folder), "-q", *flags])
            except SystemExit as exit_:
                if exit_.code:
                    raise SystemExit(f"{name}: the 4-bit source could not be written (exit {exit_.code})")
        derived[name] = folder
    return derived


def convert_all(out: Path) -> None:
    from qconvert.cli.main import main

    out.mkdir(parents=True, exist_ok=True)
    found = sources(out.parent / "sources")
    runs = [(name, src, label) for name, src in found.items() for label in FLAG_SETS]
    runs += [(name, src, label) for name, src in derived_sources(out.parent / "sources", found).items()
             for label in DERIVED_FLAG_SETS]
    for name, src, label in runs:
        target = out / f"{name}-{label}"
        if (name, label) in SKIP or target.exists():
            continue
        try:
            main(["quantize", str(src), "-o", str(target), "-q", *FLAG_SETS[label]])
        except SystemExit as exit_:
            if exit_.code:
                print(f"{name} {label}: exit {exit_.code}", flush=True)
                continue
        print(f"{name} {label}: converted", flush=True)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def compare(before: Path, after: Path) -> int:
    """Print each conversion's differing files; the number of conversions whose tensors or configs differ."""
    differing = 0
    for a in sorted(p for p in before.iterdir() if p.is_dir()):
        b = after / a.name
        if not b.is_dir():
            print(f"{a.name}: missing on the second side")
            differing += 1
            continue
        names = sorted({p.name for p in a.iterdir()} | {p.name for p in b.iterdir()})
        changed = [n for n in names if not (a / n).is_file() or not (b / n).is_file() or digest(a / n) != digest(b / n)]
        records = [n for n in changed if n in ("qconvert.json", "README.md")]
        payload = [n for n in changed if n not in records]
        differing += bool(payload)
        print(f"{a.name}: {'same bytes' if not payload else 'DIFFERS: ' + ', '.join(payload)}"
              + (f" (record: {', '.join(records)})" if records else ""))
    return differing


def main_() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, nargs="?")
    parser.add_argument("--compare", type=Path, nargs=2, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.compare:
        sys.exit(1 if compare(*args.compare) else 0)
    if args.out is None:
        parser.error("give OUT, or --compare BEFORE AFTER")
    convert_all(args.out)


if __name__ == "__main__":
    main_()
