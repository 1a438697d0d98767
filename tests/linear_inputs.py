"""Random linears with the inputs a trained LLM's have (correlated channels, a few large ones), for the GPTQ tests."""

import numpy as np


def input_mixing(rng, cols):
    """A matrix that makes activations correlated across channels, with a few large channels (as a trained
    LLM's are)."""
    mix = rng.standard_normal((cols, cols)) / np.sqrt(cols) + np.eye(cols)
    mix[:, rng.choice(cols, 8, replace=False)] *= 8.0
    return mix


def linear(rng, out_f, in_f, rows=None):
    """A weight, its calibration inputs, and held-out inputs drawn afresh from the same distribution."""
    w = (rng.standard_normal((out_f, in_f)) * 0.02).astype(np.float32)
    mix = input_mixing(rng, in_f)
    rows = rows or 2 * in_f
    x, held_out = ((rng.standard_normal((rows, in_f)) @ mix).astype(np.float32) for _ in range(2))
    return w, x, held_out
