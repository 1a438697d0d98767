"""formats.jsonfile.read_config, the one reader of a folder's config.json: its refusals are one line, in the caller's words."""

import json

import pytest

from qconvert.formats.errors import InvalidCheckpointError
from qconvert.formats.jsonfile import read_config


def test_read_config_returns_the_object(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 576}))
    assert read_config(tmp_path) == {"model_type": "llama", "hidden_size": 576}


def test_a_missing_config_is_refused_with_the_callers_remedy_or_is_empty_when_optional(tmp_path):
    with pytest.raises(InvalidCheckpointError, match=r"config\.json is missing; pass the output folder$") as err:
        read_config(tmp_path, missing="pass the output folder")
    assert err.value.exit_code == 6
    (tmp_path / "config.json").mkdir()  # a folder of that name is no config.json either
    with pytest.raises(InvalidCheckpointError, match="is missing; a Hugging Face checkpoint folder needs"):
        read_config(tmp_path)
    assert read_config(tmp_path, missing=None) == {}


@pytest.mark.parametrize("text, what", [("{\"architectures\": [", "is not valid JSON"),
                                        (b"\xff\xfe", "is not valid JSON"),
                                        ("[1, 2]", "must hold a JSON object")])
def test_a_broken_config_is_one_line_naming_the_file(tmp_path, text, what):
    path = tmp_path / "config.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(InvalidCheckpointError) as err:
        read_config(tmp_path, missing=None, broken="fix or remove it")
    message = str(err.value)
    assert message.startswith(f"{path} {what}") and message.endswith("; fix or remove it") and "\n" not in message
