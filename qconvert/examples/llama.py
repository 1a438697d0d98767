"""A small trained causal LM to try the LLM path offline: a byte-level Llama, built deterministically.

`qconvert example-model --llm` trains it once on qconvert's built-in calibration text (qconvert/data/calibration.txt;
evaluation.txt, verify's held-out text, is never seen) with a fixed seed and a fixed number of steps, in about a
minute on two CPU cores, and saves it as a float Hugging Face Llama folder: config.json (LlamaForCausalLM),
model.safetensors, a byte-level tokenizer.json with its tokenizer_config.json, and generation_config.json.
example.json records the recipe and every file's sha256: a folder whose record and files agree is reused, a
damaged one rebuilt, one that holds anything else refused. The same recipe gives the same bytes on a given machine
and JAX version.

Tokens are bytes (ids 0..255) plus <s> = 256 and </s> = 257; the vocabulary is rounded up to 320. The forward is
qconvert's own Llama forward (qconvert.models), so what was trained is what qconvert converts. bench/train_llama.py
trains larger ones on other text with the same pieces.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from importlib import resources
from pathlib import Path
from typing import Callable

import numpy as np

BOS, EOS, VOCAB = 256, 257, 320  # 256 bytes, two specials, rounded up to a multiple of 64
RECORD = "example.json"
# The recipe: sizes (hidden and intermediate multiples of 128, so that int4's groups of 128 fit every linear),
# training settings and seed. Any change gives a new recipe hash, hence a new cache folder.
RECIPE = {
    "name": "tiny-llama-bytes", "hidden": 128, "layers": 4, "heads": 4, "kv_heads": 2, "intermediate": 384,
    "positions": 512, "seqlen": 128, "batch": 16, "steps": 150, "lr": 3e-3, "warmup": 20, "seed": 0,
    "text": "calibration.txt",
}
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def built_in_text(name: str) -> str:
    return resources.files("qconvert").joinpath("data", name).read_text(encoding="utf-8")


def recipe_sha256(recipe: dict = RECIPE) -> str:
    """The recipe's hash, the training text's bytes included."""
    text = built_in_text(recipe["text"]).encode("utf-8")
    blob = json.dumps(recipe, sort_keys=True).encode() + hashlib.sha256(text).digest()
    return hashlib.sha256(blob).hexdigest()


def default_folder() -> Path:
    """Where the example is kept: $XDG_CACHE_HOME/qconvert (else ~/.cache/qconvert), one folder per recipe."""
    cache = os.environ.get("XDG_CACHE_HOME", "")
    cache = Path(cache) if os.path.isabs(cache) else Path.home() / ".cache"  # a relative one is ignored (XDG)
    return cache / "qconvert" / f"{RECIPE['name']}-{recipe_sha256()[:12]}"


def config(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, positions: int) -> dict:
    """A byte-level Llama's config.json."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": hidden // heads, "vocab_size": VOCAB,
        "max_position_embeddings": positions, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
        "bos_token_id": BOS, "eos_token_id": EOS,
    }


def byte_to_unicode() -> dict[int, str]:
    """The GPT-2 byte-to-character table that the tokenizers library's ByteLevel uses."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def tokenizer_json() -> dict:
    """A byte-level tokenizer.json: every UTF-8 byte is one token (byte b is id b); <s> before each text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    mapping = byte_to_unicode()
    vocab = {mapping[b]: b for b in range(256)}
    assert set(vocab) == set(pre_tokenizers.ByteLevel.alphabet())
    vocab["<s>"], vocab["</s>"] = BOS, EOS
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    return json.loads(tok.to_str())


def tokenizer_config(positions: int) -> dict:
    """tokenizer_config.json: transformers' AutoTokenizer reads tokenizer.json as it is (no Llama-specific class)."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
            "pad_token": "</s>", "model_max_length": positions, "clean_up_tokenization_spaces": False}


def generation_config() -> dict:
    return {"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": EOS}


def init_params(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    """Scaled Gaussian weights (output projections shrunk with depth), unit norms."""
    rng = np.random.default_rng(seed)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d, kv = cfg["head_dim"], cfg["num_key_value_heads"]

    def w(out, inp, std=None):
        return (rng.standard_normal((out, inp)) * (std or inp ** -0.5)).astype(np.float32)

    p = {"model.embed_tokens.weight": w(v, h, 1.0), "model.norm.weight": np.ones(h, np.float32),
         "lm_head.weight": w(v, h)}
    depth = (2 * cfg["num_hidden_layers"]) ** -0.5
    for layer in range(cfg["num_hidden_layers"]):
        q = f"model.layers.{layer}"
        p[f"{q}.input_layernorm.weight"] = np.ones(h, np.float32)
        p[f"{q}.post_attention_layernorm.weight"] = np.ones(h, np.float32)
        p[f"{q}.self_attn.q_proj.weight"] = w(h, h)
        p[f"{q}.self_attn.k_proj.weight"] = w(kv * d, h)
        p[f"{q}.self_attn.v_proj.weight"] = w(kv * d, h)
        p[f"{q}.self_attn.o_proj.weight"] = w(h, h, depth * h ** -0.5)
        p[f"{q}.mlp.gate_proj.weight"] = w(i, h)
        p[f"{q}.mlp.up_proj.weight"] = w(i, h)
        p[f"{q}.mlp.down_proj.weight"] = w(h, i, depth * i ** -0.5)
    return p


def loss_fn(model, params, ids):
    """Next-token cross-entropy in nats per token."""
    import jax
    import jax.numpy as jnp

    logits = model.forward(params, ids[:, :-1]).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))


def adam_step(model, b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8, wd: float = 0.01):
    """One jitted AdamW step: (params, m, v, ids, t, lr) -> (params, m, v, loss)."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def step(params, m, v, ids, t, lr):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(model, p, ids))(params)
        m = jax.tree.map(lambda a, g: b1 * a + (1 - b1) * g, m, grads)
        v = jax.tree.map(lambda a, g: b2 * a + (1 - b2) * g * g, v, grads)
        corr = jnp.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        params = jax.tree.map(lambda p, a, b: p - lr * (corr * a / (jnp.sqrt(b) + eps) + wd * p * (p.ndim == 2)),
                              params, m, v)
        return params, m, v, loss

    return step


def train(recipe: dict = RECIPE, on_step: Callable[[int, float], None] | None = None
          ) -> tuple[dict, dict[str, np.ndarray], float]:
    """(config, trained float32 params, mean loss of the last 10 steps) for the recipe; the same every time."""
    import jax
    import jax.numpy as jnp

    from qconvert.models import build

    text = np.frombuffer(built_in_text(recipe["text"]).encode("utf-8"), np.uint8).astype(np.int32)
    cfg = config(recipe["hidden"], recipe["layers"], recipe["heads"], recipe["kv_heads"], recipe["intermediate"],
                 recipe["positions"])
    model = build(cfg)
    params = {k: jnp.asarray(v) for k, v in init_params(cfg, recipe["seed"]).items()}
    m = jax.tree.map(jnp.zeros_like, params)
    v = jax.tree.map(jnp.zeros_like, params)
    step = adam_step(model)
    rng = np.random.default_rng(recipe["seed"])
    seqlen, losses = recipe["seqlen"], []
    for t in range(1, recipe["steps"] + 1):
        starts = rng.integers(0, text.size - seqlen, recipe["batch"])
        ids = np.stack([np.concatenate([[BOS], text[s:s + seqlen]]) for s in starts])
        # Linear warm-up, then a cosine decay to a tenth by the last step.
        decay = 0.55 + 0.45 * np.cos(np.pi * t / recipe["steps"])
        lr = recipe["lr"] * min(1.0, t / recipe["warmup"]) * decay
        params, m, v, loss = step(params, m, v, jnp.asarray(ids), jnp.float32(t), jnp.float32(lr))
        losses.append(float(loss))
        if on_step is not None:
            on_step(t, losses[-1])
    return cfg, {k: np.asarray(val, np.float32) for k, val in params.items()}, float(np.mean(losses[-10:]))


def write_folder(folder: Path, cfg: dict, params: dict[str, np.ndarray], record: dict) -> None:
    """The Hugging Face folder and its record (every file's sha256)."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(dict(sorted(params.items())), str(folder / "model.safetensors"), metadata={"format": "pt"})
    texts = {"config.json": cfg, "generation_config.json": generation_config(), "tokenizer.json": tokenizer_json(),
             "tokenizer_config.json": tokenizer_config(cfg["max_position_embeddings"])}
    for name, value in texts.items():
        (folder / name).write_text(json.dumps(value, indent=2, sort_keys=name != "tokenizer.json") + "\n",
                                   encoding="utf-8")
    files = {name: _sha256(folder / name) for name in FILES}
    (folder / RECORD).write_text(json.dumps({**record, "files": files}, indent=2) + "\n", encoding="utf-8")
    # The modes a plain mkdir and open would give (mkdtemp's folder and safetensors' file are private).
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for name in (*FILES, RECORD):
        (folder / name).chmod(0o666 & ~umask)


def check(folder: Path, recipe: dict = RECIPE) -> str | None:
    """None when the folder holds this recipe's example, every file with its recorded sha256; else why not."""
    try:
        record = json.loads((folder / RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return f"no readable {RECORD}"
    if record.get("recipe_sha256") != recipe_sha256(recipe):
        return "built from another recipe"
    files = record.get("files")
    if not isinstance(files, dict) or set(files) != set(FILES):
        return f"{RECORD} does not list the example's files"
    for name, digest in files.items():
        if not (folder / name).is_file() or _sha256(folder / name) != digest:
            return f"{name} does not match its recorded sha256"
    return None


def ensure(folder: Path | None = None, recipe: dict = RECIPE,
           note: Callable[[str], None] | None = None) -> Path:
    """The example's folder (the cache folder by default): reused when check() passes, else built (replacing a
    damaged example; a folder that holds anything else is refused, never overwritten)."""
    from qconvert.formats.errors import UsageError

    folder = Path(folder) if folder is not None else default_folder()
    why = check(folder, recipe)
    if why is None:
        return folder
    if folder.exists():
        if not folder.is_dir():
            raise UsageError(f"{folder} is not a folder; give another --out")
        if any(folder.iterdir()) and not (folder / RECORD).is_file():
            raise UsageError(f"{folder} is not empty and holds no example model ({RECORD}); give another --out")
        if note is not None and any(folder.iterdir()):
            note(f"rebuilding {folder}: {why}")
    folder.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if note is not None:
        note(f"training the example LLM ({recipe['steps']} steps, about a minute, once) into {folder}")
    cfg, params, loss = train(recipe)
    stage = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        write_folder(stage, cfg, params, {"recipe": recipe, "recipe_sha256": recipe_sha256(recipe),
                                          "final_loss_nats_per_byte": round(loss, 4)})
        _replace(folder, stage)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    if note is not None:
        note(f"built in {time.perf_counter() - started:.0f} s (final training loss {loss:.2f} nats/byte)")
    return folder


def _replace(folder: Path, stage: Path) -> None:
    """Move the staged folder into place; an existing (damaged or empty) one is moved aside first. Another process
    that built the same example at once may have won: its folder, if it checks, is kept."""
    old = None
    if folder.exists():
        old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
        os.replace(folder, old)
    try:
        os.replace(stage, folder)
    except OSError:
        if check(folder) is not None:
            raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
