"""config.json of tiny models, without weights, for the tests that read a config alone (expected shapes, the registry)."""

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
         "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
CASES = {
    "llama": LLAMA,
    "llama-tied-head_dim": {**LLAMA, "tie_word_embeddings": True, "head_dim": 24},
    "llama-biases": {**LLAMA, "attention_bias": True, "mlp_bias": True},
    "mistral": {**LLAMA, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 32},
    "qwen2": {**LLAMA, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"},
    "mixtral": {**LLAMA, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 3,
                "num_experts_per_tok": 2},
    "bert": {"architectures": ["BertModel"], "model_type": "bert", "hidden_size": 64, "intermediate_size": 96,
             "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100, "max_position_embeddings": 40,
             "type_vocab_size": 2},
}
