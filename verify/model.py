"""Whole-model verification: every quantized linear through the kernels vs the float model.

Causal LMs compare next-token distributions (mean KL, top-1 agreement) and the
perplexity of both models on the evaluation tokens; encoders compare the
mean-pooled last hidden states (the sentence embedding of all-MiniLM-L6-v2)
by cosine similarity, sequence by sequence.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from qconvert.formats import QArray
from qconvert.calibration.layers import forward_layerwise
from qconvert.models.hooks import dense_grouped_linear, dense_linear
from qconvert.verify import metrics
from qconvert.verify.kernel_path import KernelPath
from qconvert.verify.results import ModelResult
from qconvert.verify.thresholds import Thresholds, check


def kernel_linear_hook(kernels: KernelPath):
    """A models linear hook: QArray weights through the folder's kernels, float weights through dense_linear."""

    def linear(name, x, weight, bias):
        if not isinstance(weight, QArray):
            return dense_linear(name, x, weight, bias)
        y, _ = kernels.linear(name, x.reshape(-1, x.shape[-1]), weight, bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    return linear


def kernel_grouped_hook(kernels: KernelPath):
    """A models grouped hook: experts with QArray weights through grouped_matmul, float ones as before."""

    def grouped_linear(names, x, weights, group_sizes):
        if not all(isinstance(w, QArray) for w in weights):
            return dense_grouped_linear(names, x, weights, group_sizes)
        return kernels.grouped(names, x, weights, group_sizes)

    return grouped_linear


def mean_pool(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Mean over the real tokens of each sequence: [B, T, H] -> [B, H]."""
    m = np.asarray(mask, dtype=np.float64)[..., None]
    return (np.asarray(hidden, dtype=np.float64) * m).sum(1) / np.maximum(m.sum(1), 1.0)


def compare_causal_lm(float_logits, quant_logits, input_ids, mask, thresholds: Thresholds) -> ModelResult:
    """KL, top-1 agreement and perplexities of quantized against float logits."""
    figures = metrics.causal_lm_figures(float_logits, quant_logits, input_ids, mask)
    checks = (
        check("mean_kl", "model", figures["mean_kl"], thresholds.max_mean_kl, "max"),
        check("top1_agreement", "model", figures["top1_agreement"], thresholds.min_top1_agreement, "min"),
        check("perplexity_ratio", "model", figures["perplexity_ratio"], thresholds.max_perplexity_ratio, "max"),
    )
    mask = np.asarray(mask)
    return ModelResult("causal_lm", int(mask.shape[0]), int(mask.sum()), figures, checks)


def compare_encoder(float_hidden, quant_hidden, mask, thresholds: Thresholds) -> ModelResult:
    """Cosine similarity of the mean-pooled outputs, per sequence (mean and min reported; the mean checked).

    The mean estimates what one sentence's embedding loses, whatever the number of sequences; the minimum of n
    sequences falls as n grows (more draws, a lower least one), so a floor on it failed correct conversions as the
    evaluation grew (all-MiniLM-L6-v2 in nf4: min 0.972 over 2 sequences, 0.946 over 8, mean 0.960 and 0.962).
    """
    a, b = mean_pool(float_hidden, mask), mean_pool(quant_hidden, mask)
    cosines = [metrics.cosine_similarity(a[i], b[i]) for i in range(a.shape[0])]
    figures = {
        "pooled_cosine_mean": float(np.mean(cosines)),
        "pooled_cosine_min": float(np.min(cosines)),
        "last_hidden_sqnr_db": metrics.sqnr_db(float_hidden, quant_hidden),
    }
    checks = (check("pooled_cosine_mean", "model", figures["pooled_cosine_mean"],
                    thresholds.min_pooled_cosine, "min"),)
    mask = np.asarray(mask)
    return ModelResult("encoder", int(mask.shape[0]), int(mask.sum()), figures, checks)


def verify_model(model, reference: Mapping, converted: Mapping, input_ids, attention_mask,
                 kernels: KernelPath, thresholds: Thresholds, *,
                 causal_lm: bool, batch_size: int | None = None,
                 float_output=None, jit: bool = False, on_layer=None, kv_cache=None) -> ModelResult:
    """Run the float and the kernel-backed model on the same tokens and compare their outputs.

    `float_output` may hand in the float model's output when the caller already
    has it (the per-layer pass computes the same forward). Layers run eagerly
    by default so the kernels compiled by the per-layer pass are reused. `kv_cache` (a models.hooks KV tap)
    rounds the converted model's keys and values as its KV cache stores them.
    """
    mask = np.ones(np.shape(input_ids), np.int32) if attention_mask is None else np.asarray(attention_mask)
    if float_output is None:
        float_output = forward_layerwise(model, reference, input_ids, mask, batch_size=batch_size, jit=jit)
    quant_output = forward_layerwise(model, converted, input_ids, mask, batch_size=batch_size,
                                     linear=kernel_linear_hook(kernels),
                                     grouped_linear=kernel_grouped_hook(kernels), jit=jit,
                                     on_layer=on_layer, kv_cache=kv_cache)
    float_output, quant_output = np.asarray(float_output), np.asarray(quant_output)
    if causal_lm:
        return compare_causal_lm(float_output, quant_output, np.asarray(input_ids), mask, thresholds)
    return compare_encoder(float_output, quant_output, mask, thresholds)
