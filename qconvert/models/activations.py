"""The activation functions config.json names (`hidden_act`, `hidden_activation`), as transformers defines them."""

from __future__ import annotations

from typing import Callable

import jax

from qconvert.formats.errors import UnsupportedModelError

Activation = Callable[[jax.Array], jax.Array]

# transformers' meanings: "gelu" is the exact erf form; "gelu_new" and "gelu_pytorch_tanh"
# are the tanh approximation.
ACTIVATIONS: dict[str, Activation] = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
}


def check_activation(name: object, key: str = "hidden_act", family: str = "") -> str:
    """`name` if the table has it, else UnsupportedModelError naming the config key and what is supported."""
    if not isinstance(name, str) or name not in ACTIVATIONS:
        raise UnsupportedModelError(f"{family + ' ' if family else ''}{key} {name!r} is not supported; "
                                    "supported: " + ", ".join(ACTIVATIONS))
    return str(name)
