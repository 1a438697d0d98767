"""The model card: the README.md that quantize writes into OUT, and the verification section verify adds.

The card is text made only from what qconvert.json records and the plan's sizes
(no dates, no output path), so the same conversion writes the same bytes; it is
listed in qconvert.json's `files` like every other output file, and
`verify --update-card` rewrites its verification section and that hash together.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from qconvert import interrupts
from qconvert.formats.jsonfile import json_bytes
from qconvert.formats.quantized_sources import read_as
from qconvert.formats.record import RECORD_NAME, ConversionRecord, SourceRecord, read_record

CARD_NAME = "README.md"
VERIFY_BEGIN = "<!-- qconvert verify: begin -->"
VERIFY_END = "<!-- qconvert verify: end -->"
# A placeholder, not OUT's path: the card must not change with where the folder was written.
FOLDER = "path/to/this/folder"


@dataclasses.dataclass(frozen=True)
class CardFacts:
    """What the card says about a conversion."""

    record: ConversionRecord  # qconvert.json as written (its `files` not yet known)
    quant_method: str  # quantization_config["quant_method"]: the Python package transformers needs
    scheme_summary: str
    loads_in: str
    vllm_loads: bool
    causal_lm: bool  # a decoder (AutoModelForCausalLM, LLM.generate), else an encoder (AutoModel, LLM.embed)
    architecture: str
    quantized_linears: int
    unchanged_tensors: int
    input_bytes: int
    output_bytes: int
    pip_packages: tuple[str, ...] = ()  # beside transformers, to load the folder (default: quant_method's)
    act_applies: bool = True  # the scheme quantizes activations, so the act flag shaped the folder
    repo: str | None = None  # the Hub repository the folder is uploaded to (--upload-repo): loads name it
    transformers_quantization_config: str = ""  # the layout's quantization_config= for from_pretrained, if any
    transformers_dtype: str = ""  # the layout's dtype= (a torch dtype's name) for from_pretrained, if any
    # Each server's recorded answer for this scheme, flags and model family (qconvert.schemes.servers, what
    # `qconvert inspect` prints): the card's "loads in" row, and whether it shows vLLM's snippet. Empty: loads_in.
    servers: Mapping[str, str] = dataclasses.field(default_factory=dict)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _source_lines(source: SourceRecord) -> list[str]:
    model = source.model or "(unknown)"
    if source.is_hub:
        where = f"[`{model}`](https://huggingface.co/{model}), commit `{source.commit}`"
    else:
        where = f"`{model}` (a local folder; no Hub commit)"
    if source.format is not None:
        where += f" ({source.format}: {read_as(source.format)})"
    return [f"| source | {where} |"]


def _flags_line(record: ConversionRecord, act_applies: bool) -> str:
    """The flags that shaped the folder: not the scheme (its own row), not those left unset, off or empty, and
    not the activation mode of a scheme that keeps activations float (qconvert.json records every one)."""
    def applied(key: str, value: Any) -> bool:
        return key != "scheme" and value not in (None, False, [], {}) and (key != "act" or act_applies)

    shown = ", ".join(f"`{key}={json.dumps(value, sort_keys=True)}`" for key, value in sorted(record.flags.items())
                      if applied(key, value))
    return f"| flags | {shown or '(defaults)'} |"


def _rounding_line(record: ConversionRecord) -> str:
    """How the weights were rounded: GPTQ with its settings, or to nearest (after AWQ's scales, where folded)."""
    rounding = record.rounding or {}
    awq = ("AWQ's per-channel scales (searched on the calibration text below, folded into the norms and linears "
           "before them), then " if record.smoothing is not None and record.smoothing.method == "awq" else "")
    if rounding.get("method") == "gptq":
        return (f"| rounding | {awq}GPTQ (dampening {rounding.get('damp')}, act order "
                f"{'on' if rounding.get('act_order') else 'off'}) on the calibration text below |")
    return f"| rounding | {awq}to nearest |"


def _calibration_line(record: ConversionRecord) -> list[str]:
    calibration = record.calibration
    if not calibration:
        return []
    text = calibration.get("description") or calibration.get("source", "")
    samples, seqlen = calibration.get("samples"), calibration.get("seqlen")
    return [f"| calibration | {text}; {samples} x {seqlen} tokens |"]


def _front_matter(facts: CardFacts) -> list[str]:
    source = facts.record.source
    lines = ["---"]
    if source.is_hub:  # the Hub lists the folder, once uploaded, among its base model's quantizations
        lines += [f"base_model: {source.model}", "base_model_relation: quantized"]
    lines += ["library_name: transformers", "tags:", "- qconvert", "- quantized", f"- {facts.record.scheme}",
              f"- {facts.quant_method}", "---", ""]
    return lines


def _transformers_snippet(facts: CardFacts) -> list[str]:
    auto = "AutoModelForCausalLM" if facts.causal_lm else "AutoModel"
    use = ('inputs = tokenizer("The capital of France is", return_tensors="pt")',
           "print(tokenizer.decode(model.generate(**inputs, max_new_tokens=8)[0]))") if facts.causal_lm else (
           'inputs = tokenizer(["A sentence to embed."], return_tensors="pt")',
           "print(model(**inputs).last_hidden_state.mean(dim=1))")
    packages = " ".join(facts.pip_packages or (facts.quant_method,))
    where = facts.repo or FOLDER
    qconfig = facts.transformers_quantization_config
    names = ", ".join([auto, "AutoTokenizer"] + ([qconfig.split("(")[0]] if qconfig else []))
    load_args = f'"{where}"' + (f", quantization_config={qconfig}" if qconfig else "")
    load_args += f", dtype=torch.{facts.transformers_dtype}" if facts.transformers_dtype else ""
    return [f"transformers (with `pip install transformers {packages}`):", "", "```python",
            *(["import torch"] if facts.transformers_dtype else []), f"from transformers import {names}", "",
            f'model = {auto}.from_pretrained({load_args})', f'tokenizer = AutoTokenizer.from_pretrained("{where}")',
            *use, "```", ""]


def _loads_in_line(facts: CardFacts) -> str:
    """Each server's recorded answer for the folder, in the words `qconvert inspect` prints after "loads in: ";
    without them, the scheme's loaders."""
    if not facts.servers:
        return f"| loads in | {facts.loads_in} |"
    answers = "; ".join(f"{server} {answer}" for server, answer in facts.servers.items())
    return f"| loads in | {answers} (as measured for this model family: docs/LOADERS.md) |"


def _vllm_snippet(facts: CardFacts) -> list[str]:
    if not facts.vllm_loads:
        return [f"vLLM: does not load this layout ({facts.loads_in}).", ""]
    measured = facts.servers.get("vLLM GPU")
    if measured == "no":
        return ["vLLM: does not load this folder (as measured for this model family).", ""]
    use = ('print(llm.generate(["The capital of France is"])[0].outputs[0].text)' if facts.causal_lm
           else 'print(llm.embed(["A sentence to embed."])[0].outputs.embedding[:4])')
    # With KV-cache scales, the cache they are for (vLLM's default keeps it in the model's dtype).
    cache = ', kv_cache_dtype="fp8"' if facts.record.kv_cache is not None else ""
    heading = "vLLM (not measured for this model family):" if measured == "not measured" else "vLLM:"
    return [heading, "", "```python", "from vllm import LLM", "",
            f'llm = LLM(model="{facts.repo or FOLDER}"{cache})', use, "```", ""]


def _kv_cache_line(record: ConversionRecord) -> list[str]:
    """The KV cache's scales, where the folder has them."""
    if record.kv_cache is None:
        return []
    return [f"| KV cache | {record.kv_cache.get('scheme')} scales per tensor (k_scale, v_scale: each attention block's "
            "largest calibrated key and value magnitude / 448); served with an FP8 cache |"]


def model_card(facts: CardFacts) -> str:
    """The card's text: what was converted and how, the sizes, and how to load it."""
    record = facts.record
    source = record.source
    # The repository it is published as, or the source's own name.
    name = facts.repo or str(source.model or "model").rstrip("/").split("/")[-1]
    ratio = facts.input_bytes / facts.output_bytes if facts.output_bytes else 0.0
    lines = _front_matter(facts) + [
        f"# {name} ({record.scheme})", "",
        f"{facts.architecture} quantized by qconvert {record.qconvert_version}: {facts.scheme_summary}.", "",
        "| | |", "|---|---|", *_source_lines(source),
        f"| scheme | `{record.scheme}` ({facts.quant_method} layout) |", _flags_line(record, facts.act_applies),
        _rounding_line(record),
        *_calibration_line(record), *_kv_cache_line(record),
        (f"| size | {_mib(facts.input_bytes)} -> {_mib(facts.output_bytes)} ({ratio:.2f}x smaller); "
         f"{facts.quantized_linears} linears quantized, {facts.unchanged_tensors} tensors unchanged |"),
        _loads_in_line(facts), "",
        ("qconvert.json records every flag and the sha256 of every file, this card's included; "
         f"`qconvert verify {FOLDER}` checks them and the quantized model against the float one."), "",
        "## Load it", "", *_vllm_snippet(facts), *_transformers_snippet(facts),
    ]
    return "\n".join(lines)


def write_card(folder: Path, facts: CardFacts) -> str:
    """folder/README.md (mode 0644); its sha256."""
    raw = model_card(facts).encode("utf-8")
    path = Path(folder) / CARD_NAME
    path.write_bytes(raw)
    os.chmod(path, 0o644)
    return hashlib.sha256(raw).hexdigest()


def verify_section(record: Mapping[str, Any]) -> str:
    """The card's verification section, from verify's JSON record (figures only: no seconds, no dates)."""
    evaluation = record.get("evaluation") or {}
    layers = record.get("layers") or []
    # The verdict without the folder's path, which depends on where verify was run from.
    verdict = str(record.get("verdict", "")).replace(f" {record.get('out')}:", ":", 1)
    lines = [VERIFY_BEGIN, "## Verification", "", f"`qconvert verify`: **{verdict}**", ""]
    given = record.get("thresholds_given") or {}
    if given:  # a verdict under other thresholds than the scheme's says so where it is read
        lines.append("- under thresholds given on the command line, not the scheme's: "
                     + ", ".join(f"{k} {v:g}" for k, v in sorted(given.items())))
    if evaluation.get("quick"):
        lines.append("- with `--quick`: a small evaluation sample, a smoke check")
    if evaluation.get("samples") is not None:
        lines.append(f"- evaluation text: {evaluation.get('description') or evaluation.get('source')}; "
                     f"{evaluation.get('samples')} x {evaluation.get('seqlen')} tokens")
    if layers:
        sqnr = sorted(float(r["sqnr_db"]) for r in layers if isinstance(r.get("sqnr_db"), (int, float)))
        if sqnr:
            lines.append(f"- per linear ({len(layers)}): SQNR worst {sqnr[0]:.1f} dB, median "
                         f"{sqnr[len(sqnr) // 2]:.1f} dB against the float layer")
    model = record.get("model") or {}
    figures = {k: v for k, v in model.items() if k not in ("kind", "passed", "sequences", "tokens", "checks")}
    if figures:
        shown = ", ".join(f"{k} {v:.6g}" if isinstance(v, float) else f"{k} {v}" for k, v in sorted(figures.items()))
        lines.append(f"- whole model ({model.get('kind')}, {model.get('sequences')} sequences, "
                     f"{model.get('tokens')} tokens): {shown}")
    lines.append(f"- kernels: backend {record.get('backend')}; qconvert {(record.get('versions') or {}).get('qconvert')}")
    lines += ["", VERIFY_END]
    return "\n".join(lines)


def with_verify_section(card: str, section: str) -> str:
    """`card` with its verification section replaced by `section`, or `section` appended."""
    begin, end = card.find(VERIFY_BEGIN), card.find(VERIFY_END)
    if begin != -1 and end > begin:
        return card[:begin] + section + card[end + len(VERIFY_END):]
    return card.rstrip("\n") + "\n\n" + section + "\n"


def update_card(folder: Path, verify_record: Mapping[str, Any]) -> str:
    """Write verify's section into folder/README.md and its new sha256 into qconvert.json; returns the sha256.

    Both files are written beside their targets and renamed into place with
    signals held back, README.md first: were the second rename never to happen,
    the card would fail verify's integrity check, never pass with a stale hash.
    """
    folder = Path(folder)
    card_path, record_path = folder / CARD_NAME, folder / RECORD_NAME
    card = card_path.read_text(encoding="utf-8") if card_path.is_file() else ""
    text = with_verify_section(card, verify_section(verify_record)).encode("utf-8")
    digest = hashlib.sha256(text).hexdigest()
    record = read_record(folder)
    record = dataclasses.replace(record, files=dict(sorted({**record.files, CARD_NAME: digest}.items())))
    _replace_together([(card_path, text), (record_path, json_bytes(record.to_json()))])
    return digest


def _replace_together(files: list[tuple[Path, bytes]]) -> None:
    """Write every file beside its target, then rename them into place in order, signals held back; a failed
    write removes the temporaries and leaves every target as it was."""
    temporaries = [path.with_name(f".{path.name}.qconvert-tmp") for path, _ in files]
    with interrupts.deferred():
        try:
            for temporary, (_, data) in zip(temporaries, files):
                temporary.write_bytes(data)
                os.chmod(temporary, 0o644)
        except BaseException:
            for temporary in temporaries:
                temporary.unlink(missing_ok=True)
            raise
        for temporary, (path, _) in zip(temporaries, files):
            os.replace(temporary, path)
