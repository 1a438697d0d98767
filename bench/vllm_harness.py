"""How the bench/vllm_*.py scripts drive vLLM's and vLLM TPU's own loading checks (../shared/vllm/vllm_accept.py,
../shared/vllm-tpu/tpu_accept.py): the check loaded as a module and run from its own folder, the script's
changes installed after the check's own patches, its arguments, and its exit.

The scripts run in the servers' venvs (vllm, torch and compressed-tensors, not qconvert): this module needs only
the standard library. A script imports it (and any other bench module it uses) first, then calls
leave_import_path().
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

BENCH = Path(__file__).resolve().parent
VLLM_ACCEPT = BENCH.parent.parent / "shared" / "vllm" / "vllm_accept.py"
TPU_ACCEPT = BENCH.parent.parent / "shared" / "vllm-tpu" / "tpu_accept.py"


def leave_import_path() -> None:
    """Take bench/ off the import path: it holds modules named like packages the loaders import (kernels.py: the
    `kernels` package transformers probes under vLLM)."""
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]


def load_check(path: Path, name: str):
    """The check script at `path` as module `name` (a script of the shared tools, not a package: on import it
    sets only its environment defaults, and tpu_accept.py its tokamax stub), its folder first on the import path."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(path.parent))
    spec.loader.exec_module(module)
    return module


def open_check(path: Path, name: str):
    """load_check from the check's own folder, as it is run itself: vLLM inspects some architectures in a
    subprocess that imports from its working folder (this repository's root holds a `kernels` package)."""
    path = path.resolve()
    os.chdir(path.parent)
    return load_check(path, name)


def after_own_patches(accept, patch: Callable[[object], None]) -> None:
    """patch(accept) runs right after vllm_accept's own patches, which it installs once the config is parsed
    (vLLM imported in order)."""
    install = accept.install_patches
    accept.install_patches = lambda: (install(), patch(accept))


def accept_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments of a script run as vllm_accept.py with changes: OUT, --ref and --accept."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--ref", help="the float model the folder was made from")
    parser.add_argument("--accept", type=Path, default=VLLM_ACCEPT, help="vllm_accept.py of the shared tools")
    return parser


def start_on_cpu(parser: argparse.ArgumentParser):
    """(args, vllm_accept as a module, OUT, --ref or None) for a script of accept_parser's arguments: vLLM's
    loading code on CPU, OUT and --ref as absolute paths, run from the check's folder."""
    args = parser.parse_args()
    if os.environ.get("VLLM_TARGET_DEVICE") != "cpu":
        parser.error("run with VLLM_TARGET_DEVICE=cpu (vLLM's loading code on CPU)")
    out, ref = os.path.abspath(args.out), args.ref and os.path.abspath(args.ref)
    return args, open_check(args.accept, "vllm_accept"), out, ref


def run_accept(doc: str, patch: Callable[[object], None]) -> NoReturn:
    """vllm_accept.py on OUT (accept_parser's arguments, `doc` the script's docstring) with patch(accept)
    installed after its own patches; exits with its verdict's code."""
    _, accept, out, ref = start_on_cpu(accept_parser(doc))
    after_own_patches(accept, patch)
    exit_reporting(accept, lambda: accept.run(out, ref, False))


def add_check_argument(parser: argparse.ArgumentParser, default: Path) -> None:
    """--check: the shared check script to run (VLLM_ACCEPT or TPU_ACCEPT by default)."""
    parser.add_argument("--check", type=Path, default=default, help=f"{default.name} (default: %(default)s)")


def start_given_check(script: str, args: argparse.Namespace, what: str, name: str):
    """(the check given as --check as module `name`, OUT, --ref or None): OUT and --ref resolved, then
    open_check; exit with one line where the check is not there."""
    out = str(Path(args.out).resolve())
    ref = str(Path(args.ref).resolve()) if getattr(args, "ref", None) else None
    if not args.check.is_file():
        sys.exit(f"{script}: no {what} at {args.check}; pass --check PATH/{name}.py")
    return open_check(args.check, name), out, ref


def run_check_main(check, path: Path, out: str, ref: str | None, no_h100: bool) -> None:
    """vllm_accept.py's own main on OUT (its exit: the verdict's code)."""
    sys.argv = [str(path), out, *(["--ref", ref] if ref else []), *(["--no-h100"] if no_h100 else [])]
    check.main()


def exit_now(code: int) -> NoReturn:
    """Exit as the checks do: stdout flushed, vLLM's teardown noise skipped."""
    sys.stdout.flush()
    os._exit(code)


def exit_reporting(check, run: Callable[[], int]) -> NoReturn:
    """Exit with run()'s code; an unexpected exception is reported as the check reports one (FAIL-REFUSE
    `unexpected`, then its verdict)."""
    try:
        code = run()
    except Exception as exc:  # noqa: BLE001 - reported as the check reports it
        check.emit("FAIL-REFUSE", "unexpected", f"{check.short_exc(exc)} at {check.where(exc)}")
        code = check.finish()
    exit_now(code)
