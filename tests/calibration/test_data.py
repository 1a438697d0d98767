"""Calibration: text sources, token windows, layer-by-layer statistics, and the statistics file."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpoints import make_llama_checkpoint, make_tokenizer

from qconvert.calibration.documents import builtin_corpus_text
from qconvert.calibration.data import load_calibration, random_windows
from qconvert.calibrate import save_act_stats
from qconvert.calibration.observer import collect_act_stats, open_params
from qconvert.formats.act_stats import ActStats, check_stats_cover, load_act_stats
from qconvert.formats.errors import UsageError
from qconvert.models import build, dense_linear


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = make_llama_checkpoint(tmp_path_factory.mktemp("llama"), outlier_channels=(5,))
    make_tokenizer(folder, vocab_size=256)
    return folder, json.loads((folder / "config.json").read_text())


def test_stats_equal_maxima_recorded_in_a_whole_model_forward(llama):
    folder, config = llama
    model, params = build(config), open_params(folder)
    ids = random_windows(256, 5, 24, seed=3)
    stats = collect_act_stats(model, params, ids, batch_size=2)  # 3 uneven batches, layer by layer

    # Independent record: one eager forward over all samples at once, max|x| per channel.
    recorded = {}

    def recording(name, x, weight, bias):
        recorded[name] = np.abs(np.asarray(x, np.float32).reshape(-1, x.shape[-1])).max(0)
        return dense_linear(name, x, weight, bias)

    with jax.disable_jit():
        model.forward({k: np.asarray(params[k]) for k in params}, jnp.asarray(ids), linear=recording)
    assert set(stats.act_absmax) == set(recorded)  # every linear, lm_head included
    for name, expected in recorded.items():
        np.testing.assert_allclose(stats.act_absmax[name], expected, rtol=1e-4, err_msg=name)
        assert stats.act_absmax[name].dtype == np.float32
    assert stats.tokens == 5 * 24
    assert stats.tensor_absmax("model.layers.0.self_attn.q_proj") == pytest.approx(
        float(recorded["model.layers.0.self_attn.q_proj"].max()), rel=1e-4)
    # the planted outlier channel of the norm weight shows in the norm-fed inputs
    q_in = stats.act_absmax["model.layers.1.mlp.gate_proj"]
    assert q_in[5] > 10 * np.median(q_in)


def test_stats_file_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    stats = ActStats({"a.q": rng.random(8).astype(np.float32), "a.o": rng.random(4).astype(np.float32)},
                     tokens=96, calibration={"source": "random", "random": True})
    path = tmp_path / "stats.safetensors"
    save_act_stats(path, stats, model="tiny")
    back = load_act_stats(path)
    assert back.tokens == 96 and back.calibration == {"source": "random", "random": True}
    assert set(back.act_absmax) == {"a.q", "a.o"}
    for name in stats.act_absmax:
        np.testing.assert_array_equal(back.act_absmax[name], stats.act_absmax[name])
    from safetensors.numpy import load_file

    raw = load_file(str(path))
    assert raw["a.q.act_tensor_absmax"][0] == stats.act_absmax["a.q"].max()


def test_stats_file_errors(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        load_act_stats(tmp_path / "missing.safetensors")
    from safetensors.numpy import save_file

    save_file({"x": np.zeros(2, np.float32)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(UsageError, match="not a qconvert activation statistics file"):
        load_act_stats(tmp_path / "other.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 5)
    with pytest.raises(UsageError):
        load_act_stats(tmp_path / "junk.safetensors")
    stats = ActStats({"m.a": np.ones(4, np.float32)}, 1)
    with pytest.raises(UsageError, match="no statistics for m.b"):
        check_stats_cover(stats, {"m.a": 4, "m.b": 4}, "s.safetensors")
    with pytest.raises(UsageError, match="8"):
        check_stats_cover(stats, {"m.a": 8}, "s.safetensors")


def test_text_windows_carry_the_models_special_tokens(llama, tmp_path):
    folder, config = llama
    text = tmp_path / "calib.txt"
    text.write_text("the people of the word " * 200)
    data = load_calibration(str(text), folder, config, samples=3, seqlen=16)
    assert data.input_ids.shape == (3, 16) and data.input_ids.dtype == np.int32
    assert (data.input_ids[:, 0] == 1).all()  # <s> starts every window, as the tokenizer's template
    assert set(np.unique(data.input_ids[:, 1:])) <= {4, 5, 6, 7, 8, 9} | set(range(4, 256))
    assert data.record()["random"] is False and data.record()["tokens"] == 48
    import hashlib

    assert data.record()["sha256"] == hashlib.sha256(text.read_bytes()).hexdigest()


def test_jsonl_reads_the_text_field_and_rejects_bad_lines(llama, tmp_path):
    folder, config = llama
    good = tmp_path / "c.jsonl"
    good.write_text('{"text": "the word"}\n\n{"text": "of people", "id": 3}\n' * 4 + '{"text": "the word"}\n')
    data = load_calibration(str(good), folder, config, samples=12, seqlen=3)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab()
    # documents are concatenated, then cut into windows of <s> + 2 tokens
    assert data.input_ids.tolist()[:2] == [[1, vocab["the"], vocab["word"]], [1, vocab["of"], vocab["people"]]]
    assert data.samples == 9  # the text (18 tokens) ran out: fewer samples, and the record says so
    assert data.record()["requested_samples"] == 12
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(UsageError, match="line 2"):
        load_calibration(str(bad), folder, config)
    with pytest.raises(UsageError, match=".txt or .jsonl"):
        (tmp_path / "c.csv").write_text("x")
        load_calibration(str(tmp_path / "c.csv"), folder, config)


def test_random_calibration_is_reproducible_and_says_random(llama):
    folder, config = llama
    a = load_calibration("random", folder, config, samples=2, seqlen=8)
    b = load_calibration("random", folder, config, samples=2, seqlen=8)
    np.testing.assert_array_equal(a.input_ids, b.input_ids)
    assert a.input_ids.max() < 256
    assert a.record()["random"] is True and "random" in a.record()["description"]


def test_long_text_is_not_truncated_by_the_tokenizer_json():
    # all-MiniLM-L6-v2's tokenizer.json truncates to 128 tokens; calibration cuts its own windows
    from checkpoints import minilm_path

    folder = minilm_path()
    config = json.loads((folder / "config.json").read_text())
    data = load_calibration("builtin", folder, config, samples=4, seqlen=256)
    assert data.input_ids.shape == (4, 256)
    assert (data.input_ids[:, 0] == 101).all() and (data.input_ids[:, -1] == 102).all()  # [CLS] ... [SEP]
    assert not np.isin(data.input_ids[:, 1:-1], [0, 101, 102]).any()


def test_builtin_corpus_and_seqlen_cap(llama):
    folder, config = llama
    data = load_calibration("builtin", folder, config, samples=2, seqlen=1000)
    assert data.seqlen == config["max_position_embeddings"]  # 256: capped at the model's positions
    assert data.record()["requested_seqlen"] == 1000
    assert len(builtin_corpus_text()) > 5000


def test_missing_tokenizer_says_to_use_random(tmp_path):
    folder = make_llama_checkpoint(tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    with pytest.raises(UsageError, match="--calib random"):
        load_calibration("builtin", folder, config, samples=1, seqlen=8)


def test_hub_dataset_address_is_downloaded_with_huggingface_hub(llama, tmp_path, monkeypatch):
    import huggingface_hub

    folder, config = llama
    local = tmp_path / "train.jsonl"
    local.write_text('{"text": "the word of people"}\n')
    calls = []

    def fake_download(**kwargs):
        calls.append(kwargs)
        return str(local)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    data = load_calibration("hf://datasets/someone/corpus@v1/data/train.jsonl", folder, config,
                            samples=1, seqlen=4)
    assert calls == [{"repo_id": "someone/corpus", "filename": "data/train.jsonl",
                      "repo_type": "dataset", "revision": "v1"}]
    assert data.samples == 1 and data.record()["source"].startswith("hf://datasets/someone/corpus")
    with pytest.raises(UsageError, match="hf://datasets"):
        load_calibration("hf://models/x", folder, config)
