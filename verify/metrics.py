"""Error metrics between a float reference and a quantized result: per tensor and per model.

Per tensor (one linear's outputs): SQNR in dB, relative Frobenius error, cosine
similarity, max abs error. Per model (logits): mean KL divergence of the
next-token distributions, top-1 agreement, perplexity.

The sums run in float64: a correct int8 layer sits near 40-50 dB SQNR, where the
error energy is 1e-5 of the signal's, and float32 sums over large activations
would blur the difference between a good and a slightly broken conversion.
These functions summarize; they are called once per layer, outside any jit
(the whole-model figures run as one float64 XLA program over the logits).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


def _pair(reference, test) -> tuple[np.ndarray, np.ndarray]:
    ref = np.asarray(reference, dtype=np.float64)
    out = np.asarray(test, dtype=np.float64)
    if ref.shape != out.shape:
        raise ValueError(f"shapes differ: reference {ref.shape} vs test {out.shape}")
    return ref, out


def sqnr_db(reference, test) -> float:
    """Signal-to-quantization-noise ratio 10*log10(sum(ref^2) / sum((ref - test)^2)); inf when exact."""
    ref, out = _pair(reference, test)
    if not (np.isfinite(ref).all() and np.isfinite(out).all()):
        return -math.inf  # an output with Inf/NaN carries no usable signal: the check fails, it does not crash
    peak = max(float(np.max(np.abs(ref), initial=0.0)), float(np.max(np.abs(out), initial=0.0)))
    if peak > 0.0:  # the ratio does not change; huge values (a 1e38 weight) no longer overflow the sums
        ref, out = ref / peak, out / peak
    noise = float(np.sum((ref - out) ** 2))
    signal = float(np.sum(ref**2))
    if noise == 0.0:
        return math.inf
    ratio = signal / noise
    return 10.0 * math.log10(ratio) if ratio > 0.0 else -math.inf


def relative_frobenius_error(reference, test) -> float:
    """||ref - test||_F / ||ref||_F (0 when exact; inf when the reference is all zeros and test is not)."""
    ref, out = _pair(reference, test)
    noise = float(np.linalg.norm((ref - out).ravel()))
    signal = float(np.linalg.norm(ref.ravel()))
    if noise == 0.0:
        return 0.0
    return noise / signal if signal > 0.0 else math.inf


def cosine_similarity(reference, test) -> float:
    """Cosine of the angle between the flattened tensors (1 when both are all zeros)."""
    ref, out = _pair(reference, test)
    ref, out = ref.ravel(), out.ravel()
    norms = float(np.linalg.norm(ref)) * float(np.linalg.norm(out))
    if norms == 0.0:
        return 1.0 if not ref.any() and not out.any() else 0.0
    return float(np.dot(ref, out)) / norms


def max_abs_error(reference, test) -> float:
    """The largest |ref - test| over all elements."""
    ref, out = _pair(reference, test)
    return float(np.max(np.abs(ref - out))) if ref.size else 0.0


@dataclasses.dataclass(frozen=True)
class TensorMetrics:
    """How far one quantized output lies from its float reference."""

    sqnr_db: float
    rel_error: float
    cosine: float
    max_abs_error: float

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def tensor_metrics(reference, test) -> TensorMetrics:
    """All four per-tensor metrics of `test` against `reference`.

    The same formulas as the four functions above, from one float64 copy of each
    side and four sums of products (verify calls this twice per linear, on outputs
    of up to [tokens, out]); a side with Inf/NaN, or values so large or small
    that the squares leave float64's range, takes the functions themselves.
    """
    ref, out = _pair(reference, test)
    ref, out = ref.ravel(), out.ravel()
    peak = max(float(np.max(np.abs(ref), initial=0.0)), float(np.max(np.abs(out), initial=0.0)))
    # np.max carries a NaN through, so a finite peak means both sides are finite.
    if not (math.isfinite(peak) and (peak == 0.0 or 1e-100 < peak < 1e100)):
        return TensorMetrics(sqnr_db(ref, out), relative_frobenius_error(ref, out), cosine_similarity(ref, out),
                             max_abs_error(ref, out))
    diff = ref - out
    # einsum's own loop, not BLAS: a threaded ddot stalls for milliseconds on a busy host.
    noise, signal = float(np.einsum("i,i->", diff, diff)), float(np.einsum("i,i->", ref, ref))
    test_energy, cross = float(np.einsum("i,i->", out, out)), float(np.einsum("i,i->", ref, out))
    if noise == 0.0:
        sqnr, rel = math.inf, 0.0
    else:
        sqnr = 10.0 * math.log10(signal / noise) if signal > 0.0 else -math.inf
        rel = math.sqrt(noise) / math.sqrt(signal) if signal > 0.0 else math.inf
    norms = math.sqrt(signal) * math.sqrt(test_energy)
    if norms == 0.0:
        cosine = 1.0 if signal == 0.0 and test_energy == 0.0 else 0.0
    else:
        cosine = cross / norms
    return TensorMetrics(sqnr_db=sqnr, rel_error=rel, cosine=cosine,
                         max_abs_error=float(np.max(np.abs(diff))) if diff.size else 0.0)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _positions(mask, shape: tuple[int, ...]) -> np.ndarray:
    """Boolean [B, T] of the positions that count (all of them without a mask)."""
    if mask is None:
        return np.ones(shape, dtype=bool)
    mask = np.asarray(mask).astype(bool)
    if mask.shape != shape:
        raise ValueError(f"mask shape {mask.shape} does not match logits {shape}")
    return mask


def mean_kl_divergence(reference_logits, test_logits, mask=None) -> float:
    """Mean over positions of KL(P_ref || P_test) of the softmax distributions, in nats.

    `mask` [B, T] (1 = a real token) selects the positions that count.
    """
    ref, out = _pair(reference_logits, test_logits)
    log_p, log_q = _log_softmax(ref), _log_softmax(out)
    kl = np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)
    keep = _positions(mask, kl.shape)
    return float(kl[keep].mean()) if keep.any() else 0.0


def top1_agreement(reference_logits, test_logits, mask=None) -> float:
    """Fraction of positions where both logits pick the same arg-max token."""
    ref, out = _pair(reference_logits, test_logits)
    same = ref.argmax(axis=-1) == out.argmax(axis=-1)
    keep = _positions(mask, same.shape)
    return float(same[keep].mean()) if keep.any() else 1.0


@jax.jit
def _causal_lm_positions(reference_logits, test_logits, next_ids):
    """Per position, in float64: KL(P_ref || P_test), whether the arg-maxes agree, and each side's -log p(next)."""
    log_p = jax.nn.log_softmax(reference_logits.astype(jnp.float64), axis=-1)
    log_q = jax.nn.log_softmax(test_logits.astype(jnp.float64), axis=-1)
    kl = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)
    same = jnp.argmax(reference_logits, axis=-1) == jnp.argmax(test_logits, axis=-1)

    def nll(log_probs):
        return -jnp.take_along_axis(log_probs[:, :-1], next_ids[..., None], axis=-1)[..., 0]

    return kl, same, nll(log_p), nll(log_q)


def causal_lm_figures(reference_logits, test_logits, input_ids, mask=None) -> dict[str, float]:
    """mean_kl, top1_agreement and both perplexities, as the functions here define them, in one pass.

    The same float64 formulas, fused by XLA (a real vocabulary's logits are
    hundreds of MB in float64, and numpy would pass over them a dozen times).
    """
    ref, out = np.asarray(reference_logits), np.asarray(test_logits)
    ids = np.asarray(input_ids)
    if ref.shape != out.shape:
        raise ValueError(f"shapes differ: reference {ref.shape} vs test {out.shape}")
    if ref.shape[:2] != ids.shape:
        raise ValueError(f"logits {ref.shape} do not match input_ids {ids.shape}")
    if ids.shape[1] < 2:
        raise ValueError("perplexity needs sequences of at least 2 tokens")
    keep = _positions(mask, ids.shape)
    pairs = keep[:, :-1] & keep[:, 1:]
    if not pairs.any():
        raise ValueError("perplexity needs at least one pair of consecutive real tokens")
    with jax.enable_x64(True):
        kl, same, nll_ref, nll_test = (np.asarray(a) for a in _causal_lm_positions(
            ref, out, jnp.asarray(ids[:, 1:], jnp.int32)))
    # The ratio is taken in log space: with very large logits both perplexities overflow to inf, and
    # inf / inf would be nan where the two models may well agree.
    log_ppl_ref, log_ppl_test = float(nll_ref[pairs].mean()), float(nll_test[pairs].mean())
    return {"mean_kl": float(kl[keep].mean()), "top1_agreement": float(same[keep].mean()),
            "perplexity_float": _exp(log_ppl_ref), "perplexity_quantized": _exp(log_ppl_test),
            "perplexity_ratio": _exp(log_ppl_test - log_ppl_ref)}


def _exp(log_value: float) -> float:
    """exp without overflow warnings: inf past float64's range."""
    return math.exp(log_value) if log_value < 709.0 else math.inf


def perplexity(logits, input_ids, mask=None) -> float:
    """exp(mean negative log-likelihood) of each next token given the logits at the position before.

    logits [B, T, V] predict token t+1 at position t; with a mask, a prediction
    counts only when both positions are real tokens.
    """
    logits = np.asarray(logits, dtype=np.float64)
    ids = np.asarray(input_ids)
    if logits.shape[:2] != ids.shape:
        raise ValueError(f"logits {logits.shape} do not match input_ids {ids.shape}")
    if ids.shape[1] < 2:
        raise ValueError("perplexity needs sequences of at least 2 tokens")
    log_probs = _log_softmax(logits[:, :-1])
    targets = ids[:, 1:]
    nll = -np.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    keep = _positions(mask, ids.shape)
    keep = keep[:, :-1] & keep[:, 1:]
    if not keep.any():
        raise ValueError("perplexity needs at least one pair of consecutive real tokens")
    return _exp(float(nll[keep].mean()))
