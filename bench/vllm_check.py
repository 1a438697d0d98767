"""Convert models with qconvert and ask vLLM's own loading code (../shared/vllm) whether it serves each folder.

    python bench/vllm_check.py MODEL_FOLDER... [--schemes int8,w8a8,w8a8-static,int4,fp8] [--venv .vllm-venv]
                               [--out DIR] [--ref] [--tpu [--tpu-venv .vllm-tpu-venv]]

For every model and scheme: `qconvert quantize` (w8a8 on random calibration
tokens; `w8a8-static` is `--act static`; `int4-g64` is `--group-size 64`), then
vLLM 0.33's check `vllm_accept.py OUT` in its own virtual environment (built
with ../shared/vllm/setup_venv.sh; it runs vLLM's config parser, model classes,
weight loader and dequantization on CPU). Prints one markdown row per folder:
the conversion's exit code and vLLM's verdict (OK, REFUSE, WRONG), or the
refusal line when qconvert itself refused. `--ref` passes the float model so
the check also bounds each dequantized weight against the float one.
`--tpu` also runs vLLM TPU's check (../shared/vllm-tpu/tpu_accept.py, vllm-tpu
0.32 + tpu-inference 0.32 on CPU, in the venv built with its setup_venv.sh)
twice, each path judged on its own: `--impl auto` (a plain `vllm serve` on TPU)
and `--impl vllm` (`MODEL_IMPL_TYPE=vllm`, the torchax path).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECK = ROOT.parent / "shared" / "vllm" / "vllm_accept.py"
TPU_CHECK = ROOT.parent / "shared" / "vllm-tpu" / "tpu_accept.py"
TPU_IMPLS = ("auto", "vllm")
FLAGS = {
    "int8": ["--scheme", "int8"],
    "int4": ["--scheme", "int4"],
    "int4-g64": ["--scheme", "int4", "--group-size", "64"],
    "fp8": ["--scheme", "fp8"],
    "nf4": ["--scheme", "nf4"],
    "w8a8": ["--scheme", "w8a8", "--calib", "random", "--calib-samples", "4", "--calib-seqlen", "32"],
    "w8a8-static": ["--scheme", "w8a8", "--act", "static", "--calib", "random", "--calib-samples", "4",
                    "--calib-seqlen", "32"],
}


def _verdict(command: list[str], cwd: Path, env: dict) -> tuple[str, str]:
    """(verdict, the last lines) of one acceptance check's run."""
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, env={**os.environ, **env})
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    verdict = next((line.split()[1] for line in reversed(lines) if line.startswith("VERDICT")), "NO VERDICT")
    return verdict, "\n".join(lines[-12:])


def vllm_verdict(venv: Path, folder: Path, ref: Path | None) -> tuple[str, str]:
    """(verdict, the check's last lines) of vllm_accept.py on `folder`."""
    command = [str(venv / "bin" / "python"), CHECK.name, str(folder)] + (["--ref", str(ref)] if ref else [])
    return _verdict(command, CHECK.parent, {"VLLM_TARGET_DEVICE": "cpu"})


def tpu_verdict(venv: Path, folder: Path, impl: str) -> tuple[str, str]:
    """(verdict, the check's last lines) of tpu_accept.py on `folder`, judging MODEL_IMPL_TYPE=impl."""
    command = [str(venv / "bin" / "python"), TPU_CHECK.name, str(folder), "--impl", impl]
    return _verdict(command, TPU_CHECK.parent, {})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", type=Path)
    parser.add_argument("--schemes", default="int8,w8a8,w8a8-static,int4,fp8")
    parser.add_argument("--venv", type=Path, default=ROOT / ".vllm-venv")
    parser.add_argument("--out", type=Path, default=Path("/tmp/qconvert-vllm-check"))
    parser.add_argument("--ref", action="store_true")
    parser.add_argument("--tpu", action="store_true", help="also run vLLM TPU's check on both of its paths")
    parser.add_argument("--tpu-venv", type=Path, default=ROOT / ".vllm-tpu-venv")
    parser.add_argument("--verbose", action="store_true", help="print the check's last lines for each folder")
    args = parser.parse_args()
    if not (args.venv / "bin" / "python").exists():
        sys.exit(f"no vLLM venv at {args.venv}; build it with bash ../shared/vllm/setup_venv.sh {args.venv}")
    if args.tpu and not (args.tpu_venv / "bin" / "python").exists():
        sys.exit(f"no vLLM TPU venv at {args.tpu_venv}; build it with bash ../shared/vllm-tpu/setup_venv.sh "
                 f"{args.tpu_venv}")
    tpu_columns = [f"vLLM TPU 0.32 {impl}" for impl in TPU_IMPLS] if args.tpu else []
    print("| " + " | ".join(["model", "scheme", "qconvert", "vLLM 0.33", *tpu_columns]) + " |")
    print("|" + "---|" * (4 + len(tpu_columns)))
    failed = 0
    for model in args.models:
        for scheme in args.schemes.split(","):
            out = args.out / f"{model.name}-{scheme}"
            subprocess.run(["rm", "-rf", str(out)], check=True)
            done = subprocess.run([sys.executable, "-m", "qconvert.cli.entry", "quantize", str(model), "-o", str(out),
                                   "-q", *FLAGS[scheme]], capture_output=True, text=True)
            if done.returncode != 0:
                refusal = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
                print(f"| {model.name} | {scheme} | exit {done.returncode}: {refusal} |"
                      + " not written |" * (1 + len(tpu_columns)))
                continue
            runs = [vllm_verdict(args.venv, out, model if args.ref else None)]
            runs += [tpu_verdict(args.tpu_venv, out, impl) for impl in TPU_IMPLS] if args.tpu else []
            failed += runs[0][0] != "OK"
            print(f"| {model.name} | {scheme} | 0 | " + " | ".join(v for v, _ in runs) + " |", flush=True)
            for verdict, tail in runs:
                if args.verbose or verdict != "OK":
                    print(tail, file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
