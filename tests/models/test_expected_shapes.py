"""Each family's expected_shapes() against the tensors transformers builds from the same config.json."""

import pytest
import torch  # noqa: F401  (transformers' models need it)

from model_configs import CASES, LLAMA
from qconvert.formats.errors import InvalidCheckpointError
from qconvert.models import build


def transformers_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of the transformers model (BertModel without its pooler, which no forward of
    ours reads; a tied lm_head is the embedding)."""
    import transformers

    hf_config = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    if config["model_type"] == "bert":
        model = transformers.BertModel(hf_config, add_pooling_layer=False)
    else:
        model = getattr(transformers, config["architectures"][0])(hf_config)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=True)}
    return _checkpoint_names(shapes) if config["model_type"] == "mixtral" else shapes


def _checkpoint_names(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """transformers 5 fuses Mixtral's experts in memory (mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]);
    Mixtral checkpoints store them per expert (block_sparse_moe.experts.{e}.w1/w3 [I, H], w2 [H, I])."""
    out = {}
    for name, shape in shapes.items():
        layer, _, rest = name.partition(".mlp.")
        if not rest:
            out[name] = shape
        elif rest == "gate.weight":
            out[f"{layer}.block_sparse_moe.gate.weight"] = shape
        elif rest == "experts.gate_up_proj":
            for e in range(shape[0]):
                for w in ("w1", "w3"):
                    out[f"{layer}.block_sparse_moe.experts.{e}.{w}.weight"] = (shape[1] // 2, shape[2])
        elif rest == "experts.down_proj":
            for e in range(shape[0]):
                out[f"{layer}.block_sparse_moe.experts.{e}.w2.weight"] = shape[1:]
        else:
            raise AssertionError(f"unexpected Mixtral parameter {name}")
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_expected_shapes_are_what_transformers_builds(name):
    config = CASES[name]
    ours = build(config).expected_shapes()
    theirs = transformers_shapes(config)
    assert ours == theirs


@pytest.mark.parametrize("changes,words", [
    ({"num_hidden_layers": "two"}, "num_hidden_layers is 'two'"),
    ({"hidden_size": 64.5}, "hidden_size is 64.5"),
    ({"num_attention_heads": True}, "num_attention_heads is True"),
    ({"num_attention_heads": 0}, "num_attention_heads is 0; it must be at least 1"),
    ({"num_key_value_heads": 3}, "num_key_value_heads = 3 does not divide num_attention_heads = 4"),
    ({"num_attention_heads": 6, "num_key_value_heads": 2}, "num_attention_heads = 6 does not divide hidden_size = 64"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings is 'yes'; it must be true or false"),
    ({"rms_norm_eps": "small"}, "rms_norm_eps is 'small'"),
    ({"vocab_size": None}, "config.json has no vocab_size"),
])
def test_config_values_of_the_wrong_type_name_the_key(changes, words):
    config = {k: v for k, v in {**LLAMA, **changes}.items() if v is not None}
    with pytest.raises(InvalidCheckpointError, match=words.replace("(", r"\(").replace(")", r"\)")):
        build(config)


def test_mixtral_and_bert_keys_are_checked_too():
    with pytest.raises(InvalidCheckpointError, match="num_experts_per_tok = 4 exceeds num_local_experts = 3"):
        build(CASES["mixtral"] | {"num_experts_per_tok": 4})
    with pytest.raises(InvalidCheckpointError, match="num_attention_heads = 5 does not divide hidden_size = 64"):
        build(CASES["bert"] | {"num_attention_heads": 5})
