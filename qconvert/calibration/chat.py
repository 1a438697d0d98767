"""A model's chat template rendered as transformers renders it, so chat rows of a calibration dataset become the
text the model is served.

The template is the model folder's chat_template.jinja, else tokenizer_config.json's `chat_template` (a string,
or a list of {name, template} of which `default` is used). It is a checkpoint's code, so it runs only inside
jinja2's immutable sandbox, with the environment and globals transformers gives it: trim_blocks and
lstrip_blocks, loop controls, the `{% generation %}` block, `raise_exception`, `strftime_now`, a `tojson` that
does not escape HTML, a `namespace` that refuses underscore names, the tokenizer's special token strings
(bos_token, eos_token...), and add_generation_prompt false. `strftime_now` formats a fixed moment (FIXED_NOW),
not the clock, so the same rows give the same text on any day. One row's rendering is bounded in the text it
writes and the time it takes (template_bounds).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
from pathlib import Path
from typing import Any, Mapping

from qconvert.calibration.template_bounds import (BoundedEnvironmentMixin, bounded_code_generator, bounded_filter,
                                                  bounded_render)
from qconvert.formats.errors import InvalidCheckpointError, UsageError
from qconvert.formats.jsonfile import JsonFileError, read_json_object

TEMPLATE_FILE = "chat_template.jinja"
FIXED_NOW = datetime.datetime(2025, 1, 1, 0, 0, 0)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# ShareGPT-style rows ({"from": ..., "value": ...}) speak of their roles so.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool"}
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A model's chat template, compiled in the sandbox, with the special token strings it is rendered with."""

    source: str  # the file it was read from
    text: str
    special_tokens: Mapping[str, str]
    compiled: Any = dataclasses.field(compare=False, repr=False)

    def render(self, messages: list[dict[str, Any]]) -> str:
        """The conversation as the template writes it (no generation prompt), within template_bounds' bounds
        on the text written and the time taken (TemplateBoundError past one); jinja2's errors pass through."""
        stream = self.compiled.generate(messages=_aliased_reasoning(messages), tools=None, documents=None,
                                        add_generation_prompt=False, **self.special_tokens)
        return bounded_render(self.compiled.environment, stream)

    def record(self) -> dict[str, str]:
        """What qconvert.json says of the template applied."""
        return {"file": self.source, "sha256": hashlib.sha256(self.text.encode("utf-8")).hexdigest()}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return read_json_object(path) if path.is_file() else {}
    except JsonFileError as err:
        raise InvalidCheckpointError(f"{path} cannot be read ({err.kind}); fix or remove it") from None


def special_tokens(folder: Path) -> dict[str, str]:
    """The named special tokens' strings: tokenizer_config.json's, then special_tokens_map.json's for the rest."""
    tokens: dict[str, str] = {}
    for source in (_read_json(folder / "tokenizer_config.json"), _read_json(folder / "special_tokens_map.json")):
        for name in SPECIAL_TOKENS:
            value = source.get(name)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str) and name not in tokens:
                tokens[name] = value
    return tokens


def load_chat_template(folder: Path) -> ChatTemplate | None:
    """The model's chat template compiled in the sandbox, or None when the folder has none."""
    folder = Path(folder)
    if (folder / TEMPLATE_FILE).is_file():
        try:
            text, source = (folder / TEMPLATE_FILE).read_text(encoding="utf-8"), TEMPLATE_FILE
        except (OSError, UnicodeDecodeError) as err:
            raise InvalidCheckpointError(f"{folder / TEMPLATE_FILE} cannot be read ({err})") from None
    else:
        text, source = _config_template(folder), "tokenizer_config.json"
        if text is None:
            return None
    return ChatTemplate(source, text, special_tokens(folder), _compiled(text, folder / source))


def _config_template(folder: Path) -> str | None:
    value = _read_json(folder / "tokenizer_config.json").get("chat_template")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in value):
        named = {t["name"]: t.get("template") for t in value}
        if isinstance(named.get("default"), str):
            return named["default"]
        if "default" not in named:
            return None  # only named templates (tool_use, rag): none for plain conversations
    raise InvalidCheckpointError(f"{folder / 'tokenizer_config.json'} has a chat_template that is neither a string "
                                 "nor a list of {name, template} with a string template 'default'")


def _compiled(text: str, path: Path):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Environment(BoundedEnvironmentMixin, ImmutableSandboxedEnvironment):
        code_generator_class = bounded_code_generator()

    environment = Environment(trim_blocks=True, lstrip_blocks=True,
                              extensions=[_generation_block(), jinja2.ext.loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.filters = {name: bounded_filter(f) for name, f in environment.filters.items()}
    environment.globals.update(raise_exception=_raise_exception, strftime_now=FIXED_NOW.strftime,
                               dict=_TemplateDict(), namespace=_template_namespace())
    try:
        return environment.from_string(text)
    except jinja2.exceptions.TemplateSyntaxError as err:
        raise InvalidCheckpointError(f"the chat template in {path} is not a valid Jinja template (line {err.lineno}: "
                                     f"{err.message}); fix it, or calibrate on a text column") from None


def _generation_block():
    """The jinja2 extension for `{% generation %}` (built on call: jinja2 is imported only for chat rows)."""
    import jinja2.ext
    from jinja2 import nodes

    class GenerationBlock(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks: rendered as it is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return GenerationBlock


def _template_namespace():
    """The template's `namespace`: jinja2's, refusing underscore names."""
    import jinja2

    class TemplateNamespace(jinja2.utils.Namespace):
        # Underscore names would reach CPython's internals through a namespace's attributes.
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace.check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace.check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_': {name!r}")

    return TemplateNamespace


class _TemplateDict:
    # dict() and dict.fromkeys() without handing the template the type itself.
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' tojson: no HTML escaping, unlike jinja2's own.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def conversation(value: list, row: str) -> list[dict[str, Any]]:
    """A chat row's messages as the template takes them: plain JSON data; keys whose value is null dropped (as
    transformers drops them); ShareGPT's {"from", "value"} read as {"role", "content"}; a content of parts
    ({"type": "text", "text": ...}) read as its text parts, one per line. UsageError naming `row` for another
    shape."""
    messages = []
    for k, message in enumerate(value):
        if not isinstance(message, dict):
            raise UsageError(f"{row}: message {k} is {type(message).__name__}, not an object with role and content")
        message = {key: _plain(item) for key, item in message.items() if item is not None}
        if "role" not in message and "from" in message:
            role = SHAREGPT_ROLES.get(str(message.pop("from")).lower())
            if role is None:
                raise UsageError(f"{row}: message {k} is from {value[k]['from']!r}; ShareGPT rows are read with "
                                 f"from = {', '.join(SHAREGPT_ROLES)}")
            message = {"role": role, **({"content": message.pop("value")} if "value" in message else {}), **message}
        if not isinstance(message.get("role"), str):
            raise UsageError(f"{row}: message {k} has no string \"role\"")
        content = message.get("content")
        if isinstance(content, list):
            message["content"] = "\n".join(part["text"] for part in content
                                           if isinstance(part, dict) and part.get("type") == "text"
                                           and isinstance(part.get("text"), str))
        elif content is not None and not isinstance(content, str):
            raise UsageError(f"{row}: message {k} has a content of {type(content).__name__}, not text or parts")
        messages.append(message)
    return messages


def _plain(value: Any) -> Any:
    # What the sandbox sees is plain JSON data; anything else (bytes, dates from parquet) becomes a placeholder
    # naming its type, as transformers does, so no object's methods reach the template.
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return f"<{type(value).__name__}>"


def _aliased_reasoning(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # transformers fills reasoning_content (and gpt-oss's thinking) from any of the names reasoning comes under.
    out = []
    for message in messages:
        reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
        out.append({"thinking": reasoning, **message, "reasoning_content": reasoning} if reasoning is not None
                   else message)
    return out
